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


def probe(url: str, timeout_ms: int) -> None:
    """Raise `MaruServerDown` at once if nothing listens at a tcp:// URL; other transports
    (ipc://) and a listening port pass (the handshake then tells the rest)."""
    m = _TCP.match(url)
    if m is None:
        return
    host, port = m.group(1), int(m.group(2))
    try:
        with socket.create_connection((host, port), timeout=timeout_ms / 1000):
            pass
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        if isinstance(exc, ConnectionRefusedError):
            why = "connection refused: is maru-server running on that port?"
        elif isinstance(exc, TimeoutError):
            why = f"no TCP connection within {timeout_ms} ms"
        raise MaruServerDown(url, f"maru-server is down or unreachable ({why})") from None


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
