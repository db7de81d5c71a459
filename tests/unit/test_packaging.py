"""The distribution as a user installs it: its own name (`maru` on PyPI is another project),
the import names SGLang and LMCache use, metrics as installed, and CI building and
smoke-testing the wheel and the sdist (scripts/check_dist.sh does the real install)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[2]


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_the_distribution_has_a_name_of_its_own_and_metrics_as_a_dependency():
    p = project()
    assert p["name"] == "maru-kvcache"
    assert any(d.startswith("prometheus-client") for d in p["dependencies"])
    assert p["scripts"] == {"maru-server": "maru.server.cli:main", "maru": "maru.client.cli:main"}
    for package in ("maru", "maru_sglang"):  # import names: unchanged
        assert (ROOT / "src" / package / "__init__.py").exists()


def test_ci_builds_and_smoke_tests_the_wheel_and_the_sdist():
    assert "make dist-check" in (ROOT / ".ci" / "run").read_text()
    assert "scripts/check_dist.sh" in (ROOT / "Makefile").read_text()
    script = (ROOT / "scripts" / "check_dist.sh").read_text()
    assert "-m build" in script and "smoke_installed.py" in script


def test_an_install_without_a_c_compiler_fails_in_one_clear_line(tmp_path):
    """The C extensions are required (no pure-Python stand-ins): setup.py's build_ext, run for
    real with `CC` naming a compiler that is not there, stops before compiling anything with
    one line that says what to install, not a compiler's traceback."""
    missing = tmp_path / "no-such-cc"
    dirs = ["--build-lib", str(tmp_path / "lib"), "--build-temp", str(tmp_path / "tmp")]
    proc = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", *dirs],
        cwd=ROOT,
        env={**os.environ, "CC": str(missing)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "error: maru-kvcache needs a C compiler (gcc or clang) and the Python headers to build "
        f"its extensions: the compiler '{missing}' was not found."
    ), proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "lib").exists()  # nothing built


def test_the_readme_installs_what_its_commands_need():
    readme = (ROOT / "README.md").read_text()
    assert "maru-kvcache" in readme
    assert "MARU_TORCH_INDEX_URL" in readme
    assert "maru[metrics]" not in readme


def test_the_readme_states_the_true_default_pool_and_maps_every_doc():
    from maru.common.config import fmt_bytes, parse_size
    from maru.server.cli import build_parser

    readme = (ROOT / "README.md").read_text()
    default = build_parser().get_default("pool_size")
    assert f"{fmt_bytes(parse_size(default)).replace('.0', '')} unless --pool-size" in readme
    for doc in sorted((ROOT / "docs").glob("*.md")):
        assert f"](docs/{doc.name})" in readme, f"README's map omits docs/{doc.name}"
    for line in readme.splitlines():  # every `maru-server` line in it parses
        if line.startswith("maru-server "):
            build_parser().parse_args(line.split("#")[0].rstrip(" &").split()[1:])
