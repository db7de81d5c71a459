"""The client: what an inference process links (handler, request path, pages, mapping).

The names below are the client's public surface: what the adapters (`maru_sglang`,
`maru_vllm`, `maru_lmcache`) may use; every other module of the client is internal and may
change with how writes and reads work (tests/unit/test_layers.py guards it). They load on
first use, as `maru`'s do.
"""

from __future__ import annotations

from maru.common.lazy import lazy_exports

_EXPORTS = {
    # the lifecycle: reserve, write, seal, get, release, delete
    "MaruHandler": "maru.client.handler",
    "AllocHandle": "maru.client.chunks",
    "MemoryInfo": "maru.client.requests",
    "StoreOutcome": "maru.client.writes",
    "Lookup": "maru.client.requests",  # (a lease held across threads: the linker's load)
    # the write verb (`MaruHandler.put`) and the copies it takes
    "Put": "maru.client.writes",
    "CopyIn": "maru.client.writes",
    "values_at": "maru.client.writes",
    "ValuesAt": "maru.client.writes",
    "from_pointers": "maru.client.writes",
    "PIPELINE_MIN_PAGES": "maru.client.writes",
    # the copy loops a caller's copy function is made of
    "CopyFaultError": "maru.common.memcopy",
    "CopyStarted": "maru.common.memcopy",
    "copy_many": "maru.common.memcopy",
    "copy_many_hashed": "maru.common.memcopy",
    "copy_values": "maru.common.memcopy",
    "copy_values_start": "maru.common.memcopy",
    "page_pointers": "maru.common.memcopy",
    # software coherence for bytes moved by something else than the copy loops (a device)
    "invalidate_ranges": "maru.client.coherence",
    "write_back_ranges": "maru.client.coherence",
    # configuration and errors
    "MaruConfig": "maru.common.config",
    "ConfigError": "maru.common.config",
    "parse_bool": "maru.common.config",  # (an adapter's own keys, parsed as MaruConfig's)
    "parse_int": "maru.common.config",
    "MaruError": "maru.common.errors",
    "Throttle": "maru.common.throttle",  # (a line that can repeat at every step)
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_exports("maru.client", _EXPORTS, globals())
