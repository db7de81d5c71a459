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


class OtherInstance:
    """Another instance (a plain MaruHandler of chunks of `chunk` bytes) storing values of
    `size` bytes, all `OTHER`: what a restarted or evicting server may hand the audited pages
    to."""

    def __init__(self, url: str, size: int, chunk: int, handler: Any = None):
        from maru import MaruHandler

        self.size = size
        self.h = handler or MaruHandler(  # (`handler`: an instance of the test's own)
            server_url=url, pool_size="64M", chunk_size_bytes=chunk, timeout_ms=10_000
        )
        self.stored: list[str] = []

    def holds(self, place: tuple | None) -> bool:
        """Whether `place` ((path, offset), or with its own size third) holds its values."""
        if place is None:
            return False
        return holds_other(place[:2], place[2] if len(place) > 2 else self.size)

    def write(self, places: Sequence[tuple | None], most: int, salt: str) -> list[bool]:
        """Store up to `most` values, until every place holds them; per place, whether it
        does."""
        value, batch, tried = bytes([OTHER]) * self.size, 128, 0
        while tried < most:
            keys = [f"other-{salt}-{tried + i}" for i in range(batch)]
            tried += batch
            done = self.h.batch_store(keys, [value] * batch)
            self.stored += [k for k, ok in zip(keys, done) if ok]
            if all(self.holds(p) for p in places if p is not None):
                break
        return [self.holds(p) for p in places]

    def wrong(self) -> list[str]:
        """Its values read back (by itself) as other bytes; a miss (evicted) is not wrong."""
        value = bytes([OTHER]) * self.size
        infos = self.h.batch_retrieve(self.stored)
        return [k for k, i in zip(self.stored, infos) if i is not None and bytes(i.view) != value]

    def close(self) -> None:
        self.h.close()
