#!/usr/bin/env bash
# Install Mooncake Store's CPU wheel into the current Python environment, and the three system
# libraries its store.so links even for TCP (libibverbs1, libnl-3-200, libnl-route-3-200)
# unpacked into a private folder: no system package is installed or changed.
#
#   scripts/install_mooncake_cpu.sh            # uses `python` on PATH (e.g. an activated venv)
#   PYTHON=/path/to/venv/bin/python scripts/install_mooncake_cpu.sh
#
# The libraries go to $MARU_MOONCAKE_LIBS (default: <venv>/mooncake-libs); the cluster tier
# (src/maru/server/cluster/mooncake.py) preloads them from there before importing
# mooncake.store, so neither maru-server nor the tests need LD_LIBRARY_PATH. Needs apt-get
# (Debian/Ubuntu); where the libraries are already installed system-wide, it only checks.
# Idempotent: re-running only checks that everything is already there.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
req="$(cd "$here/../requirements" && pwd)"
PY="${PYTHON:-python}"
pip=("$PY" -m pip install --disable-pip-version-check)
[[ "${VERBOSE:-0}" == 1 ]] || pip+=(-q)
libs="${MARU_MOONCAKE_LIBS:-$("$PY" -c 'import sys; print(sys.prefix)')/mooncake-libs}"
debs=(libibverbs1 libnl-3-200 libnl-route-3-200)

start=$SECONDS
"${pip[@]}" --no-deps -r "$req/mooncake-cpu.txt"

if [[ ! -e "$libs/.installed" ]]; then
    if ldconfig -p | grep -q 'libibverbs.so.1 ' && ldconfig -p | grep -q 'libnl-route-3.so.200 '; then
        echo "[install_mooncake_cpu] the libraries are installed system-wide"
    else
        tmp="$(mktemp -d)"
        trap 'rm -rf "$tmp"' EXIT
        # apt-get download needs the package lists; update them once if they are empty.
        if ! apt-cache show "${debs[0]}" >/dev/null 2>&1; then apt-get update -qq; fi
        (cd "$tmp" && apt-get download -qq -o APT::Sandbox::User=root "${debs[@]}")
        mkdir -p "$libs"
        for deb in "$tmp"/*.deb; do dpkg-deb -x "$deb" "$tmp/root"; done
        # Keep only the shared objects, flat: the tier preloads them by path.
        find "$tmp/root" -name '*.so*' \( -type f -o -type l \) -exec cp -a {} "$libs/" \;
    fi
    touch "$libs/.installed"
fi

# Sanity: the store client imports and mooncake_master is there.
MARU_MOONCAKE_LIBS="$libs" "$PY" - <<'PYEOF'
from maru.server.cluster.mooncake import load_mooncake, master_binary
store = load_mooncake()
print(f"[install_mooncake_cpu] ok: {store.__name__}, master {master_binary()}")
PYEOF
echo "[install_mooncake_cpu] done in $((SECONDS - start)) s"
