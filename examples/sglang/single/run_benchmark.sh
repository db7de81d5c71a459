#!/usr/bin/env bash
# TTFT with and without L3 hits on one server: cold, then the same prompt after /flush_cache
# (loaded from Maru). Passes when the speed-up is >= MIN_SPEEDUP (1.5) and the server's log
# shows only full batch_get_v1 hits.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
: "${PYTHON:=python3}"
: "${SGLANG_HOST:=127.0.0.1}"
: "${SGLANG_PORT:=30000}"
: "${PROMPT_WORDS:=3000}"
: "${REPS:=3}"
: "${MIN_SPEEDUP:=1.5}"
: "${LOG_DIR:=$PWD/logs}"
exec "$PYTHON" "$here/../common/sglang_client.py" bench \
    --url "http://$SGLANG_HOST:$SGLANG_PORT" --words "$PROMPT_WORDS" --reps "$REPS" \
    --min-speedup "$MIN_SPEEDUP" --hit-log "$LOG_DIR/sglang.log" "$@"
