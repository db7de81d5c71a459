"""Paired A/B of a change in the client's write path, in one process, in a regime of
`bench_regimes.py` (a full instance by default).

    PYTHONPATH=tests/sglang_cpu .venv/bin/python benchmarks/ab_regimes.py SWITCH.py \\
        --size "1 MiB" --rounds 80                                   # ~1 minute

SWITCH.py defines `a()` and `b()`, each putting one version in place in this process (a module
attribute set, a method swapped), e.g.:

    import maru.client.supply as supply
    def a(): supply.AHEAD_WRITES = 3
    def b(): supply.AHEAD_WRITES = 4

Whole `bench_regimes.py` runs drift with the host's memory bandwidth by 10-30% within minutes,
more than most changes of the write path are worth (benchmarks/results/history.md, 2026-12-05,
session 44). Here one writer process and one `maru-server` run both versions: bench_regimes'
`Side` (MaruStorage from SGLang's backend factory on SGLang's MHA host pool), its
`maru_pool_size` written full first (`--regime full`: every write makes room) or with room
(`--regime roomy`: its keys deleted after each block, untimed). Each round runs a block of
A, a block of B (two untimed calls after each switch) and a block of the streaming copy, in a
seeded random order; ratios are taken per round, so the machine's drift cancels. A null
switch (`a` and `b` alike) gives B/A 0.99-1.01 over 80-100 rounds; a 3% change shows as B
faster in about four rounds of five.
"""

from __future__ import annotations

import argparse
import runpy
import sys
from collections.abc import Callable

import bench_hicache as H  # (same dir; puts tests/ on sys.path for sglang_cpu)
import bench_regimes as R
from report import paired_rounds, print_paired


def load_switch(path: str) -> dict[str, Callable[[], object]]:
    """SWITCH.py's `a` and `b` (SystemExit naming what is missing)."""
    found = runpy.run_path(path)
    missing = [name for name in ("a", "b") if not callable(found.get(name))]
    if missing:
        sys.exit(f"ab_regimes: {path} defines no function {' or '.join(missing)}()")
    return {"A": found["a"], "B": found["b"]}


def run(
    switch: dict[str, Callable[[], object]], size: str, regime: str, rounds: int, calls: int
) -> dict[str, list[float]]:
    """Seconds per block of `calls` calls for A, B and the stream copy, one entry a round."""
    case = R.CASES[size]
    pages = R.pages_of(case)
    with H.maru_server(R.SERVER_POOL) as url:
        share = R.FULL_CALLS if regime == "full" else 4 * calls
        side = R.Side(url, case, pages, share * R.CALL_BYTES, regime)
        side.fill(1)
        side.timed("stream_set", "warm", 2)
        switch["A"]()
        if regime == "full":
            side.timed("maru_set", "share", R.FULL_CALLS + 1)  # (untimed: its share full)
        else:  # (untimed: the pages its blocks write touched once)
            side.timed("maru_set", "warm", calls + 2)
            side.delete("warm", calls + 2)
        blocks = [0]

        def maru(version: str) -> float:
            switch[version]()
            blocks[0] += 1
            tag = f"ab{blocks[0]}"
            side.timed("maru_set", f"{tag}/warm", 2)  # (untimed: the switch)
            block = side.timed("maru_set", tag, calls)
            assert block["ok"] == calls * pages, f"{version}: stored {block}"
            if regime == "roomy":
                side.delete(f"{tag}/warm", 2)
                side.delete(tag, calls)
            return block["seconds"]

        try:
            return paired_rounds(
                {
                    "A": lambda: maru("A"),
                    "B": lambda: maru("B"),
                    "stream": lambda: side.timed("stream_set", "copy", calls)["seconds"],
                },
                rounds,
            )
        finally:
            switch["A"]()
            side.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("switch", help="a Python file defining a() and b()")
    p.add_argument("--size", choices=sorted(R.CASES), default="1 MiB")
    p.add_argument("--regime", choices=("full", "roomy"), default="full")
    p.add_argument("--rounds", type=int, default=80)
    p.add_argument("--calls", type=int, default=12, help="16 MiB calls a block")
    args = p.parse_args()
    times = run(load_switch(args.switch), args.size, args.regime, args.rounds, args.calls)
    print(
        f"{args.switch}: batch_set_v1 of {args.size} pages, regime {args.regime}, "
        f"{args.rounds} rounds of {args.calls} calls of 16 MiB"
    )
    print_paired(times, args.calls)
    return 0


if __name__ == "__main__":
    sys.exit(main())
