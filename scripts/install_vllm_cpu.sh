#!/usr/bin/env bash
# Install the real vLLM 0.33.0, CPU only, into build/vllm-site (a --target directory, not the
# venv): the maru_vllm tests run vLLM's scheduler and connector classes from there.
#
#   scripts/install_vllm_cpu.sh            # uses `python` on PATH (e.g. an activated venv)
#   PYTHON=/path/to/venv/bin/python scripts/install_vllm_cpu.sh
#
# Needs the SGLang set first (scripts/install_sglang_cpu.sh: CPU torch, transformers...).
# Downloads about 340 MB, takes about 880 MB on disk. Idempotent: skipped when the pinned
# versions are already there.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
req="$root/requirements/vllm-nodeps.txt"
site="${VLLM_SITE:-$root/build/vllm-site}"
PY="${PYTHON:-python}"
stamp="$site/.installed-$(sha1sum "$req" | cut -c1-12)"

start=$SECONDS
if [[ ! -e "$stamp" ]]; then
    rm -rf "$site"
    pip=("$PY" -m pip install --disable-pip-version-check --no-deps --target "$site")
    [[ "${VERBOSE:-0}" == 1 ]] || pip+=(-q)
    "${pip[@]}" -r "$req"
    touch "$stamp"
fi

# Sanity: vLLM's connector base classes and scheduler import on CPU torch (with the
# torchvision schema shim of tests/vllm_cpu/sitecustomize.py, as the tests run them).
PYTHONPATH="$root/tests/vllm_cpu:$site${PYTHONPATH:+:$PYTHONPATH}" "$PY" - <<'PYEOF' 2>&1 | grep -v "vllm._C"
import torch
assert not torch.version.cuda, f"expected a CPU torch, got CUDA {torch.version.cuda}"
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA
from vllm.v1.core.sched.scheduler import Scheduler
print(f"[install_vllm_cpu] ok: torch {torch.__version__}, vllm {vllm.__version__}")
PYEOF
echo "[install_vllm_cpu] done in $((SECONDS - start)) s"
