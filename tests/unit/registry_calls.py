"""Registry calls in the shapes the tests read best: one [key, region_id, offset, length] row per
registered key, one [region_id, offset, length] location (None for a miss) per looked-up key."""

from __future__ import annotations

from typing import Any

from maru.common.region import RegionHandle
from maru.server.registry import Registry


def register(reg: Registry, iid: str, rows: list[list[Any]]) -> list[int]:
    """`Registry.register` of these rows (its four columns)."""
    keys, region_ids, offsets, lengths = (list(c) for c in zip(*rows)) if rows else ([],) * 4
    return reg.register(iid, keys, region_ids, offsets, lengths)


def locate(
    reg: Registry, keys: list[Any], iid: str | None = None
) -> tuple[list[list[int] | None], list[RegionHandle]]:
    """`Registry.lookup` (no lease) as a location per key and the regions' handles."""
    region_ids, offsets, lengths, _checksums, handles, _ = reg.lookup(keys, iid)
    columns = (memoryview(c).cast("q").tolist() for c in (region_ids, offsets, lengths))
    return [[r, o, n] if r else None for r, o, n in zip(*columns)], handles


def lease(reg: Registry, keys: list[Any], owner: str | None) -> int:
    """A read lease on the hits among `keys`, as LOOKUP_KV with "lease" takes it (0: none)."""
    return reg.lookup(keys, owner, lease=True)[-1]
