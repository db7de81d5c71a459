"""`benchmarks/bench_pod.py` (issue 43) run as a user runs it, in quick mode: the two hosts of a
pod (namespaces, as the pod tests make them), local and remote readers through the in-pool
index in both coherence modes, every byte read judged. The figures are printed, not judged
here (no wall-clock thresholds): the run proves the harness and the reads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .test_pool_path import hosts_missing

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "bench_pod.py"


@pytest.mark.skipif(bool(hosts_missing()), reason=hosts_missing() or "-")
def test_the_pod_bench_reads_every_value_right_from_both_hosts(tmp_path):
    out = tmp_path / "pod.json"
    done = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| hardware |" in done.stdout and "| software |" in done.stdout
    summary = json.loads(out.read_text())
    assert set(summary) == {"hardware", "software"}
    for mode in summary.values():
        assert mode["index"] == {"local": True, "remote": True}  # both through the index
        calls = 5 * 64  # quick: 5 timed calls of 64 values per reader
        assert mode["local_bytes"] == mode["remote_bytes"] == [calls, 0, 0]
