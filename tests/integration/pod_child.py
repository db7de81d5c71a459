"""Run by `test_pool_path.py`: two hosts of a CXL pod, simulated on this machine.

`pod_child.py NEUTRAL WORKDIR` runs (through `tmpfs.run_on_tmpfs`) in a mount namespace of its
own with a fresh tmpfs at NEUTRAL: the pool's memory, which neither host sees at /dev/shm. It
makes two hosts, each a network namespace and a mount namespace of its own with a private
/dev/shm (held open by a `sleep`), joined by a veth pair (10.43.0.1 and 10.43.0.2, only
inside them); host A sees NEUTRAL/pool as a directory (a bind mount) where `maru-server
--curve` keeps its pool file, host B sees the one pool file bind-mounted at another path.
Clients on both hosts (`client` mode, each run through `nsenter` into its host) write and
read each other's values. Prints one JSON line: what each client run reported.

Everything it starts ends with it: the server and the hosts' `sleep`s are killed on the way
out, and bounded by `timeout` / `sleep` if this process is killed; the namespaces, mounts and
the veth pair go with their last process.

`pod_child.py client URL KEY POOL_PATH WRITE READ N`: one client process: with `pool_path`
POOL_PATH ("-": unset), store N values under WRITE/i, read READ/i back by their bytes."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TESTS.parent), str(TESTS)]  # (tests.integration, and conftest as pytest has it)

from tests.integration.test_crash_safety import make_value  # noqa: E402
from tests.integration.test_pool_trust import read_counts  # noqa: E402

import conftest  # noqa: E402
from maru import MaruHandler  # noqa: E402

SERVER_IP, CLIENT_IP = "10.43.0.1", "10.43.0.2"
LIFE_S = 150  # the longest anything started here may outlive this process


def client(url: str, key: str, pool_path: str, write: str, read: str, n: int) -> dict:
    h = MaruHandler(
        server_url=url,
        server_public_key=key,
        pool_path=None if pool_path == "-" else pool_path,
        pool_size="8M",
        chunk_size_bytes="64K",
        timeout_ms=5000,
    )
    try:
        if not h.connected:
            return {"refused": str(h.connect_error)}
        keys = [f"{write}/{i}" for i in range(n)] if write != "-" else []
        stored = sum(h.batch_store(keys, [make_value(k, 60_000) for k in keys])) if keys else 0
        wanted = [f"{read}/{i}" for i in range(n)] if read != "-" else []
        right, missing, wrong = read_counts(h, wanted) if wanted else (0, 0, 0)
        return {"stored": stored, "right": right, "missing": missing, "wrong": wrong}
    finally:
        h.close()


def sh(pid: int, script: str) -> None:
    """Run `script` in the network and mount namespaces of `pid` (a host)."""
    cmd = ["nsenter", "-t", str(pid), "-n", "-m", "sh", "-ec", script]
    done = subprocess.run(cmd, timeout=30, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"in host {pid}: {script!r} failed: {done.stderr.strip()}")


def host() -> subprocess.Popen:
    """A host: new network and mount namespaces (private propagation), held by a `sleep`.
    Returned once the process is in them: `nsenter` into it before would enter ours."""
    cmd = ["unshare", "--net", "--mount", "--propagation", "private", "sleep", str(LIFE_S)]
    proc = subprocess.Popen(cmd)
    ours = [os.readlink(f"/proc/self/ns/{ns}") for ns in ("net", "mnt")]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            if all(
                os.readlink(f"/proc/{proc.pid}/ns/{ns}") != mine
                for ns, mine in zip(("net", "mnt"), ours)
            ):
                return proc
        time.sleep(0.01)
    proc.kill()
    raise RuntimeError("unshare did not make the host's namespaces within 30 s")


def run_client(pid: int, *args: str) -> dict:
    cmd = ["nsenter", "-t", str(pid), "-n", "-m", sys.executable, __file__, "client", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        return {"error": done.stderr[-3000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def pod(neutral: Path, workdir: Path) -> dict:
    (neutral / "pool").mkdir()
    seen_by_a = workdir / "a-pool"  # host A: the directory, bind-mounted
    seen_by_b = workdir / "b-cxl0"  # host B: the pool file, bind-mounted (another path)
    seen_by_a.mkdir()
    seen_by_b.touch()
    hosts: list[subprocess.Popen] = []
    server = None
    try:
        hosts.append(host())
        hosts.append(host())
        a, b = hosts
        sh(
            a.pid,
            f"mount --bind {neutral / 'pool'} {seen_by_a}\n"
            "mount -t tmpfs maru-a /dev/shm\n"
            "ip link set lo up\n"
            f"ip link add pod-a type veth peer name pod-b netns {b.pid}\n"
            f"ip addr add {SERVER_IP}/30 dev pod-a\n"
            "ip link set pod-a up",
        )
        sh(
            b.pid,
            "mount -t tmpfs maru-b /dev/shm\n"
            "ip link set lo up\n"
            f"ip addr add {CLIENT_IP}/30 dev pod-b\n"
            "ip link set pod-b up",
        )
        command = conftest.maru_server_command()
        conftest.maru_server_command = lambda: [
            *("nsenter", "-t", str(a.pid), "-n", "-m", "timeout", str(LIFE_S)),
            *command,
        ]
        server = conftest.MaruServerProcess(
            workdir / "srv",
            pool_size="64M",
            pool=str(seen_by_a / "maru.pool"),
            host=SERVER_IP,
            extra_args=["--curve"],
        ).start()
        sh(b.pid, f"mount --bind {neutral / 'pool' / 'maru.pool'} {seen_by_b}")
        key = str(server.state_dir / "curve.pub")
        return {
            "url": server.url,
            "a_writes": run_client(a.pid, server.url, key, "-", "a", "-", "16"),
            "b_writes_reads_a": run_client(b.pid, server.url, key, str(seen_by_b), "b", "a", "16"),
            "a_reads_b": run_client(a.pid, server.url, key, "-", "-", "b", "16"),
            "b_unset": run_client(b.pid, server.url, key, "-", "-", "a", "1"),
        }
    finally:
        if server is not None:
            server.halt()
        for h in hosts:
            h.kill()
            h.wait(10)


if __name__ == "__main__":
    if sys.argv[1] == "client":
        url, key, pool_path, write, read, n = sys.argv[2:8]
        print(json.dumps(client(url, key, pool_path, write, read, int(n))))
    else:
        print(json.dumps(pod(Path(sys.argv[1]), Path(sys.argv[2]))))
