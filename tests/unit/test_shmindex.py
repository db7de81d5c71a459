"""The local index's shared table (`maru.common._shmindex`) and the server's and clients' sides
of it (`maru.server.localindex`, `maru.client.localindex`), without a server: insert, delete
(backward shifts instead of tombstones), growth, keys too long to publish, use bits, retiring,
and a reader that never sees a torn entry while another process rewrites the table."""

from __future__ import annotations

import mmap
import multiprocessing as mp
import os
import random
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from maru.client.localindex import LocalIndexClient, _open
from maru.common import shmindex
from maru.common.memcopy import COPY_VALUES
from maru.common.shmindex import MAX_KEY, NCOLS, USE_SUFFIX, region_tag, table_files
from maru.server import localindex
from maru.server.localindex import LocalIndex, _Table, retire_earlier

from .maru64 import hash64

TOKEN = "0123456789abcdef" * 2
REGIONS = {1: SimpleNamespace(token=TOKEN), 2: SimpleNamespace(token="f" * 32)}
BASE = {1: 1 << 40, 2: 1 << 41}  # where the regions are "mapped" (the probe only adds)
GiB = 1 << 30


def rows(**changes: tuple[int, int, int, int] | None) -> np.ndarray:
    """`RegionMapper.rows` for REGIONS (id, base address, length, tag): `changes` replace
    "r1" / "r2" (None: not mapped) or add rows."""
    table = {
        "r1": (1, BASE[1], GiB, region_tag(TOKEN)),
        "r2": (2, BASE[2], GiB, region_tag("f" * 32)),
        **changes,
    }
    return np.array([r for r in table.values() if r], np.int64).reshape(-1, 4)


def columns(reader, keys, regions=None, **kw):
    """The probe's columns: address, length, checksum, region, offset, slot, seq."""
    raw = reader.probe(keys, rows() if regions is None else regions, **kw)
    return None if raw is None else np.frombuffer(raw, np.int64).reshape(NCOLS, len(keys))


def publish(index: LocalIndex, keys, region=1, base=0):
    n = len(keys)
    offsets = [base + 4096 * i for i in range(n)]
    index.publish(
        keys, [region] * n, offsets, [100 + i for i in range(n)], [7] * n, regions=REGIONS
    )


@pytest.fixture
def index(tmp_path: Path):
    idx = LocalIndex("shm", str(tmp_path / "pool"), "gen-1")
    yield idx
    idx.close()


def test_published_keys_are_found_with_their_location_and_others_are_not(index):
    keys = [f"ns:{i:064x}" for i in range(50)]
    publish(index, keys)
    index.publish([b"raw"], [2], [8192], [5], None, regions=REGIONS)
    reader = _open(index.path, os.getuid())
    cols = columns(reader, [*keys, "ns:missing", b"raw", "raw"])
    address, length, checksum, region, offset = cols[:5]
    assert region.tolist() == [1] * 50 + [0, 2, 0]  # str "raw" is not bytes b"raw"
    assert offset[:50].tolist() == [4096 * i for i in range(50)]
    assert address.tolist() == [BASE[1] + 4096 * i for i in range(50)] + [0, BASE[2] + 8192, 0]
    assert length[:50].tolist() == [100 + i for i in range(50)]
    assert checksum.tolist() == [7] * 50 + [0, 0, 0]
    assert reader.contains([keys[3], "nope", b"raw"]) == [True, False, True]
    # a batch long enough to be answered without the GIL (GIL_FREE_FROM: 256 keys), both ways
    absent = [f"ns:{i:064x}" for i in range(1000, 1300)]
    assert reader.contains(keys + absent) == [True] * 50 + [False] * 300
    assert (columns(reader, keys + absent)[3] == [1] * 50 + [0] * 300).all()
    assert reader.count == index.count == 51
    assert reader.pool_generation == shmindex.hash_generation(b"gen-1")


def reference_hash(data: bytes, seed: int = 0) -> int:
    """The table's hash (`hash_bytes` in _shmindex.c), as the layout defines it: every server
    and client build must give these values, or their tables disagree."""
    mask, m1, m2 = (1 << 64) - 1, 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9
    h = seed ^ (len(data) * m1 & mask)
    for at in range(0, len(data), 8):
        w = int.from_bytes(data[at : at + 8], "little")  # a short tail: zeros above it
        x = h ^ (w * m2 & mask)
        h = ((x << 29 | x >> 35) & mask) * m1 & mask
    for shift, mul in ((33, 0xFF51AFD7ED558CCD), (33, 0xC4CEB9FE1A85EC53), (33, None)):
        h ^= h >> shift
        h = h * mul & mask if mul else h
    return h


def test_the_hash_is_the_layouts_for_every_length():
    """Tails of every length (0-7 bytes after the whole words) hash as the layout says."""
    rng = random.Random(7)
    for n in range(0, 200):
        data = rng.randbytes(n)
        assert shmindex.hash_generation(data) == reference_hash(data), n


def test_leading_counts_the_hits_from_the_start_and_marks_use_only_of_those(index):
    """`leading` (SGLang's batch_exists) answers what `contains` answers for the run from the
    start, across hash groups and the GIL-free length, with a prefix too; past the first miss
    nothing is probed, so no later hit is marked used."""
    keys = [f"ns:{i:064x}" for i in range(300)]
    publish(index, keys)
    reader = _open(index.path, os.getuid())
    absent = [f"ns:{i:064x}" for i in range(1000, 1300)]
    rng = random.Random(5)
    for n in (0, 1, 31, 32, 33, 64, 128, 255, 256, 300):
        for miss_at in {0, n // 2, n - 1, n} - {-1}:
            batch = keys[:n]
            if miss_at < n:
                batch = [*batch[:miss_at], absent[rng.randrange(300)], *batch[miss_at + 1 :]]
            found = reader.contains(batch)
            expected = found.index(False) if False in found else n
            assert reader.leading(batch) == expected == min(miss_at, n)
    assert reader.leading([k[3:] for k in keys[:40]], prefix="ns:") == 40
    assert reader.leading([*keys[:3], "x" * 1000]) is None  # a key the table cannot hold
    index.harvest_into(SimpleNamespace(get_many=lambda ks: [None] * len(ks)))  # clear use
    assert reader.leading([keys[0], keys[1], "absent", keys[3], keys[4]]) == 2
    entries = {k: SimpleNamespace(referenced=False) for k in keys}
    index.harvest_into(SimpleNamespace(get_many=lambda ks: [entries.get(k) for k in ks]))
    assert sorted(k for k, e in entries.items() if e.referenced) == keys[:2]


def test_keys_too_long_for_a_slot_are_not_published_and_readers_must_ask(index):
    fits, long_key = "k" * MAX_KEY, "k" * (MAX_KEY + 1)
    wide = "é" * (MAX_KEY // 2 + 1)  # few characters, more UTF-8 bytes than a slot holds
    publish(index, [fits, long_key, wide])
    reader = _open(index.path, os.getuid())
    assert index.count == 1
    assert reader.contains([fits]) == [True]
    for key in (long_key, wide):
        assert reader.contains([fits, key]) is None  # the batch goes to the server
        assert columns(reader, [key]) is None


def test_a_prefixed_probe_is_the_probe_of_the_joined_keys(index):
    """`probe` / `contains` with a prefix (one, or one per key) answer what they answer for
    `prefix + key` (never joined: hashed and compared in two parts): str and bytes,
    non-ASCII, and a key that fits alone but not with its prefix (the batch goes to the
    server, as for any key the table cannot hold)."""
    pre, bpre, wide = "ns:", b"ns:", "é名:"  # (wide: 6 UTF-8 bytes)
    hashes = [f"{i:064x}" for i in range(20)] + ["ünï", "k" * (MAX_KEY - 6)]
    stored = [pre + h for h in hashes[:10]] + [wide + h for h in hashes[10:]]
    stored += [bpre + b"raw", bpre + "ü".encode()]
    publish(index, stored)
    reader = _open(index.path, os.getuid())
    queries = [
        (hashes, pre),
        (hashes, wide),
        (hashes, [pre] * 10 + [wide] * 12),  # one prefix per key
        ([b"raw", "ü".encode(), b"absent"], bpre),
        ([pre + h for h in hashes], ""),  # "": no prefix
        ([b"ns:raw"], b""),
    ]
    for keys, prefix in queries:
        joined = [p + k for p, k in zip(prefix, keys)] if isinstance(prefix, list) else None
        joined = joined or [prefix + k for k in keys]
        got = columns(reader, keys, prefix=prefix)
        want = columns(reader, joined)
        assert got is not None and (got == want).all(), (keys, prefix)
        assert reader.contains(keys, prefix=prefix) == reader.contains(joined)
    assert sum(reader.contains(hashes, prefix=pre)) == 10
    assert reader.contains(hashes, prefix=[pre] * 10 + [wide] * 12) == [True] * 22
    # at the boundary: the widest stored key fits (MAX_KEY bytes with its prefix); one more
    # byte of prefix and neither probe nor contains can answer for the batch
    assert len((wide + hashes[-1]).encode()) == MAX_KEY
    assert reader.contains(hashes[-1:], prefix=wide) == [True]
    for prefix in ("x" + wide, ["x" + wide]):
        assert reader.contains(hashes[-1:], prefix=prefix) is None
        assert columns(reader, hashes[-1:], prefix=prefix) is None
    assert reader.contains(["k" * MAX_KEY], prefix="n") is None  # fits alone, not joined


def test_a_key_split_anywhere_into_prefix_and_key_is_found_as_the_whole_key(index):
    """The reader hashes and compares `prefix + key` in its two parts (never joined): every
    split of keys of 1-40 bytes (the prefix ending inside, at and across 8-byte words, the
    key shorter than what its word needs) finds the key the writer published whole, and
    a key that differs in one byte on either side of the split is absent."""
    rng = random.Random(11)
    whole = [rng.randbytes(n) for n in range(1, 41)]
    publish(index, whole + [w.hex() for w in whole])
    reader = _open(index.path, os.getuid())
    for w in whole:
        for cut in range(len(w) + 1):
            pre, key = w[:cut], w[cut:]
            for p, k in ((pre, key), (pre.hex(), key.hex())):
                assert reader.contains([k], prefix=p) == [True], (p, k)
                assert columns(reader, [k], prefix=p)[5][0] >= 0  # probe: a hit (its slot)
            flipped = bytes([w[cut - 1] ^ 1]) if cut else b""
            if cut:
                assert reader.contains([key], prefix=pre[:-1] + flipped) == [False]
            if cut < len(w):
                assert reader.contains([bytes([key[0] ^ 1]) + key[1:]], prefix=pre) == [False]
    # In one batch: a prefix's hash state is kept for the next key of the same prefix, length
    # and kind only (one prefix, keys of changing lengths; one prefix per key, every split).
    ns = b"a-namespace-17b:x"
    tails = [rng.randbytes(n) for n in range(0, 30)]
    publish(index, [ns + t for t in tails], base=1 << 20)
    order = [5, 5, 6, 5, 29, 29, 0, 3, 3, 17, 16, 17]
    assert reader.contains([tails[n] for n in order], prefix=ns) == [True] * len(order)
    assert reader.contains([tails[n] for n in order], prefix=ns[:-1] + b"y") == [False] * 12
    w = whole[-1]
    splits = list(range(len(w) + 1)) * 2
    keys, prefixes = [w[c:] for c in splits], [w[:c] for c in splits]
    assert reader.contains(keys, prefix=prefixes) == [True] * len(splits)
    assert reader.leading(keys, prefix=prefixes) == len(splits)


def test_a_prefix_not_of_its_keys_type_or_count_is_refused_as_python_refuses_it(index):
    reader = _open(index.path, os.getuid())
    for keys, prefix, error in (
        (["a"], b"ns:", TypeError),  # "a" + b"ns:" raises TypeError in Python too
        ([b"a"], "ns:", TypeError),
        (["a", b"b"], "ns:", TypeError),
        (["a", "b"], ["ns:", None], TypeError),
        (["a", "b"], ["ns:"], ValueError),  # one per key
        (["a"], 5, TypeError),
    ):
        with pytest.raises(error):
            reader.contains(keys, prefix=prefix)
        with pytest.raises(error):
            columns(reader, keys, prefix=prefix)
    assert reader.contains([b"a"], prefix="") == [False]  # "": no prefix, for bytes keys too


def test_the_probe_gives_addresses_only_inside_regions_mapped_with_the_same_tag(index):
    """A hit is an address only through a mapping of the same region with the same tag; a
    location outside its region is a miss (never a read past the mapping); a hit in a region
    not mapped here, or mapped with another tag (another pool life), sends the batch to the
    server (None)."""
    publish(index, ["a", "b", "c"])  # region 1: offsets 0, 4096, 8192; lengths 100..102
    index.publish(["d"], [2], [0], [10], None, regions=REGIONS)
    publish(index, ["before"], base=-4096)  # (never published by a server: still a miss)
    reader = _open(index.path, os.getuid())
    keys = ["a", "b", "c", "d", "nope"]
    address, length, checksum, region, offset, slot, _ = columns(reader, keys)
    assert address.tolist() == [BASE[1], BASE[1] + 4096, BASE[1] + 8192, BASE[2], 0]
    assert (slot[:4] >= 0).all() and slot[4] == -1
    assert columns(reader, ["before"])[0].tolist() == [0]
    # region 1 mapped shorter: "b" ends exactly at its end (a hit), "c" is past it (a miss)
    short = rows(r1=(1, BASE[1], 4096 + 101, region_tag(TOKEN)))
    address, length, checksum, region, offset, slot, _ = columns(reader, keys, short)
    assert address.tolist() == [BASE[1], BASE[1] + 4096, 0, BASE[2], 0]
    assert (length[2], checksum[2], region[2], offset[2], slot[2]) == (0, 0, 0, 0, -1)
    tiny = rows(r1=(1, BASE[1], 50, region_tag(TOKEN)))
    assert columns(reader, keys, tiny)[0].tolist() == [0, 0, 0, BASE[2], 0]
    assert columns(reader, keys, rows(r1=(1, BASE[1], GiB, 12345))) is None  # another tag
    assert columns(reader, keys, rows(r2=None)) is None  # region 2 not mapped here
    assert columns(reader, ["a", "nope"], rows(r2=None)) is not None  # (no hit in it)
    assert columns(reader, ["nope"], rows(r1=None, r2=None))[5].tolist() == [-1]
    for bad in (rows()[::-1].copy(), np.zeros(6, np.int64), b"1234567"):
        with pytest.raises(ValueError):
            reader.probe(keys, bad)  # not sorted by id / not rows of 4 int64


def test_deletes_keep_every_other_key_findable(tmp_path: Path):
    """A small table, many random inserts and deletes: backward shifts keep probe chains
    whole (no tombstones), checked against a model after every step."""
    table = _Table(str(tmp_path / "t.0"), 64, "g", None)
    reader = _open(table.path, os.getuid())
    rng = random.Random(7)
    present: set[str] = set()
    universe = [f"key-{i}" for i in range(200)]
    for _ in range(3000):
        key = rng.choice(universe)
        if key in present:
            assert table.writer.remove([key]) == 1
            present.discard(key)
        elif len(present) < 32:
            table.writer.publish([key], [1], [0], [1], None, {1: 5})
            present.add(key)
        found = reader.contains(universe)  # the hash column
        assert {k for k, f in zip(universe, found) if f} == present
        slots = columns(reader, universe, rows(r1=(1, BASE[1], GiB, 5)))[5]  # the slots
        assert {k for k, slot in zip(universe, slots) if slot >= 0} == present
        assert table.writer.count == len(present)
    table.retire()


def test_existence_comes_from_the_hash_column_and_a_read_compares_the_whole_key(index):
    """`contains` reads only the hash column (8 bytes a slot); a read (`probe`) compares the
    key itself. A slot whose key bytes differ but whose hash matches (a 64-bit collision,
    made here by hand) may answer `exists`, never a read."""
    keys = [f"ns:{i:064x}" for i in range(8)]
    publish(index, keys)
    reader = _open(index.path, os.getuid())
    table = index.table
    slot = int(columns(reader, keys[:1])[5][0])
    column = shmindex.HEADER_BYTES + table.capacity * shmindex.SLOT_BYTES
    view = memoryview(table.maps[0])
    key_at = shmindex.HEADER_BYTES + slot * shmindex.SLOT_BYTES + 64
    view[key_at + 3] ^= 0xFF  # the slot now holds another key of the same hash
    assert reader.contains(keys[:2]) == [True, True]
    assert columns(reader, keys[:2])[5][0] == -1  # a read: a miss, not the other key's bytes
    view[key_at + 3] ^= 0xFF
    entry = column + 8 * slot
    saved = bytes(view[entry : entry + 8])
    view[entry : entry + 8] = bytes(8)  # an empty column entry: not there for `contains`
    assert reader.contains(keys[:2]) == [False, True]
    view[entry : entry + 8] = saved
    assert reader.contains(keys) == [True] * 8 and (columns(reader, keys)[5] >= 0).all()
    view.release()


def test_a_table_past_half_full_is_replaced_by_a_bigger_one(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(localindex, "INITIAL_CAPACITY", 16)
    index = LocalIndex("shm", str(tmp_path / "pool"), "g")
    first = index.path
    client = LocalIndexClient.open(first, os.getuid())
    old_reader = client.reader()
    keys = [f"k{i}" for i in range(300)]
    for i in range(0, 300, 10):
        publish(index, keys[i : i + 10], base=i * 4096)
    assert index.grown >= 3 and index.table.capacity >= 600
    assert old_reader.retired and old_reader.successor  # names the table that replaced it
    assert not os.path.exists(first) and not os.path.exists(first + USE_SUFFIX)
    assert [p for _, p in table_files(index.base)] == [index.path]  # only the current one
    reader = client.reader()  # followed (the successor itself is gone: found by name)
    assert reader is not old_reader and client.path == index.path
    assert reader.contains(keys) == [True] * 300
    index.close()
    assert reader.retired and client.reader() is None  # the server stopped: ask it
    assert table_files(index.base) == []


def test_readers_see_the_next_region_id_and_a_bigger_table_carries_it(tmp_path, monkeypatch):
    """The header's `regions` (the id the server's next region gets) is 0 in a new table,
    what the server last noted after that, and the same in the table that replaces it."""
    monkeypatch.setattr(localindex, "INITIAL_CAPACITY", 16)
    index = LocalIndex("shm", str(tmp_path / "pool"), "g")
    client = LocalIndexClient.open(index.path, os.getuid())
    assert client.regions_made() == 0
    index.note_regions(5)
    assert client.regions_made() == 5
    keys = [f"k{i}" for i in range(40)]
    for i in range(0, 40, 10):
        publish(index, keys[i : i + 10], base=i * 4096)
    assert index.grown >= 1
    assert client.regions_made() == 5 and client.path == index.path  # (the successor's)
    index.note_regions(6)
    assert client.regions_made() == 6
    index.close()
    assert client.regions_made() == 0  # (no table: not said)


def test_hits_mark_use_bits_that_the_server_harvests_once(index):
    keys = [f"k{i}" for i in range(10)]
    publish(index, keys)
    reader = _open(index.path, os.getuid())
    reader.contains(keys[:3])
    columns(reader, [keys[5], "absent"])
    entries = {k: SimpleNamespace(referenced=False) for k in keys}
    key_index = SimpleNamespace(get_many=lambda ks: [entries.get(k) for k in ks])
    assert index.harvest_into(key_index) == 4
    assert sorted(k for k, e in entries.items() if e.referenced) == sorted([*keys[:3], keys[5]])
    assert index.table.writer.harvest() == []  # cleared


def test_changed_names_a_removed_or_moved_key_and_every_hit_of_a_retired_table(index):
    keys = [f"k{i}" for i in range(20)]
    publish(index, keys)
    reader = _open(index.path, os.getuid())
    cols = columns(reader, [*keys, "absent"])
    slots, seqs = cols[5].copy(), cols[6].copy()
    assert reader.changed(slots, seqs) is None  # every hit unchanged: nothing to say
    index.remove(keys[:2])
    changed = np.frombuffer(reader.changed(slots, seqs), bool)
    assert changed[:2].all() and not changed[-1]  # (a miss is never "changed")
    assert columns(reader, keys[:2])[0].tolist() == [0, 0]  # and they are misses now
    index.close()
    assert np.frombuffer(reader.changed(slots, seqs), bool).tolist() == [True] * 20 + [False]
    with pytest.raises(ValueError):
        reader.changed(slots, seqs[:3])


def test_a_server_start_retires_the_tables_an_earlier_one_left(tmp_path: Path):
    pool = str(tmp_path / "pool")
    killed = LocalIndex("shm", pool, "g")  # as a SIGKILLed server leaves it: not retired
    publish(killed, ["a", "b"])
    reader = _open(killed.path, os.getuid())
    assert retire_earlier("shm", pool) == 1
    assert reader.retired and reader.successor == ""
    assert table_files(killed.base) == []
    killed.table = None  # (its files are gone)


def test_tables_are_private_and_readers_refuse_one_others_may_write(index):
    assert os.stat(index.path).st_mode & 0o777 == 0o600
    assert os.stat(index.path + USE_SUFFIX).st_mode & 0o777 == 0o600
    assert _open(index.path, os.getuid() + 1) is None  # not the server's user
    os.chmod(index.path, 0o622)
    assert _open(index.path, os.getuid()) is None


def _rewrite(path: str, keys: list[str], seconds: float) -> None:
    """Another process: publish and remove `keys` over and over, each time at a new location
    whose fields agree with each other (checksum = offset * 3 + length), for `seconds`."""
    with open(path, "r+b") as f, open(path + USE_SUFFIX, "r+b") as u:
        writer = shmindex.Writer(mmap.mmap(f.fileno(), 0), mmap.mmap(u.fileno(), 0))
        version, end = 1, time.monotonic() + seconds
        while time.monotonic() < end:
            version += 1
            half = keys[version % 2 :: 2]
            writer.remove(half)
            offsets = [version * 1000 + i for i in range(len(half))]
            lengths = [version % 977 + 1] * len(half)
            sums = [o * 3 + n for o, n in zip(offsets, lengths)]
            writer.publish(half, [1] * len(half), offsets, lengths, sums, {1: 9})
        writer.close()


def test_a_reader_never_sees_a_torn_entry_while_another_process_rewrites(tmp_path: Path):
    table = _Table(str(tmp_path / "t.0"), 256, "g", None)
    keys = [f"key-{i:03d}" for i in range(100)]
    table.writer.publish(
        keys, [1] * 100, list(range(100)), [1] * 100, [i * 3 + 1 for i in range(100)], {1: 9}
    )
    proc = mp.get_context("spawn").Process(target=_rewrite, args=(table.path, keys, 3.0))
    proc.start()
    reader = _open(table.path, os.getuid())
    hits = torn = present = 0
    never = [f"other-{i:03d}" for i in range(100)]  # never published
    region = np.array([[1, 1 << 40, 1 << 50, 9]], np.int64)
    while proc.is_alive():
        address, length, checksum, _, offset = columns(reader, keys, region)[:5]
        hit = address != 0
        hits += int(hit.sum())
        torn += int((checksum[hit] != offset[hit] * 3 + length[hit]).sum())
        found = reader.contains(keys + never)  # the hash column, moved under it too
        present += sum(found[:100])
        assert not any(found[100:])
        assert reader.leading(keys + never) <= 100  # (batch_exists) over the moving chains
    proc.join(10)
    assert proc.exitcode == 0
    assert torn == 0 and hits > 1000  # it read a lot, and never a mix of two writes
    assert present > 1000
    table.retire()


# -- the fused read (`Reader.read`: probe, copy, check in one call) ---------------------------


def region_with_bytes(size: int = 64 * 1024) -> tuple[np.ndarray, np.ndarray]:
    """Random bytes standing for region 1 (mapped where they are), and the rows that say so."""
    data = np.frombuffer(np.random.default_rng(size).bytes(size), np.uint8).copy()
    return data, rows(r1=(1, data.ctypes.data, size, region_tag(TOKEN)))


def fused_read(
    reader, keys, regions, length, *, parts=2, hashed=False, copier=None, threads=None, **kw
):
    """`Reader.read` into a zeroed host buffer of one `length` row per key, each row in
    `parts` equal parts (`threads`: its optional last argument): (its 9 columns or None, the
    buffer); its `proven` list is checked against the statuses."""
    out = np.zeros((len(keys), length), np.uint8)
    part = length // parts
    rows_at = out.ctypes.data + np.arange(len(keys), dtype=np.int64)[:, None] * length
    buffers = (rows_at + np.arange(parts, dtype=np.int64) * part).astype(np.int64)
    sizes = np.full(parts, part, np.int64)
    more = () if threads is None else (threads,)
    got = reader.read(
        keys, regions, buffers, sizes, length, copier or COPY_VALUES, hashed, *more, **kw
    )
    if got is None:
        return None, out
    proven, raw = got
    cols = np.frombuffer(raw, np.int64).reshape(NCOLS + 2, len(keys))
    assert proven == (cols[NCOLS + 1] == 1).tolist()
    return cols, out


def test_the_fused_read_copies_each_hit_of_its_length_and_says_what_it_did(index):
    data, regions = region_with_bytes()
    keys = ["ns:a", "ns:b", "ns:short"]
    sums = [0, hash64(data[8192:12288]), 0]  # (a: stored without a checksum)
    index.publish(keys, [1, 1, 1], [0, 8192, 16384], [4096, 4096, 2048], sums, regions=REGIONS)
    reader = _open(index.path, os.getuid())
    asked = ["a", "nope", "short", "b"]
    cols, out = fused_read(reader, asked, regions, 4096, hashed=True, prefix="ns:")
    status, sums = cols[NCOLS + 1], cols[NCOLS]
    assert status.tolist() == [1, 0, 2, 1]  # copied, miss, another length (not copied), copied
    assert (out[0] == data[:4096]).all() and (out[3] == data[8192:12288]).all()
    assert not out[1].any() and not out[2].any()
    assert sums.tolist() == [hash64(data[:4096]), 0, 0, hash64(data[8192:12288])]
    probed = columns(reader, asked, regions, prefix="ns:")
    assert (cols[:NCOLS] == probed).all()  # the probe's columns, as `probe` gives them
    cols, out = fused_read(reader, asked, regions, 4096, parts=1, prefix="ns:")
    assert cols[NCOLS].tolist() == [0] * 4 and (out[3] == data[8192:12288]).all()
    data[8192 + 5] ^= 0xFF  # b's bytes now unlike the checksum stored with it: 4, a miss
    cols, out = fused_read(reader, asked, regions, 4096, hashed=True, prefix="ns:")
    assert cols[NCOLS + 1].tolist() == [1, 0, 2, 4]  # (a has no checksum: not checked)


def test_a_hit_removed_or_a_table_retired_during_the_fused_copy_is_not_proven(index, fused_copier):
    data, regions = region_with_bytes()
    keys = ["a", "b", "c"]
    index.publish(keys, [1, 1, 1], [0, 4096, 8192], [4096] * 3, None, regions=REGIONS)
    reader = _open(index.path, os.getuid())
    copier = fused_copier(lambda: index.remove(["b"]))  # between the probe and the check
    cols, out = fused_read(reader, keys, regions, 4096, copier=copier)
    assert cols[NCOLS + 1].tolist() == [1, 3, 1]  # b: copied, but its entry changed meanwhile
    assert (out[1] == data[4096:8192]).all()  # (the bytes were copied: not proven, a miss)
    copier = fused_copier(index.close)  # the server stopped: its table is retired
    cols, _ = fused_read(reader, ["a", "b", "c"], regions, 4096, copier=copier)
    assert cols[NCOLS + 1].tolist() == [3, 0, 3]


def test_a_fused_read_shared_between_threads_proves_only_what_did_not_change(index, fused_copier):
    """`threads` 3 (`maru_copy_threads`): the copy of 3 MiB goes to the caller and two copier
    threads, and the check runs only after every share: a key removed and a key whose bytes
    changed between the probe and the check are not proven; every other key's bytes are its
    own."""
    from maru.common import memcopy

    value, n = 128 * 1024, 24
    data, regions = region_with_bytes(value * n)
    keys = [f"k{i}" for i in range(n)]
    sums = [hash64(data[i * value : (i + 1) * value]) for i in range(n)]
    offsets = [i * value for i in range(n)]
    index.publish(keys, [1] * n, offsets, [value] * n, sums, regions=REGIONS)
    reader = _open(index.path, os.getuid())

    def fault():
        index.remove(["k5"])
        data[20 * value + 7] ^= 0xFF

    before = memcopy.copier_tasks()
    cols, out = fused_read(
        reader, keys, regions, value, hashed=True, copier=fused_copier(fault), threads=3
    )
    assert memcopy.copier_tasks() - before == 2  # three shares of 1 MiB
    status = cols[NCOLS + 1].tolist()
    assert status[5] == 3 and status[20] == 4  # changed entry; bytes unlike their checksum
    assert [i for i, st in enumerate(status) if st != 1] == [5, 20]
    for i in range(n):
        if i not in (5, 20):
            assert (out[i] == data[i * value : (i + 1) * value]).all(), i
    with pytest.raises(ValueError, match="threads"):
        fused_read(reader, keys[:1], regions, value, threads=0)


def test_the_fused_read_refuses_what_it_cannot_copy_safely(index):
    _, regions = region_with_bytes()
    index.publish(["a"], [1], [0], [4096], None, regions=REGIONS)
    reader = _open(index.path, os.getuid())
    buffers = np.zeros((1, 2), np.int64)
    with pytest.raises(ValueError, match="summing to length"):  # would read past the value
        reader.read(["a"], regions, buffers, np.array([4096, 4096]), 4096, COPY_VALUES, False)
    with pytest.raises(ValueError, match="buffers"):
        reader.read(["a", "b"], regions, buffers, np.array([2048, 2048]), 4096, COPY_VALUES, 0)
    with pytest.raises(TypeError, match="int64"):  # pointers of another type
        reader.read(
            ["a"],
            regions,
            buffers.astype(np.float64),
            np.array([2048, 2048]),
            4096,
            COPY_VALUES,
            False,
        )
    with pytest.raises(ValueError):  # not the copy loop's capsule
        reader.read(["a"], regions, buffers, np.array([2048, 2048]), 4096, object(), False)
    assert fused_read(reader, ["x" * (MAX_KEY + 1)], regions, 4096)[0] is None  # ask the server
    cols, _ = fused_read(reader, ["a"], rows(r1=None), 4096)  # region not mapped here: ask
    assert cols is None


# -- the in-pool table (`maru-server --index-slots`) -------------------------------------------


def pool_with_area(tmp_path: Path, slots: int) -> SimpleNamespace:
    """A stand-in for a pool with an index area (`Pool.index_area`): a file whose bytes from
    one page on hold the area, as past a shm pool's mark."""
    path = tmp_path / "pool"
    length = shmindex.area_bytes(slots)
    path.write_bytes(b"\xa5" * (4096 + length))  # (the area is not zeros: the format clears it)
    return SimpleNamespace(path=str(path), index_area=("", 4096, length, slots))


def in_pool_reader(pool: SimpleNamespace, index: LocalIndex) -> LocalIndexClient:
    client = LocalIndexClient.in_pool(SimpleNamespace(local=pool.path), index.offer())
    assert client is not None
    return client


@pytest.mark.parametrize("software", [False, True], ids=["hardware", "software"])
def test_an_in_pool_table_formatted_again_proves_no_copy_of_the_one_before(tmp_path, software):
    """A server's next start formats the area anew (a new index id): a reader's hit from the
    table before is not proven after, even where its slot has the same seq again (the same
    key published at the same slot); with software coherence's flushes alike."""
    pool = pool_with_area(tmp_path, 1024)
    keys = [f"k/{i}" for i in range(20)]
    first = LocalIndex("shm", pool.path, "gen-1", in_pool=pool, software=software)
    publish(first, keys)
    reader = in_pool_reader(pool, first)._reader
    cols = columns(reader, keys)
    assert cols[1].tolist() == [100 + i for i in range(20)]  # every key, from the pool file
    assert reader.changed(cols[5].tobytes(), cols[6].tobytes()) is None  # proven
    first.close()  # (the server stops, or is killed and the next start retires it)
    second = LocalIndex("shm", pool.path, "gen-1", in_pool=pool, software=software)
    publish(second, keys)  # the same slots, the same seqs
    again = in_pool_reader(pool, second)._reader
    assert columns(again, keys)[6].tolist() == cols[6].tolist()  # (the seqs are equal again)
    assert reader.retired and not again.retired
    flags = reader.changed(cols[5].tobytes(), cols[6].tobytes())
    assert flags == b"\x01" * 20  # none proven by the table before
    second.close()


def test_a_full_in_pool_table_leaves_keys_out_and_its_readers_ask_for_misses(tmp_path):
    """16 slots hold 8 keys: with k/8 in, a batch of all 12 publishes k/0..k/6 and leaves
    k/7..k/11 out (k/8's slot is removed: it names the location the batch replaces); the
    table says so, and a reader's batch with a miss goes to the server (None) where one of
    hits only is answered."""
    pool = pool_with_area(tmp_path, 16)
    index = LocalIndex("shm", pool.path, "gen-1", in_pool=pool)
    keys = [f"k/{i}" for i in range(12)]
    publish(index, keys[8:9])  # k/8 is in the table, then left out when it comes again
    publish(index, keys[:8] + keys[8:])
    stats = index.stats()
    assert stats["in_pool"] and stats["slots"] == 16
    assert index.count == 7 and stats["unpublished"] == 5
    reader = in_pool_reader(pool, index)._reader
    assert reader.incomplete
    inside = [k for k in keys if columns(reader, [k]) is not None]
    assert inside == keys[:7]  # (k/8's old slot went)
    assert columns(reader, inside)[1].tolist() == [100 + keys.index(k) for k in inside]
    assert columns(reader, [*inside, "k/8"]) is None  # a miss: the server may have it
    assert reader.contains(inside) == [True] * len(inside)
    assert reader.contains([*inside, "k/11"]) is None
    assert reader.leading(inside) == len(inside) and reader.leading(["k/11"]) is None
    index.close()


def _read_truncated(directory: str, software: bool, out) -> None:
    """Another process (it would die of SIGBUS without the fault guard): an in-pool table
    with keys, its reader, then the pool file truncated under it; every read of the table
    again, each answer sent on `out` (a pipe's end)."""
    pool = pool_with_area(Path(directory), 1024)
    keys = [f"k/{i}" for i in range(20)]
    index = LocalIndex("shm", pool.path, "gen-1", in_pool=pool, software=software)
    publish(index, keys)
    _values, regions = region_with_bytes(32 * 4096)  # (kept: only the table faults)
    reader = in_pool_reader(pool, index)._reader
    cols = columns(reader, keys, regions)
    got: dict = {"before": cols[1].tolist(), "count_before": reader.count}
    area = shmindex.map_area(pool.path, 4096, shmindex.area_bytes(1024))
    table, use = shmindex.area_views(area, 1024)
    os.truncate(pool.path, 0)
    got["probe"] = columns(reader, keys, regions)
    got["read"] = fused_read(reader, keys[:4], regions, 4096)[0]
    got["contains"], got["leading"] = reader.contains(keys), reader.leading(keys)
    got["changed"] = reader.changed(cols[5].tobytes(), cols[6].tobytes())
    got["retired"], got["incomplete"] = reader.retired, reader.incomplete
    got["successor"], got["count"] = reader.successor, reader.count
    for name, call in [
        ("pool_generation", lambda: reader.pool_generation),
        ("new_reader", lambda: shmindex.Reader(table, use, software)),
    ]:
        try:
            call()
            got[name] = "no error"
        except (OSError, ValueError) as exc:
            got[name] = f"{type(exc).__name__}: {exc}"
    out.send(got)
    os._exit(0)  # (the server's side, the writer, would fault at its close: not tested here)


@pytest.mark.parametrize("software", [False, True], ids=["hardware", "software"])
def test_an_in_pool_table_truncated_under_its_reader_faults_into_asking_the_server(
    tmp_path, software
):
    """The in-pool table is pool memory, which a shm pool's truncation takes away: every
    read of it runs under `_memcopy.c`'s fault guard (through its FAULT_GUARD capsule), so
    each call answers "ask the server" (probe, read, contains, leading), "not proven"
    (changed) or "retired" (the header), and the process lives. Before: SIGBUS."""
    context = mp.get_context("spawn")
    here, there = context.Pipe(duplex=False)
    proc = context.Process(target=_read_truncated, args=(str(tmp_path), software, there))
    proc.start()
    proc.join(120)
    assert proc.exitcode == 0, f"the reader died ({proc.exitcode}: -7 is SIGBUS)"
    assert here.poll(10)
    got = here.recv()
    assert got["before"] == [100 + i for i in range(20)] and got["count_before"] == 20
    assert got["probe"] is None and got["read"] is None  # the server answers the batch
    assert got["contains"] is None and got["leading"] is None
    assert got["changed"] == b"\x01" * 20  # no copy proven by a table that faulted
    assert got["retired"] and got["incomplete"] and got["successor"] == ""
    assert got["count"] == 0
    assert got["pool_generation"].startswith("OSError") and "faulted" in got["pool_generation"]
    assert got["new_reader"].startswith("ValueError") and "faulted" in got["new_reader"]


def test_a_probe_answers_for_the_keys_asked_though_another_thread_changes_their_list(index):
    """A probe of GIL_FREE_FROM keys or more (and every fused read) runs without the GIL, so
    another thread may change the caller's key list meanwhile and free the keys it held (here
    at once reused by keys of the same size). The probe holds its own references (a snapshot
    of the list): it answers for the keys asked. Before, such a race read the freed keys'
    bytes: a few probes a second here found other keys' answers (or none) in theirs."""
    import sys
    import threading

    n = 4096
    index.publish(
        [f"ns:{i:064x}" for i in range(n)], [1] * n, [0] * n, [4096] * n, None, regions=REGIONS
    )
    reader = _open(index.path, os.getuid())
    asked: list[str] = []
    state = {"calling": False, "stop": False, "filler": None}

    def change_the_list_during_each_probe():
        while not state["stop"]:
            others = [f"ns:{i + 10**6:064x}" for i in range(n)]  # not published
            while not state["calling"] and not state["stop"]:
                pass
            asked[:] = others  # frees the keys the probe was given...
            state["filler"] = [f"ns:{i + 2 * 10**6:064x}" for i in range(n)]  # ...reusing them
            state["calling"] = False

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # (the changing thread takes the GIL as soon as it is dropped)
    changer = threading.Thread(target=change_the_list_during_each_probe)
    changer.start()
    wrong, probes, deadline = 0, 0, time.monotonic() + 2.0
    try:
        while time.monotonic() < deadline:
            asked[:] = [f"ns:{i:064x}" for i in range(n)]  # the published keys, as new objects
            state["calling"] = True
            wrong += reader.contains(asked) != [True] * n
            probes += 1
            while state["calling"] and changer.is_alive():
                pass
    finally:
        state["stop"] = True
        changer.join(timeout=10)
        sys.setswitchinterval(interval)
    assert probes > 10 and wrong == 0
