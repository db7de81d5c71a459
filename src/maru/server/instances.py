"""Who is connected: the instances the server knows, their session credentials and processes,
and their lifecycle (handshake, sign of life, disconnect, reaping). An instance is a
credential the server issued (`open_session`), not a PID or a name; what it holds (regions,
pins, leases) goes when it disconnects or is reaped, and its credential then resumes nothing.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from maru.common.protocol import ErrorCode, ProtocolError, freed_notices
from maru.common.region import RegionHandle
from maru.common.throttle import Throttle
from maru.server.journal import JournalWriteError
from maru.server.processes import Holder, ProcessWatch, process_name
from maru.server.regions import RegionTable
from maru.server.token import TokenSigner

log = logging.getLogger("maru.server.registry")

# Instances at once (`--max-instances`): each is an object, a credential, a place in every
# reap and fair-share pass and two log lines; a client handshaking in a loop (and keeping
# them alive by heartbeats) made them without bound.
MAX_INSTANCES = 4096
# Instances one process may hold on the local socket (a pidfd each): a real client runs a
# handful of handlers per process.
MAX_PER_PROCESS = 256
# After a scan of a full table found no instance to reap for room (`admit`), the next scan
# waits this long: a client handshaking in a loop must not make each refusal a pass over
# every instance.
IDLE_RESCAN_S = 1.0


@dataclass
class Instance:
    instance_id: str
    pid: int = 0
    page_size: int = 0  # reported at handshake; informs per-instance page stats
    regions: set[int] = field(default_factory=set)
    # pages to reuse: packed int64 (region_id, offset, length), a reply's `freed` as it goes
    freed: bytearray = field(default_factory=bytearray)
    pins: Counter = field(default_factory=Counter)  # key -> pins this instance holds
    pin_count: int = 0  # its pins on all keys together (STATS reads it in O(1))
    leases: set[int] = field(default_factory=set)
    last_seen: float = field(default_factory=time.monotonic)
    sealed_at: float = 0.0  # its last write-behind seal (perf_counter; `MaruService._wants_spin`)
    keys_registered: int = 0
    bytes_registered: int = 0
    hits: int = 0
    misses: int = 0
    exists_hits: int = 0  # EXISTS checks (what SGLang asks before it prefetches)
    exists_misses: int = 0
    evicted: int = 0  # keys evicted out of this instance's regions
    park_seq: int = 0  # the sequence number of the last PARK_REGIONS applied
    lease_bytes: int = 0  # bytes of the keys its leases hold (--quota-lease-bytes)
    lease_keys: int = 0  # keys its leases hold, a reference each (`LeaseTable.max_keys`)
    pin_bytes: int = 0  # bytes of the keys it pins, each once (`Pins.max_bytes`)
    # Its last request but a bare heartbeat (time.monotonic()): of those holding nothing, a
    # full table reaps the one idle longest (`InstanceTable.admit`). Set by `touch` for any
    # message but a HEARTBEAT, and by `beat` for a heartbeat that reports reads.
    active_at: float = field(default_factory=time.monotonic)
    shed: int = 0  # bytes of regions to ask it to give back, on its next reply (fair share)
    # It asked for a region once (REQUEST_REGION): it writes, so it is owed a fair share; an
    # instance that only reads never uses pool room, and counting it shrank writers' shares
    writer: bool = False
    routes: set[bytes] = field(default_factory=set)  # its TCP connections (ZMQ routing ids)
    dropped: bool = False  # its last TCP connection dropped, and it has not spoken since
    host: str = ""  # where it last spoke from: "local" (the Unix socket), else an address


class InstanceTable(dict[str, Instance]):
    """instance id -> Instance, with the lifecycle verbs."""

    def __init__(
        self,
        regions: RegionTable,
        signer: TokenSigner,
        let_go: Callable[[Instance], tuple[int, int]],
        log_throttle: Throttle,
        counters: dict[str, int],
        reap_hold: float = 0.0,
    ):
        """`let_go`: drops a departing instance's pins and leases, returning how many."""
        super().__init__()
        self.regions, self.signer, self.let_go = regions, signer, let_go
        self.log_throttle, self.counters = log_throttle, counters
        self.sessions: dict[str, str] = {}  # credential -> instance id (`open_session`)
        self.processes = ProcessWatch()  # the process holding each instance, where known
        self.reap_hold = reap_hold
        self.routes: dict[bytes, str] = {}  # ZMQ routing id -> the instance that spoke on it
        self.max_instances = MAX_INSTANCES  # (`admit`)
        self.max_per_process = MAX_PER_PROCESS  # (`claim`)
        # `admit`'s candidates, idle longest last: [(active_at, instance id)], checked again
        # when taken; and when a scan for more may next run
        self._idle: list[tuple[float, str]] = []
        self._idle_scan_at = 0.0

    def require(self, instance_id: Any) -> Instance:
        """The instance a request that needs one names (UNKNOWN_INSTANCE: handshake first)."""
        if not isinstance(instance_id, str) or instance_id not in self:
            raise ProtocolError(
                ErrorCode.UNKNOWN_INSTANCE, f"unknown instance {instance_id!r}: handshake first"
            )
        inst = self[instance_id]
        inst.last_seen = time.monotonic()
        return inst

    def admit(self, idle_s: float) -> None:
        """Room for one more instance (a HANDSHAKE that makes one), else QUOTA_EXCEEDED: the
        server's memory must not grow with a client's handshakes. Places free as instances
        disconnect or are reaped (a silent one after the heartbeat timeout); on a full table
        by reaping one that holds nothing and was idle over `idle_s` (`_reap_idle`), so that
        one client's handshakes, kept alive by heartbeats, cannot lock the others out."""
        if len(self) < self.max_instances or self._reap_idle(idle_s):
            return
        why = (
            f"the server has {len(self)} instances, its most (--max-instances): a new one is "
            "refused until one disconnects or is reaped"
        )
        held = self.log_throttle.allow(("max_instances",))
        if held is not None:
            log.warning("handshake refused: %s%s", why, self.log_throttle.note(held))
        raise ProtocolError(ErrorCode.QUOTA_EXCEEDED, why)

    def _reap_idle(self, idle_s: float) -> bool:
        """Reap the instance idle longest (no request but bare heartbeats for over `idle_s`)
        of those holding nothing (no region, hence no key in one; no pin, no lease): that
        costs it only a handshake, which its client makes when told UNKNOWN_INSTANCE. A
        watched, live process too: nothing of its can be written into after. Whether one
        was; candidates are kept from one scan for the next handshakes, each checked again."""
        now = time.monotonic()
        while True:
            if not self._idle and now >= self._idle_scan_at:
                self._idle = sorted(
                    ((i.active_at, i.instance_id) for i in self.values() if _idle(i, now, idle_s)),
                    reverse=True,
                )
                if not self._idle:  # (no longer than it takes to become idle)
                    self._idle_scan_at = now + min(IDLE_RESCAN_S, idle_s)
            if not self._idle:
                return False
            active_at, instance_id = self._idle.pop()
            inst = self.get(instance_id)
            if inst is None or inst.active_at != active_at or not _idle(inst, now, idle_s):
                continue
            why = (
                f"reaped to make room (--max-instances): it holds nothing and sent no request "
                f"for {now - active_at:.0f} s"
            )
            self.disconnect(instance_id, reason=why)
            self.counters["instances_reaped"] += 1
            return True

    def beat(self, instance_id: Any, reads: bool) -> None:
        """A HEARTBEAT shows life, not use (`touch` marked none): one that reports reads the
        client answered from the local index (`reads`) is use, and ends its idleness."""
        inst = self.get(instance_id) if isinstance(instance_id, str) else None
        if inst is not None and reads:
            inst.active_at = time.monotonic()

    def claim(self, instance_id: str, sock: Any) -> str | None:
        """`ProcessWatch.claim` (None, or why the peer may not speak for it), for at most
        `max_per_process` instances of one process: past it QUOTA_EXCEEDED and no pidfd
        taken, so one process cannot take the server's descriptors by handshaking."""

        def admit(process: Holder) -> None:
            held = self.processes.held_by(process.identity)
            if held < self.max_per_process:
                return
            why = (
                f"process {process_name(process.pid)} holds {held} instances "
                f"on the local socket, the most one process may; instance {instance_id} is "
                "refused (close a MaruHandler)"
            )
            allowed = self.log_throttle.allow(("per_process", process.identity))
            if allowed is not None:
                log.warning("%s%s", why, self.log_throttle.note(allowed))
            raise ProtocolError(ErrorCode.QUOTA_EXCEEDED, why)

        return self.processes.claim(instance_id, sock, admit)

    def touch(
        self, instance_id: Any, route: bytes | None = None, host: str = "", heartbeat: bool = False
    ) -> None:
        """Any message naming a known instance is a sign of life, and shows it connected; any
        but a `heartbeat` is a sign of use too (its idleness ends: `admit`; a heartbeat that
        reports reads is one, `beat`). `route`: the ZMQ routing id it came on (None: the
        local socket); `host`: where from (`MaruService.host_of`; "" keeps the last known)."""
        inst = self.get(instance_id) if isinstance(instance_id, str) else None
        if inst is not None:
            now = time.monotonic()
            inst.last_seen = now
            if not heartbeat:
                inst.active_at = now
            inst.dropped = False
            if host:
                inst.host = host
            if route is not None and route not in inst.routes:
                inst.routes.add(route)
                self.routes[route] = instance_id

    def route_dropped(self, route: bytes) -> None:
        """A TCP connection closed (`TcpEndpoint`'s socket monitor): the last of an instance
        whose process is not watched shows it dropped. Reaping still waits for the heartbeat
        timeout: it may be a live process on another host, which ZeroMQ reconnects."""
        instance_id = self.routes.pop(route, None)
        inst = self.get(instance_id) if instance_id is not None else None
        if inst is None:
            return
        inst.routes.discard(route)
        if inst.routes or inst.dropped or self.processes.pids(inst.instance_id):
            return
        inst.dropped = True
        log.info(
            "instance %s: its TCP connection dropped (its process exited, or the network cut "
            "it): gone; reaped after --heartbeat-timeout without a message, unless it "
            "reconnects",
            instance_id,
            extra={"instance": instance_id},
        )

    def handshake(self, instance_id: str, pid: int, chunk_size: int = 0) -> list[RegionHandle]:
        """(Re)attach an instance; the regions it still owns (after a reconnect). `chunk_size`
        (the client's allocation unit, 0: unknown) feeds only page statistics; a re-handshake
        with a new one (MaruStorage learning SGLang's page size) recounts empty regions in it."""
        if not isinstance(instance_id, str) or not instance_id or len(instance_id) > 128:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "instance_id must be a non-empty string")
        inst = self.get(instance_id)
        how = "connected" if inst is None else "reconnected"
        log.info("instance %s %s (pid %d)", instance_id, how, pid, extra={"instance": instance_id})
        if inst is None:
            inst = self[instance_id] = Instance(instance_id)
        inst.pid, inst.page_size, inst.last_seen = pid, chunk_size, time.monotonic()
        owned = [self.regions[r] for r in sorted(inst.regions)]
        for region in owned:
            if not region.live_keys:
                region.page_size = chunk_size
        return [region.handle() for region in owned]

    def open_session(self, instance_id: str) -> str:
        """The credential of a handshaken instance (`TokenSigner.session`), from now on the
        only thing that makes a request this instance's."""
        session = self.signer.session(instance_id)
        self.sessions[session] = instance_id
        return session

    def disconnect(
        self, instance_id: str, reason: str = "disconnected", hold: float = 0.0
    ) -> tuple[int, int, int]:
        """Forget an instance: drop its pins and leases; its regions (their keys stay readable)
        free once no key points into them and `hold` seconds have passed. The counts of pins,
        leases and regions let go. Journal first, step by step ("X", then a "T" per region): on
        `JournalWriteError` the rest waits, the instance staying with the regions it owns."""
        inst = self.get(instance_id)
        if inst is None:
            return 0, 0, 0
        pins, leases = self.let_go(inst)
        regions = len(inst.regions)
        try:
            for region_id in sorted(inst.regions):
                self.regions.release(self.regions[region_id], hold)
                inst.regions.discard(region_id)
        except JournalWriteError:
            if len(inst.regions) < regions:
                # Left half let go: some regions released (held, then freed and handed out).
                # Its credential is void until it handshakes, which tells its client which
                # regions are still its own; else a paused writer resumes into a released one.
                self.sessions.pop(self.signer.session(instance_id), None)
            raise
        del self[instance_id]
        for route in inst.routes:
            if self.routes.get(route) == instance_id:
                del self.routes[route]
        self.sessions.pop(self.signer.session(instance_id), None)
        self.processes.forget(instance_id)
        log.info(
            "instance %s %s: %d pins and %d leases released, %d regions returned",
            instance_id,
            reason,
            pins,
            leases,
            regions,
            extra={"instance": instance_id},
        )
        return pins, leases, regions

    def reap(self, timeout: float, now: float | None = None) -> list[str]:
        """Disconnect dead instances: at once those whose watched processes all exited; after
        `timeout` s of silence those whose process is not watched, their regions then held for
        `reap_hold` s (it may only be paused). A watched, live process is never reaped for
        silence: stopped, it may resume writing into its regions (`maru.server.processes`)."""
        now = time.monotonic() if now is None else now
        exited = set(self.processes.exited())
        dead: list[tuple[str, str, float]] = []
        for inst in self.values():
            iid = inst.instance_id
            if iid in exited:
                dead.append((iid, "reaped: its process exited", 0.0))
            elif now - inst.last_seen > timeout:
                pids = self.processes.pids(iid)
                if not pids:
                    why = f"reaped after {timeout:g}s without a heartbeat"
                    dead.append((iid, why, self.reap_hold))
                elif self.log_throttle.allow(("silent", iid)) is not None:
                    log.warning(
                        "instance %s silent for %.0f s, but its process %s is alive (stopped?):"
                        " not reaped",
                        iid,
                        now - inst.last_seen,
                        ", ".join(map(process_name, pids)),
                        extra={"instance": iid},
                    )
        for iid in exited - {d[0] for d in dead}:  # exited, already gone from the registry
            self.processes.forget(iid)
        for n, (instance_id, reason, hold) in enumerate(dead):
            try:
                self.disconnect(instance_id, reason=reason, hold=hold)
            except JournalWriteError:  # logged by the journal; the rest wait until it works
                return [d[0] for d in dead[:n]]
            self.counters["instances_reaped"] += 1
        return [d[0] for d in dead]

    def hand_out(self, instance_id: str | None, reply: dict[str, Any]) -> None:
        """Put the instance's freed pages and the bytes of regions to ask it to give back
        (fair share) into `reply`: each handed out once."""
        inst = self.get(instance_id)
        if inst is None:
            return
        if inst.freed:
            reply["freed"] = bytes(inst.freed)
            inst.freed.clear()
        if inst.shed:
            reply["shed"], inst.shed = inst.shed, 0

    def take_freed(self, instance_id: Any) -> list[list[int]]:
        """The instance's freed pages as [region_id, offset, length], each handed out once
        (the cluster tier's pages, which no reply carries)."""
        inst = self.get(instance_id) if isinstance(instance_id, str) else None
        if inst is None or not inst.freed:
            return []
        freed = freed_notices(bytes(inst.freed))
        inst.freed.clear()
        return freed


def _idle(inst: Instance, now: float, idle_s: float) -> bool:
    """Whether `inst` holds nothing and sent no request for over `idle_s` (`admit`)."""
    return not inst.regions and not inst.pins and not inst.leases and now - inst.active_at > idle_s
