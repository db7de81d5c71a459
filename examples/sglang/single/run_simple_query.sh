#!/usr/bin/env bash
# Send a long prompt, flush the server's device and host caches, send it again: the second time
# its prefix comes from Maru (L3). Prints the cached tokens by tier.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
: "${PYTHON:=python3}"
: "${SGLANG_HOST:=127.0.0.1}"
: "${SGLANG_PORT:=30000}"
: "${PROMPT_WORDS:=3000}"
exec "$PYTHON" "$here/../common/sglang_client.py" query \
    --url "http://$SGLANG_HOST:$SGLANG_PORT" --words "$PROMPT_WORDS" "$@"
