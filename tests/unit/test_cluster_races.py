"""The cluster tier's races, in fixed orders through the real `ClusterTier` and `Registry`
(only the sidecar process stands in: `Popen` is replaced and its replies are applied as the
loop applies them): a pull against the node's own writes and deletes, against a request that
asks the tier to give regions back, against a sidecar restart; publish holds against deletes.
Each pins a promise of docs/reliability.md's cluster rows: a hit is the registered bytes or a
miss, never a second version, never pages handed out twice."""

from __future__ import annotations

import json

import pytest

from maru.common.protocol import DeleteStatus, ProtocolError, RegisterStatus
from maru.server.cluster import tier as tier_module
from maru.server.cluster.link import Link
from maru.server.cluster.proof import LENGTH, PUBLISHED
from maru.server.cluster.tier import ClusterTier

from .registry_calls import locate, register
from .test_cluster_tier import SGLANG_FILE, FakeSidecar
from .test_eviction_leases import MiB, consistent, make_registry


@pytest.fixture
def tier(tmp_path, monkeypatch):
    monkeypatch.setattr(tier_module.subprocess, "Popen", FakeSidecar)
    config = tmp_path / "mooncake.json"
    config.write_text(json.dumps(SGLANG_FILE))
    t = ClusterTier(make_registry(tmp_path, pool_mib=64, high=1.0, low=1.0), str(config))
    ends = [connect(t)]
    yield t
    t.close()
    for end in ends:
        end.close()


def connect(t: ClusterTier) -> Link:
    """A fresh channel whose other end stays open (sends succeed), the tier connected; returns
    that end."""
    t.link, theirs = Link.pair()
    t._apply({"op": "state", "connected": True, "error": None})
    return theirs


def pull_in_flight(t: ClusterTier, key: str, length: int = MiB) -> tuple[int, object]:
    """A pull of `key` sent (its length guessed), not answered: (batch id, batch)."""
    t.guess = length
    assert t.want([key]) == 1
    ((batch_id, batch),) = [(i, b) for i, b in t.batches.items() if b.op == "pull"]
    return batch_id, batch


def proven(t: ClusterTier, batch_id: int, *results: list) -> None:
    t._apply({"op": "pull-done", "batch": batch_id, "results": list(results), "error": None})


def test_a_local_write_during_a_pull_wins_and_the_pulled_pages_go_back(tier):
    reg = tier.registry
    batch_id, _ = pull_in_flight(tier, "K")
    rid = reg.request_region("A", 16 * MiB).region_id
    assert register(reg, "A", [["K", rid, 0, MiB]]) == [RegisterStatus.REGISTERED]
    proven(tier, batch_id, [PUBLISHED, 77])
    assert locate(reg, ["K"])[0] == [[rid, 0, MiB]]
    assert all(pages.used == 0 for pages in tier.pages.free_lists.values())
    consistent(reg)


def test_a_value_registered_again_during_a_pull_is_the_one_read(tier):
    reg = tier.registry
    rid = reg.request_region("A", 16 * MiB).region_id
    register(reg, "A", [["K", rid, 0, MiB]])
    assert reg.delete(["K"]) == [DeleteStatus.DELETED]
    batch_id, _ = pull_in_flight(tier, "K")
    register(reg, "A", [["K", rid, MiB, MiB]])
    proven(tier, batch_id, [PUBLISHED, 77])
    assert locate(reg, ["K"])[0] == [[rid, MiB, MiB]]
    consistent(reg)


def test_a_region_a_pull_lands_in_is_never_given_back(tier):
    reg = tier.registry
    batch_id, batch = pull_in_flight(tier, "K")
    landing, offset = batch.places[0]
    for _ in range(3):
        reg.request_region("A", 16 * MiB)
    with pytest.raises(ProtocolError):  # (the pool full: the tier is asked to give back)
        reg.request_region("B", 16 * MiB)
    assert not reg.regions[landing].returned
    proven(tier, batch_id, [PUBLISHED, 77])
    assert locate(reg, ["K"])[0] == [[landing, offset, MiB]]
    consistent(reg)


def test_a_late_reply_of_a_restarted_sidecar_registers_nothing(tier):
    reg = tier.registry
    batch_id, batch = pull_in_flight(tier, "K")
    tier.start()  # (as housekeeping does on a stall: the batch fails, its pages go back)
    end = connect(tier)
    try:
        _, again = pull_in_flight(tier, "K2")
        assert again.places == batch.places  # K's pages, reserved for K2 now
        proven(tier, batch_id, [PUBLISHED, 77])
        assert locate(reg, ["K"])[0] == [None]
        consistent(reg)
    finally:
        end.close()


def test_pages_reserved_for_a_length_retry_are_none_of_a_proven_values(tier):
    """A value of another length is pulled again (its pages reserved) before the proven
    values of the batch are registered: those pages are not handed out twice."""
    reg = tier.registry
    tier.guess = MiB
    assert tier.want(["G", "M"]) == 2
    ((batch_id, _),) = [(i, b) for i, b in tier.batches.items() if b.op == "pull"]
    proven(tier, batch_id, [PUBLISHED, 77], [LENGTH, 3 * MiB])
    ((_, retry),) = [(i, b) for i, b in tier.batches.items() if b.op == "pull"]
    region, start, length = locate(reg, ["G"])[0][0]
    other, at = retry.places[0]
    assert other != region or at >= start + length or at + 3 * MiB <= start
    consistent(reg)


def test_a_key_being_published_cannot_be_deleted(tier):
    reg = tier.registry
    rid = reg.request_region("A", 16 * MiB).region_id
    register(reg, "A", [["W", rid, 0, MiB]])
    tier.sealed(["W"], [RegisterStatus.REGISTERED], RegisterStatus.REGISTERED)
    assert any(b.op == "publish" for b in tier.batches.values())
    assert reg.delete(["W"]) == [DeleteStatus.PINNED]


def test_spilled_victims_stay_registered_and_unfreed_until_published(tier):
    reg = tier.registry
    tier.publish_mode = "spill"
    reg.eviction.spill = tier.spill
    rid = reg.request_region("A", 16 * MiB).region_id
    register(reg, "A", [[f"s{i}", rid, i * MiB, MiB] for i in range(4)])
    reg.eviction.evict(2 * MiB, spill=True)
    publishing = [b for b in tier.batches.values() if b.op == "publish"]
    assert publishing and all(key in reg.keys for key in publishing[0].keys)
    keys = publishing[0].keys
    assert reg.delete(keys) == [DeleteStatus.PINNED] * len(keys)
    assert reg.instances.take_freed("A") == []
