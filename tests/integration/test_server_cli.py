"""`maru-server` as an operator meets it: every flag checked up front (one line, exit 2, never a
traceback), a restart with another --pool-size refused with the way out, `--purge`, and
nothing left behind by a start that fails."""

from __future__ import annotations

import hashlib
import os
import re
import socket
import subprocess
import uuid
from pathlib import Path

import pytest

import maru
from conftest import MaruServerProcess, maru_server_command, tmpfs_mounted  # tests/conftest.py
from maru import MaruHandler
from maru.common.poolmark import encode_mark
from maru.server import cli
from maru.server.cli import main


def run_server(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*maru_server_command(), *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def shm_pool() -> str:
    return f"/dev/shm/maru-test-{uuid.uuid4().hex}.pool"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--port", "70000"], "argument --port: must be from 0 to 65535, got 70000"),
        (["--port", "-5"], "argument --port: must be from 0 to 65535, got -5"),
        (["--metrics-port", "65536"], "argument --metrics-port: must be from 0 to 65535"),
        (["--pool", "/nonexistent/dir/x.pool"], "--pool: directory /nonexistent/dir does not"),
        (["--heartbeat-timeout", "0"], "argument --heartbeat-timeout: must be greater than 0"),
        (["--lease-timeout", "-1"], "argument --lease-timeout: must be greater than 0, got -1"),
        (["--snapshot-mb", "0"], "argument --snapshot-mb: must be greater than 0"),
        (["--journal-fsync-ms", "-1"], "argument --journal-fsync-ms: must be at least 0"),
        (["--busy-poll-us", "-1"], "argument --busy-poll-us: must be at least 0"),
        (["--busy-poll-us", "1.5"], "argument --busy-poll-us: expected a number at least 0"),
        (["--coherence", "sometimes"], "argument --coherence: invalid choice: 'sometimes'"),
        (["--index-slots", "1000"], "--index-slots: '1000' is not 0, auto or a power of two"),
        (["--index-slots", "many"], "--index-slots: 'many' is not 0, auto or a power of two"),
        (["--eviction-high-watermark", "1.5"], "must be above 0 and at most 1, got 1.5"),
        (["--eviction-low-watermark", "0"], "--eviction-low-watermark: must be above 0 and at"),
        (
            ["--eviction-low-watermark", "0.9", "--eviction-high-watermark", "0.8"],
            "--eviction-low-watermark 0.9 is above --eviction-high-watermark 0.8",
        ),
        (["--pool-size", "512"], "--pool-size: 512 is smaller than one region (2.0 MiB"),
        (["--pool-size", "lots"], "--pool-size: expected a size like"),
        (["--pool-group", "no-such-group-here"], "--pool-group: no group named"),
        (["--ready-file", "/nonexistent/dir/ready"], "--ready-file: directory /nonexistent/dir"),
        (["--local-socket", "/nonexistent/dir/s.sock"], "--local-socket: directory /nonexistent"),
        (["--curve-clients", "/tmp"], "--curve-clients needs --curve"),
        (["--local-uids", "1000,no-such-user-here"], "--local-uids: no user named"),
        (["--curve", "--curve-clients", "/nonexistent/keys"], "--curve-clients: [Errno 2]"),
        (["--curve", "--curve-clients", "/dev/null"], "--curve-clients: no client key in"),
        (["--pool", "/etc/hostname/x.pool"], "--pool: /etc/hostname is a file, not a directory"),
    ],
)
def test_every_bad_flag_is_one_line_and_exit_2(args, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        main([*args, "--state-dir", str(tmp_path / "state")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    first, *rest = err.splitlines()  # the error first, not after the usage of every flag
    assert first.startswith("maru-server: error: ") and message in first
    assert rest == ["(`maru-server --help` lists the options)"]
    assert "Traceback" not in err
    assert not (tmp_path / "state").exists()  # refused before anything was created


def test_bad_flag_from_the_console_script_has_no_traceback(tmp_path):
    proc = run_server("--port", "70000", "--state-dir", str(tmp_path / "state"))
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[0] == (
        "maru-server: error: argument --port: must be from 0 to 65535, got 70000"
    )
    assert "Traceback" not in proc.stderr


def test_a_pool_outside_tmpfs_gets_a_warning(maru_server_factory, tmp_path):
    on_disk = tmp_path / "disk.pool"  # tmp_path is on the root disk here, not tmpfs
    server = maru_server_factory(tmp_path / "srv", pool_size="16M", pool=str(on_disk))
    log = server.read_log()
    if "tmpfs" not in Path("/proc/mounts").read_text() or "is on tmpfs" in log:
        pytest.skip("tmp_path is on tmpfs here")
    assert f"pool {on_disk} is on " in log and "not tmpfs" in log


def _server_with_a_key(tmp_path: Path, pool: str) -> MaruServerProcess:
    server = MaruServerProcess(tmp_path, pool_size="64M", pool=pool).start()
    with MaruHandler(server_url=server.url, pool_size="4M") as h:
        assert h.store("kept", b"x" * 1000)
    server._terminate()  # stopped, the pool file and state stay
    return server


def test_restart_with_another_pool_size_is_refused_with_the_way_out(tmp_path):
    pool = shm_pool()
    server = _server_with_a_key(tmp_path, pool)
    try:
        state = str(server.state_dir)
        args = ["--port", "0", "--pool", pool, "--pool-size", "128M", "--state-dir", state]
        proc = run_server(*args)
        assert proc.returncode == 2
        line = proc.stderr.strip().splitlines()[-1]
        assert line.startswith(f"maru-server: cannot start: pool {pool} holds keys saved")
        # the sizes as the operator writes them
        assert "with --pool-size 64M (64.0 MiB), not 128M: start with --pool-size 64M to" in line
        assert "--no-restore" in line
        # nothing was changed: the old size still serves the key
        server.start()
        with MaruHandler(server_url=server.url, pool_size="4M") as h:
            assert bytes(h.retrieve("kept").view) == b"x" * 1000
        # --no-restore forces a fresh start with the new size
        server._terminate()
        server.pool_size = "128M"
        server.start(once_args=["--no-restore"])
        with MaruHandler(server_url=server.url, pool_size="4M") as h:
            assert h.stats()["pool"]["capacity"] == 128 << 20
            assert not h.exists("kept")
    finally:
        server.stop()


def test_purge_removes_the_pool_and_the_state(tmp_path):
    pool = shm_pool()
    server = _server_with_a_key(tmp_path, pool)
    state = server.state_dir
    try:
        assert Path(pool).exists() and (state / "secret.key").exists()
        server.start()
        running = run_server("--purge", "--pool", pool, "--state-dir", str(state))
        assert running.returncode == 1
        assert "cannot purge: state dir" in running.stderr and "in use by another" in running.stderr
        server._terminate()
        proc = run_server("--purge", "--pool", pool, "--state-dir", str(state))
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith(f"removed state dir {state} (")
        assert f"pool {pool} (64.0 MiB)" in proc.stdout
        assert not Path(pool).exists() and not state.exists()
        again = run_server("--purge", "--pool", pool, "--state-dir", str(state))
        assert (again.returncode, again.stdout.strip()) == (0, "nothing to purge")
    finally:
        server.stop()


def test_a_failed_start_leaves_no_pool_and_no_state(tmp_path):
    pool, state = shm_pool(), tmp_path / "state"
    # everything is created, then binding the port fails (not an address of this machine)
    proc = run_server(
        "--host", "192.0.2.1", "--port", "0", "--pool", pool, "--pool-size", "16M",
        "--state-dir", str(state),
    )  # fmt: skip
    assert proc.returncode == 1
    assert "maru-server: cannot start:" in proc.stderr
    assert not Path(pool).exists()
    assert not state.exists()


def test_version():
    proc = run_server("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"maru-server {maru.__version__}"


def test_a_state_dir_that_cannot_be_made_names_the_flag(tmp_path):
    pool = shm_pool()
    proc = run_server("--port", "0", "--pool", pool, "--pool-size", "16M", "--state-dir", "/proc/x")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        "maru-server: cannot start: --state-dir /proc/x: No such file or directory"
    )
    assert not Path(pool).exists()


def test_a_port_in_use_is_said_before_anything_is_created_or_logged(tmp_path):
    pool, state = shm_pool(), tmp_path / "state"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = run_server(
            "--port", str(port), "--pool", pool, "--pool-size", "16M", "--state-dir", str(state)
        )  # fmt: skip
    assert proc.returncode == 1
    assert proc.stderr == (
        f"maru-server: cannot start: --host 127.0.0.1 --port {port}: the port is in use "
        f"(another maru-server? `maru status --server 127.0.0.1:{port}`)\n"
    )  # the one line: nothing logged before it
    assert not Path(pool).exists() and not state.exists()


def test_the_readme_names_every_file_the_server_leaves_in_dev_shm(tmp_path):
    """Every file a running server (with a key stored and read) has beside its pool, and
    what a stop leaves, is in the README's "Where its state lives", by its pattern."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    pool = shm_pool()
    server = MaruServerProcess(tmp_path, pool_size="64M", pool=pool).start()
    try:
        with MaruHandler(server_url=server.url, pool_size="4M") as h:
            assert h.store("k", b"x" * 1000) and h.exists("k")
            running = sorted(p.name for p in Path("/dev/shm").glob(Path(pool).name + "*"))
        server._terminate()
        stopped = sorted(p.name for p in Path("/dev/shm").glob(Path(pool).name + "*"))
    finally:
        server.stop()
    assert len(running) == 3 and stopped == [Path(pool).name]  # the index goes at a clean stop
    for name in running:
        pattern = "<pool>" + re.sub(r"\.\d+", ".<n>", name[len(Path(pool).name) :])
        assert f"`{pattern}`" in readme, pattern


# -- what the pool path names: never destroyed unless it is a Maru pool of this user's -------


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _refused(proc: subprocess.CompletedProcess) -> str:
    """The one line a refused start ends with (exit 2, no traceback)."""
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    return proc.stderr.strip().splitlines()[-1]


def _start(pool: str, state: Path, *more: str) -> subprocess.CompletedProcess:
    return run_server(
        "--port", "0", "--pool", pool, "--pool-size", "16M", "--state-dir", str(state), *more,
        timeout=20,
    )  # fmt: skip


@pytest.mark.parametrize("content", ["text", "random-32M"])
def test_an_existing_file_that_is_not_a_maru_pool_is_refused_and_left_untouched(tmp_path, content):
    """Before, `--pool victim.txt` started, warned that the pool was truncated and left the
    file zeros (a file at least the capacity: unlinked and made anew)."""
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious\n" if content == "text" else os.urandom(32 << 20))
    before, state = _digest(victim), tmp_path / "state"
    line = _refused(_start(str(victim), state))
    assert line == (
        f"maru-server: cannot start: --pool {victim} exists and is not a Maru pool (no pool "
        "mark); remove it or choose another path"
    )
    assert _digest(victim) == before
    assert not state.exists()  # (this start's state went again)
    purged = run_server("--purge", "--pool", str(victim), "--state-dir", str(state))
    assert purged.returncode == 1 and "is not a Maru pool" in purged.stderr
    assert _digest(victim) == before  # `--purge` removes no such file either


def test_a_trailing_slash_on_a_file_is_refused_before_anything_is_touched(tmp_path):
    """Before, `--pool afile/` failed (File exists) and its undo unlinked `afile`."""
    afile, state = tmp_path / "afile", tmp_path / "state"
    afile.write_text("precious\n")
    for more in ((), ("--purge",)):
        proc = _start(f"{afile}/", state, *more)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        assert proc.stderr.splitlines()[0] == (
            f"maru-server: error: --pool: {afile}/ names a file, not a directory"
        )
        assert afile.read_text() == "precious\n"
        assert not state.exists()


@pytest.mark.parametrize("kind", ["shm", "shm-dangling", "fsdax"])
def test_a_symlink_at_the_pool_path_is_refused_and_its_target_untouched(tmp_path, kind):
    """Before, the server followed a link planted at the pool path and grew its target (a
    file of another user's, or root's) to the pool's size with NULs."""
    target, link, state = tmp_path / "target", tmp_path / "maru.pool", tmp_path / "state"
    if kind == "fsdax":
        target.mkdir()
    elif kind == "shm":
        target.write_text("root:x:0:0:not-really\n")
    link.symlink_to(target)

    def look() -> object:
        return (
            sorted(os.listdir(target)) if kind == "fsdax" else target.exists() and _digest(target)
        )

    before = look()
    line = _refused(_start(str(link) + ("/" if kind == "fsdax" else ""), state))
    assert line.startswith(
        f"maru-server: cannot start: --pool {link} is a symbolic link (to {target})"
    )
    assert look() == before
    assert link.is_symlink() and not state.exists()


@pytest.mark.parametrize("kind", ["shm", "fsdax"])
@pytest.mark.parametrize("how", ["another-user", "world-writable"])
def test_a_pool_path_of_another_user_or_writable_by_all_is_refused_untouched(tmp_path, kind, how):
    if how == "another-user" and os.geteuid() != 0:
        pytest.skip("makes a file of another user (needs root)")
    pool, state = tmp_path / "planted.pool", tmp_path / "state"
    if kind == "fsdax":
        pool.mkdir()
        (pool / "region-1.mem").write_bytes(b"theirs")
    else:
        # (even a pool mark is no reason)
        pool.write_bytes(encode_mark("g" * 16, "e" * 16, bytes(16)))
    os.chmod(pool, 0o777 if kind == "fsdax" else 0o666)
    if how == "another-user":
        os.chmod(pool, 0o755 if kind == "fsdax" else 0o644)
        os.chown(pool, 65534, 65534)
    before = sorted(os.listdir(pool)) if kind == "fsdax" else _digest(pool)
    line = _refused(_start(str(pool) + ("/" if kind == "fsdax" else ""), state))
    assert line.startswith(f"maru-server: cannot start: --pool {pool} ")
    if how == "another-user":
        assert "is owned by uid 65534" in line and "not by maru-server's user (uid" in line
    else:
        assert "is writable by every user (mode 777" in line or "(mode 666" in line
    assert (sorted(os.listdir(pool)) if kind == "fsdax" else _digest(pool)) == before
    assert os.stat(pool).st_uid == (65534 if how == "another-user" else os.geteuid())


@pytest.mark.parametrize(
    ("where", "message"),
    [("dir", "is a directory"), ("/proc/ready", "cannot write /proc/ready")],
)
def test_a_ready_file_that_cannot_be_written_is_refused_before_the_start(tmp_path, where, message):
    """Before, the server started fully, then died with a traceback writing the ready file."""
    ready = str(tmp_path) if where == "dir" else where
    pool, state = shm_pool(), tmp_path / "state"
    proc = _start(pool, state, "--ready-file", ready)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    first = proc.stderr.splitlines()[0]
    assert first.startswith("maru-server: error: --ready-file: ") and message in first
    assert not Path(pool).exists() and not state.exists()


def test_the_ready_file_appears_whole_or_not_at_all(tmp_path, monkeypatch):
    """A script (or this suite's harness) waits for `--ready-file` and reads it: it must never
    see the file empty or short. Before, the check at start made and removed the file itself,
    and the write truncated it in place: a poller read "" or lost it between `exists` and
    `read` (a harness start failed with FileNotFoundError)."""
    ready = tmp_path / "ready"
    made: list[str] = []
    real_open = os.open

    def recording_open(path, flags, *args):
        if flags & os.O_CREAT:
            made.append(os.fspath(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", recording_open)
    assert cli.ready_file_problem(str(ready)) is None
    monkeypatch.undo()
    assert str(ready) not in made and made and not ready.exists()
    ready.write_text("tcp://127.0.0.1:1")  # a stale one, from the last run
    stale = ready.stat().st_ino
    assert cli.write_ready_file(str(ready), "tcp://127.0.0.1:5555") is None
    assert ready.read_text() == "tcp://127.0.0.1:5555" and ready.stat().st_ino != stale
    assert os.listdir(tmp_path) == ["ready"]  # (nothing left beside it)


def test_a_ready_file_that_fails_once_serving_is_one_line_not_a_traceback(tmp_path):
    """The ready file's filesystem has room for its name, not its bytes (a full tmpfs): the
    write fails once the server serves; it says so in one line, and stops (exit 1)."""
    with tmpfs_mounted(tmp_path / "full", "4k") as mnt:
        (mnt / "filler").write_bytes(b"x" * 4096)
        with pytest.raises(OSError):
            (mnt / "probe").write_bytes(b"x" * 64)  # (full)
        (mnt / "probe").unlink(missing_ok=True)
        pool, state = shm_pool(), tmp_path / "state"
        proc = _start(pool, state, "--ready-file", str(mnt / "ready"))
        assert proc.returncode == 1 and "Traceback" not in proc.stderr
        assert proc.stderr.strip().splitlines()[-1] == (
            f"maru-server: cannot write --ready-file {mnt / 'ready'}: No space left on device"
        )
        assert not Path(pool).exists() and not state.exists()  # (nothing left behind)
