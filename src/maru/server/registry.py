"""The server's state: instances, regions, and the key -> (region, offset, length) registry.

Pure bookkeeping, no sockets and no page bytes, so every rule can be tested directly:
- write-then-register: a key exists only once its owner registered it, after writing its bytes;
- first writer wins: registering an existing key changes nothing;
- a pinned key cannot be deleted;
- deferred free: a region goes back to the pool only when its owner returned it (or is gone)
  *and* no registered key still points into it;
- page reuse: when a key in instance X's region disappears, X is told (the `freed` list
  piggy-backed on its next reply) so it can reuse those pages;
- eviction: a CLOCK (second-chance) approximation of least-recently-used (a lookup or exists
  hit sets a bit; eviction walks oldest first and gives a key with the bit set a second
  chance), never a pinned key and never a key under a read lease;
- crash safety: an instance that stops heart-beating is reaped (pins and leases released,
  regions returned); every change is written to the journal (if any) before it is answered.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import compress, repeat
from operator import is_
from typing import Any, Protocol

from maru.common.protocol import (
    KEY_TYPES,
    MAX_KEY_BYTES,
    DeleteStatus,
    ErrorCode,
    ProtocolError,
    RegisterStatus,
)
from maru.common.region import RegionHandle
from maru.server.keyindex import KeyEntry, KeyIndex, release_entries
from maru.server.logs import Throttle
from maru.server.pool import Pool, PoolFullError
from maru.server.token import TokenSigner

log = logging.getLogger(__name__)

Key = str | bytes


class JournalSink(Protocol):
    def append(self, record: Any) -> None: ...


@dataclass
class Region:
    region_id: int
    owner: str
    path: str
    offset: int
    length: int
    token: str
    returned: bool = False  # owner gave it back (or disconnected); free once live_keys == 0
    live_keys: int = 0
    page_size: int = 0  # the owner's page size (from its handshake); 0: unknown
    live_bytes: int = 0  # stats: bytes of the keys that live here
    live_pages: int = 0  # stats: pages they occupy (one per key when page_size is unknown)

    def pages_for(self, length: int) -> int:
        return -(-length // self.page_size) if self.page_size else 1

    def handle(self) -> RegionHandle:
        return RegionHandle(
            self.region_id, self.path, self.offset, self.length, self.token, self.owner
        )


@dataclass
class Lease:
    owner: str | None
    entries: list[KeyEntry]  # the entries held (not their keys: ending it needs no lookup)
    expires: float


@dataclass
class Instance:
    instance_id: str
    pid: int = 0
    page_size: int = 0  # reported at handshake; informs per-instance page stats
    regions: set[int] = field(default_factory=set)
    freed: list[list[int]] = field(default_factory=list)  # [region_id, offset, length] to reuse
    pins: Counter = field(default_factory=Counter)  # key -> pins this instance holds
    leases: set[int] = field(default_factory=set)
    last_seen: float = field(default_factory=time.monotonic)
    keys_registered: int = 0
    bytes_registered: int = 0
    hits: int = 0
    misses: int = 0
    exists_hits: int = 0  # EXISTS checks (what SGLang asks before it prefetches)
    exists_misses: int = 0
    evicted: int = 0  # keys evicted out of this instance's regions


def check_key(key: Any) -> Key:
    if type(key) is str:  # exact types: what msgpack decodes and the key index holds
        if len(key) > MAX_KEY_BYTES // 4 and len(key.encode()) > MAX_KEY_BYTES:
            raise ProtocolError(ErrorCode.KEY_TOO_LONG, f"key longer than {MAX_KEY_BYTES} bytes")
        return key
    if type(key) is bytes:
        if len(key) > MAX_KEY_BYTES:
            raise ProtocolError(ErrorCode.KEY_TOO_LONG, f"key longer than {MAX_KEY_BYTES} bytes")
        return key
    raise ProtocolError(
        ErrorCode.BAD_REQUEST, f"a key must be str or bytes, got {type(key).__name__}"
    )


class Registry:
    def __init__(
        self,
        pool: Pool,
        signer: TokenSigner,
        *,
        journal: JournalSink | None = None,
        high_watermark: float = 0.95,
        low_watermark: float = 0.85,
        lease_seconds: float = 10.0,
    ):
        if not 0 < low_watermark <= high_watermark <= 1:
            raise ValueError("watermarks must satisfy 0 < low <= high <= 1")
        self.pool = pool
        self.signer = signer
        self.journal = journal
        self.high_watermark = high_watermark
        self.low_watermark = low_watermark
        self.lease_seconds = lease_seconds
        self.instances: dict[str, Instance] = {}
        self.regions: dict[int, Region] = {}
        # Oldest first: insertion order, except that a key eviction spared (its CLOCK bit
        # was set) moves to the end. Lookups do not reorder it. Batches probe it with its
        # batch calls (`get_many`, `setdefault_many`, `lookup_columns`), which overlap their
        # keys' cache misses.
        self.keys: KeyIndex = KeyIndex()
        self.live_bytes = 0  # sum of registered key lengths
        self.leases: dict[int, Lease] = {}
        self._lease_expiry: list[tuple[float, int]] = []  # heap of (expires, lease_id)
        self._lease_ids = itertools.count(1)
        self._next_region_id = 1
        self.log_throttle = Throttle(10.0)  # per-store events under memory pressure
        self.counters: dict[str, int] = {
            "evictions": 0,
            "bytes_evicted": 0,
            "eviction_rounds": 0,
            "leases_expired": 0,
            "releases_refused": 0,  # RELEASE of a lease another instance holds
            "instances_reaped": 0,
            "regions_allocated": 0,
            "regions_freed": 0,
            "keys_registered": 0,
            "bytes_registered": 0,
            "keys_duplicate": 0,
            "keys_deleted": 0,
            "lookups": 0,
            "hits": 0,
            "misses": 0,
            "exists": 0,
            "exists_hits": 0,
            "exists_misses": 0,
        }

    # -- journal -----------------------------------------------------------------------------

    def _log(self, *record: Any) -> None:
        if self.journal is not None:
            self.journal.append(list(record))

    # -- instances ---------------------------------------------------------------------------

    def instance(self, instance_id: Any) -> Instance:
        if not isinstance(instance_id, str) or instance_id not in self.instances:
            raise ProtocolError(
                ErrorCode.UNKNOWN_INSTANCE, f"unknown instance {instance_id!r}: handshake first"
            )
        inst = self.instances[instance_id]
        inst.last_seen = time.monotonic()
        return inst

    def touch(self, instance_id: Any) -> None:
        """Any message naming a known instance is a sign of life (heartbeats, and the lookups
        of a read-only client, do not go through `instance()`)."""
        inst = self.instances.get(instance_id) if isinstance(instance_id, str) else None
        if inst is not None:
            inst.last_seen = time.monotonic()

    def handshake(self, instance_id: str, pid: int, page_size: int = 0) -> list[RegionHandle]:
        """(Re)attach an instance; returns the regions it still owns (after a reconnect).
        `page_size` (the client's page size, 0 if unknown) only feeds the page statistics."""
        if not isinstance(instance_id, str) or not instance_id or len(instance_id) > 128:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "instance_id must be a non-empty string")
        inst = self.instances.get(instance_id)
        if inst is None:
            inst = self.instances[instance_id] = Instance(instance_id, pid)
            log.info(
                "instance %s connected (pid %d)", instance_id, pid, extra={"instance": instance_id}
            )
        else:
            log.info(
                "instance %s reconnected (pid %d)",
                instance_id,
                pid,
                extra={"instance": instance_id},
            )
            inst.pid = pid
        inst.page_size = page_size
        inst.last_seen = time.monotonic()
        return [self.regions[r].handle() for r in sorted(inst.regions)]

    def used_extents(self, region_ids: set[int]) -> dict[int, list[list[int]]]:
        """[offset, length] of every key in these regions. A process that takes over an
        instance id (its predecessor crashed before being reaped) must not hand out pages that
        registered keys still occupy. Walks all keys: only on such a handshake."""
        used: dict[int, list[list[int]]] = {r: [] for r in region_ids}
        for entry in list(self.keys.values()):
            extents = used.get(entry.region_id)
            if extents is not None:
                extents.append([entry.offset, entry.length])
        return used

    def disconnect(self, instance_id: str, reason: str = "disconnected") -> None:
        """Forget an instance: drop its pins and leases; its regions become owner-less and are
        freed once no key points into them (its keys stay readable until evicted)."""
        inst = self.instances.pop(instance_id, None)
        if inst is None:
            return
        if inst.pins:
            self._log("X", instance_id)  # its pins are gone
        for key, count in inst.pins.items():
            entry = self.keys.get(key)
            if entry is not None:
                entry.pins = max(0, entry.pins - count)
        for lease_id in list(inst.leases):
            self._end_lease(lease_id)
        for region_id in sorted(inst.regions):
            self._release_region(self.regions[region_id])
        log.info(
            "instance %s %s: %d pins and %d leases released, %d regions returned",
            instance_id,
            reason,
            sum(inst.pins.values()),
            len(inst.leases),
            len(inst.regions),
            extra={"instance": instance_id},
        )

    def reap(self, timeout: float, now: float | None = None) -> list[str]:
        """Disconnect instances not heard from for `timeout` seconds (crashed clients)."""
        now = time.monotonic() if now is None else now
        dead = [i.instance_id for i in self.instances.values() if now - i.last_seen > timeout]
        for instance_id in dead:
            self.disconnect(instance_id, reason=f"reaped after {timeout:g}s without a heartbeat")
            self.counters["instances_reaped"] += 1
        return dead

    def take_freed(self, instance_id: Any) -> list[list[int]]:
        inst = self.instances.get(instance_id) if isinstance(instance_id, str) else None
        if inst is None or not inst.freed:
            return []
        freed, inst.freed = inst.freed, []
        return freed

    # -- regions -----------------------------------------------------------------------------

    def request_region(self, instance_id: str, size: int) -> RegionHandle:
        inst = self.instance(instance_id)
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, f"region size must be positive, got {size!r}"
            )
        length = self.pool.round_up(size)
        region_id = self._next_region_id
        while True:
            try:
                path, offset = self.pool.allocate(region_id, length)
                break
            except PoolFullError as exc:
                # Reclaim: evict keys of regions whose owner is gone, so the region frees.
                if self._evict_orphans(length):
                    continue
                held = self.log_throttle.allow(("refused", instance_id))
                if held is not None:
                    log.warning(
                        "region request of %d bytes by %s refused: %s%s",
                        size,
                        instance_id,
                        exc,
                        self.log_throttle.note(held),
                        extra={"instance": instance_id},
                    )
                raise ProtocolError(ErrorCode.POOL_FULL, str(exc)) from None
        self._next_region_id += 1
        token = self.signer.sign(region_id, path, offset, length)
        self._add_region(
            Region(region_id, instance_id, path, offset, length, token, page_size=inst.page_size)
        )
        inst.regions.add(region_id)
        self.counters["regions_allocated"] += 1
        self._log("R", region_id, instance_id, path, offset, length, token)
        log.info(
            "region %d (%d bytes at %s+%d) allocated to %s",
            region_id,
            length,
            path,
            offset,
            instance_id,
            extra={"instance": instance_id, "region": region_id},
        )
        return self.regions[region_id].handle()

    def _add_region(self, region: Region) -> None:
        self.regions[region.region_id] = region

    def _verified_region(self, region_id: Any, token: Any) -> Region:
        region = self.regions.get(region_id) if type(region_id) is int else None
        if region is None:
            raise ProtocolError(ErrorCode.UNKNOWN_REGION, f"unknown region {region_id!r}")
        if not self.signer.verify(
            token, region.region_id, region.path, region.offset, region.length
        ):
            raise ProtocolError(ErrorCode.BAD_TOKEN, f"wrong token for region {region_id}")
        return region

    def region_access(self, region_id: Any, token: Any) -> RegionHandle:
        return self._verified_region(region_id, token).handle()

    def return_region(self, instance_id: str, region_id: Any, token: Any) -> None:
        inst = self.instance(instance_id)
        region = self._verified_region(region_id, token)
        if region.owner != instance_id or region.returned:
            raise ProtocolError(
                ErrorCode.NOT_OWNER, f"region {region_id} is not owned by {instance_id}"
            )
        inst.regions.discard(region.region_id)
        self._release_region(region)

    def _release_region(self, region: Region) -> None:
        region.returned = True
        self._log("T", region.region_id)
        if region.live_keys == 0:
            self._free_region(region)
        else:
            log.info(
                "region %d returned by %s; freeing deferred until its %d keys go",
                region.region_id,
                region.owner,
                region.live_keys,
                extra={"instance": region.owner, "region": region.region_id},
            )

    def _free_region(self, region: Region) -> None:
        self.pool.release(region.path, region.offset)
        del self.regions[region.region_id]
        self.counters["regions_freed"] += 1
        self._log("F", region.region_id)
        log.info(
            "region %d (%d bytes) of %s freed",
            region.region_id,
            region.length,
            region.owner,
            extra={"instance": region.owner, "region": region.region_id},
        )

    def list_allocations(self, instance_id: str | None = None) -> list[RegionHandle]:
        return [
            r.handle()
            for r in self.regions.values()
            if instance_id is None or r.owner == instance_id
        ]

    # -- keys --------------------------------------------------------------------------------

    def register(self, instance_id: str, entries: list[Any]) -> list[int]:
        """Publish written pages. Each entry is [key, region_id, offset, length]."""
        inst = self.instance(instance_id)
        statuses: list[int] = []
        registered: list[list[Any]] = []
        for entry in entries:
            try:
                key, region_id, offset, length = entry
                key = check_key(key)
            except (TypeError, ValueError, ProtocolError):
                statuses.append(RegisterStatus.REJECTED)
                continue
            if key in self.keys:
                statuses.append(RegisterStatus.EXISTS)
                self.counters["keys_duplicate"] += 1
                continue
            # `type(...) is int`: a bool is an int to isinstance, and True would be offset 1.
            region = self.regions.get(region_id) if type(region_id) is int else None
            if (
                region is None
                or region.owner != instance_id
                or region.returned
                or type(offset) is not int
                or type(length) is not int
                or offset < 0
                or length <= 0
                or offset + length > region.length
            ):
                statuses.append(RegisterStatus.REJECTED)
                continue
            self._insert_key(key, KeyEntry(region.region_id, offset, length))
            inst.keys_registered += 1
            inst.bytes_registered += length
            registered.append([key, region.region_id, offset, length])
            statuses.append(RegisterStatus.REGISTERED)
        if registered:
            self._log("K", registered)
            self.counters["keys_registered"] += len(registered)
            self.counters["bytes_registered"] += sum(e[3] for e in registered)
            self.evict_to_watermark(e[0] for e in registered)
        return statuses

    def register_columnar(
        self, instance_id: str, keys: list[Any], region_id: Any, offsets: list[Any], length: Any
    ) -> list[int]:
        """`register` for a batch in one region with one length (REGISTER_KV in columnar form,
        what MaruStorage sends): `keys[i]` is at `offsets[i]`. The same rules and outcomes,
        with the region checked once per batch rather than once per key."""
        inst = self.instance(instance_id)
        region = self.regions.get(region_id) if type(region_id) is int else None
        rejected = int(RegisterStatus.REJECTED)
        if (
            region is None
            or region.owner != instance_id
            or region.returned
            or type(length) is not int
            or length <= 0
        ):
            return [rejected] * len(keys)
        table, last, rid = self.keys, region.length - length, region.region_id
        registered, exists = int(RegisterStatus.REGISTERED), int(RegisterStatus.EXISTS)
        max_key, short = MAX_KEY_BYTES, MAX_KEY_BYTES // 4
        n = len(keys)
        # The usual batch (SGLang's 128 pages) has only valid keys and offsets: checked with
        # one pass in C per condition instead of a Python iteration per key. Then
        # `setdefault` inserts in C with the loop's first-writer-wins rule (a key registered
        # before, or earlier in the batch, keeps its entry: EXISTS). Anything else (a bad or
        # long key, a bad offset) takes the loop below, which decides key by key.
        if (
            n
            and len(offsets) == n
            and set(map(type, keys)) <= KEY_TYPES
            and max(map(len, keys)) <= short  # so no str key needs encoding to be measured
            and set(map(type, offsets)) == {int}  # not bool, a subclass
            and min(offsets) >= 0
            and max(offsets) <= last
        ):
            entries = list(map(KeyEntry, repeat(rid), offsets, repeat(length)))
            stored = table.setdefault_many(keys, entries)
            if stored == entries:  # an identity check per key: all of them are new
                self._registered(inst, region, keys, offsets, length)
                return [registered] * n
            new = list(map(is_, stored, entries))
            statuses = [registered if s else exists for s in new]
            self.counters["keys_duplicate"] += n - sum(new)
            if any(new):
                self._registered(
                    inst,
                    region,
                    list(compress(keys, new)),
                    list(compress(offsets, new)),
                    length,
                )
            return statuses
        statuses: list[int] = []
        added_keys: list[Key] = []
        added_offsets: list[int] = []
        for key, offset in zip(keys, offsets):
            kind = type(key)
            if not (
                (kind is str and (len(key) <= short or len(key.encode()) <= max_key))
                or (kind is bytes and len(key) <= max_key)
            ):
                statuses.append(rejected)
            elif key in table:
                statuses.append(exists)
            elif type(offset) is not int or not 0 <= offset <= last:
                statuses.append(rejected)
            else:
                table[key] = KeyEntry(rid, offset, length)
                added_keys.append(key)
                added_offsets.append(offset)
                statuses.append(registered)
        duplicates = statuses.count(exists)
        if duplicates:
            self.counters["keys_duplicate"] += duplicates
        if added_keys:
            self._registered(inst, region, added_keys, added_offsets, length)
        return statuses

    def _registered(
        self, inst: Instance, region: Region, keys: list[Key], offsets: list[int], length: int
    ) -> None:
        """The bookkeeping of `_insert_key` and `register`, once for a batch that
        `register_columnar` put in `region` (`keys[i]` at `offsets[i]`, each `length` long).
        Journaled as one "C" record: the batch's own lists, not a list per key."""
        n = len(keys)
        region.live_keys += n
        region.live_bytes += n * length
        region.live_pages += n * region.pages_for(length)
        self.live_bytes += n * length
        inst.keys_registered += n
        inst.bytes_registered += n * length
        self._log("C", keys, region.region_id, offsets, length)
        self.counters["keys_registered"] += n
        self.counters["bytes_registered"] += n * length
        self.evict_to_watermark(keys)

    def _insert_key(self, key: Key, entry: KeyEntry) -> None:
        self.keys[key] = entry
        region = self.regions[entry.region_id]
        region.live_keys += 1
        region.live_bytes += entry.length
        region.live_pages += region.pages_for(entry.length)
        self.live_bytes += entry.length

    def lookup(
        self, keys: list[Any], instance_id: str | None = None
    ) -> tuple[list[list[int] | None], list[RegionHandle]]:
        """Locations of `keys` (None for a miss) and the handles of the regions they live in.
        A hit counts as use (sets the key's CLOCK bit)."""
        locations: list[list[int] | None] = []
        region_ids: set[int] = set()
        for entry in self.keys.get_many(keys):
            if entry is None:
                locations.append(None)
            else:
                entry.referenced = True
                locations.append([entry.region_id, entry.offset, entry.length])
                region_ids.add(entry.region_id)
        hits = len(keys) - locations.count(None)
        self.counters["lookups"] += len(keys)
        self.counters["hits"] += hits
        self.counters["misses"] += len(keys) - hits
        inst = self.instances.get(instance_id) if instance_id else None
        if inst is not None:
            inst.hits += hits
            inst.misses += len(keys) - hits
        return locations, [self.regions[r].handle() for r in region_ids]

    def lookup_columnar(
        self, keys: list[Key], instance_id: str | None = None, lease: bool = False
    ) -> tuple[bytes, bytes, bytes, list[RegionHandle], int]:
        """`lookup` (and, with `lease`, `lease`) in one pass over str/bytes keys, for LOOKUP_KV
        in columnar form: region ids, offsets and lengths as bytes of native int64s (0, 0, 0
        for a miss; region ids start at 1), the handles of those regions, and the lease id
        (0: none). The per-key work (probe, CLOCK bit, lease count, columns) is one call
        into the key index (in C with the extension)."""
        held, region_ids, offsets, lengths = self.keys.lookup_columns(keys, lease)
        hits = len(held)
        misses = len(keys) - hits
        self.counters["lookups"] += len(keys)
        self.counters["hits"] += hits
        self.counters["misses"] += misses
        inst = self.instances.get(instance_id) if instance_id else None
        if inst is not None:
            inst.hits += hits
            inst.misses += misses
        lease_id = self._add_lease(held, instance_id) if lease and held else 0
        regions = self.regions
        ids = set(memoryview(region_ids).cast("q"))
        ids.discard(0)
        handles = [regions[r].handle() for r in ids]
        return region_ids, offsets, lengths, handles, lease_id

    def lease(self, keys: list[Any], owner: str | None, seconds: float | None = None) -> int:
        """Hold the keys that exist against eviction and deletion until `release` or expiry
        (so a crashed reader cannot hold them forever). Returns the lease id (0: nothing)."""
        held = [entry for entry in self.keys.get_many(keys) if entry is not None]
        if not held:
            return 0
        for entry in held:
            entry.leases += 1
        return self._add_lease(held, owner, seconds)

    def _add_lease(
        self, held: list[KeyEntry], owner: str | None, seconds: float | None = None
    ) -> int:
        """Record a lease on `held`, whose `leases` counts the caller already raised."""
        lease_id = next(self._lease_ids)
        expires = time.monotonic() + (self.lease_seconds if seconds is None else seconds)
        self.leases[lease_id] = Lease(owner, held, expires)
        heapq.heappush(self._lease_expiry, (expires, lease_id))
        inst = self.instances.get(owner) if owner else None
        if inst is not None:
            inst.leases.add(lease_id)
        return lease_id

    def release(self, lease_ids: list[Any]) -> int:
        return sum(self._end_lease(i) for i in lease_ids if type(i) is int)  # not a bool

    def _end_lease(self, lease_id: int) -> bool:
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            return False
        # The entries themselves, not a lookup by key: no probe per key, and a key dropped
        # and registered again (a new entry) is not touched by the old entry's lease.
        release_entries(lease.entries)
        inst = self.instances.get(lease.owner) if lease.owner else None
        if inst is not None:
            inst.leases.discard(lease_id)
        return True

    def expire_leases(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        expired = 0
        while self._lease_expiry and self._lease_expiry[0][0] <= now:
            _, lease_id = heapq.heappop(self._lease_expiry)
            if self._end_lease(lease_id):
                expired += 1
        self.counters["leases_expired"] += expired
        return expired

    def exists(self, keys: list[Any], instance_id: str | None = None) -> list[bool]:
        """Membership; a hit counts as use, like a lookup (SGLang asks before it prefetches)."""
        entries = self.keys.get_many(keys)
        out = [entry is not None for entry in entries]
        for entry in entries:
            if entry is not None:
                entry.referenced = True
        hits = out.count(True)
        counters = self.counters
        counters["exists"] += len(out)
        counters["exists_hits"] += hits
        counters["exists_misses"] += len(out) - hits
        inst = self.instances.get(instance_id) if instance_id else None
        if inst is not None:
            inst.exists_hits += hits
            inst.exists_misses += len(out) - hits
        return out

    def pin(self, keys: list[Any], owner: str | None = None) -> list[bool]:
        """Pinned keys are neither deleted nor evicted. Pins held by an instance are released
        when it disconnects or is reaped."""
        inst = self.instances.get(owner) if owner else None
        out = []
        pinned: list[Key] = []
        for key in keys:
            entry = self.keys.get(key)  # None for a miss, or a key that is not str or bytes
            if entry is not None:
                entry.pins += 1
                pinned.append(key)
                if inst is not None:
                    inst.pins[key] += 1
            out.append(entry is not None)
        if pinned:  # pins outlive a server restart (until their holder is reaped)
            self._log("P", owner if inst is not None else "", pinned)
        return out

    def unpin(self, keys: list[Any], owner: str | None = None) -> list[bool]:
        inst = self.instances.get(owner) if owner else None
        out = []
        unpinned: list[Key] = []
        for key in keys:
            entry = self.keys.get(key)  # None for a miss, or a key that is not str or bytes
            ok = entry is not None and entry.pins > 0
            if ok and inst is not None:
                ok = inst.pins[key] > 0  # an instance can only drop pins it holds
                if ok:
                    inst.pins[key] -= 1
                    if not inst.pins[key]:
                        del inst.pins[key]
            if ok:
                entry.pins -= 1
                unpinned.append(key)
            out.append(ok)
        if unpinned:
            self._log("U", owner if inst is not None else "", unpinned)
        return out

    def delete(self, keys: list[Any]) -> list[int]:
        table = self.keys
        # The usual batch (str or bytes keys, every one registered, none twice, none pinned
        # or leased) is checked in C, a pass per condition; otherwise the loop below decides
        # key by key, the same way.
        entries = table.get_many(keys)
        if (
            None not in entries
            and len(set(keys)) == len(keys)
            and not any([e.pins or e.leases for e in entries])  # none busy
        ):
            out = [DeleteStatus.DELETED] * len(keys)
        else:
            out = []
            victims: dict[Key, KeyEntry] = {}
            for key in keys:
                entry = table.get(key)
                if entry is None or key in victims:
                    out.append(DeleteStatus.NOT_FOUND)
                elif entry.busy:
                    out.append(DeleteStatus.PINNED)
                else:
                    victims[key] = entry
                    out.append(DeleteStatus.DELETED)
            keys, entries = list(victims), list(victims.values())
        self._drop_keys(keys, entries)
        self.counters["keys_deleted"] += len(keys)
        return out

    def delete_prefix(self, prefix: Any) -> tuple[int, int]:
        """Delete every key starting with `prefix` that is not pinned or leased (an operator or
        `clear()` action). Returns (deleted, skipped). Walks the whole registry: not hot."""
        if not isinstance(prefix, (str, bytes)) or not prefix:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "prefix must be a non-empty str or bytes")
        matching = [k for k in self.keys if type(k) is type(prefix) and k.startswith(prefix)]
        statuses = self.delete(matching)
        deleted = statuses.count(DeleteStatus.DELETED)
        return deleted, len(matching) - deleted

    def clear(self) -> tuple[int, int]:
        """Delete every key that is not pinned or leased (an operator's `maru clear`).
        Returns (deleted, skipped)."""
        statuses = self.delete(list(self.keys))
        deleted = statuses.count(DeleteStatus.DELETED)
        return deleted, len(statuses) - deleted

    def list_keys(self, prefix: Any = None, limit: int = 100) -> tuple[list[list[Any]], bool]:
        """Up to `limit` keys starting with `prefix` (every key when it is None or empty), most
        recently used first as far as CLOCK knows (the reverse of eviction order: keys used
        since eviction last looked at them, then the others, each newest first), as
        [key, length, owner instance]; and whether more keys matched. Walks the registry (at
        most twice) until limit + 1 matches: an operator action (`maru keys`), not hot."""
        if prefix is not None and not isinstance(prefix, (str, bytes)):
            raise ProtocolError(ErrorCode.BAD_REQUEST, "prefix must be a str or bytes")
        out: list[list[Any]] = []
        keys, regions = self.keys, self.regions
        for referenced in (True, False):
            for key, entry in keys.items(reverse=True):
                if entry.referenced is not referenced:
                    continue
                if prefix and not (type(key) is type(prefix) and key.startswith(prefix)):
                    continue
                if len(out) >= limit:
                    return out, True
                region = regions.get(entry.region_id)
                out.append([key, entry.length, region.owner if region is not None else ""])
        return out, False

    def _drop_keys(self, keys: list[Key], entries: list[KeyEntry]) -> None:
        """Remove keys: journal first (so a replay never sees a region freed before its keys
        are gone), then free pages / regions and tell the owners.

        Per region rather than per key (a delete or an eviction round is a batch, mostly in
        one region): its live_* counters change once, a returned region is freed once its
        last key is gone, and the owners' freed-page notices are appended in key order. The
        outcome, the order of "F" records and of notices included, is that of dropping the
        keys one by one. `keys[i]` (all different) is registered with `entries[i]`."""
        if not keys:
            return
        self._log("D", keys)
        table = self.keys
        for key in keys:
            del table[key]
        region_ids = [e.region_id for e in entries]
        lengths = [e.length for e in entries]
        self.live_bytes -= sum(lengths)
        # Each region's key lengths; regions in the order of their last key (when dropping
        # one by one would free a returned region).
        groups: dict[int, list[int]]
        if region_ids.count(region_ids[0]) == len(region_ids):
            groups = {region_ids[0]: lengths}
        else:
            groups = {rid: [] for rid in reversed(dict.fromkeys(reversed(region_ids)))}
            for rid, length in zip(region_ids, lengths):
                groups[rid].append(length)
        notify: dict[int, list[list[int]]] = {}  # region id -> its owner's freed list
        regions, instances = self.regions, self.instances
        for rid, group in groups.items():
            region = regions[rid]
            region.live_keys -= len(group)
            region.live_bytes -= sum(group)
            region.live_pages -= sum(  # per distinct length: mostly one
                region.pages_for(length) * group.count(length) for length in set(group)
            )
            if region.returned:
                if region.live_keys == 0:
                    self._free_region(region)
            else:
                owner = instances.get(region.owner)
                if owner is not None:
                    notify[rid] = owner.freed
        if not notify:
            return
        notices = [[e.region_id, e.offset, e.length] for e in entries]
        lists = list({id(freed): freed for freed in notify.values()}.values())
        if len(notify) == len(groups) and len(lists) == 1:  # one owner, told of every key
            lists[0].extend(notices)
        else:
            for rid, notice in zip(region_ids, notices):
                freed = notify.get(rid)
                if freed is not None:
                    freed.append(notice)

    # -- eviction ----------------------------------------------------------------------------

    def _evict(
        self,
        want_bytes: int,
        accept: Any = None,
        reason: str = "",
        protect: Any = (),
        second_chance: bool = True,
    ) -> int:
        """Evict idle keys (optionally only those `accept(entry)` likes, never those in
        `protect`), oldest first, until `want_bytes` are freed; returns the bytes freed. One
        log line per round.

        CLOCK, an approximation of least-recently-used: a candidate whose `referenced` bit is
        set (a lookup or exists hit since eviction last looked at it) gets a second chance
        instead: its bit is cleared and it moves to the newest end of the index. When a pass
        frees too little and spared some keys, a second pass goes on (those keys now have
        their bits cleared), so eviction makes progress even when every candidate was used;
        at most two passes. `second_chance=False`: evict in index order, ignoring the bits."""
        freed = 0
        victims: dict[Key, KeyEntry] = {}
        keys = self.keys
        for second_pass in (False, True):
            spared: list[Key] = []
            taken = victims if second_pass else ()  # the first pass meets each key once
            for key, entry in keys.items():
                if freed >= want_bytes:
                    break
                if (
                    entry.pins > 0  # `entry.busy`, without a property call per candidate
                    or entry.leases > 0
                    or (accept is not None and not accept(entry))
                    or key in protect
                    or key in taken
                ):
                    continue
                if entry.referenced and second_chance:
                    entry.referenced = False
                    spared.append(key)
                    continue
                victims[key] = entry
                freed += entry.length
            move_to_end = keys.move_to_end
            for key in spared:  # after the walk: the index must not change under its iterator
                move_to_end(key)
            if freed >= want_bytes or not spared:
                break
        per_owner: Counter = Counter()  # counted per region first: a round is mostly one
        for region_id, count in Counter([e.region_id for e in victims.values()]).items():
            per_owner[self.regions[region_id].owner] += count
        for owner_id, count in per_owner.items():
            owner = self.instances.get(owner_id)
            if owner is not None:
                owner.evicted += count
        self._drop_keys(list(victims), list(victims.values()))
        if victims:
            self.counters["evictions"] += len(victims)
            self.counters["bytes_evicted"] += freed
            self.counters["eviction_rounds"] += 1
            held = self.log_throttle.allow(("evict", reason))
            if held is not None:
                log.info(
                    "eviction round (%s): %d keys, %d bytes evicted from %s%s",
                    reason or "requested",
                    len(victims),
                    freed,
                    ", ".join(f"{o} ({n} keys)" for o, n in per_owner.most_common()),
                    self.log_throttle.note(held),
                    extra={"instance": sorted(per_owner)},
                )
        return freed

    def evict_to_watermark(self, just_registered: Iterable[Key] = ()) -> int:
        """When registered bytes exceed the high watermark of the pool, evict down to low.
        `just_registered`: keys of the request being answered (reported REGISTERED, so they
        must survive it even if every older key is busy)."""
        capacity = self.pool.capacity
        if self.live_bytes <= self.high_watermark * capacity:
            return 0
        return self._evict(
            self.live_bytes - int(self.low_watermark * capacity),
            reason=f"above the high watermark {self.high_watermark:g}",
            protect=set(just_registered),
        )

    def evict_for(self, instance_id: str, want_bytes: int) -> int:
        """Make room in the caller's own regions (its store found no free pages and the pool
        has no region to give): evict the idle keys that live there, in CLOCK order."""
        inst = self.instance(instance_id)
        if type(want_bytes) is not int or want_bytes <= 0:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "bytes must be a positive integer")
        mine = inst.regions
        return self._evict(
            want_bytes, lambda e: e.region_id in mine, reason=f"room for {instance_id}"
        )

    def _evict_orphans(self, want_region_bytes: int) -> bool:
        """Free one returned region (owner gone) by evicting all of its keys; True if one was
        freed. Regions are tried in the order eviction would reach their keys (by their oldest
        key without the CLOCK bit; regions whose keys all have it set last); a region holding
        a pinned or leased key cannot be freed and is left alone. (Evicting
        `want_region_bytes` in eviction order over all orphans is not enough: when their keys
        interleave, it frees none.) The caller retries its allocation after each freed region."""
        orphans = {r.region_id for r in self.regions.values() if r.returned}
        order: dict[int, None] = {}  # orphan regions, by their oldest key without the bit
        used: dict[int, None] = {}  # ... and by their oldest key with it
        busy: set[int] = set()
        for entry in self.keys.values():
            if entry.region_id in orphans:
                (used if entry.referenced else order).setdefault(entry.region_id, None)
                if entry.busy:
                    busy.add(entry.region_id)
        for region_id in used:
            order.setdefault(region_id, None)
        for region_id in order:
            if region_id not in busy:
                self._evict(  # the whole region goes: no second chances
                    1 << 62,
                    lambda e, rid=region_id: e.region_id == rid,
                    reason=f"reclaiming orphaned region {region_id}",
                    second_chance=False,
                )
                if region_id not in self.regions:
                    return True
        return False

    # -- persistence -------------------------------------------------------------------------

    def snapshot_state(self) -> dict[str, Any]:
        return {
            "next_region_id": self._next_region_id,
            "regions": [
                [r.region_id, r.owner, r.path, r.offset, r.length, r.token, r.returned]
                for r in self.regions.values()
            ],
            "keys": [[k, e.region_id, e.offset, e.length] for k, e in self.keys.items()],
            "pins": self._pin_records(),
        }

    def _pin_records(self) -> list[list[Any]]:
        """[holder, key, count] for every pin; holder "" for pins taken without an instance."""
        held: Counter = Counter()
        records = []
        for inst in self.instances.values():
            for key, count in inst.pins.items():
                records.append([inst.instance_id, key, count])
                held[key] += count
        for key, entry in self.keys.items():
            if entry.pins > held[key]:
                records.append(["", key, entry.pins - held[key]])
        return records

    def _restore_pins(self, holder: str, keys: list[Any], delta: int) -> None:
        inst = self.instances.setdefault(holder, Instance(holder)) if holder else None
        for key in keys:
            entry = self.keys.get(key)
            if entry is None:
                continue
            if delta < 0 and (entry.pins <= 0 or (inst is not None and inst.pins[key] <= 0)):
                continue
            entry.pins += delta
            if inst is not None:
                inst.pins[key] += delta
                if not inst.pins[key]:
                    del inst.pins[key]

    def restore(self, snapshot: dict[str, Any] | None, records: list[Any]) -> None:
        """Rebuild regions and keys from a snapshot plus the journal records after it.

        Owners of restored regions are re-created as instances that must handshake again
        within the heartbeat timeout, or be reaped like any silent client."""
        journal, self.journal = self.journal, None  # replay must not write the journal again
        try:
            if snapshot:
                self._next_region_id = int(snapshot["next_region_id"])
                for rid, owner, path, offset, length, token, returned in snapshot["regions"]:
                    self._restore_region(rid, owner, path, offset, length, token, returned)
                for key, rid, offset, length in snapshot["keys"]:
                    self._insert_key(key, KeyEntry(rid, offset, length))
                for holder, key, count in snapshot.get("pins", ()):
                    for _ in range(count):
                        self._restore_pins(holder, [key], +1)
            for record in records:
                self._replay(record)
            for region in list(self.regions.values()):
                if region.returned and region.live_keys == 0:
                    self._free_region(region)
        finally:
            self.journal = journal
        for region in self.regions.values():
            if not region.returned:
                inst = self.instances.setdefault(region.owner, Instance(region.owner))
                inst.regions.add(region.region_id)
        now = time.monotonic()
        for inst in self.instances.values():  # all must handshake again within the timeout
            inst.last_seen = now
        log.info(
            "restored %d regions and %d keys (%d bytes)",
            len(self.regions),
            len(self.keys),
            self.live_bytes,
        )

    def _restore_region(
        self, rid: int, owner: str, path: str, offset: int, length: int, token: str, returned: bool
    ) -> None:
        self.pool.reserve(path, offset, length)
        self._add_region(Region(rid, owner, path, offset, length, token, returned))
        self._next_region_id = max(self._next_region_id, rid + 1)

    def _replay(self, record: list[Any]) -> None:
        kind = record[0]
        if kind == "R":
            self._restore_region(*record[1:], False)
        elif kind == "T":
            region = self.regions.get(record[1])
            if region is not None:
                region.returned = True
        elif kind == "F":
            region = self.regions.pop(record[1], None)
            if region is not None:
                self.pool.release(region.path, region.offset)
        elif kind == "K":
            for key, rid, offset, length in record[1]:
                if key not in self.keys and rid in self.regions:
                    self._insert_key(key, KeyEntry(rid, offset, length))
        elif kind == "C":  # "K" in columnar form: keys, their region, offsets, their length
            _, keys, rid, offsets, length = record
            if rid in self.regions:
                for key, offset in zip(keys, offsets):
                    if key not in self.keys:
                        self._insert_key(key, KeyEntry(rid, offset, length))
        elif kind == "D":
            for key in record[1]:
                entry = self.keys.pop(key, None)
                region = self.regions.get(entry.region_id) if entry is not None else None
                if entry is not None:
                    self.live_bytes -= entry.length
                if region is not None:
                    region.live_keys -= 1
                    region.live_bytes -= entry.length
                    region.live_pages -= region.pages_for(entry.length)
        elif kind == "P":
            self._restore_pins(record[1], record[2], +1)
        elif kind == "U":
            self._restore_pins(record[1], record[2], -1)
        elif kind == "X":  # the instance disconnected or was reaped
            inst = self.instances.pop(record[1], None)
            if inst is not None:
                for key, count in inst.pins.items():
                    entry = self.keys.get(key)
                    if entry is not None:
                        entry.pins = max(0, entry.pins - count)
                inst.pins.clear()
        else:
            log.warning("ignoring unknown journal record %r", kind)

    # -- stats -------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Pool, registry, per-instance and counter statistics, O(instances + regions).

        Also read by the metrics thread while the RPC thread mutates the registry: it works on
        copies (`list(...)` of a dict is atomic under the GIL) and looks regions up with `.get`;
        a caller on another thread retries on RuntimeError (a dict resized mid-iteration)."""
        now = time.monotonic()
        regions = self.regions
        instances = {}
        for i in list(self.instances.values()):
            owned = [r for r in map(regions.get, list(i.regions)) if r is not None]
            instances[i.instance_id] = {
                "pid": i.pid,
                "regions": len(owned),
                "region_bytes": sum(r.length for r in owned),
                "keys": sum(r.live_keys for r in owned),
                "bytes_stored": sum(r.live_bytes for r in owned),
                "pages": sum(r.live_pages for r in owned),
                "pages_total": sum(r.length // r.page_size for r in owned if r.page_size),
                "page_size": i.page_size,
                "keys_registered": i.keys_registered,
                "bytes_registered": i.bytes_registered,
                "hits": i.hits,
                "misses": i.misses,
                "exists_hits": i.exists_hits,
                "exists_misses": i.exists_misses,
                "evicted": i.evicted,
                "pins": sum(i.pins.values()),
                "leases": len(i.leases),
                "idle_seconds": round(max(0.0, now - i.last_seen), 3),
            }
        orphaned = [r for r in list(regions.values()) if r.returned]
        return {
            "pool": self.pool.stats(),
            "keys": len(self.keys),
            "live_bytes": self.live_bytes,
            "regions": len(regions),
            "leases": len(self.leases),
            "watermarks": {"high": self.high_watermark, "low": self.low_watermark},
            "instances": instances,
            "orphaned": {  # returned regions (owner gone) kept alive by keys still in them
                "regions": len(orphaned),
                "region_bytes": sum(r.length for r in orphaned),
                "keys": sum(r.live_keys for r in orphaned),
                "bytes_stored": sum(r.live_bytes for r in orphaned),
            },
            "counters": dict(self.counters),
            "server_pid": os.getpid(),
        }
