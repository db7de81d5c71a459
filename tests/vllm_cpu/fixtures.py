"""The preamble and fixtures of the vLLM test modules (tests/integration/test_*vllm*), which run
vLLM only in spawned processes (`vllm_cpu.workers`): the pytest process never imports it.

A module starts with::

    from vllm_cpu import fixtures

    fixtures.require()  # skips the module without vLLM

    model_dir = fixtures.model_dir  # the fixtures, by name
    vllm_env = fixtures.vllm_env
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from vllm_cpu.workers import VLLM_SITE

TESTS = Path(__file__).resolve().parents[1]


def require() -> None:
    """The preamble of a module of vLLM tests: `tests` first on sys.path (`sglang_cpu`,
    `vllm_cpu`, `pool_places`, also in the spawned processes, which get this sys.path), then
    skip the module unless vLLM is installed in build/vllm-site."""
    sys.path.insert(0, str(TESTS))
    if not (VLLM_SITE / "vllm").is_dir():
        pytest.skip("vLLM not installed (scripts/install_vllm_cpu.sh)", allow_module_level=True)


def set_vllm_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The spawned processes (only they) import vLLM from build/vllm-site (the workers add
    it to sys.path), with tests/vllm_cpu/sitecustomize.py (torchvision schema shim) loaded at
    interpreter start; nothing is downloaded."""
    paths = [str(TESTS / "vllm_cpu"), str(VLLM_SITE)]
    old = [p for p in os.environ.get("PYTHONPATH", "").split(":") if p]
    monkeypatch.setenv("PYTHONPATH", ":".join(paths + old))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """A tiny local model: vLLM's ModelConfig reads its config (no downloads)."""
    from sglang_cpu.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny")))


@pytest.fixture
def vllm_env(monkeypatch):
    """vLLM's environment for the test's spawned processes (`set_vllm_env`)."""
    set_vllm_env(monkeypatch)
