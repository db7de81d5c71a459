"""Clears that reach the cluster tier (DELETE_PREFIX with "cluster"): the tier asks its
sidecar to remove, with Mooncake's `remove_by_regex`, exactly the objects named for the keys
of a prefix (or every object of its tenant), after every publish it sent before and before
every one it sends after; the server replies at once, saying whether the removal was sent.

The real `ClusterTier`, `Registry`, `MaruService` handler and sidecar process run here, with
Mooncake's client stood in for by `test_cluster_faults`'s files-as-objects store, given a
`remove_by_regex` that reads its pattern with Python's `re` (what the sidecar sends is the
same regex in ECMAScript, Mooncake's dialect: the integration test runs the real master)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from maru.common.protocol import ErrorCode, Key, MsgType, RegisterStatus
from maru.server.cluster import tier as tier_module
from maru.server.cluster.proof import name_pattern, object_name
from maru.server.cluster.tier import ClusterTier
from maru.server.metrics import _cluster_metrics

from . import test_cluster_faults as faults
from .service_calls import call, make_service, ok
from .test_cluster_faults import Node, stopped, value
from .test_cluster_races import connect
from .test_cluster_tier import SGLANG_FILE, FakeSidecar
from .test_eviction_leases import MiB, make_registry

TENANT = "t.x"  # (a "." of its own: tenant "tax" must not match it)

# Mooncake's remove_by_regex for the stand-in: the objects (files) whose names `re.search`
# finds the pattern in, removed; a hook-remove file: "stop" first, or "code N" (a failure).
REMOVE_BY_REGEX = """

import re


def _remove_by_regex(self, pattern, force=False):
    action = _hook("remove")
    if action[:1] == ["code"]:
        return int(action[1])
    removed = 0
    for path in sorted(DIR.glob("obj-*")):
        if re.search(pattern, bytes.fromhex(path.name[4:]).decode()):
            path.unlink()
            removed += 1
    return removed


MooncakeDistributedStore.remove_by_regex = _remove_by_regex
"""

# Keys whose names a regex read carelessly would merge: metacharacters, a NUL, a newline,
# non-ASCII, str and bytes keys of one spelling.
STR_KEYS = [
    "ns1:a", "ns1:b", "ns1.x", "ns1X:a", "ns1:", "ns1", "a+b", "aab", "a+", "a(b", "a[b]",
    "ab]", "a*", "a", "a\\b", "a\\", "^a", "$a", "a^$", "k\x00a", "k\x00b", "k", "\xe9z",
    "e\u0301z", "n\nns1:a", "x/s/ns1:a",
]  # fmt: skip
BYTES_KEYS = [b"ns1:a", b"ns1.x", b"\x00\xff", b"\x00", b"\xff\x00", b"a+b", b"n"]
PREFIXES: list[Key | None] = [
    "ns1:", "ns1.", "a+", "a(", "a[", "a*", "a\\", "^", "$", "a^$", "k\x00", "\xe9", "n\n",
    b"ns1", b"\x00", b"\xff", b"a+", None,
]  # fmt: skip


@pytest.fixture
def node(tmp_path, monkeypatch):
    """`test_cluster_faults.Node` (the real sidecar) whose stand-in also removes by regex,
    its tenant TENANT."""
    monkeypatch.delenv("MOONCAKE_TENANT_ID", raising=False)
    monkeypatch.setattr(faults, "FAKE_MOONCAKE", faults.FAKE_MOONCAKE + REMOVE_BY_REGEX)
    monkeypatch.setattr(faults, "SGLANG_FILE", {**SGLANG_FILE, "tenant_id": TENANT})
    n = Node(tmp_path, monkeypatch)
    try:
        yield n
    finally:
        n.close()


def put(node: Node, names: list[str]) -> None:
    """Objects under `names` in the stand-in's store (their bytes do not matter here)."""
    for name in names:
        (node.objects / ("obj-" + name.encode().hex())).write_bytes(b"x")


def names_left(node: Node) -> set[str]:
    return {bytes.fromhex(p.name[4:]).decode() for p in node.objects.glob("obj-*")}


def every_name() -> list[str]:
    """This tier's objects for every key, another tenant's that an unescaped "." would take
    for ours ("tax"), one whose tenant holds "/" ("t.x/s"), names that hold one of ours
    unanchored, and the tier's first format's."""
    keys: list[Key] = [*STR_KEYS, *BYTES_KEYS]
    names = [object_name(t, k) for t in (TENANT, "tax", "t.x/s") for k in keys]
    return [*names, "x" + object_name(TENANT, "ns1:a"), f"maru/{TENANT}/s/ns1:a"]


def test_the_names_a_clear_removes_are_exactly_those_of_its_prefix(node):
    """For each prefix (str: the "s" names; bytes: the "b" names, by hex; None: every object
    of the tenant), the sidecar's removal leaves exactly the names of the other keys: keys
    with ".", "+", "(", "[", "*", "\\", "^", "$", a NUL, a newline or non-ASCII characters in
    the prefix never widen it, another tenant's objects (one "." away, or behind a "/") and
    names that merely contain one of ours stay. Fails if the prefix is not escaped or the
    pattern not anchored."""
    tier, everything = node.tier, every_name()
    for prefix in PREFIXES:
        put(node, everything)
        assert tier.clear(prefix)
        assert node.until(lambda: not tier.batches)
        keys: list[Key] = [*STR_KEYS, *BYTES_KEYS]
        gone = {
            object_name(TENANT, k)
            for k in keys
            if prefix is None or (type(k) is type(prefix) and k.startswith(prefix))
        }
        assert gone, prefix  # (each prefix takes some)
        assert names_left(node) == set(everything) - gone, prefix
    assert tier.counts["remove_failures"] == 0 and tier.last_failure is None


def test_the_pattern_is_one_anchored_literal_per_clear():
    """What the sidecar sends Mooncake: "^" and the name's start, every ASCII punctuation
    character escaped, control characters as \\xHH (the real master's dialect: the
    integration test), letters, digits and non-ASCII as they are."""
    assert name_pattern("t.x", "a(b") == "^maru3\\/3\\/t\\.x\\/s\\/a\\(b"
    assert name_pattern("t", b"\x00+") == "^maru3\\/1\\/t\\/b\\/002b"
    assert name_pattern("t", "k\x00\n\xe9") == "^maru3\\/1\\/t\\/s\\/k\\x00\\x0a\xe9"
    assert name_pattern("t", None) == "^maru3\\/1\\/t\\/"


def test_a_clear_removes_what_was_published_before_it_and_nothing_published_after(node, tmp_path):
    """DELETE_PREFIX "ns1:" with cluster, through the server's handler, while the sidecar is
    stopped inside the publish of ns1:a (sealed before the clear): the reply comes at once
    (the loop never waits on Mooncake) saying the removal was sent, ns1:a stays in the pool
    (held by its publish: counted as pinned). ns1:b, sealed after the clear, is published
    behind it. Once the sidecar goes on, in order: ns1:a published then removed, with an
    object only the cluster held (a peer's ns1:peer); ns1:b and ns2:a stay. Fails if the
    removal overtakes the publish before it, or is sent after (or with) the one after it."""
    tier, reg = node.tier, node.tier.registry
    svc = make_service(tmp_path, registry=reg)
    svc.cluster = tier
    try:
        rid = reg.request_region("A", 16 * MiB).region_id
        node.put_object("ns1:peer", value(20))
        node.put_object("ns2:peer", value(21))
        node.write("ns1:a", value(22), rid, 0)
        node.write("ns2:a", value(23), rid, MiB)
        node.hook("put", "stop")
        tier.sealed(["ns1:a", "ns2:a"], [RegisterStatus.REGISTERED] * 2, RegisterStatus.REGISTERED)
        assert node.until(lambda: stopped(tier.proc.pid), 30)
        reply = ok(svc, MsgType.DELETE_PREFIX, {"prefix": "ns1:", "cluster": True})
        assert (reply["deleted"], reply["pinned"], reply["cluster"]) == (0, 1, True)
        assert tier.stats()["removing"] == 1
        node.write("ns1:b", value(24), rid, 2 * MiB)
        tier.sealed(["ns1:b"], [RegisterStatus.REGISTERED], RegisterStatus.REGISTERED)
        assert [b.op for b in tier.batches.values()] == ["publish", "remove", "publish"]
        os.kill(tier.proc.pid, signal.SIGCONT)
        assert node.until(lambda: not tier.batches)
        name = lambda key: object_name(TENANT, key)  # noqa: E731
        assert names_left(node) == {name("ns1:b"), name("ns2:a"), name("ns2:peer")}
        assert node.published("ns1:b")[: len(value(24))] == value(24)
        assert tier.counts["removed"] == 2 and tier.counts["published"] == 3
        assert tier.stats()["removing"] == 0
    finally:
        svc.cluster = None  # (the node's fixture closes the tier)
        svc.close()


def test_clear_all_removes_every_object_of_the_tenant_and_only_them(node, tmp_path):
    """DELETE_PREFIX "all" with cluster: the pool's keys and every object named for this
    tenant, str and bytes keys alike, whoever published them; another tenant's objects, one
    "." away, stay."""
    svc = make_service(tmp_path, registry=node.tier.registry)
    svc.cluster = node.tier
    try:
        everything = every_name()
        put(node, everything)
        reply = ok(svc, MsgType.DELETE_PREFIX, {"all": True, "cluster": True})
        assert reply["cluster"] is True
        assert node.until(lambda: not node.tier.batches)
        mine = {n for n in everything if n.startswith(f"maru3/{len(TENANT)}/{TENANT}/")}
        assert len(mine) == len(STR_KEYS) + len(BYTES_KEYS)
        assert names_left(node) == set(everything) - mine
        assert node.tier.counts["removed"] == len(mine)
    finally:
        svc.cluster = None
        svc.close()


def test_removals_are_counted_failed_ones_too_and_shown(node):
    """`removed` counts the objects Mooncake removed; `remove_failures` the removals that
    failed: Mooncake's error code (with the tier's last_failure), and a removal whose sidecar
    died before it answered (Mooncake may or may not have made it). Both reach the stats
    document, Prometheus and `maru status`'s cluster line."""
    from maru.client.cli import _cluster_line

    tier = node.tier
    put(node, [object_name(TENANT, f"p/{i}") for i in range(3)])
    assert tier.clear("p/")
    assert node.until(lambda: not tier.batches)
    assert (tier.counts["removed"], tier.counts["remove_failures"]) == (3, 0)
    node.hook("remove", "code", -600)
    assert tier.clear("q/")
    assert node.until(lambda: not tier.batches)
    assert (tier.counts["removed"], tier.counts["remove_failures"]) == (3, 1)
    assert "remove_by_regex: -600" in (tier.last_failure or "")
    node.hook("remove", "stop")
    assert tier.clear("r/")
    assert node.until(lambda: stopped(tier.proc.pid), 30)
    os.kill(tier.proc.pid, signal.SIGKILL)
    assert node.until(lambda: tier.counts["sidecar_starts"] == 2, 30)
    stats = tier.stats()
    assert (stats["removed"], stats["remove_failures"], stats["removing"]) == (3, 2, 0)
    pytest.importorskip("prometheus_client")
    families = {f.name: f.samples[0].value for f in _cluster_metrics({"cluster": stats})}
    assert families["maru_cluster_removed"] == 3
    assert families["maru_cluster_remove_failures"] == 2
    assert families["maru_cluster_removing"] == 0
    assert "3 removed by clears (2 failed)" in _cluster_line({"cluster": stats})


def test_without_a_tier_or_a_connected_one_the_reply_says_nothing_was_sent(tmp_path, monkeypatch):
    """A server without a tier clears its pool and replies cluster false; one whose tier is
    not connected likewise, sending nothing (no batch in flight); connected, true, the one
    batch a removal. A non-bool "cluster", or a prefix longer than a key with it, is refused
    before anything is deleted."""
    monkeypatch.setattr(tier_module.subprocess, "Popen", FakeSidecar)  # (no sidecar runs)
    reg = make_registry(tmp_path, pool_mib=64, high=1.0, low=1.0)
    rid = reg.request_region("A", 4 * MiB).region_id
    reg.register("A", ["ns:1", "ns:2"], [rid, rid], [0, 65536], [10, 10])
    svc = make_service(tmp_path, registry=reg)
    config = tmp_path / "mooncake.json"
    config.write_text(json.dumps({**SGLANG_FILE, "tenant_id": TENANT}))
    tier = ClusterTier(reg, str(config))
    theirs = None
    try:
        for bad, code in (
            ({"prefix": "ns:", "cluster": 1}, ErrorCode.BAD_REQUEST),
            ({"all": True, "cluster": "yes"}, ErrorCode.BAD_REQUEST),
            ({"prefix": "n" * 1025, "cluster": True}, ErrorCode.KEY_TOO_LONG),
        ):
            assert call(svc, MsgType.DELETE_PREFIX, bad)["code"] == code, bad
        assert len(reg.keys) == 2  # (refused before any delete)
        reply = ok(svc, MsgType.DELETE_PREFIX, {"prefix": "ns:1", "cluster": True})
        assert (reply["deleted"], reply["cluster"]) == (1, False)  # (no tier)
        svc.cluster = tier
        assert not tier.connected
        reply = ok(svc, MsgType.DELETE_PREFIX, {"all": True, "cluster": True})
        assert (reply["deleted"], reply["cluster"]) == (1, False) and not tier.batches
        theirs = connect(tier)
        reply = ok(svc, MsgType.DELETE_PREFIX, {"prefix": "ns:", "cluster": True})
        assert reply["cluster"] is True
        ((_, batch),) = tier.batches.items()
        assert (batch.op, batch.patterns) == ("remove", [name_pattern(TENANT, "ns:")])
        reply = ok(svc, MsgType.DELETE_PREFIX, {"prefix": "ns:"})  # (not asked: not sent)
        assert reply["cluster"] is False and len(tier.batches) == 1
    finally:
        svc.cluster = None
        svc.close()
        tier.close()
        if theirs is not None:
            theirs.close()


# (run apart: importing SGLang needs the CPU shims applied first, as its own tests do)
STORAGE_CLEAR = """
import json, sys, types
sys.path.insert(0, sys.argv[1])
import sglang_cpu
sglang_cpu.apply()
from maru_sglang.maru_storage import MaruStorage
calls = []
handler = types.SimpleNamespace(delete_prefix=lambda p, **kw: calls.append([p, kw]) or 0)
storage = object.__new__(MaruStorage)
storage.handler, storage.confirm_writes = handler, lambda: None
pools = [types.SimpleNamespace(namespace=n) for n in ("m1", "m2", "m1", "")]
storage.pools = dict(enumerate(pools))
storage.clear()
print(json.dumps(calls))
"""


def test_maru_storage_clear_asks_the_cluster_too():
    """`MaruStorage.clear()` (SGLang's clear endpoint) deletes each namespace of its pools
    with cluster=True, as SGLang's Mooncake backend's clear empties Mooncake."""
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("needs SGLang (scripts/install_sglang_cpu.sh)")
    tests = str(Path(__file__).resolve().parents[1])
    done = subprocess.run(
        [sys.executable, "-c", STORAGE_CLEAR, tests], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    calls = json.loads(done.stdout.strip().splitlines()[-1])
    assert calls == [["m1:", {"cluster": True}], ["m2:", {"cluster": True}]]
