"""Helpers to run LMCache 0.5.6's real engine with its shipped `MaruBackend` on a CPU-only
machine (install: `scripts/install_lmcache_cpu.sh`).

* `engine.build_engine` builds an `LMCacheEngine` through `LMCacheEngineBuilder` with
  `maru_path` as its only storage backend.
* `engine.CpuKVConnector` is the one stand-in: LMCache's GPU connectors copy between vLLM's
  paged KV cache on the GPU and LMCache's memory objects with CUDA kernels; this one does the
  same gather/scatter with torch on CPU tensors in vLLM's paged layout.
* `workers` holds the code the tests run in separate processes.
"""
