"""A pure-Python model of the C key index (`maru.server._keyindex`), for tests only: the
oracle `test_keyindex.py` checks the C type against (random operations, batch calls, eviction's
walk), and Python key entries the cyclic GC tracks (`test_gc_freeze.py`). The same calls and
outcomes as the C type, slower; the server has only the C one."""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from operator import add, le
from typing import Any

import pytest

from maru.common.protocol import KEY_TYPES, pack_int64
from maru.server import holds, registry
from maru.server._keyindex import pack_record


class PyKeyEntry:
    """What the registry knows of one key (the model of the C `KeyEntry`)."""

    __slots__ = ("checksum", "leases", "length", "offset", "pins", "referenced", "region_id")

    def __init__(self, region_id: int, offset: int, length: int, checksum: int = 0):
        self.region_id = region_id  # where the bytes are: fixed once registered
        self.offset = offset
        self.length = length
        self.checksum = checksum  # the writer's checksum of the bytes (0: stored without one)
        self.pins = 0  # pinned keys are neither deleted nor evicted
        self.leases = 0  # readers copying these bytes right now: likewise
        # CLOCK bit: set by a lookup / exists hit, cleared when eviction spares the key. A hit
        # only sets it (no reordering of the key index: that costs cache misses at 10^6 keys).
        self.referenced = False

    @property
    def busy(self) -> bool:
        return self.pins > 0 or self.leases > 0


_MISS = PyKeyEntry(0, 0, 0)  # what a miss reads as: region 0 (ids start at 1), offset 0, length 0


def py_batch_fits(
    keys: Sequence[Any],
    max_chars: int,
    region_ids: Sequence[int],
    offsets: Sequence[int],
    lengths: Sequence[int],
    limits: dict[int, int],
) -> bool:
    """Whether a REGISTER_KV batch takes the registry's bulk path: at least one key, every key
    exactly str or bytes of 1..`max_chars` characters, every number an int, every value
    non-empty and inside its region (0 <= offset, offset + length <= limits[region id];
    `limits`: the lengths of the caller's writable regions). False only means "decide key
    by key". `batch_fits` is this in one C pass."""
    n = len(keys)
    if not n or not len(region_ids) == len(offsets) == len(lengths) == n:
        return False
    if not KEY_TYPES.issuperset(map(type, keys)) or not {
        *map(type, region_ids),
        *map(type, offsets),
        *map(type, lengths),
    } <= {int}:
        return False
    chars = list(map(len, keys))
    if min(chars) <= 0 or max(chars) > max_chars or min(lengths) <= 0 or min(offsets) < 0:
        return False
    if not set(region_ids) <= limits.keys():
        return False
    return all(map(le, map(add, offsets, lengths), map(limits.__getitem__, region_ids)))


def py_entry_locations(entries: Sequence[Any]) -> tuple[list[int], list[int], bytes]:
    """What `Registry._drop_keys` needs of the entries it drops: their region ids and lengths,
    and a (region_id, offset, length) notice each, packed as a reply's `freed`
    (`entry_locations` in C)."""
    notices = [[e.region_id, e.offset, e.length] for e in entries]
    packed = pack_int64([field for notice in notices for field in notice])
    return [n[0] for n in notices], [n[2] for n in notices], packed


def py_length_groups(
    region_ids: Sequence[int], lengths: Sequence[int]
) -> dict[int, dict[int, int]]:
    """{region id: {length: keys}}, regions in the order of their last key."""
    if len(region_ids) != len(lengths):
        raise ValueError("length_groups: columns differ in length")
    latest_first: dict[int, dict[int, int]] = {}
    for region_id, length in zip(reversed(region_ids), reversed(lengths)):
        if not isinstance(region_id, int) or not isinstance(length, int):
            raise TypeError("length_groups: ints only")
        group = latest_first.setdefault(region_id, {})
        group[length] = group.get(length, 0) + 1
    return dict(reversed(latest_first.items()))


def py_release_entries(entries: Iterable[Any]) -> None:
    """End one lease on each entry (never below zero)."""
    for entry in entries:
        if entry.leases > 0:
            entry.leases -= 1


class OrderedKeyIndex(OrderedDict):
    """The model of the C `KeyIndex`: an OrderedDict, oldest key first."""

    def __setitem__(self, key: Any, value: Any) -> None:
        raise TypeError("KeyIndex: keys are added with add_entries")

    def __contains__(self, key: object) -> bool:
        return type(key) in KEY_TYPES and super().__contains__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        return super().get(key, default) if type(key) in KEY_TYPES else default

    def get_many(self, keys: Sequence[Any]) -> list[Any]:
        return list(map(self.get, keys))

    def remove_many(self, keys: Sequence[Any]) -> None:
        """`del self[k]` for each key in order: KeyError at the first absent one (or one
        that is not a key), those before it removed."""
        for key in keys:
            if key not in self:
                raise KeyError(key)
            del self[key]

    def add_entries(
        self,
        keys: Sequence[Any],
        region_ids: Sequence[int],
        offsets: Sequence[int],
        lengths: Sequence[int],
        checksums: Sequence[int] | None,
        grouped: bool = False,
    ) -> Any:
        """A new entry for each absent key (the first of a batch wins): None when every key
        was new, else whether each was. TypeError / ValueError before any change. `grouped`:
        (that, `py_length_groups` of the new keys)."""
        columns = [region_ids, offsets, lengths, *([checksums] if checksums is not None else [])]
        if any(len(c) != len(keys) for c in columns):
            raise ValueError("add_entries: columns differ in length")
        if not set(map(type, keys)) <= KEY_TYPES:
            raise TypeError("KeyIndex keys are str or bytes")
        entries = list(map(PyKeyEntry, *columns))
        new = []
        for key, entry in zip(keys, entries):
            fresh = key not in self
            if fresh:
                OrderedDict.__setitem__(self, key, entry)
            new.append(fresh)
        if grouped:
            kept = [(r, n) for r, n, fresh in zip(region_ids, lengths, new) if fresh]
            return None if all(new) else new, py_length_groups(*zip(*kept) if kept else ([], []))
        return None if all(new) else new

    def lookup_columns(
        self, keys: Sequence[Any], lease: bool
    ) -> tuple[list[Any], bytes, bytes, bytes, bytes]:
        """A batch lookup: each hit's CLOCK bit set (and, with `lease`, one more lease); the
        hits' entries in key order, and region ids, offsets, lengths and checksums as bytes of
        native int64s (0 0 0 0 for a miss)."""
        entries = [self.get(key, _MISS) for key in keys]
        held = [e for e in entries if e is not _MISS]
        for entry in held:
            entry.referenced = True
            entry.leases += lease
        return (
            held,
            array("q", [e.region_id for e in entries]).tobytes(),
            array("q", [e.offset for e in entries]).tobytes(),
            array("q", [e.length for e in entries]).tobytes(),
            array("q", [e.checksum for e in entries]).tobytes(),
        )

    def clock_victims(
        self,
        want_bytes: int,
        second_chance: bool,
        protect: set[Any] | frozenset[Any] | None,
        regions: set[int] | frozenset[int] | None,
    ) -> tuple[list[Any], list[Any], int]:
        """Eviction's walk (CLOCK, `maru.server.eviction`): idle keys oldest first until
        `want_bytes` of them, as (keys, entries, bytes). Passed over: busy keys (pinned or
        leased), keys in `protect`, keys outside `regions` (None: any region). A key whose
        CLOCK bit is set is spared instead (bit cleared, moved to the newest end after the
        walk); when a walk takes too little and spared some, a second walk goes on (those
        keys now without the bit). `second_chance=False`: the bits are not looked at. Takes
        nothing out of the index: the caller drops the victims."""
        victims: dict[Any, Any] = {}
        freed = 0
        for second_pass in (False, True):
            spared = []
            taken = victims if second_pass else ()  # the first walk meets each key once
            for key, entry in self.items():
                if freed >= want_bytes:
                    break
                if (
                    entry.pins > 0
                    or entry.leases > 0
                    or (regions is not None and entry.region_id not in regions)
                    or (protect is not None and key in protect)
                    or key in taken
                ):
                    continue
                if entry.referenced and second_chance:
                    entry.referenced = False
                    spared.append(key)
                    continue
                victims[key] = entry
                freed += entry.length
            for key in spared:  # after the walk: the index must not change under its iterator
                self.move_to_end(key)
            if freed >= want_bytes or not spared:
                break
        return list(victims), list(victims.values()), freed

    def reclaim_order(self, regions: set[int] | frozenset[int]) -> list[int]:
        """The regions of `regions` a reclaim may empty, in the order eviction would reach
        them: by their first key without its CLOCK bit, then (all keys with it) by their
        first key; those with a busy key (pinned or leased) or no key left out."""
        idle: dict[int, None] = {}
        used: dict[int, None] = {}
        busy: set[int] = set()
        for entry in self.values():
            if entry.region_id in regions:
                (used if entry.referenced else idle).setdefault(entry.region_id, None)
                if entry.pins > 0 or entry.leases > 0:
                    busy.add(entry.region_id)
        return [r for r in [*idle, *(r for r in used if r not in idle)] if r not in busy]

    def items(self, *, reverse: bool = False) -> Iterator[tuple[Any, Any]]:  # type: ignore[override]
        return reversed(super().items()) if reverse else iter(super().items())

    def pack_rows(self) -> bytes:
        rows = [
            [k, e.region_id, e.offset, e.length, *([e.checksum] if e.checksum else [])]
            for k, e in self.items()
        ]
        return pack_record(rows)

    def pinned(self) -> list[tuple[Any, int]]:
        return [(k, e.pins) for k, e in self.items() if e.pins]


def use_python_key_index(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registries created from now on keep the model's index, entries and batch helpers."""
    monkeypatch.setattr(registry, "KeyIndex", OrderedKeyIndex)
    monkeypatch.setattr(registry, "KeyEntry", PyKeyEntry)
    monkeypatch.setattr(registry, "batch_fits", py_batch_fits)
    monkeypatch.setattr(registry, "entry_locations", py_entry_locations)
    monkeypatch.setattr(registry, "length_groups", py_length_groups)
    monkeypatch.setattr(holds, "release_entries", py_release_entries)
