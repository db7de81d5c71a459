"""Maru: a KV-cache store on shared memory. Clients map the pool; only metadata crosses a socket.

Three areas, one folder each: `maru.client` (what an inference process links: the handler, its
request path, its page bookkeeping), `maru.server` (`maru-server`: the registry, the pool, the
RPC loop) and `maru.common` (what both speak: protocol, errors, config parsing, extents).

The public names below load on first use, so that `import maru.server...` never pulls in the
client (or numpy) through this package's import.
"""

from __future__ import annotations

from maru.common.lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "AllocHandle": "maru.client.handler",
    "MaruHandler": "maru.client.handler",
    "MemoryInfo": "maru.client.handler",
    "MaruAdmin": "maru.client.admin",
    "ConfigError": "maru.common.config",
    "MaruConfig": "maru.common.config",
    "parse_size": "maru.common.config",
    "LeaseExpired": "maru.common.errors",
    "MaruConnectError": "maru.common.errors",
    "MaruConnectRefused": "maru.common.errors",
    "MaruConnectionError": "maru.common.errors",
    "MaruForkedError": "maru.common.errors",
    "MaruNotConnected": "maru.common.errors",
    "MaruServerDown": "maru.common.errors",
    "MaruVersionMismatch": "maru.common.errors",
    "MaruError": "maru.common.errors",
    "MaruServerError": "maru.common.errors",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_exports("maru", _EXPORTS, globals())
