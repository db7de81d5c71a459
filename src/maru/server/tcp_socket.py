"""The server's TCP port: a ZeroMQ ROUTER socket, with CURVE (`--curve`) and its client
allowlist (`--curve-clients`) where asked for; `MaruService` serves it and `local_socket` alike.

Replies are never dropped to a client that reads them: ZeroMQ refuses a send (EAGAIN) once
SNDHWM replies are in a peer's pipe, and counts what the peer took only lazily, so even a client
with one request in flight meets it now and then; such a reply waits in the peer's `Backlog`
and goes out, in order, on a later turn. A client that stops reading stalls only itself: past
`OUT_LIMIT` bytes waiting for it, its requests wait (at most RCVHWM of them, `OUT_LIMIT`
bytes), and past that are dropped, counted (`replies_dropped`) and logged.

A closed connection is noticed at once: the socket monitor reports it by file descriptor, and
each peer's first message names its descriptor (`zmq.SRCFD`), so `on_drop` gets its routing id.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from maru.common import protocol
from maru.common.curve import ClientAllowlist
from maru.common.protocol import ErrorCode
from maru.common.throttle import Throttle
from maru.server.local_socket import OUT_LIMIT

log = logging.getLogger(__name__)

SNDHWM = 16  # replies in ZeroMQ's pipe per peer; more wait in its Backlog
RCVHWM = 64  # requests queued per ZMQ peer (a client has at most max_inflight in flight)
BURST = 1024  # requests served per turn of the loop, so that housekeeping still runs
# A frame over MAX_FRAME_BYTES gets BAD_FRAME (`protocol.decode_body`) up to this size; ZeroMQ
# drops the connection of a longer one (it must buffer a frame whole to hand it over).
MAX_ZMQ_FRAME = 2 * protocol.MAX_FRAME_BYTES
GONE_KEPT = 4096  # closed connections' routing ids remembered (`TcpEndpoint.gone`)
RETRY_MS = (1, 100)  # while replies wait: the loop's first and longest wait before retrying


class Backlog:
    """What waits for one ZMQ peer: the replies ZeroMQ did not take yet, and, while those
    exceed OUT_LIMIT bytes, its requests (each with why it is refused, if it is)."""

    __slots__ = ("held", "held_bytes", "replies", "reply_bytes")

    def __init__(self) -> None:
        self.replies: deque[bytes] = deque()
        self.reply_bytes = 0
        self.held: deque[tuple[list[Any], str | None]] = deque()
        self.held_bytes = 0

    def add_reply(self, reply: bytes | None) -> None:
        if reply is None:  # kept (`PullWaits`): sent later by `send_later`
            return
        self.replies.append(reply)
        self.reply_bytes += len(reply)

    def hold(self, parts: list[Any], refused: str | None) -> bool:
        """Keep a request for when the replies have gone out; False (not kept) past RCVHWM
        requests or OUT_LIMIT bytes of them."""
        size = sum(len(part) for part in parts)
        if len(self.held) >= RCVHWM or self.held_bytes + size > OUT_LIMIT:
            return False
        self.held.append((parts, refused))
        self.held_bytes += size
        return True

    def take_held(self) -> tuple[list[Any], str | None]:
        parts, refused = self.held.popleft()
        self.held_bytes -= sum(len(part) for part in parts)
        return parts, refused

    def __len__(self) -> int:
        return len(self.replies) + len(self.held)


def _router(context: zmq.Context, bind_url: str, curve_secret_key: bytes | None) -> zmq.Socket:
    """The ROUTER socket of the TCP port, bound."""
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
    socket.setsockopt(zmq.MAXMSGSIZE, MAX_ZMQ_FRAME)
    # Bounded queues per peer; ROUTER_MANDATORY: a send past SNDHWM fails (EAGAIN) rather than
    # dropping the reply silently.
    socket.setsockopt(zmq.SNDHWM, SNDHWM)
    socket.setsockopt(zmq.RCVHWM, RCVHWM)
    socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
    if curve_secret_key is not None:
        socket.curve_server = True
        socket.curve_secretkey = curve_secret_key
    socket.bind(bind_url)
    return socket


class TcpEndpoint:
    """The bound TCP port (`endpoint`). `curve_secret_key` (Z85): only clients that know the
    server's public key complete the handshake; `curve_clients`: only those whose key is listed
    there, checked by a ZAP thread at connect and on every request (ZeroMQ keeps a connection
    open after its key is removed). `on_drop(routing_id)`: a peer's connection closed."""

    def __init__(
        self,
        context: zmq.Context,
        bind_url: str,
        curve_secret_key: bytes | None = None,
        curve_clients: Path | None = None,
        on_drop: Callable[[bytes], None] | None = None,
    ):
        self.authenticator: ThreadAuthenticator | None = None
        self.allowlist: ClientAllowlist | None = None
        if curve_clients is not None:
            if curve_secret_key is None:
                raise ValueError("curve_clients needs curve_secret_key")
            self.authenticator = ThreadAuthenticator(context, log=log)
            self.authenticator.start()
            self.allowlist = ClientAllowlist(curve_clients)
            self.authenticator.configure_curve_callback("*", credentials_provider=self.allowlist)
        try:
            self.socket = _router(context, bind_url, curve_secret_key)
        except zmq.ZMQError:
            if self.authenticator is not None:
                self.authenticator.stop()
            raise
        self.endpoint: str = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.on_drop = on_drop
        self.monitor = self.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.routes: dict[int, bytes] = {}  # file descriptor -> the routing id that spoke on it
        self.known: set[bytes] = set()  # the routing ids in `routes`
        # Routing ids whose connection closed, the latest GONE_KEPT: their late requests (still
        # queued in the ROUTER) name a descriptor a new connection may hold by now.
        self.gone: dict[bytes, None] = {}
        # by routing id: the address its connection came from (ZeroMQ's Peer-Address), the
        # host its instance runs on for `stats` (a pod: instances and requests per host)
        self.hosts: dict[bytes, str] = {}
        self.backlog: dict[bytes, Backlog] = {}  # by routing id: peers with replies waiting
        self._retry_ms = RETRY_MS[0]
        self._stuck = Throttle(10.0)

    @property
    def retry_ms(self) -> int | None:
        """How long the loop may sleep before `serve` retries the waiting replies (None: none
        wait). ZeroMQ signals room (POLLOUT) only for all peers at once, so the loop retries,
        sooner after progress, up to RETRY_MS[1] apart."""
        return self._retry_ms if self.backlog else None

    def attach(self, poller: zmq.Poller) -> None:
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)

    def serve(self, events: dict[Any, int], handle: Callable[..., bytes | None]) -> int:
        """Send the replies that wait, then answer up to BURST requests if `events` says the
        socket is ready, each by `handle(frame, refused=why or None, route=routing id)`.
        Returns how many requests went unanswered (the peer vanished, or does not read)."""
        if events.get(self.monitor):  # before the requests: a descriptor may be reused
            self._closed_connections()
        dropped = self._drain(handle) if self.backlog else 0
        if not events.get(self.socket):
            return dropped
        sock, allowlist, known = self.socket, self.allowlist, self.known
        for _ in range(BURST):
            try:
                first = sock.recv(zmq.NOBLOCK, copy=False)  # the routing id
                # With --curve-clients, each request's frame says which key it came with.
                parts = [first, *sock.recv_multipart(zmq.NOBLOCK, copy=allowlist is None)]
            except zmq.Again:
                break
            refused = None
            if allowlist is not None:
                refused = allowlist.revoked(parts[-1].get("User-Id"))
                parts = [part.bytes for part in parts]
            else:
                parts[0] = first.bytes
            if parts[0] not in known and not self._learn(first, parts[0]):
                # served (a RELEASE sent just before a close still ends its lease), but not as
                # a connection: its reply goes nowhere, its instance is not shown on it
                dropped += self._send(parts[0], self._answer(parts, refused, handle, late=True))
                continue
            waiting = self.backlog.get(parts[0]) if self.backlog else None
            if waiting is None:
                dropped += self._send(parts[0], self._answer(parts, refused, handle))
            elif waiting.reply_bytes > OUT_LIMIT:  # it does not read: its requests wait
                if not waiting.hold(parts, refused):
                    dropped += 1
                    self._log_stuck(waiting)
            else:  # behind the replies that wait, in order
                waiting.add_reply(self._answer(parts, refused, handle))
        return dropped

    @staticmethod
    def _answer(
        parts: list[Any],
        refused: str | None,
        handle: Callable[..., bytes | None],
        late: bool = False,
    ) -> bytes | None:
        if len(parts) != 2:
            # A DEALER sends exactly one frame; anything else is not ours to parse.
            return protocol.encode_error(
                0, 0, ErrorCode.BAD_FRAME, f"expected 1 frame, got {len(parts) - 1}"
            )
        return handle(parts[1], refused=refused, route=None if late else parts[0])

    def _learn(self, frame: zmq.Frame, route: bytes) -> bool:
        """Note which connection (file descriptor) a new routing id speaks on. The monitor
        first: the closed connection whose descriptor this one reuses was reported before
        it closed (ZeroMQ reports, then closes). False: a late request of a closed connection
        (still queued in the ROUTER) whose descriptor a new connection holds now; taken for
        a silent close, it made that live peer's waiting replies be forgotten."""
        self._closed_connections()
        try:
            fd = frame.get(zmq.SRCFD)
        except zmq.ZMQError as exc:  # not told: its drop is found by its silence
            log.debug("no descriptor for a ZMQ peer: %s", exc)
            fd = None
        holder = self.routes.get(fd) if fd is not None else None
        if route in self.gone:
            if holder is not None:
                return False
            del self.gone[route]  # (a peer that names its routing id, connected again)
        with contextlib.suppress(zmq.ZMQError):  # (not told: the host shows as unknown)
            self.hosts[route] = frame.get("Peer-Address")
        if fd is None:
            return True
        if holder is not None:  # closed without a word: gone too
            self._dropped(fd)
        self.routes[fd] = route
        self.known.add(route)
        return True

    def _closed_connections(self) -> None:
        """The connections the monitor says were closed: their peers are gone."""
        while True:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self._dropped(event["value"])

    def _dropped(self, fd: int) -> None:
        """The connection on `fd` closed: tell `on_drop` whose it was, and forget the replies
        still waiting for it."""
        route = self.routes.pop(fd, None)
        if route is None:
            return
        self.known.discard(route)
        self.gone[route] = None
        if len(self.gone) > GONE_KEPT:
            del self.gone[next(iter(self.gone))]
        self.hosts.pop(route, None)
        self.backlog.pop(route, None)
        if self.on_drop is not None:
            self.on_drop(route)

    def send_later(self, identity: bytes, reply: bytes) -> int:
        """A reply kept past its request's turn (`PullWaits`): behind the peer's waiting
        replies, if any (the client matches replies by request id). 1 if dropped."""
        waiting = self.backlog.get(identity)
        if waiting is not None:
            waiting.add_reply(reply)
            return 0
        return self._send(identity, reply)

    def _send(self, identity: bytes, reply: bytes | None) -> int:
        """Send now, or keep the reply in a new Backlog if ZeroMQ will not take it yet.
        Returns 1 if it was dropped: the peer has gone. None: kept, nothing to send."""
        if reply is None:
            return 0
        try:
            self.socket.send_multipart([identity, reply], zmq.NOBLOCK)
        except zmq.Again:
            waiting = self.backlog[identity] = Backlog()
            waiting.add_reply(reply)
            self._retry_ms = RETRY_MS[0]
        except zmq.ZMQError as exc:
            log.debug("reply dropped: %s", exc)
            return 1
        return 0

    def _drain(self, handle: Callable[..., bytes | None]) -> int:
        """Send what waits, answer the requests held while there is room again; returns how
        many were dropped (their peer has gone). Then choose the next retry's delay."""
        dropped, sent = 0, False
        for key, waiting in list(self.backlog.items()):
            while True:
                gone, moved = self._flush(key, waiting)
                sent = sent or moved
                if gone:
                    dropped += len(waiting)
                    del self.backlog[key]
                    break
                if not waiting.held or waiting.reply_bytes > OUT_LIMIT:
                    break
                while waiting.held and waiting.reply_bytes <= OUT_LIMIT:
                    waiting.add_reply(self._answer(*waiting.take_held(), handle))
            if not waiting:
                self.backlog.pop(key, None)
        self._retry_ms = RETRY_MS[0] if sent else min(2 * self._retry_ms, RETRY_MS[1])
        return dropped

    def _flush(self, key: bytes, waiting: Backlog) -> tuple[bool, bool]:
        """Send the peer's waiting replies, oldest first, while ZeroMQ takes them. Returns
        (whether the peer has gone, whether anything was sent)."""
        sent = False
        replies = waiting.replies
        while replies:
            try:
                self.socket.send_multipart([key, replies[0]], zmq.NOBLOCK)
            except zmq.Again:
                break
            except zmq.ZMQError as exc:
                log.debug("%d replies dropped: %s", len(replies), exc)
                return True, sent
            waiting.reply_bytes -= len(replies.popleft())
            sent = True
        return False, sent

    def _log_stuck(self, waiting: Backlog) -> None:
        held = self._stuck.allow("stuck")
        if held is not None:
            log.warning(
                "a ZMQ client does not read its replies (%.1f MiB wait for it, and %d of its "
                "requests): its later requests are dropped unanswered until it does "
                "(maru_replies_dropped_total)%s",
                waiting.reply_bytes / (1 << 20),
                len(waiting.held),
                self._stuck.note(held),
            )

    def refresh(self) -> None:
        """Between requests: a key removed from `--curve-clients` counts for open
        connections within a second."""
        if self.allowlist is not None:
            self.allowlist.refresh(every=1.0)

    def close(self) -> None:
        self.socket.disable_monitor()
        self.monitor.close(linger=0)
        self.socket.close(linger=0)
        if self.authenticator is not None:
            self.authenticator.stop()
