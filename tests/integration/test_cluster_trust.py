"""The cluster tier and the first rule: a hit is the bytes written under that key, or a miss.

What `test_cluster_tier.py` does not cover: keys that differ only in type, tenant-like
slashes, NUL or Unicode form, each its own Mooncake object; a whole proven object copied
under another key's name; objects whose trailer states another length; a key deleted and
written again; a key deleted, or evicted, while its publish waits in a stopped sidecar and
its pages offered to the next writer; a pull racing a local write; a sidecar SIGKILLed
with pulls pending. Every value is checked byte for byte against the write it came from.

Run as a script (`test_cluster_trust.py WORKDIR SCENARIO`) it drives two nodes
(`cluster_child.cluster`); `test_cluster_trust.py MODE ...` is one step inside a node.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve()
if __name__ == "__main__":  # (a step in a node, or the driver: the repo's tests importable)
    sys.path[:0] = [str(HERE.parents[2]), str(HERE.parents[1])]
    from tests.integration import cluster_child as cc
    from tests.integration.test_cluster_tier import cannot_run
    from tests.integration.test_crash_safety import make_value
else:
    from .test_cluster_tier import cannot_run

SIZE = 60_000  # (`cluster_child.SIZE`)
SPILL_N = 250  # (`cluster_child.SPILL_N`): past node 1's high watermark
TWINS: list[Any] = [  # keys a careless naming would merge (bytes keys as {"hex": ...})
    "6b",
    {"hex": "6b"},  # b"k": its hex is the str key "6b"
    "k",
    {"hex": "00ff2f6b"},  # b"\x00\xff/k"
    "s/k",
    "t/s/k",
    "k\x00a",
    "k\x00b",
    "\xe9",  # "é" composed ...
    "e\u0301",  # ... and decomposed
]


def _key(spec: Any) -> str | bytes:
    return bytes.fromhex(spec["hex"]) if isinstance(spec, dict) else spec


# -- steps run inside a node --------------------------------------------------------------


def put(url: str, spec: dict) -> dict:
    """Store spec's keys, each with make_value(its tag), 16 a call; with or without the
    writer's checksums (without: only the tier's holds keep its pages for its publish)."""
    h = cc.handler(url, checksums=spec["checksums"])
    try:
        keys, tags, stored = [_key(k) for k in spec["keys"]], spec["tags"], 0
        for at in range(0, len(keys), 16):
            values = [make_value(t, SIZE) for t in tags[at : at + 16]]
            stored += sum(h.batch_store(keys[at : at + 16], values))
        return {"stored": stored}
    finally:
        h.close()


def delete(url: str, spec: dict) -> dict:
    h = cc.handler(url)
    try:
        return {"deleted": [h.delete(_key(k)) for k in spec["keys"]]}
    finally:
        h.close()


def judge(got: bytes | None, candidates: list[str]) -> str:
    """Which candidate write `got` is, byte for byte: its tag, "missing", or "wrong"."""
    if got is None:
        return "missing"
    return next((t for t in candidates if got == make_value(t, SIZE)), "wrong")


def read(url: str, spec: dict) -> dict:
    """Each key read through Maru (leased; no reader checksums: what the tier registered is
    judged by its bytes alone), judged against its candidate writes."""
    h = cc.handler(url, checksums=False)
    keys = [_key(k) for k in spec["keys"]]
    try:
        with h.leased(keys) as infos:
            got = [None if i is None else bytes(i.view) for i in infos]
        return {"seen": [judge(g, c) for g, c in zip(got, spec["candidates"])]}
    finally:
        h.close()


def forge(config: str, spec: dict) -> dict:
    """With a plain Mooncake client: the whole object of `src` (its bytes and its proven
    trailer) copied under `dst`'s name; `trunc` as its value less 4 KiB and `long` as its
    value and 4 KiB more, each with a trailer for its own name and the maru64 of the bytes
    put, stating the length written (SIZE). Then the object of `probe` as a plain read finds
    it (which write)."""
    from maru.common.checksum import checksums
    from maru.server.cluster.proof import TRAILER_BYTES, decode_trailer, encode_trailer

    tenant = cc.MooncakeConfig.from_file(config).tenant_id
    name = lambda key: cc.object_name(tenant, key)  # noqa: E731
    store = cc.plain_client(config)
    codes = [store.put(name("dst"), bytes(store.get(name("src"))))]
    for key, body in (
        ("trunc", make_value("trunc", SIZE)[:-4096]),
        ("long", make_value("long", SIZE) + os.urandom(4096)),
    ):
        maru64 = int(checksums([memoryview(body)])[0])
        codes.append(store.put(name(key), body + encode_trailer(name(key), SIZE, maru64)))
    got = bytes(store.get(name(spec["probe"])))
    proof = decode_trailer(name(spec["probe"]), got[-TRAILER_BYTES:])
    value = got[:-TRAILER_BYTES]
    whole = proof is not None and proof == (len(value), int(checksums([memoryview(value)])[0]))
    store.close()
    return {"codes": codes, "probe": judge(value, spec["candidates"]) if whole else "unproven"}


# -- scenarios (the driver, outside the nodes) ----------------------------------------------


def step(c: Any, node: int, mode: str, spec: dict) -> Any:
    pid, url = (c.one.pid, c.url1) if node == 1 else (c.two.pid, c.url2)
    target = str(c.config) if mode == "forge" else url
    env = f"MOONCAKE_LOCAL_HOSTNAME={cc.NODE2 if node == 2 else cc.NODE1}"
    out = cc.in_node(pid, mode, target, json.dumps(spec), env=env, script=str(HERE))
    return out.get(next(iter(out))) if "failed" not in out and len(out) == 1 else out


def binding(workdir: Path) -> dict:
    """Keys that must not meet in Mooncake, proofs bound to key and length, a rewrite."""
    with cc.cluster(workdir, ("--cluster-lookup-ms", "10000")) as c:
        out: dict[str, Any] = {
            "connected": [c.wait(n, "connected", True)["connected"] for n in (1, 2)]
        }
        tags = [f"twin{i}" for i in range(len(TWINS))]
        keys = [*TWINS, "src", "dw"]
        out["put"] = step(c, 1, "put", dict(keys=keys, tags=[*tags, "src", "dw#1"], checksums=True))
        out["published"] = c.settled(1)["published"]
        out["delete"] = step(c, 1, "delete", {"keys": ["dw"]})
        out["rewrite"] = step(c, 1, "put", dict(keys=["dw"], tags=["dw#2"], checksums=True))
        out["republished"] = c.settled(1)["published"]
        out["node1_dw"] = step(c, 1, "read", dict(keys=["dw"], candidates=[["dw#1", "dw#2"]]))
        spec = {"probe": "dw", "candidates": ["dw#1", "dw#2"]}
        out["forge"] = step(c, 2, "forge", spec)
        reads = [*keys, "dst", "trunc", "long"]
        candidates = [*([t] for t in tags), ["src"], ["dw#1", "dw#2"], ["src"], ["trunc"], ["long"]]
        out["node2"] = step(c, 2, "read", dict(keys=reads, candidates=candidates))
        out["node2_stats"] = c.settled(2)
        return out


def held(workdir: Path) -> dict:
    """Holds against page reuse (write-through and spill), a pull racing a local write, a
    sidecar SIGKILLed with pulls pending."""
    spill = ("--cluster-publish", "spill", "--eviction-high-watermark", "0.2")
    spill += ("--eviction-low-watermark", "0.1")
    wait = ("--cluster-lookup-ms", "3000")
    with cc.cluster(workdir, wait, (*wait, *spill)) as c:
        out: dict[str, Any] = {
            "connected": [c.wait(n, "connected", True)["connected"] for n in (1, 2)]
        }
        sidecar1 = c.settled(1)["sidecar_pid"]
        # Spill, node 1: every value evicted (published while its writer's later stores go
        # on) with the sidecar stopped; the writer makes no checksums.
        keys = [f"s/{i}" for i in range(SPILL_N)]
        os.kill(sidecar1, signal.SIGSTOP)
        try:
            out["spill_put"] = step(c, 1, "put", dict(keys=keys, tags=keys, checksums=False))
            out["spill_stopped"] = cc.in_node(c.one.pid, "stats", c.url1)
        finally:
            os.kill(sidecar1, signal.SIGCONT)
        out["spill_tier"] = c.settled(1)
        out["spill_node2"] = step(c, 2, "read", dict(keys=keys, candidates=[[k] for k in keys]))
        # Node 2 (write-through) publishes; node 1 pulls, with its sidecar stopped, keys a
        # local writer then stores with other bytes.
        remote = ["r/0", "r/1", "q/0", "q/1"]
        out["remote"] = step(c, 2, "put", dict(keys=remote, tags=remote, checksums=True))
        c.settled(2)
        race = dict(keys=remote[:2], candidates=[["r/0", "r/0#2"], ["r/1", "r/1#2"]])
        os.kill(sidecar1, signal.SIGSTOP)
        try:
            out["race_first"] = step(c, 1, "read", race)  # (its pulls wait in the sidecar)
            local = dict(keys=remote[:2], tags=["r/0#2", "r/1#2"], checksums=True)
            out["race_local"] = step(c, 1, "put", local)
        finally:
            os.kill(sidecar1, signal.SIGCONT)
        out["race_tier"] = c.settled(1)
        out["race_read"] = step(c, 1, "read", race)
        # Write-through, node 2: a value stored (no writer checksums) while its sidecar is
        # stopped waits there, held; deleted meanwhile, then the next writer's pages.
        sidecar2 = c.settled(2)["sidecar_pid"]
        os.kill(sidecar2, signal.SIGSTOP)
        try:
            victim = dict(keys=["victim"], tags=["victim"], checksums=False)
            out["victim"] = step(c, 2, "put", victim)
            out["victim_delete"] = step(c, 2, "delete", {"keys": ["victim"]})
            fill = [f"fill/{i}" for i in range(8)]
            out["fill"] = step(c, 2, "put", dict(keys=fill, tags=fill, checksums=False))
        finally:
            os.kill(sidecar2, signal.SIGCONT)
        out["victim_tier"] = c.settled(2)
        out["victim_node1"] = step(c, 1, "read", dict(keys=["victim"], candidates=[["victim"]]))
        # Node 1's sidecar SIGKILLed with pulls pending; started again, it pulls them anew
        # (a replica that lay in its dead segment: a miss).
        qs = dict(keys=remote[2:], candidates=[["q/0"], ["q/1"]])
        os.kill(sidecar1, signal.SIGSTOP)
        out["killed_first"] = step(c, 1, "read", qs)
        os.kill(sidecar1, signal.SIGKILL)
        out["killed_restarted"] = c.wait(1, "sidecar_starts", 2)["sidecar_starts"]
        c.wait(1, "connected", True)
        out["killed_read"] = step(c, 1, "read", qs)
        out["killed_tier"] = c.settled(1)
        return out


def run_nodes(tmp_path: Path, scenario: str, script: Path = HERE) -> dict:
    """`script`'s driver (this file's, or another that runs as this one does) in a process
    of its own: the nodes' namespaces go with it; its last line, a JSON document, returned."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    done = subprocess.run(
        [sys.executable, str(script), str(workdir), scenario],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- the tests ------------------------------------------------------------------------------


def test_object_names_never_merge_keys_of_other_types_tenants_or_bytes():
    """`object_name` is one-to-one over keys that differ only in type (str "6b" and bytes
    b"k", whose hex it is), in where a slash falls between tenant and key (tenant "t", key
    "s/k" and tenant "t/s", key "k"), in NUL or odd bytes, or in Unicode form: two Maru keys
    of one Mooncake name would read each other's values as proven (the trailer binds the
    name, not the key). Fails if the kind tag or the tenant's length is dropped."""
    from maru.server.cluster.proof import object_name

    keys = [_key(k) for k in TWINS] + [b"6b", b"s/k", "b/6b", "s/6b", b"\x00", "\x00"]
    tenants = ["t", "t/s", "default", "t/s/s", "3/t"]
    names = {(t, k): object_name(t, k) for t in tenants for k in keys}
    assert len(set(names.values())) == len(names), names


need_nodes = pytest.mark.skipif(bool(cannot_run()), reason=cannot_run() or "-")


@need_nodes
def test_a_pulled_value_is_the_one_written_under_its_key_or_a_miss(tmp_path):
    """Node 1 publishes keys a careless naming would merge (str "6b" and bytes b"k", NUL in
    a str key, composed and decomposed "é"...): node 2 reads each as its own write, every
    byte. Node 2 refuses (misses, `proof_failures`): a whole proven object copied under
    another key's name (`dst`: the trailer binds the name), and objects whose trailer
    states another length than the bytes' (`trunc`, `long`: the maru64 is right for the
    bytes put). A key deleted and written again with other bytes on node 1: Mooncake keeps
    the first object (its put of an existing name answers 0 and changes nothing), so node 2
    reads the first write, whole and proven; never a mix, never another key's. (A delete is
    not a retraction: Maru keys name their content, and the pool itself keeps a key's first
    write over a second writer's.)"""
    nodes = run_nodes(tmp_path, "binding")
    assert nodes["connected"] == [True, True], nodes
    assert nodes["put"] == len(TWINS) + 2 and nodes["published"] == len(TWINS) + 2, nodes
    assert nodes["delete"] == [True] and nodes["rewrite"] == 1, nodes
    assert nodes["node1_dw"] == ["dw#2"], nodes
    assert nodes["forge"] == {"codes": [0, 0, 0], "probe": "dw#1"}, nodes
    tags = [f"twin{i}" for i in range(len(TWINS))]
    assert nodes["node2"] == [*tags, "src", "dw#1", "missing", "missing", "missing"], nodes
    assert nodes["node2_stats"]["proof_failures"] == 3, nodes
    assert nodes["node2_stats"]["pulled"] == len(TWINS) + 2, nodes


@need_nodes
def test_pages_being_published_are_never_reused_and_pulls_never_overwrite(tmp_path):
    """Holds, with writers that make no checksums (nothing but the hold keeps a value's pages
    its own until the sidecar has read them):

    - spill: node 1's sidecar stopped while one writer stores past the watermark; the
      victims sent to be published stay registered, held, while the writer stores on; once
      the sidecar goes on, node 2 reads every published victim as written (a victim dropped
      on sending would have its pages reused and their bytes published, proven, under it);
    - write-through: node 2's sidecar stopped, a value stored waits in it, held: its delete
      is refused (pinned) and the next writer gets other pages; node 1 reads it as written;
    - a pull waiting in node 2's stopped sidecar while a local writer stores the key with
      other bytes: the local write wins, the pull's bytes are never registered over it;
    - node 1's sidecar SIGKILLed with pulls pending: started again, each key is read
      whole or missed, never other bytes (nothing of the dead sidecar's batches is
      registered; a replica that lay in its dead segment is a miss)."""
    nodes = run_nodes(tmp_path, "held")
    assert nodes["connected"] == [True, True], nodes
    assert nodes["spill_put"] == SPILL_N, nodes
    assert nodes["spill_stopped"]["in_flight"] > 0, nodes  # (victims waiting, held)
    seen, published = nodes["spill_node2"], nodes["spill_tier"]["published"]
    assert "wrong" not in seen and len(seen) - seen.count("missing") == published > 0, nodes
    assert nodes["remote"] == 4, nodes
    assert nodes["race_first"] == ["missing", "missing"], nodes
    assert nodes["race_local"] == 2 and nodes["race_read"] == ["r/0#2", "r/1#2"], nodes
    assert nodes["victim"] == 1 and nodes["victim_delete"] == [False], nodes
    assert nodes["fill"] == 8 and nodes["victim_node1"] == ["victim"], nodes
    assert nodes["killed_first"] == ["missing", "missing"], nodes
    assert nodes["killed_restarted"] == 2, nodes
    assert all(s in (q, "missing") for s, q in zip(nodes["killed_read"], ["q/0", "q/1"])), nodes


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    steps = {"put": put, "delete": delete, "read": read, "forge": forge}
    if mode in steps:
        print(json.dumps(steps[mode](args[0], json.loads(args[1]))))
    else:
        print(json.dumps({"binding": binding, "held": held}[args[0]](Path(mode))))
