"""A client's chunk bookkeeping: which chunks of its own regions are free.

Each owned region is cut into chunks of `chunk_size_bytes`; a value takes a contiguous run.
Kept here so that reserving costs no request: the server learns of chunks when their keys are
sealed, and tells the owner (`freed`, on its next reply) when a key in its regions goes away.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import deque
from collections.abc import Iterable, Sequence

from maru.client.mapping import MappedRegion
from maru.client.runs import RunAllocator
from maru.common._freed import freed_runs

log = logging.getLogger("maru.client.handler")


# a handle's state for a seal (`ChunkBook.seal_states`); REPEATED: its values are an earlier
# handle's of the same call
GONE, SEALABLE, SPENT, REPEATED = 0, 1, 2, 3


class AllocHandle:
    """Reserved, unsealed chunks: `count` values of `size` bytes, value i at `address + i *
    stride` (region offset `offset + i * stride`). Write into `buf` (or at `address`), then
    `MaruHandler.seal` (a value is `size` bytes unless told otherwise) or `MaruHandler.free`.
    Its reservation's serial (`_serial`, kept by `slice`/`split`) tells it from a later one of
    the same chunks: a handle sealed or freed before is refused, not taken for the next."""

    __slots__ = (
        "_chunk",
        "_mapped",
        "_serial",
        "address",
        "count",
        "offset",
        "region_id",
        "size",
        "stride",
    )

    def __init__(
        self,
        mapped: MappedRegion,
        chunk: int,
        offset: int,
        stride: int,
        count: int,
        size: int,
        serial: int,
    ):
        self._mapped = mapped
        self._chunk = chunk
        self._serial = serial
        self.region_id = mapped.handle.region_id
        self.offset = offset
        self.address = mapped.address + offset
        self.stride = stride
        self.count = count
        self.size = size

    @property
    def length(self) -> int:
        """Bytes reserved (every value's chunks)."""
        return self.stride * self.count

    @property
    def buf(self) -> memoryview:
        """The values' bytes (first value's start to last value's end), writable, in place."""
        end = self.offset + self.stride * (self.count - 1) + self.size
        return self._mapped.view[self.offset : end]

    @property
    def region_token(self) -> str:
        """The token of the region the values were written in, as granted: a seal names it,
        so that a server that knows another region by that id refuses the seal."""
        return self._mapped.handle.token

    @property
    def page_index(self) -> int:
        """The first chunk's index in its region (LMCache's name for it)."""
        return self.offset // self._chunk

    def slice(self, start: int, stop: int) -> AllocHandle:
        """Values [start, stop) of this handle, as a handle of their own."""
        offset = self.offset + start * self.stride
        return AllocHandle(
            self._mapped, self._chunk, offset, self.stride, stop - start, self.size, self._serial
        )

    def split(self) -> list[AllocHandle]:
        """One handle per value."""
        return [self.slice(i, i + 1) for i in range(self.count)]

    def views(self, sizes: int | Sequence[int]) -> list[memoryview]:
        """Each value's first `sizes` bytes (one size for all, or one per value), in place."""
        if isinstance(sizes, int):
            sizes = [sizes] * self.count
        view, stride = self._mapped.view, self.stride
        starts = range(self.offset, self.offset + self.count * stride, stride)
        return [view[start : start + size] for start, size in zip(starts, sizes)]

    def __repr__(self) -> str:
        return (
            f"AllocHandle(region={self.region_id}, offset={self.offset}, size={self.size}, "
            f"stride={self.stride}, count={self.count})"
        )


class _Reserved:
    """The values of a region reserved and not yet written or given back, by their first
    chunks, each with its reservation's serial (`AllocHandle._serial`): runs as taken (first
    -> (chunks a value, values, serial)), and single values once part of a run was written or
    given back (serial -> firsts). Asked whether a handle's values are still its own (a seal,
    a free) and whether any is left (parking). Per value only C-level set work, no Python step."""

    __slots__ = ("runs", "singles")

    def __init__(self) -> None:
        self.runs: dict[int, tuple[int, int, int]] = {}
        self.singles: dict[int, set[int]] = {}  # (no empty set: `__bool__`)

    def __bool__(self) -> bool:
        return bool(self.runs or self.singles)

    def __len__(self) -> int:
        return sum(map(len, self.singles.values())) + sum(n for _, n, _ in self.runs.values())

    def add(self, first: int, step: int, count: int, serial: int) -> None:
        self.runs[first] = (step, count, serial)

    def discard(self, first: int, step: int, count: int, serial: int) -> set[int] | range:
        """Values first, first + step, ... (`count` of them) reserved under `serial` are no
        longer reserved (others, a later reservation's, stay); returns those that were."""
        if self.runs.get(first) == (step, count, serial):  # (the usual case: the run as taken)
            del self.runs[first]
            return range(first, first + step * count, step)
        return self.discard_each(range(first, first + step * count, step), serial)

    def holds(self, first: int, step: int, count: int, serial: int) -> bool:
        """Whether values first, first + step, ... (`count` of them) are all still reserved,
        under `serial` (not a later reservation of the same chunks)."""
        if self.runs.get(first) == (step, count, serial):  # (the usual case: the run as taken)
            return True
        end = first + step * count
        for start, (each, values, owner) in self.runs.items():  # (a piece of one run)
            if each == step and start <= first and end <= start + each * values:
                return owner == serial and (first - start) % step == 0
        mine = self.singles.get(serial)
        return mine is not None and mine.issuperset(range(first, end, step))

    def discard_each(self, firsts: Iterable[int], serial: int) -> set[int]:
        """The values at `firsts` reserved under `serial` are no longer reserved; returns them."""
        firsts = firsts if isinstance(firsts, range) else list(firsts)
        if not firsts:
            return set()
        low, high = min(firsts), max(firsts)
        singles = self.singles
        for start, (step, count, owner) in list(self.runs.items()):  # (runs they touch: singles)
            if start <= high and low < start + step * count:
                del self.runs[start]
                singles.setdefault(owner, set()).update(range(start, start + step * count, step))
        mine = singles.get(serial)
        if mine is None:
            return set()
        gone = mine.intersection(firsts)
        mine.difference_update(gone)
        if not mine:
            del singles[serial]
        return gone


class _OwnedRegion:
    """An owned region's free chunks, and what parking needs: whether a chunk was taken since
    the last `park_idle` (`touched`), which values are reserved and not yet written
    (`reserved`: their first chunks), and whether it is `parked` (no take until `unpark`)."""

    __slots__ = ("chunks", "mapped", "parked", "reserved", "touched")

    def __init__(self, mapped: MappedRegion, chunk: int, parked: bool = False):
        self.mapped = mapped
        self.chunks = RunAllocator(mapped.handle.length // chunk)
        self.parked = parked
        self.touched = True  # a new region is not idle before the next tick
        self.reserved = _Reserved()


class ChunkBook:
    """The owned regions and their free chunks; thread-safe.

    A region is parked only while none of its values is reserved and unsealed, `take` skips
    parked regions, and the server hears of a park only after it is made here and unparks
    only after the server said the region is still ours: so a page we may still write is
    never in a region the server may give away (docs/architecture.md, Capacity)."""

    def __init__(self, chunk_size: int):
        self.chunk_size = chunk_size
        self._owned: dict[int, _OwnedRegion] = {}
        self._lock = threading.Lock()
        self._serials = itertools.count(1)  # each reservation's (`AllocHandle._serial`)
        # free chunks, parked included, kept by every change below (under `_lock`): a write
        # reads a plain attribute, no call; it lags the notices not yet settled (`note_freed`)
        self.free = 0
        # replies' `freed` notices not yet applied, each with the regions owned when it came
        # (a deque: the reply hook appends on whichever thread reads a reply)
        self._told: deque[tuple[bytes, dict[int, _OwnedRegion]]] = deque()

    def __contains__(self, region_id: int) -> bool:
        return region_id in self._owned

    def region_ids(self) -> list[int]:
        with self._lock:
            return sorted(self._owned)

    def free_chunks(self) -> int:
        self.settle()
        return self.free

    def _recount(self) -> None:
        """`free` after the owned regions changed (the caller holds `_lock`)."""
        self.free = sum(o.chunks.free for o in self._owned.values())

    def untouched(self) -> bool:
        """No chunk of any owned region is reserved (the chunk size may still change)."""
        with self._lock:
            self._settle()
            return all(o.chunks.used == 0 for o in self._owned.values())

    def set_chunk_size(self, chunk_size: int, mapped: Iterable[MappedRegion]) -> None:
        """Re-cut the (untouched) owned regions into chunks of `chunk_size`; parked stay so."""

        with self._lock:
            self._settle()
            self.chunk_size = chunk_size
            parked = {r for r, o in self._owned.items() if o.parked}
            self._owned = {
                m.handle.region_id: _OwnedRegion(m, chunk_size, m.handle.region_id in parked)
                for m in mapped
            }
            self._recount()

    def owned_bytes(self) -> int:
        """Bytes of the owned regions, parked included (what `pool_size` caps)."""
        with self._lock:
            return sum(o.mapped.handle.length for o in self._owned.values())

    def largest_region(self) -> int:
        """The length of the largest owned region (0: none); the next region doubles it."""
        with self._lock:
            return max((o.mapped.handle.length for o in self._owned.values()), default=0)

    def park_idle(self) -> list[int]:
        """Park every region that had no take since the last call and holds no reserved
        value; returns every parked region (for the server, which may take them back)."""
        with self._lock:
            for owned in self._owned.values():
                if not owned.touched and not owned.reserved:
                    owned.parked = True
                owned.touched = False
        return self.parked_regions()

    def give_up(self, nbytes: int) -> list[MappedRegion]:
        """Drop owned regions of at least `nbytes` in all (or all we can), none with a value
        reserved in it, the least used first; their mappings (for RETURN_REGION)."""
        with self._lock:
            self._settle()
            idle = sorted(
                (o for o in self._owned.values() if not o.reserved),
                key=lambda o: (not o.parked, o.chunks.used),
            )
            out: list[MappedRegion] = []
            for owned in idle:
                if nbytes <= 0:
                    break
                del self._owned[owned.mapped.handle.region_id]
                out.append(owned.mapped)
                nbytes -= owned.mapped.handle.length
            self._recount()
            return out

    def parked_regions(self) -> list[int]:
        with self._lock:
            return sorted(r for r, o in self._owned.items() if o.parked)

    def parked_with_room(self, size: int, count: int = 1) -> list[int]:
        """Parked regions with a free run for `count` values of `size` bytes."""
        run = -(-size // self.chunk_size) * count
        with self._lock:
            self._settle()
            return [r for r, o in self._owned.items() if o.parked and o.chunks.largest_free >= run]

    def unpark(self, region_ids: Iterable[int]) -> None:
        """The server confirmed these regions are still ours to write in."""
        with self._lock:
            for region_id in region_ids:
                owned = self._owned.get(region_id)
                if owned is not None:
                    owned.parked, owned.touched = False, True

    def adopt(self, mapped: MappedRegion) -> None:
        """Own `mapped`, a region the server just gave us: every chunk free."""
        with self._lock:
            self._owned[mapped.handle.region_id] = _OwnedRegion(mapped, self.chunk_size)
            self._recount()

    def drop(self, region_id: int) -> None:
        with self._lock:
            self._owned.pop(region_id, None)
            self._recount()

    def clear(self) -> None:
        with self._lock:
            self._owned = {}
            self.free = 0

    def take(self, size: int, count: int = 1) -> AllocHandle | None:
        """`count` values of `size` bytes as one contiguous run of chunks in an owned region, or
        None when no owned region has such a run free."""
        chunks = -(-size // self.chunk_size)
        with self._lock:
            for settled in (False, True):  # (the notices not yet applied only if none has room)
                if settled:
                    if not self._told:
                        break
                    self._settle()
                for owned in self._owned.values():
                    if owned.parked:
                        continue
                    run = owned.chunks.allocate_run(chunks, count)
                    if run is not None:
                        self.free -= chunks * count
                        owned.touched = True
                        serial = next(self._serials)
                        owned.reserved.add(run.start, chunks, count, serial)
                        chunk = self.chunk_size
                        offset, stride = run.start * chunk, chunks * chunk
                        return AllocHandle(owned.mapped, chunk, offset, stride, count, size, serial)
        return None

    def written(self, handles: Sequence[AllocHandle]) -> list[bool]:
        """The values of each handle are written and being sealed: no longer reserved (a seal
        that comes after its region was parked and taken back is refused). Per handle, whether
        every value of it was still its reservation's: only then may the seal send it. The
        check and the claim are one step under the lock, so of two seals of one reservation
        (prepared by two threads) one sends it, and a handle freed after its seal was prepared
        sends nothing: else a value would lie under two keys, or a key over the next
        reservation's bytes. A handle not wholly its own claims nothing."""
        chunk, out = self.chunk_size, []
        with self._lock:
            for handle in handles:
                owned = self._region_of(handle)
                first, step, count = handle.offset // chunk, handle.stride // chunk, handle.count
                serial = handle._serial
                mine = owned is not None and owned.reserved.holds(first, step, count, serial)
                if mine:
                    owned.reserved.discard(first, step, count, serial)  # type: ignore[union-attr]
                out.append(mine)
        return out

    def _firsts(self, handle: AllocHandle, indices: Iterable[int] | None = None) -> list[int]:
        """The first chunks of the values of `handle` (all, or those at `indices`)."""
        chunk = self.chunk_size
        if indices is None:
            first, step = handle.offset // chunk, handle.stride // chunk
            return list(range(first, first + step * handle.count, step))
        return [(handle.offset + i * handle.stride) // chunk for i in indices]

    def give_back(
        self, handle: AllocHandle, indices: Iterable[int] | None = None, *, sealed: bool = False
    ) -> None:
        """Free the values of `handle` (all, or those at `indices`) that will not be sealed:
        only those still reserved by `handle` (`MaruHandler.free`): a value sealed, or freed
        before and maybe reserved again since, is not ours to free (its chunks may hold a key,
        or the next reservation's bytes). `sealed`: values `handle` sent for sealing (`written`)
        whose keys were not registered, or whose registration was not sent. A handle of a
        region that is gone (server restart) has nothing of ours to free."""
        with self._lock:
            owned = self._region_of(handle)
            if owned is None:
                return
            if sealed:
                firsts: Iterable[int] = self._firsts(handle, indices)
            elif indices is None:
                chunk = self.chunk_size
                first, step = handle.offset // chunk, handle.stride // chunk
                firsts = owned.reserved.discard(first, step, handle.count, handle._serial)
            else:
                firsts = owned.reserved.discard_each(self._firsts(handle, indices), handle._serial)
            if firsts:
                self.free += owned.chunks.free_many(firsts)  # (those still allocated)

    def holds(self, handle: AllocHandle) -> bool:
        """Whether `handle` is still in a region we own (not one the server forgot)."""
        with self._lock:
            return self._region_of(handle) is not None

    def seal_states(self, handles: Sequence[AllocHandle | None]) -> list[int]:
        """Per handle, for one seal (one lock for all): GONE (None, or in a region we no longer
        own: the server refuses it), SEALABLE, SPENT: in our region but not reserved by it any
        more, sealed (`written`) or given back before (its chunks maybe reserved again since,
        by a later `alloc`: its serial tells them apart), or REPEATED: SEALABLE, but with a
        value an earlier SEALABLE handle of the same call has. A reservation is sealed once,
        each value under one key: else its chunks would lie under two keys, or under a key and
        whatever the next reservation writes there. Per handle a few dict and set steps (a
        handle of several values in a list: a set step a value, in C)."""
        chunk, out = self.chunk_size, []
        # values claimed by the call's SEALABLE handles: (serial, first chunk); two handles
        # that are both still reserved share a value only if they share the reservation
        claimed: set[tuple[int, int]] = set()
        many = len(handles) > 1
        with self._lock:
            for handle in handles:
                owned = None if handle is None else self._region_of(handle)
                if owned is None or handle is None:
                    out.append(GONE)
                    continue
                first, step, count = handle.offset // chunk, handle.stride // chunk, handle.count
                serial = handle._serial
                if not owned.reserved.holds(first, step, count, serial):
                    out.append(SPENT)
                elif not many:
                    out.append(SEALABLE)
                elif count == 1:
                    value = (serial, first)
                    out.append(REPEATED if value in claimed else SEALABLE)
                    claimed.add(value)
                else:  # (a REPEATED handle claims nothing: it is not sealed)
                    firsts = range(first, first + step * count, step)
                    values = set(zip(itertools.repeat(serial), firsts))
                    if claimed.isdisjoint(values):
                        out.append(SEALABLE)
                        claimed |= values
                    else:
                        out.append(REPEATED)
        return out

    def _region_of(self, handle: AllocHandle) -> _OwnedRegion | None:
        # The mapping check matters after a server restart: a new region may reuse the id.
        owned = self._owned.get(handle.region_id)
        return owned if owned is not None and owned.mapped is handle._mapped else None

    def note_freed(self, freed: bytes) -> None:
        """The server's notice that keys in our regions went away (a reply's `freed`): their
        chunks are free once `settle` applies it. Not applied here: a reply is often read on
        a write's critical path (after its copy, where a full instance's notice of 256 pages
        costs it tens of microseconds); a write settles while its next copy runs, and whatever
        looks at the free chunks settles first. The notice is bound to the regions owned now:
        a region dropped and owned again under the same id (a server restart) is not freed."""
        self._told.append((freed, dict(self._owned)))

    def apply_freed(self, freed: bytes) -> None:
        """`note_freed`, applied at once."""
        self.note_freed(freed)
        self.settle()

    def settle(self) -> None:
        """Apply the notices kept so far (`note_freed`)."""
        if self._told:
            with self._lock:
                self._settle()

    def _settle(self) -> None:
        """`settle` with `_lock` held: one C pass a notice (`freed_runs`), then a few steps a
        run of chunks freed (`RunAllocator.free_stride`), none a page."""
        told = self._told  # (only appended to elsewhere: every pop is here, under `_lock`)
        while told:
            freed, owned_then = told.popleft()
            try:
                runs = freed_runs(freed, self.chunk_size)
            except (TypeError, ValueError) as exc:  # (its chunks stay taken: none freed twice)
                log.warning("a reply's freed notice is malformed, ignored: %s", exc)
                continue
            for region_id, first, step, count in runs:
                owned = self._owned.get(region_id)
                if owned is not None and owned is owned_then.get(region_id):
                    self.free += owned.chunks.free_stride(first, step, count)
