"""The one RPC client: `maru.common.protocol` frames to the server, replies matched by id.

ZMQ (a DEALER to the server's ROUTER at `server_url`) always works and bootstraps the
connection; once the HANDSHAKE reply names the server's Unix socket, requests go there (a much
cheaper round trip). Each thread has its own channel (ZMQ sockets are not thread-safe), so
threads never serialise on a lock; a thread's end closes it (`_ThreadChannels`).
`PendingReply.result()` is the one place a reply is judged: the deadline (a dead server raises
`MaruConnectionError`, never hangs), an error reply, another protocol version, a server that
forgot the caller (a re-handshake, then the request once more).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import re
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import msgpack
import zmq
from zmq.utils.monitor import recv_monitor_message

from maru.client._busypoll import recv_spin
from maru.common import protocol
from maru.common.errors import (
    MaruConnectionError,
    MaruConnectRefused,
    MaruError,
    MaruForkedError,
    MaruServerError,
)
from maru.common.peer import peer_credentials
from maru.common.protocol import ErrorCode, unix_address

log = logging.getLogger(__name__)

LOCAL_RETRY_S = 5.0  # after the server closed a new local connection unanswered: ZMQ meanwhile

_header, _MAGIC, _VERSION = protocol.HEADER.pack, protocol.MAGIC, protocol.PROTOCOL_VERSION

# Forks since this module was imported: an `RpcClient` made before a fork is its parent's (its
# credential, its connections) and refuses to send. A list: the data path compares it inline.
FORKS = [0]
os.register_at_fork(after_in_child=lambda: FORKS.__setitem__(0, FORKS[0] + 1))


class PendingReply:
    """A request in flight. `result()` must be called from the thread that sent it."""

    __slots__ = ("_channel", "_msg_type", "_request", "body", "request_id", "retry")

    def __init__(self, channel: _Channel, request_id: int, msg_type: int, request: dict[str, Any]):
        self._channel = channel
        self.request_id = request_id
        self._msg_type = msg_type
        self._request = request
        self.retry = True  # re-send once after a re-handshake
        self.body: dict[str, Any] | None = None

    def done(self) -> bool:
        return self.body is not None

    def wait(self, timeout_ms: int | None = None) -> None:
        """Until the reply is in (its hook applied), whatever it says: `result()` reads it.
        Raises `MaruConnectionError` if none comes in time."""
        if self.body is None:
            self._channel.wait_for(self, timeout_ms)

    def arrived(self) -> bool:
        """Whether `result()` would return at once, sending nothing (takes what has arrived).
        False for a reply that makes `result()` handshake again (which may unmap regions a
        write is copying into) and for a request whose connection was lost."""
        if self.body is None and self.request_id in self._channel.pending:
            self._channel.collect()
        body = self.body
        if body is None:
            return False
        return bool(body.get("ok", False)) or int(body.get("code", 0)) != ErrorCode.UNKNOWN_INSTANCE

    def result(self, timeout_ms: int | None = None) -> dict[str, Any]:
        """The reply's body; raises `MaruConnectionError` (no reply in time) or
        `MaruServerError` (an error reply)."""
        if self.body is None:
            try:
                self._channel.wait_for(self, timeout_ms)
            except MaruConnectionError:
                if self.request_id not in self._channel.refused:
                    raise
                # The server closed a new local connection without reading it (out of file
                # descriptors): the request was not served; send it over ZMQ instead.
                again = self._channel.client._zmq_channel().request(self._msg_type, self._request)
                again.retry = self.retry
                return again.result(timeout_ms)
        body = self.body
        assert body is not None
        if body.get("ok", False):
            return body
        code = int(body.get("code", 0))
        client = self._channel.client
        if code == ErrorCode.UNKNOWN_INSTANCE and self.retry and client.on_unknown_instance:
            log.info("maru-server does not know us (restarted?); handshaking again")
            # may raise: then the request failed; else the request as the instance now is
            request = client.on_unknown_instance(self._msg_type, self._request)
            again = client.request(self._msg_type, request)
            again.retry = False
            return again.result(timeout_ms)
        if (
            code == ErrorCode.NOT_AUTHORIZED
            and self.retry
            and isinstance(self._channel, _ZmqChannel)
            and client.local_address is not None
        ):
            # Refused over TCP because another of our threads holds the credential on the
            # local socket, named again by a handshake since this thread left it (a server
            # restart): refused before any effect, so sent once more, from here over it.
            log.info("maru-server wants our credential on its local socket; sending it there")
            again = client.request(self._msg_type, self._request)
            again.retry = False
            return again.result(timeout_ms)
        raise MaruServerError(code, str(body.get("error", "server error")))


class _Channel:
    """One thread's connection and its outstanding requests; subclasses move the frames
    (`_send`, `_receive`, `close`)."""

    def __init__(self, client: RpcClient, where: str):
        self.client = client
        self.where = where  # for error messages
        self.pending: dict[int, PendingReply] = {}
        self.refused: set[int] = set()  # requests on a connection the server refused

    def _receive(self, timeout_ms: int, spin: bool = True) -> list[bytes]:
        """The frames that arrive within `timeout_ms` (maybe none); `spin`: may busy-poll first."""
        raise NotImplementedError

    def collect(self) -> None:
        """Accept the replies that have arrived, neither waiting nor spinning for more."""
        self.client.check_fork()  # a forked child would take its parent's replies
        for frame in self._receive(0, spin=False):
            self._accept(frame)

    def request(self, msg_type: int, body: dict[str, Any]) -> PendingReply:
        while len(self.pending) >= self.client.max_inflight:
            oldest = next(iter(self.pending.values()))
            self.wait_for(oldest, None)
        request_id = next(self.client.request_ids)
        # (`protocol.encode`'s request form, inline: every request sends one)
        self._send(
            _header(_MAGIC, _VERSION, msg_type, 0, request_id)
            + msgpack.packb(body, use_bin_type=True)
        )
        pending = PendingReply(self, request_id, msg_type, body)
        self.pending[request_id] = pending
        return pending

    def wait_for(self, target: PendingReply, timeout_ms: int | None) -> None:
        self.client.check_fork()  # a forked child would take its parent's replies
        timeout = self.client.timeout_ms if timeout_ms is None else timeout_ms
        deadline = time.monotonic() + timeout / 1000.0
        while target.body is None:
            if target.request_id not in self.pending:  # the connection was lost under it
                raise MaruConnectionError(
                    f"connection to maru-server at {self.where} lost before the reply "
                    f"({protocol.MsgType(target._msg_type).name})"
                )
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0:
                self.pending.pop(target.request_id, None)
                self.raise_if_handshake_failed()
                raise MaruConnectionError(
                    f"no reply from maru-server at {self.where} within {timeout} ms "
                    f"({protocol.MsgType(target._msg_type).name})"
                )
            for frame in self._receive(remaining_ms):
                self._accept(frame)

    def _accept(self, frame: bytes) -> None:
        try:
            header, body = protocol.decode(frame)
        except protocol.ProtocolError as exc:
            if exc.code != ErrorCode.BAD_VERSION:
                log.warning("dropping undecodable reply from %s: %s", self.where, exc)
                return
            # A server of another protocol version: its reply fails the request, naming both.
            header = protocol.decode_header(frame)
            body = {"ok": False, "code": int(exc.code), "error": str(exc)}
        self.client.last_reply = time.monotonic()  # (`RpcClient.answers`)
        # The hook runs even for a reply whose caller already timed out: `freed` chunks are
        # handed out only once (lost, they would stay allocated for good).
        if body.get("ok") and self.client.reply_hook is not None:
            self.client.reply_hook(body)
        pending = self.pending.pop(header.request_id, None)
        if pending is not None:  # else: a reply whose caller already timed out
            pending.body = body

    def raise_if_handshake_failed(self) -> None:
        """Called when the server did not answer: if the transport knows why, say it."""


# ZMTP security handshake outcomes, watched on every ZMQ channel (a monitor socket): a client
# without the key of a `--curve` server, or with another key, would otherwise only time out.
_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
# Each monitor's inproc endpoint, unique in the process: pyzmq's default names it after the
# socket's descriptor, which a socket closed a moment ago (libzmq reaps it later) may still
# hold bound, and a new channel then failed with "Address already in use".
_MONITORS = itertools.count()


_REFUSALS = (ErrorCode.NOT_AUTHORIZED, ErrorCode.LOCAL_SOCKET_FULL)
_LOOPBACK = re.compile(r"^tcp://(127\.\d+\.\d+\.\d+|localhost|\[?::1\]?):\d+$")


class _ZmqChannel(_Channel):
    def __init__(self, client: RpcClient):
        super().__init__(client, client.url)
        sock = client.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # don't queue requests for a server that isn't there
        sock.setsockopt(zmq.SNDTIMEO, client.timeout_ms)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        sock.setsockopt(zmq.RCVTIMEO, client.timeout_ms)
        self.curve_public_key = ""  # ours, with CURVE
        if client.server_public_key is not None:
            if client.client_secret_key is not None:  # ours, listed by the server
                secret = client.client_secret_key.encode()
                public = zmq.curve_public(secret)
            else:  # a throwaway one, for this connection only
                public, secret = zmq.curve_keypair()
            sock.curve_serverkey = client.server_public_key.encode()
            self.curve_public_key = public.decode()
            sock.curve_publickey = public
            sock.curve_secretkey = secret
        self.monitor = sock.get_monitor_socket(
            _HANDSHAKE_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED,
            addr=f"inproc://maru-monitor-{os.getpid()}-{next(_MONITORS)}",
        )
        self.handshake_event: int | None = None  # the last security handshake's outcome
        sock.connect(client.url)
        self.sock = sock
        self._rcvtimeo = client.timeout_ms  # the socket's current RCVTIMEO

    def _send(self, frame: bytes) -> None:
        try:
            self.sock.send(frame, copy=len(frame) < 65536)
        except zmq.Again:
            self.raise_if_handshake_failed()
            raise MaruConnectionError(
                f"maru-server at {self.where} is not reachable (send timed out after "
                f"{self.client.timeout_ms} ms)"
            ) from None

    def _receive(self, timeout_ms: int, spin: bool = True) -> list[bytes]:
        # One blocking recv bounded by RCVTIMEO: cheaper than a poll and non-blocking recvs.
        if abs(self._rcvtimeo - timeout_ms) > 5 + timeout_ms // 20:
            self.sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
            self._rcvtimeo = timeout_ms
        try:
            return [self.sock.recv(copy=True)]
        except zmq.Again:
            return []

    def raise_if_handshake_failed(self) -> None:
        while self.monitor.poll(0):
            self.handshake_event = recv_monitor_message(self.monitor)["event"]
        if self.handshake_event in (None, zmq.EVENT_HANDSHAKE_SUCCEEDED):
            return
        if self.handshake_event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:  # (--curve-clients' check)
            why = (
                f"the server does not list this client's CURVE key {self.curve_public_key} "
                "(maru-server --curve-clients): add the client's public key (NAME.pub of `maru "
                "curve-keypair NAME`) there, and give the client its secret key as "
                "curve_client_key (maru_curve_client_key, maru --curve-client-key)"
            )
        elif self.client.server_public_key is None:
            why = (
                "the server requires CURVE (maru-server --curve): set server_public_key "
                "(maru_server_public_key, maru --server-public-key) to its public key, "
                "<state-dir>/curve.pub"
            )
        else:
            why = (
                "server_public_key is not this server's CURVE key (<state-dir>/curve.pub), or "
                "the server does not use --curve"
            )
        raise MaruConnectRefused(self.where, f"the security handshake failed: {why}")

    def close(self, linger_ms: int = 0) -> None:
        """`linger_ms`: how long ZeroMQ may still try to deliver what was sent (it does so in
        the background; this returns at once)."""
        if self.sock.closed:
            return
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=linger_ms)


class _LocalChannel(_Channel):
    """The server's Unix socket: length-prefixed frames on a byte stream. A broken connection
    fails the requests in flight at once; the next request reconnects, or goes over ZMQ. A wait
    spins up to `busy_poll_us` before it sleeps in poll() (a wake-up costs a round trip)."""

    def __init__(self, client: RpcClient, address: str):
        super().__init__(client, address)
        self.address = address
        self.sock: socket.socket | None = None
        self.answered = False  # whether the server has replied on this connection
        self.refused_until = 0.0  # time.monotonic(): use ZMQ until then
        self.poller = select.poll()
        self.reader = protocol.StreamReader()

    def connected(self) -> bool:
        """True if connected, after one connection attempt if not (immediate on a Unix socket)."""
        if self.sock is not None:
            return True
        if self.refused_until and time.monotonic() < self.refused_until:
            return False
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.client.timeout_ms / 1000)
            sock.connect(unix_address(self.address))
        except OSError as exc:
            sock.close()
            self.client.local_unreachable(self.address, exc)
            return False
        uid = peer_credentials(sock)[1]
        if uid != self.client.server_uid:  # not the server's: maybe an impostor (P5)
            sock.close()
            self.client.local_refused(self.address, uid)
            return False
        sock.setblocking(False)
        self.sock = sock
        self.answered = False
        self.poller = select.poll()
        self.poller.register(sock, select.POLLIN)
        self.reader = protocol.StreamReader()
        return True

    def _lost(self, why: str, refused: bool = False) -> None:
        """The connection is gone: its requests in flight fail (`MaruConnectionError`: the
        server may have served them), unless it refused the connection with its one frame
        (`refused`, or that frame still waits in the socket): then it read none, and they go
        over ZMQ. A close before any reply is no refusal: a server killed after serving a
        REGISTER_KV closes so too, and resending it would make the writer free its sealed pages."""
        log.info("local socket %s to maru-server closed (%s)", self.address, why)
        if not refused and self.sock is not None and not self.answered:
            refused = self._take_refusal(self.sock)
        if refused:
            self.refused_until = time.monotonic() + LOCAL_RETRY_S
            self.refused = set(self.pending)
        if self.sock is not None:
            self.sock.close()
        self.sock = None
        self.pending.clear()  # their waiters raise MaruConnectionError

    def _send(self, frame: bytes) -> None:
        # A connection the server closed (it restarted) fails on send, before delivering
        # anything: reconnect once and resend. If that fails too, the caller uses ZMQ.
        data = protocol.STREAM_LENGTH.pack(len(frame)) + frame  # (`stream_prefix`)
        for _attempt in range(2):
            if not self.connected():
                break
            assert self.sock is not None
            try:
                self._send_all(self.sock, data)
                return
            except TimeoutError:  # a partial frame would desynchronise the stream: drop it
                self._lost("send timed out")
                raise MaruConnectionError(
                    f"maru-server at {self.where} did not take a request within "
                    f"{self.client.timeout_ms} ms"
                ) from None
            except OSError as exc:
                self._lost(f"send failed: {exc}")
        raise LocalSocketUnavailable(self.address)

    def _send_all(self, sock: socket.socket, data: bytes) -> None:
        """All of `data`, waiting (up to the timeout) while the socket buffer is full."""
        try:
            sent = sock.send(data)  # a request usually fits the socket buffer: one call
        except BlockingIOError:
            sent = 0
        if sent == len(data):
            return
        view = memoryview(data)[sent:]
        deadline = time.monotonic() + self.client.timeout_ms / 1000
        writable = select.poll()
        writable.register(sock, select.POLLOUT)
        while view:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0:
                raise TimeoutError
            writable.poll(remaining_ms)
            with contextlib.suppress(BlockingIOError):
                view = view[sock.send(view) :]

    def _receive(self, timeout_ms: int, spin: bool = True) -> list[bytes]:
        sock = self.sock
        if sock is None:
            self.pending.clear()
            return []
        try:
            data = self._read(sock, timeout_ms, spin)
        except OSError as exc:
            self._lost(f"receive failed: {exc}")
            return []
        if data is None:
            return []
        if not data:
            self._lost("closed by the server")
            return []
        self.reader.feed(data)
        try:
            frames = self.reader.frames()
        except protocol.ProtocolError as exc:
            self._lost(str(exc))
            return []
        why = None if self.answered or not frames else self._refusal(frames[0])
        if why is not None:
            self._lost(f"refused by the server: {why}", refused=True)
            return []
        self.answered = True
        return frames

    def _take_refusal(self, sock: socket.socket) -> bool:
        """Whether the server's refusal frame (`_refusal`) still waits in the socket: a request
        sent before the server closed a refused connection fails without it."""
        with contextlib.suppress(OSError, protocol.ProtocolError):
            self.reader.feed(sock.recv(protocol.STREAM_RECV_BYTES, socket.MSG_DONTWAIT))
            frames = self.reader.frames()
            return bool(frames) and self._refusal(frames[0]) is not None
        return False

    def _refusal(self, frame: bytes) -> str | None:
        """Why, if `frame` is the server's refusal of this connection (an error for request id 0,
        which no request has): NOT_AUTHORIZED (`LocalDoor`) or LOCAL_SOCKET_FULL (out of fds)."""
        try:
            header, body = protocol.decode(frame)
        except protocol.ProtocolError:
            return None
        code = body.get("code")
        if header.request_id != 0 or code not in _REFUSALS:
            return None
        why = str(body.get("error", "refused"))
        if code == ErrorCode.NOT_AUTHORIZED:
            self.client.local_denied(self.address, why)
        return why

    def _read(self, sock: socket.socket, timeout_ms: int, spin: bool) -> bytes | None:
        """What the socket has (b"" if the server closed it): spinning up to `busy_poll_us`
        (`spin`), then sleeping in poll() up to `timeout_ms`; None if nothing came."""
        spin_ns = self.client.busy_poll_ns if spin else 0
        if spin_ns:
            data = recv_spin(sock.fileno(), protocol.STREAM_RECV_BYTES, spin_ns)
            if data is not None:
                return data
        if not self.poller.poll(timeout_ms):
            return None
        try:
            return sock.recv(protocol.STREAM_RECV_BYTES)
        except BlockingIOError:  # woken without data
            return None

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


class _ThreadChannels:
    """One thread's channels, in the client's thread-local storage. The thread's end drops
    that storage and with it this holder, which then closes them: a short-lived thread (a
    `maru-ready` thread, a caller's per-request worker) leaves no connection open behind it,
    on either end, until the client closes. In a child forked from the process, whose other
    threads' storage goes at the fork, only its copies of the Unix sockets are closed (the
    ZMQ sockets belong to the parent's context)."""

    __slots__ = ("local", "zmq")

    def __init__(self) -> None:
        self.local: _LocalChannel | None = None
        self.zmq: _ZmqChannel | None = None

    def __del__(self) -> None:
        try:
            for channel in (self.local, self.zmq):
                if channel is not None:
                    channel.client.forget(channel)
        except Exception:  # (a destructor must not raise: at exit, modules may be half gone)
            pass


class LocalSocketUnavailable(Exception):
    """The Unix socket cannot take a request now; `RpcClient` sends it over ZMQ instead."""


class RpcClient:
    def __init__(
        self,
        url: str,
        *,
        timeout_ms: int = 2000,
        max_inflight: int = 64,
        reply_hook: Callable[[dict[str, Any]], None] | None = None,
        on_unknown_instance: Callable[[int, dict[str, Any]], dict[str, Any]] | None = None,
        busy_poll_us: int = 0,
        server_public_key: str | None = None,
        client_secret_key: str | None = None,
    ):
        """`reply_hook(body)` sees every successful reply; `on_unknown_instance(msg_type,
        request)` re-handshakes after an UNKNOWN_INSTANCE reply and returns the request to send
        once more (or raises). `server_public_key` (Z85): speak CURVE to `maru-server --curve`,
        as `client_secret_key`'s client (Z85; --curve-clients) or with a throwaway keypair."""
        self.url = url
        self.server_public_key = server_public_key
        self.client_secret_key = client_secret_key
        self.busy_poll_ns = busy_poll_us * 1000  # see _LocalChannel._read
        self.timeout_ms = timeout_ms
        self.max_inflight = max_inflight
        self.reply_hook = reply_hook
        self.on_unknown_instance = on_unknown_instance
        self.context = zmq.Context.instance()
        self.request_ids = itertools.count(1)
        self.local_address: str | None = None  # the server's Unix socket, once it named one
        self.server_uid: int | None = None  # the user it must run as (the HANDSHAKE says)
        self._unreachable_logged: set[str] = set()
        self._local = threading.local()
        self._channels: list[_Channel] = []
        self._channels_lock = threading.Lock()
        self._closed = False
        self.created_in = os.getpid()
        self.forks = FORKS[0]  # this process's fork count when the client was made
        self.session: str | None = None  # the instance's credential, in every request
        self.last_reply = time.monotonic()  # when the server last answered, on any channel

    def answers(self) -> bool:
        """Whether the server answers a HEARTBEAT now (a reaped instance re-handshakes, dropping
        the regions no longer ours). `MaruHandler._may_write` asks after two silent heartbeat
        intervals: the server cannot fence a writer on another host and gives a reaped one's
        regions to others, so a cut-off writer fences itself. False (logged): write nothing."""
        silent = time.monotonic() - self.last_reply
        try:
            self.request(protocol.MsgType.HEARTBEAT, {}).result()
        except MaruError as exc:
            log.warning(
                "not writing into the pool: maru-server has not answered for %.1f s and may "
                "have given our regions to others (%s)",
                silent,
                exc,
            )
            return False
        return True

    def forked(self) -> bool:
        """Whether this process is a child forked after the client was made."""
        return FORKS[0] != self.forks

    def check_fork(self) -> None:
        """Raise `MaruForkedError` in a child forked after the client was made: its requests
        would carry the parent's credential over the parent's connections."""
        if self.forked():
            raise MaruForkedError(self.created_in)

    def use_local_socket(self, address: str | None, uid: int | None) -> None:
        """Send later requests over the server's Unix socket `address` (None: ZMQ only) if the
        process there runs as `uid` (both from HANDSHAKE): another user can take the name while
        the server restarts. A CURVE client not on loopback is on another host, where the
        address is not the server's: it stays on its authenticated channel."""
        if not isinstance(uid, int) or isinstance(uid, bool):
            address = None
        if self.server_public_key is not None and not _LOOPBACK.match(self.url):
            address = None
        if address != self.local_address:
            log.debug("maru-server local socket: %s (uid %s)", address, uid)
        self.local_address, self.server_uid = address, uid

    def local_refused(self, address: str, uid: int) -> None:
        """A connection to the local socket found another user's process there: stop using
        that address (until a handshake names one again) and say so, once."""
        log.error(
            "maru-server's local socket %s is served by uid %d, not by the server's uid %s: "
            "another user's process may be impersonating maru-server; not using it (%s instead)",
            address,
            uid,
            self.server_uid,
            self.url,
        )
        if self.local_address == address:
            self.local_address = None

    def local_denied(self, address: str, why: str) -> None:
        """The server refused this process its local socket (`LocalDoor`: another user than
        those it serves there): stop using that address until a handshake names it again."""
        if self.local_address == address:
            self.local_address = None
            log.warning(
                "maru-server refuses this process (uid %d) its local socket %s: %s; using %s "
                "(slower round trips)",
                os.geteuid(),
                address,
                why,
                self.url,
            )

    def local_unreachable(self, address: str, exc: OSError) -> None:
        if address not in self._unreachable_logged:
            self._unreachable_logged.add(address)
            log.info(
                "maru-server's local socket %s is not reachable from here (%s); "
                "using %s (slower round trips)",
                address,
                exc,
                self.url,
            )

    def _register(self, channel: _Channel) -> None:
        if self._closed:
            channel.close()
            raise MaruConnectionError("RPC client is closed")
        with self._channels_lock:
            self._channels.append(channel)

    def forget(self, channel: _Channel) -> None:
        """Close `channel` (a thread that ended, `_ThreadChannels`) and drop it from those
        `close` closes. No lock: this may run in a garbage collection on a thread holding it."""
        if isinstance(channel, _ZmqChannel):
            # A request the thread sent without waiting (a lease's release) may still be
            # queued: delivered, as on the Unix socket, whose peer reads what was written.
            # (By pid, not `forked()`: a fork drops the other threads' storage, and so calls
            # this, before the at-fork hook counts the fork.)
            if os.getpid() == self.created_in:
                channel.close(linger_ms=self.timeout_ms)
        else:
            channel.close()
        with contextlib.suppress(ValueError):
            self._channels.remove(channel)

    def _thread_channels(self) -> _ThreadChannels:
        mine = getattr(self._local, "channels", None)
        if mine is None:
            mine = self._local.channels = _ThreadChannels()
        return mine

    def _zmq_channel(self) -> _Channel:
        mine = self._thread_channels()
        if mine.zmq is None:
            channel = _ZmqChannel(self)
            self._register(channel)
            mine.zmq = channel
        return mine.zmq

    def _channel(self) -> _Channel:
        """This thread's channel: the Unix socket if the server named one and it connects."""
        address = self.local_address
        if address is not None:
            mine = self._thread_channels()
            local = mine.local
            if local is None or local.address != address:
                if local is not None:
                    self.forget(local)
                local = _LocalChannel(self, address)
                self._register(local)
                mine.local = local
            if local.connected():
                return local
        return self._zmq_channel()

    def request(self, msg_type: int, body: dict[str, Any]) -> PendingReply:
        """Send one request now; its reply comes from `.result()` (on this thread). It
        carries the instance's `session` credential unless it names one."""
        self.check_fork()
        if self.session is not None and "session" not in body:
            body["session"] = self.session
        channel = self._channel()
        try:
            return channel.request(msg_type, body)
        except LocalSocketUnavailable:
            return self._zmq_channel().request(msg_type, body)

    def close(self) -> None:
        """Close every channel. In a forked child only its copies of the Unix sockets: the
        ZMQ sockets belong to the parent's context, which closing them here would disturb."""
        self._closed = True
        forked = self.forked()  # (then no lock: the parent's threads, not here, may have held it)
        with contextlib.nullcontext() if forked else self._channels_lock:
            for channel in list(self._channels):  # (a thread's end may `forget` one meanwhile)
                if not forked or isinstance(channel, _LocalChannel):
                    channel.close()
            self._channels.clear()
        self._local = threading.local()
