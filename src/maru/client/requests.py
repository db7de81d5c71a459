"""The read's batch request `Lookup` (LOOKUP_KV, sent when made: the caller works while the
server answers) and what its hits are (`MemoryInfo`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from maru.client.coherence import invalidate_ranges
from maru.common.checksum import checksums
from maru.common.errors import MaruError
from maru.common.memcopy import CopyFaultError, faulted
from maru.common.protocol import CHECKSUMS, Key, MsgType, pack_int64
from maru.common.region import RegionHandle

if TYPE_CHECKING:
    from maru.client.rpc import PendingReply
    from maru.client.session import Session

log = logging.getLogger(__name__)


class RegionsLost(MaruError):
    """The server restarted and forgot regions we had written into; their region ids may
    already name other memory, so a registration into them must not be sent again."""


@dataclass(frozen=True)
class MemoryInfo:
    """Where a stored value lives: `view`, read-only over the shared bytes (no copy);
    `address`, their address in this process; `page_index`, its first chunk's index in the
    region (LMCache's name), -1 off this handler's chunk grid (another chunk size, the cluster
    tier's pages), where a reader by page index would read other bytes."""

    view: memoryview
    region_id: int
    page_index: int
    offset: int
    length: int
    address: int


class Lookup:
    """A LOOKUP_KV in flight. `wait()` (or entering it) gives int64 `addresses` and `lengths`
    (0 for a miss), `infos()` a `MemoryInfo` per key; `lease`: the hits stay until `release()`
    (leaving the `with`) or the lease times out. A failed or malformed lookup reads as misses,
    never as an exception in the middle of a prefetch."""

    def __init__(self, session: Session, keys: Sequence[Key], lease: bool, *, send=True):
        """`send`: send the LOOKUP_KV now (False: a subclass has the answer already)."""
        self._s = session
        self._keys = keys
        self.n = len(keys)
        self.lease = lease
        self.lease_id = 0
        self.addresses: np.ndarray | None = None
        self.lengths: np.ndarray | None = None
        self._offsets: np.ndarray | None = None
        self._region_ids: np.ndarray | None = None
        self._checksums: np.ndarray | None = None  # the writers' (0: none, or a miss)
        self._corrupt: np.ndarray | None = None  # keys `corrupt()` found so far
        self._faulted: np.ndarray | None = None  # keys whose memory faulted: never read again
        # Whether the bytes read are the keys' own as far as the lease goes: None until
        # `release` says (a lease taken), then whether it held. A hit unlike its checksum is
        # a checksum mismatch only where it held: after the lease ended the page may have been
        # reused, which is no corruption (`_unlike`).
        self._held: bool | None = None if lease else True
        self._suspect: np.ndarray | None = None  # hits unlike their checksum, `_held` unknown
        self._mismatched: np.ndarray | None = None  # keys reported as checksum mismatches
        self._sums: np.ndarray | None = None  # per key, its checksum as `copy_out` read it
        self.copied: np.ndarray | None = None  # per key, whether `copy_out` copied it
        self._pending: PendingReply | None = None
        if self.n and send:
            try:
                body = {"keys": list(keys), "lease": lease}
                self._pending = session.request(MsgType.LOOKUP_KV, body)
            except MaruError as exc:
                log.warning("lookup of %d keys failed: %s", self.n, exc)

    def __enter__(self) -> Lookup:
        self.wait()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def wait(self) -> tuple[np.ndarray, np.ndarray]:
        if self.addresses is None:
            self._read_reply()
        assert self.addresses is not None and self.lengths is not None
        return self.addresses, self.lengths

    def _read_reply(self) -> None:
        n = self.n
        zeros = np.zeros(n, np.int64)
        self.addresses = self.lengths = self._offsets = self._region_ids = self._checksums = zeros
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        try:
            reply = pending.result()
        except MaruError as exc:
            log.warning("lookup of %d keys failed: %s", n, exc)
            return
        try:
            lease_id = reply.get("lease_id") or 0
            if type(lease_id) is not int:  # (its lease, if any, cannot be ended: it expires)
                raise TypeError(f"lease_id {lease_id!r:.40}")
            self.lease_id = lease_id
            region_ids, offsets, lengths = (
                np.frombuffer(reply[name], np.int64)
                for name in ("region_ids", "offsets", "lengths")
            )
            sums = np.frombuffer(reply[CHECKSUMS], np.int64)
            if not len(region_ids) == len(offsets) == len(lengths) == len(sums) == n:
                raise ValueError(f"{len(region_ids)} locations for {n} keys")
            handles = [RegionHandle.from_wire(fields) for fields in reply["regions"]]
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("lookup of %d keys: malformed reply (%s); treated as misses", n, exc)
            return
        # Region id 0 marks a miss (address 0); so does a location outside its region's mapping
        addresses = np.zeros(n, np.int64)
        found = np.zeros(n, bool)
        for handle in handles:
            try:
                mapped = self._s.map(handle)
            except (OSError, ValueError) as exc:
                # Freed since the reply (its lease ended: a file per region removed, or cut
                # short): nothing of it to read, its keys are misses, not the read's error
                log.warning("lookup: region %d cannot be mapped: %s", handle.region_id, exc)
                continue
            here = (region_ids == handle.region_id) & (offsets >= 0) & (lengths > 0)
            here &= offsets + lengths <= handle.length
            addresses[here] = offsets[here] + mapped.address
            found |= here
        if not found.all():
            lengths, offsets, region_ids, sums = (
                np.where(found, column, 0) for column in (lengths, offsets, region_ids, sums)
            )
        self.addresses, self.lengths = addresses, lengths
        self._offsets, self._region_ids, self._checksums = offsets, region_ids, sums

    def copy_out(
        self,
        copy: Callable[[np.ndarray], np.ndarray | None],
        length: int,
        *,
        start: int = 0,
        stop: int | None = None,
    ) -> np.ndarray:
        """Copy the hits among keys[start:stop] of `length` bytes: `copy(sources)` skips a 0
        source and returns the checksums as copied (for `corrupt()`) or None. Returns per key
        whether it was copied (also `copied`; another length is a logged miss). Then take
        `corrupt()`'s keys as misses, all if `release(confirm=True)` is False. A copy that
        faulted (`CopyFaultError`) makes the whole range misses (logged), not read again."""
        addresses, lengths = self.wait()
        seg = slice(start, self.n if stop is None else stop)
        copied = (lengths[seg] == length) & (lengths[seg] > 0)  # (a miss has length 0)
        if self._faulted is not None:  # (`invalidate` found their memory gone)
            copied &= ~self._faulted[seg]
        sources = addresses[seg]
        if not copied.all():  # copy the hits only (a 0 address is skipped)
            sources = np.where(copied, sources, 0)
            other = np.flatnonzero((lengths[seg] != 0) & (lengths[seg] != length))
            if len(other):
                keys = [self._keys[start + i] for i in other.tolist()]
                other_lengths(keys, lengths[seg][other].tolist(), length)
        if self.copied is None:
            self.copied = np.zeros(self.n, bool)
        try:
            sums = copy(sources)
        except CopyFaultError as exc:
            log.warning(
                "the copy of %d keys from %r on faulted on %d of them: all misses (%s)",
                int(np.count_nonzero(copied)),
                self._keys[seg.start] if seg.start < self.n else None,
                int(np.count_nonzero(faulted(exc))),
                exc.strerror,
            )
            if self._faulted is None:
                self._faulted = np.zeros(self.n, bool)
            self._faulted[seg] = True
            self.copied[seg] = False
            return np.zeros(len(copied), bool)
        self.copied[seg] = copied
        if sums is not None:
            if self._sums is None:
                self._sums = np.zeros(self.n, np.int64)
            self._sums[seg] = sums
        return copied

    def invalidate(self) -> None:
        """In software coherence, before a copy that does not invalidate what it reads (a
        caller's own, a device's DMA; the copy loops do): the hits' cache lines invalidated,
        so that no stale line of ours is read. A hit whose memory faults there (its region's
        file cut short) is a miss, logged: never given to a copy (`copy_out`) nor hashed."""
        addresses, lengths = self.wait()
        gone = invalidate_ranges(addresses, lengths)
        if gone is None:
            return
        gone &= lengths > 0
        if not gone.any():
            return
        log.warning(
            "%d of %d keys from %r on: their memory faulted when invalidated: misses",
            int(np.count_nonzero(gone)),
            self.n,
            self._keys[0],
        )
        self._lose(gone)

    def _lose(self, keys: np.ndarray) -> None:
        """`keys` (a bool per key) faulted: misses, never read again."""
        if self._faulted is None:
            self._faulted = np.zeros(self.n, bool)
        self._faulted |= keys

    def corrupt(self, computed: np.ndarray | None = None) -> np.ndarray:
        """Per key, True where (with `maru_checksums`) the hit's bytes no longer hash to its
        writer's checksum: misses. Call it after the copy, to catch a page changed before or
        during it. `computed`: per key the checksum as copied (0: hash it here, in the pool;
        default `copy_out`'s). Each key is logged at ERROR and counted in
        `MaruHandler.checksum_mismatches` once per lookup: under a lease, once `release` says
        the lease held (it ended: the page may have been rewritten since, a miss but not
        corruption; `release`). A hit whose memory faults here is a miss (logged)."""
        self.wait()
        assert self._checksums is not None and self._offsets is not None
        if self._corrupt is None:
            self._corrupt = np.zeros(self.n, bool)
        stored = self._checksums
        todo = np.flatnonzero(stored) if self._s.config.checksums else ()
        if self._faulted is not None and len(todo):  # (misses already; not read again)
            todo = todo[~self._faulted[todo]]
        if not len(todo):  # (a miss has no checksum)
            return self._corrupt.copy()
        if computed is None:
            computed = self._sums
        sums = np.zeros(self.n, np.int64) if computed is None else np.array(computed, np.int64)
        if len(sums) != self.n:
            raise ValueError(f"corrupt: {len(sums)} checksums for {self.n} keys")
        unhashed = todo[sums[todo] == 0]
        get = self._s.mapper.get
        views = []
        for region_id, offset, length in zip(
            self._region_ids[unhashed].tolist(),  # type: ignore[index]
            self._offsets[unhashed].tolist(),
            self.lengths[unhashed].tolist(),  # type: ignore[index]
        ):
            mapped = get(region_id)  # (unmapped since the reply: nothing to vouch for, a miss)
            views.append(mapped.view[offset : offset + length] if mapped else memoryview(b""))
        if views:
            try:
                sums[unhashed] = checksums(views)
            except CopyFaultError as exc:  # (cut short since the copy: nothing to vouch for)
                log.warning(
                    "the pool's memory of %d keys faulted when hashed: %d keys misses",
                    int(faulted(exc).sum()),
                    len(unhashed),
                )
                lost = np.zeros(self.n, bool)
                lost[unhashed] = True
                self._lose(lost)
                self._corrupt |= lost
                todo = todo[~lost[todo]]
        bad = np.zeros(self.n, bool)
        bad[todo] = sums[todo] != stored[todo]
        bad &= ~self._corrupt  # said already
        self._corrupt |= bad
        at = np.flatnonzero(bad)
        if len(at):
            self._unlike(at)
        return self._corrupt.copy()

    def _unlike(self, at: np.ndarray) -> None:
        """Hits `at` (indices) whose bytes are unlike their writer's checksum: reported as
        checksum mismatches where the lease held (or none was asked), held back until
        `release` says so where it is not known yet, not reported where it ended."""
        if self._held is None:
            self._suspect = at if self._suspect is None else np.union1d(self._suspect, at)
        elif self._held:
            if self._mismatched is None:
                self._mismatched = np.zeros(self.n, bool)
            self._mismatched[at] = True
            assert self.lengths is not None and self._region_ids is not None
            assert self._offsets is not None and self._checksums is not None
            checksum_mismatches(
                self._s,
                [self._keys[i] for i in at.tolist()],
                self._region_ids[at],
                self._offsets[at],
                self.lengths[at],
                self._checksums[at],
            )
        else:
            log.debug("%d keys unlike their checksum after their lease ended: misses", len(at))

    def mismatched(self) -> np.ndarray:
        """Per key, whether it was reported as a checksum mismatch (a miss; for the caller's
        statistics): not a hit whose entry changed or whose lease ended since the lookup."""
        if self._mismatched is None:
            return np.zeros(self.n, bool)
        return self._mismatched.copy()

    def _settle(self, held: bool | None) -> None:
        """Once, at the first `release`: `held`, whether the lease held until then (None:
        not asked, taken as held). The mismatches held back are reported, or, if it ended,
        the hits are counted in `leases_ended` and the mismatches said to be no corruption."""
        if self._held is not None:
            return
        self._held = held is not False
        suspect, self._suspect = self._suspect, None
        if not self._held:
            hits = int(np.count_nonzero(self.lengths)) if self.lengths is not None else 0
            self._s.leases_ended += hits
            if suspect is not None:
                log.warning(
                    "%d of %d hits no longer match their checksum, but their lease ended "
                    "during the copy: rewritten since, misses (not checksum mismatches)",
                    len(suspect),
                    hits,
                )
        elif suspect is not None:
            self._unlike(suspect)

    def infos(self) -> list[MemoryInfo | None]:
        """A `MemoryInfo` per key (None for a miss): read-only views into the shared memory.
        With `maru_checksums`, a hit whose bytes no longer match their checksum is None; in
        software coherence, its lines are invalidated first (a fault there: None)."""
        addresses, lengths = self.wait()
        assert self._offsets is not None and self._region_ids is not None
        chunk = self._s.chunks.chunk_size
        out: list[MemoryInfo | None] = []
        mapper = self._s.mapper
        self.invalidate()  # (a fault there: a miss, not hashed by `corrupt`)
        bad = self.corrupt()
        corrupt = (bad if self._faulted is None else bad | self._faulted).tolist()
        for address, length, offset, region_id, bad in zip(
            addresses.tolist(),
            lengths.tolist(),
            self._offsets.tolist(),
            self._region_ids.tolist(),
            corrupt,
        ):
            mapped = mapper.get(region_id) if address and not bad else None
            if mapped is None:
                out.append(None)
                continue
            view = mapped.view[offset : offset + length].toreadonly()
            page = -1 if offset % chunk else offset // chunk  # (see MemoryInfo)
            out.append(MemoryInfo(view, region_id, page, offset, length, address))
        return out

    def release(self, confirm: bool = False) -> bool:
        """End the lease, not waiting by default (an unanswered lease expires). `confirm`:
        True if the lease held until now, so what was read is the keys' bytes; False if it
        ended before (--lease-timeout, a server restart): pages may have been reused, and what
        was read must be taken as misses."""
        if self.addresses is None and self._pending is not None:
            self.wait()  # a lease may be held even if the caller never looked
        lease_id, self.lease_id = self.lease_id, 0
        if not lease_id:
            # Nothing was leased: fine if nothing was found; hits that came without the lease
            # asked for (the server did not know us) were read unprotected.
            held = not (confirm and self.lease and self.lengths is not None and self.lengths.any())
        else:
            try:
                pending = self._s.request(MsgType.RELEASE, {"leases": [lease_id]})
                held = not confirm or pending.result()["released"] == 1
            except MaruError as exc:
                level = logging.WARNING if confirm else logging.DEBUG
                log.log(level, "releasing lease %d failed: %s", lease_id, exc)
                held = False
        self._settle(held if confirm else None)
        return held


def other_lengths(keys: Sequence[Key], lengths: Sequence[int], expected: int) -> None:
    """Hits of another length than the reader's (another geometry): misses, each logged."""

    for key, length in zip(keys, lengths):
        log.warning(
            "key %.200r has %d bytes, expected %d: treated as a miss", key, length, expected
        )


def checksum_mismatches(
    session: Session,
    keys: Sequence[Key],
    region_ids: np.ndarray,
    offsets: np.ndarray,
    lengths: np.ndarray,
    sums: np.ndarray,
) -> None:
    """Hits whose bytes did not match their writer's checksum after the copy (taken as
    misses): each logged at ERROR, all counted in `MaruHandler.checksum_mismatches`, and told
    to the server in one CORRUPT_KV (where each was read, and its writer's checksum), which
    drops the entries still registered there: else the first writer's corrupt entry would
    refuse every correct store of the key for good. Not waited for; a failure to send is
    logged, never raised into the read."""
    for key, length in zip(keys, lengths):
        log.error(
            "key %.200r: its %d bytes no longer match the checksum its writer stored: "
            "treated as a miss",
            key,
            int(length),
        )
    session.checksum_mismatches += len(keys)
    if not len(keys):
        return
    body = {
        "keys": list(keys),
        "region_ids": pack_int64(region_ids.tolist()),
        "offsets": pack_int64(offsets.tolist()),
        "lengths": pack_int64(lengths.tolist()),
        CHECKSUMS: pack_int64(sums.tolist()),
    }
    try:
        session.request(MsgType.CORRUPT_KV, body)  # (its reply is taken in and dropped)
    except MaruError as exc:
        log.warning("could not report %d corrupt entries to the server: %s", len(keys), exc)


BYTES_LIKE = "bytes, bytearray, memoryview, a contiguous numpy array"
