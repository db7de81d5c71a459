"""MaruHandler against a real `maru-server`: pool exhaustion, regions growing in steps up to
pool_size, multi-page values, page reuse after deletes, pinning, close() returning regions and
the deferred free."""

from __future__ import annotations

import logging
import os

import pytest

from maru import MaruHandler

from .workers import owned_pages

KiB, MiB = 1 << 10, 1 << 20


def pool_used(h: MaruHandler) -> int:
    return h.stats()["pool"]["used"]


def region_ids(h: MaruHandler) -> set[int]:
    return {r.region_id for r in h.list_allocations(all_instances=True)}


def test_pool_exhaustion_returns_false_and_logs_the_pool(maru_server_factory, caplog):
    server = maru_server_factory(pool_size="64M")
    hog = MaruHandler(server_url=server.url, pool_size="56M", expand_size="56M")
    h = MaruHandler(server_url=server.url, pool_size="32M", expand_size="8M")
    try:
        # the hog reserves a value and never seals it: its region is never parked, so the
        # server cannot take it back
        assert hog.alloc(100) is not None
        keep = os.urandom(MiB)
        assert h.store("keep", keep) and h.pin("keep")
        assert pool_used(h) == 64 * MiB
        with caplog.at_level(logging.INFO, logger="maru"):
            assert h.store("too-big", os.urandom(9 * MiB)) is False
        assert any(server.pool_path in r.getMessage() for r in caplog.records), [
            r.getMessage() for r in caplog.records
        ]
        assert server.pool_path in server.read_log()  # the server says which pool is full
        assert not h.exists("too-big")
        info = h.retrieve("keep")
        assert info is not None and bytes(info.view) == keep  # nothing else was disturbed
        assert h.store("small", b"s" * 100)  # what fits in our region still works
        hog.close()  # the hog's 56 MiB go back to the pool ...
        assert h.store("too-big", os.urandom(9 * MiB))  # ... and now it fits
    finally:
        hog.close()
        h.close()


def test_pool_size_larger_than_the_pool_connects_and_stores(maru_server_factory, caplog):
    """pool_size is a cap, not a region taken at connect: larger than the whole pool, the
    instance still connects and stores; a value larger than the pool is refused, naming it."""
    server = maru_server_factory(pool_size="32M")
    with MaruHandler(server_url=server.url, pool_size="64M") as h:
        assert h.connected and h.owned_region_ids() == []
        value = os.urandom(MiB)
        assert h.store("fits", value)
        assert sum(r.length for r in h.list_allocations()) == 4 * MiB  # its first step
        with caplog.at_level(logging.WARNING, logger="maru"):
            assert h.store("too-big", os.urandom(40 * MiB)) is False
        assert any("larger than the whole pool" in r.getMessage() for r in caplog.records)
        info = h.retrieve("fits")  # nothing was evicted in vain
        assert info is not None and bytes(info.view) == value


def test_regions_grow_in_steps_up_to_pool_size(maru_server):
    with MaruHandler(server_url=maru_server.url, pool_size="16M", chunk_size_bytes="1M") as h:
        assert h.owned_region_ids() == []  # none taken at connect
        values = {f"v{i}": os.urandom(MiB - 7 * i) for i in range(6)}
        assert h.batch_store(list(values), list(values.values())) == [True] * 6
        # the first step (2 MiB: a sixteenth of pool_size, at least 2 MiB), then twice that
        assert [r.length for r in h.list_allocations()] == [2 * MiB, 4 * MiB]
        # a value larger than the next step gets a region of its own size, within the cap
        big = os.urandom(9 * MiB + 3)
        assert h.store("big", big)
        assert [r.length for r in h.list_allocations()] == [2 * MiB, 4 * MiB, 10 * MiB]
        for key, value in [*values.items(), ("big", big)]:
            info = h.retrieve(key)
            assert info is not None and bytes(info.view) == value
        # at the cap (16 MiB held): the next value evicts our least recently used one
        assert h.store("more", b"m" * MiB)
        assert len(h.list_allocations()) == 3
        assert h.batch_exists(["v0", "more"]) == [False, True]


def test_auto_expand_off_stays_in_its_region(maru_server, caplog):
    with MaruHandler(
        server_url=maru_server.url, pool_size="4M", chunk_size_bytes="1M", auto_expand=False
    ) as h:
        keys = [f"k{i}" for i in range(4)]
        assert h.batch_store(keys, [b"x" * MiB] * 4) == [True] * 4
        assert h.batch_pin(keys) == [True] * 4  # pinned: not evictable to make room
        with caplog.at_level(logging.WARNING, logger="maru"):
            assert h.store("k4", b"x" * 10) is False
        assert caplog.records  # and says why
        assert len(h.owned_region_ids()) == 1 and len(h.list_allocations()) == 1


def test_value_larger_than_a_chunk_takes_contiguous_pages(maru_server):
    chunk = 64 * KiB
    with MaruHandler(
        server_url=maru_server.url, pool_size="2M", chunk_size_bytes=chunk, auto_expand=False
    ) as h:
        total = 32  # one region of pool_size, taken by the first reservation
        handle = h.alloc(3 * chunk + chunk // 2)
        assert handle is not None and len(h.owned_region_ids()) == 1
        assert handle.length == 4 * chunk and handle.offset % chunk == 0
        assert len(handle.buf) == handle.size == 3 * chunk + chunk // 2  # the bytes asked for
        assert h.free_chunks() == total - 4
        payload = os.urandom(3 * chunk + chunk // 2)
        handle.buf[: len(payload)] = payload
        assert h.store("multi", handle=handle, length=len(payload))
        info = h.retrieve("multi")
        assert info is not None and info.length == len(payload)
        assert info.offset == handle.offset and info.page_index == handle.offset // chunk
        assert bytes(info.view) == payload  # across page boundaries

        # fragment the rest: 28 single pages, then delete every other one
        singles = [f"p{i}" for i in range(28)]
        assert h.batch_store(singles, [bytes([i]) * 100 for i in range(28)]) == [True] * 28
        assert h.free_chunks() == 0
        assert h.batch_delete(singles[::2]) == [True] * 14
        assert h.free_chunks() == 14  # the delete reply handed our pages back
        # 14 free pages, but no two adjacent: a 2-page value cannot be placed (the rest is
        # pinned, so nothing may be evicted to make room)
        assert h.batch_pin(["multi", *singles[1::2]]) == [True] * 15
        assert h.store("two-pages", b"t" * (chunk + 1)) is False
        assert h.store("one-page", b"o" * chunk) is True
        # freeing a neighbour makes room for the 2-page value
        assert h.unpin(singles[1]) and h.delete(singles[1])
        assert h.store("two-pages", b"t" * (chunk + 1)) is True


def test_deleted_pages_return_to_their_owner(maru_server):
    with (
        MaruHandler(server_url=maru_server.url, pool_size="4M", chunk_size_bytes="256K") as a,
        MaruHandler(server_url=maru_server.url, pool_size="2M") as b,
    ):
        assert a.batch_store(["x", "y", "z"], [b"1" * 300 * KiB, b"2" * 10, b"3" * 10])
        total = owned_pages(a)
        assert a.free_chunks() == total - 4
        assert b.batch_delete(["x", "y"]) == [True, True]  # deleted by someone else
        # any reply to `a` carries the freed locations (a local `exists` sends no request)
        assert a.retrieve("z") is not None
        assert a.free_chunks() == total - 1
        # and the freed pages are really reusable
        assert a.batch_store(["p", "q"], [b"p" * 512 * KiB, b"q" * 256 * KiB]) == [True, True]
        assert a.free_chunks() == total - 4


def test_pinned_key_cannot_be_deleted(maru_server):
    with MaruHandler(server_url=maru_server.url, pool_size="2M") as h:
        assert h.store("k", b"v" * 10)
        assert h.pin("k")
        assert h.delete("k") is False
        assert h.exists("k")
        assert h.unpin("k")
        assert h.delete("k") is True
        assert not h.exists("k")
        assert h.pin("missing") is False and h.unpin("missing") is False


def test_close_returns_regions_and_deferred_free_releases_them(maru_server):
    observer = MaruHandler(server_url=maru_server.url, pool_size="2M")  # stores nothing
    a = MaruHandler(server_url=maru_server.url, pool_size="32M", expand_size="32M")
    empty = MaruHandler(server_url=maru_server.url, pool_size="16M", expand_size="16M")
    try:
        v1, v2 = os.urandom(100 * KiB), os.urandom(3 * MiB)
        assert a.batch_store(["k1", "k2"], [v1, v2]) == [True, True]
        assert empty.store("gone", b"g") and empty.delete("gone")  # a region, now keyless
        used = pool_used(observer)
        assert used == (32 + 16) * MiB
        a_regions = set(a.owned_region_ids())
        empty_regions = set(empty.owned_region_ids())

        empty.close()  # no keys in its region: freed at once
        assert pool_used(observer) == used - 16 * MiB
        assert not empty_regions & region_ids(observer)

        a.close()  # keys in its region: returned, but freed only when the last key goes
        assert a_regions <= region_ids(observer)
        assert pool_used(observer) == used - 16 * MiB
        assert "freeing deferred" in maru_server.read_log()
        for key, value in (("k1", v1), ("k2", v2)):
            info = observer.retrieve(key)
            assert info is not None and bytes(info.view) == value
        del info

        assert observer.delete("k1")
        assert a_regions <= region_ids(observer)
        assert observer.delete("k2")  # last key: the region goes back to the pool
        assert not a_regions & region_ids(observer)
        assert pool_used(observer) == used - 48 * MiB == 0
        # and the space is reusable
        with MaruHandler(server_url=maru_server.url, pool_size="48M", expand_size="48M") as again:
            assert again.store("again", b"a") and pool_used(again) == used
    finally:
        a.close()
        empty.close()
        observer.close()


def test_chunk_size_changes_only_before_the_first_reservation(maru_server):
    """MaruStorage learns SGLang's page size after connecting: the chunk size is set then,
    on the same connection (before its first store takes a region, or with its regions cut
    again); once a chunk is reserved it cannot change (the free lists would no longer
    describe the region)."""
    with MaruHandler(server_url=maru_server.url, pool_size="2M") as h:
        assert h.get_chunk_size() == MiB and h.free_chunks() == 0 and not h.owned_region_ids()
        h.set_chunk_size("64K")
        assert h.get_chunk_size() == 64 * KiB == h.config.chunk_size_bytes
        assert h.store("k", b"v" * 100) and h.retrieve("k").page_index == 0
        assert h.free_chunks() == 31 and len(h.owned_region_ids()) == 1
        with pytest.raises(RuntimeError, match="already reserved"):
            h.set_chunk_size("128K")
        with pytest.raises(ValueError, match="chunk_size_bytes"):
            h.set_chunk_size(0)  # not a positive size: the config's own check
        assert h.get_chunk_size() == 64 * KiB
