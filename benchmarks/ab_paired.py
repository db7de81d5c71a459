"""Paired A/B of one `MaruStorage` data-path method: a git revision's against the working tree's.

    PYTHONPATH=src:tests:tests/sglang_cpu .venv/bin/python benchmarks/ab_paired.py \\
        --rev HEAD~1 --method _write --case mha-64K --rounds 40      # ~1-2 min

Whole runs of `bench_hicache.py`, build against build, drift on a shared VM by more than most
changes of the data path are worth (benchmarks/results/history.md, session 19). Here one writer
process and one `maru-server` run both versions: the method's source at `--rev` is compiled
into `maru_sglang.maru_storage`'s namespace (A) beside the working tree's (B), and each round
runs A, B and the `stream` copy (the limit of bench_hicache.py) in a seeded random order over
the same host pages. The ratio B/A is taken per round, so the machine's drift cancels.
`--idle-ms N`: the writer sleeps N ms before each timed turn (the stream's too), as it does in
`bench_hicache.py` while the reader works: threads and the server asleep, caches cold (on the
2-vCPU VM a 64 KiB set meets its target back to back and misses it after idle, session 21).
`_write` is timed through `batch_set_v1` (each round's pages deleted after it), `_read`
through `batch_get_v1` of pages stored once. A method that calls helpers the revision had and
the tree no longer has fails with a NameError: compare a nearer revision.
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

import bench_hicache as bh  # noqa: E402
import maru_sglang.maru_storage as storage  # noqa: E402

OPS = {"_write": "set", "_read": "get"}


def method_at(rev: str, name: str):
    """`MaruStorage.<name>` as it was at `rev`, compiled in today's module namespace."""
    path = "src/maru_sglang/maru_storage.py"
    source = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{rev}:{path}"], capture_output=True, text=True
    )
    if source.returncode != 0:
        sys.exit(f"ab_paired: cannot read {path} at {rev}: {source.stderr.strip()}")
    lines = source.stdout.splitlines(keepends=True)
    head = f"    def {name}("
    try:
        start = next(i for i, line in enumerate(lines) if line.startswith(head))
    except StopIteration:
        sys.exit(f"ab_paired: MaruStorage.{name} not found at {rev}")
    end = next(
        (i for i in range(start + 1, len(lines)) if lines[i].startswith("    def ")), len(lines)
    )
    namespace = dict(vars(storage))
    exec(textwrap.dedent("".join(lines[start:end])), namespace)
    return namespace[name]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rev", default="HEAD", help="the revision of version A (default: HEAD)")
    p.add_argument("--method", choices=sorted(OPS), default="_write")
    p.add_argument("--case", default="mha-64K", help="a bench_hicache.py case")
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--idle-ms", type=float, default=0.0, help="sleep before each timed turn")
    args = p.parse_args()
    op = OPS[args.method]
    versions = {
        "A": method_at(args.rev, args.method),
        "B": getattr(storage.MaruStorage, args.method),
    }
    case = next((c for c in bh.CASES if c.name == args.case), None)
    if case is None:
        sys.exit(f"ab_paired: no case {args.case!r} (one of {[c.name for c in bh.CASES]})")
    batch, calls = bh.Plan.make(False).pages_for(case.page_bytes)
    pages = batch * calls
    times: dict[str, list[float]] = {"A": [], "B": [], "stream": []}
    with bh.maru_server("2G") as url:
        inst = bh.Instance(url, case, pages, tempfile.mkdtemp(dir=bh.SHM_DIR), "writer")
        try:
            inst.fill(1)
            if op == "get":
                assert inst.run("maru_set", "ab", batch, 0, pages)[1] == pages
                inst.maru.confirm_writes()
            for r in range(args.rounds + 2):  # two rounds of warm-up
                for v in random.Random(r).sample(sorted(times), len(times)):
                    tag = "ab" if op == "get" else f"ab/{r}/{v}"
                    if v != "stream":
                        setattr(storage.MaruStorage, args.method, versions[v])
                    time.sleep(args.idle_ms / 1000)
                    sec, ok, *_ = inst.run(
                        f"{'stream' if v == 'stream' else 'maru'}_{op}", tag, batch
                    )
                    assert ok == pages or v == "stream", (v, ok)
                    if v != "stream" and op == "set":
                        inst.maru_delete(tag, pages)
                    if r >= 2:
                        times[v].append(sum(sec) / calls)
        finally:
            setattr(storage.MaruStorage, args.method, versions["B"])
            inst.close()
    ratios = [b / a for a, b in zip(times["A"], times["B"])]
    print(
        f"{args.case} batch_{op}_v1 ({batch} pages a call), {args.rounds} rounds; "
        f"A: MaruStorage.{args.method} at {args.rev}, B: the working tree"
        + (f"; {args.idle_ms:g} ms idle before each turn" if args.idle_ms else "")
    )
    print("| version | median us a call | stream / version |")
    print("|---|---:|---:|")
    for v in ("A", "B", "stream"):
        share = statistics.median(s / t for s, t in zip(times["stream"], times[v]))
        print(f"| {v} | {statistics.median(times[v]) * 1e6:.1f} | {share:.1%} |")
    wins = sum(x < 1 for x in ratios)
    print(
        f"B/A per round: median {statistics.median(ratios):.3f}, "
        f"B faster in {wins} of {len(ratios)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
