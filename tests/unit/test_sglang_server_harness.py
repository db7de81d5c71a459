"""The SGLang test harness (`tests/sglang_cpu/server.py`) starts again on a new port when the
one it picked was taken before the server bound it: uvicorn then logs "address already in use"
and may hang in its shutdown, and whatever holds the port must not pass for the server.

The launcher here is a stand-in (`python=`), not SGLang: what is tested is the harness. Its
first start logs uvicorn's bind error and hangs, while the port's holder accepts connections
and never answers (as a ZMQ socket does to HTTP: what was seen in CI, the /health requests
timing out until the test's own timeout); its second start serves /health itself."""

from __future__ import annotations

import contextlib
import mmap
import os
import socket
import subprocess
import sys
import threading

import pytest

from sglang_cpu import server as harness

pytestmark = pytest.mark.timeout(60)

LAUNCHER = r"""#!{python}
import http.server, os, sys, time
port = int(sys.argv[sys.argv.index("--port") + 1])
calls = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calls")
with open(calls, "a") as f:
    f.write(f"{{port}}\n")
if len(open(calls).read().split()) == 1:
{first_start}
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ours")
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""
# What the stand-in's first start does (its later starts serve /health).
PORT_TAKEN_FIRST = """\
    print(f"ERROR:    [Errno 98] error while attempting to bind on address "
          f"('127.0.0.1', {port}): address already in use", flush=True)
    time.sleep(600)  # hangs in its shutdown, as uvicorn did"""
IMPORT_FAILS_FIRST = """\
    print("ModuleNotFoundError: No module named '{module}'", flush=True)
    sys.exit(1)"""


def launcher(tmp_path, first_start: str):
    path = tmp_path / "launcher"
    path.write_text(LAUNCHER.format(python=sys.executable, first_start=first_start))
    path.chmod(0o755)
    return path


class _Holder:
    """A listener on an ephemeral port that accepts and never answers."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        with contextlib.suppress(OSError):
            while True:
                self.held.append(self.sock.accept()[0])

    def close(self):
        self.sock.close()
        for conn in self.held:
            conn.close()


def test_a_taken_port_starts_the_server_again_on_another(tmp_path, monkeypatch):
    stand_in = launcher(tmp_path, PORT_TAKEN_FIRST)
    holder = _Holder()  # holds the first port
    ports = iter([holder.port])
    real_free_port = harness.free_port
    monkeypatch.setattr(harness, "free_port", lambda host: next(ports, None) or real_free_port())
    log = tmp_path / "server.log"
    srv = harness.start_server("model", python=str(stand_in), log_path=log, timeout=30)
    try:
        tried = (tmp_path / "calls").read_text().split()
        assert len(tried) == 2 and int(tried[0]) == holder.port
        assert srv.port == int(tried[1]) != holder.port
        assert harness.http_request(srv.base_url + "/health", timeout=5) == (200, b"ours")
        assert log.read_text().count("$ ") == 2  # both starts logged, the first's error kept
    finally:
        harness.stop_server(srv)
        holder.close()


@pytest.mark.sglang
def test_a_failed_import_of_an_installed_sglang_module_starts_again(tmp_path):
    """The environment failed the import (the file is there): start again. A module that is
    not installed is a real failure: no second start."""
    installed = "sglang.srt.mem_cache.hicache_storage"
    stand_in = launcher(tmp_path, IMPORT_FAILS_FIRST.format(module=installed))
    srv = harness.start_server("model", python=str(stand_in), log_path=tmp_path / "a.log")
    try:
        assert len((tmp_path / "calls").read_text().split()) == 2
    finally:
        harness.stop_server(srv)

    (tmp_path / "calls").unlink()
    stand_in = launcher(tmp_path, IMPORT_FAILS_FIRST.format(module="sglang.srt.nope"))
    with pytest.raises(harness.ServerError) as failed:
        harness.start_server("model", python=str(stand_in), log_path=tmp_path / "b.log")
    assert not isinstance(failed.value, harness.ModuleVanished)
    assert len((tmp_path / "calls").read_text().split()) == 1


def test_a_taken_port_given_by_the_caller_is_an_error(tmp_path):
    stand_in = launcher(tmp_path, PORT_TAKEN_FIRST)
    holder = _Holder()
    try:
        log = tmp_path / "taken.log"  # (without one the log would stay in a /tmp run dir)
        with pytest.raises(harness.PortTaken):
            harness.start_server(
                "model", python=str(stand_in), port=holder.port, timeout=30, log_path=log
            )
        assert len((tmp_path / "calls").read_text().split()) == 1
    finally:
        holder.close()


def test_stopping_removes_the_shared_memory_sglang_leaves_and_only_that(tmp_path, monkeypatch):
    """SGLang's pid-stamped segments (`sgl_shm_<kind>_<pid>_<rand>`, 24 MiB message queues)
    outlive a killed server: the harness removes those of dead processes that appeared while
    its server ran, never a live process's (another server's) nor what was there before."""
    monkeypatch.setattr(harness, "SHM_DIR", tmp_path)
    (tmp_path / "sgl_shm_mq_1_old").touch()  # there before: not ours to remove
    before = harness._shm_snapshot()
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    dead = f"sgl_shm_mq_{int(gone.stdout)}_ab12cd34"
    live = f"sgl_shm_mq_{os.getpid()}_ef56ab78"
    for name in (dead, live, "sglang_loads_x", "sgl_shm_not_stamped", "unrelated"):
        (tmp_path / name).touch()
    removed = harness.cleanup_shm(before)
    assert sorted(removed) == sorted([dead, "sglang_loads_x"])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["sgl_shm_mq_1_old", live, "sgl_shm_not_stamped", "unrelated"]
    )


def test_stopping_keeps_what_a_live_process_maps(tmp_path, monkeypatch):
    """A `sem.mp-*` semaphore that appeared during a server's run may be a test's beside it,
    still in use (mapped): only the unmapped ones are leftovers."""
    monkeypatch.setattr(harness, "SHM_DIR", tmp_path)
    before = harness._shm_snapshot()
    for name in ("sem.mp-in-use", "sem.mp-left"):
        (tmp_path / name).write_bytes(b"\0" * 4096)
    with open(tmp_path / "sem.mp-in-use", "r+b") as f, mmap.mmap(f.fileno(), 4096):
        removed = harness.cleanup_shm(before)
        assert removed == ["sem.mp-left"]
        assert (tmp_path / "sem.mp-in-use").exists()
