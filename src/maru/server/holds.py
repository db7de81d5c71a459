"""Holds on keys: pins and read leases, what keeps a key from eviction and deletion.

Both count on the key's entry (`KeyEntry.busy`) and by holder, so an instance's holds go with
it. A pin (a client asks that a key stay) is journaled: it outlives a restart. A lease holds
the entries a LOOKUP_KV reader is copying (a key dropped and registered again is a new entry,
untouched by the old lease); it ends by RELEASE or expiry (a crashed reader cannot hold keys
forever), and is not journaled: no read outlives a restart.
"""

from __future__ import annotations

import heapq
import itertools
import secrets
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from maru.common.protocol import MAX_BATCH, Key
from maru.server.keyindex import KeyEntry, KeyIndex, release_entries

if TYPE_CHECKING:
    from maru.server.instances import Instance


# Keys one instance may pin at once (`Pins.room`): each an entry of its own, of every
# snapshot, and a key eviction cannot take. A client pins the hits it is loading, then
# unpins them: a few batches.
MAX_PINNED_KEYS = 4 * MAX_BATCH
# Keys one instance may hold under leases at once, however few bytes they hold (each lease
# keeps a reference per key until released or expired): `--quota-leases` leases of
# MAX_BATCH keys each were 268 million references.
MAX_LEASED_KEYS = 16 * MAX_BATCH


class Pins:
    """Pin counts on entries, and per instance (`Instance.pins`); changes journaled "P"/"U"/"X"."""

    def __init__(self, keys: KeyIndex, instances: dict[str, Instance], log: Callable[..., None]):
        self.keys = keys
        self.instances = instances
        self._log = log  # the registry's journal writer
        self.max_keys = MAX_PINNED_KEYS
        # Bytes of keys one instance may pin at once (`--quota-pin-bytes`; 0: no quota): a
        # pinned key is never evicted, and any instance may pin any key.
        self.max_bytes = 0
        # The instances' `pin_bytes` together, kept as they change (STATS reads it in O(1)).
        self.bytes = 0

    def admit(
        self, keys: list[Any], owner: str, leading: bool = False
    ) -> tuple[str, int, int, int] | None:
        """None if `owner` may pin `keys` within `max_keys` and `max_bytes`; else what is over,
        ("keys" or "bytes", held now, asked new, the bound), the count checked first. Counted
        as if every key were pinned for the count, as `pin` would take them for the bytes
        (each key once, none it pins already, with `leading` none after the first miss). A
        request's check (a PIN is refused whole, before any side effect), not the journal
        replay's: one pass over the keys for both (with one C lookup when bytes count), none
        when no byte quota is set and the batch fits the count however many it pins already."""
        inst = self.instances.get(owner)
        if inst is None:
            return None
        pinned, max_keys, max_bytes = inst.pins, self.max_keys, self.max_bytes
        if len(pinned) + len(keys) <= max_keys and not max_bytes:
            return None
        entries = self.keys.get_many(keys) if max_bytes else itertools.repeat(None)
        seen: set[Any] = set()
        new = nbytes = 0
        counting = bool(max_bytes)  # (bytes: until the first miss, with `leading`)
        for key, entry in zip(keys, entries):
            if entry is None and leading:
                counting = False
            if key in pinned or key in seen:
                continue
            seen.add(key)
            new += 1
            if counting and entry is not None:
                nbytes += entry.length
        if len(pinned) + new > max_keys:
            return "keys", len(pinned), new, max_keys
        if max_bytes and inst.pin_bytes + nbytes > max_bytes:
            return "bytes", inst.pin_bytes, nbytes, max_bytes
        return None

    def pin(self, keys: list[Any], owner: str | None = None, leading: bool = False) -> list[bool]:
        """Pin the keys that exist; with `leading`, only the run of them from the start, up to
        the first miss (the hits a prefix lookup uses, all its caller will unpin: a key after
        a miss is neither pinned nor reported True). Journal first: if the "P" record (the
        pinned keys) cannot be written (`JournalWriteError`), no pin is taken."""
        return self._change(keys, owner, 1, leading)

    def unpin(self, keys: list[Any], owner: str | None = None) -> list[bool]:
        """Drop one pin per key (an instance only its own). Journal first ("U"), as `pin`."""
        return self._change(keys, owner, -1)

    def _change(
        self, keys: list[Any], owner: str | None, sign: int, leading: bool = False
    ) -> list[bool]:
        """Decide each key's outcome (an unpin needs a pin left after this batch's earlier
        unpins of the key, `taken`; with `leading`, none after the first miss), journal the
        changes, then apply them."""
        inst = self.instances.get(owner) if owner else None
        out = []
        changed: list[Key] = []
        entries: list[KeyEntry] = []
        taken: Counter = Counter()
        missed = False
        for key in keys:
            # None for a miss, or a key that is not str or bytes
            entry = None if missed else self.keys.get(key)
            ok = entry is not None
            missed = leading and not ok
            if ok and sign < 0:  # an instance can only drop pins it holds
                ok = entry.pins > taken[key] and (inst is None or inst.pins[key] > taken[key])
                taken[key] += ok
            if ok:
                changed.append(key)
                entries.append(entry)
            out.append(ok)
        if changed:
            self._log("P" if sign > 0 else "U", owner if inst is not None else "", changed)
        before = inst.pin_bytes if inst is not None else 0
        for key, entry in zip(changed, entries):
            entry.pins += sign
            if inst is not None:  # (its `pin_bytes`: each key's bytes once, while pinned)
                count = inst.pins[key]
                if not count:
                    inst.pin_bytes += entry.length
                inst.pins[key] = count + sign
                inst.pin_count += sign
                if count + sign == 0:
                    del inst.pins[key]
                    inst.pin_bytes = inst.pin_bytes - entry.length if inst.pins else 0
        if inst is not None:
            self.bytes += inst.pin_bytes - before
        return out

    def drop(self, inst: Instance) -> int:
        """Release every pin of an instance that is gone (disconnected or reaped); how many.
        Journal first ("X"); its pins are cleared, so a second call changes nothing."""
        if not inst.pins:
            return 0
        self._log("X", inst.instance_id)
        for key, count in inst.pins.items():
            entry = self.keys.get(key)
            if entry is not None:
                entry.pins = max(0, entry.pins - count)
        dropped, inst.pin_count = inst.pin_count, 0
        inst.pins.clear()
        self.bytes -= inst.pin_bytes
        inst.pin_bytes = 0
        return dropped

    def records(self) -> list[list[Any]]:
        """[holder, key, count] per pin, for a snapshot (holder "": taken without an instance)."""
        held: Counter = Counter()
        records = []
        for inst in self.instances.values():
            for key, count in inst.pins.items():
                records.append([inst.instance_id, key, count])
                held[key] += count
        for key, pins in self.keys.pinned():  # (in C: no Python pass over every key)
            if pins > held[key]:
                records.append(["", key, pins - held[key]])
        return records


# Ended leases' expiries the heap may keep beyond twice the live leases (then it is compacted:
# at most one pass per this many leases taken)
COMPACT_SLACK = 1024


@dataclass
class Lease:
    owner: str | None
    entries: list[KeyEntry]
    nbytes: int = 0  # the keys' bytes, counted in the owner's `lease_bytes`


class LeaseTable(dict[int, Lease]):
    """Lease id -> Lease, with the expiry heap; the owner's `Instance.leases` (the ids to end
    when it goes) is kept in step."""

    def __init__(self, instances: dict[str, Instance], seconds: float, counters: dict[str, int]):
        super().__init__()
        self.instances = instances
        self.seconds = seconds  # a lease's life (--lease-timeout)
        self.counters = counters
        self.max_keys = MAX_LEASED_KEYS  # (`room`)
        # The owners' `lease_bytes` together, kept as leases come and go (STATS, in O(1)).
        self.bytes = 0
        self._expiry: list[tuple[float, int]] = []  # heap of (expires, lease_id)
        # Ids start at a random point, so that a lease id from before a server restart (a
        # reader confirming a copy it began then) never names a lease taken since.
        self.first_id = secrets.randbits(48) + 1
        self._ids = itertools.count(self.first_id)

    def add(self, held: list[KeyEntry], owner: str | None, nbytes: int = 0) -> int:
        """A lease on `held` (`nbytes` of keys); the caller already raised their lease counts."""
        lease_id = next(self._ids)
        self[lease_id] = Lease(owner, held, nbytes)
        if len(self._expiry) > 2 * len(self) + COMPACT_SLACK:
            # Leases ended early (RELEASE, a departing owner) leave their expiry here until
            # its time: drop them, else the heap holds every lease of the last --lease-timeout
            self._expiry = [item for item in self._expiry if item[1] in self]
            heapq.heapify(self._expiry)
        heapq.heappush(self._expiry, (time.monotonic() + self.seconds, lease_id))
        inst = self.instances.get(owner) if owner else None
        if inst is not None:
            inst.leases.add(lease_id)
            inst.lease_bytes += nbytes
            inst.lease_keys += len(held)
            self.bytes += nbytes
        return lease_id

    def room(self, owner: str | None, nkeys: int) -> int | None:
        """None if `owner` may lease `nkeys` more keys within `max_keys` (an O(1) check, as
        if each were a hit); else the keys its leases hold now."""
        inst = self.instances.get(owner) if owner else None
        if inst is None or inst.lease_keys + nkeys <= self.max_keys:
            return None
        return inst.lease_keys

    def end(self, lease_id: int) -> bool:
        lease = self.pop(lease_id, None)
        if lease is None:
            return False
        release_entries(lease.entries)
        inst = self.instances.get(lease.owner) if lease.owner else None
        if inst is not None:
            inst.leases.discard(lease_id)
            inst.lease_bytes -= lease.nbytes
            inst.lease_keys -= len(lease.entries)
            self.bytes -= lease.nbytes
        return True

    def release(self, lease_ids: list[Any], owner: str | None) -> int:
        """RELEASE by `owner`: how many leases it ended. Only the instance that took a lease ends
        it (ids are sequential: a stray RELEASE must not let another reader's pages be evicted
        mid-copy); one taken without an instance id, anyone."""
        ended = 0
        for lease_id in lease_ids:
            lease = self.get(lease_id) if type(lease_id) is int else None  # not a bool
            if lease is not None and lease.owner is not None and lease.owner != owner:
                self.counters["releases_refused"] += 1
            elif lease is not None:
                ended += self.end(lease_id)
        return ended

    def expire(self, now: float) -> int:
        expired = 0
        while self._expiry and self._expiry[0][0] <= now:
            _, lease_id = heapq.heappop(self._expiry)
            expired += self.end(lease_id)
        self.counters["leases_expired"] += expired
        return expired
