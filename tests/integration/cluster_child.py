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
PREFIX/i through Maru.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TESTS.parent), str(TESTS)]  # (tests.integration, and conftest as pytest has it)

from tests.integration.pod_child import LIFE_S, host, sh  # noqa: E402
from tests.integration.test_crash_safety import make_value  # noqa: E402
from tests.integration.test_pool_trust import read_counts  # noqa: E402
from tests.integration.workers import flip_byte  # noqa: E402

import conftest  # noqa: E402
from maru import MaruHandler  # noqa: E402
from maru.client.checksum import checksums  # noqa: E402
from maru.server.cluster.config import MooncakeConfig  # noqa: E402
from maru.server.cluster.mooncake import library_env, load_mooncake, master_binary  # noqa: E402
from maru.server.cluster.proof import (  # noqa: E402
    decode_proof,
    encode_proof,
    object_name,
    proof_name,
)

NODE1, NODE2 = "10.44.0.1", "10.44.0.2"
MASTER = f"{NODE1}:50051"
SIZE = 60_000
N = 24
WAIT_S = 60  # the longest any step here waits for the tier


def handler(url: str, checksums: bool = True) -> MaruHandler:
    return MaruHandler(
        server_url=url,
        pool_size="8M",
        chunk_size_bytes="64K",
        checksums=checksums,
        timeout_ms=5000,
    )


def write(url: str, prefix: str, n: int, flip: bool) -> dict:
    h = handler(url)
    try:
        keys = [f"{prefix}/{i}" for i in range(n)]
        stored = sum(h.batch_store(keys, [make_value(k, SIZE) for k in keys]))
        for key in keys if flip else ():
            flip_byte(h, key, at=SIZE // 2)
        return {"stored": stored}
    finally:
        h.close()


def stats(url: str) -> dict:
    h = handler(url)
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


def plain_client(config: str) -> Any:
    """A Mooncake client of no Maru's, holding no data itself (segment 0)."""
    c = MooncakeConfig.from_file(config)
    store = load_mooncake().MooncakeDistributedStore()
    rc = store.setup(c.local_hostname, c.metadata_server, 0, 16 << 20, c.protocol, "", MASTER)
    if rc != 0:
        raise RuntimeError(f"Mooncake setup: {rc}")
    return store


def forge(config: str, prefix: str) -> dict:
    """Values in Mooncake whose proof does not hold: PREFIX/0 as if a byte of it flipped in
    Mooncake's memory (its proof states the value's true length and maru64); PREFIX/1 with
    its true bytes under a proof made for another name (PREFIX/0's)."""
    tenant = MooncakeConfig.from_file(config).tenant_id
    store = plain_client(config)
    first = object_name(tenant, f"{prefix}/0")
    true = make_value(f"{prefix}/0", SIZE)
    proof = encode_proof(first, SIZE, int(checksums([memoryview(true)])[0]))
    flipped = bytearray(true)
    flipped[SIZE // 2] ^= 0xFF
    codes = [store.put(first, bytes(flipped)), store.put(proof_name(first), proof)]
    second = object_name(tenant, f"{prefix}/1")
    codes.append(store.put(second, make_value(f"{prefix}/1", SIZE)))
    codes.append(store.put(proof_name(second), proof))
    store.close()
    return {"codes": codes}


def read(config: str, prefix: str, n: int) -> dict:
    """Each value from Mooncake with a plain client: right (bytes as written, proof for this
    name stating their length and maru64), missing (no proof), wrong (anything else)."""
    c = MooncakeConfig.from_file(config)
    store = plain_client(config)
    right = missing = wrong = 0
    for i in range(n):
        key = f"{prefix}/{i}"
        name = object_name(c.tenant_id, key)
        proof = decode_proof(name, bytes(store.get(proof_name(name))))
        if proof is None:
            missing += 1
            continue
        value = bytes(store.get(name))
        length, checksum = proof
        ok = value == make_value(key, SIZE) and length == len(value)
        right += ok and int(checksums([memoryview(value)])[0]) == checksum
        wrong += not (ok and int(checksums([memoryview(value)])[0]) == checksum)
    store.close()
    return {"right": right, "missing": missing, "wrong": wrong}


def in_node(pid: int, *args: str, env: str = "") -> dict:
    """One `cluster_child.py` mode run in node `pid`: its JSON line."""
    cmd = ["nsenter", "-t", str(pid), "-n", "-m", "env", *env.split(), sys.executable]
    done = subprocess.run([*cmd, __file__, *args], capture_output=True, text=True, timeout=90)
    if done.returncode != 0:
        return {"error": done.stderr[-3000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def wait_for(pid: int, url: str, done: str, want: int) -> dict:
    """The tier's stats once `done` (published, proof_failures...) reaches `want`."""
    deadline = time.monotonic() + WAIT_S
    while True:
        now = in_node(pid, "stats", url)
        if "error" in now or now[done] >= want or time.monotonic() > deadline:
            return now
        time.sleep(0.2)


def node_server(pid: int, ip: str, workdir: Path, config: Path, *args: str) -> Any:
    """A `maru-server --cluster mooncake` in node `pid`, its local hostname `ip` given by
    MOONCAKE_LOCAL_HOSTNAME (one config file for every node, as SGLang's)."""
    command = SERVER_COMMAND
    conftest.maru_server_command = lambda: [
        *("nsenter", "-t", str(pid), "-n", "-m", "timeout", str(LIFE_S)),
        *("env", f"MOONCAKE_LOCAL_HOSTNAME={ip}"),
        *command,
    ]
    cluster = ["--cluster", "mooncake", "--cluster-config", str(config), *args]
    return conftest.MaruServerProcess(workdir, pool_size="64M", extra_args=cluster).start()


SERVER_COMMAND = conftest.maru_server_command()


def nodes(workdir: Path) -> dict:
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
                "global_segment_size": 64 << 20,
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
        master = [str(master_binary()), f"--rpc_address={NODE1}", "--rpc_port=50051"]
        master += [f"--metrics_host={NODE1}", "--metrics_port=9003"]
        enter = ["nsenter", "-t", str(one.pid), "-n", "-m", "timeout", str(LIFE_S)]
        with (workdir / "master.log").open("wb") as log:  # (a group of its own: `timeout`
            started.append(  # forks the master, which a kill of `timeout` alone would orphan)
                subprocess.Popen(
                    [*enter, *master],
                    stdout=log,
                    stderr=log,
                    env=library_env(),
                    start_new_session=True,
                )
            )
        servers.append(node_server(one.pid, NODE1, workdir / "node1", config))
        # Node 2's lookups wait up to 10 s for their pulls: a bound far above what a pull
        # takes (ms), not a threshold the test could miss on a loaded machine; only the pulls
        # from the dead segment at the end wait it out.
        budget = ("--cluster-lookup-ms", "10000")
        servers.append(node_server(two.pid, NODE2, workdir / "node2", config, *budget))
        url1, url2 = servers[0].url, servers[1].url
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
        out["node2_forged"] = in_node(two.pid, "retrieve", url2, "forged", "2")
        out["node2_stats"] = in_node(two.pid, "stats", url2)
        out["node2_again"] = in_node(two.pid, "retrieve", url2, "v", str(N))
        out["node2_stats_again"] = in_node(two.pid, "stats", url2)
        # Node 1's sidecar, whose Mooncake segment holds what node 1 published, SIGKILLed:
        # the server starts it again; what lay in the dead segment (v2, published before,
        # never pulled; Mooncake's master still lists it) is never a wrong hit on node 2.
        out["v2"] = in_node(one.pid, "write", url1, "v2", "8")
        out["v2_published"] = wait_for(one.pid, url1, "published", N + 8)
        os.kill(sidecar, signal.SIGKILL)
        out["restarted"] = wait_for(one.pid, url1, "sidecar_starts", 2)
        out["reconnected"] = wait_for(one.pid, url1, "connected", True)
        out["node2_dead_segment"] = in_node(two.pid, "retrieve", url2, "v2", "8")
        return out
    finally:
        for server in servers:
            server.halt()
        for proc in reversed(started):
            if proc.args[0] == "nsenter":  # the master: its whole group
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            proc.kill()
            proc.wait(10)


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "write":
        print(json.dumps(write(args[0], args[1], int(args[2]), len(args) > 3)))
    elif mode == "stats":
        print(json.dumps(stats(args[0])))
    elif mode == "retrieve":
        print(json.dumps(retrieve(args[0], args[1], int(args[2]))))
    elif mode == "forge":
        print(json.dumps(forge(args[0], args[1])))
    elif mode == "read":
        print(json.dumps(read(args[0], args[1], int(args[2]))))
    else:
        print(json.dumps(nodes(Path(mode))))
