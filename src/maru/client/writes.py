"""The write verb (`MaruHandler.put`): reserve, copy, seal, and the per-key outcomes.

Every writer goes through `Writes.put`, with a `Put` per group of values (keys, bytes per
value, a copy function). Equal-sized values get one run of chunks, else a reservation each;
at `pool_size` one eviction makes room for the whole write and the next ones
(`RegionSupply.room` / `ahead`). A copy that faults fails its values and gives their chunks
back. A run of at least PIPELINE_MIN_PAGES values, or a write's only run, is sealed as soon
as it is copied (in flight while the rest is copied); the others are sealed together at the
end. Write-behind (`behind=True`) returns
once every registration is sent, each sent value reported stored; this thread's next call
reads the replies (`confirm`): a value whose registration failed then reads as a miss,
logged and told to its `Put.on_late`.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from maru.client.chunks import REPEATED, SEALABLE, SPENT, AllocHandle
from maru.client.coherence import write_back_handles
from maru.client.localindex import joined
from maru.client.requests import BYTES_LIKE, RegionsLost
from maru.client.supply import AHEAD_WRITES, RegionSupply, Room
from maru.common._memcopy import copy_values_start as _c_copy_values_start
from maru.common.checksum import checksums
from maru.common.errors import MaruError, MaruServerError
from maru.common.memcopy import CopyFaultError, copy_values_start
from maru.common.protocol import (
    CHECKSUMS,
    INT64,
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

# A waiting call registers its last run in up to PIPELINE_PIECES pieces, each sent while the
# next is copied; write-behind waits for no reply, so one piece (one REGISTER_KV, not two).
PIPELINE_PIECES = 2
PIPELINE_MIN_PAGES = 32


class CopyIn(Protocol):
    """Copy values [first, last) of a `Put` to `targets` (an int64 address each), using up to
    `threads` copiers. Returns each value's maru64 when `hashed` (else None), or an object
    whose `finish()` does; raises `CopyFaultError` if the memory faulted."""

    def __call__(
        self, targets: np.ndarray, first: int, last: int, hashed: bool, threads: int
    ) -> Any: ...


@dataclass(eq=False)
class Put:
    """One group of values of a write: `keys`, `size` (one for all, or per value), `copy`;
    `prefix` (of the keys' type) is joined to each key. The verb fills `results` (as
    `Sealing.wait`) and, when the call waits, `outcomes`. `on_late(n)`: with write-behind, n
    values reported stored were not registered after all."""

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
    """`copy_values` begun from `buffers` (int64 (values, parts) pointers; parts of `sizes`,
    back to back). The data path's copy: `Writes._start` begins it in C itself, so both
    columns are C-contiguous int64 (`values_at`)."""

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


def _finish_quietly(started: Any) -> None:
    """A copy begun (`Writes._start`) whose call raised beside it, finished at once, inside
    `Writes._copying` where its pool pages are still mapped: else the exception's traceback
    kept it, and its end (which copies what no copier took) could come after the region was
    unmapped and its addresses reused. Its chunks stay reserved, unsealed."""
    if hasattr(started, "finish"):
        with suppress(Exception):
            started.finish()


def values_at(buffers: np.ndarray, sizes: Sequence[int] | np.ndarray) -> ValuesAt:
    """The copy of values whose parts lie at `buffers` (see `ValuesAt`)."""
    table = np.ascontiguousarray(buffers, np.int64)
    return ValuesAt(table, np.ascontiguousarray(sizes, np.int64).reshape(-1))


def from_pointers(pointers: Sequence[int], sizes: Sequence[int]) -> CopyIn:
    """The copy of value i, `sizes[i]` bytes at `pointers[i]` (such values are copied one by
    one: a range has one size)."""
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
    """Each value's address (one numpy call: on a writer's cold caches each costs microseconds)."""
    address, stride = handle.address, handle.stride
    return np.arange(address, address + handle.count * stride, stride, dtype=np.int64)


class Writes:
    """The write algorithm of one handler (`MaruHandler.put` / `confirm_writes`)."""

    def __init__(self, session: Session, supply: RegionSupply) -> None:
        self._s = session
        self._supply = supply
        self._copying = session.mapper.copying()  # (one object: every write enters it)
        self._unconfirmed = _Unconfirmed()
        # threads with unconfirmed registrations (a set: cheaper for a read than a
        # thread-local); each thread adds and removes only its own id
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
                ahead: Room | None = None  # the next writes' room, asked during the copy
                if number == 1 and (run is not None or self._supply.full):
                    room = self._room(puts)
                    if s.chunks.free * s.chunks.chunk_size < AHEAD_WRITES * room.chunks:
                        ahead = room
                if run is None:  # no free run: value by value
                    self._while_copying(ahead, False)
                    if n:
                        rest.append((put, *self._value_by_value(put, n, size, hashed)))
                    continue
                last_put = number == len(puts)
                if n < PIPELINE_MIN_PAGES and len(puts) > 1:  # (one REGISTER_KV for all)
                    started = self._start(put, run, 0, n, hashed, threads)
                    try:
                        self._while_copying(ahead, behind and last_put)
                    except BaseException:
                        _finish_quietly(started)
                        raise
                    copied, sums = self._copy(put, run, 0, n, started)
                    if copied:
                        rest.append((put, run, sums))
                    continue
                step = max(PIPELINE_MIN_PAGES, -(-n // pieces)) if last_put else n
                for first in range(0, n, step):
                    last = min(n, first + step)
                    piece = run.slice(first, last) if step < n else run
                    started = self._start(put, piece, first, last, hashed, threads)
                    # During the copy: the registration (reads no value), the eviction ahead
                    # and, on the call's last copy, the earlier calls' replies that are in
                    try:
                        sealing = Sealing(s, put.keys[first:last], piece, size)
                        self._while_copying(ahead, behind and last_put and last == n)
                    except BaseException:
                        _finish_quietly(started)
                        raise
                    ahead = None
                    copied, sums = self._copy(put, piece, first, last, started)
                    if copied:
                        sealings.append(
                            ([(put, first, last - first)], self._send(sealing, sums, behind))
                        )
        if rest:
            sealings.append(self._seal_together(rest, behind))
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

    def _while_copying(self, ahead: Room | None, take_replies: bool) -> None:
        """A write's work while its copy runs in C (memory-bound: a core is free): take in
        the eviction sent ahead and, on the call's last copy (`take_replies`), the earlier
        calls' replies that are in; then ask for the next writes' room (`ahead`)."""
        self._supply.collect_ahead()
        if take_replies:
            self.confirm(wait=False)
        if ahead is not None:
            s = self._s
            self._supply.ahead(ahead, s.chunks.free * s.chunks.chunk_size)

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
            put.keys = joined(put.keys, prefix)
        n, size = len(put.keys), put.size
        sizes = size if not isinstance(size, int) else () if size > 0 else [size] * n
        refused = refuse_bad_stores(put.keys, sizes, s.refused_stores, s.instance_id)
        if refused:
            sizes = [size] * n if isinstance(size, int) else size
            put.size = [0 if i in refused else v for i, v in enumerate(sizes)]

    def _value_by_value(
        self, put: Put, n: int, size: int, hashed: bool
    ) -> tuple[list[AllocHandle | None], np.ndarray | None]:
        """`put` value by value: a handle per value (None: none made, or an empty value) and,
        `hashed`, the checksums. If a re-handshake forgot an earlier reservation's region,
        all are reserved once more."""
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
        """Finish `started`: (True, checksums or None); (False, None) if the memory faulted:
        the values fail, their chunks given back unsealed."""
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
            with suppress(CopyFaultError):  # (software coherence: what it wrote before the
                write_back_handles(handle, None)  # fault leaves no dirty line on the chunks)
            self._s.chunks.give_back(handle)
            return False, None
        return True, sums

    def _seal_together(
        self, rest: list[tuple[Put, Any, np.ndarray | None]], behind: bool
    ) -> tuple[Owners, Sealing]:
        """One registration for several whole puts' values (`put`'s `rest`)."""
        if len(rest) == 1:  # (one run or one put's values: sealed as they are)
            put, handles, sums = rest[0]
            sealing = Sealing(self._s, put.keys, handles, put.size)
            return [(put, 0, len(put.keys))], self._send(sealing, sums, behind)
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
        sealing = Sealing(self._s, keys, handles_all, lengths_all)
        return owners, self._send(sealing, checksums, behind)

    def _send(self, sealing: Sealing, checksums: np.ndarray | None, behind: bool) -> Sealing:
        """Send `sealing` (its values are written) with this thread's ask for its next writes'
        room, if one is due (`RegionSupply.ahead`): the server evicts it before it seals.
        `behind`: the call does not wait for the reply (write-behind)."""
        ask = self._supply.take_ask()
        sealing.send(checksums, ahead=ask, behind=behind)
        if ask and sealing.pending is not None:
            self._supply.asked(sealing.pending)
        return sealing

    def confirm(self, wait: bool = True) -> int:
        """Wait for the replies of this thread's write-behind calls (`wait=False`: those in,
        oldest first); then every instance finds their values. Returns how many values
        reported stored were not registered (logged, told to `on_late`): they read as misses."""
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
    """A REGISTER_KV sealing `keys[i]` onto value i of `handles` (one run, or one handle per
    key, None: nothing reserved). Made without reading a value (during the copy), sent by
    `send()` once all are written. `wait()`: per key True when stored (ours, or a first
    writer's: our chunks come back), False if rejected or not reserved. An unknown outcome
    keeps the chunks reserved (the server may have sealed some); STATE_UNAVAILABLE sealed
    nothing, so they come back."""

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
            if np.ndim(lengths) and len(lengths) != n:  # (else refused as malformed once sent:
                # the run's chunks then neither sealed nor freed)
                raise ValueError(f"seal: {n} keys for {len(lengths)} lengths")
            if not _within(handles.size if lengths is None else lengths, handles.stride):
                handles = self._handles = handles.split()  # (each value judged on its own)
        if isinstance(handles, AllocHandle):
            self._positions: list[int] | None = None  # every key is sent
            size = handles.size if lengths is None else lengths
            stride, offset = handles.stride, handles.offset
            sent_keys = list(keys)
            if session.chunks.seal_states([handles]) == [SPENT]:  # (GONE: the server refuses)
                log.warning("seal of %d keys refused: their handle was sealed or freed before", n)
                sent_keys = []
            self._sizes: int | list[int] = size if isinstance(size, int) else list(size)
            # the wire's columns without a Python int per key (a repeated one: bytes repeated)
            columns = (
                INT64.pack(handles.region_id) * n,
                np.arange(offset, offset + n * stride, stride, dtype=np.int64).tobytes(),
                INT64.pack(size) * n if isinstance(size, int) else pack_int64(self._sizes),
            )
            tokens = [[handles.region_id, handles.region_token]]
        else:
            if len(handles) != n:
                raise ValueError(f"seal: {n} keys for {len(handles)} handles")
            if lengths is None:
                sizes = [h.size if isinstance(h, AllocHandle) else 0 for h in handles]
            else:
                sizes = [lengths] * n if isinstance(lengths, int) else list(lengths)
            if len(sizes) != n:
                raise ValueError(f"seal: {n} keys for {len(sizes)} lengths")
            handles = self._handles = self._refuse_misfits(keys, handles, sizes)
            states = session.chunks.seal_states(handles)
            self._positions = [i for i, state in enumerate(states) if state == SEALABLE]
            if SPENT in states:
                log.warning(
                    "seal of %d keys refused: their handles were sealed or freed before",
                    states.count(SPENT),
                )
            if REPEATED in states:
                log.warning(
                    "seal of %d keys (first %.80r) refused: their handles' values are another "
                    "key's of the same call (a value is sealed under one key)",
                    states.count(REPEATED),
                    keys[states.index(REPEATED)],
                )
            self._keys, self._every_size = keys, sizes
            self._body: dict[str, Any] | None = self._body_of_positions()
            return
        self._body = _body(sent_keys, columns, tokens) if sent_keys else None

    def _refuse_misfits(
        self, keys: Sequence[Key], handles: Sequence[Any], sizes: list[int]
    ) -> list[AllocHandle | None]:
        """`handles` with None for each value that is not a handle, or whose length is not
        within its own chunks (`stride`): registered, its key would cover the next value's
        chunks, and read as its bytes once that value is deleted and its chunks reused. Such
        a key fails alone (a WARNING, counted in `refused_stores`); its handle is given back,
        as a rejected one is, unless it is named again in the call."""
        refused: dict[int, tuple[str, str]] = {}
        for i, (handle, size) in enumerate(zip(handles, sizes)):
            if handle is None:
                continue
            if not isinstance(handle, AllocHandle):
                text = f"a value to seal is an AllocHandle, not {type(handle).__name__}"
                refused[i] = ("value_type", text)
            elif not 0 < size <= handle.stride:
                text = f"length {size} is not within its value's {handle.stride} bytes"
                refused[i] = ("value_size", text)
        if not refused:
            return list(handles)
        kept = [None if i in refused else h for i, h in enumerate(handles)]
        named = {id(h) for h in kept if h is not None}
        s = self._s
        for i, (reason, _) in refused.items():
            s.refused_stores[reason] += 1
            handle = handles[i]
            if isinstance(handle, AllocHandle) and id(handle) not in named:
                s.chunks.give_back(handle)
        first = min(refused)
        more = f" (and {len(refused) - 1} more in the batch)" if len(refused) > 1 else ""
        log.warning(
            "instance %s: seal of key %.80r refused: %s%s",
            s.instance_id,
            keys[first],
            refused[first][1],
            more,
        )
        return kept

    def _body_of_positions(self) -> dict[str, Any] | None:
        """The REGISTER_KV of handles in a list: the keys at `_positions` (None if none)."""
        handles, positions = self._handles, self._positions
        assert positions is not None and not isinstance(handles, AllocHandle)
        self._sizes = [self._every_size[i] for i in positions]
        if not positions:
            return None
        region_ids = [handles[i].region_id for i in positions]  # type: ignore[union-attr]
        offsets = [handles[i].offset for i in positions]  # type: ignore[union-attr]
        columns = (pack_int64(region_ids), pack_int64(offsets), pack_int64(self._sizes))
        granted = {handles[i].region_id: handles[i].region_token for i in positions}  # type: ignore[union-attr]
        tokens = [[region_id, token] for region_id, token in granted.items()]
        return _body([self._keys[i] for i in positions], columns, tokens)

    def send(
        self, checksums: np.ndarray | None = None, ahead: int = 0, behind: bool = False
    ) -> Sealing:
        """Send, once, with every value in place (the server makes a key visible to all).
        `checksums` (`maru_checksums`): one per key from the copy, else hashed in the pool.
        `ahead`: bytes the server then evicts in our regions, our next writes' room.
        `behind`: the caller reads the reply after its next copy (write-behind), so the server
        need not stay awake for this writer's next request (`MaruService._wants_spin`)."""
        if self._sent:
            raise RuntimeError("Sealing.send: already sent")
        if checksums is not None and len(checksums) != self._n:  # (before the claim: the
            # handles stay the caller's to free)
            raise ValueError(f"seal: {len(checksums)} checksums for {self._n} keys")
        self._sent = True
        self._claim()
        body, s = self._body, self._s
        if body is None:
            self._results = [False] * self._n
            return self
        if s.config.checksums:
            body[CHECKSUMS] = self._checksums(checksums).tobytes()
        if ahead:
            body["ahead"] = ahead
        if behind:
            body["behind"] = True
        try:
            self._pending = s.request(MsgType.REGISTER_KV, body)
        except MaruError as exc:  # not sent (the server down or unreachable): nothing sealed,
            # so the chunks come back (a handle sealed is not the caller's to `free` any more)
            log.warning("register of %d keys failed: %s", len(body["keys"]), exc)
            self._results = self._outcome([_REJECTED] * len(body["keys"]))
        return self

    def _claim(self) -> None:
        """The values are written: no longer reserved, so their region may be parked from now
        on (`ChunkBook.written`). A handle sealed or freed since this seal was made (another
        thread's seal of it, a `free`) is left out: its value is another key's now, or the
        next reservation's."""
        handles, positions, chunks = self._handles, self._positions, self._s.chunks
        if self._body is None:
            return
        if positions is None:
            assert isinstance(handles, AllocHandle)
            if chunks.written([handles])[0]:
                return
            left, self._body = self._n, None
        else:
            claimed = chunks.written([handles[i] for i in positions])  # type: ignore[misc]
            if all(claimed):
                return
            self._positions = [i for i, mine in zip(positions, claimed) if mine]
            left, self._body = len(positions) - len(self._positions), self._body_of_positions()
        self.regions_lost = self._in_dropped_region()
        if not self.regions_lost:
            log.warning(
                "seal of %d keys refused: their handles were sealed or freed after this seal "
                "was prepared (a value is sealed under one key)",
                left,
            )

    def _checksums(self, given: np.ndarray | None) -> np.ndarray:
        """The sent values' checksums: `given` (per key) where the caller hashed as it copied,
        else hashed now over the values as stored (after the caller's copy)."""
        handles, sizes = self._handles, self._sizes
        if given is not None:  # (one per key: `send` checked)
            given = np.asarray(given, np.int64)
            return given if self._positions is None else given[self._positions]
        if isinstance(handles, AllocHandle):
            return checksums(handles.views(sizes))
        return checksums(
            [handles[i].views(size)[0] for i, size in zip(self._positions, sizes)]  # type: ignore[union-attr]
        )

    @property
    def pending(self) -> PendingReply | None:
        """The request in flight (None: not sent, or its send failed)."""
        return self._pending

    def hoped(self) -> list[bool]:
        """What `wait()` gives if the server seals every key sent (its results once known)."""
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
        if not all(self._results) and self._in_dropped_region():
            # (a re-handshake on another thread dropped the region under our reservation)
            log.warning(
                "register of %d keys refused: the server forgot their region (restarted)",
                self._n,
            )
            self.regions_lost = True
        return self._results

    def _in_dropped_region(self) -> bool:
        """Whether a handle of ours lies in a region we no longer own (the server forgot it)."""
        chunks, handles = self._s.chunks, self._handles
        if isinstance(handles, AllocHandle):
            return not chunks.holds(handles)
        return any(h is not None and not chunks.holds(h) for h in handles)

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
            refused = [i for i, st in enumerate(statuses) if st != _REGISTERED]
            chunks.give_back(handles, refused, sealed=True)
            self._outcomes = [_OUTCOMES.get(st, StoreOutcome.FAILED) for st in statuses]
            return [st in (_REGISTERED, _EXISTS) for st in statuses]
        results = [False] * self._n
        self._outcomes = [StoreOutcome.FAILED] * self._n
        for i, status in zip(self._positions, statuses):
            if status != _REGISTERED:
                chunks.give_back(handles[i], sealed=True)  # type: ignore[index,arg-type]
            results[i] = status in (_REGISTERED, _EXISTS)
            self._outcomes[i] = _OUTCOMES.get(status, StoreOutcome.FAILED)
        return results


_OUTCOMES = {_REGISTERED: StoreOutcome.STORED, _EXISTS: StoreOutcome.EXISTED}


def _within(sizes: int | Sequence[int], stride: int) -> bool:
    """Whether every length is more than 0 and fits its value's chunks (`stride` bytes)."""
    if isinstance(sizes, int):
        return 0 < sizes <= stride
    return bool(len(sizes)) and min(sizes) > 0 and max(sizes) <= stride


def _body(keys: list[Key], columns: tuple[bytes, bytes, bytes], tokens: list) -> dict[str, Any]:
    """A REGISTER_KV's body: the keys and their (region id, offset, length) columns."""
    return {
        "keys": keys,
        "region_ids": columns[0],
        "offsets": columns[1],
        "lengths": columns[2],
        "tokens": tokens,  # (the regions as granted: another by their ids is refused)
    }


def refuse_bad_stores(
    keys: Sequence[Any], sizes: Sequence[int], refused: Counter[str], instance_id: str
) -> set[int]:
    """Positions of stores that cannot succeed: a bad key (not str or bytes, empty, over
    MAX_KEY_BYTES), an empty value, or a size below 0 (not bytes-like). One WARNING names the
    first; `refused` (the handler's `refused_stores`) counts them by reason."""

    if all_keys_valid(keys) and (not sizes or min(sizes) > 0):
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
