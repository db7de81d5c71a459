"""Pod benchmark (issue 43): a host of a CXL pod reading the pool through the in-pool index
(`maru-server --index-slots`), beside the server's own host, in hardware and software
coherence.

    sudo .venv/bin/python benchmarks/bench_pod.py --quick   # ~1 minute
    sudo .venv/bin/python benchmarks/bench_pod.py           # a few minutes

Needs root (it says why and stops otherwise): the two hosts are made as the pod tests make them
(`tests/integration/pod_child.py`'s `pod_hosts`: each host a network and a mount namespace of
its own with a private /dev/shm, the pool in a neutral tmpfs, a veth pair, `maru-server
--curve` on host A). Per coherence mode: a writer on host A stores 64 values of 60 000 bytes;
a reader on host A (the local host) and one on host B (the remote host, over TCP with CURVE,
mapping the pool at its own path) read all 64 with `MaruHandler.read` in calls of 64, in an
order alternated per round; each call is timed inside its process around the read alone
(`pod_child.timed_copy`), every byte checked after (a wrong byte fails the run). Figures are
medians of per-call times; the ratio is the median of per-round ratios (paired). The goal: a
remote host's reads at >= 95% of the local host's (time ratio <= 1/0.95). This machine's
caches are coherent: software mode's flushes only cost here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # (tests.integration.pod_child, conftest)

from tests.integration import pod_child as pc  # noqa: E402
from tests.integration.test_pool_path import hosts_missing  # noqa: E402
from tests.integration.tmpfs import run_on_tmpfs  # noqa: E402

MODES = ("hardware", "software")
PER_CALL = 64  # values per call (pod_child.VALUE bytes each)
GOAL = 0.95  # the remote host's read throughput at least this share of the local host's


def measure(neutral: Path, workdir: Path, mode: str, rounds: int) -> dict[str, Any]:
    """One pod in `mode`: per round, the local and the remote reader's timed call (order
    alternated), and every call's byte counts."""
    args = ["--coherence", mode, "--index-slots", "auto"]
    for place in (neutral / mode, workdir / mode):
        place.mkdir()
    with pc.pod_hosts(neutral / mode, workdir / mode, args) as pod:
        url, key = pod.server.url, pod.key
        agents = [pc.Agent(pod.a.pid, url, key, pool_size="16M")]
        try:
            assert agents[0].ok("store", "v", 0, PER_CALL) == PER_CALL, "the writer stored"
            agents.append(pc.Agent(pod.a.pid, url, key))
            agents.append(pc.Agent(pod.b.pid, url, key, pod.b_pool))
            readers = {"local": agents[1], "remote": agents[2]}
            local = {name: r.ok("local") for name, r in readers.items()}
            for r in readers.values():  # (each process's first call is not timed)
                r.ok("timed", "v", 0, PER_CALL)
            calls: dict[str, list[list[float]]] = {"local": [], "remote": []}
            for i in range(rounds):
                order = ("local", "remote") if i % 2 == 0 else ("remote", "local")
                for name in order:
                    calls[name].append(readers[name].ok("timed", "v", 0, PER_CALL))
        finally:
            for agent in agents:
                agent.close()
    return {"calls": calls, "index": local}


def summarize(calls: dict[str, list[list[float]]]) -> dict[str, Any]:
    """Medians of the per-call times, the paired per-round ratio, and the bytes judged."""
    nbytes = PER_CALL * pc.VALUE
    out: dict[str, Any] = {}
    for name, rows in calls.items():
        seconds = statistics.median(r[0] for r in rows)
        out[f"{name}_ms"] = seconds * 1e3
        out[f"{name}_gbps"] = nbytes / seconds / 1e9
        out[f"{name}_bytes"] = [sum(int(r[i]) for r in rows) for i in (1, 2, 3)]
    ratios = [rem[0] / loc[0] for loc, rem in zip(calls["local"], calls["remote"])]
    out["remote_vs_local"] = statistics.median(ratios)  # time ratio: <= 1/GOAL passes
    return out


def render(summary: dict[str, dict[str, Any]]) -> list[str]:
    """The table: per mode local and remote (GB/s, ms a call), their ratio and the goal."""
    lines = [
        "| coherence | local host: GB/s, ms | remote host: GB/s, ms | remote time / local "
        f"| goal (remote >= {GOAL:.0%} of local) |",
        "|---|---|---|---|---|",
    ]
    for mode, s in summary.items():
        ok = s["remote_vs_local"] <= 1 / GOAL
        lines.append(
            f"| {mode} | {s['local_gbps']:.2f}, {s['local_ms']:.2f} | {s['remote_gbps']:.2f}, "
            f"{s['remote_ms']:.2f} | {s['remote_vs_local']:.2f}x | {'PASS' if ok else 'MISS'} |"
        )
    if set(MODES) <= set(summary):
        hw, sw = summary["hardware"], summary["software"]
        lines.append("")
        lines.append(
            f"software coherence costs the local read {sw['local_ms'] / hw['local_ms']:.2f}x "
            f"and the remote read {sw['remote_ms'] / hw['remote_ms']:.2f}x the time of hardware"
        )
    return lines


def child(neutral: str, workdir: str, rounds: str) -> None:
    """In the neutral tmpfs (`run_on_tmpfs`): both modes measured; one JSON line out."""
    runs = {m: measure(Path(neutral), Path(workdir), m, int(rounds)) for m in MODES}
    print(json.dumps(runs))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="5 rounds instead of 30")
    p.add_argument("--json", metavar="FILE", help="also write the summary there")
    args = p.parse_args(argv)
    missing = hosts_missing()
    if missing:
        print(f"bench_pod: cannot simulate the pod's hosts here: {missing}", file=sys.stderr)
        return 2
    rounds = 5 if args.quick else 30
    with tempfile.TemporaryDirectory(prefix="bench-pod-") as tmp:
        work = Path(tmp) / "work"
        work.mkdir()
        done = run_on_tmpfs(
            Path(tmp), "size=512M", Path(__file__), "child", str(work), str(rounds), timeout=600
        )
    if done.returncode != 0:
        print(done.stderr[-3000:], file=sys.stderr)
        return 1
    runs = json.loads(done.stdout.strip().splitlines()[-1])
    summary = {
        mode: summarize(run["calls"]) | {"index": run["index"]} for mode, run in runs.items()
    }
    wrong = {m: (s["local_bytes"][2], s["remote_bytes"][2]) for m, s in summary.items()}
    print("\n".join(render(summary)))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    if any(w for pair in wrong.values() for w in pair):
        print(f"bench_pod: wrong bytes read: {wrong}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[2] == "child":  # (run_on_tmpfs: MOUNT child WORK ROUNDS)
        child(sys.argv[1], sys.argv[3], sys.argv[4])
    else:
        sys.exit(main())
