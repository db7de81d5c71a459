"""Paired A/B of one `MaruStorage` data-path method: a git revision's against the working tree's.

    PYTHONPATH=src:tests:tests/sglang_cpu .venv/bin/python benchmarks/ab_paired.py \\
        --rev HEAD~1 --method _write --case mha-64K --rounds 40      # ~1-2 min

Whole runs of `bench_hicache.py`, build against build, drift on a shared VM by more than most
changes of the data path are worth (benchmarks/results/history.md, session 19). Here one writer
process and one `maru-server` run both versions: the method's source at `--rev` is compiled
into `maru_sglang.maru_storage`'s namespace (A) beside the working tree's (B), and each round
runs A, B and the `stream` copy (the limit of bench_hicache.py) in a seeded random order over
the same host pages. B's speed over A's is taken per round, so the machine's drift cancels.
`--idle-ms N`: the writer sleeps N ms before each timed turn (the stream's too), as it does in
`bench_hicache.py` while the reader works: threads and the server asleep, caches cold (on the
2-vCPU VM a 64 KiB set meets its target back to back and misses it after idle, session 21).
`_write` is timed through `batch_set_v1` (each round's pages deleted after it), `_read`
through `batch_get_v1` of pages stored once. A method that calls helpers the revision had and
the tree no longer has fails with a NameError: compare a nearer revision.
"""

from __future__ import annotations

import argparse
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
from report import paired_rounds, print_paired  # noqa: E402

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
    with bh.maru_server("2G") as url:
        inst = bh.Instance(url, case, pages, tempfile.mkdtemp(dir=bh.SHM_DIR), "writer")
        turn = [0]

        def maru(version: str) -> float:
            setattr(storage.MaruStorage, args.method, versions[version])
            time.sleep(args.idle_ms / 1000)
            turn[0] += 1
            tag = "ab" if op == "get" else f"ab/{turn[0]}"
            sec, ok, *_ = inst.run(f"maru_{op}", tag, batch)
            assert ok == pages, (version, ok)
            if op == "set":
                inst.maru_delete(tag, pages)
            return sum(sec)

        def stream() -> float:
            time.sleep(args.idle_ms / 1000)
            return sum(inst.run(f"stream_{op}", "ab", batch)[0])

        try:
            inst.fill(1)
            if op == "get":
                assert inst.run("maru_set", "ab", batch, 0, pages)[1] == pages
                inst.maru.confirm_writes()
            times = paired_rounds(
                {"A": lambda: maru("A"), "B": lambda: maru("B"), "stream": stream},
                args.rounds,
                warmup=2,
            )
        finally:
            setattr(storage.MaruStorage, args.method, versions["B"])
            inst.close()
    print(
        f"{args.case} batch_{op}_v1 ({batch} pages a call), {args.rounds} rounds; "
        f"A: MaruStorage.{args.method} at {args.rev}, B: the working tree"
        + (f"; {args.idle_ms:g} ms idle before each turn" if args.idle_ms else "")
    )
    print_paired(times, calls, unit="us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
