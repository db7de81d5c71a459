"""bench_hicache.py's key scaling still runs: it registers its keys as the server accepts them
(a key a page of its own; all over one chunk was refused once seals were checked for values
sealed under two keys, and nothing ran the scaling then). Real SGLang host pools and real
maru-servers, 10^3 keys, one quick round; no timing asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_key_scaling_registers_its_keys_and_reports_them(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "tests" / "sglang_cpu"))
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_hicache.py"),
            *("--cases", "none", "--max-keys", "1000", "--quick", "--no-progress"),
            *("--out", str(tmp_path)),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "registering scale keys failed" not in run.stderr
    (result,) = tmp_path.glob("hicache-*.json")
    rows = json.loads(result.read_text())
    keys = [row for row in _rows(rows) if row.get("keys") == 1000]
    assert keys and all(row["register_s"] > 0 for row in keys), keys


def _rows(result: object) -> list[dict]:
    """The scaling rows wherever the result file keeps them (a list of dicts with "keys")."""
    found: list[dict] = []
    if isinstance(result, dict):
        for value in result.values():
            found += _rows(value)
    elif isinstance(result, list):
        for item in result:
            if isinstance(item, dict) and "keys" in item and "register_s" in item:
                found.append(item)
            else:
                found += _rows(item)
    return found
