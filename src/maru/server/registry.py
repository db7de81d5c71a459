"""The server's state: the key -> (region, offset, length) index, regions, leases and pins.

Pure bookkeeping, no sockets and no page bytes, so every rule can be tested directly:
- write-then-register: a key exists only once its owner registered it, after writing its bytes;
- first writer wins: registering an existing key changes nothing;
- a pinned key cannot be deleted;
- page reuse: when a key in instance X's region disappears, X is told (the `freed` list
  piggy-backed on its next reply) so it can reuse those pages;
- crash safety: an instance whose process exited, or (when the server cannot watch its
  process) that stopped heart-beating, is reaped (pins and leases released, regions returned;
  after silence, held back for `reap_hold` seconds); every change is written to the journal
  (if any) before it is answered, and a restart replays the journal through the same
  mutators that wrote it.

Who is connected (sessions, handshake, disconnect, reaping) is in `maru.server.instances`;
regions and their deferred free, in `maru.server.regions`; which keys go when memory runs
short, in `maru.server.eviction`; pins and read leases, in `maru.server.holds`; the snapshot
and the replay, in `maru.server.persistence`; the statistics, in `maru.server.metrics`.
"""

from __future__ import annotations

import logging
import time
from contextlib import suppress
from itertools import compress
from operator import attrgetter
from typing import Any, Protocol

from maru.common.protocol import (
    CHECKSUMS,
    MAX_KEY_CHARS,
    DeleteStatus,
    ErrorCode,
    ProtocolError,
    RegisterStatus,
    all_keys_valid,
    check_count,
)
from maru.common.region import RegionHandle
from maru.server.eviction import Eviction
from maru.server.holds import LeaseTable, Pins
from maru.server.instances import Instance, InstanceTable
from maru.server.journal import JournalWriteError
from maru.server.keyindex import (
    KeyEntry,
    KeyIndex,
    batch_fits,
    entry_locations,
    release_entries,
)
from maru.server.localindex import LocalIndex
from maru.server.logs import Throttle
from maru.server.metrics import COUNTERS, registry_stats
from maru.server.pool import Pool, PoolFullError
from maru.server.regions import Region, RegionTable
from maru.server.token import TokenSigner

log = logging.getLogger(__name__)

Key = str | bytes
REGISTERED, EXISTS, REJECTED = (int(s) for s in RegisterStatus)
DELETED, NOT_FOUND, PINNED = (int(s) for s in DeleteStatus)  # plain ints: the wire's form
_BUSY = attrgetter("busy")
# How long the regions others give back are kept for an instance below its fair share that
# asked for one (`Registry.wanting`): its client retries within a second or two.
WANT_SECONDS = 10.0


class JournalSink(Protocol):
    def append(self, record: Any) -> None: ...


def _by_region(region_ids: list[int], lengths: list[int]) -> dict[int, list[int]]:
    """The lengths of a batch's keys per region, regions in the order of their last key (the
    order in which adding or dropping the keys one by one would finish with each region)."""
    if region_ids.count(region_ids[0]) == len(region_ids):  # the usual batch: one region
        return {region_ids[0]: lengths}
    groups: dict[int, list[int]] = {r: [] for r in reversed(dict.fromkeys(reversed(region_ids)))}
    for region_id, length in zip(region_ids, lengths):
        groups[region_id].append(length)
    return groups


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
        reap_hold: float = 0.0,
        quota_region_bytes: int = 0,
        quota_leases: int = 0,
        quota_lease_bytes: int = 0,
    ):
        """`reap_hold`: seconds the regions of an instance reaped for its silence, whose
        process is not watched (`maru.server.processes`), stay out of use (`--reap-hold`).

        `quota_region_bytes`, `quota_leases`, `quota_lease_bytes`: what one instance may hold
        (0: no limit), so that one client cannot starve the others (`--quota-region-bytes`,
        `--quota-leases`, `--quota-lease-bytes`); past them a request is refused with
        QUOTA_EXCEEDED, before any side effect (a leased lookup past the bytes: its keys were
        only marked used). Besides, every instance is owed a fair share of the pool
        (`fair_share`, `request_region`)."""
        self.pool = pool
        self.signer = signer
        self.journal = journal
        self.instances = InstanceTable(self, reap_hold)
        self.quota_region_bytes, self.quota_leases = quota_region_bytes, quota_leases
        self.quota_lease_bytes = quota_lease_bytes
        # Instances below their fair share refused a region lately: instance id -> until when
        # (time.monotonic()) the regions others give back are kept for them.
        self.wanting: dict[str, float] = {}
        # Oldest first, the order eviction walks (a key it spares moves to the end); batches
        # go through its batch calls (`maru.server.keyindex`).
        self.keys: KeyIndex = KeyIndex()
        self.live_bytes = 0  # sum of registered key lengths
        self.log_throttle = Throttle(10.0)  # per-store events under memory pressure
        self.counters: dict[str, int] = dict.fromkeys(  # journal_* are the service's
            [c for c in COUNTERS if not c.startswith("journal_")], 0
        )
        self.regions = RegionTable(pool, signer, self._log, self.counters)
        self.eviction = Eviction(self, high_watermark, low_watermark)
        self.pins = Pins(self.keys, self.instances, self._log)
        self.leases = LeaseTable(self.instances, lease_seconds, self.counters)
        # The key index published for readers on this node (`maru.server.localindex`), which
        # `_add_keys` and `_drop_keys` keep up to date; None: not published.
        self.local_index: LocalIndex | None = None

    def _log(self, *record: Any) -> None:
        if self.journal is not None:
            self.journal.append(list(record))

    def stats(self) -> dict[str, Any]:
        return registry_stats(self)

    # -- an instance's regions ---------------------------------------------------------------

    def request_region(
        self, instance_id: str, size: int, min_size: int | None = None
    ) -> RegionHandle:
        """A new region for `instance_id`: `size` bytes if the pool has them free, else at
        least `min_size` (default `size`), reclaiming idle regions (`Eviction.reclaim`: parked
        by their idle owners, or orphaned) until it fits; POOL_FULL when nothing more can be
        reclaimed."""
        inst = self.instances.require(instance_id)
        check_count(size, "size")
        check_count(size if min_size is None else min_size, "min_size")
        length = self.pool.round_up(size)
        least = min(length, self.pool.round_up(size if min_size is None else min_size))
        if least > self.pool.capacity:  # refused before reclaiming (evicting) anything
            raise ProtocolError(
                ErrorCode.POOL_FULL,
                f"pool {self.pool.name} cannot hold a region of {size} bytes: its capacity "
                f"is {self.pool.capacity} bytes",
            )
        if self.quota_region_bytes:
            held = sum(self.regions[r].length for r in inst.regions)
            room = (self.quota_region_bytes - held) // self.pool.alignment * self.pool.alignment
            if room < least:
                raise _over_quota(self, inst, "bytes of regions", held, self.quota_region_bytes)
            length = min(length, room)
        share, held = self.fair_share(), self.region_bytes(inst)
        now = time.monotonic()
        waiting = [i for i, until in self.wanting.items() if until > now and i != instance_id]
        if waiting and held + least > share:  # what others give back is theirs
            raise ProtocolError(
                ErrorCode.POOL_FULL,
                f"instance {instance_id} holds {held} bytes of regions, its fair share of the "
                f"pool is {share} and {len(waiting)} other instances wait for theirs",
            )
        try:
            region = self.regions.allocate(instance_id, length, inst.page_size)
        except PoolFullError:
            below = held + least <= share
            region = self._allocate_reclaiming(instance_id, least, inst.page_size, below)
        self.wanting.pop(instance_id, None)
        inst.regions.add(region.region_id)
        return region.handle()

    def fair_share(self) -> int:
        """The bytes of regions each live instance is owed: the pool's capacity over the
        instances. An instance below it that finds no room makes those above it give regions
        back (`_ask_to_shed`), and while it waits, no instance grows past its own share."""
        return self.pool.capacity // max(1, len(self.instances))

    def region_bytes(self, inst: Instance) -> int:
        """The bytes of the regions `inst` owns (returned ones no longer count)."""
        return sum(self.regions[r].length for r in inst.regions)

    def _ask_to_shed(self, instance_id: str, share: int) -> list[str]:
        """Ask every instance above `share` to give back what it holds over it (`shed`, on
        its next reply; its client returns regions it holds no unsealed value in: never one
        it may still write, the first rule); `instance_id` waits for them
        (`wanting`). The instances asked."""
        asked = []
        for inst in self.instances.values():
            over = self.region_bytes(inst) - share
            if over > 0 and inst.instance_id != instance_id:
                inst.shed = max(inst.shed, over)
                asked.append(inst.instance_id)
        if asked:
            self.wanting[instance_id] = time.monotonic() + WANT_SECONDS
            self.counters["shed_requests"] += len(asked)
            held = self.log_throttle.allow(("shed", instance_id))
            if held is not None:
                log.info(
                    "instance %s is below its fair share (%d bytes) and the pool is full: "
                    "asked %s to give regions back%s",
                    instance_id,
                    share,
                    ", ".join(asked),
                    self.log_throttle.note(held),
                    extra={"instance": instance_id},
                )
        return asked

    def _allocate_reclaiming(
        self, instance_id: str, length: int, page_size: int, below_share: bool
    ) -> Region:
        while True:
            try:
                return self.regions.allocate(instance_id, length, page_size)
            except PoolFullError as exc:
                if self.eviction.reclaim():
                    continue
                code, why = ErrorCode.POOL_FULL, str(exc)
                if below_share and self._ask_to_shed(instance_id, self.fair_share()):
                    code = ErrorCode.POOL_RECLAIMING
                    why += "; instances over their fair share were asked to give regions back"
                held = self.log_throttle.allow(("refused", instance_id))
                if held is not None:
                    log.warning(
                        "region request of %d bytes by %s refused: %s%s",
                        length,
                        instance_id,
                        why,
                        self.log_throttle.note(held),
                        extra={"instance": instance_id},
                    )
                raise ProtocolError(code, why) from None

    def park(
        self, instance_id: str, seq: Any, park: list[Any], unpark: list[Any]
    ) -> tuple[list[int], list[int]]:
        """An idle owner parks regions (it will not write in them before it unparks them, so
        the server may take them back when the pool has no room) or unparks them (before it
        writes there again). Returns (the regions unparked, the regions named that the
        instance no longer owns: taken back). `seq` orders an instance's park requests: one
        not newer than the last applied is stale (a retry or a late copy) and changes nothing,
        so a late park can never undo the unpark after which the owner writes again."""
        inst = self.instances.require(instance_id)
        if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "seq must be a non-negative integer")
        if not all(type(r) is int for r in [*park, *unpark]):
            raise ProtocolError(ErrorCode.BAD_REQUEST, "region ids must be integers")
        gone = [r for r in [*park, *unpark] if r not in inst.regions]
        if seq <= inst.park_seq:
            return [], gone
        inst.park_seq = seq
        for region_id in park:
            if region_id in inst.regions:
                self.regions[region_id].parked = True
        unparked = [r for r in unpark if r in inst.regions]
        for region_id in unparked:
            self.regions[region_id].parked = False
        return unparked, gone

    def take_back(self, region: Region) -> None:
        """Reclaim a parked region from its live owner (`Eviction.reclaim`): it is released as
        if returned (journaled "T"), so it frees with its last key; the owner learns it at its
        next park request or handshake."""
        self.regions.release(region)
        owner = self.instances.get(region.owner)
        if owner is not None:
            owner.regions.discard(region.region_id)
        self.counters["regions_reclaimed"] += 1
        log.info(
            "region %d taken back from idle %s",
            region.region_id,
            region.owner,
            extra={"instance": region.owner, "region": region.region_id},
        )

    def return_region(self, instance_id: str, region_id: Any, token: Any) -> None:
        inst = self.instances.require(instance_id)
        region = self.regions.verified(region_id, token)
        if region.owner != instance_id or region.returned:
            raise ProtocolError(
                ErrorCode.NOT_OWNER, f"region {region_id} is not owned by {instance_id}"
            )
        self.regions.release(region)  # journal first: on failure the caller still owns it
        inst.regions.discard(region.region_id)

    # -- keys --------------------------------------------------------------------------------

    def register(
        self,
        instance_id: str,
        keys: list[Any],
        region_ids: list[int],
        offsets: list[int],
        lengths: list[int],
        checksums: list[int] | None = None,
    ) -> list[int]:
        """Publish written pages: `keys[i]` is at (`region_ids[i]`, `offsets[i]`,
        `lengths[i]`), four columns of one length, with the writer's checksum of its bytes
        (`checksums`, optional: kept with the key, handed to readers). A RegisterStatus per
        key: EXISTS when the key was registered before, or earlier in the batch (first writer
        wins); REJECTED for a bad key or a location outside the caller's own live regions."""
        inst = self.instances.require(instance_id)
        n = len(keys)
        # A batch whose every key and location is valid (nearly all) is checked in one C pass
        # and inserted by `add_entries`; only one with a bad key or location goes key by key.
        limits = self._writable_lengths(instance_id, region_ids)
        if limits is not None and batch_fits(
            keys, MAX_KEY_CHARS, region_ids, offsets, lengths, limits
        ):
            new = self._add_keys(keys, region_ids, offsets, lengths, checksums)
            statuses = (
                [REGISTERED] * n if new is None else [REGISTERED if s else EXISTS for s in new]
            )
        else:  # anything else is decided key by key
            statuses = self._statuses(instance_id, keys, region_ids, offsets, lengths)
            new = [s == REGISTERED for s in statuses]
            columns = (keys, region_ids, offsets, lengths, *([checksums] if checksums else []))
            self._add_keys(*(list(compress(c, new)) for c in columns))
        if new is not None:
            keys, lengths = list(compress(keys, new)), list(compress(lengths, new))
            self.counters["keys_duplicate"] += statuses.count(EXISTS)
        if keys:
            nbytes = sum(lengths)
            inst.keys_registered += len(keys)
            inst.bytes_registered += nbytes
            self.counters["keys_registered"] += len(keys)
            self.counters["bytes_registered"] += nbytes
            # The keys are registered and journaled: the reply must say so (an error would let
            # the writer reuse their pages). An eviction that cannot be journaled changed
            # nothing (journal first) and comes with a later store.
            with suppress(JournalWriteError):
                self.eviction.to_watermark(keys)
        return statuses

    def _writable_lengths(self, instance_id: str, region_ids: list[int]) -> dict[int, int] | None:
        """The length of each region a batch names, if every one is a live region of the
        caller's (None if one is not: the batch is decided key by key). SGLang's usual batch
        names one region; a v2 call's pools sealed together, or pages placed one by one, a
        few."""
        if not region_ids:
            return None
        first = region_ids[0]
        named = (first,) if region_ids.count(first) == len(region_ids) else set(region_ids)
        limits = {}
        for region_id in named:
            region = self.regions.writable(region_id, instance_id)
            if region is None:
                return None
            limits[region_id] = region.length
        return limits

    def _statuses(
        self,
        instance_id: str,
        keys: list[Any],
        region_ids: list[int],
        offsets: list[int],
        lengths: list[int],
    ) -> list[int]:
        """`register`'s outcome for each key, decided one at a time (each region checked
        once): what the batch path decides in bulk."""
        regions = {r: self.regions.writable(r, instance_id) for r in set(region_ids)}
        keys_valid = all_keys_valid(keys)
        table, taken = self.keys, set()
        statuses = []
        for key, region_id, offset, length in zip(keys, region_ids, offsets, lengths):
            region = regions[region_id]
            if not keys_valid and not all_keys_valid([key]):
                statuses.append(REJECTED)
            elif key in table or key in taken:
                statuses.append(EXISTS)
            elif region is None or length <= 0 or offset < 0 or offset + length > region.length:
                statuses.append(REJECTED)
            else:
                taken.add(key)
                statuses.append(REGISTERED)
        return statuses

    def _add_keys(
        self,
        keys: list[Key],
        region_ids: list[int],
        offsets: list[int],
        lengths: list[int],
        checksums: list[int] | None = None,
    ) -> list[bool] | None:
        """Insert keys at checked locations, the first writer of each winning (a key registered
        before, or earlier in the batch, keeps its entry); journaled as one "K" record of the
        keys that were new (with their checksums, when given, tagged with the hash's name:
        `CHECKSUMS`). Which keys were new (None: all). The one mutator that adds keys, for
        requests and journal replay alike."""
        columns = [region_ids, offsets, lengths, *([checksums] if checksums else [])]
        new = self.keys.add_entries(keys, region_ids, offsets, lengths, checksums or None)
        if new is not None:  # (None: every key was new)
            keys, *columns = (list(compress(c, new)) for c in (keys, *columns))
            region_ids, lengths = columns[0], columns[2]
        if keys:
            for region_id, group in _by_region(region_ids, lengths).items():
                self.regions[region_id].count(group, +1)
            self.live_bytes += sum(lengths)  # before the journal's write lets the metrics run
            try:
                self._log("K", keys, *columns, *([CHECKSUMS] if checksums else []))
            except JournalWriteError:
                self._undo_add(keys, region_ids, lengths)
                raise
            if self.local_index is not None:
                self.local_index.publish(keys, *columns, regions=self.regions)
        return new

    def _undo_add(self, keys: list[Key], region_ids: list[int], lengths: list[int]) -> None:
        """Take back the keys `_add_keys` just inserted when their "K" record could not be
        written: the request is answered with an error, and a writer told so may reuse the
        pages (not known to the index: nobody read them in between, one thread serves all)."""
        table = self.keys
        for key in keys:
            del table[key]
        for region_id, group in _by_region(region_ids, lengths).items():
            self.regions[region_id].count(group, -1)
        self.live_bytes -= sum(lengths)

    def lookup(
        self, keys: list[Key], instance_id: str | None = None, lease: bool = False
    ) -> tuple[bytes, bytes, bytes, bytes, list[RegionHandle], int]:
        """Where `keys` are, for LOOKUP_KV: region ids, offsets, lengths and the writers'
        checksums as bytes of native int64s (0, 0, 0, 0 for a miss; region ids start at 1;
        checksum 0: stored without one), the handles of those regions, and
        with `lease` the id of a lease on the hits (0: none). A hit counts as use (sets the
        key's CLOCK bit). The per-key work (probe, CLOCK bit, lease count, columns) is one
        call into the key index (in C with the extension)."""
        inst = self.instances.get(instance_id) if instance_id else None
        # Only an instance holds leases: it alone can end them (RELEASE) or lose them (reap).
        lease = lease and inst is not None
        quota = self.quota_leases
        if lease and inst is not None and quota and len(inst.leases) >= quota:
            raise _over_quota(self, inst, "leases", len(inst.leases), quota)
        held, region_ids, offsets, lengths, checksums = self.keys.lookup_columns(keys, lease)
        nbytes = 0
        if lease and held and inst is not None and self.quota_lease_bytes:
            nbytes = sum(memoryview(lengths).cast("q"))
            if inst.lease_bytes + nbytes > self.quota_lease_bytes:
                release_entries(held)  # (a flood of leases must not keep writers from room)
                what = f"bytes under leases (a lease of {nbytes} more asked)"
                raise _over_quota(self, inst, what, inst.lease_bytes, self.quota_lease_bytes)
        self.count_reads(instance_id, lookups=len(keys), hits=len(held))
        lease_id = self.leases.add(held, instance_id, nbytes) if lease and held else 0
        handles = [self.regions[r].handle() for r in set(memoryview(region_ids).cast("q")) - {0}]
        return region_ids, offsets, lengths, checksums, handles, lease_id

    def exists(self, keys: list[Any], instance_id: str | None = None) -> list[bool]:
        """Membership; a hit counts as use, like a lookup (SGLang asks before it prefetches)."""
        entries = self.keys.get_many(keys)
        out = [entry is not None for entry in entries]
        for entry in entries:
            if entry is not None:
                entry.referenced = True
        self.count_reads(instance_id, exists=len(out), exists_hits=out.count(True))
        return out

    def count_reads(
        self,
        instance_id: str | None,
        lookups: int = 0,
        hits: int = 0,
        exists: int = 0,
        exists_hits: int = 0,
    ) -> None:
        """Count lookups and membership checks, server-wide and for the instance: those this
        server answered, and those a client answered from the local index and reported with
        its heartbeat (so hit rates stay true when reads send no request)."""
        counters = self.counters
        counters["lookups"] += lookups
        counters["hits"] += hits
        counters["misses"] += lookups - hits
        counters["exists"] += exists
        counters["exists_hits"] += exists_hits
        counters["exists_misses"] += exists - exists_hits
        inst = self.instances.get(instance_id) if instance_id else None
        if inst is not None:
            inst.hits += hits
            inst.misses += lookups - hits
            inst.exists_hits += exists_hits
            inst.exists_misses += exists - exists_hits

    def delete(self, keys: list[Any]) -> list[int]:
        table = self.keys
        # The usual batch (str or bytes keys, every one registered, none twice, none pinned
        # or leased) is checked in C, a pass per condition; otherwise the loop below decides
        # key by key, the same way.
        entries = table.get_many(keys)
        if None not in entries and len(set(keys)) == len(keys) and not any(map(_BUSY, entries)):
            out = [DELETED] * len(keys)
        else:
            out = []
            victims: dict[Key, KeyEntry] = {}
            for key in keys:
                entry = table.get(key)
                if entry is None or key in victims:
                    out.append(NOT_FOUND)
                elif entry.busy:
                    out.append(PINNED)
                else:
                    victims[key] = entry
                    out.append(DELETED)
            keys, entries = list(victims), list(victims.values())
        self._drop_keys(keys, entries)
        self.counters["keys_deleted"] += len(keys)
        return out

    def _drop_keys(self, keys: list[Key], entries: list[KeyEntry]) -> None:
        """Remove keys (deleted, evicted, or replayed from the journal): journal first (so a
        replay never sees a region freed before its keys are gone), then free pages / regions
        and tell the owners. The one mutator that removes keys.

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
        if self.local_index is not None:  # before the pages can be reused: notices, frees
            self.local_index.remove(keys)
        region_ids, lengths, notices = entry_locations(entries)  # (notices: for the owners)
        self.live_bytes -= sum(lengths)
        groups = _by_region(region_ids, lengths)
        notify: dict[int, list[list[int]]] = {}  # region id -> its owner's freed list
        regions, instances = self.regions, self.instances
        for rid, group in groups.items():
            region = regions[rid]
            region.count(group, -1)
            if region.returned:
                if region.live_keys == 0:
                    regions.free(region)
            else:
                owner = instances.get(region.owner)
                if owner is not None:
                    notify[rid] = owner.freed
        if not notify:
            return
        lists = list({id(freed): freed for freed in notify.values()}.values())
        if len(notify) == len(groups) and len(lists) == 1:  # one owner, told of every key
            lists[0].extend(notices)
        else:
            for rid, notice in zip(region_ids, notices):
                freed = notify.get(rid)
                if freed is not None:
                    freed.append(notice)


# -- operator actions that walk the whole registry (not on any hot path) ----------------------


def delete_prefix(registry: Registry, prefix: Any) -> tuple[int, int]:
    """Delete every key starting with `prefix` that is not pinned or leased (an operator or
    `clear` action). Returns (deleted, skipped). Walks the whole registry: not hot."""
    if not isinstance(prefix, (str, bytes)) or not prefix:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "prefix must be a non-empty str or bytes")
    matching = [k for k in registry.keys if type(k) is type(prefix) and k.startswith(prefix)]
    statuses = registry.delete(matching)
    deleted = statuses.count(DeleteStatus.DELETED)
    return deleted, len(matching) - deleted


def clear_all(registry: Registry) -> tuple[int, int]:
    """Delete every key that is not pinned or leased (an operator's `maru clear`).
    Returns (deleted, skipped)."""
    statuses = registry.delete(list(registry.keys))
    deleted = statuses.count(DeleteStatus.DELETED)
    return deleted, len(statuses) - deleted


def list_keys(
    registry: Registry, prefix: Any = None, limit: int = 100
) -> tuple[list[list[Any]], bool]:
    """Up to `limit` keys starting with `prefix` (every key when it is None or empty), most
    recently used first as far as CLOCK knows (the reverse of eviction order: keys used
    since eviction last looked at them, then the others, each newest first), as
    [key, length, owner instance]; and whether more keys matched. Walks the registry (at
    most twice) until limit + 1 matches: an operator action (`maru keys`), not hot."""
    if prefix is not None and not isinstance(prefix, (str, bytes)):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "prefix must be a str or bytes")
    out: list[list[Any]] = []
    keys, regions = registry.keys, registry.regions
    if registry.local_index is not None:  # readers' use marks count, as for eviction
        registry.local_index.harvest_into(keys)
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


def _over_quota(
    registry: Registry, inst: Instance, what: str, held: int, quota: int
) -> ProtocolError:
    """QUOTA_EXCEEDED for `inst`, logged (throttled)."""
    message = f"instance {inst.instance_id} holds {held} {what}: its quota is {quota}"
    held_log = registry.log_throttle.allow(("quota", what, inst.instance_id))
    if held_log is not None:
        log.warning(
            "%s refused%s",
            message,
            registry.log_throttle.note(held_log),
            extra={"instance": inst.instance_id},
        )
    return ProtocolError(ErrorCode.QUOTA_EXCEEDED, message)
