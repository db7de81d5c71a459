"""The one RPC client: DEALER sockets speaking `maru.protocol` to the server's ROUTER.

Each thread gets its own DEALER socket (ZMQ sockets are not thread-safe), so SGLang's backup,
prefetch and scheduler threads never serialise on a lock. On a socket, requests carry ids:
`submit` sends without waiting (at most `max_inflight` outstanding), `call` is submit + wait.
Every wait has a deadline: a dead server yields `MaruConnectionError`, never a hang. ZMQ
reconnects by itself after a server restart; replies that arrive after their caller gave up are
recognised by id and dropped.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from maru import protocol
from maru.errors import MaruConnectionError, MaruServerError

log = logging.getLogger(__name__)

ReplyHook = Callable[[dict[str, Any]], None]


class PendingReply:
    """A request in flight. `result()` must be called from the thread that submitted it."""

    __slots__ = ("_channel", "_msg_type", "body", "request_id")

    def __init__(self, channel: _Channel, request_id: int, msg_type: int):
        self._channel = channel
        self.request_id = request_id
        self._msg_type = msg_type
        self.body: dict[str, Any] | None = None

    def done(self) -> bool:
        return self.body is not None

    def result(self, timeout_ms: int | None = None) -> dict[str, Any]:
        if self.body is None:
            self._channel.wait_for(self, timeout_ms)
        body = self.body
        assert body is not None
        if not body.get("ok", False):
            raise MaruServerError(int(body.get("code", 0)), str(body.get("error", "server error")))
        return body


class _Channel:
    """One thread's socket and its outstanding requests."""

    def __init__(self, client: RpcClient):
        self.client = client
        sock = client.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # don't queue requests for a server that isn't there
        sock.setsockopt(zmq.SNDTIMEO, client.timeout_ms)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        sock.setsockopt(zmq.RCVTIMEO, client.timeout_ms)
        sock.connect(client.url)
        self.sock = sock
        self._rcvtimeo = client.timeout_ms  # the socket's current RCVTIMEO
        self.pending: dict[int, PendingReply] = {}

    def submit(self, msg_type: int, body: dict[str, Any]) -> PendingReply:
        while len(self.pending) >= self.client.max_inflight:
            oldest = next(iter(self.pending.values()))
            self.wait_for(oldest, None)
        request_id = next(self.client.request_ids)
        frame = protocol.encode(msg_type, request_id, body)
        try:
            self.sock.send(frame, copy=len(frame) < 65536)
        except zmq.Again:
            raise MaruConnectionError(
                f"maru-server at {self.client.url} is not reachable (send timed out after "
                f"{self.client.timeout_ms} ms)"
            ) from None
        pending = PendingReply(self, request_id, msg_type)
        self.pending[request_id] = pending
        return pending

    def wait_for(self, target: PendingReply, timeout_ms: int | None) -> None:
        # One blocking recv per reply, bounded by RCVTIMEO (a poll, then non-blocking recvs
        # until zmq.Again, cost three calls and an exception per reply).
        timeout = self.client.timeout_ms if timeout_ms is None else timeout_ms
        deadline = time.monotonic() + timeout / 1000.0
        sock = self.sock
        while target.body is None:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0:
                self.pending.pop(target.request_id, None)
                raise MaruConnectionError(
                    f"no reply from maru-server at {self.client.url} within {timeout} ms "
                    f"({protocol.MsgType(target._msg_type).name})"
                )
            if abs(self._rcvtimeo - remaining_ms) > 5 + remaining_ms // 20:
                sock.setsockopt(zmq.RCVTIMEO, remaining_ms)
                self._rcvtimeo = remaining_ms
            try:
                frame = sock.recv(copy=True)
            except zmq.Again:
                continue  # RCVTIMEO passed: the deadline check above decides
            self._accept(frame)

    def _accept(self, frame: bytes) -> None:
        try:
            header, body = protocol.decode(frame)
        except protocol.ProtocolError as exc:
            log.warning("dropping undecodable reply from %s: %s", self.client.url, exc)
            return
        # The hook runs even for a reply whose caller already timed out: it may carry
        # `freed` pages that the server hands out only once (lost, they would stay
        # allocated in the client for good).
        if body.get("ok") and self.client.reply_hook is not None:
            self.client.reply_hook(body)
        pending = self.pending.pop(header.request_id, None)
        if pending is not None:  # else: a reply whose caller already timed out
            pending.body = body

    def close(self) -> None:
        self.sock.close(linger=0)


class RpcClient:
    def __init__(
        self,
        url: str,
        *,
        timeout_ms: int = 2000,
        max_inflight: int = 64,
        reply_hook: ReplyHook | None = None,
    ):
        self.url = url
        self.timeout_ms = timeout_ms
        self.max_inflight = max_inflight
        self.reply_hook = reply_hook
        self.context = zmq.Context.instance()
        self.request_ids = itertools.count(1)
        self._local = threading.local()
        self._channels: list[_Channel] = []
        self._channels_lock = threading.Lock()
        self._closed = False

    def _channel(self) -> _Channel:
        channel = getattr(self._local, "channel", None)
        if channel is None:
            if self._closed:
                raise MaruConnectionError("RPC client is closed")
            channel = _Channel(self)
            self._local.channel = channel
            with self._channels_lock:
                self._channels.append(channel)
        return channel

    def submit(self, msg_type: int, body: dict[str, Any]) -> PendingReply:
        return self._channel().submit(msg_type, body)

    def call(
        self, msg_type: int, body: dict[str, Any], timeout_ms: int | None = None
    ) -> dict[str, Any]:
        """Send one request and wait for its reply; raises on timeout or error reply."""
        return self.submit(msg_type, body).result(timeout_ms)

    def close(self) -> None:
        self._closed = True
        with self._channels_lock:
            for channel in self._channels:
                channel.close()
            self._channels.clear()
        self._local = threading.local()
