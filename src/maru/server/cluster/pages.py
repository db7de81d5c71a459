"""Pool pages for values pulled from the cluster. A pulled value needs pages before its bytes
arrive, and an owner once registered: the tier's own instance (never a client's), whose regions
come from the pool as any instance's do (`Registry.request_region`). Its pages are free again
when a pull fails or the server drops a pulled key (the `freed` notices every owner gets).
Room for the next pulls is taken ahead (`ready`): the instances on the node map and populate
a region within a quarter second of its making, so a pull that lands in one made ahead is read
without a page fault, where one made for it is faulted page by page by its first reader.
Regions go back to the pool when the pool asks (`shed`: another instance, below its fair
share, found the pool full), in the very request that found it full (`RegionGrants.
give_back_now`), so pulls never crowd out the node's own writers; when no region can be had,
a pull makes room among the tier's own pulled values (`_room_among_own`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from maru.common.extents import ExtentAllocator
from maru.common.protocol import ProtocolError
from maru.server.journal import JournalWriteError
from maru.server.registry import Registry

log = logging.getLogger("maru.server.cluster")

REGION_BYTES = 16 << 20  # asked per region; a larger value gets a region of its size
AHEAD_SHARE = 16  # room kept free ahead of pulls: at most this fraction of the pool
ALIGN = 4096


class TierPages:
    def __init__(self, registry: Registry, landing: Callable[[], set[int]] | None = None):
        """`landing`: the regions pulls are landing in now; given, the pages are given back
        when the pool asks in the request that found it full (`RegionGrants.give_back_now`),
        never those; else only by `shed`."""
        self.registry = registry
        self.instance_id = f"cluster-tier.{os.getpid()}.{os.urandom(4).hex()}"
        registry.instances.handshake(self.instance_id, os.getpid(), ALIGN)
        if landing is not None:
            registry.grants.give_back_now[self.instance_id] = lambda: self.shed(landing())
        self.free_lists: dict[int, ExtentAllocator] = {}  # region id -> its free pages
        # regions given back (`shed`) whose pulled keys the pool has not reclaimed yet
        self.given_back: set[int] = set()
        self.last = -1  # the region the last value's pages came from
        self.ahead = 0  # bytes kept free for the next pull (`ready`)

    def touch(self) -> None:
        """A sign of life, as a client's heartbeat (the tier's instance is never reaped)."""
        self.registry.instances.touch(self.instance_id)

    def reserve(self, length: int) -> tuple[int, int, str, int] | None:
        """Pages for `length` bytes: (region id, offset in it, the region's file, the offset
        in that file), or None when the pool has no room now. The offset is a multiple of the
        pages' length, so readers that name a value by its chunk index (LMCache) find only
        values as long as their chunk there: another is a miss (`Lookup.infos`)."""
        align = -(-length // ALIGN) * ALIGN
        place = self._in_own_regions(length, align)
        if place is not None:
            return place
        try:
            size = max(REGION_BYTES, length)
            handle = self.registry.request_region(self.instance_id, size, length)
        except (ProtocolError, JournalWriteError) as exc:  # (a region is journaled first)
            place = self._room_among_own(length, align)
            if place is None:
                log.info("cluster tier: no pool pages for a pull of %d bytes: %s", length, exc)
            return place
        pages = self.free_lists[handle.region_id] = ExtentAllocator(handle.length, ALIGN)
        offset = pages.allocate(length, align)
        self.last = handle.region_id
        return None if offset is None else self._place(handle.region_id, offset)

    def _in_own_regions(self, length: int, align: int) -> tuple[int, int, str, int] | None:
        """Free pages for `length` in the tier's regions: where the last value went (mostly
        room there), else the oldest region with room (full ones skipped)."""
        last = self.free_lists.get(self.last)
        if last is not None and (offset := last.allocate(length, align)) is not None:
            return self._place(self.last, offset)
        for region_id, pages in self.free_lists.items():
            if pages.free >= length and (offset := pages.allocate(length, align)) is not None:
                self.last = region_id
                return self._place(region_id, offset)
        return None

    def _room_among_own(self, length: int, align: int) -> tuple[int, int, str, int] | None:
        """No region to be had (the pool full, or the tier over its fair share): pages freed
        among the tier's own pulled values, least recently used first, as a client at its
        `pool_size` evicts its own. They are still in the cluster: the cheapest bytes of the
        pool to lose. One round frees a batch's worth (`ahead`: the next values of this pull
        find their pages freed, not a round each); twice as much asked once when what was
        freed holds no run of `length`."""
        want = max(length, self.ahead)
        for _ in range(2 if self.free_lists else 0):
            try:
                freed = self.registry.eviction.evict_for(self.instance_id, want)
            except (ProtocolError, JournalWriteError) as exc:
                log.info("cluster tier: no room made among pulled values: %s", exc)
                return None
            self.take_freed()
            place = self._in_own_regions(length, align)
            if place is not None:
                return place
            if not freed:
                break
            want *= 2
        return None

    def ready(self, batch_bytes: int) -> None:
        """After a batch of `batch_bytes` went to be pulled: keep as many bytes free in the
        tier's regions as the largest batch so far (at most 1/AHEAD_SHARE of the pool), taking
        a region when there are fewer: from the pool's free room only (nothing is evicted or
        reclaimed for room ahead)."""
        cap = self.registry.pool.capacity // AHEAD_SHARE
        self.ahead = min(max(self.ahead, batch_bytes), cap)
        free = sum(pages.free for pages in self.free_lists.values())
        if free >= self.ahead:
            return
        size = max(REGION_BYTES, self.ahead - free)
        try:
            handle = self.registry.request_region(self.instance_id, size, reclaim=False)
        except (ProtocolError, JournalWriteError):  # (no room now: pulls take it when needed)
            return
        self.free_lists[handle.region_id] = ExtentAllocator(handle.length, ALIGN)

    def shed(self, landing: set[int]) -> int:
        """Give back what the pool asked of the tier's instance (`RegionGrants`: it holds more
        than its fair share and another instance, below its own, found the pool full): whole
        regions, oldest first, never one a pull is landing in (`landing`: its pages are not
        registered yet). Pulled values are still in the cluster, so the room is cheap to give.
        A region given back keeps its keys readable until the pool reclaims it for the
        instance that waits. The bytes given back."""
        inst = self.registry.instances.get(self.instance_id)
        want = inst.shed if inst is not None else 0
        regions = self.registry.regions
        self.given_back = {r for r in self.given_back if r in regions}  # (the rest reclaimed)
        if want <= 0:
            return 0
        inst.shed = 0  # (asked again if the waiting instance still finds no room)
        given = 0
        for region_id in [r for r in self.free_lists if r not in landing]:
            if given >= want:
                break
            region = regions[region_id]
            try:
                self.registry.return_region(self.instance_id, region_id, region.token)
            except (ProtocolError, JournalWriteError) as exc:
                log.warning("cluster tier: region %d not given back: %s", region_id, exc)
                break
            del self.free_lists[region_id]
            self.given_back.add(region_id)
            given += region.length
        if self.last not in self.free_lists:
            self.last = -1
        log.info("cluster tier: gave %d bytes of regions back to the pool, asked %d", given, want)
        return given

    def pulled_into(self, region_id: int) -> bool:
        """Whether `region_id`'s values were pulled (they are in the cluster already): one of
        the tier's regions, or one it gave back whose keys are still readable."""
        if region_id in self.free_lists:
            return True
        if region_id not in self.given_back:
            return False
        region = self.registry.regions.get(region_id)
        return region is not None and region.returned and region.owner == self.instance_id

    def _place(self, region_id: int, offset: int) -> tuple[int, int, str, int]:
        region = self.registry.regions[region_id]
        return region_id, offset, region.path, region.offset + offset

    def release(self, region_id: int, offset: int) -> None:
        pages = self.free_lists.get(region_id)
        if pages is not None:
            pages.free_extent(offset)

    def take_freed(self) -> None:
        """The pages of pulled keys the server dropped are free again."""
        for region_id, offset, _length in self.registry.instances.take_freed(self.instance_id):
            self.release(region_id, offset)
