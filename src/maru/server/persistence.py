"""The registry's state as the journal keeps it: a snapshot, and the replay of records after it.

A restart replays each record through the registry mutator that wrote it, so live requests and
recovery share one implementation of each rule. Leases are not kept (a restart ends every read).
"""

from __future__ import annotations

import logging
import time
from itertools import compress
from typing import Any

from maru.common.protocol import CHECKSUMS
from maru.server.instances import Instance
from maru.server.journal import Packed
from maru.server.registry import Registry

log = logging.getLogger(__name__)


def snapshot(registry: Registry) -> dict[str, Any]:
    """The registry's state with its keys as a list of rows, one list per key: what
    `restore` reads back. The server writes `snapshot_packed`'s instead, the same bytes."""
    return _state(
        registry,
        [
            [k, e.region_id, e.offset, e.length, e.checksum]
            if e.checksum
            else [k, e.region_id, e.offset, e.length]
            for k, e in registry.keys.items()
        ],
    )


def snapshot_packed(registry: Registry) -> dict[str, Any]:
    """`snapshot` with the keys' rows packed in C (`KeyIndex.pack_rows`): the journal writes it
    byte for byte as it writes `snapshot`'s, without a second on the server's loop building a
    list per key first (10^6 keys)."""
    keys = registry.keys
    return _state(registry, Packed(keys.pack_rows(), len(keys)))


def _state(registry: Registry, keys: list[list[Any]] | Packed) -> dict[str, Any]:
    return {
        "next_region_id": registry.regions.next_id,
        "regions": registry.regions.snapshot(),
        # a row: key, region id, offset, length, and the checksum when the key has one (of the
        # hash named here: rows of a snapshot without the name restore without theirs)
        "checksums": CHECKSUMS,
        "keys": keys,
        "pins": registry.pins.records(),
    }


def restore(registry: Registry, snapshot: dict[str, Any] | None, records: list[Any]) -> None:
    """Rebuild regions, keys and pins from a snapshot plus the journal records after it. Owners
    of restored regions become instances that must handshake again within the heartbeat
    timeout, or are reaped like any silent client."""
    regions, instances = registry.regions, registry.instances
    journal, registry.journal = registry.journal, None  # replay must not write the journal again
    try:
        if snapshot:
            regions.next_id = int(snapshot["next_region_id"])
            for row in snapshot["regions"]:
                regions.restore(*row)
            rows = snapshot["keys"]
            if snapshot.get("checksums") != CHECKSUMS:  # xxh3 before: none
                rows = [row[:4] for row in rows]
            _replay(registry, ["K", rows])  # the rows of a "K" record's old form
            for holder, key, count in snapshot.get("pins", ()):
                _replay(registry, ["P", holder, [key] * count])
        for record in records:
            _replay(registry, record)
        for region in list(regions.values()):
            if region.returned and region.live_keys == 0:
                regions.free(region)
    finally:
        registry.journal = journal
    for region in regions.values():
        if not region.returned:
            instances.setdefault(region.owner, Instance(region.owner)).regions.add(region.region_id)
    now = time.monotonic()
    for inst in instances.values():  # all must handshake again within the timeout
        inst.last_seen = now
        inst.freed.clear()  # notices of the replayed drops: told before the restart, or lost
    keys, live = len(registry.keys), registry.live_bytes
    log.info("restored %d regions and %d keys (%d bytes)", len(regions), keys, live)


def _replay(registry: Registry, record: list[Any]) -> None:
    """Apply one journal record through the mutator that wrote it."""
    kind, regions, keys = record[0], registry.regions, registry.keys
    if kind == "R":
        regions.restore(*record[1:], False)
    elif kind == "T":  # [, the wall-clock time its hold ends]
        region = regions.get(record[1])
        if region is not None:
            regions.release(region, record[2] - time.time() if len(record) > 2 else 0.0)
    elif kind == "F":  # already freed by the "T" or "D" before it, as when it was written
        region = regions.get(record[1])
        if region is not None and region.live_keys == 0:
            # (freed then: its hold had ended, whatever the wall clock now says of the "T")
            regions.held.pop(region.region_id, None)
            region.held_until = 0.0
            regions.free(region)
    elif kind == "K" and len(record) in (5, 6, 7):
        # keys, region_ids, offsets, lengths[, sums, the hash's name]; sums without the name
        # are xxh3 of before: restored as none
        tagged = len(record) == 7 and record[6] == CHECKSUMS
        _restore_keys(registry, *record[1 : 6 if tagged else 5])
    elif kind == "K":  # a snapshot's rows, and records before protocol 2: [[key, ...], ...]
        rows = record[1]
        if any(len(row) > 4 for row in rows):  # some with a checksum: 0 for the others
            rows = [row if len(row) > 4 else [*row, 0] for row in rows]
        if rows:
            _restore_keys(registry, *map(list, zip(*rows)))
    elif kind == "C":  # before protocol 2: keys, their region, offsets, their length
        _, names, region_id, offsets, length = record
        _restore_keys(registry, names, [region_id] * len(names), offsets, [length] * len(names))
    elif kind == "D":
        names = [key for key in record[1] if key in keys]
        registry._drop_keys(names, keys.get_many(names))
    elif kind in ("P", "U"):
        holder = record[1]
        if holder:
            registry.instances.setdefault(holder, Instance(holder))
        (registry.pins.pin if kind == "P" else registry.pins.unpin)(record[2], holder or None)
    elif kind == "X":  # the instance disconnected or was reaped
        inst = registry.instances.pop(record[1], None)
        if inst is not None:
            registry.pins.drop(inst)
    else:
        log.warning("ignoring unknown journal record %r", kind)


def _restore_keys(registry: Registry, *columns: list[Any]) -> None:
    """`_add_keys` for the keys of a snapshot or journal whose region still exists; `columns`:
    keys, region_ids, offsets, lengths[, checksums]."""
    regions = registry.regions
    if not all(r in regions for r in set(columns[1])):
        present = [r in regions for r in columns[1]]
        columns = tuple(list(compress(c, present)) for c in columns)
    registry._add_keys(*columns)
