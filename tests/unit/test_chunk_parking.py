"""The client's half of parking (`ChunkBook`): a region is parked only while nothing of it is
reserved and unsealed, and nothing is reserved in a parked region until it is unparked."""

from __future__ import annotations

import mmap

from maru.client.chunks import ChunkBook
from maru.client.mapping import MappedRegion
from maru.common.region import RegionHandle

KiB = 1 << 10
CHUNK = 64 * KiB


def region(region_id: int, chunks: int) -> MappedRegion:
    mm = mmap.mmap(-1, chunks * CHUNK)
    handle = RegionHandle(region_id, "anon", 0, chunks * CHUNK, "token", "me")
    return MappedRegion(handle, mm, memoryview(mm), 0, True)


def book(*chunks: int) -> ChunkBook:
    chunk_book = ChunkBook(CHUNK)
    for region_id, n in enumerate(chunks, start=1):
        chunk_book.adopt(region(region_id, n))
    return chunk_book


def test_a_region_parks_after_a_tick_without_takes_and_without_reserved_values():
    b = book(8)
    assert b.park_idle() == []  # adopted during this tick: not idle yet
    run = b.take(CHUNK, 3)
    assert run is not None
    assert b.park_idle() == []  # taken from during this tick
    assert b.park_idle() == []  # idle for a tick, but three values are reserved, unsealed
    b.written([run.slice(0, 2)])
    assert b.park_idle() == []  # one is still being written
    b.written([run.slice(2, 3)])
    assert b.park_idle() == [1]  # all sealed (or being sealed): parked
    assert b.take(CHUNK) is None  # nothing is reserved in a parked region...
    assert b.parked_with_room(CHUNK, 5) == [1] and b.parked_with_room(CHUNK, 6) == []
    b.unpark([1])  # ...until the server said it is still ours
    assert b.take(CHUNK) is not None
    assert b.park_idle() == []


def test_freeing_an_unsealed_value_ends_its_reservation():
    b = book(4, 4)
    first, second = b.take(CHUNK), b.take(CHUNK, 4)
    assert (first.region_id, second.region_id) == (1, 2)
    b.park_idle()
    b.give_back(first)  # `MaruHandler.free`: will not be sealed
    assert b.park_idle() == [1]  # region 2 still holds four unsealed values
    b.give_back(second, [0, 1, 2])
    assert b.park_idle() == [1]
    b.give_back(second, [3])
    assert b.park_idle() == [1, 2]
    assert b.owned_bytes() == 8 * CHUNK and b.largest_region() == 4 * CHUNK


def test_a_new_chunk_size_keeps_parked_regions_parked():
    b = book(4, 4)
    b.park_idle()
    b.take(CHUNK)  # region 1: touched, then given back
    b.give_back(b.take(CHUNK))
    assert b.park_idle() == [2]
    b.set_chunk_size(2 * CHUNK, [region(1, 4), region(2, 4)])
    assert b.parked_regions() == [2]
    assert b.take(2 * CHUNK, 2).region_id == 1  # region 2 stays closed
    assert b.take(2 * CHUNK, 1) is None
