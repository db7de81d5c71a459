"""`benchmarks/write_floor.py` run as a user runs it: every method's bursts store every page
(the tool stops with an error otherwise: a floor of failed registrations would flatter it),
and the table names each method and the kernel's scheduler settings. No timing asserted."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "benchmarks" / "write_floor.py"


def test_write_floor_measures_each_method_over_fully_stored_bursts():
    done = subprocess.run(
        [sys.executable, str(TOOL), "--rounds", "1", "--idle-ms", "0"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split("|")[1].strip() for line in done.stdout.splitlines() if line[:2] == "| "]
    assert rows == ["method", "stream", "dest", "floor", "maru"]
    assert "kernel scheduler settings:" in done.stdout
