"""Exceptions raised by the client library."""

from __future__ import annotations


class MaruError(Exception):
    """Base class of Maru client errors."""


class MaruConnectionError(MaruError):
    """The server did not answer within the timeout (down, unreachable, or overloaded)."""


class MaruServerError(MaruError):
    """The server answered with an error reply."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


class MaruConnectError(MaruError, RuntimeError):
    """`MaruHandler` could not connect; the subclass says why. The message starts with the
    seed's `Failed to connect MaruHandler to <url>` (and it is a RuntimeError, as that was), then
    the reason, once."""

    def __init__(self, url: str, reason: str):
        super().__init__(f"Failed to connect MaruHandler to {url}: {reason}")
        self.url, self.reason = url, reason


class MaruServerDown(MaruConnectError):
    """Nothing answers at the URL: no server running, another port, host unreachable."""


class MaruConnectRefused(MaruConnectError):
    """A server answered but refused this instance (a bad request, an error reply)."""


class MaruVersionMismatch(MaruConnectError):
    """The server speaks another protocol version (upgrade client and server together)."""
