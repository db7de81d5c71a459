"""Regions: the slices of the pool the server hands to instances, and the rules of their life.

A region has one owner, which alone writes into it (its HMAC token lets readers map it).
Deferred free: it goes back to the pool only once its owner returned it (or is gone) *and* no
registered key points into it, so a reader never maps bytes handed out again. Held
(`--reap-hold`): the regions of an instance reaped for silence, whose process could not be
watched, stay out of use even when empty: that process may only be paused.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

from maru.common.config import PAGE
from maru.common.protocol import ErrorCode, ProtocolError
from maru.common.region import RegionHandle
from maru.server.journal import JournalWriteError
from maru.server.pool import Pool
from maru.server.token import TokenSigner

log = logging.getLogger(__name__)


@dataclass
class Region:
    region_id: int
    owner: str
    path: str
    offset: int
    length: int
    token: str
    returned: bool = False  # owner gave it back (or disconnected); free once live_keys == 0
    # The idle owner will not write here before unparking it (`RegionGrants.park`), so the server
    # may take it back. Not journaled: after a restart, not reclaimable until parked again.
    parked: bool = False
    live_keys: int = 0
    page_size: int = 0  # the owner's page size (from its handshake); 0: unknown
    live_bytes: int = 0  # stats: bytes of the keys that live here
    live_pages: int = 0  # stats: pages they occupy (one per key when page_size is unknown)
    held_until: float = 0.0  # time.monotonic(): not freed before (`RegionTable.release`)

    def pages_for(self, length: int) -> int:
        return -(-length // self.page_size) if self.page_size else 1

    def count(self, lengths: dict[int, int], sign: int) -> int:
        """Keys came (sign 1) or went (-1), so many of each length (`length_groups`, in C):
        the live counters follow. Their bytes."""
        nkeys = nbytes = npages = 0
        for length, keys in lengths.items():  # mostly one length
            nkeys += keys
            nbytes += length * keys
            npages += self.pages_for(length) * keys
        self.live_keys += sign * nkeys
        self.live_bytes += sign * nbytes
        self.live_pages += sign * npages
        return nbytes

    def room(self) -> tuple[int, int]:
        """What new keys may still take here: bytes, and values. Each value takes a page at
        least (a writer's chunks start on page boundaries: `maru.common.config.PAGE`), so a
        region holds no more keys than pages, however short their values."""
        return self.length - self.live_bytes, self.length // PAGE - self.live_keys

    def handle(self) -> RegionHandle:
        return RegionHandle(
            self.region_id, self.path, self.offset, self.length, self.token, self.owner
        )


class RegionTable(dict[int, Region]):
    """Region id -> Region, with the operations that allocate, verify and free them. Changes
    are journaled through `journal` (the registry's, which it silences during a replay)."""

    def __init__(
        self,
        pool: Pool,
        signer: TokenSigner,
        journal: Callable[..., None],
        counters: dict[str, int],
    ):
        super().__init__()
        self.pool = pool
        self.signer = signer
        self._log = journal
        self.counters = counters
        self.next_id = 1
        self.held: dict[int, Region] = {}  # returned regions not to be freed before held_until
        # called with `next_id` after each allocation: the local index tells readers on the
        # node that a region was made (`LocalIndex.note_regions`)
        self.on_allocated: Callable[[int], None] | None = None

    def allocate(self, owner: str, length: int, page_size: int) -> Region:
        """A new region of `length` bytes (already rounded up); PoolFullError if none fits."""
        region_id = self.next_id
        path, offset = self.pool.allocate(region_id, length)
        token = self.signer.sign(region_id, path, offset, length)
        try:  # journal first: a region nobody can find after a restart must not be handed out
            self._log("R", region_id, owner, path, offset, length, token)
        except BaseException:
            self.pool.release(path, offset)
            raise
        self.next_id += 1
        region = self[region_id] = Region(
            region_id, owner, path, offset, length, token, page_size=page_size
        )
        self.counters["regions_allocated"] += 1
        if self.on_allocated is not None:
            self.on_allocated(self.next_id)
        log.info(
            "region %d (%d bytes at %s+%d) allocated to %s",
            region_id,
            length,
            path,
            offset,
            owner,
            extra={"instance": owner, "region": region_id},
        )
        return region

    def restore(
        self,
        rid: int,
        owner: str,
        path: str,
        offset: int,
        length: int,
        token: str,
        returned: bool,
        held_until: float = 0.0,
    ) -> None:
        """A region of a snapshot or journal: its pool bytes are taken again, as they were.
        `held_until`: the wall-clock time (`time.time()`) its hold ends, 0 if none."""
        self.next_id = max(self.next_id, rid + 1)  # (never handed out again, restored or not)
        if not self.pool.reserve(path, offset, length):  # (its bytes went while we were down)
            log.warning(
                "region %d: its file %s is gone, or shorter than the region: its keys are not "
                "restored",
                rid,
                path,
            )
            return
        region = self[rid] = Region(rid, owner, path, offset, length, token, returned)
        self._hold(region, held_until - time.time() if held_until else 0.0)

    def verified(self, region_id: Any, token: Any) -> Region:
        """The region, if `token` is its token; else UNKNOWN_REGION or BAD_TOKEN."""
        region = self.get(region_id) if type(region_id) is int else None
        if region is None:
            raise ProtocolError(ErrorCode.UNKNOWN_REGION, f"unknown region {region_id!r}")
        if not self.signer.verify(
            token, region.region_id, region.path, region.offset, region.length
        ):
            raise ProtocolError(ErrorCode.BAD_TOKEN, f"wrong token for region {region_id}")
        return region

    def writable(self, region_id: int, owner: str) -> Region | None:
        """The region if `owner` may register keys in it (owns it, has not returned it)."""
        region = self.get(region_id)
        if region is None or region.owner != owner or region.returned:
            return None
        return region

    def release(self, region: Region, hold: float = 0.0) -> None:
        """Its owner is done with it: freed now if no key points into it, else with its last
        key; with `hold` (seconds, journaled as the wall-clock end so a restart keeps it), not
        before then either. Journal first: on `JournalWriteError` the owner keeps it."""
        self._log("T", region.region_id, *([time.time() + hold] if hold > 0 else []))
        region.returned = True
        self._hold(region, hold)
        if region.held_until:
            log.info(
                "region %d of %s held for %g s (its process may only be paused)",
                region.region_id,
                region.owner,
                hold,
                extra={"instance": region.owner, "region": region.region_id},
            )
        elif region.live_keys == 0:
            self.free(region)
        else:
            log.info(
                "region %d returned by %s; freeing deferred until its %d keys go",
                region.region_id,
                region.owner,
                region.live_keys,
                extra={"instance": region.owner, "region": region.region_id},
            )

    def _hold(self, region: Region, seconds: float) -> None:
        if seconds > 0:
            region.held_until = time.monotonic() + seconds
            self.held[region.region_id] = region

    def end_holds(self, now: float) -> None:
        """Free the held regions whose hold has passed and that no key points into (a held
        region whose last key went earlier waited for this)."""
        for region in [r for r in self.held.values() if r.held_until <= now]:
            del self.held[region.region_id]
            region.held_until = 0.0
            if region.returned and region.live_keys == 0:
                self.free(region)

    def free(self, region: Region) -> None:
        """Give a returned region with no keys back to the pool, unless held (`end_holds` does,
        later). Its "F" record only repeats what the "T" or "D" just written implies, so a
        failure to write it is not the caller's (logged; later records are refused anyway)."""
        if region.held_until:
            return
        self.pool.release(region.path, region.offset)
        del self[region.region_id]
        self.counters["regions_freed"] += 1
        with suppress(JournalWriteError):
            self._log("F", region.region_id)
        log.info(
            "region %d (%d bytes) of %s freed",
            region.region_id,
            region.length,
            region.owner,
            extra={"instance": region.owner, "region": region.region_id},
        )

    def handles(self, owner: str | None = None) -> list[RegionHandle]:
        """Every region's handle (LIST_ALLOCATIONS), or only those of `owner`'s."""
        return [r.handle() for r in self.values() if owner is None or r.owner == owner]

    def snapshot(self) -> list[list[Any]]:
        """A row per region, as `restore` takes it (a hold as the wall-clock time it ends)."""
        now, wall = time.monotonic(), time.time()
        return [
            [r.region_id, r.owner, r.path, r.offset, r.length, r.token, r.returned]
            + ([wall + r.held_until - now] if r.held_until else [])
            for r in self.values()
        ]
