"""Run by `test_sglang_pod.py`: two real SGLang CPU servers on two hosts of a simulated CXL pod.

`sglang_pod_child.py NEUTRAL WORKDIR MODEL LOG_DIR [B_POOL]` runs (through
`tmpfs.run_on_tmpfs`) in a mount namespace of its own with a fresh tmpfs at NEUTRAL, the
pool's memory. It makes the pod with `pod_child.pod_hosts` (hosts A and B: each its own
network and mount namespace with a private /dev/shm, a veth pair, `maru-server --curve` on A,
host B seeing the pool file at another path), then runs this script's `drive` mode inside
host A (`nsenter` into A's namespaces: the veth addresses exist only there and in B) and
prints its one JSON line. B_POOL, where B's server maps the pool, defaults to B's path of it
(another value shows what a wrong `maru_pool_path` does: the connect is refused).

`drive` starts SGLang server 1 on host A and server 2 on host B (each through `nsenter` into
its host, so it has that host's network, loopback and /dev/shm; server 2's HTTP port is bound
on B's veth address), runs `p2p.share_prompt` for each prompt, reads maru-server's STATS while
both run, stops both, and reports what it saw.

What SGLang needs inside a host, and where it comes from: loopback up (its processes talk
over 127.0.0.1 and ZMQ; `pod_hosts` sets `lo` up in both hosts); a /dev/shm for its message
queues (24 MiB segments) and `sglang_loads_*` files: the host's private tmpfs, sized by the
kernel's default (half the RAM), which also takes the leftovers away with the namespace; a
writable TMPDIR (its ZMQ IPC sockets) and the model, log and `TORCH_EXTENSIONS_DIR`
directories: paths on the disk every mount namespace here shares, and the environment
(HOME, PYTHONPATH with the CPU shims) passes through `nsenter` unchanged. Server 2's HTTP
port is picked free on A (`free_port` binds where it runs): nothing else listens in B.

Everything is bounded: the driver and both servers run under `timeout LIFE_S`, and so do
the pod's hosts and maru-server (`pod_child.LIFE_S`, raised here: two SGLang starts take
minutes on 2 loaded cores, more than the pod tests' default).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TESTS.parent), str(TESTS)]

from tests.integration import pod_child  # noqa: E402

from sglang_cpu import p2p  # noqa: E402
from sglang_cpu.server import free_port, start_server  # noqa: E402
from sglang_cpu.tiny_model import make_prompt  # noqa: E402

LIFE_S = 540  # the longest anything started here may live (the test's timeout is 600 s)
PROMPTS = [(200, 21), (600, 23)]  # (tokens, seed): whole pages; over one 128-page batch
POOL_SIZE = "256M"  # maru-server's pool; each SGLang instance takes regions of MARU_POOL
MARU_POOL = "64M"


def python_on(host_pid: int, workdir: Path, name: str) -> str:
    """An interpreter path for `start_server(python=...)` that runs in host `host_pid`'s
    network and mount namespaces, under `timeout LIFE_S` (the server's session leader, so
    `stop_server` still ends the whole group)."""
    wrapper = workdir / f"python-on-{name}"
    wrapper.write_text(
        f'#!/bin/sh\nexec nsenter -t {host_pid} -n -m timeout {LIFE_S} "{sys.executable}" "$@"\n'
    )
    wrapper.chmod(0o755)
    return str(wrapper)


def parent(pid: int) -> int:
    """The parent of process `pid` (0 once it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    return int(stat.rsplit(")", 1)[1].split()[1])  # (the name may hold spaces)


def instances_by_server(stats: dict, servers: list) -> list[list[str]]:
    """The `host` of each maru-server instance, grouped by the SGLang server whose launcher
    the instance's process (its scheduler) descends from."""
    groups: list[list[str]] = [[] for _ in servers]
    for inst in stats["instances"].values():
        pid = inst["pid"]
        while pid > 1:
            for i, server in enumerate(servers):
                if pid == server.pid:
                    groups[i].append(inst["host"])
            pid = parent(pid)
    return groups


def drive(url: str, key: str, a_pid: int, b_pid: int, b_pool: str, model: str, logs: str) -> dict:
    """Server 1 on host A, server 2 on host B, one pool; each prompt on 1, then on 2."""
    log_dir, work = Path(logs), Path(logs) / "bin"
    work.mkdir(parents=True, exist_ok=True)
    extra = p2p.maru_extra_config(
        url, pool_size=MARU_POOL, prefetch_threshold=p2p.PAGE_SIZE, maru_server_public_key=key
    )
    on_b = {**extra, "maru_pool_path": b_pool}  # B maps the pool at its own path
    servers = []
    try:
        servers.append(
            start_server(
                model,
                extra_args=[*p2p.hicache_args("dynamic", extra), *p2p.IDLE_ARGS],
                host=pod_child.SERVER_IP,
                python=python_on(a_pid, work, "a"),
                log_path=log_dir / "sglang-a.log",
                page_size=p2p.PAGE_SIZE,
            )
        )
        servers.append(
            start_server(
                model,
                extra_args=[*p2p.hicache_args("dynamic", on_b), *p2p.IDLE_ARGS],
                host=pod_child.CLIENT_IP,  # B's veth address: reachable from A
                port=free_port(pod_child.SERVER_IP),  # (nothing else listens in B)
                python=python_on(b_pid, work, "b"),
                log_path=log_dir / "sglang-b.log",
                page_size=p2p.PAGE_SIZE,
            )
        )
        outcomes = [
            p2p.share_prompt(
                *servers, url, make_prompt(tokens, seed=seed), server_public_key=key, say=print
            )
            for tokens, seed in PROMPTS
        ]
        stats = p2p.l3_stats(url, server_public_key=key)
        hosts = instances_by_server(stats, servers)  # (while their processes run)
    finally:
        p2p.stop_servers(servers)
    return {
        "startup_seconds": [s.startup_seconds for s in servers],
        "b_extra_config": on_b,
        "outcomes": [
            {
                "tokens": o.tokens,
                "first_cached": o.first["meta_info"]["cached_tokens"],
                "first_output": o.first["output_ids"],
                "second_output": o.second["output_ids"],
                "second_details": o.second["meta_info"].get("cached_tokens_details"),
                "storage": o.storage,
                "expected": o.expected_storage,
                "keys_written": o.l3_keys_after - o.l3_keys_before,
                "hits_lines": o.hits_lines,
                "hits_logged": o.hits_logged,
            }
            for o in outcomes
        ],
        "hosts": hosts,
        "instances": [[i["host"], i["pid"]] for i in stats["instances"].values()],
        "host_requests": stats.get("host_requests"),
    }


def pod(neutral: Path, workdir: Path, model: str, logs: str, b_pool: str | None) -> dict:
    """The pod, and `drive` run inside host A."""
    pod_child.LIFE_S = LIFE_S  # (read by `pod_hosts` for the hosts and maru-server)
    with pod_child.pod_hosts(neutral, workdir, pool_size=POOL_SIZE) as p:
        key = Path(p.key).read_text().strip()  # the key itself, as an operator copies it
        argv = [p.server.url, key, str(p.a.pid), str(p.b.pid), b_pool or p.b_pool, model, logs]
        cmd = [
            *("nsenter", "-t", str(p.a.pid), "-n", "-m", "timeout", str(LIFE_S)),
            *(sys.executable, __file__, "drive", *argv),
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=LIFE_S + 10)
        if done.returncode != 0:
            return {"error": done.stderr[-6000:], "stdout": done.stdout[-3000:]}
        return {"url": p.server.url, **json.loads(done.stdout.strip().splitlines()[-1])}


if __name__ == "__main__":
    if sys.argv[1] == "drive":
        url, key, a, b, b_pool, model, logs = sys.argv[2:9]
        print(json.dumps(drive(url, key, int(a), int(b), b_pool, model, logs)))
    else:
        neutral, workdir, model, logs, *b_pool = sys.argv[1:]
        print(json.dumps(pod(Path(neutral), Path(workdir), model, logs, next(iter(b_pool), None))))
