"""The server's TCP port: a ZeroMQ ROUTER socket, with CURVE (`--curve`) and its client
allowlist (`--curve-clients`) where asked for. The counterpart of `local_socket` for clients
on other hosts (and for every client's first handshake); `MaruService` serves both alike."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator

from maru.common import protocol
from maru.common.curve import ClientAllowlist
from maru.common.protocol import ErrorCode

log = logging.getLogger(__name__)

SNDHWM = 16  # replies queued per ZMQ peer (each at most a few MiB) before more are dropped
RCVHWM = 64  # requests queued per ZMQ peer (a client has at most max_inflight in flight)
BURST = 1024  # requests served per turn of the loop, so that housekeeping still runs


def _router(context: zmq.Context, bind_url: str, curve_secret_key: bytes | None) -> zmq.Socket:
    """The ROUTER socket of the TCP port, bound."""
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
    # A frame over the limit makes ZMQ drop the peer's connection before buffering it.
    socket.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_FRAME_BYTES + protocol.HEADER.size)
    # Bounded queues per peer, so that a client that stops reading its replies stalls only
    # itself: past SNDHWM unsent replies to one peer the next is dropped (and counted:
    # ROUTER_MANDATORY makes the send fail instead of dropping silently); past RCVHWM
    # requests ZMQ stops reading that peer's connection. A live client's own I/O thread
    # drains its replies as they come, so it never meets the limit.
    socket.setsockopt(zmq.SNDHWM, SNDHWM)
    socket.setsockopt(zmq.RCVHWM, RCVHWM)
    socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
    if curve_secret_key is not None:
        socket.curve_server = True
        socket.curve_secretkey = curve_secret_key
    socket.bind(bind_url)
    return socket


class TcpEndpoint:
    """The bound TCP port (`endpoint`: where it listens). `curve_secret_key`: CURVE under
    this key (Z85): only clients that know the server's public key complete the handshake.
    `curve_clients`: and only clients whose own public key is listed there: checked by a ZAP
    thread at connect, and on every request (ZeroMQ keeps a connection open after its key
    was removed from the list)."""

    def __init__(
        self,
        context: zmq.Context,
        bind_url: str,
        curve_secret_key: bytes | None = None,
        curve_clients: Path | None = None,
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

    def attach(self, poller: zmq.Poller) -> None:
        poller.register(self.socket, zmq.POLLIN)

    def serve(self, events: dict[Any, int], handle: Callable[..., bytes]) -> int:
        """Answer up to BURST requests if `events` (one poll's result) says the socket is
        ready: `handle(frame, refused=why or None)` makes each reply. Returns how many
        replies were dropped (the peer vanished, or does not read: SNDHWM)."""
        if not events.get(self.socket):
            return 0
        sock, allowlist, dropped = self.socket, self.allowlist, 0
        for _ in range(BURST):
            try:
                # With --curve-clients, each request's frame says which key it came with.
                parts = sock.recv_multipart(zmq.NOBLOCK, copy=allowlist is None)
            except zmq.Again:
                break
            refused = None
            if allowlist is not None:
                refused = allowlist.revoked(parts[-1].get("User-Id"))
                parts = [part.bytes for part in parts]
            if len(parts) != 2:
                # A DEALER sends exactly one frame; anything else is not ours to parse.
                reply = protocol.encode_error(
                    0, 0, ErrorCode.BAD_FRAME, f"expected 1 frame, got {len(parts) - 1}"
                )
            else:
                reply = handle(parts[1], refused=refused)
            try:
                sock.send_multipart([parts[0], reply], zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                dropped += 1
                log.debug("reply dropped: %s", exc)
        return dropped

    def refresh(self) -> None:
        """Between requests: a key removed from `--curve-clients` counts for open
        connections within a second."""
        if self.allowlist is not None:
            self.allowlist.refresh(every=1.0)

    def close(self) -> None:
        self.socket.close(linger=0)
        if self.authenticator is not None:
            self.authenticator.stop()
