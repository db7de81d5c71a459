"""The channel between maru-server and its cluster sidecar: msgpack messages in the stream
frames of the clients' Unix socket (`protocol.STREAM_LENGTH`, `StreamReader`), on a Unix
socketpair the server makes and the sidecar inherits. A pull crosses it twice while its
reader waits: a plain socket wakes the other side directly, where ZeroMQ passes each message
through an I/O thread on both sides (docs/performance.md#cluster-tier-two-nodes-mooncake).

The server's end never blocks its loop: what the socket does not take waits in an outbox
(`flush`, when the loop sees the socket writable); the sidecar's end blocks. Either side reads
the peer's exit as the end of the stream (`closed`).
"""

from __future__ import annotations

import logging
import socket
from typing import Any

import msgpack
import zmq

from maru.common.protocol import STREAM_LENGTH, ProtocolError, StreamReader

log = logging.getLogger("maru.server.cluster")

POLLIN, POLLOUT = int(zmq.POLLIN), int(zmq.POLLOUT)
OUTBOX_LIMIT = 16 << 20  # bytes waiting for the socket past which `send` refuses a message
READ_BYTES = 1 << 20  # read at once


class Link:
    """One end of the channel."""

    def __init__(self, sock: socket.socket, *, blocking: bool):
        sock.setblocking(blocking)
        self.sock = sock
        self.fd = sock.fileno()
        self.watched = 0  # the poll flags the server's loop watches this end with
        self.blocking = blocking
        self.reader = StreamReader()
        self.outbox = bytearray()
        self.closed = False  # the peer is gone, or the stream cannot be read any more

    @classmethod
    def pair(cls) -> tuple[Link, socket.socket]:
        """The server's end, and the socket the sidecar inherits (its descriptor)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        return cls(ours, blocking=False), theirs

    def fileno(self) -> int:
        return self.fd

    def watch(self, poller: zmq.Poller) -> None:
        """Have the server loop's `poller` watch this end as it needs now: readable, and
        writable while something waits in the outbox; not at all once closed (its end would
        wake the loop on every turn)."""
        want = 0 if self.closed else POLLIN | (POLLOUT if self.outbox else 0)
        if want != self.watched:
            if self.watched:
                poller.unregister(self.fd)
            if want:
                poller.register(self.fd, want)
            self.watched = want

    def ready(self, events: dict) -> bool:
        """Whether the loop's poll found this end ready."""
        return bool(self.watched and events.get(self.fd))

    def send(self, message: dict[str, Any]) -> bool:
        """Send (the server's end: queue what the socket does not take now); False when
        the peer is gone or, not blocking, OUTBOX_LIMIT bytes wait already."""
        if self.closed or len(self.outbox) > OUTBOX_LIMIT:
            return False
        frame = msgpack.packb(message, use_bin_type=True)
        data = STREAM_LENGTH.pack(len(frame)) + frame
        if self.blocking:
            try:
                self.sock.sendall(data)
            except OSError:
                self.closed = True
            return not self.closed
        self.outbox += data
        self.flush()
        return not self.closed

    def flush(self) -> None:
        """Send what waits in the outbox, as far as the socket takes it now."""
        while self.outbox and not self.closed:
            try:
                sent = self.sock.send(self.outbox)
            except BlockingIOError:
                return
            except OSError:
                self.closed = True
                self.outbox.clear()
                return
            del self.outbox[:sent]

    def receive(self) -> list[dict[str, Any]]:
        """The messages that arrived whole (the server's end: all it can read without
        blocking; the sidecar's: one read, made when the socket is readable). A frame that
        is not a msgpack map is logged and skipped; a stream that cannot be cut into frames
        any more, or its end, sets `closed`."""
        while not self.closed:
            try:
                data = self.sock.recv(READ_BYTES)
            except BlockingIOError:
                break
            except OSError:
                data = b""
            if not data:
                self.closed = True
                break
            self.reader.feed(data)
            if self.blocking:
                break
        try:
            frames = self.reader.frames()
        except ProtocolError as exc:
            log.error("cluster tier: the sidecar channel broke: %s", exc)
            self.closed = True
            return []
        messages = []
        for frame in frames:
            try:
                message = msgpack.unpackb(frame, raw=False)
            except (ValueError, msgpack.UnpackException) as exc:
                log.error("cluster tier: a bad message on the sidecar channel (%s): ignored", exc)
                continue
            if isinstance(message, dict):
                messages.append(message)
            else:
                log.error("cluster tier: a message that is not a map: ignored")
        return messages

    def close(self) -> None:
        self.closed = True
        self.sock.close()
