"""Red-team inputs to the `maru` and `maru-server` executables that they used to take silently,
crash on or hang on, each now one line on stderr and exit 2, no traceback:

- `maru --server ""` (a script's unset `$URL`) talked to the default server, localhost:5555,
  and `--server-public-key ""` / `--curve-client-key ""` meant plain TCP / no client key;
- `maru --server-public-key FILE` with a binary FILE was a UnicodeDecodeError traceback, with
  a FIFO no one writes to a hang;
- `maru-server --pool ""`, `--state-dir ""`, `--ready-file ""` were taken as "not given" (the
  default pool in /dev/shm, the default state dir, no ready file).

Nothing here needs a running server: each input is refused before any connection."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import maru_server_command  # tests/conftest.py


def maru_command() -> list[str]:
    beside = Path(sys.executable).parent / "maru"
    if beside.exists():
        return [str(beside)]
    found = shutil.which("maru")
    return [found] if found else [sys.executable, "-m", "maru"]


def run(command: list[str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*command, *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=15,  # (a hang guard: each refusal comes before any connection)
    )


def assert_usage_error(proc: subprocess.CompletedProcess, message: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


@pytest.mark.parametrize(
    "args",
    [
        ["--server", "", "status"],
        ["--server", " ", "clear", "--yes"],
        ["status", "--server", ""],
        ["--server-public-key", "", "--server", "127.0.0.1:1", "status"],
        ["--curve-client-key", "", "--server", "127.0.0.1:1", "status"],
    ],
)
def test_an_empty_flag_is_refused_not_its_default(args):
    assert_usage_error(run(maru_command(), *args), "must not be empty")


def test_a_binary_key_file_is_one_line(tmp_path):
    path = tmp_path / "binary.key"
    path.write_bytes(bytes(range(256)))
    for flag in ("--server-public-key", "--curve-client-key"):
        proc = run(maru_command(), flag, str(path), "--server", "127.0.0.1:1", "status")
        assert_usage_error(proc, f"maru: {flag}: {str(path)!r} holds no CURVE key (not text)")


def test_a_fifo_key_file_no_one_writes_to_is_refused_not_waited_for(tmp_path):
    fifo = tmp_path / "key.fifo"
    os.mkfifo(fifo)
    proc = run(
        maru_command(), "--server-public-key", str(fifo), "--server", "127.0.0.1:1", "status"
    )
    assert_usage_error(proc, "a CURVE public key is 40 Z85 characters, got 0")


@pytest.mark.parametrize("flag", ["--pool", "--state-dir", "--ready-file"])
def test_an_empty_server_path_is_refused_before_the_port_is_tried(flag, tmp_path):
    with socket.socket() as taken:  # (before the fix: past the flags, "the port is in use")
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        args = {"--pool": str(tmp_path / "p.pool"), "--state-dir": str(tmp_path / "state")}
        args[flag] = ""
        flat = [item for pair in args.items() for item in pair]
        proc = run(maru_server_command(), "--port", port, "--pool-size", "4M", *flat)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines()[0] == (
        f"maru-server: error: {flag}: must not be empty (leave the flag out for its default)"
    )
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "state").exists() and not (tmp_path / "p.pool").exists()
