"""bench_snapshot.py keeps measuring what it says: both ways of snapshotting a registry of real
keys through a real in-process server, the same bytes each way. No timing asserted."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_snapshot


def test_both_ways_are_measured_and_write_the_same_snapshot():
    got = bench_snapshot.measure(3000, 1)
    assert set(got) == {"rows list (before)", "packed in C"}
    sizes = {size for _, _, size in got.values()}
    assert len(sizes) == 1 and sizes.pop() > 3000 * 70  # (a row a key: its 68-char key and more)
    assert all(wall > 0 and cpu >= 0 for wall, cpu, _ in got.values())
