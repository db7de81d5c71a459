"""What every benchmark does at its end: print the report and write it to result files.

`bench_hicache.py` and `bench_lmcache.py` share it so that their result files keep one naming
scheme (`<name>-<time>[-<label>][-quick].{csv,md,json[,png]}` under `--out`) and one footer
line (the load at the end and the run's duration). The paired A/B tools (`ab_*.py`) share
their rounds and their verdict (`paired_rounds`, `print_paired`). Not a `bench_*.py` itself:
it measures nothing (docs/performance.md has one section per `bench_*.py`).
"""

from __future__ import annotations

import csv
import json
import os
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def finish(
    name: str,
    out_dir: str | Path,
    text: str,
    doc: dict[str, Any],
    machine: dict[str, Any],
    t_start: float,
    *,
    write_csv: Callable[[Path], None],
    plot: Callable[[Path], bool] | None = None,
    quick: bool = False,
    label: str = "",
) -> Path:
    """Print `text` with the footer line, then write `.csv` (`write_csv`), `.md` (the text),
    `.json` (`doc`, which should hold `machine`: its `load_after` is set here first) and, if
    `plot` is given, `.png` (`plot` returns False when matplotlib is missing). Returns the
    files' common stem."""
    machine["load_after"] = os.getloadavg()[0]
    text += (
        f"\n\n1-min load at end {machine['load_after']:.2f}; "
        f"run took {time.monotonic() - t_start:.0f} s"
    )
    print(text)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S") + (f"-{label}" if label else "")
    base = out / f"{name}-{stamp}{'-quick' if quick else ''}"

    def path(ext: str) -> Path:  # (a label may hold dots: no with_suffix)
        return base.with_name(base.name + ext)

    write_csv(path(".csv"))
    path(".md").write_text(text + "\n")
    path(".json").write_text(json.dumps(doc, indent=1))
    wrote = f"\nwrote {base}.csv, .md, .json"
    if plot is not None:
        wrote += ", .png" if plot(path(".png")) else " (no matplotlib: no PNG)"
    print(wrote)
    return base


def rows_csv(rows: list[dict[str, Any]]) -> Callable[[Path], None]:
    """`finish`'s `write_csv` for a table of dicts alike (the first row names the columns)."""

    def write_csv(path: Path) -> None:
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)

    return write_csv


def paired_rounds(
    turns: dict[str, Callable[[], float]], rounds: int, warmup: int = 0
) -> dict[str, list[float]]:
    """Run every turn (A, B, "stream": each returns its seconds) once a round, in an order
    seeded by the round, so that a drifting machine weighs on every version alike; the
    seconds of each turn, one a round after the `warmup` rounds."""
    times: dict[str, list[float]] = {name: [] for name in turns}
    for r in range(warmup + rounds):
        for name in random.Random(r).sample(sorted(turns), len(turns)):
            seconds = turns[name]()
            if r >= warmup:
                times[name].append(seconds)
    return times


def print_paired(times: dict[str, list[float]], per: int, unit: str = "ms") -> None:
    """The verdict of `paired_rounds`' A, B and "stream": each version's median time a call
    (`per` calls a turn) and its speed against the stream copy's in the same round; B's speed
    over A's per round (drift cancels), and in how many rounds B was faster."""
    scale = {"ms": 1e3, "us": 1e6}[unit]
    print(f"| version | median {unit} a call | of the stream copy (median of rounds) |")
    print("|---|---:|---:|")
    for v in ("A", "B", "stream"):
        share = (
            ""
            if v == "stream"
            else f"{statistics.median(s / t for s, t in zip(times['stream'], times[v])):.1%}"
        )
        print(f"| {v} | {statistics.median(times[v]) / per * scale:.3f} | {share} |")
    ratios = [a / b for a, b in zip(times["A"], times["B"])]
    faster = sum(x > 1 for x in ratios)
    print(
        f"B's speed / A's per round: median {statistics.median(ratios):.3f}, "
        f"mean {statistics.mean(ratios):.3f}; B faster in {faster} of {len(ratios)}"
    )
