#!/usr/bin/env bash
# Install the CPU build of torch that the SGLang test stack needs (torch==2.13.0+cpu).
#
#   scripts/install_torch_cpu.sh                      # into `python` on PATH
#   PYTHON=/path/to/venv/bin/python scripts/install_torch_cpu.sh
#
# `2.13.0+cpu` exists only on the PyTorch CPU wheel index, never on PyPI (plain `torch` there
# is a multi-GB CUDA build). In order:
#   1. a torch 2.13.0+cpu already installed in $PYTHON is used as is;
#   2. one pip finds with its own settings (pip.conf, PIP_FIND_LINKS, a local mirror) is
#      installed from there;
#   3. otherwise it comes from the PyTorch CPU index, $MARU_TORCH_INDEX_URL
#      (default https://download.pytorch.org/whl/cpu; point it at a mirror), its
#      dependencies from pip's usual index.
# DRY_RUN=1 only says what it would install (pip --dry-run).
set -euo pipefail

PY="${PYTHON:-python}"
TORCH="torch==2.13.0+cpu"
INDEX="${MARU_TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}"
pip=("$PY" -m pip install --disable-pip-version-check)
[[ "${VERBOSE:-0}" == 1 ]] || pip+=(-q)
[[ "${DRY_RUN:-0}" == 1 ]] && pip+=(--dry-run)

say() { echo "[install_torch_cpu] $*"; }

if "$PY" -c 'import sys, torch; sys.exit(torch.__version__ != "2.13.0+cpu")' 2>/dev/null; then
    say "torch 2.13.0+cpu already installed"
    exit 0
fi
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
if "${pip[@]}" "$TORCH" >"$log" 2>&1; then
    cat "$log"
    say "torch 2.13.0+cpu found by pip's own settings"
    exit 0
fi
say "pip's own settings have no $TORCH; trying the PyTorch CPU index $INDEX"
if ! "${pip[@]}" --extra-index-url "$INDEX" "$TORCH"; then
    echo "--- the first attempt (pip's own settings) said:" >&2
    cat "$log" >&2
    say "cannot install $TORCH: set MARU_TORCH_INDEX_URL to a reachable PyTorch CPU index" >&2
    exit 1
fi
say "torch 2.13.0+cpu from $INDEX"
