"""The test install's torch step (scripts/install_torch_cpu.sh) on a machine like a fresh one:
pip with no config, no local wheels, an index without `torch==2.13.0+cpu`. A stand-in torch
wheel (a few bytes, same name and version) plays the PyTorch CPU index's, so each way the
script can go is taken for real: from $MARU_TORCH_INDEX_URL, found by pip's own settings,
already installed, and a clear failure when nothing has it."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "install_torch_cpu.sh"
WHEEL = "torch-2.13.0+cpu-py3-none-any.whl"


def stand_in_wheel(directory: Path) -> Path:
    directory.mkdir(parents=True)
    info = "torch-2.13.0+cpu.dist-info"
    files = {
        "torch/__init__.py": '__version__ = "2.13.0+cpu"\n',
        f"{info}/METADATA": "Metadata-Version: 2.1\nName: torch\nVersion: 2.13.0+cpu\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"])
    path = directory / WHEEL
    with zipfile.ZipFile(path, "w") as zf:
        for name, text in files.items():
            zf.writestr(name, text)
    return path


@pytest.fixture(scope="module")
def machine(tmp_path_factory):
    """A venv without torch, an empty default index, and a stand-in PyTorch CPU index."""
    root = tmp_path_factory.mktemp("install")
    subprocess.run([sys.executable, "-m", "venv", str(root / "venv")], check=True, timeout=120)
    wheel = stand_in_wheel(root / "wheels")
    (root / "empty-index").mkdir()
    index = root / "torch-index" / "torch"
    index.mkdir(parents=True)
    (index / "index.html").write_text(f'<a href="{wheel.as_uri()}">{WHEEL}</a>\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(
        PIP_CONFIG_FILE=os.devnull,  # no pip.conf: no local mirror, no find-links
        PIP_INDEX_URL=(root / "empty-index").as_uri(),
        PIP_NO_CACHE_DIR="1",
        PYTHON=str(root / "venv" / "bin" / "python"),
    )
    env.pop("MARU_TORCH_INDEX_URL", None)
    return root, env


def install(env: dict, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT)],
        env={**env, **extra},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_nothing_has_it_fails_saying_which_variable_to_set(machine):
    root, env = machine
    proc = install(env, MARU_TORCH_INDEX_URL=(root / "empty-index").as_uri())
    assert proc.returncode == 1
    assert "trying the PyTorch CPU index" in proc.stdout
    assert "set MARU_TORCH_INDEX_URL to a reachable PyTorch CPU index" in proc.stderr


def test_found_by_pips_own_settings(machine):
    root, env = machine
    proc = install(env, DRY_RUN="1", PIP_FIND_LINKS=str(root / "wheels"))
    assert proc.returncode == 0, proc.stderr
    assert "found by pip's own settings" in proc.stdout


def test_from_the_index_in_the_variable_then_already_installed(machine):
    root, env = machine
    index = (root / "torch-index").as_uri()
    proc = install(env, MARU_TORCH_INDEX_URL=index)
    assert proc.returncode == 0, proc.stderr
    assert f"torch 2.13.0+cpu from {index}" in proc.stdout
    again = install(env)  # no index given, none needed now
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip() == "[install_torch_cpu] torch 2.13.0+cpu already installed"
