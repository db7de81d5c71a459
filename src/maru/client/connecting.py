"""Why a connect failed, said once and fast: `MaruHandler.connect` probes the server's TCP
port first (a refused connection is known in microseconds, where a request to nobody waits
for its whole deadline), and turns whatever went wrong into one `MaruConnectError` subclass."""

from __future__ import annotations

import re
import socket

from maru.common.errors import (
    MaruConnectError,
    MaruConnectionError,
    MaruConnectRefused,
    MaruError,
    MaruServerDown,
    MaruServerError,
    MaruVersionMismatch,
)
from maru.common.protocol import ErrorCode

_TCP = re.compile(r"^tcp://\[?([^\]]+?)\]?:(\d+)$")


# ZeroMQ's greeting (ZMTP 3) begins with this signature: a maru-server's first byte is 0xFF.
# We send it and a line end, so that a line protocol's server (HTTP, Redis...) answers at once.
_ZMTP_SIGNATURE = b"\xff" + b"\x00" * 8 + b"\x7f"
_PROBE = _ZMTP_SIGNATURE + b"\r\n\r\n"
_PROBE_WAIT_S = 1.0  # for the peer's first bytes; silence is left to the handshake


def probe(url: str, timeout_ms: int) -> None:
    """Raise `MaruServerDown` at once if nothing listens at a tcp:// URL, `MaruConnectRefused`
    if what listens is not a ZeroMQ peer (it answers, or hangs up, without ZeroMQ's greeting).
    Other transports (ipc://) and a ZeroMQ peer pass (the handshake tells the rest)."""
    m = _TCP.match(url)
    if m is None:
        return
    host, port = m.group(1), int(m.group(2))
    try:
        with socket.create_connection((host, port), timeout=timeout_ms / 1000) as conn:
            first = _first_bytes(conn)
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        if isinstance(exc, ConnectionRefusedError):
            why = "connection refused: is maru-server running on that port?"
        elif isinstance(exc, TimeoutError):
            why = f"no TCP connection within {timeout_ms} ms"
        raise MaruServerDown(url, f"maru-server is down or unreachable ({why})") from None
    if first is not None and not first.startswith(_ZMTP_SIGNATURE[:1]):
        said = f"it sent {first[:40]!r}" if first else "it closed the connection"
        raise MaruConnectRefused(
            url,
            f"something other than maru-server answered on that port ({said}): is the port right?",
        )


def _first_bytes(conn: socket.socket) -> bytes | None:
    """What the peer sends after our ZeroMQ signature: b"" if it hangs up, None if it says
    nothing in time (left to the handshake to judge)."""
    try:
        conn.sendall(_PROBE)
        conn.settimeout(min(conn.gettimeout() or _PROBE_WAIT_S, _PROBE_WAIT_S))
        return conn.recv(64)
    except TimeoutError:
        return None
    except ConnectionError:
        return b""


def connect_failure(url: str, exc: MaruError) -> MaruConnectError:
    """The one error a failed connect reports, by cause."""
    if isinstance(exc, MaruConnectError):
        return exc
    if isinstance(exc, MaruConnectionError):
        return MaruServerDown(url, f"maru-server is down or unreachable ({exc})")
    if isinstance(exc, MaruServerError):
        if exc.code == ErrorCode.BAD_VERSION:
            return MaruVersionMismatch(url, str(exc))
        return MaruConnectRefused(url, f"the server refused the connection ({exc})")
    return MaruConnectRefused(url, str(exc))
