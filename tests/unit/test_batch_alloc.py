"""Batch allocation: one search for a batch of equal pages, each page freed on its own."""

from __future__ import annotations

from maru.common.extents import ExtentAllocator


def test_allocate_run_gives_adjacent_extents_freed_one_by_one():
    alloc = ExtentAllocator(100)
    assert alloc.allocate(3) == 0
    starts = alloc.allocate_run(4, 5)
    assert starts == [3, 7, 11, 15, 19]
    assert alloc.used == 23
    for s in (7, 15, 3):
        assert alloc.free_extent(s) == 4
    assert alloc.used == 11
    assert alloc.allocate(4) == 3  # first fit reuses a freed page of the run
    for s in (11, 19, 3, 0):
        alloc.free_extent(s)
    assert alloc.used == 0 and alloc.free_extents == 1  # everything coalesced again


def test_allocate_run_that_does_not_fit_changes_nothing():
    alloc = ExtentAllocator(10)
    assert alloc.allocate_run(3, 4) is None
    assert alloc.used == 0
    assert alloc.allocate_run(2, 5) == [0, 2, 4, 6, 8]
    assert alloc.allocate(1) is None


def test_handler_alloc_takes_one_run_and_a_value_at_a_time_after(maru_server):
    from maru import MaruHandler

    with MaruHandler(
        server_url=maru_server.url, pool_size="4M", chunk_size_bytes="64K", auto_expand=False
    ) as h:
        run = h.alloc(65536, 8)
        assert run.count == 8 and run.offset == 0 and run.stride == 65536
        handles = run.split()
        assert [x.offset for x in handles] == [i * 65536 for i in range(8)]
        assert [x.page_index for x in handles] == list(range(8))
        h.free(handles[3])
        one, two = h.alloc(100), h.alloc(70000)  # first fit
        assert one.offset == 3 * 65536 and two.length == 2 * 65536
        assert h.alloc(65536, 64) is None  # 64 chunks: no run left, and a run never evicts
        singles = [h.alloc(65536) for _ in range(64)]
        assert sum(x is not None for x in singles) == 64 - 8 - 2
