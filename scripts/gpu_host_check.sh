#!/usr/bin/env bash
# The GPU checks in one command, on a GPU host whose Python already has a CUDA torch and Triton
# (a PyTorch CUDA image): the tests that need CUDA (the linker's copy kernel, the linker on
# SGLang's device pools, the shared mapping registered with CUDA), the GPU benchmarks, and
# bench_hicache.py on the host's CPUs. Needs no network and no install of Maru: it builds the
# C extensions in place and runs from the checkout.
#
#   WHEELS=wheels OUT=gpu-results bash scripts/gpu_host_check.sh     # QUICK=1: a short pass
#
# WHEELS: a folder of wheels for what the image lacks (requirements/gpu-host-nodeps.txt),
# installed with --no-deps into a private target. OUT: where the results and the log go.
# HICACHE_ARGS: more arguments for bench_hicache.py, e.g. "--pool-dir /mnt/maru" for a tmpfs
# mounted with huge=within_size (docs/operations.md, huge pages), or "--cases none".
# Each step has its own time limit and a failed step does not stop the next.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"
OUT="${OUT:-benchmarks/results/gpu-host}"
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_host_check.log") 2>&1
t0=$SECONDS
step() { echo; echo "=== [$((SECONDS - t0)) s] $*"; }
quick=()
[[ "${QUICK:-0}" == 1 ]] && quick=(--quick)

if [[ -n "${WHEELS:-}" ]]; then
    step "wheels from $WHEELS"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/maru-gpu-site "$WHEELS"/*.whl || exit 1
    export PYTHONPATH="/tmp/maru-gpu-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

step machine
nproc
lscpu | grep -E "Model name|NUMA node\(s\)|L3" || true
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
for f in enabled shmem_enabled; do
    echo "THP $f: $(cat /sys/kernel/mm/transparent_hugepage/$f 2>/dev/null)"
done
"$PY" -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.is_available())"

step "C extensions, in place"
"$PY" setup.py -q build_ext --inplace >/dev/null 2>&1
"$PY" -c "import maru.common._memcopy, maru.client._busypoll, maru.common._shmindex, maru.server._keyindex" \
    && echo "all four built" || { echo "the C extensions did not build"; exit 1; }

step "tests that need CUDA"
timeout 300 "$PY" -m pytest -q -p no:cacheprovider tests/unit/test_cuda_copy.py \
    tests/integration/test_sglang_linker.py tests/integration/test_bench_gpu_copy.py

step bench_gpu_copy
timeout 120 "$PY" benchmarks/bench_gpu_copy.py "${quick[@]}" --out "$OUT"
step bench_gpu_linker
PYTHONPATH="$PWD/tests/sglang_cpu:$PYTHONPATH" \
    timeout 120 "$PY" benchmarks/bench_gpu_linker.py "${quick[@]}" --out "$OUT"

step "bench_hicache on the host's CPUs"
CUDA_VISIBLE_DEVICES= SGLANG_USE_CPU_ENGINE=1 \
    timeout 400 "$PY" benchmarks/bench_hicache.py "${quick[@]}" --no-progress --out "$OUT" \
    ${HICACHE_ARGS:-} 2>&1 | grep -vE "UserWarning|warnings.warn"
step done
