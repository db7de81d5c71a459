"""The `sgl_kernel` stand-in of the SGLang test shims (`tests/sglang_cpu/sitecustomize.py`).

On CPU only the top-level module is a stand-in, so SGLang's `except ImportError` fallbacks for
its submodules still run. On a GPU host without the sgl_kernel wheel (scripts/gpu_host_check.sh)
SGLang imports `sgl_kernel.quantization` unguarded, so there the submodules are stand-ins too;
that host's branch is taken here by replacing its GPU check, in a fresh interpreter each time
(a stand-in stays in `sys.modules` once imported)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import sglang_cpu

pytestmark = pytest.mark.timeout(60)

PROBE = r"""
import sys
import sitecustomize
sitecustomize._stub_submodules = lambda: {gpu}
import sgl_kernel
assert getattr(sgl_kernel, sitecustomize._MARK), "not the stand-in"
try:
    import sgl_kernel.quantization.gguf as sub
except ImportError:
    print("no submodules")
    sys.exit(0)
print("submodule", sub.__name__)
from sgl_kernel.scalar_type import scalar_types
print("read at import:", scalar_types.uint4b8)
class Layer(sgl_kernel.SomeBase):
    pass
print("called:", sub.ggml_dequantize(1, 2))
"""


def probe(gpu: bool) -> str:
    return run(PROBE.format(gpu=gpu))


def run(code: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(sglang_cpu.SHIM_DIR))
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


CPU_PROBE = r"""
import sitecustomize
sitecustomize._stub_submodules = lambda: False
import sgl_kernel
try:
    sgl_kernel.moe_sum()
except NotImplementedError as exc:
    print("raises:", exc)
"""


def test_on_cpu_the_submodules_of_the_stand_in_stay_missing():
    assert probe(gpu=False).strip() == "no submodules"


def test_on_cpu_a_name_of_the_stand_in_raises_when_called():
    assert "raises: sgl_kernel.moe_sum is a CPU test stand-in" in run(CPU_PROBE)


def test_on_a_gpu_host_the_submodules_are_stand_ins_and_their_names_placeholders():
    # what SGLang 0.5.23's modules do with them at import on a CUDA host (seen on an H100)
    out = probe(gpu=True)
    assert "submodule sgl_kernel.quantization.gguf" in out
    assert (
        "read at import: <sgl_kernel test stand-in sgl_kernel.scalar_type.scalar_types.uint4b8>"
        in out
    )
    assert (
        "called: <sgl_kernel test stand-in sgl_kernel.quantization.gguf.ggml_dequantize()>" in out
    )
