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
POOL_PATH ("-": unset), store N values under WRITE/i, read READ/i back by their bytes.

The parts are reused by `pod_hosts_child.py` (a host failing): `pod_hosts` makes the pod,
`Agent` keeps a client running on a host and tells it what to do step by step (`agent`
mode), `kill_host` SIGKILLs every process of a host."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TESTS.parent), str(TESTS)]  # (tests.integration, and conftest as pytest has it)

from tests.integration.test_crash_safety import make_value  # noqa: E402
from tests.integration.test_pool_trust import read_counts  # noqa: E402

import conftest  # noqa: E402
from maru import MaruHandler  # noqa: E402
from maru.common.errors import MaruError  # noqa: E402

SERVER_IP, CLIENT_IP = "10.43.0.1", "10.43.0.2"
LIFE_S = 150  # the longest anything started here may outlive this process
VALUE = 60_000  # the size of every value the clients store (one 64 KiB chunk)


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
        stored = sum(h.batch_store(keys, [make_value(k, VALUE) for k in keys])) if keys else 0
        wanted = [f"{read}/{i}" for i in range(n)] if read != "-" else []
        right, missing, wrong = read_counts(h, wanted) if wanted else (0, 0, 0)
        return {"stored": stored, "right": right, "missing": missing, "wrong": wrong}
    finally:
        h.close()


def agent(
    url: str, key: str, pool_path: str, pool_size: str, timeout_ms: str, regions: str
) -> None:
    """`agent` mode: one client kept connected between steps, told what to do by a JSON line
    on stdin (`[op, *args]`, one of AGENT_OPS) and answering each with one line (`{"ok": ...}`,
    or `{"error": ...}` for a `MaruError`: a failure the caller judges)."""
    h = MaruHandler(
        server_url=url,
        server_public_key=key,
        pool_path=None if pool_path == "-" else pool_path,
        pool_size=pool_size,
        chunk_size_bytes="64K",
        timeout_ms=int(timeout_ms),
        auto_expand=regions == "grow",
    )
    try:
        serve(h, AGENT_OPS)
    finally:
        h.close()


def serve(h: MaruHandler, ops: dict) -> None:
    """Answer the JSON lines on stdin (`[op, *args]`, one of `ops`) with one line each
    (`{"ok": ...}`, or `{"error": ...}` for a `MaruError`: a failure the caller judges)."""
    reserved: list = []  # the run `alloc` reserved, written and sealed by `fill`
    for line in sys.stdin:
        op, *args = json.loads(line)
        try:
            reply = {"ok": ops[op](h, reserved, *args)}
        except MaruError as exc:
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(reply), flush=True)


def keys_of(prefix: str, start: int, n: int) -> list[str]:
    return [f"{prefix}/{i}" for i in range(start, start + n)]


def fill(h: MaruHandler, reserved: list, prefix: str) -> int:
    """Write a value into each chunk of the reserved run (in place, as a zero-copy writer
    does: whether or not the server still counts the region ours), then seal them."""
    parts = reserved.pop().split()
    keys = keys_of(prefix, 0, len(parts))
    for key, part in zip(keys, parts):
        part.buf[:VALUE] = make_value(key, VALUE)
    return sum(h.seal(keys, parts, VALUE).wait())


def copy_counts(h: MaruHandler, keys: list[str], tag: str = "") -> list[int]:
    """[right, missing, wrong] of `keys` read with `MaruHandler.read`, the copying read an
    index answers without a request, each judged by its bytes against `make_value(key + tag)`
    (`tag`: which life of the key's value is the right one)."""
    out = np.zeros((len(keys), VALUE), np.uint8)
    buffers = (out.ctypes.data + np.arange(len(keys), dtype=np.int64) * VALUE)[:, None]
    proven = h.read(keys, buffers, np.array([VALUE], np.int64), length=VALUE)
    counts = [0, 0, 0]
    for i, (key, ok) in enumerate(zip(keys, proven)):
        counts[0 if ok and bytes(out[i]) == make_value(key + tag, VALUE) else 2 if ok else 1] += 1
    return counts


def timed_copy(h: MaruHandler, prefix: str, start: int, n: int) -> list[float]:
    """One `copy_counts` of `n` keys, timed around `MaruHandler.read` alone: [seconds, right,
    missing, wrong] (`benchmarks/bench_pod.py`)."""
    keys = keys_of(prefix, start, n)
    out = np.zeros((n, VALUE), np.uint8)
    buffers = (out.ctypes.data + np.arange(n, dtype=np.int64) * VALUE)[:, None]
    began = time.perf_counter()
    proven = h.read(keys, buffers, np.array([VALUE], np.int64), length=VALUE)
    seconds = time.perf_counter() - began
    right = sum(
        ok and bytes(out[i]) == make_value(k, VALUE) for i, (k, ok) in enumerate(zip(keys, proven))
    )
    wrong = sum(ok for ok in proven) - right
    return [seconds, right, n - right - wrong, wrong]


def store_as(h: MaruHandler, prefix: str, start: int, n: int, tag: str) -> int:
    """Store `make_value(key + tag)` under each key (`tag`: which life of its value)."""
    keys = keys_of(prefix, start, n)
    return sum(h.batch_store(keys, [make_value(k + tag, VALUE) for k in keys]))


AGENT_OPS = {
    "whoami": lambda h, _: h.instance_id,
    "store": lambda h, _, prefix, start, n: sum(
        h.batch_store(keys := keys_of(prefix, start, n), [make_value(k, VALUE) for k in keys])
    ),
    "read": lambda h, _, prefix, start, n: read_counts(h, keys_of(prefix, start, n)),
    "regions": lambda h, _: [
        [r.owner, r.path, r.offset, r.length] for r in h.list_allocations(all_instances=True)
    ],
    "stats": lambda h, _: h.stats(),
    "store_as": lambda h, _, prefix, start, n, tag: store_as(h, prefix, start, n, tag),
    "copy": lambda h, _, prefix, start, n, tag: copy_counts(h, keys_of(prefix, start, n), tag),
    "local": lambda h, _: h.reads_locally,
    "timed": lambda h, _, prefix, start, n: timed_copy(h, prefix, start, n),
    "alloc": lambda h, reserved, n: reserved.append(h.alloc(VALUE, n)) or reserved[-1] is not None,
    "fill": fill,
}


class Agent:
    """A client process (`agent` mode) on host `host_pid`, run through `nsenter`; `ask` sends
    it one step and returns its answer."""

    def __init__(
        self,
        host_pid: int,
        url: str,
        key: str,
        pool_path: str = "-",
        pool_size: str = "8M",
        timeout_ms: int = 5000,
        regions: str = "grow",
    ):
        """`regions`: "grow" (regions in steps up to `pool_size`) or "one" (one region of
        `pool_size`, at the first store)."""
        cmd = [
            *("nsenter", "-t", str(host_pid), "-n", "-m", "timeout", str(LIFE_S)),
            *(sys.executable, __file__, "agent", url, key, pool_path, pool_size),
            *(str(timeout_ms), regions),
        ]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.instance = self.ok("whoami")

    def ask(self, op: str, *args: object, bound: float = 60.0) -> dict:
        """The agent's answer to one step. `bound` (seconds) is a bound for the run to stop
        (a step that hangs past it raises TimeoutError), not a threshold."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps([op, *args]) + "\n")
        self.proc.stdin.flush()
        if not select.select([self.proc.stdout], [], [], bound)[0]:
            raise TimeoutError(f"the agent did not answer {op} within {bound} s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the agent exited (status {self.proc.poll()}) on {op}")
        return json.loads(line)

    def ok(self, op: str, *args: object) -> object:
        """`ask`, where an error is a failure of the run."""
        reply = self.ask(op, *args)
        if "ok" not in reply:
            raise RuntimeError(f"{op}{args}: {reply['error']}")
        return reply["ok"]

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.stdin.close()  # (its loop ends, and it closes its handler)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def kill_host(pid: int) -> tuple[int, int]:
    """SIGKILL every process of host `pid` (every process in its network namespace, its
    `sleep` too). Returns an fd of the namespace, which keeps it and the veth pair (host A's
    address is on its end; close the fd to let them go), and how many processes it killed."""
    ns = f"/proc/{pid}/ns/net"
    held, theirs, killed = os.open(ns, os.O_RDONLY), os.readlink(ns), 0
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):  # (a process that ended meanwhile)
            if entry.name.isdigit() and os.readlink(entry / "ns" / "net") == theirs:
                os.kill(int(entry.name), signal.SIGKILL)
                killed += 1
    return held, killed


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


@dataclass
class Pod:
    """The two hosts (their namespaces' holders), the server on A, its CURVE public key file,
    and where host B sees the pool file."""

    a: subprocess.Popen
    b: subprocess.Popen
    server: conftest.MaruServerProcess
    key: str
    b_pool: str


@contextlib.contextmanager
def pod_hosts(
    neutral: Path, workdir: Path, server_args: Sequence[str] = (), pool_size: str = "64M"
) -> Iterator[Pod]:
    """Hosts A and B joined by the veth pair, `maru-server --curve *server_args` serving a
    pool of `pool_size` on A; all of it ended on the way out."""
    (neutral / "pool").mkdir()
    seen_by_a = workdir / "a-pool"  # host A: the directory, bind-mounted
    seen_by_b = workdir / "b-cxl0"  # host B: the pool file, bind-mounted (another path)
    seen_by_a.mkdir()
    seen_by_b.touch()
    hosts: list[subprocess.Popen] = []
    server = None
    original = conftest.maru_server_command  # (patched below, for this pod only)
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
            pool_size=pool_size,
            pool=str(seen_by_a / "maru.pool"),
            host=SERVER_IP,
            extra_args=["--curve", *server_args],
        ).start()
        sh(b.pid, f"mount --bind {neutral / 'pool' / 'maru.pool'} {seen_by_b}")
        yield Pod(a, b, server, str(server.state_dir / "curve.pub"), str(seen_by_b))
    finally:
        conftest.maru_server_command = original
        if server is not None:
            server.halt()
        for h in hosts:
            h.kill()
            h.wait(10)


def pod(neutral: Path, workdir: Path) -> dict:
    with pod_hosts(neutral, workdir) as p:
        url, key, a, b = p.server.url, p.key, p.a.pid, p.b.pid
        return {
            "url": url,
            "a_writes": run_client(a, url, key, "-", "a", "-", "16"),
            "b_writes_reads_a": run_client(b, url, key, p.b_pool, "b", "a", "16"),
            "a_reads_b": run_client(a, url, key, "-", "-", "b", "16"),
            "b_unset": run_client(b, url, key, "-", "-", "a", "1"),
        }


if __name__ == "__main__":
    if sys.argv[1] == "agent":
        agent(*sys.argv[2:8])
    elif sys.argv[1] == "client":
        url, key, pool_path, write, read, n = sys.argv[2:8]
        print(json.dumps(client(url, key, pool_path, write, read, int(n))))
    else:
        print(json.dumps(pod(Path(sys.argv[1]), Path(sys.argv[2]))))
