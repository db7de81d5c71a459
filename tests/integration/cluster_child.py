"""Run by `test_cluster_tier.py`: two nodes and a Mooncake master, simulated on this machine.

`cluster_child.py WORKDIR` makes two nodes the way `pod_child.py` makes hosts (its `host` and
`sh`): each a network and mount namespace of its own with a private /dev/shm, joined by a
veth pair (10.44.0.1 and 10.44.0.2, only inside them). Node 1 runs `mooncake_master`; each
node runs a `maru-server --cluster mooncake` (its pool in its own /dev/shm, its local
hostname from MOONCAKE_LOCAL_HOSTNAME, beside one shared config file). A client on node 1
writes values with its checksums (`write`); the tier publishes them. One more value is stored
while the sidecar is stopped (SIGSTOP) and a byte of it is flipped in the pool before the
sidecar goes on: its pages no longer match its writer's checksum, so it must not be
published; meanwhile node 1's server serves its own values (its loop never waits on the
tier). A plain Mooncake client on node 2 (`read`, no Maru) reads every value and its proof
back; values whose proof does not hold are put (`forge`); a client of node 2's server reads
them all (`retrieve`). At the end node 1's sidecar is SIGKILLed (its Mooncake segment with
it): the server starts it again, and node 2 reads values that lay in the dead segment.
Prints one JSON line: what each step reported.

Everything it starts ends with it: the master, the servers and the nodes' `sleep`s are killed
on the way out (the sidecars die with their servers), and bounded by `timeout` / `sleep` if
this process is killed.

`cluster_child.py write URL PREFIX N [FLIP]`: store PREFIX/i (i < N) with checksums; with
FLIP, flip a byte of each in the pool after storing it. `cluster_child.py stats URL`: the
server's `cluster` stats. `cluster_child.py read CONFIG PREFIX N`: read PREFIX/i from
Mooncake with a plain client, by their bytes and proofs. `cluster_child.py forge CONFIG
PREFIX`: put values whose proofs do not hold. `cluster_child.py retrieve URL PREFIX N`: read
PREFIX/i through Maru; `copyread URL PREFIX N` through a copying lookup (`lookup(for_copy=True)`),
`pinread URL PREFIX N` pinned first (`batch_pin`).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TESTS.parent), str(TESTS)]  # (tests.integration, and conftest as pytest has it)

from tests.integration.pod_child import LIFE_S, host, sh  # noqa: E402
from tests.integration.test_crash_safety import intact, make_value  # noqa: E402
from tests.integration.test_pool_trust import read_counts  # noqa: E402
from tests.integration.workers import flip_byte  # noqa: E402

import conftest  # noqa: E402
from maru import MaruAdmin, MaruHandler  # noqa: E402
from maru.client.reads import copy_and_prove  # noqa: E402
from maru.common.checksum import checksums  # noqa: E402
from maru.server.cluster.config import MooncakeConfig  # noqa: E402
from maru.server.cluster.mooncake import library_env, load_mooncake, master_binary  # noqa: E402
from maru.server.cluster.proof import (  # noqa: E402
    TRAILER_BYTES,
    decode_trailer,
    encode_trailer,
    object_name,
)

NODE1, NODE2 = "10.44.0.1", "10.44.0.2"
MASTER = f"{NODE1}:50051"
SIZE = 60_000
N = 24
SPILL_N = 250  # values of SIZE node 1 writes with spill: 15 MB, past its high watermark
SHARE, SHARE_BATCH = "8M", 8  # an instance's share that SPILL_N values overflow; its calls
WAIT_S = 60  # the longest any step here waits for the tier
CROWD_N, CROWD_READ, OWN_N = 480, 120, 96  # values of SIZE pulled into a 32M pool (28 MiB
# of it), read CROWD_READ at a time; then values a new instance writes there
SIDECAR_CHECK_S = 1.0  # `maru.server.cluster.sidecar.CHECK_S`
FSDAX = "/dev/shm/maru-fsdax/"  # node 1's pool in `fsdax` (in its own /dev/shm)


def handler(url: str, checksums: bool = True, pool_size: str = "32M") -> MaruHandler:
    return MaruHandler(
        server_url=url,
        pool_size=pool_size,  # (32M: above `spill`'s high watermark: its rounds, not room)
        chunk_size_bytes="64K",
        checksums=checksums,
        timeout_ms=5000,
    )


def write(url: str, prefix: str, n: int, flip: bool) -> dict:
    h = handler(url)
    try:
        keys = [f"{prefix}/{i}" for i in range(n)]
        stored = 0
        for at in range(0, n, 16):  # several stores: each round of eviction spares only the
            batch = keys[at : at + 16]  # keys of the store that set it off
            stored += sum(h.batch_store(batch, [make_value(k, SIZE) for k in batch]))
        for key in keys if flip else ():
            flip_byte(h, key, at=SIZE // 2)
        return {"stored": stored}
    finally:
        h.close()


def write_share(url: str, prefix: str, n: int) -> dict:
    """PREFIX/i (i < n) written by one instance whose `maru_pool_size` (SHARE) holds a
    fraction of them, SHARE_BATCH values a call (a sixteenth of its share: it asks room for
    its next calls ahead), waiting between calls until the tier has nothing in flight, as a
    writer slower than the tier would. Stored; then the pool's keys and eviction rounds."""
    h = handler(url, pool_size=SHARE)
    try:
        stored = 0
        for at in range(0, n, SHARE_BATCH):
            batch = [f"{prefix}/{i}" for i in range(at, min(n, at + SHARE_BATCH))]
            stored += sum(h.batch_store(batch, [make_value(k, SIZE) for k in batch]))
            deadline = time.monotonic() + WAIT_S
            while any(h.stats()["cluster"][k] for k in ("queue_depth", "in_flight")):
                assert time.monotonic() < deadline, "the tier did not settle"
                time.sleep(0.02)
        server = h.stats()
        return {"stored": stored, "kept": server["keys"], "counters": server["counters"]}
    finally:
        h.close()


def stats(url: str) -> dict:
    """The server's `cluster` statistics, asked by a handler that never connects (it takes
    no region of the pool: asked after SGLang's instances, it needs none free)."""
    h = MaruHandler(server_url=url, auto_connect=False, timeout_ms=5000)
    try:
        return h.stats()["cluster"]
    finally:
        h.close()


def retrieve(url: str, prefix: str, n: int) -> dict:
    """PREFIX/i read through Maru on this node (leased lookups, as `read_counts`): right,
    missing, wrong bytes. Without the reader's own checksums: what the tier let in is judged
    by its bytes alone."""
    h = handler(url, checksums=False)
    try:
        right, missing, wrong = read_counts(h, [f"{prefix}/{i}" for i in range(n)])
        return {"right": right, "missing": missing, "wrong": wrong}
    finally:
        h.close()


def copy_read(url: str, prefix: str, n: int) -> dict:
    """PREFIX/i read as MaruStorage's v2 read does, through a copying lookup
    (`lookup(for_copy=True)`, its copies, `copy_and_prove`): right, missing, wrong bytes."""
    h = handler(url, checksums=False)
    keys = [f"{prefix}/{i}" for i in range(n)]
    rows = np.zeros((n, SIZE), np.uint8)

    def copy(sources: np.ndarray) -> None:
        for row, address in zip(rows, sources.tolist()):
            if address:
                ctypes.memmove(row.ctypes.data, address, SIZE)

    try:
        with h.copying():
            proven, _ = copy_and_prove(h.lookup(keys, lease=True, for_copy=True), [(n, SIZE, copy)])
        good = [ok and intact(k, row) for k, ok, row in zip(keys, proven.tolist(), rows)]
        right = sum(good)
        return {
            "right": right,
            "missing": n - int(proven.sum()),
            "wrong": int(proven.sum()) - right,
        }
    finally:
        h.close()


def pin_read(url: str, prefix: str, n: int) -> dict:
    """PREFIX/i pinned (LMCache's pinned lookup: `batch_pin`), then read: how many the pin
    found, and the reads' right, missing, wrong bytes."""
    h = handler(url, checksums=False)
    keys = [f"{prefix}/{i}" for i in range(n)]
    try:
        pinned = sum(h.batch_pin(keys))
        right, missing, wrong = read_counts(h, keys)
        return {"pinned": pinned, "right": right, "missing": missing, "wrong": wrong}
    finally:
        h.close()


def plain_client(config: str) -> Any:
    """A Mooncake client of no Maru's, holding no data itself (segment 0)."""
    c = MooncakeConfig.from_file(config)
    store = load_mooncake().MooncakeDistributedStore()
    rc = store.setup(c.local_hostname, c.metadata_server, 0, 16 << 20, c.protocol, "", MASTER)
    if rc != 0:
        raise RuntimeError(f"Mooncake setup: {rc}")
    return store


def forge(config: str, prefix: str) -> dict:
    """Objects in Mooncake whose proof does not hold, or of another format: PREFIX/0 as if a
    byte of it flipped in Mooncake's memory (its trailer states the value's true length and
    maru64); PREFIX/1 with its true bytes and the trailer made for another name (PREFIX/0's);
    PREFIX/2 with its true bytes and no trailer (as a plain Mooncake client puts a value);
    PREFIX/3 in the tier's first format (the value and a valid proof beside it, under that
    format's names: `maru/...` and `...#maru64`)."""
    tenant = MooncakeConfig.from_file(config).tenant_id
    store = plain_client(config)
    first = object_name(tenant, f"{prefix}/0")
    true = make_value(f"{prefix}/0", SIZE)
    trailer = encode_trailer(first, SIZE, int(checksums([memoryview(true)])[0]))
    flipped = bytearray(true)
    flipped[SIZE // 2] ^= 0xFF
    codes = [store.put(first, bytes(flipped) + trailer)]
    second = object_name(tenant, f"{prefix}/1")
    codes.append(store.put(second, make_value(f"{prefix}/1", SIZE) + trailer))
    codes.append(store.put(object_name(tenant, f"{prefix}/2"), make_value(f"{prefix}/2", SIZE)))
    key, value = f"{prefix}/3", make_value(f"{prefix}/3", SIZE)
    old = f"maru/{tenant}/s/{key}"
    digest = hashlib.blake2b(old.encode(), digest_size=16).digest()
    proof = struct.pack("<8sqq16s", b"maru64p1", SIZE, checksums([memoryview(value)])[0], digest)
    codes += [store.put(old, value), store.put(f"{old}#maru64", proof)]
    store.close()
    return {"codes": codes}


def read(config: str, prefix: str, n: int) -> dict:
    """Each object from Mooncake with a plain client: right (the bytes as written, then a
    trailer for this name stating their length and maru64), missing (no object, or no
    trailer for this name), wrong (anything else)."""
    c = MooncakeConfig.from_file(config)
    store = plain_client(config)
    right = missing = wrong = 0
    for i in range(n):
        key = f"{prefix}/{i}"
        name = object_name(c.tenant_id, key)
        got = bytes(store.get(name))
        proof = decode_trailer(name, got[-TRAILER_BYTES:])
        if proof is None:
            missing += 1
            continue
        value = got[:-TRAILER_BYTES]
        length, checksum = proof
        ok = value == make_value(key, SIZE) and length == len(value)
        ok = ok and int(checksums([memoryview(value)])[0]) == checksum
        right += ok
        wrong += not ok
    store.close()
    return {"right": right, "missing": missing, "wrong": wrong}


def in_node(pid: int, *args: str, env: str = "", script: str = __file__) -> dict:
    """One `cluster_child.py` mode (or `script`'s, e.g. a benchmark's) run in node `pid`:
    its JSON line."""
    cmd = ["nsenter", "-t", str(pid), "-n", "-m", "env", *env.split(), sys.executable]
    done = subprocess.run([*cmd, script, *args], capture_output=True, text=True, timeout=90)
    if done.returncode != 0:
        return {"failed": done.stderr[-3000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def wait_for(pid: int, url: str, done: str, want: int | bool) -> dict:
    """The tier's stats once `done` (published, proof_failures...) reaches `want` (a
    flag such as connected: once it is `want`)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        now = in_node(pid, "stats", url)
        if "failed" in now or time.monotonic() > deadline:
            return now
        if now[done] == want if isinstance(want, bool) else now[done] >= want:
            return now
        time.sleep(0.2)


def node_server(
    pid: int,
    ip: str,
    workdir: Path,
    config: Path | None,
    *args: str,
    pool_size: str = "64M",
    pool: str | None = None,
) -> Any:
    """A `maru-server --cluster mooncake` in node `pid`, its local hostname `ip` given by
    MOONCAKE_LOCAL_HOSTNAME (one config file for every node, as SGLang's); with no
    `config`, a server without a tier."""
    command = SERVER_COMMAND
    conftest.maru_server_command = lambda: [
        *("nsenter", "-t", str(pid), "-n", "-m", "timeout", str(LIFE_S)),
        *("env", f"MOONCAKE_LOCAL_HOSTNAME={ip}"),
        *command,
    ]
    tier = ["--cluster", "mooncake", "--cluster-config", str(config)] if config else []
    return conftest.MaruServerProcess(
        workdir, pool_size=pool_size, extra_args=[*tier, *args], pool=pool
    ).start()


SERVER_COMMAND = conftest.maru_server_command()


@dataclass
class Nodes:
    """The two nodes (their namespaces' holders), their servers' URLs, the shared config
    file, and every process started (killed at the end)."""

    one: subprocess.Popen
    two: subprocess.Popen
    url1: str
    url2: str
    config: Path
    workdir: Path
    started: list[subprocess.Popen]
    master: subprocess.Popen | None = None

    def start_master(self) -> None:
        """`mooncake_master` on node 1, in a process group of its own (`timeout` forks it:
        a kill of `timeout` alone would orphan it)."""
        master = [str(master_binary()), f"--rpc_address={NODE1}", "--rpc_port=50051"]
        master += [f"--metrics_host={NODE1}", "--metrics_port=9003"]
        enter = ["nsenter", "-t", str(self.one.pid), "-n", "-m", "timeout", str(LIFE_S)]
        with (self.workdir / "master.log").open("ab") as log:
            self.master = subprocess.Popen(
                [*enter, *master], stdout=log, stderr=log, env=library_env(), start_new_session=True
            )
        self.started.append(self.master)

    def kill_master(self) -> None:
        assert self.master is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.master.pid, signal.SIGKILL)
        self.master.wait(10)

    def ask(self, node: int, mode: str, *args: str | int) -> dict:
        """A `cluster_child.py` mode (write, retrieve, stats) against node 1's or node 2's
        server, from within that node."""
        pid, url = (self.one.pid, self.url1) if node == 1 else (self.two.pid, self.url2)
        return in_node(pid, mode, url, *map(str, args))

    def settled(self, node: int) -> dict:
        """The tier's stats once nothing waits in it (publish queue, lookups, batches)."""
        deadline = time.monotonic() + WAIT_S
        while True:
            now = self.ask(node, "stats")
            busy = ("queue_depth", "pull_queue_depth", "pulling", "in_flight")
            if "failed" in now or time.monotonic() > deadline or not any(now[k] for k in busy):
                return now
            time.sleep(0.2)

    def publish(self, prefix: str, n: int) -> dict:
        """Node 1 writes PREFIX/i (i < n): how many it stored, and how many its tier
        published then (counted between two settled states)."""
        before = self.settled(1)["published"]
        stored = self.ask(1, "write", prefix, n)
        return {**stored, "published": self.settled(1)["published"] - before}

    def wait(self, node: int, done: str, want: int | bool) -> dict:
        """`wait_for` on node 1's or node 2's server."""
        pid, url = (self.one.pid, self.url1) if node == 1 else (self.two.pid, self.url2)
        return wait_for(pid, url, done, want)


@contextlib.contextmanager
def cluster(
    workdir: Path,
    node2_args: tuple[str, ...],
    node1_args: tuple[str, ...] = (),
    pool_size: str = "64M",
    segment: int = 64 << 20,
    node1_pool: str | None = None,
) -> Iterator[Nodes]:
    """Two nodes, a Mooncake master on node 1, a `maru-server --cluster mooncake` on each
    (with `node1_args`, `node2_args`; pools of `pool_size`, Mooncake segments of `segment`
    bytes); every process killed on the way out."""
    started: list[subprocess.Popen] = []
    servers: list[Any] = []
    config = workdir / "mooncake.json"  # one file for every node (SGLang's form)
    config.write_text(
        json.dumps(
            {
                "local_hostname": "localhost",  # MOONCAKE_LOCAL_HOSTNAME wins, per node
                "metadata_server": "P2PHANDSHAKE",
                "master_server_address": MASTER,
                "protocol": "tcp",
                "device_name": "",
                "global_segment_size": segment,
            }
        )
    )
    try:
        started += [host(), host()]
        one, two = started
        sh(
            one.pid,
            "mount -t tmpfs maru-one /dev/shm\n"
            "ip link set lo up\n"
            f"ip link add cl-a type veth peer name cl-b netns {two.pid}\n"
            f"ip addr add {NODE1}/30 dev cl-a\n"
            "ip link set cl-a up",
        )
        sh(
            two.pid,
            "mount -t tmpfs maru-two /dev/shm\n"
            "ip link set lo up\n"
            f"ip addr add {NODE2}/30 dev cl-b\n"
            "ip link set cl-b up",
        )
        nodes = Nodes(one, two, "", "", config, workdir, started)
        nodes.start_master()
        for pid, ip, name, args, pool in (
            (one.pid, NODE1, "node1", node1_args, node1_pool),
            (two.pid, NODE2, "node2", node2_args, None),
        ):
            server = node_server(
                pid, ip, workdir / name, config, *args, pool_size=pool_size, pool=pool
            )
            servers.append(server)
        nodes.url1, nodes.url2 = servers[0].url, servers[1].url
        yield nodes
    finally:
        for server in servers:
            server.halt()
        for proc in reversed(started):
            if proc.args[0] == "nsenter":  # a master: its whole group
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            proc.kill()
            proc.wait(10)


def proofs(workdir: Path) -> dict:
    """Publish, pull and proofs (`test_values_written_on_one_node_are_read_on_another...`)."""
    # Node 2's lookups wait up to 10 s for their pulls: a bound far above what a pull
    # takes (ms), not a threshold the test could miss on a loaded machine; only the pulls
    # from the dead segment at the end wait it out.
    with cluster(workdir, ("--cluster-lookup-ms", "10000")) as c:
        one, two, url1, url2, config = c.one, c.two, c.url1, c.url2, c.config
        out: dict[str, Any] = {}
        out["connected"] = [wait_for(one.pid, url1, "connected", True)]
        out["connected"].append(wait_for(two.pid, url2, "connected", True))
        out["write"] = in_node(one.pid, "write", url1, "v", str(N))
        out["published"] = wait_for(one.pid, url1, "published", N)
        sidecar = out["published"]["sidecar_pid"]
        os.kill(sidecar, signal.SIGSTOP)  # the next value waits in its queue, held
        try:
            out["write_flipped"] = in_node(one.pid, "write", url1, "bad", "1", "flip")
            # The server's loop never waits on the tier: its own keys are served meanwhile.
            out["own_while_stopped"] = in_node(one.pid, "retrieve", url1, "v", str(N))
            out["queued_while_stopped"] = in_node(one.pid, "stats", url1)
        finally:
            os.kill(sidecar, signal.SIGCONT)
        out["refused"] = wait_for(one.pid, url1, "publish_refused", 1)
        env = f"MOONCAKE_LOCAL_HOSTNAME={NODE2}"
        out["read"] = in_node(two.pid, "read", str(config), "v", str(N), env=env)
        out["read_flipped"] = in_node(two.pid, "read", str(config), "bad", "1", env=env)
        out["forge"] = in_node(two.pid, "forge", str(config), "forged", env=env)
        out["node2_first"] = in_node(two.pid, "retrieve", url2, "v", str(N))
        out["node2_bad"] = in_node(two.pid, "retrieve", url2, "bad", "1")
        out["node2_forged"] = in_node(two.pid, "retrieve", url2, "forged", "4")
        out["node2_stats"] = in_node(two.pid, "stats", url2)
        out["node2_again"] = in_node(two.pid, "retrieve", url2, "v", str(N))
        out["node2_stats_again"] = in_node(two.pid, "stats", url2)
        # Node 2's other lookups pull what they miss too: a copying lookup (MaruStorage's
        # v2 read) and a pin (LMCache's pinned lookup).
        out["w"] = [in_node(one.pid, "write", url1, p, "4") for p in ("wc", "wp")]
        wait_for(one.pid, url1, "published", N + 8)
        out["node2_copy_read"] = in_node(two.pid, "copyread", url2, "wc", "4")
        out["node2_pin_read"] = in_node(two.pid, "pinread", url2, "wp", "4")
        # Node 1's sidecar, whose Mooncake segment holds what node 1 published, SIGKILLed:
        # the server starts it again; what lay in the dead segment (v2, published before,
        # never pulled; Mooncake's master still lists it) is never a wrong hit on node 2.
        out["v2"] = in_node(one.pid, "write", url1, "v2", "8")
        out["v2_published"] = wait_for(one.pid, url1, "published", N + 16)
        os.kill(sidecar, signal.SIGKILL)
        out["restarted"] = wait_for(one.pid, url1, "sidecar_starts", 2)
        out["reconnected"] = wait_for(one.pid, url1, "connected", True)
        out["node2_dead_segment"] = in_node(two.pid, "retrieve", url2, "v2", "8")
        return out


def faults(workdir: Path) -> dict:
    """The master SIGKILLed and restarted, node 2's link cut and restored, node 2's
    sidecar stopped and continued (`test_the_pools_serve_their_own_keys_through...`)."""
    # Node 2's lookups wait up to 3 s for a pull: far above a pull's ms, and every wait
    # that runs it out (while the cluster is away) ends in misses.
    with cluster(workdir, ("--cluster-lookup-ms", "3000")) as c:
        out: dict[str, Any] = {"connected": [c.wait(1, "connected", True)]}
        out["connected"].append(c.wait(2, "connected", True))
        out["a"] = c.publish("a", 8)

        # The master SIGKILLed: each pool serves its own keys, stores new ones; lookups of
        # the cluster's keys are misses; each tier notices, and says why.
        c.kill_master()
        out["down_own1"] = c.ask(1, "retrieve", "a", 8)
        out["down_write1"] = c.ask(1, "write", "l1", 4)
        out["down_read1"] = c.ask(1, "retrieve", "l1", 4)
        out["down_cluster2"] = c.ask(2, "retrieve", "a", 8)
        out["down_state1"] = c.wait(1, "connected", False)
        out["down_state2"] = c.wait(2, "connected", False)
        out["down_write2"] = c.ask(2, "write", "l2", 4)
        out["down_read2"] = c.ask(2, "retrieve", "l2", 4)
        out["down_cluster2_again"] = c.ask(2, "retrieve", "a", 8)
        # ... and restarted (empty: what it listed is gone): the tiers reconnect by
        # themselves, then publish and pull again.
        c.start_master()
        back = time.monotonic()
        out["up_state1"] = c.wait(1, "connected", True)
        out["up_state2"] = c.wait(2, "connected", True)
        out["reconnect_s"] = round(time.monotonic() - back, 1)
        out["b"] = c.publish("b", 8)
        out["up_read2"] = c.ask(2, "retrieve", "b", 8)
        out["up_old2"] = c.ask(2, "retrieve", "a", 8)

        # Node 2's link cut: it serves its own keys (b, pulled and now its own), stores new
        # ones; node 1's values are misses; its tier notices. The link back: it reconnects.
        out["c"] = c.publish("c", 4)
        sh(c.two.pid, "ip link set cl-b down")
        try:
            out["cut_own2"] = c.ask(2, "retrieve", "b", 8)
            out["cut_write2"] = c.ask(2, "write", "l3", 4)
            out["cut_read2"] = c.ask(2, "retrieve", "l3", 4)
            out["cut_cluster2"] = c.ask(2, "retrieve", "c", 4)
            out["cut_state2"] = c.wait(2, "connected", False)
        finally:
            sh(c.two.pid, "ip link set cl-b up")
        out["relinked_state2"] = c.wait(2, "connected", True)
        out["d"] = c.publish("d", 4)
        out["relinked_read2"] = c.ask(2, "retrieve", "d", 4)
        out["relinked_c2"] = c.ask(2, "retrieve", "c", 4)

        # Node 2's sidecar stopped (SIGSTOP): its pulls miss the budget, so they are misses,
        # and the next reads miss at once; continued (SIGCONT): the pulls land, reads hit.
        out["e"] = c.publish("e", 4)
        sidecar = out["relinked_state2"]["sidecar_pid"]
        os.kill(sidecar, signal.SIGSTOP)
        try:
            out["stopped_read2"] = c.ask(2, "retrieve", "e", 4)
            out["stopped_again2"] = c.ask(2, "retrieve", "e", 4)
            out["stopped_own2"] = c.ask(2, "retrieve", "b", 8)
        finally:
            os.kill(sidecar, signal.SIGCONT)
        out["continued_read2"] = c.ask(2, "retrieve", "e", 4)
        out["node1"] = c.ask(1, "stats")
        out["node2"] = c.ask(2, "stats")
        return out


def spill(workdir: Path) -> dict:
    """`--cluster-publish spill` on node 1 (`test_keys_evicted_from_a_pool_are_spilled...`)."""
    wait = ("--cluster-lookup-ms", "10000")  # (as in `proofs`: a bound, not a threshold)
    spills = ("--cluster-publish", "spill", "--eviction-high-watermark", "0.2")
    spills += ("--eviction-low-watermark", "0.1")  # of its 64M pool: evicts at 12.8 MB
    with cluster(workdir, wait, (*wait, *spills)) as c:
        out: dict[str, Any] = {"connected": [c.wait(1, "connected", True)]}
        out["connected"].append(c.wait(2, "connected", True))
        out["write"] = c.publish("s", SPILL_N)
        out["spilled"] = c.settled(1)
        out["node2"] = c.ask(2, "retrieve", "s", SPILL_N)
        out["node1_back"] = c.ask(1, "retrieve", "s", 16)  # the oldest: evicted first
        out["node1_stats"] = c.settled(1)
        return out


def spill_share(workdir: Path) -> dict:
    """`--cluster-publish spill` on node 1, whose pool never reaches its watermark: an
    instance's own share overflows (`test_keys_an_instance_evicts_for_its_own_room_...`)."""
    wait = ("--cluster-lookup-ms", "10000")  # (as in `proofs`: a bound, not a threshold)
    with cluster(workdir, wait, (*wait, "--cluster-publish", "spill")) as c:
        out: dict[str, Any] = {"connected": [c.wait(1, "connected", True)]}
        out["connected"].append(c.wait(2, "connected", True))
        out["write"] = c.ask(1, "writeshare", "s", SPILL_N)
        out["node1"] = c.settled(1)
        out["node2"] = c.ask(2, "retrieve", "s", SPILL_N)
        return out


def crowded(workdir: Path) -> dict:
    """Node 2's pool filled with values pulled from node 1, then a new writer on node 2
    (`test_pulled_values_do_not_keep_a_nodes_writers_from_storing`)."""
    wait = ("--cluster-lookup-ms", "10000")  # (as in `proofs`: a bound, not a threshold)
    with cluster(workdir, wait, wait, pool_size="32M") as c:
        out: dict[str, Any] = {"connected": [c.wait(1, "connected", True)]}
        out["connected"].append(c.wait(2, "connected", True))
        parts = range(CROWD_N // CROWD_READ)  # (a read leases at most half the pool)
        writes = [c.publish(f"far{j}", CROWD_READ) for j in parts]
        out["write"] = {k: sum(w[k] for w in writes) for k in ("stored", "published")}
        reads = [c.ask(2, "retrieve", f"far{j}", CROWD_READ) for j in parts]
        out["pulled"] = {k: sum(r[k] for r in reads) for k in ("right", "missing", "wrong")}
        out["node2_full"] = c.settled(2)
        out["own"] = c.ask(2, "write", "own", OWN_N)
        out["own_read"] = c.ask(2, "retrieve", "own", OWN_N)
        return out


def clear(url: str) -> dict:
    """Delete every key of this node's pool (`maru clear`)."""
    with MaruAdmin(url, timeout_ms=5000) as admin:
        deleted, kept = admin.clear()
    return {"deleted": deleted, "kept": kept}


def files_mapped(pid: int, under: str) -> list[str]:
    """The files under `under` process `pid` maps (its /proc maps), each once; a deleted
    one ends in " (deleted)"."""
    with open(f"/proc/{pid}/maps") as maps:
        names = [line.split(None, 5)[-1].strip() for line in maps]
    return sorted({name for name in names if name.startswith(under)})


def fsdax(workdir: Path) -> dict:
    """Node 1's pool an fsdax directory, a region file each (`test_an_fsdax_pool_s...`)."""
    wait = ("--cluster-lookup-ms", "10000")  # (as in `proofs`: a bound, not a threshold)
    with cluster(workdir, wait, wait, node1_pool=FSDAX) as c:
        out: dict[str, Any] = {"connected": [c.wait(1, "connected", True)]}
        out["connected"].append(c.wait(2, "connected", True))
        out["first"] = c.publish("f", N)
        out["first_read2"] = c.ask(2, "retrieve", "f", N)
        sidecar = c.settled(1)["sidecar_pid"]
        out["mapped_before"] = files_mapped(sidecar, FSDAX)
        out["clear"] = c.ask(1, "clear")
        time.sleep(3 * SIDECAR_CHECK_S)  # (the sidecar looks every SIDECAR_CHECK_S)
        out["mapped_later"] = files_mapped(sidecar, FSDAX)
        out["second"] = c.publish("g", N)
        out["second_read2"] = c.ask(2, "retrieve", "g", N)
        out["node1"] = c.settled(1)
        return out


def lmcache(workdir: Path) -> dict:
    """LMCache's shipped MaruBackend on each node (`test_lmcache_backend_on_node_2...`):
    node 1's engine stores a prompt's chunks; node 2's, through LMCache's async lookup
    (which pins: `batch_pin`) and its retrieve, reads them into its own paged cache."""
    from tests.integration.test_lmcache_backend import PROMPT, SLOTS

    same_keys = "PYTHONHASHSEED=0"  # (LMCache hashes chunks with hash() without vLLM)
    with cluster(workdir, ("--cluster-lookup-ms", "10000")) as c:
        out: dict[str, Any] = {"connected": [c.wait(1, "connected", True)]}
        out["connected"].append(c.wait(2, "connected", True))
        out["store"] = in_node(c.one.pid, "lmstore", c.url1, str(PROMPT), str(SLOTS), env=same_keys)
        out["published"] = c.settled(1)
        out["retrieve"] = in_node(
            c.two.pid, "lmretrieve", c.url2, str(PROMPT), str(SLOTS), env=same_keys
        )
        out["node2"] = c.settled(2)
        return {**out, "prompt": PROMPT}


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "write":
        print(json.dumps(write(args[0], args[1], int(args[2]), len(args) > 3)))
    elif mode == "writeshare":
        print(json.dumps(write_share(args[0], args[1], int(args[2]))))
    elif mode == "stats":
        print(json.dumps(stats(args[0])))
    elif mode == "clear":
        print(json.dumps(clear(args[0])))
    elif mode == "retrieve":
        print(json.dumps(retrieve(args[0], args[1], int(args[2]))))
    elif mode == "copyread":
        print(json.dumps(copy_read(args[0], args[1], int(args[2]))))
    elif mode == "pinread":
        print(json.dumps(pin_read(args[0], args[1], int(args[2]))))
    elif mode in ("lmstore", "lmretrieve"):
        from lmcache_cpu import workers

        url, tokens, slots = args[0], int(args[1]), int(args[2])
        if mode == "lmstore":
            print(json.dumps(workers.store_prompt(url, tokens, 7, slots)))
        else:
            print(json.dumps(workers.retrieve_prompt(url, tokens, 7, slots, True)))
    elif mode == "forge":
        print(json.dumps(forge(args[0], args[1])))
    elif mode == "read":
        print(json.dumps(read(args[0], args[1], int(args[2]))))
    else:
        scenarios = {"proofs": proofs, "faults": faults, "spill": spill, "lmcache": lmcache}
        scenarios.update(spill_share=spill_share, fsdax=fsdax, crowded=crowded)
        scenario = scenarios[args[0] if args else "proofs"]
        print(json.dumps(scenario(Path(mode))))
