"""Maru: a KV-cache store on shared memory. Clients map the pool; only metadata crosses a socket."""

from maru.admin import MaruAdmin
from maru.config import ConfigError, MaruConfig, parse_size
from maru.errors import MaruConnectionError, MaruError, MaruServerError
from maru.handler import AllocHandle, MaruHandler, MemoryInfo

__all__ = [
    "AllocHandle",
    "ConfigError",
    "MaruAdmin",
    "MaruConfig",
    "MaruConnectionError",
    "MaruError",
    "MaruHandler",
    "MaruServerError",
    "MemoryInfo",
    "parse_size",
]
__version__ = "0.1.0"
