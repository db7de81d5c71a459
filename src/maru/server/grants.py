"""Region grants: free pool space, else idle regions reclaimed (`Eviction.reclaim`); a fair
share for every live writer (an instance that holds or asked for regions); quotas per client
process; parking and returning regions.
The policy: docs/architecture.md, "Capacity: regions as data arrives".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from typing import Any

from maru.common.protocol import ErrorCode, ProtocolError, check_count
from maru.common.region import RegionHandle
from maru.common.throttle import Throttle
from maru.server.instances import Instance, InstanceTable
from maru.server.pool import Pool, PoolFullError
from maru.server.processes import process_name
from maru.server.regions import Region, RegionTable

log = logging.getLogger("maru.server.registry")

# How long the regions others give back are kept for an instance below its fair share that
# asked for one (`RegionGrants.wanting`): its client retries within a second or two.
WANT_SECONDS = 10.0


class RegionGrants:
    def __init__(
        self,
        pool: Pool,
        regions: RegionTable,
        instances: InstanceTable,
        reclaim: Callable[[Collection[str]], bool],
        counters: dict[str, int],
        log_throttle: Throttle,
        quota_region_bytes: int = 0,
    ):
        """`reclaim`: frees one idle region, True if it did (`Eviction.reclaim`), sparing the
        parked regions of the instances named.
        `quota_region_bytes`: the bytes of regions one client process may hold, its instances
        together (0: no limit)."""
        self.pool, self.regions, self.instances = pool, regions, instances
        self.reclaim, self.counters, self.log_throttle = reclaim, counters, log_throttle
        self.quota_region_bytes = quota_region_bytes
        # instance id -> until when (time.monotonic()) regions given back are kept for it
        self.wanting: dict[str, float] = {}
        # Owners inside the server (the cluster tier's instance), which give back what their
        # `shed` asks at once, as Plasma evicts before it grants: instance id -> the call that
        # does (the bytes given back). A client is told on its next reply instead.
        self.give_back_now: dict[str, Callable[[], int]] = {}

    def request(
        self, instance_id: str, size: int, min_size: int | None = None, *, reclaim: bool = True
    ) -> RegionHandle:
        """A new region for `instance_id`: `size` bytes if free, else at least `min_size`
        (default `size`), reclaiming idle regions until it fits; POOL_FULL when nothing more
        can be. `reclaim` False (taken ahead of need): POOL_FULL at once, evicting nothing."""
        inst = self.instances.require(instance_id)
        inst.writer = True  # (from its first ask on, owed a share: `fair_share`)
        check_count(size, "size")
        check_count(size if min_size is None else min_size, "min_size")
        pool = self.pool
        length = pool.round_up(size)
        least = min(length, pool.round_up(size if min_size is None else min_size))
        if least > pool.capacity:  # refused before reclaiming (evicting) anything
            raise ProtocolError(
                ErrorCode.POOL_FULL,
                f"pool {pool.name} cannot hold a region of {size} bytes: its capacity "
                f"is {pool.capacity} bytes",
            )
        if self.quota_region_bytes:
            held, whose = self.quota_held(inst)
            room = (self.quota_region_bytes - held) // pool.alignment * pool.alignment
            if room < least:
                quota = self.quota_region_bytes
                raise over_quota(self.log_throttle, inst, "bytes of regions", held, quota, whose)
            length = min(length, room)
        share, held = self.fair_share(), self.region_bytes(inst)
        now = time.monotonic()
        # One that has gone since, or waited its time, waits for nothing: dropped, else every
        # instance that ever asked stayed here (and in every request's pass) for good.
        self.wanting = {
            i: until for i, until in self.wanting.items() if until > now and i in self.instances
        }
        waiting = [i for i in self.wanting if i != instance_id]
        if waiting and held + least > share:  # what others give back is theirs
            raise ProtocolError(
                ErrorCode.POOL_FULL,
                f"instance {instance_id} holds {held} bytes of regions, its fair share of the "
                f"pool is {share} and {len(waiting)} other instances wait for theirs",
            )
        try:
            region = self.regions.allocate(instance_id, length, inst.page_size)
        except PoolFullError:
            if not reclaim:
                raise ProtocolError(
                    ErrorCode.POOL_FULL,
                    f"no free room for a region of {length} bytes taken ahead of need "
                    "(nothing is reclaimed for one)",
                ) from None
            below = held + least <= share
            region = self._allocate_reclaiming(instance_id, least, inst.page_size, below, share)
        self.wanting.pop(instance_id, None)
        inst.regions.add(region.region_id)
        return region.handle()

    def fair_share(self) -> int:
        """The bytes of regions each writer is owed: the pool's capacity over the live
        instances that hold or asked for regions (`Instance.writer`), never less than one
        region of the pool's alignment (more writers than regions). Readers do not count: they
        use no region, and counting them shrank each writer's share, so that a writer held at
        one region could not ask one holding most of the pool to give any back, and one asked
        gave back (evicting its keys) far more than another writer needed."""
        writers = sum(1 for i in self.instances.values() if i.writer or i.regions)
        share = self.pool.capacity // max(1, writers)
        return max(share, min(self.pool.alignment, self.pool.capacity))

    def regions_over_share(self) -> set[int]:
        """The regions of every instance that holds more than its fair share: where a
        watermark eviction takes its victims first (`Eviction.to_watermark`)."""
        share = self.fair_share()
        over: set[int] = set()
        for inst in self.instances.values():
            if self.region_bytes(inst) > share:
                over.update(inst.regions)
        return over

    def region_bytes(self, inst: Instance) -> int:
        """The bytes of the regions `inst` owns (returned ones no longer count)."""
        return sum(self.regions[r].length for r in inst.regions)

    def quota_held(self, inst: Instance) -> tuple[int, str]:
        """The region bytes `--quota-region-bytes` counts for `inst`: those of every instance
        held by the same process (`ProcessWatch`: the local socket's peer), else its own; and
        a note naming that process for the refusal's message."""
        processes = self.instances.processes
        process = processes.holder(inst.instance_id)
        if process is None:
            return self.region_bytes(inst), ""
        group = [i for i in self.instances.values() if processes.holder(i.instance_id) == process]
        held = sum(self.region_bytes(i) for i in group)
        pid = process_name(processes.pids(inst.instance_id)[0])
        return held, f" (process {pid}, {len(group)} instances)"

    def _ask_to_shed(self, instance_id: str, share: int) -> list[str]:
        """Ask every other instance above `share` to give back its excess (`shed`, on its next
        reply; its client returns only regions it holds no unsealed value in: the first rule);
        `instance_id` waits for them (`wanting`). The instances asked."""
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
        self, instance_id: str, length: int, page_size: int, below_share: bool, share: int
    ) -> Region:
        """A region of `length`, reclaiming idle ones until it fits. The parked regions with
        keys of the instances within their fair share are taken last, as in a watermark round
        (`Eviction.to_watermark`): whoever holds more than its share pays first. A requester
        below its share takes those over theirs' idle regions, else asks them to give some
        back (POOL_RECLAIMING), and takes a within-share instance's only when nobody is over.
        A requester over its share that can make the room among its own keys (it holds a
        region of `length` at least) takes none of them; one that cannot (a value larger than
        any region it holds) may take any."""
        can_make_room = any(
            self.regions[r].length >= length for r in self.instances[instance_id].regions
        )
        spared: Collection[str] = ()
        if below_share or can_make_room:
            spared = self._within_share(instance_id, share)
        while True:
            try:
                return self.regions.allocate(instance_id, length, page_size)
            except PoolFullError as exc:
                if self.reclaim(spared):
                    continue
                code, why = ErrorCode.POOL_FULL, str(exc)
                if spared and not below_share:
                    why += (
                        f"; {instance_id} is over its fair share ({share} bytes) and takes no "
                        "idle region of an instance within its own: it makes room among its "
                        "own keys"
                    )
                asked = self._ask_to_shed(instance_id, share) if below_share else []
                if self._given_back_now(asked):
                    continue  # (regions returned: the next reclaim takes them)
                if below_share and not asked and spared:
                    spared = ()  # (nobody over its share to ask: any idle region)
                    continue
                if asked:
                    code = ErrorCode.POOL_RECLAIMING
                    why += "; instances over their fair share were asked to give regions back"
                elif below_share:
                    why += (
                        f"; no other instance holds more than its fair share ({share} bytes) "
                        "and no region can be taken back (idle, no pinned or leased key): "
                        "the pool may hold fewer regions than instances that write"
                    )
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

    def _within_share(self, instance_id: str, share: int) -> set[str]:
        """The other instances that hold no more than `share` bytes of regions."""
        return {
            i.instance_id
            for i in self.instances.values()
            if i.instance_id != instance_id and self.region_bytes(i) <= share
        }

    def _given_back_now(self, asked: list[str]) -> bool:
        """Whether an owner inside the server among those `asked` gave regions back at once
        (`give_back_now`), so that the request goes on instead of waiting for clients."""
        given = 0
        for instance_id in asked:
            give_back = self.give_back_now.get(instance_id)
            if give_back is not None:
                given += give_back()
        return given > 0

    def park(
        self, instance_id: str, seq: Any, park: list[Any], unpark: list[Any]
    ) -> tuple[list[int], list[int]]:
        """An idle owner parks regions (it will not write there before unparking, so the server
        may take them back) or unparks them: (those unparked, those named it no longer owns).
        A `seq` not newer than the last applied is stale (a retry or a late copy) and changes
        nothing, so a late park can never undo the unpark after which the owner writes."""
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

    def give_back(self, instance_id: str, region_id: Any, token: Any) -> None:
        """RETURN_REGION: the owner gives a region back; it frees with its last key."""
        inst = self.instances.require(instance_id)
        region = self.regions.verified(region_id, token)
        if region.owner != instance_id or region.returned:
            raise ProtocolError(
                ErrorCode.NOT_OWNER, f"region {region_id} is not owned by {instance_id}"
            )
        self.regions.release(region)  # journal first: on failure the caller still owns it
        inst.regions.discard(region.region_id)


def over_quota(
    log_throttle: Throttle, inst: Instance, what: str, held: int, quota: int, whose: str = ""
) -> ProtocolError:
    """QUOTA_EXCEEDED for `inst`, logged (throttled); `whose`: who else the count includes."""
    message = f"instance {inst.instance_id}{whose} holds {held} {what}: its quota is {quota}"
    # (throttled per quota, not per amount asked: "bytes under leases (N more asked)")
    held_log = log_throttle.allow(("quota", what.partition(" (")[0], inst.instance_id))
    if held_log is not None:
        log.warning(
            "%s refused%s",
            message,
            log_throttle.note(held_log),
            extra={"instance": inst.instance_id},
        )
    return ProtocolError(ErrorCode.QUOTA_EXCEEDED, message)
