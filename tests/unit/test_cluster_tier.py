"""The cluster tier's pure parts: its config file read as SGLang reads it, the proof that
binds a value to its name, and how `maru status` and Prometheus show the tier."""

from __future__ import annotations

import itertools
import json

import pytest

from maru.client.cli import _cluster_line
from maru.server.cluster.config import ClusterConfigError, MooncakeConfig, parse_segment_size
from maru.server.cluster.pages import TierPages
from maru.server.cluster.proof import (
    TRAILER_BYTES,
    decode_trailer,
    encode_trailer,
    object_name,
    value_length,
)
from maru.server.keyindex import release_entries
from maru.server.metrics import CLUSTER_METRICS, _cluster_metrics

from .registry_calls import locate, register
from .test_eviction_leases import MiB, consistent, fill, make_registry

SGLANG_FILE = {
    "local_hostname": "10.0.0.7",
    "metadata_server": "P2PHANDSHAKE",
    "master_server_address": "10.0.0.1:50051",
    "protocol": "tcp",
    "device_name": "",
    "global_segment_size": "2gb",
}


@pytest.fixture(autouse=True)
def no_mooncake_env(monkeypatch):
    for name in ("MOONCAKE_LOCAL_HOSTNAME", "LOCAL_HOSTNAME", "MOONCAKE_PROTOCOL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("MOONCAKE_TENANT_ID", raising=False)


def test_sglangs_file_is_read_with_its_size_forms(tmp_path):
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps(SGLANG_FILE))
    c = MooncakeConfig.from_file(path)
    assert (c.local_hostname, c.master_server_address, c.protocol) == (
        "10.0.0.7",
        "10.0.0.1:50051",
        "tcp",
    )
    assert c.global_segment_size == 2 << 30
    assert c.tenant_id == "default"
    assert [parse_segment_size(v) for v in (4096, "4096", " 3GB ")] == [4096, 4096, 3 << 30]
    for bad in ("gb", "lots", -1, True):
        with pytest.raises(ClusterConfigError, match="global_segment_size"):
            parse_segment_size(bad)


def test_the_environment_names_the_node_before_the_shared_file(monkeypatch):
    monkeypatch.setenv("LOCAL_HOSTNAME", "10.0.0.8")
    assert MooncakeConfig.from_dict(SGLANG_FILE).local_hostname == "10.0.0.8"
    monkeypatch.setenv("MOONCAKE_LOCAL_HOSTNAME", "10.0.0.9")
    assert MooncakeConfig.from_dict(SGLANG_FILE).local_hostname == "10.0.0.9"
    monkeypatch.setenv("MOONCAKE_PROTOCOL", "efa")
    no_protocol = {k: v for k, v in SGLANG_FILE.items() if k != "protocol"}
    assert MooncakeConfig.from_dict(no_protocol).protocol == "efa"
    per_rank = {**SGLANG_FILE, "device_name": '{"0": "mlx5_0", "1": "mlx5_1"}'}
    assert MooncakeConfig.from_dict(per_rank).device_name == "mlx5_0"


@pytest.mark.parametrize(
    "raw, why",
    [
        ({"metadata_server": "P2PHANDSHAKE"}, "master_server_address is required"),
        ({"client_server_address": "10.0.0.1:50052"}, "standalone"),
        ({**SGLANG_FILE, "device_name": "{not json"}, "not valid JSON"),
    ],
)
def test_a_file_the_tier_cannot_use_is_refused_with_the_reason(raw, why):
    with pytest.raises(ClusterConfigError, match=why):
        MooncakeConfig.from_dict(raw)


def test_unreadable_files_are_refused_naming_them(tmp_path):
    with pytest.raises(ClusterConfigError, match="cannot read cluster config"):
        MooncakeConfig.from_file(tmp_path / "missing.json")
    (tmp_path / "list.json").write_text("[]")
    with pytest.raises(ClusterConfigError, match="a JSON object expected"):
        MooncakeConfig.from_file(tmp_path / "list.json")


def test_a_trailer_holds_only_for_its_own_name():
    name = object_name("default", "k/1")
    trailer = encode_trailer(name, 4096, 12345)
    assert len(trailer) == TRAILER_BYTES
    assert decode_trailer(name, trailer) == (4096, 12345)
    assert decode_trailer(object_name("default", "k/2"), trailer) is None  # another key's
    assert decode_trailer(object_name("other", "k/1"), trailer) is None  # another tenant's
    assert decode_trailer(name, trailer[:-1]) is None
    assert decode_trailer(name, bytes(TRAILER_BYTES)) is None  # a value's tail, not a trailer
    assert decode_trailer(name, encode_trailer(name, 4096, 0)) is None  # no checksum: no proof
    assert object_name("t", b"k") != object_name("t", "6b")  # bytes keys never meet str keys
    # A tenant id holding "/" never names another tenant's object (tenant "team" with key
    # "s/k" against tenant "team/s" with key "k"), nor a str key a bytes key's of another.
    assert object_name("team", "s/k") != object_name("team/s", "k")
    assert object_name("t", "x/b/ab") != object_name("t/s/x", b"\xab")
    # Earlier formats named objects maru/... and maru2/...: never looked up, so never a hit.
    assert object_name("t", "k").startswith("maru3/")
    # The value's length in an object: its size less the trailer; none when too short.
    assert value_length(4096 + TRAILER_BYTES) == 4096
    assert value_length(TRAILER_BYTES) is None and value_length(3) is None


TIER = {
    "kind": "mooncake",
    "master": "10.0.0.1:50051",
    "connected": False,
    "error": "Mooncake setup failed: -1",
    "queue_depth": 3,
    "published": 7,
    "publish_drops": 1,
    "pulled": 5,
    "pull_misses": 2,
    "proof_failures": 1,
}


def test_status_shows_the_tier_and_why_it_is_not_connected():
    line = _cluster_line({"cluster": TIER})
    assert "NOT CONNECTED (Mooncake setup failed: -1)" in line
    assert "7 published (3 queued, 1 dropped), 5 pulled, 2 pull misses, 1 proof failures" in line
    assert _cluster_line({"cluster": None}).startswith("off")


def test_prometheus_exports_every_tier_field_and_nothing_without_a_tier():
    pytest.importorskip("prometheus_client")
    families = {f.name: f for f in _cluster_metrics({"cluster": TIER})}
    assert len(families) == len(CLUSTER_METRICS)
    assert families["maru_cluster_pulled"].samples[0].value == 5
    assert families["maru_cluster_connected"].samples[0].value == 0
    assert list(_cluster_metrics({"cluster": None})) == []


def test_a_watermark_round_leaves_the_victims_spill_holds_registered_until_it_drops_them(
    tmp_path,
):
    """`--cluster-publish spill` (`Eviction.spill`): the victims the tier takes stay
    registered, their pages not freed to their owner, until it drops them (once published);
    they count as evicted already, so the next store does not evict more for them. Rounds
    that make room for a writer waiting (`evict_for`) never spill."""
    reg = make_registry(tmp_path)  # 16 MiB: evicts above 8 MiB down to 4 MiB
    taken: list[tuple[list, list]] = []
    not_held: list[list] = []

    def spill(keys: list, entries: list, hold: bool, room_for: str) -> tuple[list, list]:
        if not hold:
            not_held.append(keys)
            return keys, entries
        assert room_for == ""  # (a watermark round: nobody's room)
        taken.append((keys, entries))
        reg.eviction.spilling += sum(e.length for e in entries)
        return [], []  # all held, to publish first

    reg.eviction.spill = spill
    rid = reg.request_region("A", 16 * MiB).region_id
    fill(reg, "A", rid, [f"k{i}" for i in range(9)])
    assert [keys for keys, _ in taken] == [[f"k{i}" for i in range(5)]]
    assert len(reg.keys) == 9 and reg.instances.take_freed("A") == []  # held, not freed
    fill(reg, "A", rid, ["k9"])  # 5 MiB counted as evicted: no round for them again
    assert len(taken) == 1 and len(reg.keys) == 10
    keys, entries = taken[0]
    reg.eviction.spilling = 0
    reg.eviction.view.drop_keys(keys, entries)  # published: dropped now
    assert sorted(reg.keys) == ["k5", "k6", "k7", "k8", "k9"]
    assert reg.instances.take_freed("A") == [[rid, i * MiB, MiB] for i in range(5)]
    assert reg.eviction.evict_for("A", 1) == MiB and len(taken) == 1  # (no spill)
    assert not_held == [["k5"]]  # (offered to the tier to count, not to hold)
    consistent(reg)


def test_room_asked_ahead_is_spilled_and_not_asked_again_while_it_comes(tmp_path):
    """An instance at its `pool_size` asks room for its next writes ahead (`evict_for`
    with `ahead`): with spill, its victims are held for the tier to publish, and the bytes
    on their way to it count against its next ask ahead, which evicts only what they lack.
    A writer that waits for room (no `ahead`) gets it at once, its victims unpublished."""
    reg = make_registry(tmp_path)  # 16 MiB: watermark rounds above 8 MiB, not reached here
    held: list[tuple[list, list, str]] = []

    def spill(keys: list, entries: list, hold: bool, room_for: str) -> tuple[list, list]:
        if not hold:
            return keys, entries
        reg.keys.lookup_columns(keys, True)  # held (leased) until published, as the tier does
        held.append((keys, entries, room_for))
        reg.eviction.coming[room_for] += sum(e.length for e in entries)
        return [], []

    reg.eviction.spill = spill
    rid = reg.request_region("A", 16 * MiB).region_id
    fill(reg, "A", rid, [f"k{i}" for i in range(6)])
    assert reg.eviction.evict_for("A", 2 * MiB, ahead=2 * MiB) == 2 * MiB
    assert [(keys, who) for keys, _, who in held] == [(["k0", "k1"], "A")]
    assert len(reg.keys) == 6 and reg.instances.take_freed("A") == []  # room to come
    assert reg.eviction.evict_for("A", 2 * MiB, ahead=2 * MiB) == 0  # (on its way already)
    assert reg.eviction.evict_for("A", 3 * MiB, ahead=3 * MiB) == MiB  # only what it lacks
    assert [keys for keys, _, _ in held] == [["k0", "k1"], ["k2"]]
    assert reg.eviction.evict_for("A", MiB) == MiB  # a writer waits: k3 goes now
    assert len(held) == 2  # (not held: no spill of room a writer waits for)
    # k3's page, freed and not yet told to A (its next reply does), is room on its way too
    assert reg.eviction.evict_for("A", MiB, ahead=MiB) == 0 and len(held) == 2
    assert "k3" not in reg.keys and reg.instances.take_freed("A") == [[rid, 3 * MiB, MiB]]
    for keys, entries, _ in held:  # published: dropped, their room freed to A
        release_entries(entries)
        reg.eviction.view.drop_keys(keys, entries)
        reg.eviction.coming["A"] -= sum(e.length for e in entries)  # (as the tier does)
    assert sorted(reg.keys) == ["k4", "k5"] and len(reg.instances.take_freed("A")) == 3
    # room for a waiting write and, in the same ask, the next writes': the first part goes
    # now, the second is held (nothing is on its way any more)
    fill(reg, "A", rid, ["k6", "k7"])
    assert reg.eviction.evict_for("A", 2 * MiB, ahead=MiB) == 2 * MiB
    assert held[-1][0] == ["k5"] and sorted(reg.keys) == ["k5", "k6", "k7"]
    assert reg.instances.take_freed("A") == [[rid, 4 * MiB, MiB]]  # k4's page, at once
    release_entries(held[-1][1])
    consistent(reg)


def test_pulled_values_sit_on_the_grid_of_their_own_length(tmp_path):
    """The tier's pages for a pulled value start at a multiple of the value's length in 4 KiB
    pages, whatever was pulled before: an LMCache reader, which names a value by its chunk
    index in the region (`page_index * chunk_size`), finds each full chunk where it is."""
    reg = make_registry(tmp_path)
    pages = TierPages(reg)
    chunk = 12 << 10  # a full chunk: 3 pages (not a power of two)
    lengths = (5000, chunk, 4096, chunk, chunk - 100, chunk)
    places = [pages.reserve(n) for n in lengths]
    assert all(place is not None for place in places)
    offsets = [place[1] for place in places]
    assert all(o % (-(-n // 4096) * 4096) == 0 for n, o in zip(lengths, offsets))
    spans = sorted((o, o + n) for n, o in zip(lengths, offsets))
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))  # no two overlap


def test_room_for_pulls_is_taken_ahead_from_free_room_only(tmp_path):
    """`TierPages.ready` keeps as many bytes free in the tier's regions as the largest pull
    batch so far (at most a sixteenth of the pool), taking a region only when there are fewer,
    and only from the pool's free room: room ahead never evicts a key nor reclaims a region."""
    reg = make_registry(tmp_path, pool_mib=512)
    pages = TierPages(reg)
    pages.ready(20 * MiB)
    assert [p.free for p in pages.free_lists.values()] == [20 * MiB]
    pages.ready(20 * MiB)  # (enough already)
    assert len(pages.free_lists) == 1
    assert pages.reserve(8 * MiB) is not None
    pages.ready(20 * MiB)  # 12 MiB free: one more region, at least REGION_BYTES
    assert sorted(p.free for p in pages.free_lists.values()) == [12 * MiB, 16 * MiB]
    rest = reg.pool.capacity - 36 * MiB
    rid = reg.request_region("A", rest).region_id
    fill(reg, "A", rid, [f"k{i}" for i in range(rest // MiB)])
    reg.park("A", 1, [rid], [])  # (idle: a region request that may reclaim would empty it)
    keys, regions = sorted(reg.keys), sorted(reg.regions)
    pages.ready(64 * MiB)  # 32 MiB wanted (the cap), the pool full: nothing evicted for it
    assert len(pages.free_lists) == 2 and pages.ahead == 32 * MiB
    assert sorted(reg.keys) == keys and sorted(reg.regions) == regions
    consistent(reg)


def test_a_pulls_pages_are_found_without_walking_every_full_region(tmp_path, monkeypatch):
    """A tier holding many full regions reserves a value's pages where the last one went, or
    in the first region with room (the freed pages of an evicted value included), without
    searching the full ones: a node whose tier holds gigabytes took 10-13 ms a 64-value pull
    to walk 256 of them."""
    from maru.common.extents import ExtentAllocator

    reg = make_registry(tmp_path, pool_mib=96)
    pages = TierPages(reg)
    length = 1 << 20
    places = [pages.reserve(length) for _ in range(80)]  # 5 full regions of 16
    assert all(places) and len(pages.free_lists) == 5
    searched = []
    allocate = ExtentAllocator.allocate
    monkeypatch.setattr(
        ExtentAllocator,
        "allocate",
        lambda self, n, a=None: searched.append(self) or allocate(self, n, a),
    )

    def tier_searches() -> int:  # (the pool's own allocator carves regions: not counted)
        ours = {id(allocator) for allocator in pages.free_lists.values()}
        count = sum(id(allocator) in ours for allocator in searched)
        searched.clear()
        return count

    pages.release(*places[3][:2])  # a value of the oldest region evicted: its pages free
    assert pages.reserve(length)[:2] == places[3][:2] and tier_searches() == 2  # (last, then it)
    again = pages.reserve(length)  # none free: a new region, no full one searched
    assert again is not None and again[0] not in {p[0] for p in places} and tier_searches() == 2
    assert pages.reserve(length) is not None and tier_searches() == 1  # where the last one went


def test_a_pull_that_finds_no_region_makes_room_among_the_tiers_own_values(tmp_path):
    """The tier holds a 16 MiB region of pulled values, A (within its share) a parked one of
    its own. A pull that finds the pool full evicts the tier's oldest pulled value (it is in
    the cluster still), not A's keys: before, it took A's parked region back (A's 16 keys
    evicted), and with the fair-share rule alone it found no room (a miss)."""
    reg = make_registry(tmp_path, pool_mib=32, high=1.0, low=1.0)
    pages = TierPages(reg)
    places = [pages.reserve(MiB) for _ in range(16)]
    assert all(places) and len(pages.free_lists) == 1
    tier = pages.instance_id
    register(reg, tier, [[f"pulled{i}", p[0], p[1], MiB] for i, p in enumerate(places)])
    rid = reg.request_region("A", 16 * MiB).region_id
    fill(reg, "A", rid, [f"a{i}" for i in range(16)])
    reg.park("A", 1, [rid], [])
    pages.ready(4 * MiB)  # (the pool full: no region ahead, but a batch's room is 2 MiB)
    place = pages.reserve(MiB)
    assert place is not None and place[:2] == places[0][:2]  # the oldest pulled value's pages
    rounds = reg.counters["eviction_rounds"]
    assert pages.reserve(MiB)[:2] == places[1][:2]  # freed by the same round, for the batch
    assert reg.counters["eviction_rounds"] == rounds == 1
    assert len(reg.keys) == 30 and "pulled0" not in reg.keys and "pulled1" not in reg.keys
    assert all(f"a{i}" in reg.keys for i in range(16)) and rid in reg.instances["A"].regions
    consistent(reg)


def test_the_tiers_regions_go_back_when_a_writer_below_its_share_finds_the_pool_full(tmp_path):
    """Pulled values filling the pool never crowd out the node's own writers: asked to shed
    (another instance, below its fair share, found the pool full), the tier gives back whole
    regions, oldest first, never one a pull is landing in; their keys stay readable until
    the pool reclaims them for the writer, whose next request gets room. Found with
    bench_cluster (2026-12-04): the tier never gave any back, and a full-share writer on the
    pulling node failed 45 of 384 stores every round."""
    from maru.common.protocol import ErrorCode, ProtocolError, RegisterStatus

    reg = make_registry(tmp_path, pool_mib=64, high=1.0, low=1.0)
    pages = TierPages(reg)
    places = [pages.reserve(MiB) for _ in range(64)]  # the pool: four regions of pulls
    keys = [f"pulled/{i}" for i in range(64)]
    rows = [[k, p[0], p[1], MiB] for k, p in zip(keys, places)]
    assert register(reg, pages.instance_id, rows) == [RegisterStatus.REGISTERED] * 64
    regions = list(pages.free_lists)
    assert len(regions) == 4 and reg.pool.used == reg.pool.capacity
    with pytest.raises(ProtocolError) as refused:
        reg.request_region("B", 16 * MiB)
    assert refused.value.code == ErrorCode.POOL_RECLAIMING  # (the tier asked to shed)
    landing = {regions[0]}  # a pull in flight there: not given back
    given = pages.shed(landing)
    assert given == 32 * MiB  # the tier's 64 over its share of 64/2 (A only reads)
    assert list(pages.free_lists) == [regions[0], regions[3]]  # the landing one, the newest
    assert all(reg.regions[r].returned for r in regions[1:3])
    assert all(hit is not None for hit in locate(reg, keys)[0])  # readable until reclaimed
    # (and still known as pulled: a spilling eviction of them publishes nothing again)
    assert all(pages.pulled_into(r) for r in regions) and not pages.pulled_into(-1)
    assert pages.shed(landing) == 0  # (asked once)
    handle = reg.request_region("B", 16 * MiB)
    assert handle.region_id not in regions[:1]
    hits = locate(reg, keys)[0]
    assert all(hits[:16]) and hits.count(None) == 16  # one returned region's keys reclaimed
    assert pages.reserve(MiB) is not None  # (the tier goes on pulling: a returned region)
    consistent(reg)


def test_a_writer_below_its_share_gets_the_tiers_room_in_the_request_that_finds_it_full(
    tmp_path, monkeypatch
):
    """The tier is inside the server: asked to shed, it gives its regions back in the very
    region request that found the pool full (as Plasma evicts before it grants), so the
    writer's first request gets room, where a client's regions come back only on its next
    reply (the writer then waits POOL_RECLAIMING out and asks again). A region a pull is
    landing in is kept."""
    from maru.server.cluster.tier import Batch, ClusterTier

    monkeypatch.setattr(ClusterTier, "start", lambda self: None)  # (no sidecar: pages only)
    config = tmp_path / "mooncake.json"
    config.write_text(json.dumps(SGLANG_FILE))
    reg = make_registry(tmp_path, pool_mib=64, high=1.0, low=1.0)
    tier = ClusterTier(reg, str(config))
    places = [tier.pages.reserve(MiB) for _ in range(64)]  # the pool: four regions of pulls
    keys = [f"pulled/{i}" for i in range(64)]
    register(reg, tier.pages.instance_id, [[k, p[0], p[1], MiB] for k, p in zip(keys, places)])
    regions = list(tier.pages.free_lists)
    assert len(regions) == 4 and reg.pool.used == reg.pool.capacity
    tier.batches[1] = Batch("pull", ["landing"], places=[(regions[0], 0)])  # a pull in flight
    handle = reg.request_region("B", 16 * MiB)  # at once: no POOL_RECLAIMING
    assert handle.region_id not in regions[:1]
    # 32 MiB back, the oldest regions but the landing one: over its share of 64/2 (A reads)
    assert list(tier.pages.free_lists) == [regions[0], regions[3]]
    hits = locate(reg, keys)[0]
    assert all(hits[:16]) and hits.count(None) == 16  # one returned region reclaimed
    assert not reg.regions[regions[0]].returned  # (the pull's pages stay the tier's)
    assert reg.instances.get(tier.pages.instance_id).shed == 0  # (nothing left asked)
    consistent(reg)


def test_a_pulls_proof_on_two_threads_is_the_proof_on_one():
    """A pull's values past SPLIT_PROOF_BYTES are hashed half on the sidecar's helper thread:
    each value keeps its own maru64, in order, whatever the split."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    from maru.common.checksum import checksums
    from maru.server.cluster.sidecar import SPLIT_PROOF_BYTES, Sidecar

    sidecar = object.__new__(Sidecar)  # (no Mooncake client: `_checksums` only)
    sidecar.helper = ThreadPoolExecutor(1)
    data = np.random.default_rng(5).integers(0, 256, 3 * SPLIT_PROOF_BYTES, np.uint8)
    cuts = [0, 5000, SPLIT_PROOF_BYTES, SPLIT_PROOF_BYTES + 4096, 2 * SPLIT_PROOF_BYTES, len(data)]
    views = [memoryview(data[a:b]) for a, b in itertools.pairwise(cuts)]
    places = [(data.ctypes.data + a, b - a) for a, b in itertools.pairwise(cuts)]
    try:
        for some, at in ((views, places), (views[2:4], places[2:4]), (views[:1], places[:1]),
                         (views[::-1], places[::-1])):  # fmt: skip
            addresses, lengths = [a for a, _ in at], [n for _, n in at]
            assert sidecar._checksums(addresses, lengths) == checksums(some).tolist()
    finally:
        sidecar.helper.shutdown()


def test_a_sidecar_without_mooncake_fails_each_job_in_its_ops_own_form():
    """Before Mooncake is set up the sidecar answers every batch with failures, each in the
    form its op's results take: a pull's [FAILED, 0, job id] (a bare code read as an unproven
    value, counted as a proof failure), a publish's [FAILED, job id], a probe's None (a bare
    code is an int the server would take for a length and pull); each names its job's id."""
    from maru.server.cluster.proof import FAILED
    from maru.server.cluster.sidecar import Sidecar

    sidecar = object.__new__(Sidecar)  # (no Mooncake client, no socket: `answer` only)
    sidecar.store, sidecar.error = None, "not connected yet"
    jobs = [["name", "/pool", 0, 4096, False, 7 + n] for n in range(3)]
    forms = {"publish": [[FAILED, 7], [FAILED, 8], [FAILED, 9]], "probe": [None] * 3,
             "pull": [[FAILED, 0, 7], [FAILED, 0, 8], [FAILED, 0, 9]]}  # fmt: skip
    for op, failed in forms.items():
        probe = [job[0] for job in jobs]
        reply = sidecar.answer({"op": op, "batch": 7, "jobs": probe if op == "probe" else jobs})
        assert reply == {
            "op": f"{op}-done",
            "batch": 7,
            "results": failed,
            "error": "not connected yet",
        }
    assert sidecar.answer({"op": "unknown", "batch": 8, "jobs": jobs}) is None


class _FakeStore:
    """Mooncake's zero-copy calls as its TCP transport does them here: a get copies each
    object's bytes into the buffers with the CPU (cached stores), a put reads them."""

    def __init__(self, objects: dict[str, bytes]):
        self.objects, self.put = objects, {}

    def register_buffer(self, address: int, length: int) -> int:
        return 0

    def batch_get_into_multi_buffers(self, names, buffers, sizes):
        import ctypes

        codes = []
        for name, places, lengths in zip(names, buffers, sizes):
            data = self.objects[name]
            at = 0
            for address, length in zip(places, lengths):
                ctypes.memmove(address, data[at : at + length], min(length, len(data) - at))
                at += length
            codes.append(len(data))
        return codes

    def batch_put_from_multi_buffers(self, names, buffers, sizes):
        import ctypes

        for name, places, lengths in zip(names, buffers, sizes):
            self.put[name] = b"".join(ctypes.string_at(a, n) for a, n in zip(places, lengths))
        return [0] * len(names)


@pytest.mark.parametrize("mode", ["software", "hardware"])
def test_the_sidecar_flushes_what_its_proofs_read_in_the_servers_coherence(tmp_path, mode):
    """Pool memory another host of a pod reads or wrote (`maru-server --coherence software`):
    the sidecar runs in the server's mode (`--coherence`, passed by the tier), and its proofs
    evict every line of every value before they read it. A pull's pages, written here by
    Mooncake with cached stores, go to memory (a dirty line is written back as it is evicted)
    before the reply that has them registered; a publish hashes and sends what another host's
    writer put in memory, not a line cached here before. Hardware: nothing flushed. (Before:
    the sidecar never ran in software mode, 0 lines.)"""
    import mmap

    import numpy as np

    from maru.client.coherence import lines_flushed
    from maru.common import _memcopy
    from maru.common.checksum import checksums
    from maru.server.cluster.proof import PUBLISHED, encode_trailer
    from maru.server.cluster.sidecar import PoolMaps, Sidecar, apply_coherence

    pool = tmp_path / "pool"
    pool.write_bytes(bytes(1 << 20))
    sizes = [60_000, 4096 + 100]  # (each at a 4 KiB page, as the tier reserves them)
    values = [np.random.default_rng(i).bytes(n) for i, n in enumerate(sizes)]
    sums = checksums([memoryview(v) for v in values]).tolist()
    objects = {f"o{i}": v + encode_trailer(f"o{i}", len(v), s) for i, (v, s) in
               enumerate(zip(values, sums))}  # fmt: skip
    sidecar = object.__new__(Sidecar)  # (no Mooncake client, no socket)
    sidecar.store, sidecar.helper, sidecar.trailers = _FakeStore(objects), None, None
    sidecar.maps = PoolMaps(lambda address, length: 0, 0)
    offsets = [0, 64 << 10]
    pulls = [[f"o{i}", str(pool), offsets[i], n, False, i] for i, n in enumerate(sizes)]
    lines = sum(-(-n // 64) for n in sizes)
    before = _memcopy.coherence()
    try:
        apply_coherence(mode)
        start = lines_flushed()
        results, error = sidecar.pull(pulls)
        flushed = lines_flushed()[1] - start[1]
        assert error is None and results == [[PUBLISHED, s, i] for i, s in enumerate(sums)]
        assert flushed == (lines if mode == "software" else 0)
        with open(pool, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
            assert [mm[o : o + n] for o, n in zip(offsets, sizes)] == values
        start = lines_flushed()
        published, error = sidecar.publish([[f"p{i}", *p[1:4], s, i] for i, (p, s) in
                                            enumerate(zip(pulls, sums))])  # fmt: skip
        flushed = lines_flushed()[1] - start[1]
        assert error is None and published == [[PUBLISHED, 0], [PUBLISHED, 1]]
        assert flushed == (lines if mode == "software" else 0)
        assert [sidecar.store.put[f"p{i}"][: len(v)] for i, v in enumerate(values)] == values
    finally:
        _memcopy.coherence(before)
        for mm, _, _ in sidecar.maps.maps.values():
            mm.close()


class FakeSidecar:
    """`subprocess.Popen` for the tier's sidecar: a process that is alive and does nothing;
    `started` keeps the command of each start."""

    started: list[list[str]] = []
    pid, returncode = 4242, None

    def __init__(self, cmd, **kw):
        FakeSidecar.started.append(cmd)

    def poll(self):
        return None

    def kill(self):
        pass

    def wait(self, timeout=None):
        return 0


def test_the_tier_starts_its_sidecar_in_the_servers_coherence(tmp_path, monkeypatch):
    """`ClusterTier(coherence=...)` (maru-server's `--coherence`) starts the sidecar with it."""
    from maru.server.cluster import tier as tier_module

    monkeypatch.setattr(tier_module.subprocess, "Popen", FakeSidecar)  # (no sidecar runs)
    config = tmp_path / "mooncake.json"
    config.write_text(json.dumps(SGLANG_FILE))
    reg = make_registry(tmp_path, pool_mib=64)
    for mode in ("software", "hardware"):
        tier = tier_module.ClusterTier(reg, str(config), coherence=mode)
        try:
            cmd = FakeSidecar.started[-1]
            assert cmd[cmd.index("--coherence") + 1] == mode
        finally:
            tier.close()
