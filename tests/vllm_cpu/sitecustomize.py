"""Loaded at interpreter start in the vLLM test processes (this directory first on PYTHONPATH):
the SGLang tests' import hook, for its torchvision op-schema shim (the torchvision wheel of the
shared CPU set is a CUDA build whose `_C` does not load on CPU torch, and transformers, which
vLLM imports, imports torchvision). Its other shims act only on `sglang` modules."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import sglang_cpu.sitecustomize  # noqa: F401
