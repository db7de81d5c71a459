#!/usr/bin/env bash
# Build the wheel and the sdist of maru-kvcache, install each into a fresh venv (no editable
# install, no repository on sys.path) and smoke-test what was installed (scripts/smoke_installed.py:
# a real maru-server with --metrics-port, a store and a retrieve, `maru status`, --purge).
#
#   scripts/check_dist.sh          # `make dist-check`; CI (.ci/run) runs it
#   PYTHON=python3.11 scripts/check_dist.sh
#   KEEP=1 ...                     # keep the work dir (printed) for a look
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
work="$(mktemp -d "${TMPDIR:-/tmp}/maru-dist.XXXXXX")"
[[ "${KEEP:-0}" == 1 ]] && echo "[check_dist] work dir: $work" || trap 'rm -rf "$work"' EXIT
pip=(--disable-pip-version-check -q)
start=$SECONDS

"$PY" -m venv "$work/tools"
"$work/tools/bin/pip" install "${pip[@]}" build
# The sdist from the checkout, then the wheel from the sdist: what a user gets either way.
"$work/tools/bin/python" -m build --outdir "$work/dist" "$root" >"$work/build.log" 2>&1 ||
    { cat "$work/build.log"; exit 1; }
wheel=("$work"/dist/maru_kvcache-*.whl)
sdist=("$work"/dist/maru_kvcache-*.tar.gz)
echo "[check_dist] built $(basename "${wheel[0]}") and $(basename "${sdist[0]}")"

for artifact in "${wheel[0]}" "${sdist[0]}"; do
    venv="$work/venv-$(basename "$artifact" | sed 's/[^A-Za-z0-9]/_/g')"
    "$PY" -m venv "$venv"
    "$venv/bin/pip" install "${pip[@]}" "$artifact"
    # from a directory outside the checkout, so that only the installed package can be found
    (cd "$work" && "$venv/bin/python" "$root/scripts/smoke_installed.py" "$(basename "$artifact")")
done
echo "[check_dist] ok in $((SECONDS - start)) s"
