"""The cluster tier's races, in fixed orders through the real `ClusterTier` and `Registry`
(only the sidecar process stands in: `Popen` is replaced and its replies are applied as the
loop applies them): a pull against the node's own writes and deletes, against a request that
asks the tier to give regions back, against a sidecar restart; publish holds against deletes.
Each pins a promise of docs/reliability.md's cluster rows: a hit is the registered bytes or a
miss, never a second version, never pages handed out twice."""

from __future__ import annotations

import json
import time

import pytest
import zmq

from maru.common.protocol import DeleteStatus, ProtocolError, RegisterStatus
from maru.server.cluster import tier as tier_module
from maru.server.cluster.link import Link
from maru.server.cluster.proof import ABSENT, FAILED, LENGTH, PUBLISHED, REFUSED
from maru.server.cluster.tier import DOUBT_S, ClusterTier

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


@pytest.mark.parametrize("result", [FAILED, REFUSED])
def test_a_failed_pulls_pages_are_not_reused_while_its_transfer_may_go_on(tier, result):
    """Mooncake may report a get failed while parts of its transfer still run (its wait gives
    up without cancelling; one failed part can end it): a late write into pages reused since
    would change a value registered there. A failed (or unproven) pull's pages are reused
    only after DOUBT_S, or once the sidecar that pulled them is gone; one that found no
    object pulled nothing, and its pages go back at once. Before: every failure's pages went
    back at once and the next pull landed in them."""
    reg = tier.registry
    batch_id, batch = pull_in_flight(tier, "K")
    failed = batch.places[0]
    proven(tier, batch_id, [result, 0])
    batch_id, again = pull_in_flight(tier, "K2")
    assert again.places[0] != failed, "a failed pull's pages were reused at once"
    landing = tier_module.landing(tier.batches.values(), tier.lingering)
    assert failed[0] in landing  # (its region is not given back either)
    proven(tier, batch_id, [ABSENT, 0])
    batch_id, third = pull_in_flight(tier, "K3")
    assert third.places == again.places  # (nothing was transferred: reused at once)
    proven(tier, batch_id, [ABSENT, 0])
    tier.housekeeping(zmq.Poller(), time.monotonic() + DOUBT_S + 1)
    assert tier.counts["sidecar_starts"] == 1  # (not restarted: released by time)
    assert failed not in [p for b in tier.lingering for p in b.places]
    assert tier.counts["pull_failures"] == (result == FAILED)
    consistent(reg)


def test_a_failed_pulls_pages_go_back_with_its_sidecar(tier):
    batch_id, batch = pull_in_flight(tier, "K")
    proven(tier, batch_id, [FAILED, 0])
    assert [b.places for b in tier.lingering] == [batch.places]
    tier.start()  # (the sidecar killed and reaped: nothing can write the pages now)
    end = connect(tier)
    try:
        assert list(tier.lingering) == []
        _, again = pull_in_flight(tier, "K2")
        assert again.places == batch.places
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


def test_a_sidecar_not_reaped_keeps_its_batches_pages_and_holds_until_it_is(tier, caplog):
    """A sidecar SIGKILLed (a batch stalled) that the kernel does not reap in time (stuck in
    the kernel, D state) may still read or write its batches' pages: it is set aside, logged
    at ERROR, and the server goes on (no exception out of housekeeping); the pages its pull
    was landing in are reserved for no other pull and the key its publish held stays so,
    until a later housekeeping finds it reaped. (SIGKILL cannot be ignored: the stuck
    process is simulated, its `wait` raising TimeoutExpired and its `poll` finding it
    running. Before: `close` freed the pages and holds first, then `wait` raised.)"""
    import subprocess
    import time

    import zmq

    reg = tier.registry
    rid = reg.request_region("A", 16 * MiB).region_id
    register(reg, "A", [["W", rid, 0, MiB]])
    tier.sealed(["W"], [RegisterStatus.REGISTERED], RegisterStatus.REGISTERED)
    _, batch = pull_in_flight(tier, "K")
    stuck = tier.proc

    def wait(timeout=None):
        raise subprocess.TimeoutExpired("sidecar", timeout)

    stuck.wait, stuck.poll = wait, lambda: None
    poller = zmq.Poller()
    tier.housekeeping(poller, time.monotonic() + tier_module.STALL_S + 1)  # stalled: restarted
    assert tier.proc is not stuck and tier.counts["sidecar_starts"] == 2
    assert any(r.levelname == "ERROR" and "reaped" in r.getMessage() for r in caplog.records)
    assert "K" not in tier.pulling  # (its readers miss now)
    end = connect(tier)
    try:
        _, again = pull_in_flight(tier, "K2")
        assert set(again.places).isdisjoint(batch.places)  # K's pages: still the stuck one's
        assert reg.delete(["W"]) == [DeleteStatus.PINNED]  # still held for its publish
        assert all(not reg.regions[r].returned for r, _ in batch.places)  # (never given back)
        tier.close()  # (at shutdown too: no exception, nothing released)
        assert reg.delete(["W"]) == [DeleteStatus.PINNED]
        stuck.poll = lambda: -9  # the kernel reaped it at last
        tier.start()
        tier.housekeeping(poller, time.monotonic() + 2 * tier_module.STALL_S)
        assert reg.delete(["W"]) == [DeleteStatus.DELETED]
        end.close()
        end = connect(tier)
        _, third = pull_in_flight(tier, "K3")
        assert third.places == batch.places  # K's pages free again
        consistent(reg)
    finally:
        end.close()


@pytest.mark.parametrize(
    "results",
    [
        [[PUBLISHED, 1 << 63]],  # a maru64 past int64 (before: OverflowError out of the loop)
        [[PUBLISHED, 77], [PUBLISHED, 78]],  # more results than keys (before: IndexError)
        [],  # fewer (before: the batch dropped, its pages never freed)
        [[PUBLISHED, "77"]],
        {"K": [PUBLISHED, 77]},
    ],
    ids=["past-int64", "too-many", "too-few", "a-str", "a-map"],
)
def test_a_reply_that_does_not_fit_its_batch_is_never_applied_nor_stops_the_loop(tier, results):
    """A sidecar reply whose results do not fit its batch (a sidecar bug, a channel gone
    wrong) is applied in no part and raises nothing out of `serve` (maru-server's loop):
    the channel is taken for broken, the sidecar started again, and the batch's pages freed
    once it is gone. Before, some of these killed the server, others leaked the pages."""
    import time

    import zmq

    reg = tier.registry
    end = Link(connect(tier), blocking=True)
    poller = zmq.Poller()
    tier.attach(poller)
    try:
        batch_id, batch = pull_in_flight(tier, "K")
        end.send({"op": "pull-done", "batch": batch_id, "results": results, "error": None})
        tier.serve(dict(poller.poll(5000)), poller)
        assert locate(reg, ["K"])[0] == [None] and tier.link.closed
        assert tier.batches == {batch_id: batch}  # (its pages kept until the sidecar is gone)
        tier.housekeeping(poller, time.monotonic() + tier_module.RESTART_S + 1)
        assert tier.counts["sidecar_starts"] == 2 and not tier.batches
        assert all(pages.used == 0 for pages in tier.pages.free_lists.values())
        consistent(reg)
    finally:
        end.close()


def test_a_sidecar_that_cannot_be_started_again_never_stops_the_loop(tier, monkeypatch):
    """A sidecar that exited is started again from housekeeping; a start that fails (no
    descriptor left for its channel: EMFILE, as while TCP connections exhaust them; or no
    memory to fork) raises nothing out of the loop: logged, `error` says why, and tried again
    RESTART_S later. (Before: the OSError went out of `housekeeping`: maru-server died.)"""
    import errno
    import time

    import zmq

    def exhausted() -> None:
        raise OSError(errno.EMFILE, "Too many open files")

    poller = zmq.Poller()
    tier.proc.poll = lambda: 1  # (the sidecar exited)
    pair = Link.pair
    monkeypatch.setattr(tier_module.Link, "pair", exhausted)
    now = time.monotonic() + tier_module.RESTART_S + 1
    tier.housekeeping(poller, now)
    assert tier.proc is None and tier.link is None and "Too many open files" in tier.error
    monkeypatch.setattr(tier_module.Link, "pair", pair)
    tier.housekeeping(poller, now + tier_module.RESTART_S + 1)
    assert tier.proc is not None and tier.counts["sidecar_starts"] == 2


def test_a_region_the_journal_could_not_record_is_a_miss_not_a_dead_loop(tier, monkeypatch):
    """A pull's pages need a region, and a region is journaled before it is handed out: with
    the state dir's disk full (`JournalWriteError`) there is none, and the pull is a miss, as
    when the pool is full; nothing goes out of the loop (the sidecar's probe reply, applied
    by `serve`) nor of an EXISTS (`want`), and no key is left `pulling` for good. (Before:
    the error went out of `serve`, and maru-server died.)"""
    import errno
    import time
    from pathlib import Path

    import zmq

    from maru.server.journal import JournalWriteError

    def full(*args, **kwargs):
        raise JournalWriteError(Path("/nonexistent/state"), OSError(errno.ENOSPC, "No space"))

    monkeypatch.setattr(tier.registry, "request_region", full)
    end = Link(connect(tier), blocking=True)
    poller = zmq.Poller()
    tier.attach(poller)
    try:
        tier.guess = 0  # (probed first: the reply's lengths are pulled from `serve`)
        assert tier.want(["K"]) == 1
        ((batch_id, _),) = tier.batches.items()
        end.send({"op": "probe-done", "batch": batch_id, "results": [MiB], "error": None})
        tier.serve(dict(poller.poll(5000)), poller)
        assert "K" not in tier.pulling and not tier.batches and not tier.link.closed
        tier.guess, tier.absent = MiB, {}
        tier.want(["K2"])  # (its length guessed: pulled at once, from the EXISTS)
        assert "K2" not in tier.pulling and not tier.batches
        tier.pages.ready(MiB)  # (room ahead: none either)
        tier.housekeeping(poller, time.monotonic() + 1)
        consistent(tier.registry)
    finally:
        end.close()
