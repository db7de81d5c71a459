"""The server's state: the key -> (region, offset, length) index, regions, leases and pins.

Pure bookkeeping (no sockets, no page bytes), so every rule is tested directly: a key exists
only once its owner wrote its bytes and registered it; the first writer wins; a pinned key
cannot be deleted; when a key in instance X's region goes, X is told (`freed`, on its next
reply) so it can reuse the pages; a departed instance is reaped (`maru.server.instances`).
Every change is journaled before it is answered, and a restart replays the journal through
the same mutators. The parts (docs/architecture.md) see only what they use of each other.
"""

from __future__ import annotations

import logging
from contextlib import suppress
from itertools import compress
from operator import attrgetter
from typing import Any, Protocol

from maru.common.protocol import (
    CHECKSUMS,
    MAX_KEY_CHARS,
    DeleteStatus,
    ErrorCode,
    Key,
    ProtocolError,
    RegisterStatus,
    all_keys_valid,
)
from maru.common.region import RegionHandle
from maru.common.throttle import Throttle
from maru.server.eviction import Eviction, EvictionView
from maru.server.grants import RegionGrants, over_quota
from maru.server.holds import LeaseTable, Pins
from maru.server.instances import Instance, InstanceTable
from maru.server.journal import JournalWriteError
from maru.server.keyindex import (
    KeyEntry,
    KeyIndex,
    batch_fits,
    entry_locations,
    length_groups,
    release_entries,
)
from maru.server.localindex import LocalIndex
from maru.server.metrics import COUNTERS, registry_stats
from maru.server.pool import Pool
from maru.server.regions import Region, RegionTable
from maru.server.token import TokenSigner

log = logging.getLogger(__name__)

REGISTERED, EXISTS, REJECTED = (int(s) for s in RegisterStatus)
DELETED, NOT_FOUND, PINNED = (int(s) for s in DeleteStatus)  # plain ints: the wire's form
_BUSY = attrgetter("busy")


class JournalSink(Protocol):
    def append(self, record: Any) -> None: ...


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
        """`reap_hold`: seconds the regions of an instance reaped for silence stay out of use.
        `quota_*`: what one instance may hold (0: no limit), so one client cannot starve the
        others; past them a request is refused with QUOTA_EXCEEDED before any side effect (a
        leased lookup past the bytes only marked its keys used)."""
        self.pool = pool
        self.signer = signer
        self.journal = journal
        self.quota_leases, self.quota_lease_bytes = quota_leases, quota_lease_bytes
        self.keys: KeyIndex = KeyIndex()
        self.live_bytes = 0  # sum of registered key lengths
        self.log_throttle = Throttle(10.0)  # per-store events under memory pressure
        self.counters: dict[str, int] = dict.fromkeys(  # journal_* are the service's
            [c for c in COUNTERS if not c.startswith("journal_")], 0
        )
        self.regions = RegionTable(pool, signer, self._log, self.counters)
        self.instances = InstanceTable(
            self.regions, signer, self._let_go, self.log_throttle, self.counters, reap_hold
        )
        self.pins = Pins(self.keys, self.instances, self._log)
        self.leases = LeaseTable(self.instances, lease_seconds, self.counters)
        view = EvictionView(
            self.keys,
            self.regions,
            self.instances,
            self.counters,
            self.log_throttle,
            pool.capacity,
            live_bytes=lambda: self.live_bytes,
            drop_keys=self._drop_keys,
            harvest_marks=self.harvest_marks,
            over_share=lambda: self.grants.regions_over_share(),
        )
        self.eviction = Eviction(view, high_watermark, low_watermark)
        self.grants = RegionGrants(
            pool,
            self.regions,
            self.instances,
            self.eviction.reclaim,
            self.counters,
            self.log_throttle,
            quota_region_bytes,
        )
        # Kept up to date by `_add_keys` and `_drop_keys`; None: no index published.
        self.local_index: LocalIndex | None = None

    def _log(self, *record: Any) -> None:
        if self.journal is not None:
            self.journal.append(list(record))

    def stats(self) -> dict[str, Any]:
        return registry_stats(self)

    def harvest_marks(self) -> None:
        """Readers' use marks on the local index become CLOCK bits (eviction, `list_keys`)."""
        if self.local_index is not None:
            self.local_index.harvest_into(self.keys)

    def _let_go(self, inst: Instance) -> tuple[int, int]:
        """Drop the pins and end the leases of a departing instance: (pins, leases)."""
        pins, leases = self.pins.drop(inst), len(inst.leases)
        for lease_id in list(inst.leases):
            self.leases.end(lease_id)
        return pins, leases

    # -- an instance's regions (`maru.server.grants`) ----------------------------------------

    def request_region(
        self, instance_id: str, size: int, min_size: int | None = None, *, reclaim: bool = True
    ) -> RegionHandle:
        """REQUEST_REGION (`RegionGrants.request`)."""
        return self.grants.request(instance_id, size, min_size, reclaim=reclaim)

    def park(
        self, instance_id: str, seq: Any, park: list[Any], unpark: list[Any]
    ) -> tuple[list[int], list[int]]:
        """PARK_REGIONS (`RegionGrants.park`)."""
        return self.grants.park(instance_id, seq, park, unpark)

    def return_region(self, instance_id: str, region_id: Any, token: Any) -> None:
        """RETURN_REGION (`RegionGrants.give_back`)."""
        self.grants.give_back(instance_id, region_id, token)

    # -- keys --------------------------------------------------------------------------------

    def register(
        self,
        instance_id: str,
        keys: list[Any],
        region_ids: list[int],
        offsets: list[int],
        lengths: list[int],
        checksums: list[int] | None = None,
        tokens: dict[int, str] | None = None,
    ) -> list[int]:
        """Publish written pages: `keys[i]` at (`region_ids[i]`, `offsets[i]`, `lengths[i]`),
        with the writer's optional checksum, kept for readers. A RegisterStatus per key:
        EXISTS for a key registered before or earlier in the batch (first writer wins);
        REJECTED for a bad key or a location outside the caller's own live regions. `tokens`
        (region id -> token, as the writer was granted them): a region whose token is not
        the one named is not the one the writer wrote in (another server's or pool's region
        under the same id, after a re-handshake), and its keys are REJECTED. A new key that
        would make its region's live bytes pass the region's length, or its keys its pages,
        is REJECTED too (keys over the same bytes: an honest writer's values each have
        chunks of their own), so bytes that do not exist never count toward the watermark,
        quotas or shares, and a region's keys never outnumber its pages (`Region.room`)."""
        inst = self.instances.require(instance_id)
        # One C pass and a sum admit the usual batch whole (each key counted as new, each
        # region with room for its keys); otherwise `_screen_each` goes key by key, exactly.
        writable = self._writable_lengths(instance_id, region_ids, tokens)
        nbytes = -1  # the batch's bytes once admitted whole
        if writable is not None and batch_fits(
            keys, MAX_KEY_CHARS, region_ids, offsets, lengths, writable[0]
        ):
            nbytes, room = sum(lengths), writable[1]
            least = min(room.values())  # (mostly one region)
            if (nbytes > least[0] or len(keys) > least[1]) and not _room_per_region(
                region_ids, lengths, room
            ):
                nbytes = -1
        screened = (
            None
            if nbytes >= 0
            else self._screen_each(instance_id, keys, region_ids, offsets, lengths, tokens)
        )
        columns = [keys, region_ids, offsets, lengths, *([checksums] if checksums else [])]
        if screened is not None:
            columns = [list(compress(c, [s is None for s in screened])) for c in columns]
        new = self._add_keys(*columns)  # (None: every key inserted was new)
        keys, lengths = columns[0], columns[3]
        if new is None:
            statuses = [REGISTERED] * len(keys)
        else:
            statuses = self._repeated([REGISTERED if s else EXISTS for s in new], columns)
            keys, lengths = list(compress(keys, new)), list(compress(lengths, new))
        if screened is not None:  # the inserted keys' outcomes in the places left open
            inserted = iter(statuses)
            statuses = [next(inserted) if s is None else s for s in screened]
        if new is not None or screened is not None:
            self.counters["keys_duplicate"] += statuses.count(EXISTS)
        if keys:
            if new is not None or screened is not None:  # (else: the batch admitted whole)
                nbytes = sum(lengths)
            inst.keys_registered += len(keys)
            inst.bytes_registered += nbytes
            self.counters["keys_registered"] += len(keys)
            self.counters["bytes_registered"] += nbytes
            # The keys are journaled: an error reply would let the writer reuse their pages. An
            # eviction that cannot be journaled changed nothing and comes with a later store.
            with suppress(JournalWriteError):
                self.eviction.to_watermark(keys)
        return statuses

    def _repeated(self, statuses: list[int], columns: list[list[Any]]) -> list[int]:
        """REGISTERED, not EXISTS, for a key already registered at the very place named (a
        request sent twice): EXISTS would let the writer reuse pages the entry points at."""
        keys, region_ids, offsets, lengths = columns[:4]
        again = [i for i, st in enumerate(statuses) if st == EXISTS]
        for i, entry in zip(again, self.keys.get_many([keys[i] for i in again])):
            place = (region_ids[i], offsets[i], lengths[i])
            if entry is not None and (entry.region_id, entry.offset, entry.length) == place:
                statuses[i] = REGISTERED
        return statuses

    def _writable(
        self, region_id: int, instance_id: str, tokens: dict[int, str] | None
    ) -> Region | None:
        """`Regions.writable`, and (`tokens` given) the very region the writer was granted."""
        region = self.regions.writable(region_id, instance_id)
        if region is None or tokens is None or tokens.get(region_id) == region.token:
            return region
        return None

    def _writable_lengths(
        self, instance_id: str, region_ids: list[int], tokens: dict[int, str] | None = None
    ) -> tuple[dict[int, int], dict[int, tuple[int, int]]] | None:
        """The length of each region a batch names and the room its live keys leave (region
        id -> `Region.room`), if all are live regions of the caller's; else None (the batch
        is screened key by key)."""
        if not region_ids:
            return None
        first = region_ids[0]
        named = (first,) if region_ids.count(first) == len(region_ids) else set(region_ids)
        limits, room = {}, {}
        for region_id in named:
            region = self._writable(region_id, instance_id, tokens)
            if region is None:
                return None
            limits[region_id] = region.length
            room[region_id] = region.room()
        return limits, room

    def _screen_each(
        self,
        instance_id: str,
        keys: list[Any],
        region_ids: list[int],
        offsets: list[int],
        lengths: list[int],
        tokens: dict[int, str] | None = None,
    ) -> list[int | None]:
        """Per key of a batch not admitted whole: REJECTED for a bad key or a location outside
        the caller's live regions, but EXISTS there for a key registered before or earlier in
        the batch (the first writer wins wherever the later one claims to be); REJECTED for a
        new key its region has no room left for (`_over_room`), as if added one by one; None
        for a key left to the insert."""
        regions = {r: self._writable(r, instance_id, tokens) for r in set(region_ids)}
        room = {r: list(g.room()) for r, g in regions.items() if g is not None}
        over: dict[int, int] = {}  # region id -> new keys refused for want of room
        keys_valid = all_keys_valid(keys)
        table, inserted = self.keys, set()
        out: list[int | None] = []
        for key, region_id, offset, length in zip(keys, region_ids, offsets, lengths):
            region = regions[region_id]
            if not keys_valid and not all_keys_valid([key]):
                out.append(REJECTED)
            elif region is None or length <= 0 or offset < 0 or offset + length > region.length:
                out.append(EXISTS if key in table or key in inserted else REJECTED)
            elif key in table or key in inserted:
                out.append(None)  # (EXISTS, or REGISTERED again: `_repeated`; no room taken)
            elif length > room[region_id][0] or room[region_id][1] < 1:
                over[region_id] = over.get(region_id, 0) + 1
                out.append(REJECTED)
            else:
                room[region_id][0] -= length
                room[region_id][1] -= 1
                inserted.add(key)
                out.append(None)
        if over:
            _over_room(self.counters, self.log_throttle, instance_id, over)
        return out

    def _add_keys(
        self,
        keys: list[Key],
        region_ids: list[int],
        offsets: list[int],
        lengths: list[int],
        checksums: list[int] | None = None,
    ) -> list[bool] | None:
        """The one mutator that adds keys (requests and journal replay alike): insert at checked
        locations, the first writer winning; journal the new ones as one "K" record (with
        their checksums, tagged `CHECKSUMS`). Which keys were new (None: all)."""
        columns = [region_ids, offsets, lengths, *([checksums] if checksums else [])]
        # One C call: the insert, and the new keys counted per region and length.
        new, groups = self.keys.add_entries(
            keys, region_ids, offsets, lengths, checksums or None, True
        )
        if new is not None:  # (None: every key was new)
            keys, *columns = (list(compress(c, new)) for c in (keys, *columns))
        if keys:
            self._count(groups, +1)  # before the journal's write lets the metrics run
            try:
                self._log("K", keys, *columns, *([CHECKSUMS] if checksums else []))
            except JournalWriteError:
                # The request is answered with an error, and a writer told so may reuse the
                # pages: take the keys back (not yet published, and one thread serves all).
                self.keys.remove_many(keys)
                self._count(groups, -1)
                raise
            if self.local_index is not None:
                self.local_index.publish(keys, *columns, regions=self.regions)
        return new

    def _count(self, groups: dict[int, dict[int, int]], sign: int) -> None:
        """Keys came (sign 1) or went (-1), so many per region and length (`length_groups`):
        the regions' live counters and `live_bytes` follow."""
        regions, nbytes = self.regions, 0
        for region_id, group in groups.items():  # mostly one region
            nbytes += regions[region_id].count(group, sign)
        self.live_bytes += sign * nbytes

    def lookup(
        self, keys: list[Key], instance_id: str | None = None, lease: bool = False
    ) -> tuple[bytes, bytes, bytes, bytes, list[RegionHandle], int]:
        """LOOKUP_KV: region ids, offsets, lengths and the writers' checksums as bytes of native
        int64s (all 0 for a miss, region ids start at 1; checksum 0: stored without one), the
        regions' handles, and with `lease` a lease id on the hits (0: none). A hit sets the
        key's CLOCK bit."""
        inst = self.instances.get(instance_id) if instance_id else None
        # Only an instance holds leases: it alone can end them (RELEASE) or lose them (reap).
        lease = lease and inst is not None
        quota = self.quota_leases
        if lease and inst is not None and quota and len(inst.leases) >= quota:
            raise over_quota(self.log_throttle, inst, "leases", len(inst.leases), quota)
        held = self.leases.room(instance_id, len(keys)) if lease else None
        if held is not None:  # (one comparison: the keys its leases hold, a reference each)
            what = f"keys under leases ({len(keys)} more asked)"
            raise over_quota(self.log_throttle, inst, what, held, self.leases.max_keys)
        held, region_ids, offsets, lengths, checksums = self.keys.lookup_columns(keys, lease)
        nbytes = 0
        if lease and held and inst is not None:  # (its `lease_bytes`, quota or not: STATS)
            nbytes = sum(memoryview(lengths).cast("q"))
            if self.quota_lease_bytes and inst.lease_bytes + nbytes > self.quota_lease_bytes:
                release_entries(held)  # (a flood of leases must not keep writers from room)
                what = f"bytes under leases (a lease of {nbytes} more asked)"
                raise over_quota(
                    self.log_throttle, inst, what, inst.lease_bytes, self.quota_lease_bytes
                )
        self.count_reads(instance_id, lookups=len(keys), hits=len(held))
        lease_id = self.leases.add(held, instance_id, nbytes) if lease and held else 0
        handles = [self.regions[r].handle() for r in set(memoryview(region_ids).cast("q")) - {0}]
        return region_ids, offsets, lengths, checksums, handles, lease_id

    def exists(self, keys: list[Any], instance_id: str | None = None) -> list[bool]:
        """Membership; a hit counts as use, like a lookup (SGLang asks before it prefetches)."""
        entries = self.keys.get_many(keys)
        out = [entry is not None for entry in entries]
        for entry in compress(entries, out):
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
        """Count lookups and membership checks, server-wide and for the instance, including
        those a client answered from the local index (reported with its heartbeat)."""
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
        # The usual batch (every key registered, none twice, none pinned or leased) is checked
        # a pass per condition; otherwise the loop below decides key by key, the same way.
        entries = table.get_many(keys)
        if None not in entries and len(set(keys)) == len(keys) and not any(map(_BUSY, entries)):
            out = [DELETED] * len(keys)
        else:
            out, victims = deletable(keys, entries)
            keys, entries = list(victims), list(victims.values())
        self._drop_keys(keys, entries)
        self.counters["keys_deleted"] += len(keys)
        return out

    def _drop_keys(self, keys: list[Key], entries: list[KeyEntry]) -> dict[str, int]:
        """The one mutator that removes keys (deleted, evicted, or replayed): journal first, so a
        replay never sees a region freed before its keys are gone; then free pages / regions
        and tell the owners, per region with the outcome (order of "F" records and notices
        included) of dropping them one by one. `keys[i]` (all different) has `entries[i]`.
        Returns the keys dropped per owner of their regions (eviction counts its victims so,
        from the groups made here anyway, not with a Python step per key)."""
        if not keys:
            return {}
        self._log("D", keys)
        self.keys.remove_many(keys)
        if self.local_index is not None:  # before the pages can be reused: notices, frees
            self.local_index.remove(keys)
        region_ids, lengths, notices = entry_locations(entries)  # (notices: for the owners)
        groups = length_groups(region_ids, lengths)  # regions in the order of their last key
        self._count(groups, -1)
        notify: dict[int, bytearray] = {}  # region id -> its owner's freed pages
        per_owner: dict[str, int] = {}
        regions, instances = self.regions, self.instances
        for rid, group in groups.items():
            region = regions[rid]
            per_owner[region.owner] = per_owner.get(region.owner, 0) + sum(group.values())
            if region.returned:
                if region.live_keys == 0:
                    regions.free(region)
            else:
                owner = instances.get(region.owner)
                if owner is not None:
                    notify[rid] = owner.freed
        if not notify:
            return per_owner
        lists = list({id(freed): freed for freed in notify.values()}.values())
        if len(notify) == len(groups) and len(lists) == 1:  # one owner, told of every key
            lists[0] += notices
        else:
            at, size = 0, len(notices) // len(keys)  # (a notice's bytes)
            for rid in region_ids:
                freed = notify.get(rid)
                if freed is not None:
                    freed += notices[at : at + size]
                at += size
        return per_owner


def _over_room(
    counters: dict[str, int], throttle: Throttle, instance_id: str, over: dict[int, int]
) -> None:
    """Count and report (one throttled WARNING a batch) the new keys refused because their
    region's live bytes would pass its length, or its keys its pages: keys over bytes
    other keys hold."""
    refused = sum(over.values())
    counters["keys_over_region"] += refused
    held = throttle.allow(("over_region", instance_id))
    if held is not None:
        log.warning(
            "instance %s: %d keys refused: their region's keys would hold more bytes than "
            "it has, or outnumber its pages (keys registered over the same bytes) in %s%s",
            instance_id,
            refused,
            ", ".join(f"region {r} ({n} keys)" for r, n in over.items()),
            throttle.note(held),
            extra={"instance": instance_id, "region": sorted(over)},
        )


def _room_per_region(
    region_ids: list[int], lengths: list[int], room: dict[int, tuple[int, int]]
) -> bool:
    """Whether each region a batch names (several) has room for all its keys there."""
    if len(room) == 1:
        return False  # (the caller compared the one region's room with the whole batch)
    groups = length_groups(region_ids, lengths).items()
    return all(
        sum(n * k for n, k in group.items()) <= room[rid][0] and sum(group.values()) <= room[rid][1]
        for rid, group in groups
    )


# -- operator actions that walk the whole registry (not on any hot path) ----------------------


def delete_prefix(registry: Registry, prefix: Any) -> tuple[int, int]:
    """Delete every key starting with `prefix` that is not pinned or leased (an operator or
    `clear` action). Returns (deleted, skipped). Walks the whole registry: not hot."""
    if not isinstance(prefix, (str, bytes)) or not prefix:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "prefix must be a non-empty str or bytes")
    matching = [k for k in registry.keys if type(k) is type(prefix) and k.startswith(prefix)]
    return _delete(registry, matching)


def clear_all(registry: Registry) -> tuple[int, int]:
    """Delete every key that is not pinned or leased (`maru clear`): (deleted, skipped)."""
    return _delete(registry, list(registry.keys))


def deletable(
    keys: list[Key], entries: list[KeyEntry | None]
) -> tuple[list[int], dict[Key, KeyEntry]]:
    """What a delete makes of each key (`entries[i]`: its entry, None if absent): a
    DeleteStatus per key, NOT_FOUND (absent, or named before), PINNED (pinned or leased: a
    reader may still copy its pages) or DELETED; and the entries to drop, by key."""
    out: list[int] = []
    victims: dict[Key, KeyEntry] = {}
    for key, entry in zip(keys, entries):
        if entry is None or key in victims:
            out.append(NOT_FOUND)
        elif entry.busy:
            out.append(PINNED)
        else:
            victims[key] = entry
            out.append(DELETED)
    return out, victims


def _delete(registry: Registry, keys: list[Key]) -> tuple[int, int]:
    deleted = registry.delete(keys).count(DELETED)
    return deleted, len(keys) - deleted


def drop_corrupt(
    registry: Registry,
    keys: list[Key],
    places: list[tuple[int, int, int, int]],
    reporter: str,
) -> list[int]:
    """CORRUPT_KV: drop each key a reader found unlike its writer's checksum, but only if its
    entry is still the one the reader read (`places[i]`: region id, offset, length, checksum):
    a key deleted and stored again since, or rewritten elsewhere, holds another value, which
    must never go for the old one's fault. A pinned or leased entry is kept, as by a delete
    (its pages must not be reused while another reader copies them); the reporter released its
    own lease first. Returns a DeleteStatus per key; each drop logged at ERROR and counted."""
    entries = registry.keys.get_many(keys)
    for i, (key, entry, place) in enumerate(zip(keys, entries, places)):
        if (
            entry is not None
            and (entry.region_id, entry.offset, entry.length, entry.checksum) != place
        ):
            log.info("key %.200r: registered anew since %s found it corrupt: kept", key, reporter)
            entries[i] = None  # (not the value read: as if absent)
    statuses, victims = deletable(keys, entries)
    for key, status in zip(keys, statuses):
        if status == PINNED:
            log.warning(
                "key %.200r: %s found its bytes unlike its checksum, but it is pinned or leased: "
                "kept (a later reader will report it again)",
                key,
                reporter,
            )
    if victims:
        registry._drop_keys(list(victims), list(victims.values()))
        registry.counters["corrupt_dropped"] += len(victims)
        for key, entry in victims.items():
            log.error(
                "key %.200r dropped: %s read its %d bytes at region %d offset %d unlike the "
                "checksum its writer stored (corrupt in the pool); a writer may store it again",
                key,
                reporter,
                entry.length,
                entry.region_id,
                entry.offset,
                extra={"instance": reporter, "region": entry.region_id},
            )
    return statuses


def list_keys(
    registry: Registry, prefix: Any = None, limit: int = 100
) -> tuple[list[list[Any]], bool]:
    """Up to `limit` [key, length, owner] starting with `prefix` (None or empty: all), most
    recently used first as CLOCK knows (the reverse of eviction order), and whether more
    matched. Walks the registry (at most twice): an operator action (`maru keys`), not hot."""
    if prefix is not None and not isinstance(prefix, (str, bytes)):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "prefix must be a str or bytes")
    out: list[list[Any]] = []
    keys, regions = registry.keys, registry.regions
    registry.harvest_marks()  # readers' use marks count, as for eviction
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
