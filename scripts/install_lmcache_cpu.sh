#!/usr/bin/env bash
# Install the real LMCache 0.5.6 into the current Python environment, CPU only (tests of
# maru_lmcache against LMCache's shipped MaruBackend).
#
#   scripts/install_lmcache_cpu.sh            # uses `python` on PATH (e.g. an activated venv)
#   PYTHON=/path/to/venv/bin/python scripts/install_lmcache_cpu.sh
#
# Run after scripts/install_sglang_cpu.sh (which brings the CPU torch, numpy, pyzmq, msgspec,
# transformers... that LMCache imports) and after Maru itself is installed (the sanity check
# imports LMCache's MaruBackend, which imports maru and maru_lmcache).
# Idempotent: re-running only checks that everything is already satisfied.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
req="$(cd "$here/../requirements" && pwd)"
PY="${PYTHON:-python}"
pip=("$PY" -m pip install --disable-pip-version-check)
[[ "${VERBOSE:-0}" == 1 ]] || pip+=(-q)

start=$SECONDS
# LMCache and the few modules it imports beyond the SGLang set, without declared dependencies
# (they would pull CUDA wheels and move numpy).
"${pip[@]}" --no-deps -r "$req/lmcache-nodeps.txt"

# Sanity: CPU torch still in place; the engine and the shipped Maru backend import.
LMCACHE_TRACK_USAGE=false "$PY" - <<'PYEOF'
import torch
assert not torch.version.cuda, f"expected a CPU torch, got CUDA {torch.version.cuda}"
import lmcache
from lmcache.v1.cache_engine import LMCacheEngineBuilder
from lmcache.v1.storage_backend.maru_backend import MaruBackend
print(f"[install_lmcache_cpu] ok: torch {torch.__version__}, lmcache {lmcache.__version__}")
PYEOF
echo "[install_lmcache_cpu] done in $((SECONDS - start)) s"
