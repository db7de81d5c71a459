"""Cheap checks of examples/sglang (the GPU ones cannot run here; the CPU one runs in
test_sglang_p2p.py through the same `sglang_cpu.p2p.run_p2p`).

* every shell script parses (`bash -n`);
* the contract JSON that examples/sglang/common/lib.sh passes to SGLang is the one the CPU
  tests use (`sglang_cpu.p2p.maru_extra_config`), key for key;
* the Python entry points start (`--help`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "sglang"
sys.path.insert(0, str(ROOT / "tests"))

from sglang_cpu import p2p  # noqa: E402

SCRIPTS = sorted(EXAMPLES.rglob("*.sh"))


def test_examples_exist():
    names = {p.relative_to(EXAMPLES).as_posix() for p in SCRIPTS}
    assert {
        "single/single_example.sh",
        "single/run_simple_query.sh",
        "single/run_benchmark.sh",
        "p2p_sharing/p2p_example.sh",
        "p2p_sharing/run_simple_query.sh",
        "p2p_sharing/run_benchmark.sh",
        "cpu_p2p/run.sh",
        "common/lib.sh",
    } <= names
    for d in ("single", "p2p_sharing", "cpu_p2p"):
        assert (EXAMPLES / d / "README.md").is_file()


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.relative_to(EXAMPLES).as_posix())
def test_shell_scripts_parse(script):
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr


def test_lib_passes_the_contract_json(tmp_path):
    env = dict(os.environ, LOG_DIR=str(tmp_path), MARU_PORT="5999", MARU_POOL_SIZE="256M")
    env["PREFETCH_THRESHOLD"] = "4"
    proc = subprocess.run(
        ["bash", "-c", f'source "{EXAMPLES / "common" / "lib.sh"}" && maru_extra_config'],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == p2p.maru_extra_config(
        "tcp://127.0.0.1:5999", pool_size="256M", prefetch_threshold=4
    )


@pytest.mark.parametrize(
    "entry", ["common/sglang_client.py", "cpu_p2p/p2p_demo.py"], ids=lambda e: e
)
def test_python_entry_points_start(entry):
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / entry), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "usage" in proc.stdout
