#!/usr/bin/env bash
# TTFT cold on instance 1 vs. the same prompt on instance 2, which loads instance 1's pages from
# Maru (a P2P hit). Passes when the speed-up is >= MIN_SPEEDUP (1.5) and instance 2's log shows
# `batch_get_v1 result: N/N hits` for every batch (all pages found).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
: "${PYTHON:=python3}"
: "${SGLANG_HOST:=127.0.0.1}"
: "${SGLANG_PORT_1:=30001}"
: "${SGLANG_PORT_2:=30002}"
: "${PROMPT_WORDS:=3000}"
: "${REPS:=3}"
: "${MIN_SPEEDUP:=1.5}"
: "${LOG_DIR:=$PWD/logs}"
exec "$PYTHON" "$here/../common/sglang_client.py" bench \
    --url "http://$SGLANG_HOST:$SGLANG_PORT_1" --url2 "http://$SGLANG_HOST:$SGLANG_PORT_2" \
    --words "$PROMPT_WORDS" --reps "$REPS" --min-speedup "$MIN_SPEEDUP" \
    --hit-log "$LOG_DIR/sglang-2.log" "$@"
