"""The server's Unix socket: the ROUTER socket's request frames, length-prefixed on a stream
(`protocol.StreamReader`), for clients on this node without ZMQ's I/O threads in the round
trip (docs/architecture.md, "Wire protocol").

Sockets are non-blocking and replies buffered per connection, so a client that stops reading
stalls only itself: past `OUT_LIMIT` buffered bytes its requests are neither read nor answered.
A connection refused by `LocalDoor`, or whose descriptor comes within `FD_RESERVE` of the
process's limit (the kernel hands out the lowest free number), gets one error frame and is
closed before any of its requests is read: the journal and TCP clients always find descriptors.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import socket
import stat
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import zmq

from maru.common import protocol
from maru.common.peer import peer_credentials, peer_groups
from maru.common.protocol import ErrorCode, unix_address
from maru.common.throttle import Throttle

log = logging.getLogger(__name__)

# Plain ints: zmq.POLLIN is an enum, and enum arithmetic costs microseconds per request.
POLLIN, POLLOUT = int(zmq.POLLIN), int(zmq.POLLOUT)
FRAMES_PER_WAKEUP = 256  # requests served from one connection before the others get a turn
OUT_LIMIT = 16 << 20  # buffered reply bytes past which a connection's requests wait
IN_LIMIT = 1 << 20  # unserved request bytes past which a connection is not read (`_readable`)
ACCEPT_PAUSE_S = 1.0  # after a failed accept (out of file descriptors), stop watching that long
FD_RESERVE = 64  # descriptors below the limit that connections never take


def local_address(spec: str | None, endpoint: str, tag: str = "") -> str | None:
    """The address to listen on for `--local-socket spec` (None: "none"). "auto": an abstract
    name of the ZMQ endpoint (unique in this network namespace, like the TCP port) and `tag`
    (`TokenSigner.server_tag`: the same across restarts, so clients reconnect, and never
    another server's, which a client in another namespace could reach by the same endpoint)."""
    if spec is None or spec.lower() in ("", "none", "off"):
        return None
    if spec == "auto":
        return f"@maru:{endpoint}:{tag}" if tag else f"@maru:{endpoint}"
    return spec


class LocalDoor:
    """Who may use the local socket: the processes that may map the pool (the server's user,
    root, whom no file mode keeps out, `--local-uids`, and `--pool-group`'s members, primary or
    supplementary, as the kernel took them at connect). Nothing the socket offers is anyone
    else's (a DELETE_PREFIX of theirs would drop every key)."""

    def __init__(self, uids: Iterable[int] = (), gid: int | None = None):
        self.uids = frozenset({os.geteuid(), 0, *uids})
        self.gid = gid

    def refusal(self, sock: socket.socket) -> tuple[int, int, str] | None:
        """None if the peer of `sock` may come in, else (its uid, its pid, the reason)."""
        try:
            pid, uid, gid = peer_credentials(sock)
        except OSError as exc:
            return -1, 0, f"the kernel does not say who connected ({exc})"
        if uid in self.uids:
            return None
        if self.gid is not None and (gid == self.gid or self.gid in peer_groups(sock)):
            return None
        allowed = ", ".join(str(u) for u in sorted(self.uids))
        group = f" nor a member of --pool-group gid {self.gid}" if self.gid is not None else ""
        why = (
            f"uid {uid} may not use maru-server's local socket: it serves uids {allowed} "
            f"(its own, root and --local-uids){group}, the processes that may map the pool; "
            f"the operator can add --local-uids {uid}, or talk to the server over TCP"
        )
        return uid, pid, why


class Peer:
    """A client connection. The request handler sees `sock` (whose peer process the server
    can watch) and `instance`, the instance it was last seen to speak for."""

    __slots__ = ("fd", "held", "instance", "out", "reader", "sock", "want")

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.instance: str | None = None
        self.fd = sock.fileno()
        self.reader = protocol.StreamReader()
        self.out = bytearray()
        self.held: list[bytes] = []  # requests read but not answered: `out` was full
        self.want = POLLIN  # what the poller watches for


class LocalSocketServer:
    """Listens on `address`; `attach` its sockets to the RPC loop's poller and hand each
    poll's events to `serve`."""

    def __init__(self, address: str, door: LocalDoor | None = None):
        self.address = address
        self.door = door if door is not None else LocalDoor()
        self._path = None if address.startswith("@") else address
        if self._path is not None:
            _remove_stale_socket(self._path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(unix_address(address))
            listener.listen(128)
        except OSError:
            listener.close()
            raise
        listener.setblocking(False)
        self.listener = listener
        self.connections: dict[int, Peer] = {}  # by file descriptor
        self._poller: zmq.Poller | None = None
        self.accept_paused_until = 0.0  # monotonic time; 0: accepting
        self._refusals = Throttle(10.0)

    def attach(self, poller: zmq.Poller) -> None:
        self._poller = poller
        if not self.accept_paused_until:
            poller.register(self.listener, POLLIN)
        for conn in self.connections.values():
            poller.register(conn.sock, conn.want)

    def serve(self, events: dict[Any, int], handle: Callable[[bytes, Peer], bytes | None]) -> None:
        """Accept, read, answer and flush whatever `events` (one poll's result; zmq.Poller
        reports plain sockets by file descriptor) says is ready. Never raises for a client's
        misbehaviour: the connection is closed instead."""
        if events.get(self.listener.fileno()):
            # A new connection may already hold requests (sent while this process was
            # stopped, say): read it now, before housekeeping judges who is silent.
            events = {**events, **dict.fromkeys(self._accept(), POLLIN)}
        for fd, conn in list(self.connections.items()):
            flags = events.get(fd)
            if not flags:
                continue
            if flags & POLLIN and _readable(conn) and not self._receive(conn):
                continue
            try:
                frames = conn.held or conn.reader.frames(FRAMES_PER_WAKEUP)
            except protocol.ProtocolError as exc:
                # The stream cannot be resynchronised: answer once, then hang up.
                reply = protocol.encode_error(0, 0, exc.code, str(exc))
                conn.out += protocol.stream_prefix(reply) + reply
                self._flush(conn)
                self._close(conn, str(exc))
                continue
            conn.held = []
            for n, frame in enumerate(frames):
                if len(conn.out) > OUT_LIMIT:  # it does not read its replies: wait for it
                    conn.held = frames[n:]
                    break
                reply = handle(frame, conn)
                if reply is not None:  # (None: kept, sent later by `send_later`)
                    conn.out += protocol.stream_prefix(reply)
                    conn.out += reply
            if fd in self.connections:
                self._flush(conn)

    def send_later(self, conn: Peer, reply: bytes) -> None:
        """A reply kept past its request's turn (`PullWaits`): sent if its connection is
        still open (the client matches replies by request id), else dropped."""
        if self.connections.get(conn.fd) is not conn:
            return
        conn.out += protocol.stream_prefix(reply)
        conn.out += reply
        self._flush(conn)

    def _accept(self) -> list[int]:
        """Accept waiting connections; returns their file descriptors."""
        accepted: list[int] = []
        for _ in range(64):
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                # Out of file descriptors, say: the connection stays queued and the listener
                # readable, so polling it would spin; stop watching it for a while.
                log.warning(
                    "local socket: accept failed (%s); not accepting for %.0f s",
                    exc,
                    ACCEPT_PAUSE_S,
                )
                self._pause_accepting()
                break
            if sock.fileno() >= _fd_limit() - FD_RESERVE:
                # refused, with a frame that says so: the client then knows that none of
                # its requests was read, and sends them over TCP
                _send_refusal(sock, ErrorCode.LOCAL_SOCKET_FULL, "out of file descriptors")
                held = self._refusals.allow("fds")
                if held is not None:
                    log.warning(
                        "local socket: refusing connections: %d of %d file descriptors open%s",
                        _fd_limit() - FD_RESERVE,
                        _fd_limit(),
                        self._refusals.note(held),
                    )
                continue
            sock.setblocking(False)
            refused = self.door.refusal(sock)
            if refused is not None:
                self._refuse(sock, *refused)
                continue
            conn = Peer(sock)
            self.connections[conn.fd] = conn
            accepted.append(conn.fd)
            if self._poller is not None:
                self._poller.register(sock, conn.want)
        return accepted

    def _refuse(self, sock: socket.socket, uid: int, pid: int, why: str) -> None:
        """One NOT_AUTHORIZED frame, then close: the client says why and goes on over TCP."""
        _send_refusal(sock, ErrorCode.NOT_AUTHORIZED, why)
        held = self._refusals.allow(("uid", uid))
        if held is not None:
            log.warning(
                "local socket: refused a connection of pid %d: %s%s",
                pid,
                why,
                self._refusals.note(held),
            )

    def _pause_accepting(self) -> None:
        if not self.accept_paused_until and self._poller is not None:
            self._poller.unregister(self.listener)
        self.accept_paused_until = time.monotonic() + ACCEPT_PAUSE_S

    def resume_accepting_if_due(self, now: float) -> None:
        """Called every loop turn: watch the listener again once a pause has passed."""
        if self.accept_paused_until and now >= self.accept_paused_until:
            self.accept_paused_until = 0.0
            if self._poller is not None:
                self._poller.register(self.listener, POLLIN)

    def _receive(self, conn: Peer) -> bool:
        """Read what the socket has into the connection's buffer; False if it closed."""
        try:
            data = conn.sock.recv(protocol.STREAM_RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError as exc:
            self._close(conn, f"receive failed: {exc}")
            return False
        if not data:
            self._close(conn, None)
            return False
        conn.reader.feed(data)
        return True

    def _flush(self, conn: Peer) -> None:
        """Send buffered replies, then poll for requests, and for POLLOUT while replies are left
        or complete requests wait (the socket is writable: poll returns at once for them)."""
        out = conn.out
        while out:
            try:
                sent = conn.sock.send(out)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                self._close(conn, f"send failed: {exc}")
                return
            del out[:sent]
        if len(out) > OUT_LIMIT:
            self._want(conn, POLLOUT)  # stop reading its requests until it reads replies
        elif out or conn.held or conn.reader.has_frame():
            self._want(conn, POLLIN | POLLOUT)
        else:
            self._want(conn, POLLIN)

    def _want(self, conn: Peer, flags: int) -> None:
        if flags != conn.want:
            conn.want = flags
            if self._poller is not None:
                self._poller.modify(conn.sock, flags)

    def _close(self, conn: Peer, why: str | None) -> None:
        if why:
            log.debug("local socket: closing a connection: %s", why)
        if self.connections.pop(conn.fd, None) is not None and self._poller is not None:
            self._poller.unregister(conn.sock)
        conn.sock.close()

    def close(self) -> None:
        for conn in list(self.connections.values()):
            self._close(conn, None)
        self.listener.close()
        if self._path is not None:
            Path(self._path).unlink(missing_ok=True)


def _readable(conn: Peer) -> bool:
    """Whether to read more of a connection: not while IN_LIMIT bytes of complete requests
    wait to be served (FRAMES_PER_WAKEUP a turn). A client writing small requests faster
    than that would grow the server by what it wrote, without bound; the kernel holds the
    rest, and the client blocks. Still read when no whole frame is buffered (a long one)."""
    reader = conn.reader
    return reader.buffered < IN_LIMIT or not reader.has_frame()


def _fd_limit() -> int:
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def raise_fd_limit() -> None:
    """Raise this process's soft limit of open files to its hard limit (a server's
    connections are file descriptors)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard != resource.RLIM_INFINITY:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (OSError, ValueError):
            return
        log.info("open file limit raised from %d to %d (each connection is one)", soft, hard)


def holder_of(address: str) -> str:
    """Who listens at a Unix socket address, for an error message: "pid P (uid U)"."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(unix_address(address))
        pid, uid, _ = peer_credentials(probe)
        return f"pid {pid} (uid {uid})"
    except OSError as exc:
        return f"a process that cannot be asked ({exc})"
    finally:
        probe.close()


def _remove_stale_socket(path: str) -> None:
    """A socket file left by a server that died can be replaced; a live server's cannot."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise OSError(f"--local-socket {path} exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        os.unlink(path)  # nobody listens: stale
        return
    finally:
        probe.close()
    raise OSError(f"--local-socket {path} is in use by a running server")


def _send_refusal(sock: socket.socket, code: ErrorCode, why: str) -> None:
    """A connection refused before any of its requests is read: one error frame for request
    id 0 (no request has it), then close."""
    reply = protocol.encode_error(0, 0, code, why)
    with contextlib.suppress(OSError):  # it has gone already
        sock.send(protocol.stream_prefix(reply) + reply)
    sock.close()
