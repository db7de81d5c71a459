"""Region lifecycles under random steps: a registry (real pool file, real journal, in-pool local
index, all under pytest's tmp_path) driven by a seeded random walk of the things clients,
housekeeping and operators do to it, with a model client per instance that writes only where
the server let it. After every step every invariant in `INVARIANTS` is checked; each says in
its docstring what it protects. The first rule behind them all: a hit is the bytes that were
written under that key, or it is a miss.

Step kinds (`STEPS`, weighted): handshake, request region (reclaiming or ahead of need),
return region, park, unpark, write (a batch of keys, sometimes with region tokens, sometimes
naming a region not the writer's), write an existing key again, delete, evict for room, take
a lease, release it, expire leases, pin, unpin, take a reply (freed pages, a fair-share ask
to shed), disconnect, silence and reap (held regions, `--reap-hold`), end holds, snapshot,
restart (the journal replayed into a new registry, clients handshaking again). Any journal
append may fail (a full state dir): the change is refused, and so are later ones until a
snapshot, as the service does (`CHANGES`, housekeeping).

Deterministic: seed N always takes the same steps. The default run (about 10 s on two cores) is
MARU_FUZZ_SEEDS=12 seeds of MARU_FUZZ_STEPS=500 steps; a long run raises them, e.g.
`MARU_FUZZ_SEEDS=300 MARU_FUZZ_STEPS=1000 pytest tests/unit/test_registry_lifecycle_fuzz.py`,
and MARU_FUZZ_FIRST_SEED=N starts the seeds at N (MARU_FUZZ_SEEDS=1 replays one). A failure
names the seed, the step and the steps before it.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import random
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import maru.client.localindex  # noqa: F401  (the shared table's Reader needs the client side)
from maru.common import shmindex
from maru.common.protocol import ErrorCode, ProtocolError, RegisterStatus, freed_notices
from maru.server import grants, holds, instances, persistence, regions
from maru.server.journal import SNAPSHOT_NAME, Journal, JournalWriteError, read_records
from maru.server.localindex import open_local_index
from maru.server.pool import ShmPool
from maru.server.registry import Registry
from maru.server.token import TokenSigner

from .registry_calls import lease, register

MiB = 1 << 20
CHUNK = 256 * 1024  # the model clients' page
POOL = 16 * MiB
HOLD = 5.0  # --reap-hold of the seeds that hold (the others: 0)
FIRST_SEED = int(os.environ.get("MARU_FUZZ_FIRST_SEED", "0"))
SEEDS = int(os.environ.get("MARU_FUZZ_SEEDS", "12"))
STEP_COUNT = int(os.environ.get("MARU_FUZZ_STEPS", "500"))
JOURNAL_FAILURE_RATE = 0.015  # of appends


class Clock:
    """The server's clocks, stopped but for the steps that let time pass (`end_holds`), so
    that a seed's walk does not depend on how fast it runs: monotonic and wall clock move
    together, as a hold replayed after a restart (kept as a wall-clock end) needs."""

    def __init__(self) -> None:
        self.skew = 0.0
        self._monotonic, self._time = time.monotonic(), time.time()

    def monotonic(self) -> float:
        return self._monotonic + self.skew

    def time(self) -> float:
        return self._time + self.skew


@contextlib.contextmanager
def server_clock(clock: Clock) -> Iterator[None]:
    """The registry's modules read `clock` for `time` while the walk runs."""
    modules = (grants, holds, instances, persistence, regions)
    fake = SimpleNamespace(monotonic=clock.monotonic, time=clock.time)
    saved = [(m, m.time) for m in modules]
    for module in modules:
        module.time = fake  # type: ignore[assignment]
    try:
        yield
    finally:
        for module, real in saved:
            module.time = real  # type: ignore[assignment]


class FullDiskJournal(Journal):
    """The real journal, whose appends fail now and then as on a full state dir: the torn
    record cut away and every later append refused until a snapshot (`Journal._write_failed`)."""

    def __init__(self, state_dir: Path, rnd: random.Random):
        super().__init__(state_dir, fsync_interval=3600.0)  # (no fsyncs between snapshots)
        self.rnd = rnd

    def append(self, record: Any) -> None:
        if self.write_error is None and self.rnd.random() < JOURNAL_FAILURE_RATE:
            exc = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self._write_failed(exc)
            raise JournalWriteError(self.state_dir, exc)
        super().append(record)


@dataclass
class ModelRegion:
    """A region as its client knows it."""

    length: int
    token: str
    free: set[int]  # chunks it may write into (never written, or told freed)
    parked: bool = False


@dataclass
class Client:
    """What an instance's client believes: the regions it may write, its free pages."""

    iid: str
    regions: dict[int, ModelRegion] = field(default_factory=dict)
    park_seq: int = 0
    alive: bool = True


@dataclass
class Grant:
    """A region request and what came of it, for `grants_keep_fair_shares`."""

    iid: str
    held: int  # its region bytes before
    least: int
    share: int  # the fair share, counted here
    others_wait: bool  # another instance below its share waited for returned regions
    reclaim: bool  # it may reclaim (not taken ahead of need)
    sheds_before: dict[str, int]
    length: int = 0  # granted (0: refused)
    code: int = 0  # the refusal's
    # a requester over its share: the parked regions with keys of others within theirs
    protected: set[int] = field(default_factory=set)


class World:
    """One seed's registry, its files, and the model clients."""

    def __init__(self, seed: int, tmp: Path, clock: Clock):
        self.seed, self.tmp, self.clock = seed, tmp, clock
        self.rnd = random.Random(seed)
        self.hold = self.rnd.choice([0.0, HOLD])
        self.state_dir = tmp / "state"
        self.clients: dict[str, Client] = {}
        self.leases: dict[int, dict[Any, tuple[int, int, int]]] = {}  # id -> key -> location
        self.names: list[str] = []  # every key name written so far
        self.protected: dict[int, tuple[int, int, float]] = {}  # held region -> place, until
        self.grant: Grant | None = None
        self.history: deque[str] = deque(maxlen=12)
        self.journal = FullDiskJournal(self.state_dir, self.rnd)
        self.journal.load()
        self.reg = self._registry(None, [])

    def _registry(self, snapshot: dict[str, Any] | None, records: list[Any]) -> Registry:
        """A registry as maru-server starts one: restored, compacted, its local index opened."""
        pool = ShmPool(str(self.tmp / "pool"), POOL, index_slots=4096)
        pool.generation = "fuzz"
        reg = Registry(
            pool,
            TokenSigner(b"f" * 32),
            journal=self.journal,
            high_watermark=0.9,
            low_watermark=0.6,
            reap_hold=self.hold,
        )
        persistence.restore(reg, snapshot, records)
        self.journal.write_snapshot(persistence.snapshot(reg))
        assert open_local_index(pool, reg) is not None
        _, offset, length, slots = pool.index_area
        self.index_map = shmindex.map_area(pool.path, offset, length)
        self.index_reader = shmindex.Reader(*shmindex.area_views(self.index_map, slots), False)
        return reg

    def close(self) -> None:
        if self.reg.local_index is not None:
            self.reg.local_index.close()
        self.reg.pool.close()
        self.journal.close()

    def refused(self) -> bool:
        """Whether the service refuses changes now: the journal cannot be written."""
        return not self.journal.writable

    def live(self) -> list[Client]:
        return [c for c in self.clients.values() if c.alive]

    def handshake_again(self, client: Client) -> None:
        """The client handshakes (its credential was voided, or the server restarted) and
        keeps only the regions the server lists as its own; gone from the server, it is a new
        instance (here: a client that ends)."""
        if client.iid not in self.reg.instances:
            client.alive = False
            return
        owned = {h.region_id for h in self.reg.instances.handshake(client.iid, 1)}
        self.reg.instances.open_session(client.iid)
        for region_id in list(client.regions):
            if region_id not in owned:
                del client.regions[region_id]

    def take_reply(self, client: Client) -> None:
        """A reply to `client`: the pages freed in its regions become free to it again; a
        fair-share ask to shed is answered by returning regions (it holds no unsealed value)."""
        reply: dict[str, Any] = {}
        self.reg.instances.hand_out(client.iid, reply)
        for region_id, offset, length in freed_notices(reply.get("freed", b"")):
            region = client.regions.get(region_id)
            if region is not None:
                region.free.update(range(offset // CHUNK, -(-(offset + length) // CHUNK)))
        shed = reply.get("shed", 0)
        for region_id in sorted(client.regions, key=lambda r: -client.regions[r].length):
            if shed <= 0 or self.refused():
                break
            shed -= client.regions[region_id].length
            give_back(self, client, region_id)


# -- steps: one function per kind; each changes the registry the way its actor does ---------


def handshake(w: World, client: Client | None) -> None:
    """A new instance connects (a reader until it asks for a region)."""
    iid = f"i{len(w.clients)}"
    w.reg.instances.handshake(iid, 1)
    w.reg.instances.open_session(iid)
    w.clients[iid] = Client(iid)


def request_region(w: World, client: Client) -> None:
    """REQUEST_REGION: usually reclaiming idle regions when the pool is full, sometimes ahead
    of need (nothing reclaimed); the outcome is kept for `grants_keep_fair_shares`."""
    if w.refused():
        return
    reg = w.reg
    inst = reg.instances[client.iid]
    size = w.rnd.choice([2, 4]) * MiB
    inst.writer = True  # (what the request does first: the share counts it)
    writers = sum(1 for i in reg.instances.values() if i.writer or i.regions)
    share = max(POOL // writers, min(reg.pool.alignment, POOL))
    now = w.clock.monotonic()
    grant = Grant(
        client.iid,
        held=region_bytes(reg, client.iid),
        least=size,
        share=share,
        others_wait=any(
            until > now and i != client.iid and i in reg.instances
            for i, until in reg.grants.wanting.items()
        ),
        reclaim=w.rnd.random() < 0.8,
        sheds_before={i.instance_id: i.shed for i in reg.instances.values()},
    )
    over = grant.held + grant.least > share
    if (over and any(reg.regions[r].length >= size for r in inst.regions)) or (
        not over  # (below its share: those over theirs pay, or are asked to)
        and any(region_bytes(reg, i) > share for i in reg.instances if i != client.iid)
    ):
        grant.protected = {
            r.region_id
            for r in reg.regions.values()
            if r.parked
            and not r.returned
            and r.live_keys
            and r.owner != client.iid
            and r.owner in reg.instances
            and region_bytes(reg, r.owner) <= share
        }
    w.grant = grant
    try:
        handle = reg.request_region(client.iid, size, reclaim=grant.reclaim)
    except ProtocolError as exc:
        grant.code = exc.code
        raise
    grant.length = handle.length
    chunks = set(range(handle.length // CHUNK))
    client.regions[handle.region_id] = ModelRegion(handle.length, handle.token, chunks)


def region_bytes(reg: Registry, iid: str) -> int:
    return sum(reg.regions[r].length for r in reg.instances[iid].regions)


def return_region(w: World, client: Client) -> None:
    """RETURN_REGION of one of its regions; it writes there no more."""
    if client.regions and not w.refused():
        give_back(w, client, w.rnd.choice(sorted(client.regions)))


def give_back(w: World, client: Client, region_id: int) -> None:
    token = client.regions.pop(region_id).token  # (even if the reply is an error)
    w.reg.return_region(client.iid, region_id, token)


def park(w: World, client: Client) -> None:
    """PARK_REGIONS: an idle client parks a region (it writes there no more until unparked)."""
    if client.regions:
        client.regions[w.rnd.choice(sorted(client.regions))].parked = True
        parked = [r for r, m in client.regions.items() if m.parked]
        send_park(w, client, parked, [])


def unpark(w: World, client: Client) -> None:
    """PARK_REGIONS unparking every parked region; it writes only in those unparked."""
    parked = [r for r, m in client.regions.items() if m.parked]
    if parked:
        for region_id in send_park(w, client, [], parked):
            client.regions[region_id].parked = False


def send_park(w: World, client: Client, park: list[int], unpark: list[int]) -> list[int]:
    client.park_seq += 1
    unparked, gone = w.reg.park(client.iid, client.park_seq, park, unpark)
    for region_id in gone:  # taken back while parked
        client.regions.pop(region_id, None)
    return unparked


def write(w: World, client: Client, again: bool = False) -> None:
    """REGISTER_KV of a batch of 1-3 keys, each in a free chunk of an unparked region (`again`:
    names already registered, which must come back EXISTS); now and then a row in a region not
    its own, which must come back REJECTED. A chunk whose key was not REGISTERED (or whose
    request failed) is free to the client again: that is what an error reply lets it do."""
    if w.refused():
        return
    w.take_reply(client)
    rows, chunks = [], []
    for _ in range(w.rnd.randint(1, 3)):
        spaces = [(r, m) for r, m in sorted(client.regions.items()) if not m.parked and m.free]
        if not spaces:
            break
        region_id, space = w.rnd.choice(spaces)
        chunk = w.rnd.choice(sorted(space.free))
        space.free.discard(chunk)
        if again and w.reg.keys:
            name = w.rnd.choice(sorted(k for k in w.reg.keys))
        else:
            name = f"k{len(w.names)}"
            w.names.append(name)
        length = CHUNK - w.rnd.choice([0, 100, CHUNK // 2])
        rows.append([name, region_id, chunk * CHUNK, length])
        chunks.append(space.free)
    if not rows:
        return
    foreign = [r for r in w.reg.regions if w.reg.regions.writable(r, client.iid) is None]
    if foreign and w.rnd.random() < 0.1:
        rows.append([f"x{len(w.names)}", w.rnd.choice(foreign), 0, CHUNK])
        chunks.append(set())
    statuses: list[int] = [RegisterStatus.REJECTED] * len(rows)
    try:
        if w.rnd.random() < 0.5:
            statuses = register(w.reg, client.iid, rows)
        else:  # with the tokens of the regions as granted
            keys, region_ids, offsets, lengths = (list(c) for c in zip(*rows))
            tokens = {r: m.token for r, m in client.regions.items()}
            statuses = w.reg.register(client.iid, keys, region_ids, offsets, lengths, None, tokens)
    finally:
        for (_, _, offset, _), status, free in zip(rows, statuses, chunks):
            if status != RegisterStatus.REGISTERED:
                free.add(offset // CHUNK)
    if rows[-1][0].startswith("x"):
        assert statuses[-1] == RegisterStatus.REJECTED, (rows[-1], statuses)


def write_again(w: World, client: Client) -> None:
    """REGISTER_KV of names registered already (the first writer wins)."""
    write(w, client, again=True)


def delete(w: World, client: Client) -> None:
    """DELETE_KV of up to 3 keys (a pinned or leased one stays)."""
    if w.reg.keys and not w.refused():
        keys = sorted(w.reg.keys)
        w.reg.delete(w.rnd.sample(keys, min(3, len(keys))))


def evict_for(w: World, client: Client) -> None:
    """EVICT_FOR: room in the client's own regions, some of it ahead of need."""
    if not w.refused():
        want = w.rnd.choice([1, 2, 4]) * CHUNK
        w.reg.eviction.evict_for(client.iid, want, ahead=w.rnd.choice([0, want // 2]))


def take_lease(w: World, client: Client) -> None:
    """LOOKUP_KV with a lease: the hits' places are kept, for `leases_keep_keys_in_place`."""
    if w.reg.keys:
        keys = w.rnd.sample(sorted(w.reg.keys), min(2, len(w.reg.keys)))
        lease_id = lease(w.reg, keys, client.iid)
        if lease_id:
            entries = dict(zip(keys, w.reg.keys.get_many(keys)))
            w.leases[lease_id] = {
                k: (e.region_id, e.offset, e.length) for k, e in entries.items() if e is not None
            }


def release(w: World, client: Client) -> None:
    """RELEASE of one of the client's leases."""
    mine = sorted(lid for lid in w.leases if lid in w.reg.instances[client.iid].leases)
    if mine:
        lease_id = w.rnd.choice(mine)
        w.reg.leases.release([lease_id], client.iid)


def expire_leases(w: World, client: Client) -> None:
    """Housekeeping: the leases' time passes (a reader that crashed mid-copy)."""
    w.reg.leases.expire(w.clock.monotonic() + w.reg.leases.seconds + 1)


def pin(w: World, client: Client) -> None:
    """PIN of a key."""
    if w.reg.keys and not w.refused():
        w.reg.pins.pin(w.rnd.sample(sorted(w.reg.keys), 1), client.iid)


def unpin(w: World, client: Client) -> None:
    """UNPIN of one of the client's pins."""
    pins = w.reg.instances[client.iid].pins
    if pins and not w.refused():
        w.reg.pins.unpin([w.rnd.choice(sorted(pins))], client.iid)


def take_reply(w: World, client: Client) -> None:
    """A reply reaches the client: freed pages, a fair-share ask (`World.take_reply`)."""
    w.take_reply(client)


def disconnect(w: World, client: Client) -> None:
    """DISCONNECT: the instance ends; its keys stay readable until their regions' keys go."""
    if not w.refused():
        w.reg.instances.disconnect(client.iid)
        client.alive = False


def reap(w: World, client: Client) -> None:
    """The client falls silent past the heartbeat timeout and housekeeping reaps it. Its
    process may only be paused: with a hold, its regions are protected (`held_regions_stay`)
    until the hold ends, as it may still write there. A reap half done (the journal failed)
    voids its credential; it handshakes again (`World.handshake_again`)."""
    if w.refused():  # (housekeeping reaps only while the journal can be written)
        return
    w.reg.instances[client.iid].last_seen -= 100
    until = w.clock.monotonic() + w.hold
    places = {  # (any instance silent before, its reap half done, goes too)
        r: (w.reg.regions[r].offset, w.reg.regions[r].length)
        for inst in w.reg.instances.values()
        for r in inst.regions
    }
    try:
        gone = w.reg.instances.reap(10.0)
    finally:
        if w.hold:
            for region_id, (offset, length) in places.items():
                region = w.reg.regions.get(region_id)
                if region is not None and region.returned:
                    w.protected[region_id] = (offset, length, until)
    for iid in gone:
        if iid in w.clients:
            w.clients[iid].alive = False


def end_holds(w: World, client: Client) -> None:
    """Housekeeping ends the holds that passed, now or 10 s on (past `HOLD`)."""
    w.clock.skew += w.rnd.choice([0.0, 10.0])
    now = w.clock.monotonic()
    w.reg.regions.end_holds(now)
    for region_id, (_, _, until) in list(w.protected.items()):
        if until <= now:
            del w.protected[region_id]


def snapshot(w: World, client: Client) -> None:
    """Housekeeping writes a snapshot (the journal is rotated; after a failed append, the way
    back to accepting changes)."""
    w.journal.write_snapshot(persistence.snapshot(w.reg))


def restart(w: World, client: Client) -> None:
    """maru-server restarts: the snapshot and journal on disk replayed into a new registry;
    leases end; every client handshakes again (one whose instance is gone ends)."""
    w.close()
    w.journal = FullDiskJournal(w.state_dir, w.rnd)
    w.reg = w._registry(*w.journal.load())
    w.leases.clear()
    for c in w.live():
        w.handshake_again(c)


Step = Callable[[World, Any], None]
STEPS: list[tuple[Step, int]] = [
    (handshake, 2),
    (request_region, 4),
    (return_region, 2),
    (park, 2),
    (unpark, 2),
    (write, 8),
    (write_again, 1),
    (delete, 2),
    (evict_for, 2),
    (take_lease, 2),
    (release, 2),
    (expire_leases, 1),
    (pin, 1),
    (unpin, 1),
    (take_reply, 2),
    (disconnect, 1),
    (reap, 1),
    (end_holds, 1),
    (snapshot, 1),
    (restart, 1),
]


# -- invariants: each protects a rule; all are checked after every step ---------------------


def chunks_of(offset: int, length: int) -> range:
    return range(offset // CHUNK, -(-(offset + length) // CHUNK))


def live_pages(reg: Registry) -> dict[int, Any]:
    """Pool page (a chunk's offset in the pool) -> the live key in it."""
    pages: dict[int, Any] = {}
    for key, entry in reg.keys.items():
        base = reg.regions[entry.region_id].offset
        for chunk in chunks_of(entry.offset, entry.length):
            pages[base + chunk * CHUNK] = key
    return pages


def regions_disjoint(w: World) -> None:
    """No two regions share pool bytes, and each lies in the pool: two owners writing the same
    bytes would serve each other's keys."""
    spans = sorted((r.offset, r.offset + r.length, r.region_id) for r in w.reg.regions.values())
    for a, b in itertools.pairwise(spans):
        assert a[1] <= b[0], f"regions overlap: {a} {b}"
    assert not spans or spans[-1][1] <= POOL, spans[-1]


def keys_in_their_regions(w: World) -> None:
    """Every key points inside a region that still exists (deferred free: a region goes back
    to the pool only with its last key, else a reader maps bytes handed out again), and the
    region's key count, which decides that free, counts exactly its keys."""
    counts: Counter[int] = Counter()
    nbytes = 0
    for key, entry in w.reg.keys.items():
        region = w.reg.regions.get(entry.region_id)
        assert region is not None, f"key {key!r} in region {entry.region_id}, which is freed"
        assert entry.offset >= 0 and entry.offset + entry.length <= region.length, key
        counts[entry.region_id] += 1
        nbytes += entry.length
    for region in w.reg.regions.values():
        assert region.live_keys == counts[region.region_id], (region, counts[region.region_id])
    assert w.reg.live_bytes == nbytes, (w.reg.live_bytes, nbytes)


def keys_disjoint(w: World) -> None:
    """No two live keys share a page: a write of one would change the other's bytes."""
    pages: dict[int, Any] = {}
    for key, entry in w.reg.keys.items():
        base = w.reg.regions[entry.region_id].offset
        for chunk in chunks_of(entry.offset, entry.length):
            other = pages.setdefault(base + chunk * CHUNK, key)
            assert other == key, f"keys {other!r} and {key!r} share a page"


def notices_clear_of_live_keys(w: World) -> None:
    """No pending freed notice covers a live key's page: its owner, told, would write there."""
    pages = live_pages(w.reg)
    for inst in w.reg.instances.values():
        for region_id, offset, length in freed_notices(bytes(inst.freed)):
            region = w.reg.regions.get(region_id)
            for chunk in chunks_of(offset, length) if region is not None else ():
                key = pages.get(region.offset + chunk * CHUNK)
                assert key is None, (
                    f"{inst.instance_id} told region {region_id} chunk {chunk} free under {key!r}"
                )


def client_pages_clear_of_live_keys(w: World) -> None:
    """No page a client holds free (never written, or told freed) lies under a live key: the
    client writes its next value there."""
    pages = live_pages(w.reg)
    for client in w.live():
        for region_id, space in client.regions.items():
            region = w.reg.regions.get(region_id)
            if region is None or region.owner != client.iid:
                continue  # (not writable: `writable_regions_are_own`)
            for chunk in space.free:
                key = pages.get(region.offset + chunk * CHUNK)
                assert key is None, (
                    f"{client.iid} may write region {region_id} chunk {chunk} under {key!r}"
                )


def writable_regions_are_own(w: World) -> None:
    """Every region a live client may write in (held, not parked) is its own, live region
    that the server counts as its; and the server's count of an instance's regions holds
    only its own live ones. A client writing in a region given back (or taken, or handed to
    another) overwrites keys the server serves."""
    for inst in w.reg.instances.values():
        for region_id in inst.regions:
            region = w.reg.regions.get(region_id)
            assert region is not None and region.owner == inst.instance_id, region_id
            assert not region.returned, f"{inst.instance_id} counts returned region {region_id}"
    sessions = w.reg.instances.sessions
    for client in w.live():
        if w.reg.signer.session(client.iid) not in sessions:
            continue  # (its credential is void: it must handshake before it writes again)
        inst = w.reg.instances.get(client.iid)
        for region_id, space in client.regions.items():
            if space.parked:
                continue
            region = w.reg.regions.get(region_id)
            assert inst is not None and region_id in inst.regions, (client.iid, region_id)
            assert region is not None and region.owner == client.iid, (client.iid, region_id)
            assert not region.returned, f"{client.iid} may write returned region {region_id}"


def held_regions_stay(w: World) -> None:
    """A region of an instance reaped for silence, under `--reap-hold`, keeps its pool bytes
    out of use until the hold ends: the process may only be paused and write there when it
    resumes."""
    for region_id, (offset, length, _) in w.protected.items():
        region = w.reg.regions.get(region_id)
        assert region is not None, f"held region {region_id} freed before its hold ended"
        assert (region.offset, region.length) == (offset, length), region_id
        for other in w.reg.regions.values():
            if other.region_id != region_id:
                assert not (other.offset < offset + length and offset < other.offset + other.length)


def holds_keep_keys(w: World) -> None:
    """A pinned key is not dropped (the client asked that it stay) and its pin counts agree
    with its holders' (an instance's pins go with it); a leased key stays at the place the
    lease found it until the lease ends (a reader is copying those bytes)."""
    held: Counter[Any] = Counter()
    for inst in w.reg.instances.values():
        for key, count in inst.pins.items():
            assert key in w.reg.keys, f"{inst.instance_id}'s pinned key {key!r} was dropped"
            held[key] += count
        assert inst.pin_count == sum(inst.pins.values()), inst.instance_id  # (STATS's "pins")
    for key, entry in w.reg.keys.items():
        assert entry.pins == held[key], (key, entry.pins, held[key])
    for lease_id, places in w.leases.items():
        if lease_id not in w.reg.leases:
            continue  # (ended: released, expired, or its owner gone)
        for key, place in places.items():
            entry = w.reg.keys.get(key)
            assert entry is not None, f"leased key {key!r} dropped under lease {lease_id}"
            assert (entry.region_id, entry.offset, entry.length) == place, key


def local_index_matches_keys(w: World) -> None:
    """The in-pool local index holds exactly the live keys, at their places: a reader on the
    node finds keys there without asking, so a key left in it after it went points at pages
    that may hold another key's bytes by now."""
    reader, keys = w.index_reader, w.reg.keys
    if w.names:
        found = reader.contains(w.names)
        stale = [k for k, hit in zip(w.names, found) if hit and k not in keys]
        missing = [k for k, hit in zip(w.names, found) if not hit and k in keys]
        assert not stale, f"the local index still holds {stale[:5]}"
        assert not missing, f"the local index lacks {missing[:5]}"
    live = sorted(keys)
    if live:
        rows = [
            [r.region_id, 0, r.length, shmindex.region_tag(r.token)] for r in w.reg.regions.values()
        ]
        raw = reader.probe(live, np.array(rows, np.int64).reshape(-1, 4))
        assert raw is not None
        cols = np.frombuffer(raw, np.int64).reshape(shmindex.NCOLS, len(live))
        for key, entry, length, region_id, offset in zip(
            live, keys.get_many(live), cols[1], cols[3], cols[4]
        ):
            place = (int(region_id), int(offset), int(length))
            assert place == (entry.region_id, entry.offset, entry.length), (key, place)


def journal_replays_to_live_state(w: World) -> None:
    """The snapshot and journal on disk, replayed, give the live keys and regions: what a
    restart serves is what was acknowledged (a change is journaled before it is answered),
    and no region freed live comes back under keys (nor a deleted key)."""
    snap_path = w.state_dir / SNAPSHOT_NAME
    snap = read_records(snap_path.read_bytes())[0][0] if snap_path.exists() else None
    path = w.state_dir / f"journal-{w.journal.generation}.log"
    records = read_records(path.read_bytes())[0] if path.exists() else []
    replay = Registry(ShmPool(str(w.tmp / "replay-pool"), POOL), TokenSigner(b"f" * 32))
    persistence.restore(replay, snap, records)
    assert keys_of(replay) == keys_of(w.reg), keys_of(replay) ^ keys_of(w.reg)
    assert regions_of(replay) == regions_of(w.reg), regions_of(replay) ^ regions_of(w.reg)


def keys_of(reg: Registry) -> set[tuple[Any, ...]]:
    return {(k, e.region_id, e.offset, e.length, e.pins) for k, e in reg.keys.items()}


def regions_of(reg: Registry) -> set[tuple[Any, ...]]:
    return {(r.region_id, r.owner, r.offset, r.length, r.returned) for r in reg.regions.values()}


def grants_keep_fair_shares(w: World) -> None:
    """A request's outcome keeps fair shares (counted here: the pool over the writers, the
    instances that hold or asked for regions): while another instance below its share waits
    for regions given back, none is granted past its share; one below its share that may
    reclaim is not refused POOL_FULL while another still holds more than its share (that one
    is asked to shed: POOL_RECLAIMING); one refused POOL_RECLAIMING was below its share, and
    every instance newly asked to shed holds more than the share; one over its share, with a
    region as large as it asks, or one below it while another is over, took no parked region
    with keys of an instance within its own. Else one instance keeps most of the pool while
    others get nothing, or one within its share gives back (evicting its keys) what nobody
    is owed."""
    grant, w.grant = w.grant, None
    if grant is None:
        return
    below = grant.held + grant.least <= grant.share
    if grant.length and grant.others_wait:
        assert grant.held + grant.length <= grant.share, grant
    if grant.code == ErrorCode.POOL_FULL and grant.reclaim and below and not grant.others_wait:
        over = [
            i for i in w.reg.instances if i != grant.iid and region_bytes(w.reg, i) > grant.share
        ]
        assert not over, f"refused POOL_FULL while {over} hold more than the share: {grant}"
    if grant.code == ErrorCode.POOL_RECLAIMING:
        assert below, grant
    taken = [r for r in grant.protected if r not in w.reg.regions or w.reg.regions[r].returned]
    assert not taken, f"over its share, took regions {taken} of instances within theirs: {grant}"
    for inst in w.reg.instances.values():
        if inst.shed > grant.sheds_before.get(inst.instance_id, 0):
            held = region_bytes(w.reg, inst.instance_id)
            assert held > grant.share, (inst.instance_id, held, grant)


INVARIANTS: list[Callable[[World], None]] = [
    regions_disjoint,
    keys_in_their_regions,
    keys_disjoint,
    notices_clear_of_live_keys,
    client_pages_clear_of_live_keys,
    writable_regions_are_own,
    held_regions_stay,
    holds_keep_keys,
    local_index_matches_keys,
    journal_replays_to_live_state,
    grants_keep_fair_shares,
]


def run(seed: int, tmp: Path, steps: int) -> World:
    """`steps` random steps of seed `seed`, every invariant checked after each."""
    clock = Clock()
    with server_clock(clock):
        w = World(seed, tmp, clock)
        try:
            for n in range(steps):
                take_step(w, n)
        finally:
            w.close()
    return w


def take_step(w: World, n: int) -> None:
    """Step `n`: a random kind, by a random live client; then what follows any reply (a
    voided credential makes its client handshake again; after a failed append housekeeping
    soon writes a snapshot); then every invariant."""
    kinds, weights = zip(*STEPS)
    step = w.rnd.choices(kinds, weights)[0]
    live = w.live()
    client = w.rnd.choice(live) if live else None
    if client is None:
        step = handshake
    w.history.append(f"{n}: {step.__name__} {client.iid if client else ''}")
    with contextlib.suppress(ProtocolError, JournalWriteError), named(w, n, step.__name__):
        step(w, client)  # (refused: the client was told so)
    for c in w.live():
        if w.reg.signer.session(c.iid) not in w.reg.instances.sessions:
            w.handshake_again(c)
    if w.refused() and w.rnd.random() < 0.5:
        snapshot(w, None)
    for invariant in INVARIANTS:
        with named(w, n, invariant.__name__):
            invariant(w)


@contextlib.contextmanager
def named(w: World, n: int, what: str) -> Iterator[None]:
    """An assertion that fails names the seed, the step, and the steps before it."""
    try:
        yield
    except AssertionError as exc:
        steps_before = "\n  ".join(w.history)
        raise AssertionError(
            f"seed {w.seed}, {what} broken at step {n}:\n  {steps_before}\n{exc}"
        ) from exc


@pytest.mark.parametrize("seed", range(FIRST_SEED, FIRST_SEED + SEEDS))
def test_region_lifecycles_keep_every_invariant(seed: int, tmp_path: Path) -> None:
    w = run(seed, tmp_path, STEP_COUNT)
    assert w.names  # (the walk wrote keys)
