"""The three areas stay apart: the server never loads client code (or numpy), and the client's
public names still come from `import maru`."""

from __future__ import annotations

import json
import subprocess
import sys

CLIENT_MODULES = ("maru.client", "maru.client.handler", "maru.client.rpc", "numpy")


def _loaded_after(statement: str) -> set[str]:
    code = f"import sys\n{statement}\nimport json; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_the_server_loads_no_client_module_and_no_numpy():
    loaded = _loaded_after("import maru.server.service, maru.server.cli")
    assert "maru.server.service" in loaded
    assert not loaded & set(CLIENT_MODULES), sorted(loaded & set(CLIENT_MODULES))


def test_public_names_load_on_first_use():
    loaded = _loaded_after("from maru import MaruConfig, MaruHandler, MaruAdmin, __version__")
    assert {"maru.client.handler", "maru.common.config"} <= loaded
