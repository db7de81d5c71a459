"""An instance's regions: taken as data arrives, grown up to `pool_size`, parked when idle
(the server may take them back), unparked before we write there again (docs/architecture.md,
"Capacity: regions as data arrives")."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from maru.client.chunks import AllocHandle
from maru.common.config import fmt_bytes
from maru.common.errors import MaruConnectionError, MaruError, MaruServerError
from maru.common.protocol import ErrorCode, MsgType
from maru.common.region import RegionHandle
from maru.common.throttle import Throttle

if TYPE_CHECKING:
    from maru.client.rpc import PendingReply
    from maru.client.session import Request, Session

log = logging.getLogger("maru.client.handler")

# At `pool_size`, a write of at most 1/AHEAD_SHARE of our regions keeps the room of the next
# AHEAD_WRITES writes free or being freed (`RegionSupply.ahead`); a larger one evicts only its
# own, so a small instance keeps its keys. Three, not one: room asked with a write's seal is
# answered during the next write's copy and taken in there (`collect_ahead`), so the write after
# that is the first to use it, and a run needs contiguous chunks (spare room absorbs the holes).
AHEAD_SHARE = 16
AHEAD_WRITES = 3
# Seconds between two "no room" WARNINGs of one instance
NO_ROOM_LOG_S = 10.0


@dataclass(frozen=True)
class Room:
    """A write's room: `chunks`, its chunks' bytes, and `values`, its values' bytes. An
    eviction is asked in `values`: the server counts keys' bytes, so asking in chunks would
    evict too much when values are not chunk multiples."""

    chunks: int
    values: int


class RegionSupply:
    """Chunks for one handler, and the regions they come from. One region change at a time
    (`lock`): grow, park, unpark."""

    def __init__(self, session: Session, request: Request):
        """`request`: the handler's own send (a test may wrap the session's to count a batch's
        requests: region traffic is not one of them)."""
        self.owner = session  # (its `config`, `instance_id` and `refused_stores`)
        self.chunks = session.chunks
        self.mapper = session.mapper
        self._request = request
        self.pool_capacity = 0  # the pool's, as of the last handshake (0: not known yet)
        self.pool_generation: str | None = None  # likewise
        self.lock = threading.Lock()
        self._park_seq = itertools.count(1)
        self._shed = 0  # bytes of regions the server asked us to give back (fair share)
        # Regions given up (`_give_back_share`) whose RETURN_REGION the server has not taken:
        # they may hold our keys, so they are never adopted again as empty (`reattach`), only
        # returned again at each `tick` until the server takes them or says they are not ours.
        self._unreturned: dict[int, RegionHandle] = {}
        self.full = False  # we evicted for room: we hold `pool_size` (or the pool is full)
        self._ahead = threading.local()  # .pending: this thread's EVICT_FOR sent ahead
        self._ready_lock = threading.Lock()
        self._ready_bytes = 0  # room `ready` keeps free in our regions (see there)
        self._readier: threading.Thread | None = None  # `ready`'s thread while it runs
        self._refusal = ""  # the server's last answer to a region request we needed (POOL_FULL)
        self._no_room_log = Throttle(NO_ROOM_LOG_S)  # (a failing batch fails value by value)

    def reserve(self, size: int, count: int) -> AllocHandle | None:
        """A run once the owned regions' free chunks (`ChunkBook.take`, tried first) have no
        room: unpark, a new region, else evict in our own regions."""
        chunk = self.chunks.chunk_size
        need = -(-size // chunk) * count * chunk
        # (the whole pool first: it says that no setting of this client would help)
        for limit, what, reason in (
            (self.pool_capacity or need, "the whole pool", "larger_than_pool"),
            (self.owner.config.pool_size, "this instance's pool_size", "larger_than_pool_size"),
        ):
            if need <= limit:
                continue
            # never fits: evicting anything for it would be in vain
            if count == 1:  # (a run that does not fit may still go value by value)
                self.owner.refused_stores[reason] += 1
                log.warning(
                    "instance %s: a value of %s is larger than %s (%s): not stored",
                    self.owner.instance_id,
                    fmt_bytes(size),
                    what,
                    fmt_bytes(limit),
                )
            return None
        with self.lock:
            self._settle()
            handle = self._take_or_unpark(size, count)  # another thread may have made room
            if handle is not None:
                return handle
            region_size = self._next_region_size(need)
            if region_size is not None:
                try:  # at least `need` when the pool is short (the server reclaims for it)
                    reply = self._request_region(region_size, need)
                    handle = RegionHandle.from_wire(reply["region"])
                    self.chunks.adopt(self.mapper.map(handle, writable=True))
                    handle = self.chunks.take(size, count)
                    if handle is not None:
                        return handle
                except MaruServerError as exc:
                    # (POOL_RECLAIMING here: those owing us room did not give it back while
                    # `_request_region` waited, e.g. a stopped process: our own keys make room
                    # rather than the value going unstored)
                    if exc.code not in (
                        ErrorCode.POOL_FULL,
                        ErrorCode.QUOTA_EXCEEDED,
                        ErrorCode.POOL_RECLAIMING,
                    ):
                        log.warning("instance %s: cannot expand: %s", self.owner.instance_id, exc)
                        return None
                    self._refusal = str(exc)
                    log.info("instance %s: %s", self.owner.instance_id, exc)
                except MaruConnectionError as exc:
                    log.warning("instance %s: cannot expand: %s", self.owner.instance_id, exc)
                    return None
            return self._evict_for(size, count)

    def _request_region(self, size: int, need: int) -> dict[str, Any]:
        """REQUEST_REGION's reply, POOL_RECLAIMING retried for a while (we are below our fair
        share; those above it give back at their next reply)."""
        body = {"size": size, "min_size": need, "pool_proof": self.mapper.pool_proof}
        for delay in (0.02, 0.04, 0.08, 0.16, 0.32, None):
            try:
                return self._request(MsgType.REQUEST_REGION, dict(body)).result()
            except MaruServerError as exc:
                if exc.code != ErrorCode.POOL_RECLAIMING or delay is None:
                    raise
                time.sleep(delay)
        raise AssertionError("unreachable")

    def shed(self, nbytes: int) -> None:
        """The server asks us to give back `nbytes` of regions (we hold more than our fair
        share and another instance has none to get): done at the next `tick`."""
        self._shed = max(self._shed, int(nbytes))

    def _give_back_share(self) -> None:
        """Return at least `_shed` bytes of regions no value is reserved in (caller holds
        `lock`), dropped first (`ChunkBook.give_up`): a page we may still write is never in a
        region we return, and a seal in flight into one is refused, never misplaced."""
        want, self._shed = self._shed, 0
        for mapped in self.chunks.give_up(want):
            self._unreturned[mapped.handle.region_id] = mapped.handle
            # Fenced before the server can hand it out: a write through a view or handle
            # kept from before lands in private memory (its keys are read from a new mapping)
            self.mapper.unmap(mapped.handle.region_id)
        self._return_unreturned()

    def _return_unreturned(self) -> None:
        """RETURN_REGION for each region given up and not yet taken back (caller holds
        `lock`). One the server did not take (unreachable, its journal unwritable) stays
        aside, unwritten, and is returned again at the next `tick`: were it forgotten, a
        restarted server would list it as ours with its keys, and `reattach` would adopt it
        with every chunk free, and our next writes would overwrite those keys' bytes."""
        for region_id, handle in list(self._unreturned.items()):
            body = {"region_id": region_id, "token": handle.token}
            try:
                self._request(MsgType.RETURN_REGION, body).result()
            except MaruError as exc:
                # Kept unless the server answered that it is not ours (NOT_OWNER,
                # UNKNOWN_REGION, BAD_TOKEN: returned already, or forgotten)
                if not isinstance(exc, MaruServerError) or exc.code in (
                    ErrorCode.STATE_UNAVAILABLE,
                    ErrorCode.UNKNOWN_INSTANCE,
                ):
                    log.warning(
                        "instance %s: returning region %d failed, kept aside to return again: %s",
                        self.owner.instance_id,
                        region_id,
                        exc,
                    )
                    continue
                log.info("instance %s: region %d: %s", self.owner.instance_id, region_id, exc)
            else:
                log.info(
                    "instance %s: region %d given back (over our fair share of the pool)",
                    self.owner.instance_id,
                    region_id,
                )
            del self._unreturned[region_id]

    def room(self, room: Room) -> None:
        """Before a write placed value by value: when our free chunks hold less than `room`
        and no region can be had, one EVICT_FOR for what is missing (and `_headroom`), so
        that no value asks on its own."""
        with self.lock:
            self._settle()
            self.chunks.settle()
            free = self.chunks.free * self.chunks.chunk_size
            if free >= room.chunks or self._next_region_size(room.chunks) is not None:
                return
            self.full = True
            headroom = self._headroom(room)
            self._evict(room.chunks - free + headroom, headroom)

    def ready(self, nbytes: int) -> None:
        """Have `nbytes` free in our regions before the writes that need it: with `eager_map`,
        a background thread takes regions (mapped, populated whole) until they are, evicting
        nothing and taking none where the pool has no free room."""
        if not self.mapper.populate_regions or not self.owner.config.auto_expand:
            return
        with self._ready_lock:  # (not `lock`: a write asks here, and must not wait)
            self._ready_bytes = max(self._ready_bytes, nbytes)
            if self._readier is None or not self._readier.is_alive():  # (or forked)
                self._readier = threading.Thread(
                    target=self._get_ready, name="maru-ready", daemon=True
                )
                self._readier.start()

    def _get_ready(self) -> None:
        """`ready`'s thread: ends once the room is free, or none can be taken ahead (and
        nobody asked for more meanwhile)."""
        while True:
            with self._ready_lock:
                want = self._ready_bytes
            if self._take_ahead(want):
                with self._ready_lock:
                    if self._ready_bytes == want:
                        self._ready_bytes, self._readier = 0, None
                        return

    def _take_ahead(self, want: int) -> bool:
        """One region for `ready`, unless `want` bytes are free (True: stop). `lock` is held
        for its request and mapping only: a write waits for at most that."""
        with self.lock:  # (the chunk size changes under it only: `set_chunk_size`)
            self.chunks.settle()
            size, chunk = None, self.chunks.chunk_size
            if self.chunks.free * chunk < want:
                size = self._next_region_size(chunk)
            if size is None:
                return True
            body = {"size": size, "min_size": size, "ahead": True}  # (nothing reclaimed for it)
            body["pool_proof"] = self.mapper.pool_proof
            try:
                reply = self._request(MsgType.REQUEST_REGION, body).result()
                handle = RegionHandle.from_wire(reply["region"])
                self.chunks.adopt(self.mapper.map(handle, writable=True, whole=True))
            except (MaruError, OSError) as exc:  # (POOL_FULL: no room to take ahead)
                log.debug("instance %s: no region ahead: %s", self.owner.instance_id, exc)
                return True
        log.debug(
            "instance %s: region %d (%s) taken ahead of our writes",
            self.owner.instance_id,
            handle.region_id,
            fmt_bytes(size),
        )
        return False

    def ahead(self, room: Room, free: int) -> None:
        """A write reserved `room` and left `free` bytes, less than the next AHEAD_WRITES
        writes': ready them. Below `pool_size`, the next region (`ready`); at it, what is
        missing is asked of the server with this thread's next registration (`take_ask`):
        its REGISTER_KV evicts that room before it seals, no request of its own (with a
        spilling cluster tier the victims are published first). One ask in flight per
        thread: the next waits for its reply, which brings the room."""
        if not self.full:  # (one write's room: regions are taken ahead whole)
            if free < room.chunks and self._next_region_size(room.chunks) is not None:
                self.ready(room.chunks)
            return
        pending = getattr(self._ahead, "pending", None)
        if pending is not None and not pending.done():
            return
        short = AHEAD_WRITES * room.chunks - free
        if short <= 0 or not self._headroom(room):
            return
        if self._next_region_size(room.chunks) is not None:
            return
        self._ahead.ask = -(-room.values * short // room.chunks)  # (in keys like ours)

    def take_ask(self) -> int:
        """This thread's ask for its next writes' room (`ahead`), cleared: the registration
        about to be sent carries it (then `asked`). 0: none."""
        ask = getattr(self._ahead, "ask", 0)
        self._ahead.ask = 0
        return ask

    def asked(self, pending: PendingReply) -> None:
        """The request carrying this thread's ask is out: its reply brings the room."""
        self._ahead.pending = pending

    def collect_ahead(self) -> None:
        """Take in the reply to this thread's ask if it is in, not waiting (a write calls it
        while its copy runs: the freed chunks are applied there, off its path)."""
        pending = getattr(self._ahead, "pending", None)
        if pending is not None and not pending.done():
            pending.arrived()
        self.chunks.settle()  # (the freed pages of every reply read so far)

    def _headroom(self, room: Room) -> int:
        """What a full instance evicts beyond a write of `room`: the next AHEAD_WRITES writes'
        room, if one is at most 1/AHEAD_SHARE of our regions; else nothing."""
        return (
            AHEAD_WRITES * room.values
            if room.chunks * AHEAD_SHARE <= self.chunks.owned_bytes()
            else 0
        )

    def _settle(self) -> None:
        """Wait for the reply to this thread's ask, if it is not in: its chunks are the room
        a reservation is about to look for. Only its arrival: the registration it came with
        takes its outcome itself (`Sealing.wait`)."""
        pending, self._ahead.pending = getattr(self._ahead, "pending", None), None
        if pending is not None and not pending.done():
            try:
                pending.wait()
            except MaruError as exc:
                log.debug("instance %s: no reply to an ask ahead: %s", self.owner.instance_id, exc)

    def _evict(self, nbytes: int, ahead: int = 0) -> dict[str, Any] | None:
        """One EVICT_FOR of `nbytes` in our regions (caller holds `lock`), `ahead` of them for
        the next writes; the freed chunks are free on return (the reply hook; with a spilling
        cluster tier, those of `ahead` may come later). None if it failed (logged)."""
        body = {"bytes": nbytes, "ahead": ahead} if ahead else {"bytes": nbytes}
        try:
            return self._request(MsgType.EVICT_FOR, body).result()
        except MaruError as exc:
            log.warning("instance %s: eviction request failed: %s", self.owner.instance_id, exc)
            return None

    def _evict_for(self, size: int, count: int) -> AllocHandle | None:
        """Room for `count` values of `size` bytes by evicting in our own regions. A run asks
        once for what the free chunks lack (plus `_headroom` at `pool_size`; the oldest keys,
        mostly earlier runs of its size, free mostly contiguous chunks), nothing if they hold
        its values one by one; None if no run results: the caller goes value by value. One
        value asks again, for twice as much, while what was freed holds no run."""

        want = -(-size // self.chunks.chunk_size) * self.chunks.chunk_size
        ahead = 0  # (of `want`: the next writes' room)
        if count > 1:  # (in keys like these values: the server counts keys' bytes)
            room = Room(want * count, size * count)
            free = self.chunks.free * self.chunks.chunk_size
            if free >= room.chunks:  # no run, but room value by value: nothing to evict
                return None
            want = -(-room.values * (room.chunks - free) // room.chunks)
            if self._next_region_size(room.chunks) is None:
                ahead = self._headroom(room)
                want += ahead
        self.full = True
        for _ in range(6 if count == 1 else 1):
            reply = self._evict(want, ahead)
            if reply is None:
                return None
            handle = self._take_or_unpark(size, count)
            if handle is not None:
                return handle
            if not reply["freed_bytes"]:
                break
            want *= 2
        if count == 1:
            self._warn_no_room(size)
        return None

    def _warn_no_room(self, size: int) -> None:
        """A value found no room (caller holds `lock`): a WARNING, NO_ROOM_LOG_S apart at most."""
        more = self._no_room_log.allow("no room")
        if more is not None:
            warn_no_room(
                self.owner.instance_id, size, self.chunks.owned_bytes(), self._refusal, more
            )

    def reattach(self, reply: dict[str, Any]) -> int:
        """After a HANDSHAKE: keep the regions the server still knows as ours, drop the others
        (and, if the pool is a new one, every mapping of other instances' regions); returns
        how many of ours it no longer knows."""
        still_owned = {h.region_id: h for h in map(RegionHandle.from_wire, reply["regions"])}
        pool = reply.get("pool") or {}
        self.pool_capacity = int(pool.get("capacity") or 0)
        generation = str(pool.get("generation", ""))
        if self.pool_generation is not None and generation != self.pool_generation:
            # A recreated or truncated pool: other instances' mappings are gone (remapped later)
            log.warning(
                "maru-server's pool is new (generation %s, was %s): dropping its old mappings",
                generation,
                self.pool_generation,
            )
            for region_id in self.mapper.region_ids():
                if region_id not in self.chunks:
                    self.mapper.unmap(region_id)
        self.pool_generation = generation
        lost = 0
        for region_id in self.chunks.region_ids():
            mapped = self.mapper.get(region_id)
            if region_id not in still_owned or (
                mapped is not None and mapped.handle != still_owned[region_id]
            ):
                log.warning("server no longer knows region %d; dropping it", region_id)
                self.chunks.drop(region_id)
                self.mapper.unmap(region_id)
                lost += 1
        for region_id in [r for r in self._unreturned if r not in still_owned]:
            del self._unreturned[region_id]  # (the server does not hold it as ours)
        for handle in still_owned.values():
            if handle.region_id in self._unreturned:  # (it may hold our keys: returned again)
                continue
            if handle.region_id not in self.chunks:  # (a grant whose reply we never read)
                self.chunks.adopt(self.mapper.map(handle, writable=True))
        return lost

    def _next_region_size(self, need: int) -> int | None:
        """How big our next region is: the first `region_expand_size`, each later one twice
        the largest we hold, never past `pool_size` in all (None: that cap leaves no room for
        `need` bytes). Without `auto_expand`, one region of `pool_size`."""
        held, cap = self.chunks.owned_bytes(), self.owner.config.pool_size
        if not self.owner.config.auto_expand:
            return None if held or need > cap else cap
        if need > cap - held:
            return None
        step = max(self.owner.config.region_expand_size, 2 * self.chunks.largest_region())
        return max(need, min(step, cap - held))

    def tick(self, report: dict[str, Any]) -> None:
        """Every heartbeat interval: park the idle regions and tell the server. A HEARTBEAT
        carries `report` (the local reads), unless a park said we live and there is none.
        Then the `freed` notices read since the last write are applied (an idle writer's
        notices do not pile up)."""
        with self.lock:
            if self._shed:
                self._give_back_share()
            elif self._unreturned:
                self._return_unreturned()
            parked = self.chunks.park_idle()
            if parked and self._park(parked, []) is not None and not report:
                self.chunks.settle()
                return
        self._request(MsgType.HEARTBEAT, report).result()
        self.chunks.settle()

    def _park(self, park: list[int], unpark: list[int]) -> list[int] | None:
        """One PARK_REGIONS exchange (the caller holds `lock`, so a park and an unpark
        are never in flight together; `seq` makes a late copy of either harmless): drops the
        regions the server took back; returns the regions unparked, None if it failed."""
        body = {"seq": next(self._park_seq), "park": park, "unpark": unpark}
        try:
            reply = self._request(MsgType.PARK_REGIONS, body).result()
        except MaruError as exc:
            log.debug("instance %s: park request failed: %s", self.owner.instance_id, exc)
            return None
        for region_id in reply["gone"]:
            # Taken back (nothing of ours was being written there). Its mapping is fenced:
            # an address a reader still holds in it reads the pool, a late write stays here.
            log.info("instance %s: region %d was taken back", self.owner.instance_id, region_id)
            self.chunks.drop(region_id)
            self.mapper.unmap(region_id)
        self.chunks.unpark(reply["unparked"])
        return reply["unparked"]

    def _take_or_unpark(self, size: int, count: int) -> AllocHandle | None:
        """`ChunkBook.take`, else unpark the parked regions with room and take again."""
        handle = self.chunks.take(size, count)
        if handle is None:
            room = self.chunks.parked_with_room(size, count)
            if room and self._park([], room):
                handle = self.chunks.take(size, count)
        return handle


def warn_no_room(instance_id: str, size: int, owned: int, refusal: str, more: int) -> None:
    """Why a value of `size` bytes found no room: an instance that owns no region (`owned`
    bytes) was refused one by the server (`refusal`, its reason: e.g. a pool with fewer
    regions than instances that write), else its own chunks are all pinned, leased or
    fragmented. `more`: values refused since the last such warning, not logged each."""
    why = (
        f"it holds no region and the server gives none ({refusal or 'the pool is full'})"
        if not owned
        else "all its chunks are pinned, leased or fragmented"
    )
    note = f" ({more} more values since the last such warning)" if more else ""
    log.warning("instance %s: no room for %d bytes in pool: %s%s", instance_id, size, why, note)
