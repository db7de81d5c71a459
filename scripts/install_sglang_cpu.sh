#!/usr/bin/env bash
# Install the real SGLang 0.5.23 into the current Python environment, CPU only (tests).
#
#   scripts/install_sglang_cpu.sh            # uses `python` on PATH (e.g. an activated venv)
#   PYTHON=/path/to/venv/bin/python scripts/install_sglang_cpu.sh
#
# Idempotent: re-running only checks that everything is already satisfied.
# Order matters: torch (CPU build) first, then the deps under constraints that keep torch
# pinned, then sglang itself without its (CUDA) dependency set.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
req="$(cd "$here/../requirements" && pwd)"
PY="${PYTHON:-python}"
pip=("$PY" -m pip install --disable-pip-version-check)
[[ "${VERBOSE:-0}" == 1 ]] || pip+=(-q)

start=$SECONDS
echo "[install_sglang_cpu] python: $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])')"

# 1. torch, CPU build: already installed, found by pip, or from the PyTorch CPU index
#    ($MARU_TORCH_INDEX_URL overrides it; see install_torch_cpu.sh). `+cpu` never matches
#    the CUDA wheel; never unpinned: plain `torch` resolves to a multi-GB CUDA build.
PYTHON="$PY" bash "$here/install_torch_cpu.sh"

# 2. Everything SGLang needs on CPU, with torch & friends held by the constraints.
"${pip[@]}" -c "$req/constraints.txt" -r "$req/sglang-cpu.txt"

# 3. SGLang itself, without its declared dependencies (they would pull CUDA wheels).
"${pip[@]}" --no-deps -r "$req/sglang-nodeps.txt"

# Sanity: CPU torch still in place, the HiCache modules import (with the test shims).
PYTHONPATH="$here/../tests/sglang_cpu${PYTHONPATH:+:$PYTHONPATH}" SGLANG_USE_CPU_ENGINE=1 "$PY" - <<'PYEOF'
import torch
assert not torch.version.cuda, f"expected a CPU torch, got CUDA {torch.version.cuda}"
import sglang
import sglang.srt.mem_cache.hicache_storage
import sglang.srt.mem_cache.storage.backend_factory
import sglang.srt.mem_cache.pool_host.mha
import sglang.srt.mem_cache.pool_host.mla
import sglang.srt.managers.cache_controller
print(f"[install_sglang_cpu] ok: torch {torch.__version__}, sglang {sglang.__version__}")
PYEOF
# SGLang compiles its C++ page-hash extension (hicache_hash_cpp) on first use, inside the first
# request that hashes, 10-20 s here: a server's storage thread busy with it for that long
# makes SGLang's 10 s join give up on a detach. Build it now, where the test servers look for
# it (tests/sglang_cpu: $VENV/torch_extensions). Not fatal: SGLang builds it later otherwise.
TORCH_EXTENSIONS_DIR="$("$PY" -c 'import sys; print(sys.prefix)')/torch_extensions" \
PYTHONPATH="$here/../tests/sglang_cpu${PYTHONPATH:+:$PYTHONPATH}" SGLANG_USE_CPU_ENGINE=1 \
    "$PY" -c 'from sglang.srt.mem_cache.cpp_utils.native_hash import _load_native_hash_module as load; load()' \
    >/dev/null 2>&1 \
    && echo "[install_sglang_cpu] SGLang's page-hash extension built" \
    || echo "[install_sglang_cpu] warning: SGLang's page-hash extension not built now (SGLang builds it on first use)"
echo "[install_sglang_cpu] done in $((SECONDS - start)) s"
