"""Helpers to run the real SGLang 0.5.23 on a CPU-only machine in tests.

* :func:`apply` installs the CPU shims of ``sitecustomize.py`` in the current process;
  :func:`require` does it and skips a test module unless SGLang imports.
* :func:`sglang_env` gives the environment for ``sglang.launch_server`` subprocesses (this
  directory on ``PYTHONPATH`` so that every SGLang process loads the shims).
* ``tiny_model.build_tiny_model`` makes a random-weight Qwen2 model + tokenizer locally.
* ``server.start_server`` / ``server.stop_server`` launch and stop a real server.

Install SGLang first: ``scripts/install_sglang_cpu.sh``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

SHIM_DIR = Path(__file__).resolve().parent


def apply() -> None:
    """Install the CPU shims in this process (idempotent; safe before or after sglang imports)."""
    from . import sitecustomize

    sitecustomize.install()


def require() -> None:
    """The preamble of a test module that needs SGLang: install the CPU shims (before SGLang
    is first imported), then skip the module unless SGLang, and with it torch, imports."""
    import pytest

    apply()
    pytest.importorskip("sglang")


def sglang_env(extra: dict[str, str] | None = None, *, base: dict[str, str] | None = None) -> dict:
    """Environment for a ``python -m sglang.launch_server`` subprocess on CPU.

    Starts from ``base`` (default: ``os.environ``), puts this directory first on ``PYTHONPATH``
    (so ``sitecustomize`` loads in the server and all its subprocesses), selects SGLang's CPU
    engine, and applies ``extra`` last (an ``extra["PYTHONPATH"]`` keeps the shim dir first).
    """
    env = dict(os.environ if base is None else base)
    env.update(
        {
            # Else the rotary embedding imports vllm, and CUDA-only kernels are chosen.
            "SGLANG_USE_CPU_ENGINE": "1",
            "CUDA_VISIBLE_DEVICES": "",
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
        }
    )
    # SGLang JIT-compiles a C++ hash extension (hicache_hash_cpp) on first use, into one
    # directory shared by every Python environment of the user: two venvs with different torch
    # builds then rebuild it in turn (10-20 s each, inside the first request that hashes). One
    # directory per environment keeps each build.
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    if extra:
        env.update(extra)
    # The shim dir goes first even when ``extra`` sets its own PYTHONPATH.
    paths = [str(SHIM_DIR)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env
