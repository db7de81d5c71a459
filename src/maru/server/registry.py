"""The server's state: instances, regions, and the key -> (region, offset, length) registry.

Pure bookkeeping, no sockets and no page bytes, so every rule can be tested directly:
- write-then-register: a key exists only once its owner registered it, after writing its bytes;
- first writer wins: registering an existing key changes nothing;
- a pinned key cannot be deleted;
- deferred free: a region goes back to the pool only when its owner returned it (or is gone)
  *and* no registered key still points into it;
- page reuse: when a key in instance X's region disappears, X is told (the `freed` list
  piggy-backed on its next reply) so it can reuse those pages.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from maru.pool.backends import Pool, PoolFullError
from maru.pool.region import RegionHandle
from maru.pool.token import TokenSigner
from maru.protocol import MAX_KEY_BYTES, DeleteStatus, ErrorCode, ProtocolError, RegisterStatus

log = logging.getLogger(__name__)

Key = str | bytes


@dataclass
class Region:
    region_id: int
    owner: str
    path: str
    offset: int
    length: int
    token: str
    returned: bool = False  # owner gave it back (or disconnected); free once live_keys == 0
    live_keys: int = 0

    def handle(self) -> RegionHandle:
        return RegionHandle(
            self.region_id, self.path, self.offset, self.length, self.token, self.owner
        )


class KeyEntry:
    __slots__ = ("length", "offset", "pins", "region_id")

    def __init__(self, region_id: int, offset: int, length: int):
        self.region_id = region_id
        self.offset = offset
        self.length = length
        self.pins = 0


@dataclass
class Instance:
    instance_id: str
    pid: int = 0
    regions: set[int] = field(default_factory=set)
    freed: list[list[int]] = field(default_factory=list)  # [region_id, offset, length] to reuse
    last_seen: float = field(default_factory=time.monotonic)
    keys_registered: int = 0
    bytes_registered: int = 0
    hits: int = 0
    misses: int = 0


def check_key(key: Any) -> Key:
    if isinstance(key, str):
        if len(key) > MAX_KEY_BYTES // 4 and len(key.encode()) > MAX_KEY_BYTES:
            raise ProtocolError(ErrorCode.KEY_TOO_LONG, f"key longer than {MAX_KEY_BYTES} bytes")
        return key
    if isinstance(key, bytes):
        if len(key) > MAX_KEY_BYTES:
            raise ProtocolError(ErrorCode.KEY_TOO_LONG, f"key longer than {MAX_KEY_BYTES} bytes")
        return key
    raise ProtocolError(
        ErrorCode.BAD_REQUEST, f"a key must be str or bytes, got {type(key).__name__}"
    )


class Registry:
    def __init__(self, pool: Pool, signer: TokenSigner):
        self.pool = pool
        self.signer = signer
        self.instances: dict[str, Instance] = {}
        self.regions: dict[int, Region] = {}
        self.keys: dict[Key, KeyEntry] = {}
        self._next_region_id = 1
        self.counters: dict[str, int] = {
            "regions_allocated": 0,
            "regions_freed": 0,
            "keys_registered": 0,
            "keys_duplicate": 0,
            "keys_deleted": 0,
            "lookups": 0,
            "hits": 0,
            "misses": 0,
        }

    # -- instances ---------------------------------------------------------------------------

    def instance(self, instance_id: Any) -> Instance:
        if not isinstance(instance_id, str) or instance_id not in self.instances:
            raise ProtocolError(
                ErrorCode.UNKNOWN_INSTANCE, f"unknown instance {instance_id!r}: handshake first"
            )
        inst = self.instances[instance_id]
        inst.last_seen = time.monotonic()
        return inst

    def handshake(self, instance_id: str, pid: int) -> list[RegionHandle]:
        """(Re)attach an instance; returns the regions it still owns (after a reconnect)."""
        if not isinstance(instance_id, str) or not instance_id or len(instance_id) > 128:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "instance_id must be a non-empty string")
        inst = self.instances.get(instance_id)
        if inst is None:
            inst = self.instances[instance_id] = Instance(instance_id, pid)
            log.info("instance %s connected (pid %d)", instance_id, pid)
        else:
            log.info("instance %s reconnected (pid %d)", instance_id, pid)
            inst.pid = pid
        inst.last_seen = time.monotonic()
        return [self.regions[r].handle() for r in sorted(inst.regions)]

    def disconnect(self, instance_id: str) -> None:
        """Forget an instance: its regions become owner-less and are freed once keyless."""
        inst = self.instances.pop(instance_id, None)
        if inst is None:
            return
        for region_id in list(inst.regions):
            self._release_region(self.regions[region_id])
        log.info("instance %s disconnected", instance_id)

    def take_freed(self, instance_id: Any) -> list[list[int]]:
        inst = self.instances.get(instance_id) if isinstance(instance_id, str) else None
        if inst is None or not inst.freed:
            return []
        freed, inst.freed = inst.freed, []
        return freed

    # -- regions -----------------------------------------------------------------------------

    def request_region(self, instance_id: str, size: int) -> RegionHandle:
        inst = self.instance(instance_id)
        if not isinstance(size, int) or size <= 0:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, f"region size must be positive, got {size!r}"
            )
        length = self.pool.round_up(size)
        region_id = self._next_region_id
        try:
            path, offset = self.pool.allocate(region_id, length)
        except PoolFullError as exc:
            log.warning("region request of %d bytes by %s refused: %s", size, instance_id, exc)
            raise ProtocolError(ErrorCode.POOL_FULL, str(exc)) from None
        self._next_region_id += 1
        token = self.signer.sign(region_id, path, offset, length)
        region = Region(region_id, instance_id, path, offset, length, token)
        self.regions[region_id] = region
        inst.regions.add(region_id)
        self.counters["regions_allocated"] += 1
        log.info(
            "region %d (%d bytes at %s+%d) allocated to %s",
            region_id,
            length,
            path,
            offset,
            instance_id,
        )
        return region.handle()

    def _verified_region(self, region_id: Any, token: Any) -> Region:
        region = self.regions.get(region_id) if isinstance(region_id, int) else None
        if region is None:
            raise ProtocolError(ErrorCode.UNKNOWN_REGION, f"unknown region {region_id!r}")
        if not self.signer.verify(
            token, region.region_id, region.path, region.offset, region.length
        ):
            raise ProtocolError(ErrorCode.BAD_TOKEN, f"wrong token for region {region_id}")
        return region

    def region_access(self, region_id: Any, token: Any) -> RegionHandle:
        return self._verified_region(region_id, token).handle()

    def return_region(self, instance_id: str, region_id: Any, token: Any) -> None:
        inst = self.instance(instance_id)
        region = self._verified_region(region_id, token)
        if region.owner != instance_id or region.returned:
            raise ProtocolError(
                ErrorCode.NOT_OWNER, f"region {region_id} is not owned by {instance_id}"
            )
        inst.regions.discard(region.region_id)
        self._release_region(region)

    def _release_region(self, region: Region) -> None:
        region.returned = True
        if region.live_keys == 0:
            self._free_region(region)
        else:
            log.info(
                "region %d returned by %s; freeing deferred until its %d keys go",
                region.region_id,
                region.owner,
                region.live_keys,
            )

    def _free_region(self, region: Region) -> None:
        self.pool.release(region.path, region.offset)
        del self.regions[region.region_id]
        self.counters["regions_freed"] += 1
        log.info("region %d freed", region.region_id)

    def list_allocations(self, instance_id: str | None = None) -> list[RegionHandle]:
        return [
            r.handle()
            for r in self.regions.values()
            if instance_id is None or r.owner == instance_id
        ]

    # -- keys --------------------------------------------------------------------------------

    def register(self, instance_id: str, entries: list[Any]) -> list[int]:
        """Publish written pages. Each entry is [key, region_id, offset, length]."""
        inst = self.instance(instance_id)
        statuses: list[int] = []
        for entry in entries:
            try:
                key, region_id, offset, length = entry
                key = check_key(key)
            except (TypeError, ValueError, ProtocolError):
                statuses.append(RegisterStatus.REJECTED)
                continue
            if key in self.keys:
                statuses.append(RegisterStatus.EXISTS)
                self.counters["keys_duplicate"] += 1
                continue
            region = self.regions.get(region_id) if isinstance(region_id, int) else None
            if (
                region is None
                or region.owner != instance_id
                or region.returned
                or not isinstance(offset, int)
                or not isinstance(length, int)
                or offset < 0
                or length <= 0
                or offset + length > region.length
            ):
                statuses.append(RegisterStatus.REJECTED)
                continue
            self.keys[key] = KeyEntry(region.region_id, offset, length)
            region.live_keys += 1
            inst.keys_registered += 1
            inst.bytes_registered += length
            statuses.append(RegisterStatus.REGISTERED)
        self.counters["keys_registered"] += statuses.count(RegisterStatus.REGISTERED)
        return statuses

    def lookup(
        self, keys: list[Any], instance_id: str | None = None
    ) -> tuple[list[list[int] | None], list[RegionHandle]]:
        """Locations of `keys` (None for a miss) and the handles of the regions they live in."""
        locations: list[list[int] | None] = []
        region_ids: set[int] = set()
        get = self.keys.get
        for key in keys:
            entry = get(key) if isinstance(key, (str, bytes)) else None
            if entry is None:
                locations.append(None)
            else:
                locations.append([entry.region_id, entry.offset, entry.length])
                region_ids.add(entry.region_id)
        hits = len(keys) - locations.count(None)
        self.counters["lookups"] += len(keys)
        self.counters["hits"] += hits
        self.counters["misses"] += len(keys) - hits
        inst = self.instances.get(instance_id) if instance_id else None
        if inst is not None:
            inst.hits += hits
            inst.misses += len(keys) - hits
        return locations, [self.regions[r].handle() for r in region_ids]

    def exists(self, keys: list[Any]) -> list[bool]:
        contains = self.keys.__contains__
        return [isinstance(k, (str, bytes)) and contains(k) for k in keys]

    def pin(self, keys: list[Any]) -> list[bool]:
        out = []
        for key in keys:
            entry = self.keys.get(key) if isinstance(key, (str, bytes)) else None
            if entry is not None:
                entry.pins += 1
            out.append(entry is not None)
        return out

    def unpin(self, keys: list[Any]) -> list[bool]:
        out = []
        for key in keys:
            entry = self.keys.get(key) if isinstance(key, (str, bytes)) else None
            ok = entry is not None and entry.pins > 0
            if ok:
                entry.pins -= 1
            out.append(ok)
        return out

    def delete(self, keys: list[Any]) -> list[int]:
        out = []
        for key in keys:
            entry = self.keys.get(key) if isinstance(key, (str, bytes)) else None
            if entry is None:
                out.append(DeleteStatus.NOT_FOUND)
            elif entry.pins > 0:
                out.append(DeleteStatus.PINNED)
            else:
                self._drop_key(key, entry)
                out.append(DeleteStatus.DELETED)
        return out

    def delete_prefix(self, prefix: Any) -> tuple[int, int]:
        """Delete every unpinned key starting with `prefix` (an operator or `clear()` action).
        Returns (deleted, skipped because pinned). Walks the whole registry: not a hot path."""
        if not isinstance(prefix, (str, bytes)) or not prefix:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "prefix must be a non-empty str or bytes")
        deleted = skipped = 0
        for key in [k for k in self.keys if type(k) is type(prefix) and k.startswith(prefix)]:
            entry = self.keys[key]
            if entry.pins:
                skipped += 1
            else:
                self._drop_key(key, entry)
                deleted += 1
        return deleted, skipped

    def _drop_key(self, key: Key, entry: KeyEntry) -> None:
        del self.keys[key]
        self.counters["keys_deleted"] += 1
        region = self.regions[entry.region_id]
        region.live_keys -= 1
        if region.returned:
            if region.live_keys == 0:
                self._free_region(region)
        else:
            owner = self.instances.get(region.owner)
            if owner is not None:
                owner.freed.append([entry.region_id, entry.offset, entry.length])

    # -- stats -------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        return {
            "pool": self.pool.stats(),
            "keys": len(self.keys),
            "regions": len(self.regions),
            "instances": {
                i.instance_id: {
                    "pid": i.pid,
                    "regions": len(i.regions),
                    "keys_registered": i.keys_registered,
                    "bytes_registered": i.bytes_registered,
                    "hits": i.hits,
                    "misses": i.misses,
                }
                for i in self.instances.values()
            },
            "counters": dict(self.counters),
            "server_pid": os.getpid(),
        }
