"""examples/basic/run.sh works: a server, a writer process, then a reader process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

RUN_SH = Path(__file__).resolve().parents[2] / "examples" / "basic" / "run.sh"


@pytest.mark.timeout(120)
def test_basic_example_runs():
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(
        ["bash", str(RUN_SH)], env=env, capture_output=True, text=True, timeout=100
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert out.count("identical=True") == 7
    assert "identical=False" not in out
    assert "example/never-stored: not found (as expected)" in out
    assert out.rstrip().endswith("reader: OK")
    pool = out.split(", pool ", 1)[1].split()[0]
    assert pool.startswith("/dev/shm/") and not os.path.exists(pool)  # cleaned up
