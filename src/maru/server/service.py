"""The RPC loop: one thread, one request at a time, from the TCP port and the local socket.

Every frame gets a reply, even garbage (an error reply; the loop carries on). The loop never
touches page bytes: it authenticates each request and hands its body to its message type's
handler (`maru.server.handlers`).
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from time import perf_counter
from typing import Any

import zmq

from maru import __version__
from maru.common import protocol
from maru.common.config import parse_coherence
from maru.common.protocol import ErrorCode, MsgType, ProtocolError
from maru.common.throttle import Throttle
from maru.server.cluster.tier import ClusterTier
from maru.server.cluster.waits import PullWaits, Waiting
from maru.server.handlers import CHANGES, HANDLERS, WAIT
from maru.server.housekeeping import Housekeeping, freeze_heap
from maru.server.journal import Journal, JournalWriteError
from maru.server.local_socket import LocalDoor, LocalSocketServer, Peer, holder_of, local_address
from maru.server.metrics import RequestStats
from maru.server.processes import process_name
from maru.server.registry import Registry
from maru.server.tcp_socket import TcpEndpoint

log = logging.getLogger(__name__)


def _listen_locally(address: str, auto: bool, door: LocalDoor | None) -> LocalSocketServer:
    """The local socket at `address`. With "auto", a name someone else holds (a squatter: the
    TCP port is ours, so not another maru-server of this state dir) is an ERROR naming it, and
    the server listens under a new name, which the handshake tells clients."""
    try:
        return LocalSocketServer(address, door)
    except OSError as exc:
        if not auto or exc.errno != errno.EADDRINUSE:
            raise
    fallback = f"{address}:{secrets.token_hex(4)}"
    log.error(
        "local socket %s is taken by %s, not by this server: another process squats "
        "maru-server's name; listening on %s instead (clients refuse a socket of another "
        "user, and learn the new name at their next handshake)",
        address,
        holder_of(address),
        fallback,
    )
    return LocalSocketServer(fallback, door)


# Requests that walk every key (DELETE_PREFIX, KEYS: `WalkBudget`) may take this share of the
# loop's time, after a burst of this many seconds of walking.
WALK_SHARE = 0.25
WALK_BURST_S = 1.0


class WalkBudget:
    """The loop's time for requests that walk every key (DELETE_PREFIX, KEYS): operators'
    actions, open to any client, whose cost grows with the registry, not with the request;
    sent back to back they would hold the one loop every instance is served by. A leaky
    bucket of seconds: each walk adds its time, which drains at `share` of real time; while
    more than `burst` seconds are owed, a walk is refused (QUOTA_EXCEEDED, saying when to
    retry). Small registries' walks never come near it."""

    def __init__(
        self,
        share: float = WALK_SHARE,
        burst: float = WALK_BURST_S,
        throttle: Throttle | None = None,
        clock: Callable[[], float] = perf_counter,
    ):
        self.share, self.burst, self.clock = share, burst, clock
        self.throttle = throttle if throttle is not None else Throttle(10.0)
        self.owed = 0.0  # seconds of walking not yet drained
        self.at = clock()  # when `owed` was last drained

    @contextmanager
    def walk(self, what: str) -> Iterator[None]:
        now = self.clock()
        self.owed = max(0.0, self.owed - (now - self.at) * self.share)
        self.at = now
        if self.owed > self.burst:
            wait_s = (self.owed - self.burst) / self.share
            why = (
                f"{what} walks every key: such requests may take {self.share:.0%} of the "
                f"server's time, and have taken it; retry in {wait_s:.1f} s"
            )
            held = self.throttle.allow(("walks",))
            if held is not None:
                log.warning("%s refused%s", why, self.throttle.note(held))
            raise ProtocolError(ErrorCode.QUOTA_EXCEEDED, why)
        try:
            yield
        finally:
            self.owed += self.clock() - now


class MaruService:
    def __init__(
        self,
        registry: Registry,
        bind_url: str,
        *,
        journal: Journal | None = None,
        heartbeat_timeout: float = 15.0,
        local_socket: str | None = "auto",
        gc_freeze: bool = False,
        busy_poll_us: int = 0,
        curve_secret_key: bytes | None = None,
        curve_clients: Path | None = None,
        local_door: LocalDoor | None = None,
        coherence: str = "hardware",
    ):
        """`local_socket`: where else to listen, for clients on this node (`local_address`);
        with "auto" an address that cannot be bound only costs the speed-up (logged), an
        explicit one is an error. `gc_freeze`: `freeze_heap` now and every loop turn;
        process-wide, so only `maru-server` sets it. `busy_poll_us`: see `_wait_for_requests`;
        `curve_*`: see `TcpEndpoint`; `local_door`: who may use the local socket (default: this
        user and root); `coherence`: the copies' mode announced at HANDSHAKE (`--coherence`)."""
        self.registry = registry
        self.journal = journal
        self.housekeeper = Housekeeping(
            registry, journal, heartbeat_timeout, gc_freeze, on_pool_lost=self._pool_lost
        )
        self.pool_lost: str | None = None  # why the loop stopped: the pool changed under it
        if busy_poll_us < 0:
            raise ValueError(f"busy_poll_us must be >= 0, got {busy_poll_us}")
        self.busy_poll_s = busy_poll_us / 1e6
        # What this loop turn's requests say of the spin (`_wait_for_requests`): True, one wants
        # it; False, only write-behind seals far apart were served; None, no request judged.
        self.spin_wanted: bool | None = None
        self.coherence = parse_coherence(coherence, name="--coherence")
        registry.pool.ensure_mark()  # (`maru-server` wrote it already: claim_pool)
        # A new instance's id: its name and 64 random bits, not the id of an earlier instance
        # in practice (whose voided credential a paused or stray process may still hold, and
        # would name it again); never a live one's (`handlers._new_instance_id`).
        self.new_instance_id: Callable[[str], str] = lambda name: f"{name}.{secrets.token_hex(8)}"
        self.epoch = f"{time.time_ns():x}"  # changes on every start: clients notice restarts
        self._stop = threading.Event()
        self.requests = RequestStats(list(HANDLERS))
        self.started_at = time.time()
        self._started_monotonic = time.monotonic()
        self.metrics_url: str | None = None  # set when `--metrics-port` serves Prometheus
        self.cluster: ClusterTier | None = None  # set by `--cluster` (`maru.server.cluster`)
        self.waits = PullWaits()  # EXISTS requests kept until the tier's pulls land
        self.walks = WalkBudget(throttle=registry.log_throttle)  # DELETE_PREFIX, KEYS
        self.tcp = TcpEndpoint(
            zmq.Context.instance(),
            bind_url,
            curve_secret_key,
            curve_clients,
            on_drop=registry.instances.route_dropped,  # `maru status`: gone at once
        )
        self.endpoint = self.tcp.endpoint
        self.local: LocalSocketServer | None = None
        address = local_address(local_socket, self.endpoint, registry.signer.server_tag())
        if address is not None:
            try:
                self.local = _listen_locally(address, local_socket == "auto", local_door)
            except OSError as exc:
                if local_socket != "auto":
                    self.tcp.close()
                    raise OSError(f"cannot listen on --local-socket {address}: {exc}") from exc
                log.error("no local socket (%s): clients use %s only", exc, self.endpoint)
        if gc_freeze:
            freeze_heap(full=True)  # the restored registry: one full collection, at start-up

    def stats(self) -> dict[str, Any]:
        """What STATS returns, and what the metrics endpoint exports (read at scrape time from
        another thread: see `maru.server.metrics`)."""
        stats = self.registry.stats()
        stats["epoch"] = self.epoch
        stats["version"] = __version__
        stats["started_at"] = self.started_at
        stats["uptime_seconds"] = round(time.monotonic() - self._started_monotonic, 3)
        stats["metrics_url"] = self.metrics_url
        # `maru status`: "reaping in N s"
        stats["heartbeat_timeout"] = self.housekeeper.heartbeat_timeout
        local = self.local
        stats["local_socket"] = local.address if local is not None else None
        stats["local_connections"] = len(local.connections) if local is not None else 0
        connections = list(local.connections.values()) if local is not None else []
        held = Counter(conn.instance for conn in connections)
        for iid, instance in stats["instances"].items():
            instance["local_connections"] = held[iid]  # (its connections to the Unix socket)
        journal = self.journal
        journal_counters = ("fsyncs", "fsync_errors", "write_errors", "snapshot_errors")
        for name in journal_counters:  # metrics.COUNTERS journal_*
            stats["counters"][f"journal_{name}"] = getattr(journal, name) if journal else 0
        error = journal.write_error if journal is not None else None
        stats["journal_writable"] = error is None
        stats["journal_error"] = None if error is None else str(error)
        stats.update(self.requests.report())
        cluster = self.cluster
        stats["cluster"] = {**cluster.stats(), **self.waits.counts} if cluster is not None else None
        return stats

    # -- loop --------------------------------------------------------------------------------

    def handle_frame(
        self,
        frame: bytes,
        peer: Peer | None = None,
        refused: str | None = None,
        route: bytes | None = None,
    ) -> bytes | None:
        """Turn one request frame into one reply frame, never raising (None: kept until the
        tier's pulls land, then sent by `PullWaits.settle`). `peer`: the Unix connection it
        came on; `refused`: why its sender may ask nothing (NOT_AUTHORIZED); `route`: its ZMQ
        routing id. Its time goes into its operation's histogram, a failure into its errors."""
        msg_type, request_id = 0, 0
        host = self.host_of(peer, route)
        # A request of another protocol version (BAD_VERSION) is answered in that version: the
        # error body has the same form in every version, so its client can show why.
        version = protocol.PROTOCOL_VERSION
        served: int | None = None  # the message type, once it is known to be one we serve
        start = perf_counter()
        try:
            header = protocol.decode_header(frame)
            msg_type, request_id, version = header.msg_type, header.request_id, header.version
            self.requests.count_host(host, msg_type)
            if refused is not None:
                raise ProtocolError(ErrorCode.NOT_AUTHORIZED, refused)
            body = protocol.decode_body(frame, header)
            # Who is asking: the instance whose session credential the request carries, else
            # nobody (handlers that need an instance answer UNKNOWN_INSTANCE: handshake).
            session = body.get("session")
            sessions = self.registry.instances.sessions
            iid = body["iid"] = sessions.get(session) if type(session) is str else None
            body["via_local"] = peer is not None  # on this node for sure (the local index)
            if iid is not None:
                self._check_holder(iid, peer)
            # Any message is a sign of life; any but a heartbeat a sign of use (idle reaping)
            self.registry.instances.touch(iid, route, host, msg_type == MsgType.HEARTBEAT)
            handler = HANDLERS.get(msg_type)  # (`maru.server.handlers`)
            if handler is None:
                raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"unknown message type {msg_type}")
            if iid is None and session is not None and msg_type != MsgType.HANDSHAKE:
                # A client from before a restart (or reaped): served anonymously, its lookups
                # would take no lease and its heartbeats keep nothing alive. It handshakes.
                raise ProtocolError(ErrorCode.UNKNOWN_INSTANCE, "unknown session: handshake")
            served = msg_type
            if msg_type in CHANGES:
                journal = self.journal
                if journal is not None and journal.write_error is not None:
                    raise JournalWriteError(journal.state_dir, journal.write_error)
            reply = handler(self, body)
            if self._wants_spin(msg_type, body):
                self.spin_wanted = True
            elif self.spin_wanted is None:
                self.spin_wanted = False
            wait = reply.pop(WAIT, None)
            reply["ok"] = True
            if msg_type == MsgType.HANDSHAKE:  # its connection and host, too
                self.registry.instances.touch(reply["iid"], route, host)
            # Not on a RELEASE or CORRUPT_KV reply, which the client sends without waiting
            # and may never read.
            if msg_type != MsgType.RELEASE and msg_type != MsgType.CORRUPT_KV:
                self.registry.instances.hand_out(iid, reply)
            kept = wait is not None and self._keep(wait, reply, request_id, peer, route)
            out = None if kept else protocol.encode(msg_type, request_id, reply, reply=True)
            self.requests.served(msg_type, perf_counter() - start)
            return out
        except (ProtocolError, JournalWriteError) as exc:
            # JournalWriteError: refused, or failed before its change was made
            code = exc.code if isinstance(exc, ProtocolError) else ErrorCode.STATE_UNAVAILABLE
            self.requests.failed(served)
            log.debug("request error (%s): %s", code.name, exc)
            return protocol.encode_error(msg_type, request_id, code, str(exc), version=version)
        except Exception as exc:
            self.requests.failed(served)
            log.exception("internal error handling message type %s", msg_type)
            return protocol.encode_error(
                msg_type, request_id, ErrorCode.INTERNAL, f"internal server error: {exc}"
            )

    def _keep(
        self, wait: tuple, reply: dict[str, Any], request_id: int, peer: Peer | None, route: Any
    ) -> bool:
        """Keep an EXISTS reply until the pulls it waits for land (False: answer it now)."""
        keys, index, wait_s = wait
        local = self.local
        send: Callable[[bytes], Any]
        if peer is not None and local is not None:
            send = functools.partial(local.send_later, peer)
        elif route is not None:
            send = functools.partial(self.tcp.send_later, route)
        else:
            return False
        encode = functools.partial(protocol.encode, MsgType.EXISTS, request_id, reply=True)
        deadline = time.monotonic() + wait_s
        return self.waits.park(Waiting(reply, keys, index, deadline, encode, send))

    def host_of(self, peer: Peer | None, route: bytes | None) -> str:
        """Where a request came from, for the statistics per host: "local" over the Unix
        socket (this node), else the address of its TCP connection ("" if unknown)."""
        if peer is not None:
            return "local"
        return self.tcp.hosts.get(route, "") if route is not None else ""

    def _check_holder(self, iid: str, peer: Peer | None) -> None:
        """Only the process holding an instance's credential (`ProcessWatch.claim`, once per
        connection and instance) speaks for it; any other is refused (NOT_AUTHORIZED): on the
        local socket by its pid, over TCP (which cannot tell who asks) for any held instance."""
        processes = self.registry.instances.processes
        if peer is None:
            holder = processes.pids(iid)
            if not holder:
                return
            why = (
                f"it is held by process {process_name(holder[0])} on the local socket, not "
                "taken over TCP"
            )
        elif peer.instance == iid:
            return
        else:
            why = self.registry.instances.claim(iid, peer.sock)  # (at most so many a process)
            if why is None:
                peer.instance = iid  # once per connection and instance
                return
        raise ProtocolError(
            ErrorCode.NOT_AUTHORIZED,
            f"instance {iid}'s credential is one process's: {why} (a process forked after "
            "connecting makes a MaruHandler of its own)",
        )

    def serve_forever(self, poll_ms: int = 200) -> None:
        log.info(
            "maru-server listening on %s%s (pool %s, %d bytes)",
            self.endpoint,
            f" and {self.local.address}" if self.local is not None else "",
            self.registry.pool.name,
            self.registry.pool.capacity,
        )
        poller = zmq.Poller()
        self.tcp.attach(poller)
        if self.local is not None:
            self.local.attach(poller)
        if self.cluster is not None:
            self.cluster.attach(poller)  # the sidecar's replies wake the loop
        looked = time.monotonic()  # when the loop last looked at its sockets
        served = 0.0  # when the loop last served a request (perf_counter)
        while not self._stop.is_set():
            retry_ms = self.tcp.retry_ms  # replies wait for a ZMQ peer: send them soon
            wait_ms = poll_ms if retry_ms is None else min(poll_ms, retry_ms)
            due_ms = self.waits.next_ms(time.monotonic())  # a kept EXISTS's deadline
            wait_ms = wait_ms if due_ms is None else min(wait_ms, due_ms)
            events = self._wait_for_requests(poller, wait_ms, served)
            self.spin_wanted = None
            # Requests first, then housekeeping, so that the heartbeats queued during a stall
            # count before the reaper judges who is silent.
            self.registry.counters["replies_dropped"] += self.tcp.serve(events, self.handle_frame)
            if self.local is not None and events:
                self.local.serve(events, self.handle_frame)
            # Anything that woke the loop opens the window (a request, a failed one, the
            # sidecar's reply that answers a reader's kept EXISTS), unless all it served were
            # write-behind seals that their writers' next copies follow.
            if events and self.spin_wanted is not False:
                served = perf_counter()
            if self.cluster is not None:
                self.cluster.serve(events, poller)
                if not self._stop.is_set():  # (a sidecar that a stop's signal ended stays so)
                    self.cluster.housekeeping(poller, time.monotonic())
                self.waits.settle(self.cluster.pulling, self.registry.exists)
            now = time.monotonic()
            if self.local is not None:
                self.local.resume_accepting_if_due(now)
            self._forgive_stall(now - looked - poll_ms / 1000)
            looked = now
            self.housekeeping(now)
        log.info("maru-server stopping")

    def _wants_spin(self, msg_type: int, body: dict[str, Any]) -> bool:
        """Whether the loop should stay awake for what follows this request (its spin,
        `_wait_for_requests`). A seal its writer does not wait for (write-behind) is followed by
        the writer's next copy: it is worth a spin only when the writer's seals come less than
        half the window apart (small writes back to back); otherwise the spin takes a CPU from
        that copy (on a small host), to answer sooner a reply no one waits for."""
        if msg_type != MsgType.REGISTER_KV or body.get("behind") is not True:
            return True
        inst = self.registry.instances.get(body["iid"])
        if inst is None:
            return True
        now = perf_counter()
        close = now - inst.sealed_at < self.busy_poll_s / 2
        inst.sealed_at = now
        return close

    def _wait_for_requests(self, poller: zmq.Poller, poll_ms: int, served: float) -> dict:
        """The sockets that are ready. Within `busy_poll_s` of the last request, poll without
        sleeping: a request that finds the loop asleep waits for its wake-up (`--busy-poll-us`).
        Not while the cluster tier pulls: its sidecar's reply is what comes next, and the
        sidecar needs a CPU to get there (on a small host the spin would be taking it)."""
        pulling = self.cluster is not None and self.cluster.pulling
        until = 0.0 if pulling else served + self.busy_poll_s
        while perf_counter() < until:
            events = poller.poll(0)
            if events:
                return dict(events)
            os.sched_yield()  # a client that owes us a request may be waiting for this CPU
        return dict(poller.poll(poll_ms))

    def _forgive_stall(self, stalled: float) -> None:
        """Time the loop was away past a poll (SIGSTOP, a paused VM, a long snapshot) is not the
        clients' silence (their heartbeats are still queued): forgive it, or every live client
        would be reaped when the server resumes."""
        if stalled > 1.0:
            log.warning("server stalled for %.1f s; not counting it against clients", stalled)
            for inst in self.registry.instances.values():
                inst.last_seen += stalled

    def housekeeping(self, now: float | None = None) -> None:
        self.housekeeper.run(now)
        self.tcp.refresh()

    def _pool_lost(self, reason: str) -> None:
        self.pool_lost = reason
        self.stop()

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        if self.cluster is not None:
            self.cluster.close()
        self.tcp.close()
        if self.local is not None:
            self.local.close()
        self.registry.instances.processes.close()
        if self.journal is not None:
            self.journal.close()
