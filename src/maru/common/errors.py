"""Exceptions raised by the client library."""

from __future__ import annotations

import os


class MaruError(Exception):
    """Base class of Maru client errors."""


class MaruConnectionError(MaruError):
    """The server did not answer within the timeout (down, unreachable, or overloaded)."""


class MaruServerError(MaruError):
    """The server answered with an error reply."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


class LeaseExpired(MaruError):
    """A read lease ended (`--lease-timeout`, or a server restart) before its holder was done:
    the keys' pages may have been reused, so what was read under it is not taken as those keys'
    bytes. `keys`: the hits it held."""

    def __init__(self, keys: list):
        shown = ", ".join(repr(k)[:80] for k in keys[:8]) + (", ..." if len(keys) > 8 else "")
        super().__init__(
            f"the lease on {len(keys)} keys ended before the block did (it outlived "
            f"--lease-timeout, or the server restarted): what was read may be other bytes: "
            f"{shown}"
        )
        self.keys = keys


class MaruForkedError(RuntimeError):
    """A `MaruHandler` used in a process forked from its creator: with its copy of the parent's
    credential, regions and chunk allocator, the child would write into the pages the parent
    hands out next, as the parent. Every request, reservation and local-index read raises this
    (`close()` only drops the child's copies). Not a `MaruError`: a caller's bug, never a server
    condition, so no path that turns a `MaruError` into a miss or a False swallows it."""

    def __init__(self, created_in: int):
        super().__init__(
            f"this MaruHandler was created in process {created_in}, and process {os.getpid()} "
            "is a child forked from it: a handler does not cross a fork (its credential, "
            "regions and chunks are its parent's); create a new MaruHandler in the child, or "
            "start workers with the 'spawn' method"
        )
        self.created_in = created_in


class MaruNotConnected(MaruError, RuntimeError):
    """A `MaruHandler` used before `connect()` succeeded or after `close()`: a RuntimeError
    starting "Not connected", as the original Maru's (software written for it catches that), and
    a `MaruError`, so the adapters' catch-alls still give a miss or a failed store."""

    def __init__(self, url: str, why: str):
        super().__init__(f"Not connected to maru-server at {url}: {why}")
        self.url = url


class MaruConnectError(MaruError, RuntimeError):
    """`MaruHandler` could not connect; the subclass says why. A RuntimeError, as the original
    Maru's was, whose message is `Failed to connect MaruHandler to <url>: <reason>`."""

    def __init__(self, url: str, reason: str):
        super().__init__(f"Failed to connect MaruHandler to {url}: {reason}")
        self.url, self.reason = url, reason


class MaruServerDown(MaruConnectError):
    """Nothing answers at the URL: no server running, another port, host unreachable."""


class MaruConnectRefused(MaruConnectError):
    """A server answered but refused this instance (a bad request, an error reply)."""


class MaruVersionMismatch(MaruConnectError):
    """The server speaks another protocol version (upgrade client and server together)."""
