"""CLOCK (second-chance) eviction and leases that hold entries, tested on the Registry
directly: a hit only sets a key's `referenced` bit; eviction walks oldest first, spares a
referenced candidate once (clears the bit, moves it to the newest end), and takes a second pass
when everything was referenced; a lease ends on the entries it took, not on a lookup by key."""

from __future__ import annotations

import pytest

from maru.server.registry import Registry, list_keys

from .registry_calls import lease, locate
from .test_eviction_leases import MiB, consistent, fill, make_registry


@pytest.fixture
def reg(tmp_path) -> Registry:
    return make_registry(tmp_path)  # 16 MiB pool, watermarks 0.5 / 0.25


def _lookup(reg: Registry, keys: list[str]) -> None:
    assert None not in locate(reg, keys, "B")[0]


def _lookup_leased(reg: Registry, keys: list[str]) -> None:
    assert reg.leases.release([lease(reg, keys, "B")], "B") == 1


HITS = [_lookup, _lookup_leased]


@pytest.mark.parametrize("hit", HITS, ids=lambda f: f.__name__.strip("_"))
def test_a_hit_key_survives_eviction_of_younger_keys_never_hit(reg, hit):
    rid = reg.request_region("A", 16 * MiB).region_id
    fill(reg, "A", rid, [f"k{i}" for i in range(8)])  # 8 MiB: at the high watermark
    assert not any(e.referenced for e in reg.keys.values())  # new keys start unreferenced
    hit(reg, ["k0"])  # the oldest key
    assert reg.keys["k0"].referenced
    assert next(iter(reg.keys)) == "k0"  # a hit does not reorder the index
    fill(reg, "A", rid, ["k8"])  # 9 MiB: evict 5 MiB
    # k0 got a second chance; the five oldest keys never hit went (k1 is younger than k0)
    assert "k0" in reg.keys and "k1" not in reg.keys
    assert list(reg.keys) == ["k6", "k7", "k8", "k0"]  # spared: moved to the newest end
    assert not reg.keys["k0"].referenced  # ...with its bit cleared: one chance per hit
    assert reg.counters["evictions"] == 5
    consistent(reg)
    # without another hit, k0 is now just another key, evicted in its new place
    assert reg.eviction.evict_for("A", 4 * MiB) == 4 * MiB
    assert list(reg.keys) == []


def test_exists_hits_count_as_references(reg):
    rid = reg.request_region("A", 16 * MiB).region_id
    fill(reg, "A", rid, [f"k{i}" for i in range(8)])
    assert reg.exists(["k0", "missing", 7, None]) == [True, False, False, False]
    assert reg.exists([b"k1"]) == [False]  # a bytes key is another key: k1 is not hit
    assert reg.keys["k0"].referenced and not reg.keys["k1"].referenced
    assert "missing" not in reg.keys
    fill(reg, "A", rid, ["k8"])
    assert "k0" in reg.keys and "k1" not in reg.keys
    assert sorted(reg.keys) == ["k0", "k6", "k7", "k8"]
    consistent(reg)


def test_when_every_candidate_was_hit_a_second_pass_still_frees_enough(reg):
    rid = reg.request_region("A", 16 * MiB).region_id
    names = [f"k{i}" for i in range(8)]
    fill(reg, "A", rid, names)
    reg.pins.pin(["k0"], "A")
    lease_id = lease(reg, ["k1"], "B")
    _lookup(reg, names)  # every key is referenced, busy ones included
    fill(reg, "A", rid, ["k8"])  # 9 MiB: 5 MiB must go, only k2..k7 may
    assert reg.counters["evictions"] == 5 and reg.counters["eviction_rounds"] == 1
    assert reg.live_bytes == 4 * MiB <= reg.eviction.low_watermark * reg.pool.capacity
    # busy keys stay (pinned k0, leased k1), the just-registered k8 stays, and of the spared
    # k2..k7 the second pass took the oldest five
    assert sorted(reg.keys) == ["k0", "k1", "k7", "k8"]
    assert reg.keys["k0"].referenced and reg.keys["k1"].referenced  # busy: not touched
    consistent(reg)

    # the same for evict_for (room in the caller's own regions); the index is now
    # k0, k1, k8, k7 (the second pass kept the order of the keys it had spared)
    assert list(reg.keys) == ["k0", "k1", "k8", "k7"]
    _lookup(reg, ["k7", "k8"])
    assert reg.eviction.evict_for("A", MiB) == MiB
    assert sorted(reg.keys) == ["k0", "k1", "k7"]
    # only busy keys left (and k7): once k7 is gone nothing more can be freed, however wanted
    assert reg.eviction.evict_for("A", 10 * MiB) == MiB
    assert sorted(reg.keys) == ["k0", "k1"]
    assert reg.eviction.evict_for("A", MiB) == 0
    assert reg.leases.release([lease_id], "B") == 1
    consistent(reg)


def test_keys_are_listed_in_the_reverse_of_eviction_order(tmp_path):
    reg = make_registry(tmp_path, high=1.0, low=1.0)  # no watermark eviction
    rid = reg.request_region("A", 16 * MiB).region_id
    fill(reg, "A", rid, [f"k{i}" for i in range(6)])
    _lookup(reg, ["k1", "k4"])
    reg.exists(["k2"])
    listed = [row[0] for row in list_keys(reg, limit=100)[0]]
    assert listed == ["k4", "k2", "k1", "k5", "k3", "k0"]  # referenced first, newest first
    assert list_keys(reg, limit=2) == ([["k4", MiB, "A"], ["k2", MiB, "A"]], True)
    evicted = []
    while reg.keys:
        before = set(reg.keys)
        assert reg.eviction.evict_for("A", 1) == MiB
        evicted += before - set(reg.keys)
    assert evicted == listed[::-1]


def test_release_decrements_the_entries_of_that_lease_only(reg):
    rid = reg.request_region("A", 16 * MiB).region_id
    fill(reg, "A", rid, ["a", "b", "c"])
    first = lease(reg, ["a", "b", "missing", "b"], "B")
    second = lease(reg, ["b", "c", "missing"], "A")
    assert [e.leases for e in reg.leases[first].entries] == [1, 3, 3]  # a, b, b: b held 3x
    assert reg.leases[first].entries == [reg.keys[k] for k in ("a", "b", "b")]
    assert {k: e.leases for k, e in reg.keys.items()} == {"a": 1, "b": 3, "c": 1}
    consistent(reg)
    assert reg.leases.release([first], "B") == 1
    assert {k: e.leases for k, e in reg.keys.items()} == {"a": 0, "b": 1, "c": 1}
    assert reg.leases.release([first], "B") == 0  # idempotent: nothing decremented twice
    assert {k: e.leases for k, e in reg.keys.items()} == {"a": 0, "b": 1, "c": 1}
    consistent(reg)
    assert reg.eviction.evict_for("A", 3 * MiB) == MiB  # only a is idle
    assert sorted(reg.keys) == ["b", "c"]
    assert reg.leases.release([second], "A") == 1
    assert not any(e.busy for e in reg.keys.values())
    consistent(reg)
