"""The region handle: everything a client needs to map a region of a pool, and nothing else."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RegionHandle:
    region_id: int
    path: str  # file or device to mmap
    offset: int  # byte offset of the region inside `path` (page aligned)
    length: int
    token: str
    owner: str = ""  # instance id of the region's owner

    def to_wire(self) -> list[Any]:
        return [self.region_id, self.path, self.offset, self.length, self.token, self.owner]

    @classmethod
    def from_wire(cls, fields: list[Any]) -> RegionHandle:
        region_id, path, offset, length, token, owner = fields
        return cls(int(region_id), str(path), int(offset), int(length), str(token), str(owner))
