"""The C key index (`maru.server._keyindex.KeyIndex`) against its pure-Python model
(`OrderedKeyIndex`, an OrderedDict, in `keyindex_model.py`): random operations, batch calls
included, leave both with the same keys, entries and order; plus what a dict would not check
for us (iteration under change, rebuilds, str and bytes keys of every width)."""

from __future__ import annotations

import gc
import random
import sys

import pytest

from maru.common.protocol import freed_notices
from maru.server import _keyindex as keyindex

from .keyindex_model import (
    OrderedKeyIndex,
    py_batch_fits,
    py_entry_locations,
    py_release_entries,
)

KeyIndex = keyindex.KeyIndex


def random_key(rng: random.Random, universe: int) -> str | bytes:
    """Keys that collide in a small table: few of them, str and bytes of the same text, and
    str of each internal width (1, 2 and 4 bytes per character)."""
    i = rng.randrange(universe)
    return rng.choice([f"k{i}", f"k{i}".encode(), f"ключ{i}", f"\U0001f511{i}"])


def entry(i: int = 0) -> keyindex.KeyEntry:
    return keyindex.KeyEntry(1, i, 8)


def add(index, key, i: int = 0) -> None:
    """Register `key` at offset `i` of region 1 (8 bytes), unless it is there."""
    index.add_entries([key], [1], [i], [8], None)


def fields(e) -> tuple | None:
    """What an entry says (entries of the two indexes are different objects)."""
    if e is None:
        return None
    return (e.region_id, e.offset, e.length, e.checksum, e.pins, e.leases, e.referenced)


def same(index, model) -> None:
    assert len(index) == len(model)
    assert list(index) == list(model)
    for reverse in (False, True):
        got = [(k, fields(e)) for k, e in index.items(reverse=reverse)]
        assert got == [(k, fields(e)) for k, e in model.items(reverse=reverse)]
    assert list(map(fields, index.values())) == list(map(fields, model.values()))


@pytest.mark.parametrize("seed", range(6))
def test_random_operations_match_the_ordered_dict_model(seed: int) -> None:
    rng = random.Random(seed)
    index, model = KeyIndex(), OrderedKeyIndex()
    universe = rng.choice([8, 50, 3000])
    for _ in range(6000):
        op = rng.random()
        key = random_key(rng, universe)
        if op < 0.30:
            offset = rng.randrange(1 << 40)
            add(index, key, offset)
            add(model, key, offset)
        elif op < 0.55:
            if key in model:
                del index[key]
                del model[key]
            else:
                with pytest.raises(KeyError):
                    del index[key]
        elif op < 0.65:
            if key in model:
                index.move_to_end(key)
                model.move_to_end(key)
            else:
                with pytest.raises(KeyError):
                    index.move_to_end(key)
        elif op < 0.75:
            keys = [random_key(rng, universe) for _ in range(rng.randrange(0, 100))]
            assert list(map(fields, index.get_many(keys))) == list(
                map(fields, model.get_many(keys))
            )
        elif op < 0.85:
            keys = [random_key(rng, universe) for _ in range(rng.randrange(0, 100))]
            columns = [[rng.randrange(1, 4) for _ in keys], [rng.randrange(1 << 40) for _ in keys]]
            columns += [[rng.randrange(1, 1 << 20) for _ in keys]]
            sums = rng.choice([None, [rng.randrange(-(1 << 63), 1 << 63) for _ in keys]])
            got = index.add_entries(keys, *columns, sums)
            assert got == model.add_entries(keys, *columns, sums)
            assert got is None or (len(got) == len(keys) and not all(got))
        elif op < 0.97:
            assert (key in index) == (key in model)
            assert fields(index.get(key)) == fields(model.get(key))
        elif op < 0.98:  # delete the oldest keys, as eviction does
            for old in list(model)[: rng.randrange(1, 20)]:
                del index[old]
                del model[old]
        elif op < 0.99:  # in one call, sometimes with a key absent or named twice
            keys = rng.sample(list(model), min(len(model), rng.randrange(0, 80)))
            if keys and rng.random() < 0.3:
                keys.insert(rng.randrange(len(keys)), rng.choice([keys[0], key, 7]))
            try:
                model.remove_many(keys)
            except KeyError as exc:
                with pytest.raises(KeyError) as raised:
                    index.remove_many(keys)
                assert raised.value.args == exc.args
            else:
                assert index.remove_many(keys) is None
            same(index, model)
        else:
            same(index, model)
    same(index, model)
    for key in list(model):
        del index[key]
    assert len(index) == 0 and list(index) == [] and index.get_many(["k1"]) == [None]
    add(index, "again", 7)
    assert [(k, e.offset) for k, e in index.items()] == [("again", 7)]


def test_misses_and_bad_keys() -> None:
    index = KeyIndex()
    add(index, "a")
    value = index["a"]
    assert index.get(1) is None and 1 not in index
    assert index.get_many([1, None, ["unhashable"], "a"]) == [None, None, None, value]
    for each in (index, OrderedKeyIndex()):
        for bad in (1, ("a",), bytearray(b"a")):
            with pytest.raises(TypeError):
                add(each, bad)
        with pytest.raises(TypeError):  # all or nothing: the good key before the bad one stays out
            each.add_entries(["b", 2], [1, 1], [0, 8], [8, 8], None)
        assert "b" not in each
        with pytest.raises(TypeError):  # keys are added with add_entries only
            each["b"] = value
        with pytest.raises(ValueError):
            each.add_entries(["b"], [1], [], [8], None)
        with pytest.raises(ValueError):
            each.add_entries(["b"], [1], [0], [8], [1, 2])
        assert "b" not in each
        with pytest.raises(KeyError):
            each["missing"]
        with pytest.raises(KeyError):
            del each["missing"]
    for number in ("1", 1.0, 1 << 64):  # the C index stores int64s, read before any change
        with pytest.raises((TypeError, OverflowError)):
            KeyIndex().add_entries(["b", "c"], [1, 1], [0, number], [8, 8], None)
    with pytest.raises(TypeError):
        KeyIndex({"a": 1})


def test_add_entries_reports_which_keys_were_new_and_keeps_the_first_writer() -> None:
    for index in (KeyIndex(), OrderedKeyIndex()):
        assert index.add_entries(["x", "y"], [1, 1], [0, 8], [8, 8], [5, 6]) is None  # all new
        assert index.add_entries(["z", "x", "z"], [2, 2, 2], [16, 24, 32], [8, 8, 8], None) == [
            True,
            False,
            False,
        ]
        assert [fields(index[k])[:4] for k in ("x", "y", "z")] == [
            (1, 0, 8, 5),
            (1, 8, 8, 6),
            (2, 16, 8, 0),
        ]
        assert index.add_entries([], [], [], [], None) is None


def test_batch_fits_matches_the_python_model() -> None:
    """`batch_fits` (C) decides as `py_batch_fits` does, for every reason a batch may not
    take the bulk path."""
    good = (["k1", b"k2"], 256, [1, 2], [0, 64], [64, 64], {1: 128, 2: 128})
    cases = [good]
    for i, bad in [
        (0, ["k1", ""]),  # an empty key
        (0, ["k1", "x" * 257]),  # too long
        (0, ["k1", 5]),  # not str or bytes
        (0, ["k1", bytearray(b"k")]),
        (0, []),  # nothing
        (2, [1, 3]),  # a region not the caller's
        (3, [0, 65]),  # past its region's end
        (3, [-1, 64]),
        (4, [64, 0]),  # an empty value
        (4, [64, -8]),
        (3, [0, 1 << 63]),  # past int64
        (4, [64, 1.0]),  # not ints
        (2, [1, True]),
        (4, [64]),  # columns of unequal length
    ]:
        case = list(good)
        case[i] = bad
        cases.append(tuple(case))
    cases.append((["k1"], 256, [1], [64], [64], {1: 128}))  # exactly to the end
    cases.append((["é" * 256], 256, [1], [0], [8], {1: 128}))  # 256 characters, 512 bytes
    for case in cases:
        assert keyindex.batch_fits(*case) == py_batch_fits(*case), case
    assert keyindex.batch_fits(*good) and not keyindex.batch_fits(*cases[1])


def test_iteration_under_change_raises() -> None:
    index = KeyIndex()
    index.add_entries([f"k{i}" for i in range(10)], [1] * 10, list(range(10)), [8] * 10, None)
    for change in (
        lambda: add(index, "new"),
        lambda: index.__delitem__("k5"),
        lambda: index.move_to_end("k0"),
    ):
        it = index.items()
        next(it)
        change()
        with pytest.raises(RuntimeError):
            next(it)
    it = iter(index)
    next(it)
    add(index, "k2")  # a key that is there already is not a change of the index
    assert next(it) == "k2"


def test_growth_churn_and_order_at_scale() -> None:
    """Rebuilds (growth, compaction after churn) keep order and every key."""
    index, model = KeyIndex(), OrderedKeyIndex()
    keys, columns = [f"k{i}" for i in range(50_000)], ([1] * 50_000, list(range(50_000)))
    index.add_entries(keys, *columns, [8] * 50_000, None)
    model.add_entries(keys, *columns, [8] * 50_000, None)
    for i in range(0, 50_000, 2):  # churn: delete half, move a tenth, add as many again
        del index[f"k{i}"]
        del model[f"k{i}"]
    for i in range(1, 50_000, 10):
        index.move_to_end(f"k{i}")
        model.move_to_end(f"k{i}")
    keys, columns = [f"n{i}" for i in range(30_000)], ([2] * 30_000, list(range(30_000)))
    index.add_entries(keys, *columns, [8] * 30_000, None)
    model.add_entries(keys, *columns, [8] * 30_000, None)
    same(index, model)
    assert sys.getsizeof(index) < 64 * len(index)  # no more than a few words per key


def test_entries_are_released_and_not_tracked_by_the_gc() -> None:
    index = KeyIndex()
    add(index, "a")
    probe = index["a"]
    refs = sys.getrefcount(probe)
    index.get_many(["a"] * 10)  # the results list was dropped
    list(index.items())
    assert sys.getrefcount(probe) == refs
    del index["a"]
    assert sys.getrefcount(probe) == refs - 1
    assert not gc.is_tracked(index)  # KeyEntry values reference nothing: no cycle through it


def test_lookup_columns_and_release_match_the_python_model() -> None:
    rng = random.Random(3)
    index, model = KeyIndex(), OrderedKeyIndex()
    for _ in range(300):
        key = random_key(rng, 200)
        where = (rng.randrange(1, 4), rng.randrange(1 << 40), rng.randrange(1, 1 << 20))
        where += (rng.choice([0, rng.randrange(-(1 << 63), 1 << 63)]),)  # the checksum, or none
        index.add_entries([key], *([w] for w in where))
        model.add_entries([key], *([w] for w in where))
    leases: list[tuple[list, list]] = []
    for i in range(200):
        keys = [random_key(rng, 250) for _ in range(rng.randrange(0, 140))]
        lease = i % 2 == 0
        got, want = index.lookup_columns(keys, lease), model.lookup_columns(keys, lease)
        assert got[1:] == want[1:]  # the columns (checksums included), byte for byte
        assert [(e.region_id, e.offset, e.length, e.checksum) for e in got[0]] == [
            (e.region_id, e.offset, e.length, e.checksum) for e in want[0]
        ]
        if lease:
            leases.append((got[0], want[0]))
        if leases and rng.random() < 0.4:
            held, held_model = leases.pop(rng.randrange(len(leases)))
            keyindex.release_entries(held)
            py_release_entries(held_model)
        state = [(e.leases, e.referenced) for e in index.values()]
        assert state == [(e.leases, e.referenced) for e in model.values()]
    for held, held_model in leases:
        keyindex.release_entries(held)
        keyindex.release_entries(held)  # never below zero
        py_release_entries(held_model)
    assert not any(e.busy for e in index.values())


def test_release_refuses_foreign_values_and_entries_are_fixed_where_they_are() -> None:
    value = entry()
    with pytest.raises(TypeError):
        keyindex.release_entries([value, object()])
    with pytest.raises(AttributeError):
        value.offset = 5  # where a key's bytes are is fixed
    with pytest.raises(TypeError):
        keyindex.KeyEntry(1, 2)


@pytest.mark.parametrize("seed", range(4))
def test_clock_victims_match_the_python_model(seed: int) -> None:
    """Eviction's walk in C takes the same victims, spares the same keys and leaves the same
    order and CLOCK bits as the model, for every mix of busy, used, protected keys and
    region filters, one walk or two."""
    rng = random.Random(seed)
    index, model = KeyIndex(), OrderedKeyIndex()
    for round_ in range(60):
        keys = [f"r{round_}k{i}" for i in range(rng.randrange(0, 80))]
        columns = [[rng.randrange(1, 4) for _ in keys], [0] * len(keys)]
        columns += [[rng.randrange(1, 9) for _ in keys]]
        index.add_entries(keys, *columns, None)
        model.add_entries(keys, *columns, None)
        for e, m in zip(index.values(), model.values()):  # the same uses, pins and leases
            e.referenced = m.referenced = rng.random() < 0.4
            e.pins = m.pins = int(rng.random() < 0.1)
            e.leases = m.leases = int(rng.random() < 0.1)
        live = list(model)
        protect = set(rng.sample(live, min(len(live), rng.randrange(0, 5)))) or None
        regions = rng.choice([None, {1}, {2, 3}, set(), {3, 1, 1 << 40}, frozenset({2})])
        want = rng.choice([0, 1, 40, 400, 1 << 40])
        second_chance = rng.random() < 0.8
        got = index.clock_victims(want, second_chance, protect, regions)
        expected = model.clock_victims(want, second_chance, protect, regions)
        assert got[0] == expected[0] and got[2] == expected[2]
        assert list(map(fields, got[1])) == list(map(fields, expected[1]))
        same(index, model)  # order (the spared moved to the end) and bits
        for key in got[0][: rng.randrange(0, len(got[0]) + 1)]:  # some victims dropped
            del index[key]
            del model[key]
    same(index, model)


@pytest.mark.parametrize("seed", range(4))
def test_reclaim_order_matches_the_python_model(seed: int) -> None:
    """A region reclaim's order (`Eviction._free_one`) in C is the model's, for every mix of
    used, busy and absent keys, deletions and spared keys moved to the end."""
    rng = random.Random(seed)
    index, model = KeyIndex(), OrderedKeyIndex()
    for round_ in range(40):
        keys = [f"r{round_}k{i}" for i in range(rng.randrange(0, 60))]
        columns = [[rng.choice([1, 2, 3, 7, 1 << 40]) for _ in keys], [0] * len(keys)]
        columns += [[rng.randrange(1, 9) for _ in keys]]
        index.add_entries(keys, *columns, None)
        model.add_entries(keys, *columns, None)
        for e, m in zip(index.values(), model.values()):
            e.referenced = m.referenced = rng.random() < 0.5
            e.pins = m.pins = int(rng.random() < 0.03)
            e.leases = m.leases = int(rng.random() < 0.03)
        regions = rng.choice([set(), {1}, {2, 3, 9}, {1, 2, 3, 7, 1 << 40}, frozenset({7})])
        assert index.reclaim_order(regions) == model.reclaim_order(regions)
        for key in rng.sample(list(model), min(len(model), rng.randrange(0, 20))):
            if rng.random() < 0.5:
                del index[key]
                del model[key]
            else:
                index.move_to_end(key)
                model.move_to_end(key)
    for bad in ([1], None, {"1"}):
        with pytest.raises(TypeError):
            index.reclaim_order(bad)


def test_clock_victims_refuse_bad_arguments_and_leave_no_mark() -> None:
    index = KeyIndex()
    index.add_entries(["a", "b"], [1, 1], [0, 8], [8, 8], None)
    for bad in ([["a"], None], [None, [1]], [None, None, None], [None, {1, "2"}]):
        with pytest.raises(TypeError):
            index.clock_victims(8, True, *bad)
    with pytest.raises(OverflowError):  # (a region id is an int64)
        index.clock_victims(8, True, None, {1 << 64})
    keys, entries, freed = index.clock_victims(8, True, None, None)
    assert keys == ["a"] and freed == 8 and entries == [index["a"]]
    assert not index["a"].referenced  # the walk's own mark is gone


def test_entry_locations_match_the_python_model() -> None:
    index = KeyIndex()
    index.add_entries(["a", "b", "c"], [1, 2, 1], [0, 1 << 40, 64], [64, 8, 1 << 33], None)
    entries = index.get_many(["c", "a", "b"])
    assert keyindex.entry_locations(entries) == py_entry_locations(entries)
    region_ids, lengths, notices = keyindex.entry_locations(entries)
    assert (region_ids, lengths) == ([1, 1, 2], [1 << 33, 64, 8])
    assert freed_notices(notices) == [[1, 64, 1 << 33], [1, 0, 64], [2, 1 << 40, 8]]
    assert keyindex.entry_locations([]) == ([], [], b"")
    with pytest.raises(TypeError):
        keyindex.entry_locations([entries[0], object()])
