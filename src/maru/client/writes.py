"""The write verb (`MaruHandler.put`): reserve, copy, seal, and the per-key outcomes.

Every writer of the project goes through `Writes.put`: a caller describes each group of
values (`Put`: keys, bytes per value, how to copy value i into shared memory), the verb does:

- reserve one run of chunks for a group of equal-sized values, else value by value; when
  our regions are full, one eviction in our own regions makes room for the whole write and
  the next one like it (`RegionSupply.room` / `ahead`); a region a re-handshake forgot
  meanwhile makes every reservation of the group start again once;
- copy through the caller's copy function, hashed as copied with `maru_checksums`; a copy
  that faults (`CopyFaultError`) fails its values and gives their chunks back;
- seal: a run of at least PIPELINE_MIN_PAGES values as soon as it is copied, so that its
  registration is in flight while the rest is copied; smaller runs and values placed one by
  one are sealed together at the end (one REGISTER_KV);
- write-behind (`behind=True`): the call returns once every value is copied and its
  registration sent, reporting each sent value as stored; this thread's next call reads the
  replies (`confirm`): a value reported stored whose registration failed reads as a miss,
  and is logged and told to its `Put.on_late` then.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from maru.client._memcopy import copy_values_start as _c_copy_values_start
from maru.client.checksum import checksums
from maru.client.chunks import AllocHandle
from maru.client.memcopy import CopyFaultError, copy_values_start
from maru.client.requests import BYTES_LIKE, RegionsLost
from maru.client.supply import RegionSupply, Room
from maru.common.errors import MaruError, MaruServerError
from maru.common.protocol import (
    CHECKSUMS,
    ErrorCode,
    MsgType,
    ProtocolError,
    RegisterStatus,
    all_keys_valid,
    check_key,
    pack_int64,
)

if TYPE_CHECKING:
    from maru.client.rpc import PendingReply
    from maru.client.session import Session

log = logging.getLogger(__name__)

Key = str | bytes
_REGISTERED, _EXISTS = int(RegisterStatus.REGISTERED), int(RegisterStatus.EXISTS)
_REJECTED = int(RegisterStatus.REJECTED)

# A caller that waits for the replies has its call's last run registered in up to
# PIPELINE_PIECES pieces, each sent while the next piece is copied. With write-behind nothing
# waits for the last reply, and one REGISTER_KV costs less than two: one piece.
PIPELINE_PIECES = 2
PIPELINE_MIN_PAGES = 32


class CopyIn(Protocol):
    """Copy values [first, last) of a `Put` to `targets` (int64 addresses in shared memory,
    one per value). Returns each value's maru64 as copied when `hashed` (else None), or an
    object whose `finish()` does (`copy_values_start`). `threads`: copier threads it may use.
    Raises `CopyFaultError` if the memory faulted."""

    def __call__(
        self, targets: np.ndarray, first: int, last: int, hashed: bool, threads: int
    ) -> Any: ...


@dataclass(eq=False)
class Put:
    """One group of values of a write: `keys`, `size` (bytes of each value: one for all, or
    one per value) and `copy`. The verb fills `results` (one bool per key, as `Sealing.wait`)
    and, when the call waits, `outcomes`. `on_late(n)`: told, with write-behind, that n
    values reported stored were not registered after all. `prefix` (the caller's namespace,
    of the keys' type) is joined before each key as the verb begins."""

    keys: Sequence[Key]
    size: int | Sequence[int]
    copy: CopyIn
    name: str = "values"
    on_late: Callable[[int], None] | None = None
    prefix: Key = ""
    results: list[bool] = field(default_factory=list)
    outcomes: list[StoreOutcome] | None = None

    def uniform(self) -> int:
        """The one size of every value (0 if they differ or one is empty)."""
        size = self.size
        if isinstance(size, int):
            return size
        return size[0] if size and min(size) > 0 and size.count(size[0]) == len(size) else 0


@dataclass(frozen=True)
class ValuesAt:
    """The copy of values whose parts lie at `buffers` (int64 (values, parts) pointers, parts
    of `sizes` bytes, stored back to back): `copy_values` begun. The data path's copy: the
    verb begins it in C itself (`Writes._start`). Both columns C-contiguous int64 (`values_at`
    makes them so)."""

    buffers: np.ndarray
    sizes: np.ndarray

    def __call__(
        self, targets: np.ndarray, first: int, last: int, hashed: bool, threads: int
    ) -> Any:
        return copy_values_start(
            targets,
            self.buffers[first:last],
            self.sizes,
            to_values=True,
            hashed=hashed,
            threads=threads,
        )


def values_at(buffers: np.ndarray, sizes: Sequence[int] | np.ndarray) -> ValuesAt:
    """The copy of values whose parts lie at `buffers` (see `ValuesAt`)."""
    table = np.ascontiguousarray(buffers, np.int64)
    return ValuesAt(table, np.ascontiguousarray(sizes, np.int64).reshape(-1))


def from_pointers(pointers: Sequence[int], sizes: Sequence[int]) -> CopyIn:
    """The copy of values of differing sizes, value i `sizes[i]` bytes at `pointers[i]` (the
    verb copies values of differing sizes one by one: each range has one size)."""
    column = np.asarray(pointers, np.int64)[:, None]

    def copy(targets: np.ndarray, first: int, last: int, hashed: bool, threads: int) -> Any:
        return copy_values_start(
            targets, column[first:last], [sizes[first]], to_values=True, hashed=hashed
        )

    return copy


# a Sealing's values, in the order of its keys: (put, first value, count)
Owners = list[tuple[Put, int, int]]


class _Unconfirmed(threading.local):
    """One thread's registrations whose replies a write did not wait for (write-behind),
    each with the puts it answers for and the results the call reported."""

    def __init__(self) -> None:
        self.sealings: list[tuple[Owners, Sealing, list[bool]]] = []


def _targets(handle: AllocHandle) -> np.ndarray:
    return handle.address + np.arange(handle.count, dtype=np.int64) * handle.stride


class Writes:
    """The write algorithm of one handler (`MaruHandler.put` / `confirm_writes`)."""

    def __init__(self, session: Session, supply: RegionSupply) -> None:
        self._s = session
        self._supply = supply
        self._copying = session.mapper.copying()  # (one object: every write enters it)
        self._unconfirmed = _Unconfirmed()
        # the ids of threads with unconfirmed registrations: a read's check is a set lookup
        # (a thread-local lookup costs ~3x more); only a thread adds or removes its own id
        self.unconfirmed_threads: set[int] = set()

    def put(self, puts: Sequence[Put], *, behind: bool = False, again: bool = True) -> None:
        """Write every put's values (see the module); fills each put's `results`."""
        s = self._s
        for put in puts:
            self._refuse_bad(put)
        hashed, threads = s.config.checksums, s.config.copy_threads
        pieces = 1 if behind else PIPELINE_PIECES
        sealings: list[tuple[Owners, Sealing]] = []
        rest: list[tuple[Put, Any, np.ndarray | None]] = []  # sealed together at the end
        with self._copying:  # (no region unmapped under the copies)
            for number, put in enumerate(puts, 1):
                n = len(put.keys)
                put.results, put.outcomes = [False] * n, None
                size = put.uniform()
                run = self.reserve(size, n) if n and size else None
                if number == 1 and (run is not None or self._supply.full):
                    room = self._room(puts)  # (the next write's, made ready now if not free)
                    free = s.chunks.free * s.chunks.chunk_size
                    if free < room.chunks:
                        self._supply.ahead(room, free)
                if run is None:  # no free run: value by value
                    if n:
                        rest.append((put, *self._value_by_value(put, n, size, hashed)))
                    continue
                if n < PIPELINE_MIN_PAGES:
                    started = self._start(put, run, 0, n, hashed, threads)
                    copied, sums = self._copy(put, run, 0, n, started)
                    if copied:
                        rest.append((put, run, sums))
                    continue
                last_put = number == len(puts)
                step = max(PIPELINE_MIN_PAGES, -(-n // pieces)) if last_put else n
                for first in range(0, n, step):
                    last = min(n, first + step)
                    piece = run.slice(first, last) if step < n else run
                    started = self._start(put, piece, first, last, hashed, threads)
                    # While the copier threads copy, this thread makes the registration ready
                    # (it reads no value) and, on the call's last copy, reads the earlier
                    # calls' replies that are in (`Sealing.arrived`); the rest after the copy.
                    sealing = Sealing(s, put.keys[first:last], piece, size)
                    if behind and last_put and last == n:
                        self.confirm(wait=False)
                    copied, sums = self._copy(put, piece, first, last, started)
                    if copied:
                        sealings.append(([(put, first, last - first)], sealing.send(sums)))
        if rest:
            sealings.append(self._seal_together(rest))
        # The earlier calls' replies, now: the server answered them during this call's copies.
        self.confirm()
        lost: list[Put] = []
        for owners, sealing in sealings:
            results, at = sealing.hoped() if behind else sealing.wait(), 0
            outcomes = None if behind else sealing.outcomes()
            for put, first, count in owners:
                put.results[first : first + count] = results[at : at + count]
                if outcomes is not None:
                    if put.outcomes is None:
                        put.outcomes = [StoreOutcome.FAILED] * len(put.keys)
                    put.outcomes[first : first + count] = outcomes[at : at + count]
                at += count
            if behind:
                self._unconfirmed.sealings.append((owners, sealing, results))
                self.unconfirmed_threads.add(threading.get_ident())
            elif sealing.regions_lost:  # the bytes went to memory the server forgot
                lost += [put for put, _, _ in owners if put not in lost]
        if lost and again:
            log.info("writing the %d values again", sum(len(p.keys) for p in lost))
            self.put(lost, behind=False, again=False)

    def reserve(self, size: int, count: int) -> AllocHandle | None:
        """A run of `count` values of `size` bytes in an owned region, else from the supply
        (the caller checked the handler may write: `MaruHandler.put`, `alloc`)."""
        run = self._s.chunks.take(size, count)  # (the usual case: no region change)
        return run if run is not None else self._supply.reserve(size, count)

    def _room(self, puts: Sequence[Put]) -> Room:
        """The room `puts` reserve: chunk bytes, and values' bytes."""
        chunk, chunks, values = self._s.chunks.chunk_size, 0, 0
        for put in puts:
            size = put.size
            each = [(size, len(put.keys))] if isinstance(size, int) else [(v, 1) for v in size]
            for value, times in each:
                if value > 0:
                    chunks += -(-value // chunk) * chunk * times
                    values += value * times
        return Room(chunks, values)

    def _refuse_bad(self, put: Put) -> None:
        """Bad keys and empty values of `put` (logged, counted in `refused_stores`) get
        nothing reserved: they fail, the rest goes on."""
        s = self._s
        if put.prefix:  # (once: a put written again keeps its joined keys)
            prefix, put.prefix = put.prefix, ""
            put.keys = [prefix + key for key in put.keys]  # type: ignore[operator]
        n, size = len(put.keys), put.size
        sizes = size if not isinstance(size, int) else () if size > 0 else [size] * n
        refused = refuse_bad_stores(put.keys, sizes, s.refused_stores, s.instance_id)
        if refused:
            sizes = [size] * n if isinstance(size, int) else size
            put.size = [0 if i in refused else v for i, v in enumerate(sizes)]

    def _value_by_value(
        self, put: Put, n: int, size: int, hashed: bool
    ) -> tuple[list[AllocHandle | None], np.ndarray | None]:
        """`put` value by value, when no run of its size is free: a reservation per value
        (None where none could be made, or for an empty value) and, with `hashed`, each
        value's checksum. A reservation may re-handshake with a restarted server that forgot
        the region of an earlier one: then all are reserved once more."""
        s = self._s
        sizes = [size] * n if size else [int(v) for v in put.size]  # type: ignore[union-attr]
        if size and n == 1:  # (one value: `alloc` evicted for it already)
            return [None], None
        if not size:  # (equal sizes: the run's `alloc` made room for all of them)
            self._supply.room(self._room([put]))
        for _ in range(2):
            handles = [self.reserve(v, 1) if v > 0 else None for v in sizes]
            if all(h is None or s.chunks.holds(h) for h in handles):
                break
            for handle in handles:
                if handle is not None:
                    s.chunks.give_back(handle)
        sums: np.ndarray | None = np.zeros(n, np.int64) if hashed else None
        for i, handle in enumerate(handles):
            if handle is not None and s.chunks.holds(handle):
                started = self._start(put, handle, i, i + 1, hashed, 1)
                copied, got = self._copy(put, handle, i, i + 1, started)
                if not copied:  # the key fails (sealed with no handle)
                    handles[i] = None
                elif got is None:  # (a copy that does not hash: the seal hashes in the pool)
                    sums = None
                elif sums is not None:
                    sums[i] = got[0]
        return handles, sums

    @staticmethod
    def _start(
        put: Put, handle: AllocHandle, first: int, last: int, hashed: bool, threads: int
    ) -> Any:
        """`put.copy` begun into `handle` (a `ValuesAt` copy in C here); a fault while it
        begins is returned, for `_copy` to report."""
        copy = put.copy
        try:
            if type(copy) is ValuesAt:  # (checked as made: contiguous int64 columns)
                buffers = copy.buffers[first:last]
                return _c_copy_values_start(
                    _targets(handle), buffers, copy.sizes, True, True, hashed, max(threads, 1)
                )
            return copy(_targets(handle), first, last, hashed, threads)
        except CopyFaultError as exc:
            return exc

    def _copy(
        self, put: Put, handle: AllocHandle, first: int, last: int, started: Any
    ) -> tuple[bool, np.ndarray | None]:
        """Finish `started`, the copy of values [first, last) of `put` into `handle`: (True,
        checksums or None); (False, None) if the memory faulted under it: the values fail,
        the handle's chunks are given back unsealed."""
        try:
            if isinstance(started, CopyFaultError):  # (it faulted as it began)
                raise started
            sums = started.finish() if hasattr(started, "finish") else started
            if type(sums) is bytes:  # (a copy begun in C: its checksums' bytes)
                sums = np.frombuffer(sums, np.int64)
        except CopyFaultError as exc:
            log.warning(
                "write: pages %d-%d of a %s batch failed, the pool's memory faulted under "
                "the copy: %s",
                first,
                last - 1,
                put.name,
                exc,
            )
            self._s.chunks.give_back(handle)
            return False, None
        return True, sums

    def _seal_together(
        self, rest: list[tuple[Put, Any, np.ndarray | None]]
    ) -> tuple[Owners, Sealing]:
        """One registration for several whole puts' values (`put`'s `rest`)."""
        if len(rest) == 1:  # (one run or one put's values: sealed as they are)
            put, handles, sums = rest[0]
            sealing = Sealing(self._s, put.keys, handles, put.size)
            return [(put, 0, len(put.keys))], sealing.send(sums)
        keys: list[Key] = []
        handles_all: list[AllocHandle | None] = []
        lengths_all: list[int] = []
        sums_all: list[np.ndarray] = []
        owners: Owners = []
        for put, held, sums in rest:
            n = len(put.keys)
            keys += put.keys
            handles_all += held if isinstance(held, list) else held.split()
            lengths_all += [put.size] * n if isinstance(put.size, int) else list(put.size)
            owners.append((put, 0, n))
            if sums is not None:
                sums_all.append(sums)
        checksums = np.concatenate(sums_all) if len(sums_all) == len(rest) else None
        return owners, Sealing(self._s, keys, handles_all, lengths_all).send(checksums)

    def confirm(self, wait: bool = True) -> int:
        """Wait until the server has registered every value this thread's write-behind calls
        returned for: from then on every instance finds them. Returns how many values those
        calls reported stored whose registration failed (logged, told to each put's
        `on_late`): they read as misses. `wait=False`: those whose replies are in, oldest
        first."""
        thread = threading.get_ident()
        if thread not in self.unconfirmed_threads:  # (a read's usual case)
            return 0
        unconfirmed = self._unconfirmed.sealings
        ready = len(unconfirmed)
        if not wait:
            ready = next((i for i, (_, sg, _) in enumerate(unconfirmed) if not sg.arrived()), ready)
        unconfirmed, self._unconfirmed.sealings = unconfirmed[:ready], unconfirmed[ready:]
        if not self._unconfirmed.sealings:
            self.unconfirmed_threads.discard(thread)
        lost_total = 0
        for owners, sealing, reported in unconfirmed:
            results, at = sealing.wait(), 0
            if results == reported:  # (the usual outcome: no per-value step)
                continue
            for put, _first, count in owners:
                span = zip(reported[at : at + count], results[at : at + count])
                lost = sum(1 for said, got in span if said and not got)
                at += count
                if lost and put.on_late is not None:
                    put.on_late(lost)
                lost_total += lost
        if lost_total:
            log.warning(
                "%d page(s) an earlier write reported stored may not be registered (the "
                "reason is logged above): they may read as misses",
                lost_total,
            )
        return lost_total


class StoreOutcome(Enum):
    """What a store did for one key. Keys are content hashes, so the first writer wins: a key
    already there keeps its first value, and the store reports EXISTED (our bytes were not
    used). `store`, `batch_store` and `Sealing.wait` say True for both STORED and EXISTED."""

    STORED = "stored"
    EXISTED = "existed"
    FAILED = "failed"


class Sealing:
    """A REGISTER_KV: seals `keys[i]` onto value i of `handles` (one run, or one handle per
    key, None where nothing was reserved). Made ready first (nothing read from the values, so
    it may be made while they are still being copied), sent by `send()` once every value is
    written. `wait()` gives one bool per key: True when the key is stored (ours, or another
    writer's that came first: then our chunks come back); False when it was rejected or
    nothing was reserved for it. When the outcome is unknown (no reply, an error) the chunks
    stay reserved: the server may have sealed some keys. A STATE_UNAVAILABLE refusal (the
    server cannot journal) seals nothing: they return."""

    def __init__(
        self,
        session: Session,
        keys: Sequence[Key],
        handles: AllocHandle | Sequence[AllocHandle | None],
        lengths: int | Sequence[int] | None,
    ):
        self._s = session
        self._n = n = len(keys)
        self._handles = handles
        self.regions_lost = False  # the server forgot the regions the bytes are in
        self._sent = False
        self._pending: PendingReply | None = None
        self._results: list[bool] | None = None
        self._outcomes: list[StoreOutcome] | None = None
        if isinstance(handles, AllocHandle):
            if handles.count != n:
                raise ValueError(f"seal: {n} keys for a handle of {handles.count} values")
            self._positions: list[int] | None = None  # every key is sent
            size = handles.size if lengths is None else lengths
            stride, offset = handles.stride, handles.offset
            sent_keys = list(keys)
            self._sizes: int | list[int] = size if isinstance(size, int) else list(size)
            # the wire's columns, made by numpy without a Python int per key
            columns = (
                np.full(n, handles.region_id, np.int64).tobytes(),
                np.arange(offset, offset + n * stride, stride, dtype=np.int64).tobytes(),
                np.full(n, size, np.int64).tobytes()
                if isinstance(size, int)
                else pack_int64(self._sizes),
            )
        else:
            if len(handles) != n:
                raise ValueError(f"seal: {n} keys for {len(handles)} handles")
            sizes = [h.size if h else 0 for h in handles] if lengths is None else lengths
            if isinstance(sizes, int):
                sizes = [sizes] * n
            chunks = session.chunks
            self._positions = [i for i, h in enumerate(handles) if h and chunks.holds(h)]
            sent_keys = [keys[i] for i in self._positions]
            region_ids = [handles[i].region_id for i in self._positions]  # type: ignore[union-attr]
            offsets = [handles[i].offset for i in self._positions]  # type: ignore[union-attr]
            self._sizes = [sizes[i] for i in self._positions]
            columns = (pack_int64(region_ids), pack_int64(offsets), pack_int64(self._sizes))
        self._body: dict[str, Any] | None = None
        if sent_keys:
            self._body = {
                "keys": sent_keys,
                "region_ids": columns[0],
                "offsets": columns[1],
                "lengths": columns[2],
            }

    def send(self, checksums: np.ndarray | None = None) -> Sealing:
        """Send the registration: every value must be in place (a key is visible to every
        instance once the server has it). `checksums` (with `maru_checksums`): one per key,
        hashed during the caller's copy; without them the values are hashed here, in the
        pool. Once only; returns self."""
        if self._sent:
            raise RuntimeError("Sealing.send: already sent")
        self._sent = True
        handles, s = self._handles, self._s
        # The values are written: their region may be parked from now on (`ChunkBook.written`).
        for handle in [handles] if isinstance(handles, AllocHandle) else handles:
            if handle is not None:
                s.chunks.written(handle)
        body = self._body
        if body is None:
            self._results = [False] * self._n
            return self
        if s.config.checksums:
            body[CHECKSUMS] = self._checksums(checksums).tobytes()
        try:
            self._pending = s.request(MsgType.REGISTER_KV, body)
        except MaruError as exc:
            log.warning("register of %d keys failed: %s", len(body["keys"]), exc)
            self._results = [False] * self._n
        return self

    def _checksums(self, given: np.ndarray | None) -> np.ndarray:
        """The sent values' checksums: `given` (per key) where the caller hashed as it copied,
        else hashed now over the values as stored (after the caller's copy)."""
        handles, sizes = self._handles, self._sizes
        if given is not None:
            given = np.asarray(given, np.int64)
            if len(given) != self._n:
                raise ValueError(f"seal: {len(given)} checksums for {self._n} keys")
            return given if self._positions is None else given[self._positions]
        if isinstance(handles, AllocHandle):
            return checksums(handles.views(sizes))
        return checksums(
            [handles[i].views(size)[0] for i, size in zip(self._positions, sizes)]  # type: ignore[union-attr]
        )

    def hoped(self) -> list[bool]:
        """What `wait()` will give if the server seals every key sent (its results once
        decided)."""
        if self._results is not None:
            return self._results
        if self._positions is None:
            return [True] * self._n
        sent = set(self._positions)
        return [i in sent for i in range(self._n)]

    def arrived(self) -> bool:
        """Whether `wait()` would return at once without another request."""
        if not self._sent:
            return False
        return self._results is not None or self._pending is None or self._pending.arrived()

    def wait(self) -> list[bool]:
        if self._results is not None:
            return self._results
        if not self._sent:
            raise RuntimeError("Sealing.wait: send() it first")
        assert self._pending is not None
        try:
            statuses = self._pending.result()["results"]
        except MaruError as exc:
            log.warning("register of %d keys failed: %s", self._n, exc)
            self.regions_lost = isinstance(exc, RegionsLost)
            if isinstance(exc, MaruServerError) and exc.code == ErrorCode.STATE_UNAVAILABLE:
                # refused before any side effect (the server cannot journal): nothing was
                # sealed, so the chunks come back
                sent = self._n if self._positions is None else len(self._positions)
                self._results = self._outcome([_REJECTED] * sent)
            else:  # outcome unknown: the chunks stay reserved
                self._results = [False] * self._n
            return self._results
        self._results = self._outcome(statuses)
        return self._results

    def outcomes(self) -> list[StoreOutcome]:
        """Per key, STORED, EXISTED (the first writer won) or FAILED; waits like `wait`."""
        results = self.wait()
        if self._outcomes is None:  # no reply to tell: a failure, or nothing was sent
            self._outcomes = [StoreOutcome.FAILED] * len(results)
        return self._outcomes

    def _outcome(self, statuses: list[int]) -> list[bool]:
        handles, chunks = self._handles, self._s.chunks
        if self._positions is None:  # one run, every key sent
            if statuses.count(_REGISTERED) == self._n:
                self._outcomes = [StoreOutcome.STORED] * self._n
                return [True] * self._n
            assert isinstance(handles, AllocHandle)
            chunks.give_back(handles, [i for i, st in enumerate(statuses) if st != _REGISTERED])
            self._outcomes = [_OUTCOMES.get(st, StoreOutcome.FAILED) for st in statuses]
            return [st in (_REGISTERED, _EXISTS) for st in statuses]
        results = [False] * self._n
        self._outcomes = [StoreOutcome.FAILED] * self._n
        for i, status in zip(self._positions, statuses):
            if status != _REGISTERED:
                chunks.give_back(handles[i])  # type: ignore[index,arg-type]
            results[i] = status in (_REGISTERED, _EXISTS)
            self._outcomes[i] = _OUTCOMES.get(status, StoreOutcome.FAILED)
        return results


_OUTCOMES = {_REGISTERED: StoreOutcome.STORED, _EXISTS: StoreOutcome.EXISTED}


def refuse_bad_stores(
    keys: Sequence[Any], sizes: Sequence[int], refused: Counter[str], instance_id: str
) -> set[int]:
    """Positions of stores that cannot succeed: a key that is not str or bytes, empty or
    longer than MAX_KEY_BYTES, an empty value, or (a size below 0) a value that is not
    bytes-like. A batch with any logs one WARNING naming the first such key and why; `refused`
    (the handler's `refused_stores`) counts them by reason."""
    if all_keys_valid(list(keys)) and (not sizes or min(sizes) > 0):
        return set()
    reasons: dict[int, tuple[str, str]] = {}
    for i, key in enumerate(keys):
        try:
            check_key(key)
        except ProtocolError as exc:
            kind = "key_too_long" if exc.code == ErrorCode.KEY_TOO_LONG else "bad_key"
            if kind == "bad_key":
                kind = "empty_key" if isinstance(key, (str, bytes)) else "key_type"
            reasons[i] = (kind, str(exc))
            continue
        if sizes and sizes[i] < 0:
            reasons[i] = ("value_type", f"a value must be bytes-like ({BYTES_LIKE})")
        elif sizes and sizes[i] == 0:
            reasons[i] = ("empty_value", "an empty value cannot be stored")
    refused.update(kind for kind, _ in reasons.values())
    first = min(reasons)
    more = f" (and {len(reasons) - 1} more in the batch)" if len(reasons) > 1 else ""
    log.warning(
        "instance %s: store of key %.80r refused: %s%s",
        instance_id,
        keys[first],
        reasons[first][1],
        more,
    )
    return set(reasons)
