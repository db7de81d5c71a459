#!/usr/bin/env bash
# Maru P2P KV sharing between two real SGLang servers on CPU, in one command:
#
#   bash examples/sglang/cpu_p2p/run.sh        (about 1-2 minutes on 2 cores)
#
# Uses the repository's .venv (made by `make install`) if there is one, else `python3`;
# set PYTHON=... to choose another. Arguments go to p2p_demo.py (--prompt-tokens N, --keep-logs).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../../.." && pwd)"
if [ -z "${PYTHON:-}" ]; then
    if [ -x "$root/.venv/bin/python" ]; then PYTHON="$root/.venv/bin/python"; else PYTHON=python3; fi
fi
exec "$PYTHON" "$here/p2p_demo.py" "$@"
