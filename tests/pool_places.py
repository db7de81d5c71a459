"""Where keys' bytes lie in the pool file, and whether another instance's values overwrote them:
the restart and eviction audits (SGLang, vLLM) check that pages they read as misses were really
rewritten, so that a hit there would have shown other bytes."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

OTHER = 0xEE  # every byte of another instance's values: never a page a test wrote


def places(handler: Any, keys: Sequence[Any]) -> list[tuple[str, int] | None]:
    """Where each key's value lies in the pool (file path, offset); None for a miss."""
    out: list[tuple[str, int] | None] = []
    for info in handler.batch_retrieve(keys):
        if info is None:
            out.append(None)
            continue
        region = handler._mapper.get(info.region_id).handle
        out.append((region.path, region.offset + info.offset))
    return out


def holds_other(place: tuple[str, int] | None, size: int) -> bool:
    """Whether `size` bytes at `place` in the pool file are another instance's value."""
    if place is None or not os.path.exists(place[0]):
        return False
    fd = os.open(place[0], os.O_RDONLY)
    try:
        return os.pread(fd, size, place[1]) == bytes([OTHER]) * size
    finally:
        os.close(fd)
