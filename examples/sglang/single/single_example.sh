#!/usr/bin/env bash
# One SGLang server with Maru as its HiCache L3 tier (GPU host).
#
#   bash single_example.sh          # starts maru-server + SGLang, stays in the foreground
#   bash run_simple_query.sh        # in another terminal: a prompt, /flush_cache, the prompt again
#   bash run_benchmark.sh           # TTFT cold vs. from L3
#
# Ctrl-C stops both servers and removes the shared-memory pool. Settings: see README.md.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
: "${SGLANG_PORT:=30000}"
: "${GPU=0}"
# shellcheck source=../common/lib.sh
source "$here/../common/lib.sh"
trap cleanup EXIT
trap 'exit 130' INT TERM

check_installed
start_maru_server
start_sglang sglang "$SGLANG_PORT" "$GPU"
wait_healthy sglang "$SGLANG_PORT" "$LAST_PID"
log "ready. In another terminal: bash $here/run_simple_query.sh (Ctrl-C here stops everything)"
wait "$LAST_PID"
