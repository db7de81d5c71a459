#!/usr/bin/env bash
# Two SGLang servers sharing KV through Maru (GPU host): instance 2 loads the prefixes that
# instance 1 computed, from the shared memory pool, instead of recomputing them.
#
#   bash p2p_example.sh             # maru-server + two SGLang servers, stays in the foreground
#   bash run_simple_query.sh        # in another terminal: a prompt on 1, then on 2
#   bash run_benchmark.sh           # TTFT cold on 1 vs. P2P hit on 2
#
# Ctrl-C stops all three and removes the shared-memory pool. Settings: see README.md.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
: "${SGLANG_PORT_1:=30001}"
: "${SGLANG_PORT_2:=30002}"
: "${GPU_1=0}"
: "${GPU_2=1}"
# shellcheck source=../common/lib.sh
source "$here/../common/lib.sh"
trap cleanup EXIT
trap 'exit 130' INT TERM

check_installed
start_maru_server
start_sglang sglang-1 "$SGLANG_PORT_1" "$GPU_1"
pid1=$LAST_PID
wait_healthy sglang-1 "$SGLANG_PORT_1" "$pid1"
start_sglang sglang-2 "$SGLANG_PORT_2" "$GPU_2"
pid2=$LAST_PID
wait_healthy sglang-2 "$SGLANG_PORT_2" "$pid2"
log "ready. In another terminal: bash $here/run_simple_query.sh (Ctrl-C here stops everything)"
wait -n "$pid1" "$pid2"
log "a server exited; stopping"
