"""Registry persistence: the checksummed journal, snapshot generations, `persistence.restore`, and
the pool identity check that keeps persisted locations from pointing into another pool."""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path

import msgpack
import pytest

from maru.common.protocol import CHECKSUMS, RegisterStatus
from maru.server import persistence
from maru.server.journal import (
    FRAME,
    SNAPSHOT_NAME,
    Journal,
    _frame,
    next_intact_frame,
    read_records,
)
from maru.server.pool import ShmPool
from maru.server.registry import Registry
from maru.server.state_dir import (
    POOL_IDENTITY,
    discard_state,
    pool_generation,
    same_pool_as_before,
)
from maru.server.token import TokenSigner

from .registry_calls import register

KiB, MiB = 1 << 10, 1 << 20
SIGNER = TokenSigner(b"j" * 32)


class Env:
    """A state dir and a pool file, opened again (as a restarted server would) by `open()`."""

    def __init__(self, tmp_path, pool_mib: int = 32, **journal_kw):
        self.state_dir = tmp_path / "state"
        self.pool_path = str(tmp_path / "pool")
        self.pool_mib = pool_mib
        self.journal_kw = dict(fsync_interval=0.0, **journal_kw)
        self.journal: Journal | None = None
        self.generation = 0

    def open(self) -> Registry:
        if self.journal is not None:
            self.journal.close()
        self.journal = Journal(self.state_dir, **self.journal_kw)
        snapshot, records = self.journal.load()
        reg = Registry(ShmPool(self.pool_path, self.pool_mib * MiB), SIGNER, journal=self.journal)
        persistence.restore(reg, snapshot, records)
        return reg

    def journal_path(self) -> Path:
        generation = self.generation if self.journal is None else self.journal.generation
        return self.state_dir / f"journal-{generation}.log"

    def close(self) -> None:
        if self.journal is not None:
            self.generation = self.journal.generation
            self.journal.close()
            self.journal = None


@pytest.fixture
def env(tmp_path):
    e = Env(tmp_path)
    yield e
    e.close()


def state(reg: Registry) -> dict:
    """Everything a restart must preserve (pins, leases and instances are not persisted)."""
    return {
        "regions": {
            rid: (r.owner, r.path, r.offset, r.length, r.token, r.returned, r.live_keys)
            for rid, r in reg.regions.items()
        },
        "keys": {k: (e.region_id, e.offset, e.length) for k, e in reg.keys.items()},
        "live_bytes": reg.live_bytes,
        "pool_used": reg.pool.used,
    }


def populate(reg: Registry) -> dict:
    """A bit of everything that is journaled: R, K, D, T, F, and evictions."""
    for iid in ("A", "B", "C"):
        reg.instances.handshake(iid, 1)
    r1 = reg.request_region("A", 4 * MiB)
    r2 = reg.request_region("A", 2 * MiB)
    r3 = reg.request_region("B", 2 * MiB)
    r4 = reg.request_region("C", 2 * MiB)
    register(reg, "A", [[f"a{i}", r1.region_id, i * 64 * KiB, 1000 + i] for i in range(5)])
    register(reg, "B", [[b"b0", r3.region_id, 0, 10], ["b1", r3.region_id, 4096, 20]])
    register(reg, "C", [["c0", r4.region_id, 0, 30]])
    reg.delete(["a1"])
    reg.return_region("B", r3.region_id, r3.token)  # T, keys remain: deferred
    reg.return_region("A", r2.region_id, r2.token)  # T + F: keyless
    reg.delete([b"b0"])
    reg.instances.disconnect("C")  # like a reap: T
    reg.eviction.evict_for("A", 1)  # D of the LRU key in A's regions (a0)
    return {"r1": r1, "r2": r2, "r3": r3, "r4": r4}


# -- round trip -------------------------------------------------------------------------------


def test_round_trip_restores_regions_keys_and_pool_usage(env):
    reg = env.open()
    regions = populate(reg)
    before = state(reg)
    order_before = list(reg.keys)
    assert sorted(before["keys"]) == sorted(["a2", "a3", "a4", "b1", "c0"], key=str)
    env.close()

    restored = env.open()
    assert state(restored) == before
    assert list(restored.keys) == order_before  # registration order survives (LRU seed)
    # owners of live regions come back as instances (and must heartbeat or be reaped);
    # owners of returned regions do not
    assert set(restored.instances) == {"A"}
    assert restored.instances["A"].regions == {regions["r1"].region_id}
    # region ids are never reused after a restart, even those of freed regions
    new = restored.request_region("A", 2 * MiB)
    assert new.region_id > max(h.region_id for h in regions.values())
    # the restored registry keeps journaling: a second restart sees the new change too
    register(restored, "A", [["late", new.region_id, 0, 7]])
    expected = state(restored)
    env.close()
    assert state(env.open()) == expected


def test_restored_deferred_free_still_frees(env):
    reg = env.open()
    regions = populate(reg)
    env.close()
    reg = env.open()
    used = reg.pool.used
    r3 = regions["r3"]
    assert reg.regions[r3.region_id].returned
    assert reg.delete(["b1"]) == [0]  # the last key of a returned region...
    assert r3.region_id not in reg.regions  # ...frees it, as before the restart
    assert reg.pool.used == used - r3.length


def test_records_are_in_the_file_before_sync(env):
    """`append` is an os.write: once a request is answered its record is in the kernel, so a
    SIGKILLed server loses nothing even before the batched fsync."""
    reg = env.open()
    env.journal.fsync_interval = 3600
    reg.instances.handshake("A", 1)
    r = reg.request_region("A", 2 * MiB)
    register(reg, "A", [["k", r.region_id, 0, 5]])
    records, _ = read_records(env.journal_path().read_bytes())
    assert [rec[0] for rec in records] == ["R", "K"]
    assert records[1] == ["K", ["k"], [r.region_id], [0], [5]]


def test_restart_without_changes_is_stable(env):
    reg = env.open()
    populate(reg)
    before = state(reg)
    env.close()
    for _ in range(3):
        assert state(env.open()) == before
        env.close()


# -- snapshots ---------------------------------------------------------------------------------


def test_snapshot_generations(tmp_path):
    env = Env(tmp_path, snapshot_bytes=256)
    reg = env.open()
    assert env.journal.generation == 0
    populate(reg)
    assert env.journal.needs_snapshot
    env.journal.write_snapshot(persistence.snapshot(reg))
    assert env.journal.generation == 1 and not env.journal.needs_snapshot
    files = sorted(p.name for p in env.state_dir.iterdir())
    assert files == ["journal-1.log", SNAPSHOT_NAME]
    assert os.path.getsize(env.journal_path()) == 0
    # changes after the snapshot go to the new generation's journal
    h = reg.request_region("A", 2 * MiB)
    register(reg, "A", [["after-snap", h.region_id, 0, 3]])
    reg.delete(["a2"])
    env.journal.write_snapshot(persistence.snapshot(reg))
    register(reg, "A", [["after-snap-2", h.region_id, 4096, 4]])
    assert env.journal.generation == 2
    before = state(reg)
    env.close()

    # a stale journal of an older generation (crash between snapshot and unlink) and a
    # half-written snapshot temp file (crash before the rename) are both ignored
    (env.state_dir / "journal-1.log").write_bytes(_frame(["K", [["ghost", 999, 0, 1]]]))
    (env.state_dir / (SNAPSHOT_NAME + ".tmp")).write_bytes(b"\x00\x01garbage")
    restored = env.open()
    assert state(restored) == before
    assert "ghost" not in restored.keys
    assert not (env.state_dir / "journal-1.log").exists()
    env.close()


def test_damaged_snapshot_refuses_to_start(env):
    reg = env.open()
    populate(reg)
    env.journal.write_snapshot(persistence.snapshot(reg))
    env.close()
    snap = env.state_dir / SNAPSHOT_NAME
    data = bytearray(snap.read_bytes())
    data[-1] ^= 0xFF
    snap.write_bytes(bytes(data))
    with pytest.raises(RuntimeError, match="damaged"):
        env.open()


# -- torn and corrupt tails --------------------------------------------------------------------


def _journal_with_tail(env) -> tuple[Registry, dict, bytes]:
    """Populate, then register one last key; return the state before that last record and
    the journal bytes."""
    reg = env.open()
    populate(reg)
    before_last = state(reg)
    rid = next(iter(reg.instances["A"].regions))
    register(reg, "A", [["last", rid, 2 * MiB, 99]])
    env.close()
    return reg, before_last, env.journal_path().read_bytes()


def _last_frame_start(data: bytes) -> int:
    pos, last = 0, 0
    while pos < len(data):
        last = pos
        length, _ = FRAME.unpack_from(data, pos)
        pos += FRAME.size + length
    return last


@pytest.mark.parametrize("keep", [1, 4, FRAME.size - 1, FRAME.size, FRAME.size + 3, -1])
def test_torn_tail_is_ignored_and_truncated(env, keep):
    _, before_last, data = _journal_with_tail(env)
    start = _last_frame_start(data)
    cut = start + (keep if keep >= 0 else len(data) - start - 1)
    assert start < cut < len(data)
    with open(env.journal_path(), "r+b") as f:
        f.truncate(cut)
    reg = env.open()
    assert "last" not in reg.keys  # never replayed
    assert state(reg) == before_last
    assert env.journal.damaged_bytes_dropped == cut - start
    assert os.path.getsize(env.journal_path()) == start  # truncated away
    # records appended after the truncation are not hidden behind the damage
    rid = next(iter(reg.instances["A"].regions))
    register(reg, "A", [["after", rid, 3 * MiB, 5]])
    env.close()
    assert "after" in env.open().keys


def _flip(data: bytes, pos: int) -> bytes:
    out = bytearray(data)
    out[pos] ^= 0x40
    return bytes(out)


@pytest.mark.parametrize("where", ["payload", "crc", "length-huge", "length-small"])
def test_corrupt_tail_record_is_detected_and_not_replayed(env, where):
    _, before_last, data = _journal_with_tail(env)
    start = _last_frame_start(data)
    length, crc = FRAME.unpack_from(data, start)
    if where == "payload":
        bad = _flip(data, len(data) - 2)
    elif where == "crc":
        bad = data[: start + 4] + struct.pack("!I", crc ^ 1) + data[start + 8 :]
    elif where == "length-huge":
        bad = data[:start] + struct.pack("!I", 0xFFFFFFF0) + data[start + 4 :]
    else:
        bad = data[:start] + struct.pack("!I", length - 1) + data[start + 4 :]
    env.journal_path().write_bytes(bad)
    reg = env.open()
    assert "last" not in reg.keys
    assert state(reg) == before_last
    assert os.path.getsize(env.journal_path()) == start
    assert env.journal.damaged_bytes_dropped == len(bad) - start


def test_garbage_after_the_last_record_is_ignored(env):
    _, _, data = _journal_with_tail(env)
    with open(env.journal_path(), "ab") as f:
        f.write(os.urandom(1000))
    reg = env.open()
    assert "last" in reg.keys
    assert os.path.getsize(env.journal_path()) == len(data)


def test_checksummed_but_undecodable_record_is_damage(env):
    _, before_last, data = _journal_with_tail(env)
    start = _last_frame_start(data)
    junk = b"\xc1\xc1\xc1"  # 0xc1 is never valid msgpack
    bad = data[:start] + FRAME.pack(len(junk), zlib.crc32(junk)) + junk
    env.journal_path().write_bytes(bad)
    reg = env.open()
    assert state(reg) == before_last


def _five_keys(env) -> tuple[bytes, list[int]]:
    """R, then a K record for each of k0..k4; returns the journal and each frame's offset."""
    reg = env.open()
    reg.instances.handshake("A", 1)
    r = reg.request_region("A", 2 * MiB)
    for i in range(5):
        register(reg, "A", [[f"k{i}", r.region_id, i * 4096, 10]])
    env.close()
    data = env.journal_path().read_bytes()
    starts, pos = [], 0
    while pos < len(data):
        starts.append(pos)
        pos += FRAME.size + FRAME.unpack_from(data, pos)[0]
    assert len(starts) == 6 and len(read_records(data)[0]) == 6  # R + 5 K
    return data, starts


@pytest.mark.parametrize("where", ["payload", "crc", "length-huge", "length-small", "length-0"])
def test_damage_in_the_middle_refuses_to_load(env, where, caplog):
    """A damaged record with intact records after it (found by scanning, whatever its length
    field says): the records after it are lost and the ones before it are not the registry's
    state (a delete among the lost ones would bring a key back over another key's bytes), so
    the journal is not loaded, nothing on disk changes, and an ERROR says why."""
    data, starts = _five_keys(env)
    pos = starts[3]  # the third K record
    length, crc = FRAME.unpack_from(data, pos)
    header = {
        "crc": FRAME.pack(length, crc ^ 1),
        "length-huge": FRAME.pack(0xFFFFFFF0, crc),
        "length-small": FRAME.pack(length - 1, crc),
        "length-0": FRAME.pack(0, crc),
    }
    if where == "payload":
        bad = _flip(data, pos + FRAME.size + 2)
    else:
        bad = data[:pos] + header[where] + data[pos + FRAME.size :]
    env.journal_path().write_bytes(bad)
    with pytest.raises(RuntimeError, match="damaged in its middle"):
        env.open()
    env.journal = None  # (load failed: nothing to close)
    assert env.journal_path().read_bytes() == bad  # not truncated
    (error,) = [r for r in caplog.records if r.levelname == "ERROR"]
    assert f"byte {pos} of {len(bad)}" in error.message
    assert f"at least 2, from byte {starts[4]}" in error.message
    assert "--no-restore" in error.message


def test_lost_pages_at_the_tail_are_still_a_torn_tail(env):
    """A machine crash can leave several records' worth of zeros (or a zeroed page with a torn
    record before it) at the end: no intact record follows, so it is a tail as before."""
    data, starts = _five_keys(env)
    torn = data[: starts[4] + 5] + bytes(3 * 4096)
    env.journal_path().write_bytes(torn)
    reg = env.open()
    assert sorted(reg.keys) == ["k0", "k1", "k2"]
    assert env.journal.damaged_bytes_dropped == len(torn) - starts[4]
    assert os.path.getsize(env.journal_path()) == starts[4]


def test_the_next_intact_frame_is_found_at_any_offset():
    """Frames are looked for at every offset, also where the bytes before one (a damaged
    record's, or its own header) look like a record's start: here its CRC begins 0xdd, an
    array 32 marker whose count covers its payload's first byte."""
    frame = next(
        f for f in (_frame(["D", [f"k{n}"]]) for n in range(100_000)) if f[FRAME.size - 4] == 0xDD
    )
    for junk in (b"", b"\x00", b"\x92\xa1K" * 3, os.urandom(5000), bytes(4096)):
        data = junk + frame
        assert next_intact_frame(data, 0) == len(junk)
        assert next_intact_frame(data[:-1], 0) is None  # torn: no frame
        assert next_intact_frame(data + b"\x00" * 8, 0) == len(junk)


# -- replay idempotence ------------------------------------------------------------------------


def test_replaying_a_record_twice_changes_nothing(tmp_path):
    env = Env(tmp_path)
    reg = env.open()
    populate(reg)
    expected = state(reg)
    env.close()
    _, records = Journal(env.state_dir).load()
    kinds = {r[0] for r in records}
    assert kinds == {"R", "K", "D", "T", "F"}
    doubled = []
    for record in records:
        doubled.append(record)
        if record[0] != "R":  # a region is reserved once; every other record may repeat
            doubled.append(record)
    fresh = Registry(ShmPool(str(tmp_path / "pool"), 32 * MiB), SIGNER)
    persistence.restore(fresh, None, doubled)
    assert state(fresh) == expected


def test_replay_tolerates_records_about_unknown_regions_and_keys(tmp_path):
    fresh = Registry(ShmPool(str(tmp_path / "pool"), 8 * MiB), SIGNER)
    persistence.restore(
        fresh,
        None,
        [["K", [["k", 42, 0, 1]]], ["D", ["nope"]], ["T", 7], ["F", 7], ["?", 1]],
    )
    assert not fresh.keys and not fresh.regions and fresh.live_bytes == 0


# -- pool identity -----------------------------------------------------------------------------


def test_pool_identity_check(tmp_path):
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    path = str(tmp_path / "pool")
    pool = ShmPool(path, 8 * MiB)
    assert not same_pool_as_before(state_dir, pool)  # no record: nothing to restore
    pool_generation(state_dir, pool)  # (records it, as a server start does)
    assert same_pool_as_before(state_dir, ShmPool(path, 8 * MiB))  # same file
    # a recreated file (e.g. /dev/shm after a reboot) is another pool, even at the same path
    tmp = tmp_path / "pool.new"
    ShmPool(str(tmp), 8 * MiB)
    os.replace(tmp, path)
    assert not same_pool_as_before(state_dir, ShmPool(path, 8 * MiB))
    discard_state(state_dir)
    pool_generation(state_dir, ShmPool(path, 8 * MiB))
    assert same_pool_as_before(state_dir, ShmPool(path, 8 * MiB))  # recorded anew
    # a different capacity is a different pool too
    assert not same_pool_as_before(state_dir, ShmPool(path, 16 * MiB))


def test_mismatch_is_remembered_until_the_state_is_discarded(tmp_path):
    """If the server dies between noticing another pool and discarding the old state, the
    next start must still refuse that state (it points into memory that is not there)."""
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    path = str(tmp_path / "pool")
    pool_generation(state_dir, ShmPool(path, 8 * MiB))
    assert same_pool_as_before(state_dir, ShmPool(path, 8 * MiB))
    ShmPool(str(tmp_path / "pool.new"), 8 * MiB)
    os.replace(tmp_path / "pool.new", path)
    assert not same_pool_as_before(state_dir, ShmPool(path, 8 * MiB))
    # (crash here: discard_state never ran)
    assert not same_pool_as_before(state_dir, ShmPool(path, 8 * MiB))


def test_unreadable_identity_is_a_mismatch(tmp_path):
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    path = str(tmp_path / "pool")
    pool_generation(state_dir, ShmPool(path, 8 * MiB))
    assert same_pool_as_before(state_dir, ShmPool(path, 8 * MiB))
    (state_dir / POOL_IDENTITY).write_text('{"kind": "shm", "pa')  # torn
    assert not same_pool_as_before(state_dir, ShmPool(path, 8 * MiB))


def test_identity_mismatch_discards_state_but_keeps_the_secret(tmp_path):
    env = Env(tmp_path)
    reg = env.open()
    populate(reg)
    env.journal.write_snapshot(persistence.snapshot(reg))
    register(reg, "A", [["x", next(iter(reg.instances["A"].regions)), 3 * MiB, 1]])
    env.close()
    (env.state_dir / "secret.key").write_bytes(b"s" * 32)
    discard_state(env.state_dir)
    left = sorted(p.name for p in env.state_dir.iterdir())
    assert "secret.key" in left
    assert not any(n.startswith("journal-") or n == SNAPSHOT_NAME for n in left)
    reg = env.open()
    assert not reg.keys and not reg.regions and reg.pool.used == 0


def test_frame_layout():
    frame = _frame(["K", [["k", 1, 0, 1]]])
    length, crc = FRAME.unpack_from(frame)
    payload = frame[FRAME.size :]
    assert length == len(payload) and crc == zlib.crc32(payload)
    assert msgpack.unpackb(payload) == ["K", [["k", 1, 0, 1]]]


@pytest.mark.parametrize("snapshot_first", [False, True])
def test_pins_survive_a_restart_until_their_holder_is_reaped(env, snapshot_first):
    from maru.common.protocol import DeleteStatus

    reg = env.open()
    reg.instances.handshake("A", 1)
    reg.instances.handshake("B", 2)
    rid = reg.request_region("A", 2 * MiB).region_id
    register(reg, "A", [[f"k{i}", rid, i * 4096, 100] for i in range(4)])
    assert reg.pins.pin(["k0", "k1"], "A") == [True, True]
    assert reg.pins.pin(["k1", "k2"], "B") == [True, True]
    assert reg.pins.pin(["k3"]) == [True]  # a pin without an instance: kept until unpinned
    assert reg.pins.unpin(["k2"], "B") == [True]
    if snapshot_first:
        env.journal.write_snapshot(persistence.snapshot(reg))
    env.close()

    reg = env.open()
    pins = {k: reg.keys[k].pins for k in ("k0", "k1", "k2", "k3")}
    assert pins == {"k0": 1, "k1": 2, "k2": 0, "k3": 1}
    assert reg.delete(["k0", "k2"]) == [DeleteStatus.PINNED, DeleteStatus.DELETED]
    assert reg.instances["B"].pins == {"k1": 1}
    # B never comes back: reaped, its pin goes; A's stays while A heart-beats.
    reg.instances.require("A")
    reg.instances.reap(timeout=0.0, now=reg.instances["A"].last_seen + 0.0)
    assert "B" not in reg.instances and reg.keys["k1"].pins == 1
    env.close()

    reg = env.open()  # the reaping was journaled too
    assert {k: reg.keys[k].pins for k in ("k0", "k1", "k3")} == {"k0": 1, "k1": 1, "k3": 1}
    assert "B" not in reg.instances


@pytest.mark.parametrize("snapshot_first", [False, True])
def test_checksums_survive_a_restart_and_keys_without_one_read_as_before(env, snapshot_first):
    """Issue 13, P8: a key's checksum (`maru_checksums`) is kept by the journal ("K" record's
    sixth column, tagged with the hash's name) and the snapshot (a fifth column on the rows
    that have one, the hash named once); records and rows of before, without one, still
    restore (checksum 0: none), and so do checksums of before, of another hash (xxh3: a "K"
    record's untagged sixth column, a snapshot that names no hash): as none, never trusted."""
    reg = env.open()
    reg.instances.handshake("A", 1)
    rid = reg.request_region("A", 2 * MiB).region_id
    sums = [-(1 << 63), (1 << 63) - 1, 12345]
    keys = ["c0", "c1", b"c2"]
    # the batch path, the key-by-key path (a duplicate in the batch), and a key without one
    new, old = RegisterStatus.REGISTERED, RegisterStatus.EXISTS
    assert reg.register("A", keys, [rid] * 3, [0, 4096, 8192], [100] * 3, sums) == [new] * 3
    offsets = [12288, 16384, 20480]
    statuses = reg.register("A", ["d", "d", "c0"], [rid] * 3, offsets, [5, 6, 7], [7, 8, 9])
    assert statuses == [new, old, old]  # "d" twice in the batch: the first one wins
    register(reg, "A", [["plain", rid, 24576, 50]])
    records, _ = read_records(env.journal_path().read_bytes())
    assert records[-3] == ["K", keys, [rid] * 3, [0, 4096, 8192], [100] * 3, sums, CHECKSUMS]
    assert records[-2] == ["K", ["d"], [rid], [12288], [5], [7], CHECKSUMS]
    assert records[-1] == ["K", ["plain"], [rid], [24576], [50]]  # the form of before
    want = {"c0": sums[0], "c1": sums[1], b"c2": sums[2], "d": 7, "plain": 0}
    assert {k: reg.keys[k].checksum for k in want} == want
    if snapshot_first:
        env.journal.write_snapshot(persistence.snapshot(reg))
    env.close()

    reg = env.open()
    assert {k: reg.keys[k].checksum for k in want} == want
    columns = reg.lookup(["c1", "missing", "plain", "d"])[:4]
    got = [memoryview(c).cast("q").tolist() for c in columns]
    assert got[3] == [sums[1], 0, 0, 7]  # LOOKUP_KV's checksums column
    # A snapshot of before (rows of four) and one with both kinds of rows restore alike.
    reg2 = Registry(ShmPool(env.pool_path, env.pool_mib * MiB), SIGNER)
    snap = persistence.snapshot(reg)
    assert sorted(len(row) for row in snap["keys"]) == [4, 5, 5, 5, 5]
    snap["keys"] = [row[:4] if row[0] == "c1" else row for row in snap["keys"]]
    persistence.restore(reg2, snap, [])
    assert {k: reg2.keys[k].checksum for k in want} == {**want, "c1": 0}
    # Checksums of before this hash (xxh3): a snapshot naming no hash, untagged "K" records.
    old = Registry(ShmPool(env.pool_path, env.pool_mib * MiB), SIGNER)
    untagged = {**snap, "keys": [*snap["keys"]]}
    del untagged["checksums"]
    rid2 = snap["regions"][0][0]
    record = ["K", ["x"], [rid2], [28672], [9], [4242]]  # (a journal's sixth column of before)
    persistence.restore(old, untagged, [record])
    assert {k: old.keys[k].checksum for k in [*want, "x"]} == dict.fromkeys([*want, "x"], 0)
