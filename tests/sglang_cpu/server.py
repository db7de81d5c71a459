"""Launch and stop a real ``python -m sglang.launch_server`` on CPU (tests only).

Typical use (pytest)::

    from sglang_cpu.server import running_server, generate, flush_cache

    with running_server(model_dir, extra_args=[...], env={...}) as srv:
        out = generate(srv.base_url, "some prompt", max_new_tokens=8)

Everything is bounded in time. The server runs in its own session / process group, so
:func:`stop_server` can end the launcher and every process it spawned (scheduler, detokenizer,
multiprocessing resource tracker) by that group id. It then removes the ``/dev/shm`` files
SGLang leaves behind (``sglang_loads_*``, ``sem.mp-*``) that appeared while the server ran.
SGLang also creates its ZMQ IPC sockets with ``tempfile`` and never removes them, so each server
gets a private ``TMPDIR`` that is deleted when it stops.
The server's output goes to a log file (:attr:`SGLangServer.log_path`, kept after the stop),
whose tail is put into every error raised here.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from . import sglang_env

SHM_DIR = Path("/dev/shm")
# Files SGLang / multiprocessing leave in /dev/shm when a server is stopped.
SHM_LEFTOVER_PREFIXES = ("sglang_loads_", "sem.mp-")
SHM_STAMPED_PREFIX = "sgl_shm_"  # and the creator's pid in the name: see cleanup_shm

DEFAULT_START_TIMEOUT = 300.0  # measured ~30 s on an idle 2-core box; leave room for load
DEFAULT_STOP_TIMEOUT = 30.0


class ServerError(RuntimeError):
    pass


class PortTaken(ServerError):
    """The HTTP port `free_port` picked was taken by another process before the server bound
    it (uvicorn then logs the error and may hang in its shutdown instead of exiting)."""


class ModuleVanished(ServerError):
    """A server process failed to import an SGLang module that is installed: the environment
    failed it (seen once in CI on a loaded machine, a lazy import of a file on disk), not the
    code under test, which never ran that far differently. It starts again, like PortTaken."""


PORT_TAKEN = "address already in use"
START_ATTEMPTS = 3  # a server whose port was taken meanwhile starts again on another
_NO_MODULE = re.compile(r"ModuleNotFoundError: No module named '(sglang\.[\w.]+)'")


def _installed_module_missed(log_tail: str) -> str | None:
    """The SGLang module the log says could not be imported, if its file is installed (looked
    up on disk: importing SGLang here would need the CPU shims)."""
    top = importlib.util.find_spec("sglang")
    roots = [Path(p) for p in (top.submodule_search_locations or [])] if top else []
    for name in _NO_MODULE.findall(log_tail):
        rel = Path(*name.split(".")[1:])
        for root in roots:
            if (root / rel).with_suffix(".py").is_file() or (root / rel).is_dir():
                return name
    return None


@dataclass
class SGLangServer:
    process: subprocess.Popen
    host: str
    port: int
    log_path: Path
    startup_seconds: float = 0.0
    tmp_dir: Path | None = None
    shm_before: frozenset[str] = field(default_factory=frozenset, repr=False)
    _log_file: object = field(default=None, repr=False)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "<no log>"
        return "\n".join(text.splitlines()[-lines:])


def free_port(host: str = "127.0.0.1") -> int:
    """An ephemeral TCP port that is free right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _shm_snapshot() -> frozenset[str]:
    try:
        return frozenset(p.name for p in SHM_DIR.iterdir())
    except OSError:
        return frozenset()


def http_request(
    url: str, *, method: str = "GET", payload: dict | None = None, timeout: float = 30.0
) -> tuple[int, bytes]:
    """One HTTP request (stdlib only). Returns (status, body); never raises on HTTP errors."""
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def start_server(
    model_path: str | os.PathLike,
    *,
    extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    host: str = "127.0.0.1",
    port: int | None = None,
    timeout: float = DEFAULT_START_TIMEOUT,
    log_path: str | os.PathLike | None = None,
    python: str = sys.executable,
    page_size: int | None = 4,
    max_total_tokens: int | None = 4096,
    dtype: str = "bfloat16",
) -> SGLangServer:
    """Start ``python -m sglang.launch_server`` on CPU and wait until ``/health`` is 200.

    ``extra_args`` are appended to the command line (e.g. the HiCache flags); ``env`` entries
    are added on top of :func:`sglang_cpu.sglang_env` (which puts the CPU shims on PYTHONPATH).
    ``page_size`` / ``max_total_tokens`` are left out of the command when ``None``.
    Raises :class:`ServerError` (with the log tail) if the server exits or is not healthy within
    ``timeout`` seconds; the processes are stopped in that case. Without a ``port`` given, a
    server whose port another process took first starts again on a new one (START_ATTEMPTS).
    """
    for attempt in range(1, START_ATTEMPTS + 1):
        try:
            return _start(
                model_path,
                extra_args=extra_args,
                env=env,
                host=host,
                port=port or free_port(host),
                timeout=timeout,
                log_path=log_path,
                python=python,
                page_size=page_size,
                max_total_tokens=max_total_tokens,
                dtype=dtype,
            )
        except PortTaken:
            if port is not None or attempt == START_ATTEMPTS:
                raise
        except ModuleVanished as e:
            if attempt == START_ATTEMPTS:
                raise
            print(f"sglang server start {attempt} failed: {e.args[0].splitlines()[0]}; again")
    raise AssertionError("unreachable")


def _start(
    model_path: str | os.PathLike,
    *,
    extra_args: Sequence[str],
    env: dict[str, str] | None,
    host: str,
    port: int,
    timeout: float,
    log_path: str | os.PathLike | None,
    python: str,
    page_size: int | None,
    max_total_tokens: int | None,
    dtype: str,
) -> SGLangServer:
    """One start of `start_server` on `port`."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"sglang-server-{port}-"))
    tmp_dir = run_dir / "tmp"
    tmp_dir.mkdir()
    log_path = Path(log_path) if log_path is not None else run_dir / "server.log"
    cmd = [
        python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(model_path),
        "--device",
        "cpu",
        "--host",
        host,
        "--port",
        str(port),
        "--dtype",
        dtype,
    ]
    if page_size is not None:
        cmd += ["--page-size", str(page_size)]
    if max_total_tokens is not None:
        cmd += ["--max-total-tokens", str(max_total_tokens)]
    cmd += list(extra_args)

    shm_before = _shm_snapshot()
    log_file = open(log_path, "ab")  # noqa: SIM115 - closed in stop_server
    log_file.write(("$ " + " ".join(cmd) + "\n").encode())
    log_file.flush()
    log_start = log_file.tell()  # this start's output (a given log may hold earlier ones)
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        env=sglang_env({"TMPDIR": str(tmp_dir), **(env or {})}),
        stdin=subprocess.DEVNULL,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # own process group: stop_server ends all of it by id
    )
    server = SGLangServer(
        process=proc,
        host=host,
        port=port,
        log_path=log_path,
        tmp_dir=tmp_dir,
        shm_before=shm_before,
        _log_file=log_file,
    )
    try:
        _wait_healthy(server, t0 + timeout, log_start)
    except BaseException:
        stop_server(server)
        raise
    server.startup_seconds = time.monotonic() - t0
    return server


def _wait_healthy(server: SGLangServer, deadline: float, log_start: int) -> None:
    while True:
        # (first: whatever answers on a taken port is not this server)
        if _port_taken(server, log_start):
            raise PortTaken(f"port {server.port} was taken; log {server.log_path}")
        code = server.process.poll()
        if code is not None:
            tail = server.log_tail()
            missed = _installed_module_missed(tail)
            error = ServerError if missed is None else ModuleVanished
            raise error(
                f"sglang server exited with code {code} during start-up"
                + ("" if missed is None else f" (failed to import installed {missed})")
                + f"; log {server.log_path}:\n{tail}"
            )
        try:
            status, _ = http_request(server.base_url + "/health", timeout=5)
            if status == 200:
                return
        except OSError:
            pass  # not listening yet
        if time.monotonic() > deadline:
            raise ServerError(
                f"sglang server not healthy in time; log {server.log_path}:\n{server.log_tail()}"
            )
        time.sleep(0.5)


def _port_taken(server: SGLangServer, log_start: int) -> bool:
    """Whether this start's output (from `log_start` in its log) says its port was taken."""
    try:
        with open(server.log_path, "rb") as f:
            f.seek(log_start)
            return PORT_TAKEN.encode() in f.read()
    except OSError:
        return False


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def stop_server(server: SGLangServer, timeout: float = DEFAULT_STOP_TIMEOUT) -> None:
    """Stop the server and all its processes (SIGTERM, then SIGKILL), then clean /dev/shm."""
    proc = server.process
    pgid = proc.pid  # start_new_session=True: the launcher leads its own group
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)  # SGLang's launcher tears down its children
    deadline = time.monotonic() + timeout
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if proc.poll() is None or _group_alive(pgid):
        _signal_group(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        end = time.monotonic() + 10
        while _group_alive(pgid) and time.monotonic() < end:
            time.sleep(0.1)
    if server._log_file is not None:
        server._log_file.close()
        server._log_file = None
    cleanup_shm(server.shm_before)
    if server.tmp_dir is not None:
        shutil.rmtree(server.tmp_dir, ignore_errors=True)
        with contextlib.suppress(OSError):
            server.tmp_dir.parent.rmdir()  # only if empty (the log lives elsewhere)


def _stamped_by_a_dead_process(name: str) -> bool:
    """SGLang names some segments ``sgl_shm_<kind>_<pid>_<rand>`` (its message queues: 24 MiB
    each); one is a leftover once that process is gone (another server's live ones stay)."""
    parts = name.split("_")
    if not name.startswith(SHM_STAMPED_PREFIX) or len(parts) < 5 or not parts[-2].isdigit():
        return False
    try:
        os.kill(int(parts[-2]), 0)
    except ProcessLookupError:
        return True
    except OSError:  # (alive, someone else's)
        return False
    return False


def _mapped_in_shm() -> set[str]:
    """The /dev/shm files some live process maps (a semaphore in use is mapped by each
    process that opened it): another test's, never a leftover, whenever it appeared."""
    names: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        with contextlib.suppress(OSError):
            for line in maps.read_text().splitlines():
                path = line.partition(f"{SHM_DIR}/")[2]
                if path:
                    names.add(path.removesuffix(" (deleted)"))
    return names


def cleanup_shm(before: frozenset[str]) -> list[str]:
    """Remove SGLang's /dev/shm leftovers that were not there in the ``before`` snapshot and
    that no live process maps (tests running beside this one keep theirs)."""
    removed = []
    in_use = _mapped_in_shm()
    for name in _shm_snapshot() - before - in_use:
        if name.startswith(SHM_LEFTOVER_PREFIXES) or _stamped_by_a_dead_process(name):
            with contextlib.suppress(OSError):
                (SHM_DIR / name).unlink()
                removed.append(name)
    return removed


@contextlib.contextmanager
def running_server(model_path: str | os.PathLike, **kwargs) -> Iterator[SGLangServer]:
    """Context manager around :func:`start_server` / :func:`stop_server`."""
    server = start_server(model_path, **kwargs)
    try:
        yield server
    finally:
        stop_server(server)


# ---------------------------------------------------------------------------------------------
# Small client helpers for the native SGLang API
# ---------------------------------------------------------------------------------------------
def generate(
    base_url: str,
    text: str | None = None,
    *,
    input_ids: list[int] | None = None,
    max_new_tokens: int = 8,
    timeout: float = 120.0,
    **sampling_params,
) -> dict:
    """POST /generate, greedy (temperature 0) unless overridden. Returns the JSON response.

    The response has ``text``, ``output_ids`` and ``meta_info`` (``prompt_tokens``,
    ``cached_tokens``, ``cached_tokens_details`` = ``{"device", "host", "storage",
    "storage_backend"}`` or ``None`` when nothing was cached, ...).
    """
    payload: dict = {
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0} | sampling_params
    }
    if input_ids is not None:
        payload["input_ids"] = input_ids
    else:
        payload["text"] = text
    status, body = http_request(
        base_url + "/generate", method="POST", payload=payload, timeout=timeout
    )
    if status != 200:
        raise ServerError(f"/generate returned {status}: {body[:2000]!r}")
    return json.loads(body)


def flush_cache(base_url: str, *, timeout: float = 60.0) -> None:
    """POST /flush_cache (device + host tiers; L3 storage is kept), retrying until it succeeds.

    SGLang refuses to flush while requests run; ``?timeout=`` lets it wait for idle.
    """
    deadline = time.monotonic() + timeout
    while True:
        status, body = http_request(base_url + "/flush_cache?timeout=5", method="POST", timeout=30)
        if status == 200:
            return
        if time.monotonic() > deadline:
            raise ServerError(f"/flush_cache kept failing ({status}): {body[:500]!r}")
        time.sleep(0.5)
