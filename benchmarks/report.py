"""What every benchmark does at its end: print the report and write it to result files.

`bench_hicache.py` and `bench_lmcache.py` share it so that their result files keep one naming
scheme (`<name>-<time>[-<label>][-quick].{csv,md,json[,png]}` under `--out`) and one footer
line (the load at the end and the run's duration). Not a `bench_*.py` itself: it measures
nothing (docs/performance.md has one section per `bench_*.py`).
"""

from __future__ import annotations

import csv
import json
import os
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
