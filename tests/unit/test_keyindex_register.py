"""REGISTER_KV's per-key work in C (`maru.server._keyindex`): `add_entries(..., grouped=True)`
(the insert and the new keys counted per region and length), `length_groups` (the same count
for keys that go) and `pack_record` (the journal's records in msgpack). Each against a plain
Python statement of what it must return, on the edge cases: keys repeated in a batch, keys
registered before, several regions and lengths, bad columns (nothing changes), and a "K" record
that cannot be written (the registry takes the keys back, counters included)."""

from __future__ import annotations

import errno
import random
from pathlib import Path
from typing import Any

import msgpack
import pytest

from maru.common.protocol import RegisterStatus
from maru.server import _keyindex as keyindex
from maru.server.journal import JournalWriteError

from .keyindex_model import OrderedKeyIndex, py_length_groups
from .test_eviction_leases import consistent
from .test_registry_bulk import Recorder, full_state, recounted, setup

REG, EXISTS, REJ = (int(s) for s in RegisterStatus)


def py_groups(region_ids: list[int], lengths: list[int], keep: list[bool] | None = None):
    """The model's counts of the kept rows as (region id, {length: keys}) pairs: the order of
    the regions is part of what is checked."""
    kept = [i for i in range(len(region_ids)) if keep is None or keep[i]]
    groups = py_length_groups([region_ids[i] for i in kept], [lengths[i] for i in kept])
    return list(groups.items())


def entries(index: keyindex.KeyIndex) -> list[tuple]:
    return [(k, e.region_id, e.offset, e.length, e.checksum) for k, e in index.items()]


@pytest.mark.parametrize("seed", range(4))
def test_grouped_add_matches_the_plain_add_and_counts_only_the_new_keys(seed: int) -> None:
    """Batches that repeat keys, name registered ones, and span regions and lengths: the same
    flags and entries as `add_entries` without grouping, and the counts of the new keys."""
    rng = random.Random(seed)
    grouped, plain, model = keyindex.KeyIndex(), keyindex.KeyIndex(), OrderedKeyIndex()
    for _ in range(200):
        n = rng.randint(0, 40)
        keys: list[Any] = [rng.choice([f"k{rng.randrange(150)}", b"b%d" % rng.randrange(9)])]
        keys = [rng.choice([*keys, f"k{rng.randrange(150)}"]) for _ in range(n)]
        region_ids = [rng.choice([1, 1, 1, 2, 7]) for _ in range(n)]
        lengths = [rng.choice([4096, 4096, 100, 2**40]) for _ in range(n)]
        offsets = [rng.randrange(1 << 20) for _ in range(n)]
        sums = [rng.randrange(-(2**63), 2**63) for _ in range(n)] if rng.random() < 0.5 else None
        want = plain.add_entries(keys, region_ids, offsets, lengths, sums)
        new, groups = grouped.add_entries(keys, region_ids, offsets, lengths, sums, True)
        assert new == want
        assert list(groups.items()) == py_groups(region_ids, lengths, new)
        model_new, model_groups = model.add_entries(keys, region_ids, offsets, lengths, sums, True)
        assert (new, list(groups.items())) == (model_new, list(model_groups.items()))
        assert entries(grouped) == entries(plain)
        if rng.random() < 0.2:  # some go, so that keys come back
            for key in rng.sample(list(plain), min(len(plain), 20)):
                del plain[key], grouped[key], model[key]


def test_grouped_add_of_repeated_and_registered_keys() -> None:
    index = keyindex.KeyIndex()
    assert index.add_entries(["a"], [1], [0], [8], None, True) == (None, {1: {8: 1}})
    # "a" registered before, "b" twice in the batch: the first "b" wins, and only it counts
    columns = [[2, 2, 3, 1], [0, 8, 16, 24], [8, 8, 4, 16]]
    new, groups = index.add_entries(["a", "b", "b", "c"], *columns, None, True)
    assert new == [False, True, False, True]
    assert list(groups.items()) == [(2, {8: 1}), (1, {16: 1})]
    assert entries(index) == [("a", 1, 0, 8, 0), ("b", 2, 8, 8, 0), ("c", 1, 24, 16, 0)]
    assert index.add_entries(["a", "b"], [1, 1], [0, 0], [8, 8], None, True) == (
        [False, False],
        {},
    )
    assert index.add_entries([], [], [], [], None, True) == (None, {})


@pytest.mark.parametrize(
    ("columns", "error"),
    [
        ((["x", "y"], [1, "2"], [0, 0], [8, 8]), TypeError),  # a region id not an int
        ((["x", "y"], [1, 2**63], [0, 0], [8, 8]), OverflowError),  # nor an int64
        ((["x", "y"], [1, 2], [0, 0], [8, None]), TypeError),
        ((["x", "y"], [1], [0, 0], [8, 8]), ValueError),  # columns of different lengths
        ((["x", 3], [1, 2], [0, 0], [8, 8]), TypeError),  # a key not str or bytes
    ],
)
def test_a_bad_column_changes_nothing(columns, error) -> None:
    index = keyindex.KeyIndex()
    index.add_entries(["y"], [5], [0], [8], None)
    with pytest.raises(error):
        index.add_entries(*columns, None, True)
    assert entries(index) == [("y", 5, 0, 8, 0)]


def test_length_groups() -> None:
    rids, lengths = [1, 2, 1, 3, 3, 2, 2], [8, 8, 8, 4, 8, 8, 8]
    assert list(keyindex.length_groups(rids, lengths).items()) == py_groups(rids, lengths)
    assert list(keyindex.length_groups(rids, lengths).items()) == [
        (1, {8: 2}),
        (3, {4: 1, 8: 1}),
        (2, {8: 3}),
    ]
    assert keyindex.length_groups([], []) == {}
    rng = random.Random(5)
    for _ in range(100):
        n = rng.randint(1, 60)
        rids = [rng.choice([1, 2, 3, 2**40]) for _ in range(n)]
        lengths = [rng.choice([1, 4096, 2**33]) for _ in range(n)]
        assert list(keyindex.length_groups(rids, lengths).items()) == py_groups(rids, lengths)
    with pytest.raises(ValueError):
        keyindex.length_groups([1, 2], [8])
    with pytest.raises(TypeError):
        keyindex.length_groups([1, 2.0], [8, 8])


# where msgpack's form of an int changes (fixint, 8, 16, 32, 64 bits; signed and unsigned)
EDGE_INTS = [0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1, 2**63]
EDGE_INTS += [2**64 - 1, -1, -32, -33, -128, -129, -32768, -32769, -(2**31), -(2**31) - 1]
EDGE_INTS += [-(2**63)]


def random_object(rng: random.Random, depth: int = 0) -> Any:
    """Anything a record or snapshot may hold, at every length where msgpack's form changes."""
    kind = rng.randrange(9 if depth < 4 else 6)
    if kind == 0:
        return rng.choice(EDGE_INTS)
    if kind == 1:
        chars = [chr(rng.choice([0x41, 0xE9, 0x3042, 0x1F511]))] * rng.choice([0, 5, 31, 32, 255])
        return "".join(chars)
    if kind == 2:
        return rng.randbytes(rng.choice([0, 1, 255, 256, 65536]))
    if kind == 3:
        return rng.choice([None, True, False, rng.random(), -0.0, float("inf")])
    if kind in (4, 5):
        return f"ns:{rng.getrandbits(256):064x}"
    if kind == 6:
        return [random_object(rng, depth + 1) for _ in range(rng.choice([0, 3, 15, 16, 40]))]
    if kind == 7:
        return tuple(random_object(rng, depth + 1) for _ in range(rng.randrange(5)))
    names = [f"f{i}" for i in range(rng.choice([0, 2, 15, 16, 17]))]
    return {name: random_object(rng, depth + 1) for name in names}


def test_pack_record_writes_what_msgpack_writes() -> None:
    """Byte for byte: a journal written with it is the journal msgpack would have written, so
    replay (and an older server reading it) sees the same records."""
    keys = [f"ns:{i:064x}" for i in range(256)]
    k_record = ["K", keys, [3] * 256, [i << 16 for i in range(256)], [1 << 16] * 256]
    fixed = [
        k_record,
        ["D", keys],
        ["K", [], [], [], []],
        ["T", 4, 1.5e9],
        ["R", 1, "inst", "/dev/shm/p", 0, 1 << 30, "t"],
        EDGE_INTS,
        {"a": [1, {"b": ()}], 3: None},
        list(range(70000)),
        ["x" * 70000, b"y" * 70000],
    ]
    rng = random.Random(7)
    for obj in fixed + [[random_object(rng) for _ in range(5)] for _ in range(400)]:
        packed = keyindex.pack_record(obj)
        assert packed == msgpack.packb(obj, use_bin_type=True)
        assert msgpack.unpackb(packed, raw=False, strict_map_key=False) == msgpack.unpackb(
            msgpack.packb(obj, use_bin_type=True), raw=False, strict_map_key=False
        )


@pytest.mark.parametrize(
    "obj", [[{1, 2}], [object()], [2**64], [-(2**63) - 1], ["\ud800"], [bytearray(b"x")]]
)
def test_pack_record_refuses_what_it_cannot_write(obj) -> None:
    with pytest.raises((TypeError, OverflowError, UnicodeEncodeError)):
        keyindex.pack_record(obj)


def test_pack_record_refuses_a_record_nested_too_deeply() -> None:
    deep: list[Any] = []
    for _ in range(600):
        deep = [deep]
    with pytest.raises(ValueError):
        keyindex.pack_record(deep)


class FailingJournal(Recorder):
    """Writes every record but a "K" one, as a journal on a full disk fails."""

    def append(self, record: Any) -> None:
        if record[0] == "K":
            raise JournalWriteError(Path("/state"), OSError(errno.ENOSPC, "No space left"))
        super().append(record)


def test_a_k_record_that_cannot_be_written_takes_the_keys_back(tmp_path) -> None:
    """Keys registered before, repeated in the batch, in two regions and of two lengths: the
    failed record leaves the keys, each region's counters and the totals as they were."""
    reg, journal, (r1, r2, _) = setup(tmp_path, "r")
    assert reg.register("A", ["old", "x"], [r1, r2], [0, 0], [4096, 100]) == [REG, REG]
    before = full_state(reg)
    reg.journal = FailingJournal()
    keys = ["old", "n1", "n1", "n2", "n3", "x"]
    columns = [[r1, r1, r2, r2, r1, r2], [0, 8192, 0, 4096, 16384, 0]]
    columns.append([4096, 4096, 4096, 100, 5000, 100])
    with pytest.raises(JournalWriteError):
        reg.register("A", keys, *columns)
    assert full_state(reg) == before
    consistent(reg)
    recounted(reg)
    reg.journal = journal  # and the same batch goes in once the journal can be written
    statuses = reg.register("A", keys, *columns)
    assert statuses == [REG, REG, EXISTS, REG, REG, REG]  # "old", "x": the same place again
    new_rows = [["n1", "n2", "n3"], [r1, r2, r1], [8192, 4096, 16384], [4096, 100, 5000]]
    assert journal.records[-1] == ["K", *new_rows]
    assert (reg.regions[r1].live_keys, reg.regions[r1].live_pages) == (3, 4)  # 5000 B: 2 pages
    consistent(reg)
    recounted(reg)
