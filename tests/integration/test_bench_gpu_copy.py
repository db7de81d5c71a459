"""`benchmarks/bench_gpu_copy.py` (issue 17, part 2) run as a user runs it. Torch here has no
CUDA, so its DMA/page copies run on the CPU and the kernel's are left out: the test proves the
harness (its own server, a Maru region and a second host buffer copied both ways page by page,
the round trip checked, the table and the result files) and that the output says its figures
are not GPU ones. On a GPU host the same code copies between HBM and the region registered
with CUDA, by the linker's kernel too (its columns then present)."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "bench_gpu_copy.py"


def test_the_gpu_copy_bench_runs_and_says_when_it_had_no_gpu(tmp_path):
    args = ["--quick", "--sizes", "64K,1M", "--out", str(tmp_path)]
    done = subprocess.run(
        [sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=180, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert ("NO CUDA DEVICE" in done.stdout) == (not torch.cuda.is_available())
    with next(tmp_path.glob("gpu-copy-*-quick.csv")).open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["page"], r["direction"]) for r in rows] == [
        ("64 KiB", "offload"),
        ("64 KiB", "load"),
        ("1024 KiB", "offload"),
        ("1024 KiB", "load"),
    ]
    columns = ["dma/shared", "dma/pinned", "one/shared", "one/pinned"]
    if torch.cuda.is_available():
        columns += ["kernel/shared", "kernel/pinned"]
    assert sorted(k for k in rows[0] if "/" in k) == sorted(columns)
    assert all(float(r[c]) > 0 for r in rows for c in columns)


def test_the_gpu_linker_bench_says_plainly_when_it_cannot_run(tmp_path):
    """`bench_gpu_linker.py` needs a GPU (SGLang's device pools on CUDA): without one it says
    so and exits 0, measuring nothing, rather than failing with a traceback."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the benchmark measures (docs/performance.md, GPU section)")
    bench = ROOT / "benchmarks" / "bench_gpu_linker.py"
    done = subprocess.run(
        [sys.executable, str(bench), "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "needs a CUDA GPU" in done.stdout and "Traceback" not in done.stderr
    assert not list(tmp_path.iterdir())
