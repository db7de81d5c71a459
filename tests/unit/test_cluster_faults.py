"""The cluster tier against its sidecar's faults: the pool file truncated under the sidecar's
proofs, a sidecar stopped (SIGSTOP) mid-pull and mid-publish, and replies the server must not
trust. The real `ClusterTier`, `Registry` and sidecar process run here; only Mooncake's client
inside the sidecar is a stand-in (`FAKE_MOONCAKE`, first on the sidecar's PYTHONPATH), whose
objects are files and whose calls can stop the sidecar or truncate the pool (one-shot hooks).
The first rule throughout: a key is registered only at pages holding the bytes written under
it, else it is a miss."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import zmq

from maru.common.checksum import checksums
from maru.common.protocol import DeleteStatus, RegisterStatus
from maru.server.cluster import tier as tier_module
from maru.server.cluster.proof import PUBLISHED, encode_trailer, object_name
from maru.server.cluster.tier import ClusterTier

from .registry_calls import locate
from .test_cluster_races import connect, pull_in_flight
from .test_cluster_tier import SGLANG_FILE, FakeSidecar
from .test_eviction_leases import MiB, consistent, make_registry

VALUE = 64 << 10

FAKE_MOONCAKE = '''
"""mooncake.store for tests/unit/test_cluster_faults.py: objects are files in
$FAKE_MOONCAKE_DIR; a file hook-get / hook-put there is read (and removed) by the next call:
"stop" (SIGSTOP this process first) or "truncate PATH SIZE" (after the call's copies)."""
import ctypes, os, signal
from pathlib import Path

DIR = Path(os.environ["FAKE_MOONCAKE_DIR"])


def _file(name):
    return DIR / ("obj-" + name.encode().hex())


def _hook(op):
    hook = DIR / ("hook-" + op)
    try:
        action = hook.read_text().split()
    except FileNotFoundError:
        return []
    hook.unlink()
    if action[:1] == ["stop"]:
        os.kill(os.getpid(), signal.SIGSTOP)
    return action


def _after(action):
    if action[:1] == ["truncate"]:
        os.truncate(action[1], int(action[2]))


class MooncakeDistributedStore:
    def setup(self, *args):
        return 0

    def register_buffer(self, address, length):
        return 0

    def unregister_buffer(self, address):
        return 0

    def health_check(self):
        return 0

    def batch_get_replica_desc(self, names):
        return {}

    def batch_get_into_multi_buffers(self, names, buffers, sizes):
        action, codes = _hook("get"), []
        for name, places, lengths in zip(names, buffers, sizes):
            try:
                data = _file(name).read_bytes()
            except FileNotFoundError:
                codes.append(-704)
                continue
            at = 0
            for address, length in zip(places, lengths):
                ctypes.memmove(address, data[at : at + length], max(min(length, len(data) - at), 0))
                at += length
            codes.append(len(data))
        _after(action)
        return codes

    def batch_put_from_multi_buffers(self, names, buffers, sizes):
        action = _hook("put")
        for name, places, lengths in zip(names, buffers, sizes):
            data = b"".join(ctypes.string_at(a, n) for a, n in zip(places, lengths))
            _file(name).write_bytes(data)
        _after(action)
        return [0] * len(names)
'''


class Node:
    """A tier with its real sidecar process, and the loop that drives it (`turn`)."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
        fake = tmp_path / "fake"
        (fake / "mooncake").mkdir(parents=True)
        (fake / "mooncake" / "__init__.py").write_text("")
        (fake / "mooncake" / "store.py").write_text(FAKE_MOONCAKE)
        self.objects = tmp_path / "objects"
        self.objects.mkdir()
        path = os.pathsep.join(p for p in (str(fake), os.environ.get("PYTHONPATH")) if p)
        monkeypatch.setenv("PYTHONPATH", path)
        monkeypatch.setenv("FAKE_MOONCAKE_DIR", str(self.objects))
        monkeypatch.setenv("MARU_MOONCAKE_LIBS", str(tmp_path / "no-libs"))
        config = tmp_path / "mooncake.json"
        config.write_text(json.dumps(SGLANG_FILE))
        self.reg = make_registry(tmp_path, pool_mib=64, high=1.0, low=1.0)
        self.pool = self.reg.pool.path
        self.pool_bytes = os.path.getsize(self.pool)
        self.tier = ClusterTier(self.reg, str(config), lookup_ms=200)
        self.poller = zmq.Poller()
        self.tier.attach(self.poller)
        assert self.until(lambda: self.tier.connected, 60), self.tier.error

    def turn(self, timeout_ms: int = 20) -> float:
        """One turn of the server's loop; how long the tier's part of it took (seconds)."""
        events = dict(self.poller.poll(timeout_ms))
        start = time.monotonic()
        self.tier.serve(events, self.poller)
        self.tier.housekeeping(self.poller, time.monotonic())
        self.tier.attach(self.poller)
        return time.monotonic() - start

    def until(self, done: Callable[[], bool], seconds: float = 20) -> bool:
        deadline = time.monotonic() + seconds
        while not done():
            if time.monotonic() > deadline:
                return False
            self.turn()
        return True

    def put_object(self, key: str, value: bytes, trailer_length: int | None = None) -> None:
        """`value` in the cluster under `key`, with its trailer (as a peer's tier publishes)."""
        name = object_name(self.tier.config.tenant_id, key)
        (maru64,) = checksums([memoryview(value)]).tolist()
        trailer = encode_trailer(name, trailer_length or len(value), maru64)
        (self.objects / ("obj-" + name.encode().hex())).write_bytes(value + trailer)

    def published(self, key: str) -> bytes | None:
        name = object_name(self.tier.config.tenant_id, key)
        path = self.objects / ("obj-" + name.encode().hex())
        return path.read_bytes() if path.exists() else None

    def hook(self, op: str, *action: object) -> None:
        (self.objects / f"hook-{op}").write_text(" ".join(map(str, action)))

    def read(self, key: str) -> bytes | None:
        """The bytes registered under `key` (from the pool's file: nothing here maps it)."""
        (hit,), _ = locate(self.reg, [key])
        if hit is None:
            return None
        region_id, offset, length = hit
        region = self.reg.regions[region_id]
        with open(region.path, "rb") as f:
            f.seek(region.offset + offset)
            return f.read(length)

    def write(self, key: str, value: bytes, region_id: int, offset: int) -> None:
        """Instance A stores `value` under `key` at `offset` of its region (checksummed)."""
        region = self.reg.regions[region_id]
        with open(region.path, "r+b") as f:
            f.seek(region.offset + offset)
            f.write(value)
        (maru64,) = checksums([memoryview(value)]).tolist()
        statuses = self.reg.register("A", [key], [region_id], [offset], [len(value)], [maru64])
        assert statuses == [RegisterStatus.REGISTERED]

    def close(self) -> None:
        proc = self.tier.proc
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)  # (a stopped one: killed by close all the same)
        os.truncate(self.pool, self.pool_bytes)
        self.tier.close()


@pytest.fixture
def node(tmp_path, monkeypatch):
    n = Node(tmp_path, monkeypatch)
    try:
        yield n
    finally:
        n.close()


def value(seed: int, n: int = VALUE) -> bytes:
    return np.random.default_rng(seed).bytes(n)


def stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (its state T in /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")


def test_a_pulls_proof_that_faults_fails_that_value_and_the_sidecar_lives(node):
    """The pool's file truncated under the sidecar as it hashes a pull's pages to prove them
    (after Mooncake wrote them): that value's hash faults under the copies' guard, and it fails
    alone ([FAILED, 0]: not registered, its pages doubted as any failed pull's); the other
    value of the batch is proven and registered with its bytes, and the same sidecar goes on
    to serve the next pull. Before: the CopyFaultError went out of the batch, the sidecar
    exited, the whole batch failed and the tier started a new sidecar."""
    tier, pid = node.tier, node.tier.proc.pid
    good, cut = value(1), value(2)
    node.put_object("good", good)
    node.put_object("cut", cut)
    first = tier.pages.reserve(VALUE)  # (where the batch will land: reserved, then freed)
    tier.pages.release(*first[:2])
    region = tier.registry.regions[first[0]]
    node.hook("get", "truncate", node.pool, region.offset + first[1] + VALUE)
    tier.guess = VALUE
    assert tier.want(["good", "cut"]) == 2
    ((_, batch),) = tier.batches.items()
    assert batch.places == [first[:2], (first[0], first[1] + VALUE)]
    assert node.until(lambda: not tier.pulling)
    os.truncate(node.pool, node.pool_bytes)
    assert node.read("good") == good
    assert node.read("cut") is None
    assert [b.places for b in tier.lingering] == [[batch.places[1]]]  # (doubted: DOUBT_S)
    assert tier.proc.pid == pid and tier.counts["sidecar_starts"] == 1
    assert tier.counts["pull_failures"] == 1 and tier.counts["proof_failures"] == 0
    later = value(3)
    node.put_object("later", later)
    assert tier.want(["later"]) == 1
    assert node.until(lambda: not tier.pulling)
    assert node.read("later") == later and tier.proc.pid == pid
    consistent(tier.registry)


def test_a_publish_whose_pages_fault_fails_that_value_and_goes_again(node):
    """The pool's file truncated under a value being published (write-through): its hash
    faults, it is not sent to Mooncake (whose read of the pages would kill the sidecar) and
    fails alone, released from its hold and tried again RETRY_S later; the batch's other
    value is published; the sidecar goes on. With the file back and the bytes rewritten, the
    retry publishes it. Before: the sidecar exited and the whole batch failed, not retried."""
    tier, reg, pid = node.tier, node.tier.registry, node.tier.proc.pid
    rid = reg.request_region("A", 16 * MiB).region_id
    kept, cut = value(4), value(5)
    node.write("kept", kept, rid, 0)
    node.write("cut", cut, rid, 8 * MiB)
    os.truncate(node.pool, reg.regions[rid].offset + 8 * MiB)
    tier.sealed(["kept", "cut"], [RegisterStatus.REGISTERED] * 2, RegisterStatus.REGISTERED)
    assert node.until(lambda: not tier.batches)
    os.truncate(node.pool, node.pool_bytes)
    assert node.published("kept") is not None and node.published("kept")[:VALUE] == kept
    assert node.published("cut") is None
    assert tier.proc.pid == pid and tier.counts["sidecar_starts"] == 1
    assert reg.delete(["kept"]) == [DeleteStatus.DELETED]  # (its hold released)
    assert len(tier.retry) == 1 and "faulted" in (tier.last_failure or "")
    node.write("cut-again", cut, rid, 8 * MiB)  # (the bytes back where "cut" lies)
    assert node.until(lambda: tier.counts["published"] == 2)
    assert node.published("cut")[:VALUE] == cut and tier.proc.pid == pid
    assert tier.counts["publish_failures"] == 0


def test_a_sidecar_stopped_mid_pull_costs_lookups_their_budget_and_never_the_loop(node):
    """A sidecar stopped (SIGSTOP) inside Mooncake's get: every turn of the loop stays short,
    the node's own writes and reads go on, and once the pull is older than the lookup budget
    new lookups miss at once (`want` 0) rather than wait on it. Continued (SIGCONT), its reply
    registers the value, with its bytes, in the pages held for it meanwhile."""
    tier, reg = node.tier, node.tier.registry
    pid = tier.proc.pid
    slow = value(6)
    node.put_object("slow", slow)
    node.hook("get", "stop")
    tier.guess = VALUE
    assert tier.want(["slow"]) == 1
    ((_, batch),) = tier.batches.items()
    assert node.until(lambda: stopped(pid), 30)
    longest = max(node.turn() for _ in range(20))  # (each polls 20 ms: past the 200 ms budget)
    assert longest < 5.0  # (a turn that waited on the stopped sidecar would never end)
    assert tier.want(["other"]) == 0  # (a miss at once: the pull is past the budget)
    rid = reg.request_region("A", 16 * MiB).region_id
    mine = value(7)
    node.write("mine", mine, rid, 0)
    assert node.read("mine") == mine
    os.kill(pid, signal.SIGCONT)
    assert node.until(lambda: not tier.pulling)
    assert node.read("slow") == slow
    (hit,), _ = locate(reg, ["slow"])
    assert tuple(hit[:2]) == batch.places[0] and tier.proc.pid == pid


def test_a_sidecar_stopped_past_the_stall_is_replaced_and_its_pull_never_lands(node, monkeypatch):
    """A sidecar stopped mid-pull for STALL_S is killed (SIGKILL works on a stopped process),
    reaped, and started again; only then are its pull's pages reused, by the next pull, whose
    value is the one registered there. The stopped sidecar's pull is never registered: its
    process and its channel are gone, so no late reply of it can come. (STALL_S scaled.)"""
    tier, reg = node.tier, node.tier.registry
    monkeypatch.setattr(tier_module, "STALL_S", 1.0)
    old = tier.proc
    node.put_object("stuck", value(8))
    node.hook("get", "stop")
    tier.guess = VALUE
    assert tier.want(["stuck"]) == 1
    ((_, batch),) = tier.batches.items()
    assert node.until(lambda: stopped(old.pid), 30)
    assert node.until(lambda: tier.counts["sidecar_starts"] == 2, 30)
    assert old.returncode == -signal.SIGKILL  # (killed and reaped before the pages went back)
    assert "stuck" not in tier.pulling and tier.counts["pull_failures"] == 1
    assert node.until(lambda: tier.connected, 60)
    fresh = value(9)
    node.put_object("fresh", fresh)
    assert tier.want(["fresh"]) == 1
    ((_, again),) = tier.batches.items()
    assert again.places == batch.places  # (the stuck pull's pages, free once it was reaped)
    assert node.until(lambda: not tier.pulling)
    assert node.read("fresh") == fresh and node.read("stuck") is None
    consistent(reg)


def test_a_sidecar_stopped_mid_publish_holds_the_value_and_the_node_goes_on(node):
    """A sidecar stopped inside Mooncake's put: the value being published stays held (a delete
    is PINNED: its pages cannot be reused under the put), the node's other keys are written,
    read and deleted, and a pull queued behind the stopped publish costs lookups their budget
    once, then they miss at once. Continued, the publish completes with the value's bytes and
    the hold is released."""
    tier, reg = node.tier, node.tier.registry
    pid = tier.proc.pid
    rid = reg.request_region("A", 16 * MiB).region_id
    held = value(10)
    node.write("held", held, rid, 0)
    node.hook("put", "stop")
    tier.sealed(["held"], [RegisterStatus.REGISTERED], RegisterStatus.REGISTERED)
    assert node.until(lambda: stopped(pid), 30)
    assert reg.delete(["held"]) == [DeleteStatus.PINNED]
    other = value(11)
    node.write("other", other, rid, MiB)
    assert node.read("other") == other
    assert reg.delete(["other"]) == [DeleteStatus.DELETED]
    tier.guess = VALUE
    assert tier.want(["remote"]) == 1  # (queued behind the stopped publish)
    time.sleep(tier.lookup_ms / 1000 + 0.05)
    assert max(node.turn() for _ in range(5)) < 5.0  # (a turn that waited on it would never end)
    assert tier.want(["remote2"]) == 0
    os.kill(pid, signal.SIGCONT)
    assert node.until(lambda: not tier.batches)
    assert node.published("held")[:VALUE] == held and tier.counts["published"] == 1
    assert reg.delete(["held"]) == [DeleteStatus.DELETED]
    assert tier.proc.pid == pid


# -- replies the server must not trust (no sidecar process: its replies applied here) ----------


@pytest.fixture
def tier(tmp_path, monkeypatch):
    monkeypatch.setattr(tier_module.subprocess, "Popen", FakeSidecar)
    config = tmp_path / "mooncake.json"
    config.write_text(json.dumps(SGLANG_FILE))
    t = ClusterTier(make_registry(tmp_path, pool_mib=64, high=1.0, low=1.0), str(config))
    theirs = connect(t)
    yield t
    t.close()
    theirs.close()


def test_a_proof_claim_without_a_maru64_is_never_registered(tier):
    """A pull reply [PUBLISHED, 0] claims a proof with no hash: a maru64 is never 0, and 0
    registers a key as stored without a checksum (nothing would ever judge its bytes). It is
    taken for an unproven value: not registered, its pages doubted. Before: registered, a hit
    on pages whose bytes nobody proved."""
    reg = tier.registry
    batch_id, batch = pull_in_flight(tier, "K")
    tier._apply({"op": "pull-done", "batch": batch_id, "results": [[PUBLISHED, 0]], "error": None})
    assert locate(reg, ["K"])[0] == [None]
    assert [b.places for b in tier.lingering] == [batch.places]
    assert tier.counts["proof_failures"] == 1 and tier.counts["pulled"] == 0
    consistent(reg)


def test_a_reply_naming_its_batch_by_a_bool_is_a_broken_channel(tier):
    """msgpack's true is Python's True, equal to 1 as a dict key: a reply for batch `true`
    would be applied to batch 1. It is a bad reply (applied in no part, the channel broken,
    the sidecar started again). Before: applied to batch 1, registering its key."""
    batch_id, _ = pull_in_flight(tier, "K")
    assert batch_id == 1
    with pytest.raises(ValueError):
        tier._apply({"op": "pull-done", "batch": True, "results": [[PUBLISHED, 77]], "error": None})
    assert locate(tier.registry, ["K"])[0] == [None] and 1 in tier.batches


def test_replies_for_no_batch_in_flight_do_not_keep_a_stalled_sidecar_alive(tier):
    """A sidecar that answers only batch ids the server is not waiting on (stale, or made up)
    while a batch waits STALL_S is stalled all the same, and started again. Before: every such
    reply counted as progress, and a sidecar stuck on a pull was never replaced."""
    batch_id, batch = pull_in_flight(tier, "K")
    batch.sent -= tier_module.STALL_S + 1
    tier.started -= tier_module.STALL_S
    tier._apply({"op": "pull-done", "batch": batch_id + 100, "results": [], "error": None})
    tier.housekeeping(zmq.Poller(), time.monotonic())
    assert tier.counts["sidecar_starts"] == 2 and not tier.batches
