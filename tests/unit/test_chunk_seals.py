"""`ChunkBook.seal_states`, `written` and `give_back` tell a reservation from a later one of
the same chunks (its serial, carried by the handle and its slices), and a seal names each
value once: a hit is exactly the bytes written under its key, so a handle sealed or freed
before must not seal (or free) whatever the next reservation of its chunks writes there."""

from __future__ import annotations

import mmap

from maru.client.chunks import GONE, REPEATED, SEALABLE, SPENT, ChunkBook
from maru.client.mapping import MappedRegion
from maru.common.protocol import pack_int64
from maru.common.region import RegionHandle

CHUNK = 4096


def region(region_id: int, chunks: int) -> MappedRegion:
    mm = mmap.mmap(-1, chunks * CHUNK)
    handle = RegionHandle(region_id, "anon", 0, chunks * CHUNK, "token", "me")
    return MappedRegion(handle, mm, memoryview(mm), 0, True)


def book(chunks: int = 8) -> ChunkBook:
    chunk_book = ChunkBook(CHUNK)
    chunk_book.adopt(region(1, chunks))
    return chunk_book


def test_a_freed_handle_is_spent_once_its_chunks_are_reserved_again():
    b = book(1)
    old = b.take(CHUNK)
    b.give_back(old)  # `MaruHandler.free`
    new = b.take(CHUNK)
    assert (new.region_id, new.offset) == (old.region_id, old.offset)  # the same chunk
    assert b.seal_states([old, new]) == [SPENT, SEALABLE]
    assert b.seal_states([old]) == [SPENT] and b.seal_states([new]) == [SEALABLE]
    assert b.written([old]) == [False]  # a refused seal's send: the new reservation stays
    assert b.seal_states([new]) == [SEALABLE]
    b.give_back(old)  # a second free: the new reservation's chunk stays taken
    assert b.free_chunks() == 0 and b.seal_states([new]) == [SEALABLE]
    assert b.take(CHUNK) is None


def test_a_sealed_handle_is_spent_once_its_chunks_are_freed_and_reserved_again():
    b = book(1)
    old = b.take(CHUNK)
    assert b.written([old]) == [True]  # sealed, then its key deleted: its notice frees the chunk
    b.apply_freed(pack_int64([old.region_id, old.offset, CHUNK]))
    new = b.take(CHUNK)
    assert new.offset == old.offset
    assert b.seal_states([old]) == [SPENT]
    b.give_back(old)  # free after seal: not ours any more
    assert b.seal_states([new]) == [SEALABLE] and b.free_chunks() == 0


def test_a_freed_piece_of_a_run_reserved_again_is_not_the_old_runs():
    b = book(4)
    run = b.take(CHUNK, 4)
    first, second, third, fourth = run.split()
    b.give_back(run, [1])
    again = b.take(CHUNK)
    assert again.offset == second.offset
    # the old run, and its piece, no longer hold value 1; the other pieces still do
    assert b.seal_states([run]) == [SPENT]
    assert b.seal_states([second, run.slice(0, 2), first, third, fourth, again]) == [
        SPENT,
        SPENT,
        SEALABLE,
        SEALABLE,
        SEALABLE,
        SEALABLE,
    ]
    b.give_back(run)  # frees what is still the run's (0, 2, 3), not `again`'s chunk
    assert b.free_chunks() == 3 and b.seal_states([again]) == [SEALABLE]


def test_a_value_named_twice_in_one_seal_is_sealed_once():
    b = book(8)
    one = b.take(CHUNK)
    run = b.take(CHUNK, 3)
    pieces = run.split()
    handles = [one, one, pieces[1], run.slice(0, 2), run.slice(1, 3), pieces[2], None]
    assert b.seal_states(handles) == [
        SEALABLE,
        REPEATED,  # the same handle again
        SEALABLE,
        REPEATED,  # has value 1, sealed by pieces[1]
        REPEATED,
        SEALABLE,  # value 2: the REPEATED slice before it claimed nothing
        GONE,
    ]
    # a run as a whole, then one of its values
    assert b.seal_states([run, pieces[0]]) == [SEALABLE, REPEATED]
    assert b.seal_states([pieces[0], run]) == [SEALABLE, REPEATED]
    # separate calls are not one seal (`written` makes the second SPENT)
    assert b.seal_states([one]) == [SEALABLE] and b.seal_states([one]) == [SEALABLE]


def test_written_and_given_back_slices_keep_the_runs_other_values_reserved():
    b = book(8)
    run = b.take(CHUNK, 6)
    b.written([run.slice(0, 2)])
    b.give_back(run, [5])
    assert b.seal_states([run.slice(0, 1), run.slice(2, 5), run.slice(4, 6)]) == [
        SPENT,
        SEALABLE,
        SPENT,
    ]
    assert b.free_chunks() == 3
    b.give_back(run)  # the values still reserved (2, 3, 4): not the two being sealed
    assert b.free_chunks() == 6 and not b.untouched()
    b.give_back(run, [0, 1], sealed=True)  # their keys refused: back
    assert b.free_chunks() == 8 and b.untouched()
