"""The eviction policy: which registered keys go when memory runs short (docs/architecture.md,
"Capacity and faults"): CLOCK order; never a pinned key (the caller asked it to stay) nor a
leased one (a reader is copying its bytes: its pages must not be rewritten mid-copy); whole
regions when the pool itself is full (`reclaim`). Victims go through the registry's one
key-dropping mutator (`Registry._drop_keys`), which journals them and tells the owners.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from operator import attrgetter

from maru.common.protocol import ErrorCode, Key, ProtocolError, check_count, freed_columns
from maru.common.throttle import Throttle
from maru.server.instances import InstanceTable
from maru.server.keyindex import KeyEntry, KeyIndex
from maru.server.regions import Region, RegionTable

log = logging.getLogger(__name__)
_REGION_ID = attrgetter("region_id")

# (victims' keys, their entries, hold, room for whom) -> the victims to drop now
Spill = Callable[[list[Key], list[KeyEntry], bool, str], tuple[list, list]]


@dataclass(frozen=True)
class EvictionView:
    """What eviction sees of the registry: its collections, and the calls for what changes."""

    keys: KeyIndex
    regions: RegionTable
    instances: InstanceTable
    counters: dict[str, int]
    log_throttle: Throttle
    capacity: int  # the pool's, in bytes
    live_bytes: Callable[[], int]  # the bytes of the keys registered now
    # the one key-dropping mutator; the keys dropped per owner of their regions
    drop_keys: Callable[[list[Key], list[KeyEntry]], dict[str, int]]
    harvest_marks: Callable[[], None]  # readers' use marks (the local index) into CLOCK bits
    # the regions of the instances that hold more than their fair share (`RegionGrants`)
    over_share: Callable[[], set[int]]


def _owners(regions: RegionTable, entries: list[KeyEntry]) -> dict[str, int]:
    """The entries per owner of their regions (counted per region first: mostly one)."""
    per_owner: Counter[str] = Counter()
    for region_id, count in Counter(map(_REGION_ID, entries)).items():
        per_owner[regions[region_id].owner] += count
    return per_owner


class Eviction:
    def __init__(self, view: EvictionView, high_watermark: float, low_watermark: float):
        if not 0 < low_watermark <= high_watermark <= 1:
            raise ValueError("watermarks must satisfy 0 < low <= high <= 1")
        self.view = view
        self.high_watermark = high_watermark  # of the pool's capacity, in registered bytes
        self.low_watermark = low_watermark
        # `--cluster-publish spill` (`ClusterTier.spill`): given a round's victims, whether it
        # may hold them and for whose room, holds those it publishes first (dropped once
        # published) and returns the others, to drop now
        self.spill: Spill | None = None
        self.spilling = 0  # bytes of victims it holds: evicted already, as the watermark goes
        # per instance, the bytes of its own victims held for it (`evict_for` ahead): room on
        # its way to it, which its next ask ahead does not evict again
        self.coming: Counter[str] = Counter()

    def evict(
        self,
        want_bytes: int,
        regions: set[int] | None = None,
        reason: str = "",
        protect: set[Key] | None = None,
        second_chance: bool = True,
        spill: bool = False,
        room_for: str = "",
    ) -> int:
        """Evict idle keys (only in `regions` if given, never those in `protect`) in CLOCK order
        until `want_bytes` are freed; the bytes freed. A second pass evicts the keys the first
        spared, so a round progresses even when every candidate was used; `second_chance=False`
        ignores the bits. `spill` (a round no writer waits on: a watermark's, or one asked
        ahead for `room_for`): victims the cluster tier publishes first stay registered, held,
        until it has; with spill configured, any other round's victims go unpublished (the
        tier counts them)."""
        reg = self.view
        reg.harvest_marks()  # readers' use marks count as CLOCK bits
        keys, entries, freed = reg.keys.clock_victims(want_bytes, second_chance, protect, regions)
        per_owner: dict[str, int]
        if self.spill is not None and keys:
            # (some victims may stay registered, held: every victim counts as evicted)
            per_owner = _owners(reg.regions, entries)
            # journal first: on a JournalWriteError nothing was evicted, and nothing is counted
            reg.drop_keys(*self.spill(keys, entries, spill, room_for))
        else:
            per_owner = reg.drop_keys(keys, entries)  # (as above: journaled first)
        for owner_id, count in per_owner.items():
            owner = reg.instances.get(owner_id)
            if owner is not None:
                owner.evicted += count
        if keys:
            reg.counters["evictions"] += len(keys)
            reg.counters["bytes_evicted"] += freed
            reg.counters["eviction_rounds"] += 1
            held = reg.log_throttle.allow(("evict", reason))
            if held is not None:
                log.info(
                    "eviction round (%s): %d keys, %d bytes evicted from %s%s",
                    reason or "requested",
                    len(keys),
                    freed,
                    ", ".join(f"{o} ({n} keys)" for o, n in Counter(per_owner).most_common()),
                    reg.log_throttle.note(held),
                    extra={"instance": sorted(per_owner)},
                )
        return freed

    def to_watermark(self, just_registered: Iterable[Key] = ()) -> int:
        """When registered bytes exceed the high watermark of the pool, evict down to low.
        `just_registered`: keys of the request being answered (reported REGISTERED, so they
        must survive it even if every older key is busy).

        The victims come from the instances over their fair share first, in CLOCK order
        among their keys, and from every key only for what those cannot give. A busy writer
        that holds most of the pool drives the pool past the watermark; a pool-wide CLOCK
        took the older keys of an instance below its share instead (a newcomer's first
        values, written before the busy writer's latest), which freed room in regions the
        busy writer cannot write to, and a miss for an instance the fair share protects."""
        capacity, live_bytes = self.view.capacity, self.view.live_bytes() - self.spilling
        if live_bytes <= self.high_watermark * capacity:
            return 0
        want, protect = live_bytes - int(self.low_watermark * capacity), set(just_registered)
        reason = f"above the high watermark {self.high_watermark:g}"
        over = self.view.over_share()
        freed = 0
        if over:
            freed = self.evict(want, over, f"{reason}, over their fair share", protect, spill=True)
        if freed < want:
            freed += self.evict(want - freed, reason=reason, protect=protect, spill=True)
        return freed

    def evict_for(self, instance_id: str, want_bytes: int, ahead: int = 0) -> int:
        """Make room in the caller's own regions (its store found no free pages and the pool
        has no region to give): evict the idle keys that live there, in CLOCK order; the
        bytes freed. `ahead` of `want_bytes` are room for its next writes, which wait on
        nobody: room already on its way to it is not evicted again for them (pages freed it
        has not been told of yet; with spill, victims held for it until published, whose
        room comes with a later reply), and with spill their victims are published first."""
        inst = self.view.instances.require(instance_id)
        want_bytes = check_count(want_bytes, "bytes")
        if type(ahead) is not int or not 0 <= ahead <= want_bytes:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                f"field 'ahead': expected an integer in [0, bytes], got {ahead!r:.40}",
            )
        now, reason = want_bytes - ahead, f"room for {instance_id}"
        if ahead:
            # (bytes freed in its regions that no reply has told it of yet: room on its way)
            untold = sum(freed_columns(bytes(inst.freed))[2]) if inst.freed else 0
            ahead = max(0, ahead - self.coming[instance_id] - untold)
        if self.spill is None or not ahead:  # (one round)
            return self.evict(now + ahead, inst.regions, reason=reason) if now + ahead else 0
        freed = self.evict(now, inst.regions, reason=reason) if now else 0
        return freed + self.evict(
            ahead, inst.regions, reason=f"{reason}, ahead", spill=True, room_for=instance_id
        )

    def reclaim(self, spared: Collection[str] = ()) -> bool:
        """Free one region for a region request that found no room; True if one was freed.
        Cheapest first: a parked region without keys, then a returned or parked one. The
        parked regions with keys of the instances in `spared` are not taken (those within
        their fair share: `RegionGrants._allocate_reclaiming` says when)."""
        regions = self.view.regions
        for region in regions.values():
            if region.parked and not region.returned and region.live_keys == 0:
                self.take_back(region)  # freed at once: no key points into it
                return True
        # (a held region, --reap-hold, stays out of use however many keys go: left alone)
        candidates = {
            r.region_id
            for r in regions.values()
            if (r.returned and not r.held_until)
            or (r.parked and not r.returned and r.owner not in spared)
        }
        return self._free_one(candidates)

    def _free_one(self, candidates: set[int]) -> bool:
        """Free one of `candidates` without a pinned or leased key by evicting all its keys, in
        the order eviction would reach them (evicting the bytes wanted over all candidates at
        once is not enough: when their keys interleave, it frees none)."""
        if not candidates:  # (no walk of every key: a full pool's refusal costs nothing)
            return False
        reg = self.view
        regions = reg.regions
        for region_id in reg.keys.reclaim_order(candidates):  # (one walk in C)
            region = regions[region_id]
            if not region.returned:
                self.take_back(region)
            self.evict(  # the whole region goes: no second chances
                1 << 62,
                {region_id},
                reason=f"reclaiming idle region {region_id} of {region.owner}",
                second_chance=False,
            )
            if region_id not in regions:
                return True
        return False

    def take_back(self, region: Region) -> None:
        """Reclaim a parked region from its live owner (`reclaim`): it is released as if
        returned (journaled "T"), so it frees with its last key; the owner learns it at its
        next park request or handshake."""
        view = self.view
        view.regions.release(region)
        owner = view.instances.get(region.owner)
        if owner is not None:
            owner.regions.discard(region.region_id)
        view.counters["regions_reclaimed"] += 1
        log.info(
            "region %d taken back from idle %s",
            region.region_id,
            region.owner,
            extra={"instance": region.owner, "region": region.region_id},
        )
