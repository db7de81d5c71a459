"""bench_server.py keeps measuring what it says: a few requests of each kind through a real
in-process server (journal and local index on), the full pool evicting. No timing asserted."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_server


def test_every_kind_is_measured_and_the_full_pool_evicts(tmp_path):
    times = bench_server.run(40, tmp_path)
    assert times.pop("_evictions_per_request")[0] > 0.5  # past the watermark: ~1 per key
    assert set(times) == {
        "register",
        "delete",
        "register, full pool",
        "wire: register",
        "wire: delete",
    }
    assert all(len(samples) == 40 and min(samples) > 0 for samples in times.values())
