"""Helpers to run vLLM 0.33's real scheduler, KV cache allocation and connector classes on a
CPU-only machine (install: `scripts/install_vllm_cpu.sh`, into `build/vllm-site`).

* `sitecustomize.py` (on PYTHONPATH of the vLLM processes) registers torchvision's op schemas
  before torchvision is imported: the torchvision wheel of the SGLang set is a CUDA build
  whose `_C` does not load on CPU torch (the same shim the SGLang tests use).
* `engine.MiniEngine` drives a real `Scheduler` and a worker-side connector step by step; the
  model's forward pass is the one stand-in: it writes known KV into the scheduled slots.
"""
