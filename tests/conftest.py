"""Shared fixtures: a real `maru-server` process per test.

Reusable from any test module under tests/ (pytest loads this file for all of them):

    def test_something(maru_server):            # one server, stopped after the test
        h = MaruHandler(server_url=maru_server.url, pool_size="64M")

    def test_two(maru_server_factory, tmp_path):  # several servers, all stopped after the test
        a = maru_server_factory(tmp_path / "a", pool_size="256M")
        b = maru_server_factory(tmp_path / "b", pool=str(tmp_path / "fsdax"))

`start_maru_server(...)` is the same thing without the automatic teardown (call `.stop()`).
The server is the installed `maru-server` console script, started as a subprocess with
`--port 0`; its log (stderr) goes to `<dir>/maru-server.log` (`.read_log()`).
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

READY_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 5.0


def maru_server_command() -> list[str]:
    """The installed console script (next to this interpreter if possible)."""
    beside = Path(sys.executable).parent / "maru-server"
    if beside.exists():
        return [str(beside)]
    found = shutil.which("maru-server")
    if found:
        return [found]
    return [sys.executable, "-m", "maru.server"]  # same code, if the script is not on PATH


class MaruServerProcess:
    """A `maru-server` subprocess. `.url` is what `MaruHandler(server_url=...)` takes."""

    def __init__(
        self,
        workdir: Path,
        *,
        pool_size: str = "1G",
        extra_args: Sequence[str] = (),
        pool: str | None = None,
        host: str = "127.0.0.1",
    ):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.host = host
        self.pool_size = pool_size
        self.extra_args = tuple(extra_args)
        self.pool_path = pool or f"/dev/shm/maru-test-{uuid.uuid4().hex}.pool"
        self.state_dir = self.workdir / "state"
        self.ready_file = self.workdir / "ready"
        self.log_path = self.workdir / "maru-server.log"
        self.port = 0
        self.url = ""
        self.proc: subprocess.Popen | None = None
        self._log_file = None

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self, port: int | None = None, once_args: Sequence[str] = ()) -> MaruServerProcess:
        """Start (or start again) and wait for the ready file; raises if it never comes.
        `once_args` are extra flags for this start only (e.g. `--no-restore`)."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError("maru-server is already running")
        port = self.port if port is None else port
        self.ready_file.unlink(missing_ok=True)
        cmd = [
            *maru_server_command(),
            "--host",
            self.host,
            "--port",
            str(port),
            "--pool",
            self.pool_path,
            "--pool-size",
            str(self.pool_size),
            "--state-dir",
            str(self.state_dir),
            "--ready-file",
            str(self.ready_file),
            *self.extra_args,
            *once_args,
        ]
        self._log_file = open(self.log_path, "ab")  # noqa: SIM115 - closed in _terminate
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=self._log_file, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            text = self.ready_file.read_text().strip() if self.ready_file.exists() else ""
            if text.startswith("tcp://") and text.rsplit(":", 1)[-1].isdigit():
                break
            if self.proc.poll() is not None:
                self._close_log()
                raise RuntimeError(
                    f"maru-server exited with {self.proc.returncode} before it was ready:\n"
                    + self.read_log()
                )
            if time.monotonic() > deadline:
                self._terminate()
                raise RuntimeError(
                    f"maru-server not ready within {READY_TIMEOUT_S} s:\n" + self.read_log()
                )
            time.sleep(0.02)
        self.url = text
        self.port = int(text.rsplit(":", 1)[-1])
        return self

    def _terminate(self) -> int | None:
        proc, self.proc = self.proc, None
        rc = None
        if proc is not None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(STOP_TIMEOUT_S)
            rc = proc.returncode
        self._close_log()
        return rc

    def _close_log(self) -> None:
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def halt(self) -> int | None:
        """SIGTERM, then SIGKILL after 5 s, leaving the pool where it is (for a server that
        starts on it next). Returns the exit code."""
        return self._terminate()

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after 5 s; removes the pool. Returns the exit code."""
        rc = self._terminate()
        self.remove_pool()
        return rc

    def restart(self, once_args: Sequence[str] = ()) -> MaruServerProcess:
        """Stop (SIGTERM) and start again on the same port, pool file and state dir, so
        whatever the server persists there survives; `once_args` apply to the new run only."""
        self._terminate()
        return self.start(self.port, once_args)

    def kill_and_start(self, no_restore: bool = False) -> MaruServerProcess:
        """SIGKILL (nothing flushed, nothing said to clients), then start again with the same
        arguments on the same port, pool and state dir; `no_restore`: once with `--no-restore`
        (a new pool generation, every key gone)."""
        assert self.proc is not None
        self.proc.kill()
        assert self.proc.wait(10) == -signal.SIGKILL
        self.halt()  # (dead already: closes its log)
        return self.start(self.port, ["--no-restore"] if no_restore else [])

    def remove_pool(self) -> None:
        path = Path(self.pool_path)
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
            for index_file in path.parent.glob(path.name + ".index.*"):  # a killed server's
                index_file.unlink(missing_ok=True)

    # -- helpers -----------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def read_log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def __enter__(self) -> MaruServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"MaruServerProcess(url={self.url!r}, pool={self.pool_path!r}, pid={self.pid})"


def start_maru_server(
    tmp_path: Path,
    pool_size: str = "1G",
    extra_args: Sequence[str] = (),
    *,
    pool: str | None = None,
) -> MaruServerProcess:
    """Launch the real `maru-server` on 127.0.0.1 with a free port and a unique /dev/shm pool
    (or `pool`: a directory for fsdax). The caller must `.stop()` it (or use `with`)."""
    server = MaruServerProcess(tmp_path, pool_size=pool_size, extra_args=extra_args, pool=pool)
    try:
        return server.start()
    except BaseException:
        server.stop()
        raise


@contextlib.contextmanager
def tmpfs_mounted(mnt: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` (mount's form: "4m", "4k") mounted at `mnt`, made here (needs root:
    the test is skipped, with the reason, where mount fails); unmounted after."""
    mnt.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def maru_server_factory(tmp_path: Path) -> Iterator:
    """`factory(workdir=None, pool_size="1G", extra_args=(), pool=None)`; all stopped after."""
    servers: list[MaruServerProcess] = []

    def factory(
        workdir: Path | None = None,
        pool_size: str = "1G",
        extra_args: Sequence[str] = (),
        *,
        pool: str | None = None,
    ) -> MaruServerProcess:
        workdir = workdir or tmp_path / f"server{len(servers)}"
        server = MaruServerProcess(workdir, pool_size=pool_size, extra_args=extra_args, pool=pool)
        servers.append(server)
        return server.start()

    yield factory
    for server in servers:
        server.stop()


@pytest.fixture(scope="module", autouse=True)
def sglang_runtime_context_per_module() -> Iterator[None]:
    """SGLang's runtime context as it was before each module, again after it. A module that
    publishes ServerArgs (as a scheduler process does) changes what every later pool built in
    this process reads: its KV namespace names the published weights, so a leaked context
    made a later module's reader and its writer child disagree (all misses). Modules that
    never import SGLang pay nothing here."""
    name = "sglang.srt.runtime_context"
    before = sys.modules[name].snapshot_context() if name in sys.modules else None
    yield
    context = sys.modules.get(name)
    if context is None:
        return
    if before is None:
        context.reset_context()
    else:
        context.restore_context(before)


@pytest.fixture
def maru_server(tmp_path: Path) -> Iterator[MaruServerProcess]:
    """One `maru-server` (1 GiB sparse pool in /dev/shm), stopped and removed after the test."""
    server = start_maru_server(tmp_path / "maru-server")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def shm_name() -> Iterator[str]:
    """A unique /dev/shm path, removed after the test."""
    path = f"/dev/shm/maru-test-{uuid.uuid4().hex}"
    try:
        yield path
    finally:
        p = Path(path)
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


_COPIER = None  # ctypes' prototype of `_memcopy.c`'s copy_values_run (built on first use)


@pytest.fixture
def fused_copier() -> Iterator:
    """`make(before_copy)` -> a copier for the local index's fused read (`Reader.read`'s
    `copier`, `maru.client.localindex.COPY_VALUES`) that first calls `before_copy()`, between
    the read's probe and its check, where Python cannot otherwise reach (a test's fault goes
    there: a delete, a restart, a flipped byte), then copies as the real one does (through
    `copy_values`). An exception in `before_copy` fails the test at teardown."""
    import ctypes

    import numpy as np

    from maru.common.memcopy import CopyFaultError, copy_values
    from maru.common.memcopy import faulted as memcopy_faulted

    global _COPIER
    if _COPIER is None:
        vp, size = ctypes.c_void_p, ctypes.c_ssize_t
        c_int = ctypes.c_int
        _COPIER = ctypes.CFUNCTYPE(size, vp, vp, vp, size, size, c_int, c_int, vp, c_int, vp)
    new_capsule = ctypes.pythonapi.PyCapsule_New
    new_capsule.restype = ctypes.py_object
    new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    name = b"maru.copy_values_threads.2"  # (the capsule keeps a pointer to it: it lives on here)
    kept, errors = [], []

    def array(address, n):
        return np.ctypeslib.as_array((ctypes.c_int64 * n).from_address(address)) if n else []

    def make(before_copy):
        def run(
            starts, buffers, sizes, values, parts, to_values, streaming, hashes, threads, faulted
        ):
            try:
                before_copy()
            except BaseException as exc:  # (a ctypes callback cannot raise)
                errors.append(exc)
            starts_, sizes_ = np.array(array(starts, values)), np.array(array(sizes, parts))
            rows = np.array(array(buffers, values * parts)).reshape(values, parts)
            try:
                sums = copy_values(
                    starts_,
                    rows,
                    sizes_,
                    to_values=bool(to_values),
                    hashed=bool(hashes),
                    threads=threads,
                )
            except CopyFaultError as exc:  # (flagged per value, as the real one does)
                lost = memcopy_faulted(exc)
                ctypes.memmove(faulted, lost.astype(np.uint8).ctypes.data, values)
                return int(lost.sum())
            if hashes:
                array(hashes, values)[:] = sums
            return 0

        callback = _COPIER(run)
        kept.append(callback)
        return new_capsule(ctypes.cast(callback, ctypes.c_void_p), name, None)

    yield make
    if errors:
        raise errors[0]
