"""The lean handler API MaruStorage uses (alloc_run, register_run / submit_register_run,
leased_addresses) against a real `maru-server`, read back by a second handler."""

from __future__ import annotations

import ctypes
import os
import time

from maru import MaruHandler
from maru.client.handler import PageRun

KiB = 1 << 10
PAGE = 64 * KiB


def write(run: PageRun, values: list[bytes]) -> None:
    for i, value in enumerate(values):
        ctypes.memmove(run.address + i * run.stride, value, len(value))


def test_run_register_and_leased_addresses(maru_server):
    values = [os.urandom(PAGE - 7) for _ in range(12)]
    keys = [f"hot/{i}" for i in range(12)]
    with (
        MaruHandler(server_url=maru_server.url, pool_size="4M", chunk_size_bytes="64K") as w,
        MaruHandler(server_url=maru_server.url, pool_size="1M", chunk_size_bytes="64K") as r,
    ):
        free = w.free_pages()
        run = w.alloc_run(PAGE - 7, 12)
        assert run is not None and run.stride == PAGE and run.count == 12
        assert w.free_pages() == free - 12
        write(run, values)
        # Two pieces, the first in flight while the second is registered.
        first = w.submit_register_run(keys[:5], run.slice(0, 5), PAGE - 7)
        assert w.register_run(keys[5:], run.slice(5, 12), PAGE - 7) == [True] * 7
        assert first() == [True] * 5
        with r.leased_addresses([*keys, "missing"]) as (addresses, lengths):
            assert lengths.tolist() == [PAGE - 7] * 12 + [0] and addresses[-1] == 0
            got = [ctypes.string_at(a, n) for a, n in zip(addresses[:-1].tolist(), lengths[:-1])]
            assert got == values
            assert w.batch_delete(keys[:1]) == [False]  # leased while the block runs
        assert r.batch_retrieve(keys[:1])[0] is not None
        assert w.batch_delete(keys) == [True] * 12
        assert w.free_pages() == free  # the deletes gave every page back


def test_register_run_existing_keys_give_their_pages_back(maru_server):
    with MaruHandler(server_url=maru_server.url, pool_size="4M", chunk_size_bytes="64K") as h:
        free = h.free_pages()
        assert h.store("dup/1", b"first")
        run = h.alloc_run(100, 3)
        write(run, [b"a" * 100, b"b" * 100, b"c" * 100])
        assert h.register_run(["dup/0", "dup/1", "dup/2"], run, 100) == [True] * 3
        assert h.free_pages() == free - 3  # dup/1's new page went back; 2 + the first store
        info = h.retrieve("dup/1")
        assert info is not None and bytes(info.view) == b"first"  # first writer won
        spare = h.alloc_run(100, 2)
        h.free_run(spare)
        assert h.free_pages() == free - 3


def test_alloc_run_none_when_no_run_fits(maru_server):
    with MaruHandler(
        server_url=maru_server.url, pool_size="2M", chunk_size_bytes="64K", auto_expand=False
    ) as h:
        assert h.alloc_run(PAGE, 33) is None  # 32 pages in the region
        run = h.alloc_run(PAGE, 32)
        assert run is not None
        h.free_run(run, [3])
        assert h.free_pages() == 1


def test_leased_addresses_is_sent_before_it_is_entered(maru_server):
    """`MaruStorage.batch_get_v1` prepares its copy while the lookup is in flight: the server
    has taken the lease by the time the caller enters, so a delete in between cannot free the
    page under the copy; leaving releases it."""
    value = os.urandom(PAGE)
    with (
        MaruHandler(server_url=maru_server.url, pool_size="4M", chunk_size_bytes="64K") as w,
        MaruHandler(server_url=maru_server.url, pool_size="1M", chunk_size_bytes="64K") as r,
    ):
        assert w.store("early/0", value)
        lookup = r.leased_addresses(["early/0", "early/missing"])
        deadline = time.monotonic() + 5
        while w.stats()["leases"] == 0:  # the lookup reached the server, unprompted
            assert time.monotonic() < deadline, "the lookup was not sent before entering"
            time.sleep(0.01)
        assert w.batch_delete(["early/0"]) == [False]  # leased
        with lookup as (addresses, lengths):
            assert lengths.tolist() == [PAGE, 0]
            assert ctypes.string_at(int(addresses[0]), PAGE) == value
        # Released on leaving (sent without waiting: a request on the same connection after
        # it is answered after it).
        assert r.batch_exists(["early/0"]) == [True]
        assert w.batch_delete(["early/0"]) == [True]
        with r.leased_addresses([]) as (addresses, lengths):
            assert len(addresses) == 0 and len(lengths) == 0
