"""`Session`: what the client's helpers (`Sealing`, `Lookup`, the local index, the region
supply, the write verb) share of one handler, so that none reaches into the handler's private
members and no client module imports the handler back.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from maru.client.chunks import ChunkBook
from maru.client.mapping import MappedRegion, RegionMapper
from maru.client.rpc import PendingReply
from maru.common.config import MaruConfig
from maru.common.protocol import MsgType
from maru.common.region import RegionHandle

Request = Callable[[MsgType, dict[str, Any]], PendingReply]

log = logging.getLogger("maru.client.handler")


@dataclass(slots=True, eq=False, repr=False)
class Session:
    """One handler's shared state. The handler changes `config` (a new chunk size) and
    `instance_id` (the name the server gives at handshake); `request` sends as this instance."""

    config: MaruConfig
    request: Request
    chunks: ChunkBook
    mapper: RegionMapper
    instance_id: str = field(init=False)
    refused_stores: Counter[str] = field(default_factory=Counter)  # before sending, by reason
    checksum_mismatches: int = 0  # hits taken as misses: bytes unlike their checksum
    leases_ended: int = 0  # leased hits taken as misses: the lease ended before the copy's end
    regions_seen: tuple[str | None, int] = (None, 0)  # (pool generation, next id)

    def __post_init__(self) -> None:
        self.instance_id = self.config.instance_id

    def map(self, handle: RegionHandle, *, follow: bool = False) -> MappedRegion:
        """`handle`'s region mapped here (once; again if the server reused its id): writable
        if we own it, read-only otherwise. `follow`: a region just made (see
        `RegionMapper.follow_backing`)."""
        mapped = self.mapper.get(handle.region_id)
        if mapped is not None and mapped.handle == handle:
            return mapped
        writable = handle.owner == self.instance_id and handle.region_id in self.chunks
        return self.mapper.map(handle, writable=writable, follow=follow)

    def map_new_regions(self, generation: str | None) -> None:
        """Map every region of the pool made since the last call (`eager_map`: at connect,
        then at each heartbeat), so that a first read of another instance's new region finds
        it mapped. Region ids only grow within a pool `generation`. The regions made since an
        earlier call are new: their writers are still backing their pages (followed); those
        found at the first call may be of any age."""
        seen_in, seen = self.regions_seen
        new = seen_in == generation
        seen = seen if new else 0
        reply = self.request(MsgType.LIST_ALLOCATIONS, {"from_id": seen}).result()
        for fields in reply["regions"]:
            seen = max(seen, int(fields[0]) + 1)
            try:
                self.map(RegionHandle.from_wire(fields), follow=new)
            except OSError as exc:  # (a lookup that finds a key there maps it again)
                log.warning("cannot map region %s of the pool: %s", fields[0], exc)
        self.regions_seen = (generation, seen)
