#!/usr/bin/env bash
# Start a maru-server, run writer.py and then reader.py as two separate processes, clean up.
#   bash examples/basic/run.sh            (uses `python3`; set PYTHON=... to choose another)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
PYTHON="${PYTHON:-python3}"
SERVER="${MARU_SERVER:-$(dirname "$(command -v "$PYTHON")")/maru-server}"
[ -x "$SERVER" ] || SERVER="maru-server"

tmp="$(mktemp -d)"
pool="/dev/shm/maru-example-$$.pool"
server_pid=""
cleanup() {
    if [ -n "$server_pid" ] && kill -0 "$server_pid" 2>/dev/null; then
        kill -TERM "$server_pid" 2>/dev/null || true
        for _ in $(seq 50); do kill -0 "$server_pid" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$server_pid" 2>/dev/null || true
    fi
    rm -f "$pool"
    rm -rf "$tmp"
}
trap cleanup EXIT

"$SERVER" --host 127.0.0.1 --port 0 --pool "$pool" --pool-size 256M \
    --state-dir "$tmp/state" --ready-file "$tmp/ready" 2>"$tmp/server.log" &
server_pid=$!
for _ in $(seq 150); do
    [ -s "$tmp/ready" ] && break
    kill -0 "$server_pid" 2>/dev/null || { cat "$tmp/server.log"; exit 1; }
    sleep 0.1
done
[ -s "$tmp/ready" ] || { echo "maru-server did not start"; cat "$tmp/server.log"; exit 1; }
url="$(cat "$tmp/ready")"
echo "maru-server (pid $server_pid) listening on $url, pool $pool"

"$PYTHON" "$here/writer.py" "$url"
"$PYTHON" "$here/reader.py" "$url"
