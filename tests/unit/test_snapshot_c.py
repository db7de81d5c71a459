"""The snapshot's keys packed in C (`KeyIndex.pack_rows`, `persistence.snapshot_packed`): the
same bytes, to the last one, as `msgpack.packb` of the list of rows `persistence.snapshot`
builds, so that snapshots of before restore unchanged and a server of before restores the new
ones. A key restored at another place would serve another key's bytes: byte equality is checked
against msgpack itself, on every form msgpack has for the rows' strings, ints and arrays."""

from __future__ import annotations

import random

import msgpack
import pytest

from maru.server import persistence
from maru.server._keyindex import KeyIndex, pack_record
from maru.server.journal import SNAPSHOT_NAME, Journal, Packed, _frame, read_records
from maru.server.pool import ShmPool
from maru.server.registry import Registry
from maru.server.token import TokenSigner

from .registry_calls import register

KiB, MiB = 1 << 10, 1 << 20
SIGNER = TokenSigner(b"s" * 32)

# ints at every boundary of msgpack's int forms (fixint, 8, 16, 32, 64 bits, both signs)
EDGES = [0, 1, 127, 128, 255, 256, 65535, 65536, (1 << 32) - 1, 1 << 32, (1 << 63) - 1]
SIGNED = [*EDGES, -1, -32, -33, -128, -129, -32768, -32769, -(1 << 31), -(1 << 31) - 1, -(1 << 63)]


def rows_of(index: KeyIndex) -> list[list]:
    """The rows as `persistence.snapshot` writes them (the reference)."""
    return [
        [k, e.region_id, e.offset, e.length, e.checksum]
        if e.checksum
        else [k, e.region_id, e.offset, e.length]
        for k, e in index.items()
    ]


def assert_same_bytes(index: KeyIndex) -> bytes:
    packed = index.pack_rows()
    rows = rows_of(index)
    assert packed == msgpack.packb(rows, use_bin_type=True)
    assert packed == pack_record(rows)
    assert msgpack.unpackb(packed, raw=False) == rows
    return packed


def index_of(keys: list, columns: list[list[int]] | None = None, sums: list | None = None):
    n = len(keys)
    index = KeyIndex()
    rids, offsets, lengths = columns or ([7] * n, [i * 4096 for i in range(n)], [4096] * n)
    index.add_entries(keys, rids, offsets, lengths, sums)
    return index


def test_an_empty_index_packs_an_empty_array():
    assert assert_same_bytes(KeyIndex()) == b"\x90"


@pytest.mark.parametrize("checksums", [None, "all", "some"])
@pytest.mark.parametrize("kind", ["str", "bytes", "mixed"])
def test_rows_of_str_and_bytes_keys_with_and_without_checksums(kind, checksums):
    n = 40
    keys = [f"ns:{i:064x}" for i in range(n)]
    if kind == "bytes":
        keys = [k.encode() for k in keys]
    elif kind == "mixed":
        keys = [k.encode() if i % 3 else k for i, k in enumerate(keys)]
    sums = None if checksums is None else [i * 7919 + 1 for i in range(n)]
    if checksums == "some":  # 0: the key has none (a row of four)
        sums = [s if i % 2 else 0 for i, s in enumerate(sums)]
    packed = assert_same_bytes(index_of(keys, sums=sums))
    lengths = {len(row) for row in msgpack.unpackb(packed, raw=False)}
    assert lengths == {"None": {4}, "all": {5}, "some": {4, 5}}[str(checksums)]


def test_every_string_and_int_form():
    """Keys of each width msgpack's str (fixstr, str 8/16/32) and bin (8/16/32) headers and
    Python's str kinds (ASCII, 1, 2 and 4 bytes a character) take; each int form in each
    column, checksums of both signs."""
    keys: list = []
    for n in (1, 31, 32, 255, 256, 65535, 65536):
        keys += ["a" * n, b"b" * n]
    keys += ["é" * 40, "ключ" * 20, "\U0001f511" * 9, "mixé\U0001f511", b"\x00\xff" * 3]
    n = len(keys)
    rng = random.Random(5)
    rids = [rng.choice(EDGES[1:]) for _ in range(n)]
    offsets = [EDGES[i % len(EDGES)] for i in range(n)]
    lengths = [rng.choice(EDGES[1:]) for _ in range(n)]
    sums = [SIGNED[i % len(SIGNED)] for i in range(n)]
    assert_same_bytes(index_of(keys, [rids, offsets, lengths], sums))


@pytest.mark.parametrize("n", [15, 16, 65535, 65536, 70001])
def test_array_headers_and_a_large_index(n):
    """fixarray, array 16 and array 32 of rows; a large index with holes: deleted keys, keys
    moved to the end (eviction's order) and a head past the first entry."""
    rng = random.Random(n)
    keys = [f"k{i}" if i % 2 else f"k{i}".encode() for i in range(n + 300)]
    sums = [rng.choice([0, rng.getrandbits(64) - (1 << 63)]) for _ in keys]
    index = index_of(keys, sums=sums)
    index.remove_many(keys[:100])  # the head moves past them
    index.remove_many(rng.sample(keys[100:], 200))
    for key in rng.sample([k for k in keys if k in index], min(500, n // 2)):
        index.move_to_end(key)
    assert len(index) == n
    assert_same_bytes(index)


def test_random_operations_keep_the_bytes_equal():
    rng = random.Random(11)
    index = KeyIndex()
    for step in range(300):
        batch = [rng.choice([f"r{rng.randrange(2000)}", f"r{rng.randrange(2000)}".encode()])]
        batch = list(dict.fromkeys(batch + [f"s{step}-{i}" for i in range(rng.randrange(20))]))
        batch = [k for k in batch if k not in index]
        sums = [rng.choice([0, 1, -1, rng.getrandbits(63)]) for _ in batch]
        index.add_entries(batch, [1] * len(batch), [0] * len(batch), [8] * len(batch), sums)
        live = list(index)
        if live and rng.random() < 0.5:
            index.remove_many(rng.sample(live, rng.randrange(1, min(10, len(live)) + 1)))
        if len(index) and rng.random() < 0.5:
            index.move_to_end(rng.choice(list(index)))
        if step % 25 == 0:
            assert_same_bytes(index)
    assert_same_bytes(index)


def test_pinned_lists_the_pinned_keys_oldest_first():
    index = index_of(["a", b"b", "c", "d"])
    index["c"].pins = 2
    index[b"b"].pins = 1
    index.move_to_end(b"b")
    assert index.pinned() == [("c", 2), (b"b", 1)]
    assert KeyIndex().pinned() == []


# -- whole snapshots ---------------------------------------------------------------------------


def registry(tmp_path, journal: Journal | None = None) -> Registry:
    return Registry(ShmPool(str(tmp_path / "pool"), 32 * MiB), SIGNER, journal=journal)


def populate(reg: Registry) -> None:
    """Regions of three owners, str and bytes keys with and without checksums, a deleted key
    and a returned region, pins of instances and one of none."""
    for iid in ("A", "B", "C"):
        reg.instances.handshake(iid, 1)
    r1 = reg.request_region("A", 4 * MiB).region_id
    r2 = reg.request_region("B", 2 * MiB)
    r3 = reg.request_region("C", 2 * MiB).region_id
    register(reg, "A", [[f"a{i}", r1, i * 64 * KiB, 1000 + i] for i in range(20)])
    reg.register("B", [b"b0", "b1", "é"], [r2.region_id] * 3, [0, 4096, 8192], [10] * 3, [-5, 0, 9])
    register(reg, "C", [[b"c0", r3, 0, 30]])
    reg.delete(["a3"])
    reg.return_region("B", r2.region_id, r2.token)
    reg.pins.pin(["a0", "a1"], "A")
    reg.pins.pin(["a1", b"c0"], "C")
    reg.pins.pin(["a5", "a1"])  # without an instance


@pytest.mark.parametrize("filled", [False, True])
def test_a_packed_snapshot_frames_as_the_rows_list_does(tmp_path, filled):
    reg = registry(tmp_path)
    if filled:
        populate(reg)
    rows, packed = persistence.snapshot(reg), persistence.snapshot_packed(reg)
    assert isinstance(packed["keys"], Packed) and len(packed["keys"]) == len(reg.keys)
    assert packed["pins"] == rows["pins"]
    assert list(packed) == list(rows)  # the keys of the map, in order
    for state in (rows, dict(rows, generation=3)):
        reference = msgpack.packb(state, use_bin_type=True)
        spliced = dict(state, keys=packed["keys"])
        assert _frame(spliced)[8:] == reference
        assert _frame(spliced) == _frame(state)


def test_a_packed_snapshot_restores_as_before(tmp_path):
    """Written by the journal, read back: the same state as the rows list restores, and the
    file is what `msgpack.packb` writes of the rows list (what a server of before writes and
    reads)."""
    journal = Journal(tmp_path / "state", fsync_interval=0.0)
    journal.load()
    reg = registry(tmp_path, journal)
    populate(reg)
    state = persistence.snapshot(reg)
    journal.write_snapshot(persistence.snapshot_packed(reg))
    data = (tmp_path / "state" / SNAPSHOT_NAME).read_bytes()
    assert data[8:] == msgpack.packb(dict(state, generation=1), use_bin_type=True)
    assert journal.snapshot_size == len(data)
    journal.close()

    journal = Journal(tmp_path / "state", fsync_interval=0.0)
    snapshot, records = journal.load()
    assert (snapshot, records) == (read_records(data)[0][0], [])
    again = Registry(ShmPool(str(tmp_path / "pool"), 32 * MiB), SIGNER)
    persistence.restore(again, snapshot, records)
    journal.close()
    reference = Registry(ShmPool(str(tmp_path / "pool"), 32 * MiB), SIGNER)
    persistence.restore(reference, dict(state, generation=1), [])
    for got in (again, reference):
        assert [
            (k, e.region_id, e.offset, e.length, e.checksum, e.pins) for k, e in got.keys.items()
        ] == [(k, e.region_id, e.offset, e.length, e.checksum, e.pins) for k, e in reg.keys.items()]
        assert got.regions.snapshot() == reg.regions.snapshot()
