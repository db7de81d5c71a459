"""bench_snapshot.py keeps measuring what it says: every way of snapshotting a registry of real
keys through a real in-process server, the same bytes each way. No timing asserted."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_snapshot


def test_every_way_is_measured_and_writes_the_same_snapshot():
    got = bench_snapshot.measure(3000, 1)
    assert set(got) == set(bench_snapshot.WAYS) and len(got) == 3
    assert any("background" in way for way in got)
    sizes = {size for *_, size in got.values()}
    assert len(sizes) == 1 and sizes.pop() > 3000 * 70  # (a row a key: its 68-char key and more)
    assert all(held > 0 and cpu >= 0 and landed >= held for held, cpu, landed, _ in got.values())
