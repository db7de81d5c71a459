"""The object lifecycle MaruStorage uses (alloc a run, seal it piece by piece, lookup with a
lease) against a real `maru-server`, read back by a second handler."""

from __future__ import annotations

import ctypes
import os
import time

import pytest

from maru import MaruHandler
from maru.client.chunks import AllocHandle

from .workers import owned_pages

KiB = 1 << 10
PAGE = 64 * KiB


def write(run: AllocHandle, values: list[bytes]) -> None:
    for i, value in enumerate(values):
        ctypes.memmove(run.address + i * run.stride, value, len(value))


def test_a_run_sealed_in_pieces_and_read_with_a_lease(maru_server):
    values = [os.urandom(PAGE - 7) for _ in range(12)]
    keys = [f"hot/{i}" for i in range(12)]
    with (
        MaruHandler(server_url=maru_server.url, pool_size="4M", chunk_size_bytes="64K") as w,
        MaruHandler(server_url=maru_server.url, pool_size="1M", chunk_size_bytes="64K") as r,
    ):
        run = w.alloc(PAGE - 7, 12)  # takes our first region
        assert run is not None and run.stride == PAGE and run.count == 12
        free = owned_pages(w)
        assert w.free_chunks() == free - 12
        write(run, values)
        # Two pieces, the first in flight while the second is sealed.
        first = w.seal(keys[:5], run.slice(0, 5), PAGE - 7)
        assert w.seal(keys[5:], run.slice(5, 12), PAGE - 7).wait() == [True] * 7
        assert first.wait() == [True] * 5
        with r.lookup([*keys, "missing"], lease=True) as found:
            addresses, lengths = found.addresses, found.lengths
            assert lengths.tolist() == [PAGE - 7] * 12 + [0] and addresses[-1] == 0
            got = [ctypes.string_at(a, n) for a, n in zip(addresses[:-1].tolist(), lengths[:-1])]
            assert got == values
            assert w.batch_delete(keys[:1]) == [False]  # leased while the block runs
        assert r.batch_retrieve(keys[:1])[0] is not None
        assert w.batch_delete(keys) == [True] * 12
        assert w.free_chunks() == free  # the deletes gave every page back


def test_sealing_existing_keys_gives_their_chunks_back(maru_server):
    with MaruHandler(server_url=maru_server.url, pool_size="4M", chunk_size_bytes="64K") as h:
        assert h.store("dup/1", b"first")  # takes our first region
        free = owned_pages(h)
        run = h.alloc(100, 3)
        write(run, [b"a" * 100, b"b" * 100, b"c" * 100])
        assert h.seal(["dup/0", "dup/1", "dup/2"], run, 100).wait() == [True] * 3
        assert h.free_chunks() == free - 3  # dup/1's new page went back; 2 + the first store
        info = h.retrieve("dup/1")
        assert info is not None and bytes(info.view) == b"first"  # first writer won
        spare = h.alloc(100, 2)
        h.free(spare)
        assert h.free_chunks() == free - 3


def test_hoped_results_are_the_keys_sent(maru_server):
    """`Sealing.hoped()` (what write-behind reports before the reply): True for each key
    sent, False where nothing was reserved; once the reply is in, the results themselves."""
    with MaruHandler(server_url=maru_server.url, pool_size="4M", chunk_size_bytes="64K") as h:
        a, b = h.alloc(100), h.alloc(100)
        write(a, [b"a" * 100])
        write(b, [b"b" * 100])
        sealing = h.seal(["hope/0", "hope/1", "hope/2"], [a, None, b], 100)
        assert sealing.hoped() == [True, False, True]
        assert sealing.wait() == [True, False, True]
        assert h.seal(["hope/0"], [h.alloc(100)], 100).wait() == [True]  # (it existed)
        rejected = h.seal(["", "hope/3"], [h.alloc(100), h.alloc(100)], 100)
        assert rejected.hoped() == [True, True]  # sent: the server decides
        assert rejected.wait() == [False, True]
        assert rejected.hoped() == [False, True]


def test_a_prepared_seal_reaches_nobody_before_it_is_sent(maru_server):
    """`prepare_seal` (MaruStorage makes it while its copy runs) sends nothing and leaves the
    values reserved (their region cannot be parked under the copy); `send` publishes them,
    once; `wait` before `send` is an error, not a hang."""
    values = [os.urandom(PAGE) for _ in range(3)]
    keys = [f"prep/{i}" for i in range(3)]
    with (
        MaruHandler(server_url=maru_server.url, pool_size="4M", chunk_size_bytes="64K") as w,
        MaruHandler(server_url=maru_server.url, pool_size="1M", chunk_size_bytes="64K") as r,
    ):
        run = w.alloc(PAGE, 3)
        owned = w._chunks._region_of(run)
        sealing = w.prepare_seal(keys, run, PAGE)
        assert sealing.hoped() == [True] * 3
        assert not sealing.arrived()  # (write-behind's reading of replies passes it by)
        with pytest.raises(RuntimeError, match="send"):
            sealing.wait()
        assert len(owned.reserved) == 3  # still being written: not parkable
        write(run, values)
        assert r.batch_exists(keys) == [False] * 3  # nothing was sent
        assert sealing.send() is sealing
        assert not owned.reserved
        assert sealing.wait() == [True] * 3
        assert [bytes(i.view) for i in r.batch_retrieve(keys)] == values
        with pytest.raises(RuntimeError, match="already sent"):
            sealing.send()


def test_a_reservation_is_sealed_once_whichever_seal_is_sent_first(maru_server):
    """Two seals prepared for one reservation (two threads storing one LMCache memory object,
    say) each find it reserved as they are made; only the first sent may register, else the
    value's pages lie under two keys (the first evicted frees them, the other then serves
    whatever is written there next). A reservation freed under a prepared seal: the seal
    sends nothing, else its key would lie over the next reservation's bytes."""
    value, other = os.urandom(PAGE), os.urandom(PAGE)
    with (
        MaruHandler(server_url=maru_server.url, pool_size="4M", chunk_size_bytes="64K") as w,
        MaruHandler(server_url=maru_server.url, pool_size="1M", chunk_size_bytes="64K") as r,
    ):
        run = w.alloc(PAGE)
        write(run, [value])
        first = w.prepare_seal(["twice/a"], run, PAGE)
        second = w.prepare_seal(["twice/b"], run, PAGE)
        assert first.send().wait() == [True]
        assert second.send().wait() == [False]
        assert r.batch_exists(["twice/a", "twice/b"]) == [True, False]
        # handles in a list: the one sealed by the other seal first is left out, not the rest
        one, two = w.alloc(PAGE), w.alloc(PAGE)
        write(one, [value])
        write(two, [other])
        both = w.prepare_seal(["list/a", "list/b"], [one, two], PAGE)
        assert w.seal(["list/c"], [two], PAGE).wait() == [True]
        assert both.send().wait() == [True, False]
        assert r.batch_exists(["list/a", "list/b", "list/c"]) == [True, False, True]
        # freed under a prepared seal, then reserved again and written by the next value
        run = w.alloc(PAGE)
        write(run, [value])
        late = w.prepare_seal(["freed/a"], run, PAGE)
        w.free(run)
        again = w.alloc(PAGE)
        assert (again.region_id, again.offset) == (run.region_id, run.offset)
        write(again, [other])
        assert w.seal(["freed/next"], again, PAGE).wait() == [True]
        assert late.send().wait() == [False]
        assert r.batch_exists(["freed/a"]) == [False]
        assert bytes(r.retrieve("freed/next").view) == other


def test_a_run_sealed_with_a_length_past_a_values_chunks_fails_that_value_alone(maru_server):
    """A length longer than the chunks reserved for its value would register the key over
    the next value's chunks too: that key fails (a WARNING, `refused_stores["value_size"]`)
    and its chunks come back; the run's other values are sealed. Before: both registered."""
    with MaruHandler(server_url=maru_server.url, pool_size="4M", chunk_size_bytes="64K") as h:
        run = h.alloc(PAGE, 3)
        write(run, [b"a" * PAGE, b"b" * PAGE, b"c" * PAGE])
        free = h.free_chunks()
        sealing = h.seal(["fit/0", "fit/1", "fit/2"], run, [PAGE, PAGE + 1, PAGE])
        assert sealing.wait() == [True, False, True]
        assert h.free_chunks() == free + 1 and h.refused_stores["value_size"] == 1
        assert [bytes(i.view) for i in h.batch_retrieve(["fit/0", "fit/2"])] == [
            b"a" * PAGE,
            b"c" * PAGE,
        ]
        assert h.batch_exists(["fit/1"]) == [False]


def test_alloc_of_a_run_is_none_when_no_run_fits(maru_server):
    with MaruHandler(
        server_url=maru_server.url, pool_size="2M", chunk_size_bytes="64K", auto_expand=False
    ) as h:
        assert h.alloc(PAGE, 33) is None  # 32 chunks in the region
        run = h.alloc(PAGE, 32)
        assert run is not None
        h.free(run.slice(3, 4))
        assert h.free_chunks() == 1


def test_a_lookup_is_sent_before_it_is_entered(maru_server):
    """`MaruStorage.batch_get_v1` prepares its copy while the lookup is in flight: the server
    has taken the lease by the time the caller enters, so a delete in between cannot free the
    page under the copy; leaving releases it."""
    value = os.urandom(PAGE)
    with (
        MaruHandler(server_url=maru_server.url, pool_size="4M", chunk_size_bytes="64K") as w,
        MaruHandler(server_url=maru_server.url, pool_size="1M", chunk_size_bytes="64K") as r,
    ):
        assert w.store("early/0", value)
        lookup = r.lookup(["early/0", "early/missing"], lease=True)
        deadline = time.monotonic() + 5
        while w.stats()["leases"] == 0:  # the lookup reached the server, unprompted
            assert time.monotonic() < deadline, "the lookup was not sent before entering"
            time.sleep(0.01)
        assert w.batch_delete(["early/0"]) == [False]  # leased
        with lookup as found:
            addresses, lengths = found.addresses, found.lengths
            assert lengths.tolist() == [PAGE, 0]
            assert ctypes.string_at(int(addresses[0]), PAGE) == value
        # Released on leaving (sent without waiting: a request on the same connection after
        # it is answered after it).
        assert r.stats()["keys"] == 1  # (a request: the server has the release by now)
        assert w.batch_delete(["early/0"]) == [True]
        with r.lookup([], lease=True) as found:
            assert len(found.addresses) == 0 and len(found.lengths) == 0
