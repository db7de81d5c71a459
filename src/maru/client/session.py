"""`Session`: what the client's helpers share of one handler, and nothing more.

`Sealing`, `Lookup`, the local index, the region supply and the write verb each need a few
things of the handler they serve: its configuration and instance name, its one way to send a
request, its chunk book and region mapper. They get this small object instead of the handler
(as Plasma's eviction policy sees only `PlasmaStoreInfo`), so no helper reaches into the
handler's private members and no client module imports the handler back.
"""

from __future__ import annotations

import logging
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

log = logging.getLogger("maru.client.handler")


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
        "regions_seen",
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
        self.regions_seen: tuple[str | None, int] = (None, 0)  # (pool generation, next id)

    def map(self, handle: RegionHandle) -> MappedRegion:
        """`handle`'s region mapped here (once; again if the server reused its id): writable
        if we own it, read-only otherwise."""
        mapped = self.mapper.get(handle.region_id)
        if mapped is not None and mapped.handle == handle:
            return mapped
        writable = handle.owner == self.instance_id and handle.region_id in self.chunks
        return self.mapper.map(handle, writable=writable)

    def map_new_regions(self, generation: str | None) -> None:
        """Map every region of the pool made since the last call (the handler's `eager_map`:
        at connect, then at each heartbeat; others' read-only, populated in the background),
        so that a first read of another instance's new region finds it mapped. Region ids
        only grow within a pool `generation`; a new pool starts them again."""
        seen_in, seen = self.regions_seen
        seen = seen if seen_in == generation else 0
        reply = self.request(MsgType.LIST_ALLOCATIONS, {"from_id": seen}).result()
        for fields in reply["regions"]:
            seen = max(seen, int(fields[0]) + 1)
            try:
                self.map(RegionHandle.from_wire(fields))
            except OSError as exc:  # (a lookup that finds a key there maps it again)
                log.warning("cannot map region %s of the pool: %s", fields[0], exc)
        self.regions_seen = (generation, seen)
