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
