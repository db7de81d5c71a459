"""`ChunkBook` against a model of every chunk (free, reserved by one reservation, sealed), driven
by seeded random walks of what a client and its server do to it: takes (runs and single values,
several sizes), slices and splits of handles, seals (`written`) of handles and pieces, `free`s
(`give_back`: all or some values, stale handles), refused seals (`give_back(sealed=True)`), the
server's `freed` notices for sealed values whose keys went away (noted, settled later), stray
notices (no value's first chunk), parking (`park_idle`, `unpark`), `give_up`, `drop` and `adopt`
(a region id owned again: a server restart), and handles kept from regions dropped since.

After every step the book must agree with the model: the same free chunks (the allocator's free
extents, the kept count `free` and `free_chunks()`), the same reserved values (each with its
reservation's serial), no chunk in two live reservations nor both free and held, and per handle
kept `seal_states` / `written` / `holds` as the model says: SEALABLE / True only while every
value of the handle is still its own reservation's. A notice frees only the sealed values it
names, in the region owned when it came: never a chunk a later reservation holds, nor one of a
region dropped and owned again under the same id. A parked or given-up region holds no reserved,
unsealed value. A threaded variant hammers one book from several threads (values written with
their own bytes, handles sealed and freed by two threads at once) and checks the same rules.
(The first rule: a hit is the bytes written under its key, or a miss.)"""

from __future__ import annotations

import contextlib
import mmap
import queue
import random
import struct
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from maru.client.chunks import GONE, REPEATED, SEALABLE, SPENT, AllocHandle, ChunkBook
from maru.client.mapping import MappedRegion
from maru.common.protocol import pack_int64
from maru.common.region import RegionHandle

CHUNK = 64
SIZES = (CHUNK // 2, CHUNK, 2 * CHUNK + 1)  # a value of 1, 1 and 3 chunks
REGION_IDS = (1, 2, 3)
REGION_CHUNKS = (8, 16, 24)
SEEDS, STEPS = 24, 600  # (about 3 s in all)


def region(region_id: int, chunks: int) -> MappedRegion:
    mm = mmap.mmap(-1, chunks * CHUNK)
    handle = RegionHandle(region_id, "anon", 0, chunks * CHUNK, "token", "me")
    return MappedRegion(handle, mm, memoryview(mm), 0, True)


def notice(entries: Sequence[tuple[int, int, int]]) -> bytes:
    """A reply's `freed`: (region id, offset, length) per page."""
    return pack_int64([f for entry in entries for f in entry])


# ---------------------------------------------------------------------------------------------
# the model


@dataclass(eq=False)
class MRegion:
    """An owned region as the model sees it; `mapped` tells it from an earlier owning of its id."""

    rid: int
    mapped: MappedRegion
    n: int
    parked: bool = False
    touched: bool = True
    # chunk -> what holds it (a Reservation or a Sealed value) and that value's first chunk;
    # a chunk not here is free
    held: dict[int, tuple[object, int]] = field(default_factory=dict)

    def free_set(self) -> set[int]:
        return set(range(self.n)) - set(self.held)

    def largest_free_run(self) -> int:
        best = run = 0
        for c in range(self.n):
            run = 0 if c in self.held else run + 1
            best = max(best, run)
        return best


@dataclass(eq=False)
class Reservation:
    region: MRegion
    serial: int
    chunks: int  # a value's
    live: set[int]  # first chunks of the values still reserved by it


@dataclass(eq=False)
class Tracked:
    """A handle the client keeps (maybe stale), and what it names."""

    handle: AllocHandle
    res: Reservation
    firsts: list[int]


@dataclass(eq=False)
class Sealed:
    """A value claimed by `written`: held until its seal is refused (`give_back(sealed=True)`)
    or the server's notice that its key went away is settled."""

    region: MRegion
    first: int
    chunks: int
    by: Tracked  # the handle that claimed it
    index: int  # its value's index in `by`
    noticed: bool = False


class Model:
    def __init__(self) -> None:
        self.owned: dict[int, MRegion] = {}
        self.sealed: list[Sealed] = []
        self.pending: list[list[Sealed]] = []  # notices noted, not settled
        # what the walk met (that the invariants were put to): notices settled after their
        # region was owned again with the chunk held, stale handles over a later reservation
        self.met = {"notice over a new owning": 0, "stale over a later reservation": 0}

    # chunk states --------------------------------------------------------------------------

    def _hold(self, r: MRegion, first: int, chunks: int, owner: object) -> None:
        for c in range(first, first + chunks):
            assert 0 <= c < r.n, f"chunk {c} outside region {r.rid} ({r.n} chunks)"
            assert c not in r.held, (
                f"chunk {c} of region {r.rid} handed out while held by {r.held[c]}"
            )
            r.held[c] = (owner, first)

    def _release(self, r: MRegion, first: int, chunks: int, owner: object) -> None:
        for c in range(first, first + chunks):
            assert r.held[c][0] is owner
            del r.held[c]

    def current(self, t: Tracked) -> MRegion | None:
        r = self.owned.get(t.handle.region_id)
        return r if r is t.res.region else None

    def free_count(self) -> int:
        return sum(r.n - len(r.held) for r in self.owned.values())

    def reserved_in(self, r: MRegion) -> bool:
        return any(isinstance(owner, Reservation) for owner, _ in r.held.values())

    # verbs ---------------------------------------------------------------------------------

    def take(self, h: AllocHandle, size: int, count: int) -> Tracked:
        r = self.owned.get(h.region_id)
        assert r is not None and h._mapped is r.mapped, "a take in a region not owned"
        assert not r.parked, f"a take in parked region {r.rid}"
        chunks = -(-size // CHUNK)
        assert (h.size, h.count, h.stride) == (size, count, chunks * CHUNK)
        assert h.offset % CHUNK == 0
        firsts = [h.offset // CHUNK + i * chunks for i in range(count)]
        res = Reservation(r, h._serial, chunks, set(firsts))
        for first in firsts:
            self._hold(r, first, chunks, res)
        r.touched = True
        return Tracked(h, res, firsts)

    def holds_all(self, t: Tracked) -> bool:
        return self.current(t) is not None and t.res.live.issuperset(t.firsts)

    def over_later(self, t: Tracked) -> bool:
        """Whether `t` is stale and a later reservation holds one of its values' chunks."""
        r = self.current(t)
        return r is not None and any(
            isinstance(r.held.get(f, (None,))[0], Reservation) and r.held[f][0] is not t.res
            for f in t.firsts
        )

    def seal_states(self, ts: Sequence[Tracked | None]) -> list[int]:
        out, claimed = [], set()
        for t in ts:
            if t is None or self.current(t) is None:
                out.append(GONE)
            elif not self.holds_all(t):
                out.append(SPENT)
            else:
                values = {(id(t.res), f) for f in t.firsts}
                if len(ts) > 1 and not claimed.isdisjoint(values):
                    out.append(REPEATED)
                else:
                    out.append(SEALABLE)
                    claimed |= values
        return out

    def written(self, ts: Sequence[Tracked]) -> list[bool]:
        out = []
        for t in ts:
            mine = self.holds_all(t)
            if mine:
                r = t.res.region
                for i, first in enumerate(t.firsts):
                    t.res.live.discard(first)
                    self._release(r, first, t.res.chunks, t.res)
                    value = Sealed(r, first, t.res.chunks, t, i)
                    self._hold(r, first, t.res.chunks, value)
                    self.sealed.append(value)
            out.append(mine)
        return out

    def give_back(self, t: Tracked, indices: Sequence[int] | None) -> None:
        if self.current(t) is None:
            return
        for i in sorted(set(range(len(t.firsts)) if indices is None else indices)):
            first = t.firsts[i]
            if first in t.res.live:
                t.res.live.discard(first)
                self._release(t.res.region, first, t.res.chunks, t.res)

    def refused(self, values: Sequence[Sealed]) -> None:
        for s in values:
            self._release(s.region, s.first, s.chunks, s)
            self.sealed.remove(s)

    def noted(self, values: list[Sealed]) -> None:
        for s in values:
            s.noticed = True
        self.pending.append(values)

    def settled(self) -> None:
        """The book applied every notice noted: each frees its values only in the region
        object owned when it was noted (that of the value: it was owned then)."""
        for values in self.pending:
            for s in values:
                now = self.owned.get(s.region.rid)
                if now is s.region and s in self.sealed:
                    self._release(s.region, s.first, s.chunks, s)
                    self.sealed.remove(s)
                elif now is not None and s.first in now.held:
                    self.met["notice over a new owning"] += 1
        self.pending = []

    def park_idle(self) -> list[int]:
        for r in self.owned.values():
            if not r.touched and not self.reserved_in(r):
                r.parked = True
            r.touched = False
        return sorted(r.rid for r in self.owned.values() if r.parked)

    def unpark(self, rids: Sequence[int]) -> None:
        for rid in rids:
            r = self.owned.get(rid)
            if r is not None:
                r.parked, r.touched = False, True

    def drop(self, rid: int) -> None:
        r = self.owned.pop(rid, None)
        if r is not None:
            self.sealed = [s for s in self.sealed if s.region is not r]

    def adopt(self, mapped: MappedRegion, n: int) -> None:
        self.drop(mapped.handle.region_id)
        self.owned[mapped.handle.region_id] = MRegion(mapped.handle.region_id, mapped, n)


# ---------------------------------------------------------------------------------------------
# the book's state, read under its lock (white box: what the model is compared with)


def book_free_set(book: ChunkBook, rid: int) -> set[int]:
    alloc = book._owned[rid].chunks
    out: set[int] = set()
    for start, length in zip(alloc._starts, alloc._lengths):
        out.update(range(start, start + length))
    return out


def book_reserved(book: ChunkBook, rid: int) -> set[tuple[int, int]]:
    """(serial, first chunk) of every value the book holds reserved in region `rid`."""
    reserved = book._owned[rid].reserved
    out = set()
    for start, (step, count, serial) in reserved.runs.items():
        assert count > 0, f"an empty reserved run at {start}"
        out.update((serial, f) for f in range(start, start + step * count, step))
    for serial, firsts in reserved.singles.items():
        assert firsts, f"an empty set of reserved singles for serial {serial}"
        assert not out.intersection((serial, f) for f in firsts), "a value reserved twice"
        out.update((serial, f) for f in firsts)
    return out


def check(book: ChunkBook, model: Model, tracked: Sequence[Tracked]) -> None:
    """Every invariant, after a step."""
    with book._lock:
        assert set(book._owned) == set(model.owned), "owned regions"
        by_serial: dict[int, Reservation] = {}
        for rid, r in model.owned.items():
            owned = book._owned[rid]
            assert owned.mapped is r.mapped, f"region {rid}: another owning of its id"
            free = book_free_set(book, rid)
            assert free == r.free_set(), (
                f"region {rid}: free chunks {sorted(free)}, model {sorted(r.free_set())}"
            )
            assert owned.chunks.used == len(r.held) == r.n - len(free)
            model_reserved = {
                (owner.serial, first)
                for owner, first in r.held.values()
                if isinstance(owner, Reservation)
            }
            for owner, _ in r.held.values():
                if isinstance(owner, Reservation):
                    by_serial[owner.serial] = owner
            reserved = book_reserved(book, rid)
            assert reserved == model_reserved, (
                f"region {rid}: reserved {sorted(reserved)}, model {sorted(model_reserved)}"
            )
            # the book's own word: no chunk in two live reservations, nor free and reserved
            seen: dict[int, int] = {}
            for serial, first in reserved:
                for c in range(first, first + by_serial[serial].chunks):
                    assert c not in free, f"region {rid}: chunk {c} free and reserved"
                    assert seen.setdefault(c, serial) == serial, (
                        f"region {rid}: chunk {c} in reservations {seen[c]} and {serial}"
                    )
            assert owned.parked == r.parked, f"region {rid}: parked {owned.parked}"
            if owned.parked:
                assert not owned.reserved, f"parked region {rid} holds a reserved value"
    assert book.free == model.free_count(), f"kept free count {book.free}"
    assert book.parked_regions() == sorted(r.rid for r in model.owned.values() if r.parked)
    if not book._told:  # (else free_chunks() would settle: a step of its own, `count`)
        assert book.free_chunks() == model.free_count()
    for t in tracked:
        assert book.seal_states([t.handle]) == model.seal_states([t]), t.handle
        model.met["stale over a later reservation"] += model.over_later(t)
        assert book.holds(t.handle) == (model.current(t) is not None)


# ---------------------------------------------------------------------------------------------
# the walk


class Walk:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.book = ChunkBook(CHUNK)
        self.model = Model()
        self.tracked: list[Tracked] = []
        self.log: list[str] = []
        self.done: dict[str, int] = {}

    def _settle_if_book_did(self) -> None:
        if not self.book._told:
            self.model.settled()

    def _pick(self, k: int = 1) -> list[Tracked]:
        return [self.rng.choice(self.tracked) for _ in range(k)]

    def _track(self, t: Tracked) -> None:
        self.tracked.append(t)
        if len(self.tracked) > 40:  # (bounded: the oldest, mostly stale, are let go)
            del self.tracked[self.rng.randrange(20)]

    # steps -------------------------------------------------------------------------------

    def adopt(self) -> str:
        rid, n = self.rng.choice(REGION_IDS), self.rng.choice(REGION_CHUNKS)
        mapped = region(rid, n)
        self.book.adopt(mapped)
        self.model.adopt(mapped, n)
        return f"adopt({rid}, {n})"

    def take(self) -> str:
        size, count = self.rng.choice(SIZES), self.rng.choice((1, 1, 2, 3, 5))
        h = self.book.take(size, count)
        # a take settles the notices noted only when no region had room before
        self._settle_if_book_did()
        if h is None:
            chunks = -(-size // CHUNK) * count
            room = [r.rid for r in self.model.owned.values() if not r.parked]
            fits = [rid for rid in room if self.model.owned[rid].largest_free_run() >= chunks]
            assert not fits, f"take({size}, {count}) found no room; regions {fits} have it"
            return f"take({size}, {count}) -> None"
        self._track(self.model.take(h, size, count))
        return f"take({size}, {count}) -> {h} serial {h._serial}"

    def piece(self) -> str:
        t = self._pick()[0]
        if self.rng.random() < 0.3:
            for i, h in enumerate(t.handle.split()):
                self._track(Tracked(h, t.res, [t.firsts[i]]))
            return f"split {t.handle}"
        start = self.rng.randrange(len(t.firsts))
        stop = self.rng.randint(start + 1, len(t.firsts))
        h = t.handle.slice(start, stop)
        assert h._serial == t.handle._serial and h.count == stop - start
        self._track(Tracked(h, t.res, t.firsts[start:stop]))
        return f"slice {t.handle} [{start}:{stop}]"

    def written(self) -> str:
        ts = self._pick(self.rng.choice((1, 1, 2, 3)))
        expected = self.model.written(ts)
        got = self.book.written([t.handle for t in ts])
        assert got == expected, f"written {[t.handle for t in ts]}: {got}, model {expected}"
        return f"written {[t.handle for t in ts]} -> {got}"

    def seal_states(self) -> str:
        ts: list[Tracked | None] = list(self._pick(self.rng.randint(2, 5)))
        if self.rng.random() < 0.2:
            ts.insert(self.rng.randrange(len(ts) + 1), None)
        got = self.book.seal_states([None if t is None else t.handle for t in ts])
        expected = self.model.seal_states(ts)
        assert got == expected, f"seal_states: {got}, model {expected}"
        return f"seal_states -> {got}"

    def give_back(self) -> str:
        t = self._pick()[0]
        indices: list[int] | None = None
        if self.rng.random() < 0.5:
            n = len(t.firsts)
            indices = [self.rng.randrange(n) for _ in range(self.rng.randint(1, n + 1))]
        self.book.give_back(t.handle, indices)
        self.model.give_back(t, indices)
        return f"give_back {t.handle} {indices}"

    def _sealed(self) -> list[Sealed]:
        return [s for s in self.model.sealed if not s.noticed]

    def refuse(self) -> str:
        """A seal's keys not registered: its handle's refused values come back."""
        by = self.rng.choice(self._sealed()).by
        mine = [s for s in self._sealed() if s.by is by]
        if len(mine) == len(by.firsts) and self.rng.random() < 0.5:
            self.book.give_back(by.handle, sealed=True)
            values = mine
        else:
            values = self.rng.sample(mine, self.rng.randint(1, len(mine)))
            self.book.give_back(by.handle, [s.index for s in values], sealed=True)
        self.model.refused(values)
        return f"refused {by.handle} {[s.index for s in values]}"

    def freed(self) -> str:
        """The server's notice of sealed values' keys gone (some twice), maybe with strays:
        pages that are no value's first chunk (past the region, before it, inside a value of
        several chunks, or in a region not ours)."""
        sealed = self._sealed()
        values = self.rng.sample(sealed, min(len(sealed), self.rng.randint(1, 4)))
        entries = [(s.region.rid, s.first * CHUNK, s.chunks * CHUNK) for s in values]
        entries += entries[: self.rng.randint(0, len(entries))]
        for _ in range(self.rng.choice((0, 0, 1, 2))):
            r = self.rng.choice(list(self.model.owned.values()))
            inner = [
                (first + 1) * CHUNK
                for owner, first in r.held.values()
                if getattr(owner, "chunks", 1) > 1
            ]
            offset = self.rng.choice(
                [r.n * CHUNK, (r.n + 7) * CHUNK, -CHUNK, -3 * CHUNK, -(2**62), *inner]
            )
            rid = self.rng.choice((r.rid, r.rid, 99))
            entries.append((rid, offset, CHUNK))
        self.rng.shuffle(entries)
        self.book.note_freed(notice(entries))
        self.model.noted(values)
        return f"note_freed {entries}"

    def settle(self) -> str:
        if self.rng.random() < 0.5:
            self.book.settle()
            self.model.settled()
            return "settle"
        got = self.book.free_chunks()
        self.model.settled()
        assert got == self.model.free_count(), f"free_chunks {got}"
        return f"free_chunks -> {got}"

    def park(self) -> str:
        got = self.book.park_idle()
        expected = self.model.park_idle()
        assert got == expected, f"park_idle: {got}, model {expected}"
        return f"park_idle -> {got}"

    def unpark(self) -> str:
        rids = self.rng.sample((*REGION_IDS, 7), self.rng.randint(1, 2))
        self.book.unpark(rids)
        self.model.unpark(rids)
        return f"unpark {rids}"

    def give_up(self) -> str:
        nbytes = self.rng.choice((0, CHUNK, 12 * CHUNK, 40 * CHUNK, 10**6))
        out = self.book.give_up(nbytes)
        self.model.settled()  # (give_up settles first)
        total = 0
        for mapped in out:
            r = self.model.owned.get(mapped.handle.region_id)
            assert r is not None and r.mapped is mapped, "gave up a region not owned"
            assert not self.model.reserved_in(r), f"gave up region {r.rid} with a reserved value"
            total += mapped.handle.length
            self.model.drop(r.rid)
        if total < nbytes:  # (all it could: every region left holds a reserved value)
            left = [r.rid for r in self.model.owned.values() if not self.model.reserved_in(r)]
            assert not left, f"give_up({nbytes}) kept idle regions {left}"
        if nbytes <= 0:
            assert not out
        return f"give_up({nbytes}) -> {[m.handle.region_id for m in out]}"

    def drop(self) -> str:
        rid = self.rng.choice((*REGION_IDS, 7))
        self.book.drop(rid)
        self.model.drop(rid)
        return f"drop({rid})"

    def restart(self) -> str:
        """A region dropped and owned again under its id (a server restart); mostly one
        that a notice not yet settled names."""
        noticed = [s.region.rid for values in self.model.pending for s in values]
        rid = self.rng.choice(noticed or list(self.model.owned))
        self.book.drop(rid)
        self.model.drop(rid)
        n = self.rng.choice(REGION_CHUNKS)
        mapped = region(rid, n)
        self.book.adopt(mapped)
        self.model.adopt(mapped, n)
        return f"restart({rid}, {n})"

    # the walk ----------------------------------------------------------------------------

    def step(self) -> str:
        rng, model = self.rng, self.model
        steps = [(self.adopt, 0.4), (self.take, 8), (self.settle, 2), (self.park, 2)]
        steps += [(self.unpark, 2), (self.give_up, 0.3), (self.drop, 0.2), (self.restart, 0.5)]
        if not model.owned:
            steps = [(self.adopt, 1)]
        elif self.tracked:
            steps += [(self.piece, 3), (self.written, 6), (self.seal_states, 2)]
            steps += [(self.give_back, 4)]
        if self._sealed():
            steps += [(self.refuse, 1.5), (self.freed, 4)]
        verb = rng.choices([s for s, _ in steps], [w for _, w in steps])[0]
        self.done[verb.__name__] = self.done.get(verb.__name__, 0) + 1
        return verb()

    def run(self, steps: int) -> None:
        for i in range(steps):
            try:
                self.log.append(self.step())
                check(self.book, self.model, self.tracked)
            except AssertionError as exc:
                trail = "\n  ".join(self.log[-14:])
                raise AssertionError(f"step {i}: {exc}\nlast steps:\n  {trail}") from exc


def test_the_book_keeps_to_the_model_through_random_walks():
    done: dict[str, int] = {}
    met: dict[str, int] = {}
    for seed in range(SEEDS):
        walk = Walk(seed)
        try:
            walk.run(STEPS)
        except AssertionError as exc:
            raise AssertionError(f"seed {seed}, {exc}") from exc
        for verb, n in walk.done.items():
            done[verb] = done.get(verb, 0) + n
        for what, n in walk.model.met.items():
            met[what] = met.get(what, 0) + n
    # the walks reached what they are for: every verb, at depth, and the cases that matter
    assert len(done) == 14 and min(done.values()) >= SEEDS * 3, done
    assert met["notice over a new owning"] >= 10, met
    assert met["stale over a later reservation"] >= 100 * SEEDS, met


# ---------------------------------------------------------------------------------------------
# threads


def pattern(token: int, size: int) -> bytes:
    return (struct.pack("<Q", token) * (size // 8 + 1))[:size]


@contextlib.contextmanager
def fast_switching() -> Iterator[None]:
    """Threads switch every 20 us, not every 5 ms: the races below are met often."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(2e-5)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


@dataclass(eq=False)
class Written:
    """A taken handle's values and the bytes its taker wrote in each."""

    handle: AllocHandle
    tokens: list[int]
    claimed: set[int] = field(default_factory=set)  # values a `written` returned True for


def test_threads_taking_sealing_and_freeing_at_once_keep_every_value_its_own():
    """Three writers take values, write their own bytes into them, then seal (whole or in
    pieces), free (some or all) or leave a handle to be raced: sealed or freed by two threads
    at once. A server thread checks each sealed value still holds its writer's bytes, then
    frees it (its key deleted: a notice, settled by the next take that finds no room or by
    `settle`) or refuses its seal; it also parks and unparks. A checker thread, under the
    book's lock, checks that no chunk is both free and reserved, no two reservations share
    one, and no parked region holds a reserved value. At the end every chunk is free again."""
    book = ChunkBook(CHUNK)
    regions = [region(1, 96), region(2, 64)]
    for mapped in regions:
        book.adopt(mapped)
    total = 96 + 64
    errors: list[str] = []
    taken: list[Written] = []
    contested: list[Written] = []
    sealed: queue.SimpleQueue[tuple[Written, int] | None] = queue.SimpleQueue()
    tally = threading.Lock()
    counts = dict.fromkeys(("taken", "sealed", "freed", "raced", "refused", "noticed"), 0)
    counts["rounds"] = 0
    stop = threading.Event()
    tokens = iter(range(1, 1 << 40))
    chunks_of: dict[int, int] = {}  # a reservation's chunks a value, by serial

    def intact(w: Written, indices: Sequence[int]) -> bool:
        views = w.handle.views(w.handle.size)
        return all(bytes(views[i]) == pattern(w.tokens[i], w.handle.size) for i in indices)

    def claimed(w: Written, piece: AllocHandle, start: int) -> None:
        """`written` said True for `piece` (values start, ... of `w`): sealed, to be freed."""
        indices = range(start, start + piece.count)
        # claimed: no one may reserve these chunks now, so they hold our bytes
        if not intact(w, indices):
            errors.append(f"sealed {piece}: its bytes are not its writer's")
        with tally:
            if w.claimed.intersection(indices):
                errors.append(f"sealed {piece}: a value of it was sealed before")
            w.claimed.update(indices)
            counts["sealed"] += 1
        for i in indices:
            sealed.put((w, i))

    def seal(w: Written, piece: AllocHandle, start: int) -> bool:
        (mine,) = book.written([piece])
        if mine:
            claimed(w, piece, start)
        return mine

    def take(rng: random.Random, size: int, count: int) -> Written | None:
        while not stop.is_set():
            h = book.take(size, count)
            if h is None:
                book.settle()
                time.sleep(0.001)  # (the server thread frees what was sealed)
                continue
            with tally:
                w = Written(h, [next(tokens) for _ in range(count)])
                taken.append(w)
                counts["taken"] += 1
                chunks_of[h._serial] = h.stride // CHUNK
            for view, token in zip(h.views(size), w.tokens):
                view[:] = pattern(token, size)
            if not intact(w, range(count)):
                errors.append(f"taken {h}: another reservation wrote in its chunks")
            return w
        return None

    # two threads let go at once (a barrier) on one handle's values: both seal them all
    # (in opposite orders), or one seals them while the other frees the handle
    barrier = threading.Barrier(2)
    rounds: list[tuple[Written, bool] | None] = [None]

    def racer(lead: bool) -> None:
        rng = random.Random(11 + lead)
        try:
            while True:
                if lead:
                    w = take(rng, CHUNK, rng.choice((2, 4, 8)))
                    rounds[0] = None if w is None else (w, rng.random() < 0.4)
                barrier.wait(5)
                now = rounds[0]
                if now is None:
                    return
                w, one_frees = now
                pieces = w.handle.split()
                order = list(range(len(pieces)))[:: 1 if lead else -1]
                if one_frees and not lead:
                    book.give_back(w.handle)
                else:
                    mine = book.written([pieces[i] for i in order])
                    for i, ours in zip(order, mine):
                        if ours:
                            claimed(w, pieces[i], i)
                if lead:
                    counts["rounds"] += 1
                barrier.wait(5)
                if not one_frees and len(w.claimed) != len(pieces):
                    errors.append(f"raced seals of {w.handle} left values unsealed")
        except Exception as exc:
            barrier.abort()
            errors.append(f"racer {lead}: {exc!r}")

    def writer(seed: int) -> None:
        rng = random.Random(seed)
        try:
            while not stop.is_set():
                if contested and rng.random() < 0.3:  # another writer's handle, raced
                    with tally:
                        w = rng.choice(contested)
                    if rng.random() < 0.6:
                        seal(w, w.handle, 0)
                    else:
                        book.give_back(w.handle)
                    continue
                size, count = rng.choice(SIZES), rng.choice((1, 2, 4, 6))
                w = take(rng, size, count)
                if w is None:
                    return
                h = w.handle
                kind = rng.random()
                if kind < 0.35:  # sealed whole
                    if not seal(w, h, 0):
                        errors.append(f"a seal of {h}, ours alone, was refused")
                elif kind < 0.6:  # sealed in pieces, some freed first
                    freed = rng.sample(range(count), rng.randint(0, count - 1))
                    if freed:
                        book.give_back(h, freed)
                    for i in range(count):
                        if seal(w, h.slice(i, i + 1), i) == (i in freed):
                            errors.append(f"a piece {i} of {h} (freed {freed}) sealed wrongly")
                elif kind < 0.75:  # freed
                    book.give_back(h)
                    with tally:
                        counts["freed"] += 1
                    if book.written([h]) != [False]:
                        errors.append(f"a seal of {h} after its free was sent")
                else:  # left to be raced: sealed or freed by two threads
                    with tally:
                        contested.append(w)
                        counts["raced"] += 1
                        if len(contested) > 8:
                            contested.pop(0)
                    if rng.random() < 0.5:
                        seal(w, w.handle, 0)
                    else:
                        book.give_back(w.handle)
        except Exception as exc:  # (reported by the test, not lost in the thread)
            errors.append(f"writer {seed}: {exc!r}")

    def server(seed: int) -> None:
        rng = random.Random(seed)
        batch: list[tuple[Written, int]] = []
        try:
            while True:
                try:
                    item = sealed.get(timeout=0.001)
                    last = item is None
                except queue.Empty:  # (no more for now: what is in the batch goes)
                    item, last = None, False
                if item is not None:
                    batch.append(item)
                    if len(batch) < rng.randint(1, 8):
                        continue
                entries = []
                for w, i in batch:
                    if not intact(w, [i]):
                        errors.append(f"sealed value {i} of {w.handle} was overwritten")
                    h = w.handle
                    if rng.random() < 0.2:  # its key refused: its chunks come back
                        book.give_back(h, [i], sealed=True)
                        counts["refused"] += 1
                    else:  # its key deleted: the server's notice
                        entries.append((h.region_id, h.offset + i * h.stride, h.stride))
                if entries:
                    book.note_freed(notice(entries))
                    counts["noticed"] += len(entries)
                batch = []
                if rng.random() < 0.1:
                    book.settle()
                if rng.random() < 0.05:
                    book.park_idle()
                if rng.random() < 0.05:
                    book.unpark([1, 2])
                if last:
                    return
        except Exception as exc:
            errors.append(f"server: {exc!r}")

    def checker() -> None:
        try:
            while not stop.is_set():
                with book._lock:
                    for rid, owned in book._owned.items():
                        reserved = book_reserved(book, rid)
                        free = book_free_set(book, rid)
                        if owned.parked and reserved:
                            errors.append(f"parked region {rid} holds reserved values")
                        held = [
                            c
                            for serial, first in reserved
                            for c in range(first, first + chunks_of.get(serial, 1))
                        ]
                        if len(set(held)) != len(held) or free.intersection(held):
                            errors.append(f"region {rid}: a chunk reserved twice, or free")
                        if owned.chunks.used + len(free) != owned.chunks.capacity:
                            errors.append(f"region {rid}: used and free chunks disagree")
                time.sleep(0.002)
        except Exception as exc:
            errors.append(f"checker: {exc!r}")

    threads = [threading.Thread(target=writer, args=(seed,)) for seed in range(3)]
    threads.append(threading.Thread(target=checker))
    threads += [threading.Thread(target=racer, args=(lead,)) for lead in (True, False)]
    serving = threading.Thread(target=server, args=(7,))
    with fast_switching():
        serving.start()
        for thread in threads:
            thread.start()
        time.sleep(1.5)
        stop.set()
        for thread in threads:
            thread.join(10)
        sealed.put(None)
        serving.join(10)
    assert not serving.is_alive() and not any(t.is_alive() for t in threads)
    assert not errors, errors[:10]
    # whatever is still reserved comes back (a stale free frees nothing), then every chunk
    # is free: none leaked, none freed twice (a notice settled over a later reservation)
    for w in taken:
        book.give_back(w.handle)
    assert book.free_chunks() == total
    assert book.untouched()
    for rid in (1, 2):
        assert not book._owned[rid].reserved
    # (about a fifth of what a quiet 2-core machine does)
    assert counts["taken"] > 2000 and counts["sealed"] > 2000 and counts["noticed"] > 2000, counts
    assert counts["raced"] > 300 and counts["refused"] > 500 and counts["rounds"] > 300, counts
