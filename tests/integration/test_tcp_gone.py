"""Issue 45: a TCP client whose connection closes shows as gone at once, as a local client
does, and is still reaped only after `--heartbeat-timeout` (a dropped connection may be a live
process on another host, which ZeroMQ reconnects). Real server, real client processes, real
SIGKILL; `maru status` read as an operator reads it.

The server runs with a heartbeat timeout of 600 s: before the change an instance showed gone
only after two missed heartbeats (400 s here), so the bounded polls below time out on it."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
from typing import Any

from maru import MaruHandler
from maru.client.admin import MaruAdmin
from maru.client.cli import render_instances

from .test_cli import fields, run
from .test_crash_safety import wait_until
from .workers import SPAWN, digest, make_value

SERVER_ARGS = ["--heartbeat-timeout", "600"]
KEYS = [f"tcp-gone/{i}" for i in range(8)]
SIZE = 20_000
BOUND = 60  # seconds any poll below may take: a bound for the test to stop, not a threshold


def tcp_writer(url: str, out: Any) -> None:
    """Store KEYS over TCP only (no local socket: the server cannot watch this process), say
    our instance id, then wait to be killed."""
    h = MaruHandler(
        server_url=url,
        pool_size="1M",
        chunk_size_bytes="64K",
        local_socket=False,
        timeout_ms=10_000,
    )
    ok = h.batch_store(KEYS, [make_value(i, SIZE) for i in range(len(KEYS))])
    out.put((h.instance_id, ok))
    threading.Event().wait(600)


def status(url: str) -> tuple[str, dict[str, Any]]:
    """`maru status` as printed, and the STATS document it is drawn from."""
    rc, text = run(url, "status")
    assert rc == 0, text
    with MaruAdmin(url) as admin:
        return text, admin.stats()


def shown_gone(url: str) -> bool:
    """Whether `maru status` counts one instance gone."""
    return "1 gone" in fields(status(url)[0])["instances"]


def gone_row(stats: dict[str, Any], iid: str) -> str:
    """The `maru status --instances` row of `iid`."""
    return next(row for row in render_instances(stats) if row.startswith(iid))


def test_a_tcp_client_killed_shows_gone_at_once_and_keeps_its_regions(maru_server_factory):
    server = maru_server_factory(pool_size="64M", extra_args=SERVER_ARGS)
    out = SPAWN.Queue()
    child = SPAWN.Process(target=tcp_writer, args=(server.url, out), daemon=True)
    child.start()
    observer = MaruHandler(server_url=server.url, pool_size="1M", timeout_ms=10_000)
    try:
        iid, stored = out.get(timeout=BOUND)
        assert all(stored)
        text, stats = status(server.url)
        assert fields(text)["instances"].startswith("2 connected,")  # alive: not gone
        assert not stats["instances"][iid].get("dropped")
        assert stats["instances"][iid]["watched_pids"] == []  # TCP: its process not watched

        os.kill(child.pid, signal.SIGKILL)
        child.join(10)
        assert child.exitcode == -signal.SIGKILL

        assert wait_until(lambda: shown_gone(server.url), BOUND), "still shown connected"
        text, stats = status(server.url)
        assert fields(text)["instances"].startswith("2 connected (1 gone, reaping in ")
        inst = stats["instances"][iid]
        assert inst["dropped"] and "(gone, reaping in " in gone_row(stats, iid)
        # ...but not reaped: a dropped connection may be a live process elsewhere
        assert inst["idle_seconds"] < stats["heartbeat_timeout"]
        assert inst["regions"] >= 1 and inst["keys"] == len(KEYS)
        infos = observer.batch_retrieve(KEYS)
        read = [digest(bytes(i.view)) if i is not None else None for i in infos]
        assert read == [digest(make_value(i, SIZE)) for i in range(len(KEYS))]
    finally:
        if child.is_alive():
            child.kill()
        child.join(10)
        observer.close()


class Forwarder:
    """A TCP relay from a local port to the server's: `cut()` closes the connections it
    carries, as a network blip does; new ones are relayed again (ZeroMQ reconnects)."""

    def __init__(self, port: int):
        self.target = ("127.0.0.1", port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.carried: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # closed
                return
            upstream = socket.create_connection(self.target, timeout=10)
            upstream.settimeout(None)
            with self.lock:
                self.carried += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(a: socket.socket, b: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := a.recv(65536):
                b.sendall(data)
        with contextlib.suppress(OSError):
            b.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        with self.lock:
            carried, self.carried = self.carried, []
        for s in carried:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def close(self) -> None:
        self.listener.close()
        self.cut()


def test_a_tcp_client_whose_connection_was_cut_is_connected_again_at_its_next_request(
    maru_server_factory,
):
    server = maru_server_factory(pool_size="64M", extra_args=SERVER_ARGS)
    relay = Forwarder(int(server.url.rsplit(":", 1)[1]))
    h = MaruHandler(
        server_url=relay.url,
        pool_size="1M",
        chunk_size_bytes="64K",
        local_socket=False,
        timeout_ms=10_000,
    )
    try:
        assert h.store("before", make_value(1, SIZE))
        relay.cut()

        assert wait_until(lambda: shown_gone(server.url), BOUND), "still shown connected"
        assert status(server.url)[1]["instances"][h.instance_id]["dropped"]
        assert h.store("after", make_value(2, SIZE))  # ZeroMQ reconnected through the relay
        text, stats = status(server.url)
        assert not stats["instances"][h.instance_id]["dropped"]  # the same instance, back
        assert fields(text)["instances"].startswith("1 connected,")
        for key, seed in (("before", 1), ("after", 2)):
            info = h.retrieve(key)
            assert info is not None and digest(bytes(info.view)) == digest(make_value(seed, SIZE))
    finally:
        h.close()
        relay.close()
