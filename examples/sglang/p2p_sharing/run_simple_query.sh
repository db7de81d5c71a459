#!/usr/bin/env bash
# Send a long prompt to instance 1, wait for its pages to reach Maru, send it to instance 2:
# instance 2 reports the prefix as storage hits and generates the same text.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
: "${PYTHON:=python3}"
: "${SGLANG_HOST:=127.0.0.1}"
: "${SGLANG_PORT_1:=30001}"
: "${SGLANG_PORT_2:=30002}"
: "${PROMPT_WORDS:=3000}"
exec "$PYTHON" "$here/../common/sglang_client.py" query \
    --url "http://$SGLANG_HOST:$SGLANG_PORT_1" --url2 "http://$SGLANG_HOST:$SGLANG_PORT_2" \
    --words "$PROMPT_WORDS" "$@"
