"""`Session`: what the client's helpers share of one handler, and nothing more.

`Sealing`, `Lookup`, the local index, the region supply and the write verb each need a few
things of the handler they serve: its configuration and instance name, its one way to send a
request, its chunk book and region mapper. They get this small object instead of the handler
(as Plasma's eviction policy sees only `PlasmaStoreInfo`), so no helper reaches into the
handler's private members and no client module imports the handler back.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from maru.client.chunks import ChunkBook
from maru.client.mapping import MappedRegion, RegionMapper
from maru.client.rpc import PendingReply
from maru.common.config import MaruConfig
from maru.common.protocol import MsgType
from maru.common.region import RegionHandle

Request = Callable[[MsgType, dict[str, Any]], PendingReply]


class Session:
    """One handler's shared state: `config` and `instance_id` (the handler changes them:
    a new chunk size, the name the server gives at handshake), `request` (sends as this
    instance), `chunks`, `mapper`, `refused_stores` (stores refused before anything was
    sent, by reason) and `checksum_mismatches` (hits taken as misses: bytes unlike their
    checksum)."""

    __slots__ = (
        "checksum_mismatches",
        "chunks",
        "config",
        "instance_id",
        "mapper",
        "refused_stores",
        "request",
    )

    def __init__(
        self, config: MaruConfig, request: Request, chunks: ChunkBook, mapper: RegionMapper
    ) -> None:
        self.config = config
        self.instance_id = config.instance_id
        self.request = request
        self.chunks = chunks
        self.mapper = mapper
        self.refused_stores: Counter[str] = Counter()
        self.checksum_mismatches = 0

    def map(self, handle: RegionHandle) -> MappedRegion:
        """`handle`'s region mapped here (once; again if the server reused its id): writable
        if we own it, read-only otherwise."""
        mapped = self.mapper.get(handle.region_id)
        if mapped is not None and mapped.handle == handle:
            return mapped
        writable = handle.owner == self.instance_id and handle.region_id in self.chunks
        return self.mapper.map(handle, writable=writable)
