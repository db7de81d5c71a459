"""A restart on odd on-disk state, and the operator CLIs on odd input: a hit is still the bytes
written under its key (or a miss), and an operator gets one line, never a traceback or a hang.

Real `maru-server` processes and real handlers; values carry a checksum bound to their key
(`make_value`), so a read of another key's bytes or of zeros counts as wrong.
"""

from __future__ import annotations

import errno
import io
import os
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from conftest import MaruServerProcess, maru_server_command  # tests/conftest.py (on sys.path)
from maru.client import cli as maru_cli

from .test_crash_safety import KiB, handler, make_value, sigkill_server
from .test_pool_trust import read_counts


@pytest.mark.parametrize("how", ["deleted", "short"])
def test_an_fsdax_region_file_lost_while_down_is_not_restored(tmp_path, how):
    """The fsdax directory and its mark are the pool's, but one region's file went while the
    server was down (`rm pool/*` leaves the dot files: the mark still matches) or was cut
    short. Before: its keys were restored; `exists` said True, a lease raised
    FileNotFoundError, and a short file made every new handler's constructor raise
    ValueError (mmap past the end). Now its keys are misses; the other region's keys, whose
    file is intact, are restored; no region id is handed out again."""
    pool = str(tmp_path / "fsdax") + "/"
    server = MaruServerProcess(tmp_path / "srv", pool_size="64M", pool=pool).start()
    try:
        lost = handler(server.url, pool_size="2M", timeout_ms=1000)
        kept = handler(server.url, pool_size="2M", timeout_ms=1000)
        lost_keys = [f"lost-{i}" for i in range(6)]
        kept_keys = [f"kept-{i}" for i in range(6)]
        for h, keys in ((lost, lost_keys), (kept, kept_keys)):
            assert h.batch_store(keys, [make_value(k, 60 * KiB) for k in keys]) == [True] * 6
        (lost_region,) = lost.owned_region_ids()
        lost.close()
        kept.close()
        sigkill_server(server)
        region_file = Path(pool) / f"region-{lost_region}.mem"
        if how == "deleted":
            region_file.unlink()
        else:
            os.truncate(region_file, region_file.stat().st_size // 2)
        server.start(server.port)
        assert f"region {lost_region}: its file" in server.read_log()
        reader = handler(server.url, timeout_ms=1000)  # (before, "short": ValueError here)
        assert reader.batch_exists(lost_keys) == [False] * 6
        assert read_counts(reader, lost_keys) == (0, 6, 0)
        assert read_counts(reader, kept_keys) == (6, 0, 0)
        writer = handler(server.url, pool_size="2M", timeout_ms=1000)
        assert writer.store("after", make_value("after", 60 * KiB))
        assert all(rid > lost_region for rid in writer.owned_region_ids())
        assert read_counts(reader, ["after"]) == (1, 0, 0)
        writer.close()
        reader.close()
    finally:
        server.stop()


def _start_and_stop(tmp_path: Path, *flags: str) -> tuple[subprocess.CompletedProcess, str]:
    """Start `maru-server` with `flags` (its own pool and state), wait (bounded) for it to be
    ready or exit, then SIGTERM it; (the finished process, its pool path)."""
    pool = f"/dev/shm/maru-test-{uuid.uuid4().hex}.pool"
    ready = tmp_path / "ready"
    cmd = [
        *maru_server_command(),
        *("--port", "0", "--pool", pool, "--pool-size", "64M"),
        *("--state-dir", str(tmp_path / "state"), "--ready-file", str(ready), *flags),
    ]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(300):  # at most 15 s
            if ready.exists() or proc.poll() is not None:
                break
            time.sleep(0.05)
        proc.terminate()
        _, err = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate(timeout=10)
        err += "\n(did not stop on SIGTERM within 10 s)"
    finally:
        Path(pool).unlink(missing_ok=True)
        for index_file in Path(pool).parent.glob(Path(pool).name + ".index.*"):
            index_file.unlink(missing_ok=True)
    return subprocess.CompletedProcess(cmd, proc.returncode, "", err), pool


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--snapshot-mb", "inf"),  # before: OverflowError traceback, the pool file left behind
        ("--journal-fsync-ms", "inf"),  # before: the fsync thread died (OverflowError)
        ("--busy-poll-us", "99999999999999"),  # before: spun for ever, deaf to SIGTERM
        ("--heartbeat-timeout", "inf"),  # before: `maru status` broke once a client went
    ],
)
def test_a_flag_value_too_large_to_serve_with_is_refused_up_front(tmp_path, flag, value):
    proc, pool = _start_and_stop(tmp_path, flag, value)
    assert proc.returncode == 2, proc.stderr
    first = proc.stderr.splitlines()[0]
    assert first.startswith(f"maru-server: error: argument {flag}: must be"), proc.stderr
    assert "Traceback" not in proc.stderr
    assert not Path(pool).exists() and not (tmp_path / "state").exists()


class _FullDisk(io.StringIO):
    """An output whose writes fail as on a full file system."""

    def write(self, text: str) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("command", [["status"], ["stats", "--json"], ["keys", "--json"]])
def test_maru_output_that_cannot_be_written_is_one_line_not_a_traceback(
    maru_server, command, capsys
):
    """`maru keys --json > keys.json` on a full disk: before, OSError came out of `main` (a
    traceback from the console script)."""
    rc = maru_cli.main([*command, "--server", maru_server.url], out=_FullDisk())
    assert rc == 1
    err = capsys.readouterr().err
    assert "maru: cannot write the output" in err and "No space left on device" in err


def test_maru_to_a_full_device_from_the_console_script_has_no_traceback(maru_server):
    """The same through the installed `maru` script, its stdout on /dev/full."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    beside = Path(maru_server_command()[0]).parent / "maru"
    with open("/dev/full", "w") as full:
        proc = subprocess.run(
            [str(beside), "keys", "--json", "--server", maru_server.url],
            stdin=subprocess.DEVNULL,
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=30,
        )
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr
    assert "No space left on device" in proc.stderr


def test_ctrl_c_while_maru_waits_for_a_slow_server_is_one_line(tmp_path):
    """A port that accepts but never answers, a long --timeout-ms, and the operator presses
    Ctrl-C: before, a KeyboardInterrupt traceback out of ZeroMQ's send."""
    beside = Path(maru_server_command()[0]).parent / "maru"
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(15)
        port = listener.getsockname()[1]
        proc = subprocess.Popen(
            [str(beside), "status", "--server", f"127.0.0.1:{port}", "--timeout-ms", "60000"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        try:
            conn, _ = listener.accept()  # maru is in `main` now, waiting for a reply
            with conn:
                time.sleep(0.5)
                proc.send_signal(signal.SIGINT)
                _, err = proc.communicate(timeout=15)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "maru: interrupted" in err
