"""Batch allocation: one search for a batch of equal pages, each page freed on its own."""

from __future__ import annotations

import random

import numpy as np
import pytest

from maru.client.runs import RunAllocator
from maru.common.extents import ExtentAllocator


def test_allocate_run_gives_adjacent_extents_freed_one_by_one():
    alloc = RunAllocator(100)
    assert alloc.allocate(3) == 0
    starts = alloc.allocate_run(4, 5)
    assert list(starts) == [3, 7, 11, 15, 19]
    assert alloc.used == 23
    for s in (7, 15, 3):
        assert alloc.free_extent(s) == 4
    assert alloc.used == 11
    assert alloc.allocate(4) == 3  # first fit reuses a freed page of the run
    for s in (11, 19, 3, 0):
        alloc.free_extent(s)
    assert alloc.used == 0 and alloc.free_extents == 1  # everything coalesced again


def test_allocate_run_that_does_not_fit_changes_nothing():
    alloc = RunAllocator(10)
    assert alloc.allocate_run(3, 4) is None
    assert alloc.used == 0
    assert list(alloc.allocate_run(2, 5)) == [0, 2, 4, 6, 8]
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


def _check(alloc: RunAllocator, model: dict[int, int]) -> None:
    """The allocator against a model of its allocated extents (start -> length): the same
    extents allocated, the rest of the capacity free, the free list sorted and merged."""
    assert alloc.used == sum(model.values())
    for start in range(alloc.capacity):
        assert alloc.is_allocated(start) == (start in model), start
    spans = sorted([(s, n) for s, n in zip(alloc._starts, alloc._lengths)] + list(model.items()))
    at = 0
    for start, length in spans:  # free and allocated extents tile the capacity
        assert start == at, spans
        at += length
    assert at == alloc.capacity
    assert all(a + n < b for a, n, b in zip(alloc._starts, alloc._lengths, alloc._starts[1:]))


def test_runs_freed_in_any_pieces_match_a_model_of_single_extents():
    """Runs are one record each; freeing any of their extents (a whole run, its end and the
    next run's start, scattered ones, starts not allocated, starts given twice) leaves the
    allocator as if every extent had been allocated alone."""
    rng = random.Random(7)
    for trial in range(40):
        alloc, model = RunAllocator(256), {}
        for _ in range(60):
            op = rng.random()
            if op < 0.35:
                length, count = rng.choice([1, 2, 3, 4]), rng.randint(1, 12)
                run = alloc.allocate_run(length, count)
                if run is not None:
                    assert len(run) == count and run.step == length
                    for start in run:
                        assert all(not (s <= start < s + n) for s, n in model.items())
                        model[start] = length
            elif op < 0.45:
                length = rng.randint(1, 5)
                start = alloc.allocate(length)
                if start is not None:
                    model[start] = length
            elif model:
                held = sorted(model)
                if op < 0.6:  # a stretch of adjacent extents (runs' ends and starts)
                    i = rng.randrange(len(held))
                    picked = held[i : i + rng.randint(1, 20)]
                else:  # scattered, with strays and repeats
                    picked = rng.sample(held, rng.randint(1, len(held)))
                    picked += [rng.randrange(256) for _ in range(3)] + picked[:2]
                as_array = rng.random() < 0.5
                expect = sum(model.pop(s) for s in set(picked) if s in model)
                freed = alloc.free_many(np.array(picked, np.int64) if as_array else picked)
                assert freed == expect, (trial, picked)
            _check(alloc, model)
        alloc.free_many(list(model))
        assert alloc.used == 0 and alloc.free_extents == 1, trial


def test_free_extent_in_a_run_and_unknown_starts():
    alloc = RunAllocator(64)
    run = alloc.allocate_run(4, 8)  # [0, 32)
    assert alloc.free_extent(8) == 4
    with pytest.raises(KeyError):
        alloc.free_extent(8)  # freed already
    with pytest.raises(KeyError):
        alloc.free_extent(9)  # inside an extent, not its start
    assert not alloc.is_allocated(8) and alloc.is_allocated(12) and not alloc.is_allocated(13)
    assert alloc.free_many(run) == 28  # the rest of the run, the freed one skipped
    assert alloc.used == 0 and alloc.free_extents == 1


def test_freeing_many_at_once_leaves_what_freeing_one_by_one_leaves():
    """`free_many` (a batch of freed pages) of extents allocated alone, against
    `ExtentAllocator.free_extent` one at a time, on random allocations: the same free list,
    the same accounting; starts that begin no allocated extent (given twice, never
    allocated) are skipped."""
    rng = random.Random(7)
    for _ in range(200):
        one, many = ExtentAllocator(512), RunAllocator(512)
        starts: list[int] = []
        while True:
            n = rng.randint(1, 12)
            got = one.allocate(n)
            if got is None:
                break
            assert many.allocate(n) == got
            starts.append(got)
        batch = rng.sample(starts, rng.randint(0, len(starts)))
        for start in batch:
            one.free_extent(start)
        used = many.used
        freed = many.free_many([*batch, *batch[:3], 10_000])
        assert freed == used - many.used
        assert (many._starts, many._lengths, many.used) == (one._starts, one._lengths, one.used)
        assert many._allocated == one._allocated
        n = rng.randint(1, 40)
        assert many.allocate(n) == one.allocate(n)


def test_freeing_a_batch_of_equal_extents_leaves_what_freeing_one_by_one_leaves():
    """A full instance's usual notice: equal extents of runs (`allocate_run`), in any order,
    all of a run or some of it, with gaps; against `free_extent` one at a time: the same
    free list, accounting and extents left allocated."""
    rng = random.Random(11)
    whole = 0
    for _ in range(300):
        one, many = RunAllocator(1024), RunAllocator(1024)
        size = rng.choice([1, 2, 16])
        starts: list[int] = []
        for _ in range(rng.randint(1, 6)):
            run = one.allocate_run(size, rng.randint(1, 12))
            if run is None:
                break
            assert many.allocate_run(size, len(run)) == run
            starts += run
        first = rng.randrange(len(starts))
        batch = starts[first : first + rng.randint(1, len(starts))]  # (contiguous)
        if rng.random() < 0.5 and len(batch) > 2:
            batch.pop(rng.randrange(1, len(batch) - 1))  # (a gap)
        else:
            whole += 1
        rng.shuffle(batch)
        for start in batch:
            one.free_extent(start)
        used = many.used
        assert many.free_many(batch) == used - many.used == size * len(batch)
        assert (many._starts, many._lengths, many.used) == (one._starts, one._lengths, one.used)
        assert all(many.is_allocated(u) == one.is_allocated(u) for u in range(1024))
    assert whole > 100  # (the joined case was exercised)


def test_freeing_a_stride_leaves_what_freeing_its_extents_one_by_one_leaves():
    """`free_stride` (a notice's run of pages, `freed_runs`) on whole runs, parts of runs,
    extents allocated alone and starts nothing begins at, against `free_extent` one at a
    time: the same free list, accounting and extents left allocated."""
    rng = random.Random(13)
    fast = 0
    for _ in range(300):
        one, many = RunAllocator(1024), RunAllocator(1024)
        size = rng.choice([1, 2, 16])
        for _ in range(rng.randint(1, 6)):
            if rng.random() < 0.3:
                assert many.allocate(size) == one.allocate(size)
                continue
            run = one.allocate_run(size, rng.randint(1, 12))
            if run is None:
                break
            assert many.allocate_run(size, len(run)) == run
        if many._runs and rng.random() < 0.6:  # (a notice begins where a run does)
            first = rng.choice(sorted(many._runs))
        else:
            first = size * rng.randrange(max(1, one.used // size))
        count = rng.randint(1, 40)
        step = size if rng.random() < 0.8 else size * 2
        for start in range(first, first + step * count, step):
            if one.is_allocated(start):
                one.free_extent(start)
        used = many.used
        fast += many._runs.get(first, (0, 0))[0] == step
        assert many.free_stride(first, step, count) == used - many.used
        assert (many._starts, many._lengths, many.used) == (one._starts, one._lengths, one.used)
        assert all(many.is_allocated(u) == one.is_allocated(u) for u in range(1024))
    assert fast > 100  # (whole runs were exercised)
