"""ExtentAllocator: first fit, alignment, coalescing on free, reserve, accounting."""

from __future__ import annotations

import random

import pytest

from maru.common.extents import ExtentAllocator


def test_first_fit_in_address_order():
    a = ExtentAllocator(100)
    assert [a.allocate(10) for _ in range(5)] == [0, 10, 20, 30, 40]
    a.free_extent(10)  # hole [10, 20)
    a.free_extent(30)  # hole [30, 40)
    # a request that fits the first hole lands there, not in the later or larger ones
    assert a.allocate(5) == 10
    assert a.allocate(5) == 15
    # 8 does not fit anywhere before [30, 40)
    assert a.allocate(8) == 30
    # 20 does not fit in the 2 left at [38, 40): goes after 50
    assert a.allocate(20) == 50


def test_exhaustion_returns_none_and_accounting():
    a = ExtentAllocator(64)
    assert a.allocate(64) == 0
    assert a.used == 64 and a.free == 0
    assert a.allocate(1) is None
    assert a.free_extent(0) == 64
    assert a.used == 0 and a.free == 64 and a.largest_free == 64


def test_alignment_skips_and_keeps_the_padding():
    a = ExtentAllocator(1000, alignment=100)
    assert a.allocate(30) == 0
    assert a.allocate(30) == 100  # [30, 100) is padding, still free
    assert a.free_extents == 2  # [30, 100) and [130, 1000)
    assert a.used == 60
    # a small unaligned-fitting request still must be aligned, so it cannot use [30, 100)
    assert a.allocate(50) == 200
    a.free_extent(0)
    # after freeing 0, [0, 100) is free again and coalesced with the padding
    assert a.allocate(100) == 0


def test_alignment_when_nothing_aligned_fits():
    a = ExtentAllocator(250, alignment=100)
    assert a.allocate(120) == 0
    # free space is [120, 250): aligned start 200 leaves only 50
    assert a.allocate(60) is None
    assert a.allocate(50) == 200


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 1, 0), (0, 2, 1), (1, 0, 2), (1, 2, 0)])
def test_free_coalesces_with_both_neighbours(order):
    a = ExtentAllocator(30)
    starts = [a.allocate(10) for _ in range(3)]
    for i in order:
        a.free_extent(starts[i])
    assert a.free_extents == 1
    assert a.largest_free == 30
    assert a.fragmentation() == 0.0
    assert a.allocate(30) == 0


def test_fragmentation():
    a = ExtentAllocator(40)
    starts = [a.allocate(10) for _ in range(4)]
    a.free_extent(starts[0])
    a.free_extent(starts[2])
    assert a.free_extents == 2
    assert a.fragmentation() == pytest.approx(0.5)


def test_free_of_unknown_start_raises():
    a = ExtentAllocator(100)
    a.allocate(10)
    with pytest.raises(KeyError):
        a.free_extent(5)
    with pytest.raises(KeyError):
        a.free_extent(10)


def test_double_free_raises():
    a = ExtentAllocator(100)
    s = a.allocate(10)
    a.free_extent(s)
    with pytest.raises(KeyError):
        a.free_extent(s)


def test_reserve_marks_a_known_extent():
    a = ExtentAllocator(100)
    a.reserve(40, 20)
    assert a.is_allocated(40)
    assert a.used == 20
    assert a.allocate(50) is None  # free space is [0, 40) and [60, 100)
    with pytest.raises(ValueError):
        a.reserve(45, 5)  # overlaps the reserved extent
    assert a.free_extent(40) == 20


def test_reserve_then_allocate_around_it():
    a = ExtentAllocator(100)
    a.reserve(40, 20)
    assert a.allocate(40) == 0
    assert a.allocate(40) == 60
    assert a.allocate(1) is None


@pytest.mark.parametrize(("capacity", "alignment"), [(0, 1), (10, 0), (-1, 1)])
def test_bad_construction(capacity, alignment):
    with pytest.raises(ValueError):
        ExtentAllocator(capacity, alignment)


def test_bad_length():
    with pytest.raises(ValueError):
        ExtentAllocator(10).allocate(0)


def test_random_operations_never_overlap_and_fully_coalesce():
    """Model check: allocations never overlap, stay aligned, and freeing all restores one extent."""
    rng = random.Random(1234)
    a = ExtentAllocator(1 << 16, alignment=8)
    live: dict[int, int] = {}
    for _ in range(3000):
        if live and rng.random() < 0.45:
            start = rng.choice(list(live))
            assert a.free_extent(start) == live.pop(start)
        else:
            length = rng.randint(1, 2048)
            start = a.allocate(length)
            if start is None:
                assert a.largest_free < length + 8  # nothing could have held it
                continue
            assert start % 8 == 0
            assert start >= 0 and start + length <= a.capacity
            for s, n in live.items():
                assert start + length <= s or s + n <= start, "overlap"
            live[start] = length
        assert a.used == sum(live.values())
    for start in list(live):
        a.free_extent(start)
    assert a.free_extents == 1 and a.used == 0 and a.largest_free == 1 << 16
