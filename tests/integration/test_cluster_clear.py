"""Clears that reach the cluster (DELETE_PREFIX with `cluster`: `MaruHandler.delete_prefix(...,
cluster=True)`, `maru clear --cluster`), on two nodes and a real Mooncake master: after a
clear on node 1, node 2 misses what was cleared, though it never held it, and still reads
what was not, byte for byte; a value written after the clear is read with its new bytes.

Run as a script (`test_cluster_clear.py WORKDIR clear`) it drives the two nodes
(`cluster_child.cluster`, steps of `test_cluster_trust.py`); `test_cluster_clear.py MODE ...`
is one step inside a node.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve()
if __name__ == "__main__":  # (a step in a node, or the driver: the repo's tests importable)
    sys.path[:0] = [str(HERE.parents[2]), str(HERE.parents[1])]
    from tests.integration import cluster_child as cc
    from tests.integration import test_cluster_trust as trust
    from tests.integration.test_cli import maru_command
    from tests.integration.test_cluster_tier import cannot_run

    trust.cc = cc  # (its driver's steps need it; it imports it when run as a script alone)
else:
    from .test_cli import maru_command, run
    from .test_cluster_tier import cannot_run
    from .test_cluster_trust import run_nodes as trust_nodes

# Mooncake keeps an object a reader holds a lease on (one read in the last
# --default_kv_lease_ttl, 10 s by default) through a removal. The master here leases for
# LEASE_MS, and the clear that must find nothing leased comes LEASE_WAIT_S after the last read.
LEASE_MS = 1000
LEASE_WAIT_S = 3 * LEASE_MS / 1000
NS1 = [f"ns1:{i}" for i in range(4)]
NS2 = [f"ns2:{i}" for i in range(4)]
NS3 = [f"ns3:{i}" for i in range(4)]  # (written after the first clear, never read by node 2)
TRAP = "ns1.x"  # a "." where the prefix has ":": an unescaped regex would take it
OTHER_TENANT = "other"


# -- steps run inside a node --------------------------------------------------------------


def delete_prefix(url: str, spec: dict) -> dict:
    """`MaruHandler.delete_prefix` with cluster=True, as `MaruStorage.clear` calls it."""
    h = cc.handler(url)
    try:
        return {"deleted": h.delete_prefix(spec["prefix"], cluster=True)}
    finally:
        h.close()


def objects(config: str, spec: dict) -> dict:
    """With a plain Mooncake client (no Maru): `put` objects under the names given (their
    name's bytes, `ours`), or which of `names` Mooncake holds (each read back: "ours" where
    it is such an object, whole, else "held" or "gone")."""
    store = cc.plain_client(config)
    ours = lambda name: name.encode() * 100  # noqa: E731
    try:
        if "put" in spec:
            return {"codes": [store.put(n, ours(n)) for n in spec["put"]]}
        got = [bytes(store.get(n)) for n in spec["names"]]
        seen = [
            "ours" if g == ours(n) else "held" if g else "gone" for n, g in zip(spec["names"], got)
        ]
        return {"seen": seen}
    finally:
        store.close()


# -- the scenario (the driver, outside the nodes) -------------------------------------------


def start_master(self: Any) -> None:
    """`cluster_child.Nodes.start_master`, its leases LEASE_MS long."""
    master = [str(cc.master_binary()), f"--rpc_address={cc.NODE1}", "--rpc_port=50051"]
    master += [f"--metrics_host={cc.NODE1}", "--metrics_port=9003"]
    master += [f"--default_kv_lease_ttl={LEASE_MS}"]
    enter = ["nsenter", "-t", str(self.one.pid), "-n", "-m", "timeout", str(cc.LIFE_S)]
    with (self.workdir / "master.log").open("ab") as log:
        self.master = subprocess.Popen(
            [*enter, *master], stdout=log, stderr=log, env=cc.library_env(), start_new_session=True
        )
    self.started.append(self.master)


def mine(c: Any, node: int, mode: str, spec: dict) -> Any:
    """One of this file's steps in node 1 or 2 (`objects` with the shared config)."""
    pid, url = (c.one.pid, c.url1) if node == 1 else (c.two.pid, c.url2)
    env = f"MOONCAKE_LOCAL_HOSTNAME={cc.NODE2 if node == 2 else cc.NODE1}"
    target = str(c.config) if mode == "objects" else url
    out = cc.in_node(pid, mode, target, json.dumps(spec), env=env, script=str(HERE))
    return out.get(next(iter(out))) if "failed" not in out and len(out) == 1 else out


def cli(c: Any, node: int, *args: str) -> dict:
    """The real `maru` CLI in node 1 or 2, against its server: exit status and output."""
    pid, url = (c.one.pid, c.url1) if node == 1 else (c.two.pid, c.url2)
    enter = ["nsenter", "-t", str(pid), "-n", "-m"]
    done = subprocess.run(
        [*enter, *maru_command(), "--server", url, *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return {"rc": done.returncode, "out": done.stdout + done.stderr}


def removed(c: Any, node: int, want: int) -> dict:
    """The tier's stats once its clears removed `want` objects and none is pending (or at
    the deadline: what they are then)."""
    deadline = time.monotonic() + cc.WAIT_S
    while True:
        now = c.ask(node, "stats")
        done = "failed" in now or (now["removed"] >= want and not now["removing"])
        if done or time.monotonic() > deadline:
            return now
        time.sleep(0.2)


def candidates(keys: list[str], tags: dict[str, str] | None = None) -> dict:
    tags = tags or {}
    return {"keys": keys, "candidates": [[tags.get(k, k)] for k in keys]}


def clear(workdir: Path) -> dict:
    cc.Nodes.start_master = start_master  # (leases of LEASE_MS: see LEASE_WAIT_S)
    wait = ("--cluster-lookup-ms", "3000")  # (a bound on node 2's pulls, not a threshold)
    with cc.cluster(workdir, wait, wait) as c:
        out: dict[str, Any] = {
            "connected": [c.wait(n, "connected", True)["connected"] for n in (1, 2)]
        }
        step = trust.step
        theirs = [cc.object_name(OTHER_TENANT, k) for k in (*NS1, *NS2)]
        unanchored = "x" + cc.object_name("default", NS1[0])
        out["other"] = mine(c, 2, "objects", {"put": [*theirs, unanchored]})
        # Node 1 writes ns1:, ns2: and the trap (write-through); node 2 one ns1: key of its own.
        keys = [*NS1, *NS2, TRAP]
        out["put"] = step(c, 1, "put", dict(keys=keys, tags=keys, checksums=True))
        out["put2"] = step(c, 2, "put", dict(keys=["ns1:n2"], tags=["ns1:n2"], checksums=True))
        out["published"] = [c.settled(n)["published"] for n in (1, 2)]
        # Node 1 clears "ns2." (no key has it: read as a regex, it is every ns2: key), then
        # ns1: in its pool and in the cluster.
        out["delete_dot"] = mine(c, 1, "delete_prefix", {"prefix": "ns2."})
        out["removed_dot"] = removed(c, 1, 0)
        out["delete"] = mine(c, 1, "delete_prefix", {"prefix": "ns1:"})
        out["removed"] = removed(c, 1, 5)
        out["node2_after"] = step(c, 2, "read", candidates([*NS1, *NS2, TRAP]))
        names = [cc.object_name("default", k) for k in ("ns1:n2", *NS1, *NS2, TRAP)]
        out["seen_after"] = mine(c, 2, "objects", {"names": names})
        # Written again after the clear, with new bytes: node 2 reads them.
        again = {NS1[0]: "ns1:0#2"}
        out["rewrite"] = step(c, 1, "put", dict(keys=[NS1[0]], tags=["ns1:0#2"], checksums=True))
        out["ns3"] = step(c, 1, "put", dict(keys=NS3, tags=NS3, checksums=True))
        out["republished"] = c.settled(1)["published"]
        out["node2_rewrite"] = step(c, 2, "read", candidates([NS1[0]], again))
        # `maru clear --cluster` on node 1, once node 2's leases have lapsed; node 2's pool
        # cleared too (it keeps what it pulled): node 2 then misses every key.
        time.sleep(LEASE_WAIT_S)
        out["cli"] = cli(c, 1, "clear", "--yes", "--cluster")
        out["cleared"] = removed(c, 1, out["removed"]["removed"] + 1)
        out["cli2"] = cli(c, 2, "clear", "--yes")
        everything = [*NS1, *NS2, *NS3, TRAP, "ns1:n2"]
        out["node2_end"] = step(c, 2, "read", candidates(everything, again))
        out["other_end"] = mine(c, 2, "objects", {"names": [*theirs, unanchored]})
        out["node1"] = c.settled(1)
        return out


def run_nodes(tmp_path: Path, scenario: str) -> dict:
    return trust_nodes(tmp_path, scenario, HERE)


# -- the tests ------------------------------------------------------------------------------


@pytest.mark.skipif(bool(cannot_run()), reason=cannot_run() or "-")
def test_a_clear_on_one_node_is_a_miss_on_every_node_and_later_writes_are_not(tmp_path):
    """Node 1 writes ns1:0..3, ns2:0..3 and "ns1.x" (write-through), node 2 "ns1:n2" of its
    own; a plain Mooncake client puts another tenant's objects of the same keys, and one
    whose name holds ours unanchored. Node 1's `delete_prefix("ns1:", cluster=True)`: node
    2 misses every ns1: key (its lookups pulled within their budget: the cluster has them no
    more; node 2's own ns1:n2 is gone from the cluster too, 5 objects removed), and reads
    ns2: and "ns1.x" byte for byte. ns1:0 written again on node 1 with other bytes, after the
    clear: node 2 reads the new bytes (Mooncake keeps an object's first put: without the
    removal, the old ones). `maru clear --cluster` on node 1 (the real CLI): every object of
    the tenant is removed, so node 2, its own pool cleared, misses everything, also keys it
    never read (ns3:); the other tenant's objects stay. Fails without the cluster removal
    (node 2 pulls ns1: back, and reads ns1:0's first bytes after the rewrite), with an
    unescaped prefix (a clear of "ns2.", which no key starts with, removes nothing: read as
    a regex it would take every ns2: object) or an unanchored one (the name holding ours),
    and without `--cluster` reaching the server from the CLI. (The order of a removal among
    batches in flight: `unit/test_cluster_clear.py`.)"""
    nodes = run_nodes(tmp_path, "clear")
    assert nodes["connected"] == [True, True], nodes
    assert nodes["other"] == [0] * 9, nodes
    assert nodes["put"] == 9 and nodes["put2"] == 1, nodes
    assert nodes["published"] == [9, 1], nodes
    assert nodes["delete_dot"] == 0 and nodes["removed_dot"]["removed"] == 0, nodes
    assert nodes["delete"] == 4, nodes
    assert (nodes["removed"]["removed"], nodes["removed"]["remove_failures"]) == (5, 0), nodes
    assert nodes["node2_after"] == ["missing"] * 4 + [*NS2, TRAP], nodes
    assert nodes["seen_after"] == ["gone"] * 5 + ["held"] * 5, nodes
    assert nodes["rewrite"] == 1 and nodes["ns3"] == 4, nodes
    assert nodes["republished"] == 9 + 5, nodes
    assert nodes["node2_rewrite"] == ["ns1:0#2"], nodes
    assert nodes["cli"]["rc"] == 0, nodes
    assert "cluster: asked to remove every object of its tenant" in nodes["cli"]["out"], nodes
    # (left after the first clear: ns2: 4, ns1.x, ns1:0's new write, ns3: 4)
    cleared = nodes["cleared"]
    assert (cleared["removed"], cleared["remove_failures"], cleared["removing"]) == (15, 0, 0)
    assert nodes["cli2"]["rc"] == 0, nodes
    assert nodes["node2_end"] == ["missing"] * 14, nodes
    assert nodes["other_end"] == ["ours"] * 9, nodes
    assert nodes["node1"]["publish_failures"] == 0, nodes


def test_the_cli_says_a_server_without_a_tier_cleared_its_pool_alone(maru_server):
    """`maru evict --prefix P --cluster` and `maru clear --yes --cluster` against a server
    without --cluster: the pool's keys go, the output says there is no cluster, exit 0."""
    from maru import MaruHandler

    with MaruHandler(server_url=maru_server.url, pool_size="8M", chunk_size_bytes="64K") as h:
        assert h.batch_store(["ns:1", "ns:2", "x:1"], [b"v" * 100] * 3) == [True] * 3
        assert h.delete_prefix("ns:2", cluster=True) == 1
    rc, text = run(maru_server.url, "evict", "--prefix", "ns:", "--cluster")
    assert rc == 0
    assert text.splitlines() == [
        "deleted 1 keys with prefix 'ns:' (0 pinned or leased, kept)",
        "cluster: none (maru-server without --cluster): the pool alone was cleared",
    ]
    rc, text = run(maru_server.url, "clear", "--yes", "--cluster")
    assert rc == 0 and text.splitlines()[1].startswith("cluster: none"), text


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    steps = {"delete_prefix": delete_prefix, "objects": objects}
    if mode in steps:
        print(json.dumps(steps[mode](args[0], json.loads(args[1]))))
    else:
        with contextlib.suppress(BrokenPipeError):
            print(json.dumps({"clear": clear}[args[0]](Path(mode))))
