"""`ChunkBook.free` is a kept count (adjusted on each take and free, not recounted), so the write
path can ask "is there room?" without walking the regions. A count that drifts either way is
wrong: too high and a write plans on room it has not got; too low and the client asks the server
for regions it does not need. These tests hold it to a model through every verb."""

from __future__ import annotations

import mmap
import random

import pytest

from maru.client.chunks import AllocHandle, ChunkBook
from maru.client.mapping import MappedRegion
from maru.common.protocol import pack_int64
from maru.common.region import RegionHandle

CHUNK = 4096


def packed(notices: list[tuple[int, int, int]]) -> bytes:
    """The server's notices as a reply's `freed` carries them."""
    return pack_int64([field for notice in notices for field in notice])


def region(region_id: int, chunks: int) -> MappedRegion:
    mm = mmap.mmap(-1, chunks * CHUNK)
    handle = RegionHandle(region_id, "anon", 0, chunks * CHUNK, "token", "me")
    return MappedRegion(handle, mm, memoryview(mm), 0, True)


class Model:
    """What the count must be: every chunk of every owned region, less those held by values."""

    def __init__(self) -> None:
        self.regions: dict[int, int] = {}  # region id -> chunks
        self.held: dict[tuple[int, int], int] = {}  # (region id, offset) -> chunks

    def free(self) -> int:
        return sum(self.regions.values()) - sum(self.held.values())

    def take(self, handle: AllocHandle, chunks: int) -> None:
        for i in range(handle.count):
            self.held[(handle.region_id, handle.offset + i * handle.stride)] = chunks

    def release(self, region_id: int, offset: int) -> None:
        self.held.pop((region_id, offset), None)

    def drop(self, region_id: int) -> None:
        self.regions.pop(region_id, None)
        self.held = {k: v for k, v in self.held.items() if k[0] != region_id}


@pytest.mark.parametrize("seed", range(8))
def test_the_kept_free_count_matches_the_chunks_through_every_verb(seed):
    rng = random.Random(seed)
    book, model = ChunkBook(CHUNK), Model()
    live: list[tuple[AllocHandle, list[int]]] = []  # handles and their still-held indices
    next_id = 1
    for _ in range(2000):
        verb = rng.choice(["adopt", "take", "take", "take", "give_back", "freed", "freed", "drop"])
        if verb == "adopt" or not model.regions:
            n = rng.choice([8, 16, 64])
            book.adopt(region(next_id, n))
            model.regions[next_id] = n
            next_id += 1
        elif verb == "take":
            size, count = rng.choice([CHUNK // 2, CHUNK, 3 * CHUNK]), rng.randint(1, 6)
            handle = book.take(size, count)
            if handle is not None:
                model.take(handle, -(-size // CHUNK))
                live.append((handle, list(range(count))))
        elif verb == "give_back" and live:
            handle, indices = live[rng.randrange(len(live))]
            some = rng.sample(indices, rng.randint(1, len(indices)))
            # with those given back or sealed before: a no-op (their chunks, maybe another
            # reservation's since, are not this handle's to free)
            gone = [i for i in range(handle.count) if i not in indices]
            book.give_back(handle, some + gone)
            for i in some:
                indices.remove(i)
                model.release(handle.region_id, handle.offset + i * handle.stride)
        elif verb == "freed" and live:
            # The server's notice of keys gone (values sealed: `written`), some twice. A
            # value still reserved is never in one: its chunks are not a key's.
            notice = []
            for handle, indices in rng.sample(live, min(len(live), 3)):
                for i in rng.sample(indices, rng.randint(1, len(indices))):
                    book.written([handle.slice(i, i + 1)])
                    offset = handle.offset + i * handle.stride
                    notice.append((handle.region_id, offset, handle.length))
                    indices.remove(i)
                    model.release(handle.region_id, offset)
            notice += notice[: rng.randint(0, len(notice))]
            book.apply_freed(packed(notice))
        elif verb == "drop":
            region_id = rng.choice(list(model.regions))
            book.drop(region_id)
            model.drop(region_id)
            live = [(h, i) for h, i in live if h.region_id != region_id]
        live = [(h, i) for h, i in live if i]
        assert book.free_chunks() == model.free(), verb


def test_a_notice_for_a_region_not_ours_changes_nothing():
    book = ChunkBook(CHUNK)
    book.adopt(region(1, 8))
    handle = book.take(CHUNK, 2)
    assert handle is not None and book.free_chunks() == 6
    book.apply_freed(packed([(2, 0, CHUNK), (1, 7 * CHUNK, CHUNK)]))  # another region; unheld
    assert book.free_chunks() == 6
    book.apply_freed(packed([(1, handle.offset, CHUNK)] * 2))  # the same value twice
    assert book.free_chunks() == 7


def test_notices_wait_for_a_settle_and_free_only_the_region_they_were_told_of():
    """A reply's notice is applied when the book settles (a write settles during its next
    copy; a take that finds no room settles first), not when the reply is read. It frees
    chunks only in the region object owned when it came: a region dropped and owned again
    under the same id (a server restart) keeps its chunks."""
    book = ChunkBook(CHUNK)
    book.adopt(region(1, 4))
    first = book.take(CHUNK, 4)
    assert first is not None and book.free == 0
    book.note_freed(packed([(1, first.offset, CHUNK)]))
    assert book.free == 0  # kept, not applied
    again = book.take(CHUNK, 1)  # no room: the book settles, then finds the freed chunk
    assert again is not None and again.offset == first.offset and book.free == 0
    book.note_freed(packed([(1, again.offset, CHUNK)]))
    book.settle()
    assert book.free == 1

    book.adopt(region(2, 4))
    held = book.take(CHUNK, 4)
    assert held is not None and held.region_id == 2
    book.note_freed(packed([(2, held.offset, CHUNK)]))  # told of the region owned now ...
    book.drop(2)
    book.adopt(region(2, 4))  # ... which is dropped and owned again under the same id
    taken = book.take(CHUNK, 4)
    assert taken is not None and taken.region_id == 2
    assert book.free_chunks() == 1  # the notice freed nothing in the new region
    assert book.take(CHUNK, 2) is None  # (the one free chunk is region 1's)


def test_a_malformed_notice_is_logged_and_frees_nothing(caplog):
    """A `freed` that is not packed int64 triples is dropped with a warning: its chunks stay
    taken (none can be freed twice), and the notices after it still apply."""
    book = ChunkBook(CHUNK)
    book.adopt(region(1, 4))
    handle = book.take(CHUNK, 4)
    assert handle is not None and book.free == 0
    book.note_freed(packed([(1, handle.offset, CHUNK)])[:-1])  # (a byte short)
    book.note_freed(packed([(1, handle.offset + CHUNK, CHUNK)]))
    with caplog.at_level("WARNING", logger="maru.client.handler"):
        book.settle()
    assert book.free == 1  # only the well-formed notice's chunk
    assert "malformed" in caplog.text


def test_a_notice_of_pages_outside_the_region_frees_nothing_and_fails_no_take():
    """A notice's page before its region's start (a negative offset) or past its end is no
    value's: it frees nothing, and the settle that applies it (a take that found no room, a
    free count) neither fails nor loses the pages beside it. Before: `KeyError: -1` out of
    `RunAllocator.free_many` for any page below chunk -1, raised by that take."""
    book = ChunkBook(CHUNK)
    book.adopt(region(1, 4))
    handle = book.take(CHUNK, 4)
    assert handle is not None and book.free == 0
    outside = [(1, -2 * CHUNK, CHUNK), (1, -(2**62), CHUNK), (1, 9 * CHUNK, CHUNK)]
    book.note_freed(packed([*outside, (1, handle.offset + CHUNK, CHUNK)]))
    again = book.take(CHUNK)  # no room: settles the notice first
    assert again is not None and again.offset == handle.offset + CHUNK
    book.note_freed(packed(outside))
    assert book.free_chunks() == 0
