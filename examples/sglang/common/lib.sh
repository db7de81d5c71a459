# Shared by the SGLang examples (sourced, not run). Every setting can be overridden from the
# environment; see the README of each example for the table.
#
# Processes are started in their own session (setsid), so `cleanup` can stop each one with all
# its children by process group, and only those this script started.

: "${PYTHON:=python3}"
: "${MODEL:=Qwen/Qwen2.5-7B-Instruct}"
: "${MARU_HOST:=127.0.0.1}"
: "${MARU_PORT:=5555}"
: "${MARU_SERVER_POOL_SIZE:=32G}"
: "${MARU_POOL_SIZE:=8G}"
: "${MARU_EXTERNAL:=0}"
: "${SGLANG_HOST:=127.0.0.1}"
: "${PAGE_SIZE:=64}"
: "${HICACHE_RATIO:=2}"
: "${HICACHE_MEM_LAYOUT:=page_first_direct}"
: "${HICACHE_IO_BACKEND:=direct}"
: "${PREFETCH_THRESHOLD:=256}"
: "${SGLANG_EXTRA_ARGS:=}"
: "${START_TIMEOUT:=900}"
: "${LOG_DIR:=$PWD/logs}"

mkdir -p "$LOG_DIR"
STARTED_PGIDS=()
MARU_POOL_FILE=""
LAST_PID=""
# SGLang leaves files in /dev/shm behind; see cleanup.
SHM_BEFORE="$(ls /dev/shm 2>/dev/null || true)"

log() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*"; }
die() { log "ERROR: $*" >&2; exit 1; }

maru_server_bin() {
    local beside
    beside="$(dirname "$(command -v "$PYTHON")")/maru-server"
    if [ -x "$beside" ]; then echo "$beside"; else command -v maru-server || echo ""; fi
}

check_installed() {
    "$PYTHON" -c "import sglang, maru_sglang.maru_storage" 2>/dev/null || die \
        "SGLang and Maru must be importable by $PYTHON (pip install -e <maru repo> in SGLang's environment)"
    [ -n "$(maru_server_bin)" ] || die "maru-server not found next to $PYTHON nor on PATH"
}

# The documented contract: how SGLang's dynamic backend factory loads MaruStorage.
maru_extra_config() {
    printf '{"backend_name": "maru", "module_path": "maru_sglang.maru_storage", '
    printf '"class_name": "MaruStorage", "interface_v1": 1, '
    printf '"maru_server_url": "tcp://%s:%s", "maru_pool_size": "%s", "prefetch_threshold": %s}' \
        "$MARU_HOST" "$MARU_PORT" "$MARU_POOL_SIZE" "$PREFETCH_THRESHOLD"
}

start_maru_server() {
    if [ "$MARU_EXTERNAL" = "1" ]; then
        log "using the maru-server already running at tcp://$MARU_HOST:$MARU_PORT"
        return
    fi
    local ready="$LOG_DIR/maru-server.ready"
    MARU_POOL_FILE="/dev/shm/maru-example-$MARU_PORT.pool"
    rm -f "$ready"
    setsid "$(maru_server_bin)" --host "$MARU_HOST" --port "$MARU_PORT" \
        --pool "$MARU_POOL_FILE" --pool-size "$MARU_SERVER_POOL_SIZE" \
        --state-dir "$LOG_DIR/maru-state" --ready-file "$ready" --no-restore \
        >"$LOG_DIR/maru-server.log" 2>&1 &
    local pid=$!
    STARTED_PGIDS+=("$pid")
    for _ in $(seq 150); do
        [ -s "$ready" ] && break
        kill -0 "$pid" 2>/dev/null || { cat "$LOG_DIR/maru-server.log" >&2; die "maru-server exited"; }
        sleep 0.1
    done
    [ -s "$ready" ] || die "maru-server not ready after 15 s (log: $LOG_DIR/maru-server.log)"
    log "maru-server (pid $pid) at $(cat "$ready"), pool $MARU_POOL_FILE ($MARU_SERVER_POOL_SIZE)"
}

# start_sglang NAME PORT [GPU_IDS]: one SGLang server with Maru as HiCache L3, in the background.
start_sglang() {
    local name="$1" port="$2" gpus="${3:-}"
    local logf="$LOG_DIR/$name.log"
    local -a cmd=(
        "$PYTHON" -m sglang.launch_server --model-path "$MODEL"
        --host "$SGLANG_HOST" --port "$port" --page-size "$PAGE_SIZE"
        --enable-hierarchical-cache --hicache-ratio "$HICACHE_RATIO"
        --hicache-io-backend "$HICACHE_IO_BACKEND" --hicache-mem-layout "$HICACHE_MEM_LAYOUT"
        --hicache-storage-backend dynamic
        --hicache-storage-backend-extra-config "$(maru_extra_config)"
    )
    # shellcheck disable=SC2206  # word splitting of the extra args is intended
    cmd+=($SGLANG_EXTRA_ARGS)
    echo "\$ ${cmd[*]}" >"$logf"
    if [ -n "$gpus" ]; then
        CUDA_VISIBLE_DEVICES="$gpus" setsid "${cmd[@]}" >>"$logf" 2>&1 &
    else
        setsid "${cmd[@]}" >>"$logf" 2>&1 &
    fi
    LAST_PID=$!
    STARTED_PGIDS+=("$LAST_PID")
    log "$name: SGLang (pid $LAST_PID${gpus:+, GPUs $gpus}) starting on port $port, log $logf"
}

# wait_healthy NAME PORT PID: until GET /health is 200 (SGLang's warm-up request is done then).
wait_healthy() {
    local name="$1" port="$2" pid="$3"
    local deadline=$((SECONDS + START_TIMEOUT))
    until "$PYTHON" - "$SGLANG_HOST" "$port" <<'EOF' 2>/dev/null
import sys, urllib.request
urllib.request.urlopen(f"http://{sys.argv[1]}:{sys.argv[2]}/health", timeout=5)
EOF
    do
        [ $SECONDS -lt $deadline ] || die "$name not healthy after ${START_TIMEOUT}s (log: $LOG_DIR/$name.log)"
        kill -0 "$pid" 2>/dev/null || { tail -n 30 "$LOG_DIR/$name.log" >&2; die "$name exited (log: $LOG_DIR/$name.log)"; }
        sleep 2
    done
    grep -q "MaruStorage connected" "$LOG_DIR/$name.log" ||
        log "WARNING: $name's log does not show 'MaruStorage connected'"
    log "$name ready at http://$SGLANG_HOST:$port"
}

# Stop what this script started: SIGTERM to each leader (SGLang's launcher then stops its
# scheduler and detokenizer itself), up to 30 s for the whole group to end, then SIGKILL to the
# group. Then remove the pool file and the /dev/shm files SGLang leaves behind
# (sglang_loads_*, sem.mp-*) that appeared while this script ran.
cleanup() {
    local pg f
    for pg in "${STARTED_PGIDS[@]}"; do
        kill -TERM "$pg" 2>/dev/null || true
    done
    for pg in "${STARTED_PGIDS[@]}"; do
        for _ in $(seq 150); do kill -0 -- "-$pg" 2>/dev/null || break; sleep 0.2; done
        kill -KILL -- "-$pg" 2>/dev/null || true
    done
    wait 2>/dev/null || true
    STARTED_PGIDS=()
    [ -n "$MARU_POOL_FILE" ] && rm -f "$MARU_POOL_FILE"
    for f in /dev/shm/sglang_loads_* /dev/shm/sem.mp-*; do
        [ -e "$f" ] || continue
        grep -qxF "$(basename "$f")" <<<"$SHM_BEFORE" || rm -f "$f"
    done
    true
}
