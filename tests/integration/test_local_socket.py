"""The server's Unix socket: clients on the node send their requests there once the handshake
names it, fall back to ZMQ when they cannot reach it, and a misbehaving peer on it never stalls
or crashes the server."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import pytest

from maru import MaruHandler
from maru.client.admin import MaruAdmin
from maru.client.rpc import _LocalChannel
from maru.common import protocol
from maru.common.protocol import MsgType, unix_address

KiB = 1 << 10


def server_stats(url: str) -> dict:
    with MaruAdmin(url) as admin:
        return admin.stats()


def store_and_read(h: MaruHandler, key: str) -> None:
    value = os.urandom(20 * KiB)
    assert h.store(key, value)
    info = h.retrieve(key)
    assert info is not None and bytes(info.view) == value


def test_handler_moves_to_the_local_socket_after_the_handshake(maru_server):
    with MaruHandler(server_url=maru_server.url, pool_size="4M") as h:
        address = h._rpc.local_address
        assert address is not None and address.startswith("@maru:")
        store_and_read(h, "over-unix")
        stats = server_stats(maru_server.url)
        assert stats["local_socket"] == address
        assert stats["local_connections"] >= 1  # this thread's (and the heartbeat's)


def test_local_socket_off_in_the_client_config_keeps_zmq(maru_server):
    with MaruHandler(server_url=maru_server.url, pool_size="4M", local_socket=False) as h:
        store_and_read(h, "over-zmq")
        assert h._rpc.local_address is None
        assert server_stats(maru_server.url)["local_connections"] == 0


@pytest.mark.parametrize("local", [True, False], ids=["unix", "zmq"])
def test_a_reply_is_taken_without_waiting_only_once_it_is_in(maru_server, local):
    """`PendingReply.arrived()` (a write reads the replies that are in during its copy): False
    while the server is stopped, without waiting for the reply; True once it came, and then
    `result()` has it. On either transport."""
    import signal

    config = dict(server_url=maru_server.url, pool_size="4M", local_socket=local)
    with MaruHandler(**config, timeout_ms=30_000) as h:
        assert h._rpc.request(MsgType.EXISTS, {"keys": ["a"]}).result()["ok"]  # (connected)
        os.kill(maru_server.pid, signal.SIGSTOP)
        try:
            pending = h._rpc.request(MsgType.EXISTS, {"keys": ["a"]})
            started = time.monotonic()
            assert not pending.arrived()
            assert time.monotonic() - started < 5  # (waiting would take the 30 s timeout)
        finally:
            os.kill(maru_server.pid, signal.SIGCONT)
        deadline = time.monotonic() + 10
        while not pending.arrived() and time.monotonic() < deadline:
            time.sleep(0.005)
        assert pending.arrived() and pending.done()
        assert pending.result()["ok"]


def test_server_without_local_socket(maru_server_factory, tmp_path):
    server = maru_server_factory(
        tmp_path / "srv", pool_size="64M", extra_args=["--local-socket", "none"]
    )
    with MaruHandler(server_url=server.url, pool_size="4M") as h:
        store_and_read(h, "no-local")
        assert h._rpc.local_address is None
    stats = server_stats(server.url)
    assert stats["local_socket"] is None and stats["local_connections"] == 0


def test_socket_file_is_created_replaced_when_stale_and_removed(maru_server_factory, tmp_path):
    path = tmp_path / "maru.sock"
    server = maru_server_factory(
        tmp_path / "srv", pool_size="64M", extra_args=["--local-socket", str(path)]
    )
    assert path.is_socket()
    with MaruHandler(server_url=server.url, pool_size="4M") as h:
        assert h._rpc.local_address == str(path)
        store_and_read(h, "via-path")
    os.kill(server.pid, 9)  # a killed server leaves its socket file behind
    server.proc.wait(10)
    assert path.is_socket()
    server.restart()  # the stale file is replaced, not an error
    with MaruHandler(server_url=server.url, pool_size="4M") as h:
        assert h.retrieve("via-path") is not None
    server.stop()
    assert not path.exists()


def test_a_path_that_is_not_a_socket_is_refused(maru_server_factory, tmp_path):
    path = tmp_path / "not-a-socket"
    path.write_text("keep me")
    with pytest.raises(RuntimeError, match="not a socket"):
        maru_server_factory(
            tmp_path / "srv", pool_size="64M", extra_args=["--local-socket", str(path)]
        )
    assert path.read_text() == "keep me"


def test_unreachable_local_socket_falls_back_to_zmq(maru_server_factory, tmp_path, caplog):
    """The server names a socket this client cannot reach (here: its file was removed; in
    production, a container without the shared directory): requests go over ZMQ."""
    path = tmp_path / "gone.sock"
    server = maru_server_factory(
        tmp_path / "srv", pool_size="64M", extra_args=["--local-socket", str(path)]
    )
    path.unlink()
    caplog.set_level(logging.INFO, logger="maru.client.rpc")
    with MaruHandler(server_url=server.url, pool_size="4M") as h:
        store_and_read(h, "fallback")
    assert "not reachable from here" in caplog.text
    assert server_stats(server.url)["local_connections"] == 0


def raw_connect(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(unix_address(address))
    return sock


def read_frame(sock: socket.socket) -> tuple[protocol.Header, dict]:
    reader = protocol.StreamReader()
    while True:
        data = sock.recv(65536)
        assert data, "connection closed without a reply"
        reader.feed(data)
        frames = reader.frames(1)
        if frames:
            return protocol.decode(frames[0])


def local_address_of(url: str) -> str:
    address = server_stats(url)["local_socket"]
    assert address
    return address


def test_garbage_and_oversized_frames_get_an_error_and_the_server_keeps_serving(maru_server):
    address = local_address_of(maru_server.url)
    sock = raw_connect(address)
    bad = b"not a maru frame at all"
    sock.sendall(protocol.stream_prefix(bad) + bad)
    _, body = read_frame(sock)
    assert body["ok"] is False and body["code"] == protocol.ErrorCode.BAD_FRAME
    # An impossible length: answered, then the connection is closed (no resynchronising).
    sock.sendall(protocol.STREAM_LENGTH.pack(protocol.MAX_FRAME_BYTES + 1000))
    _, body = read_frame(sock)
    assert body["code"] == protocol.ErrorCode.BAD_FRAME
    assert sock.recv(10) == b""
    sock.close()
    with MaruHandler(server_url=maru_server.url, pool_size="4M") as h:
        store_and_read(h, "after-garbage")


def test_a_client_that_never_reads_its_replies_stalls_only_itself(maru_server):
    address = local_address_of(maru_server.url)
    hog = raw_connect(address)
    hog.setblocking(False)
    frame = protocol.encode(MsgType.KEYS, 1, {"prefix": "", "limit": 10000})
    data = protocol.stream_prefix(frame) + frame
    sent = 0
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # until the kernel buffers are full
        try:
            sent += hog.send(data)
        except BlockingIOError:
            time.sleep(0.05)
            try:
                sent += hog.send(data)
            except BlockingIOError:
                break
    assert sent > 0
    with MaruHandler(server_url=maru_server.url, pool_size="4M", timeout_ms=5000) as h:
        store_and_read(h, "not-stalled")
    hog.close()
    assert maru_server.alive()


def test_requests_in_flight_when_the_server_dies_fail_fast_then_recover(maru_server):
    with MaruHandler(server_url=maru_server.url, pool_size="4M", timeout_ms=3000) as h:
        store_and_read(h, "before-restart")
        address = h._rpc.local_address
        maru_server.restart()
        store_and_read(h, "after-restart")  # reconnects (and re-handshakes) by itself
        stats = server_stats(maru_server.url)
        assert stats["local_socket"] == address  # same state dir: same name
        assert stats["local_connections"] >= 1


def test_threads_of_one_handler_each_get_a_connection_and_their_own_replies(maru_server):
    """SGLang calls one backend from its backup, prefetch and scheduler threads at once: each
    thread has its own Unix connection, and no reply reaches the wrong thread. (Counted while
    they live: a thread's end closes its connection.)"""
    errors: list[BaseException] = []
    done, counted = threading.Barrier(9, timeout=60), threading.Event()
    with MaruHandler(server_url=maru_server.url, pool_size="16M", chunk_size_bytes="4K") as h:

        def worker(t: int) -> None:
            try:
                for i in range(40):
                    key = f"thread-{t}-{i}"
                    value = f"{key}:".encode() * 50
                    assert h.store(key, value)
                    info = h.retrieve(key)
                    assert info is not None and bytes(info.view) == value
                    assert h.batch_exists([key, f"missing-{t}-{i}"]) == [True, False]
            except BaseException as exc:  # reported below
                errors.append(exc)
            done.wait()
            counted.wait(60)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
        for thread in threads:
            thread.start()
        done.wait()
        alive = server_stats(maru_server.url)["local_connections"]
        counted.set()
        for thread in threads:
            thread.join(60)
        assert not errors, errors[0]
        assert alive >= 8


@pytest.mark.parametrize("busy_poll_us", [0, 1, 200])
def test_replies_arrive_whether_they_come_within_the_spin_or_after_it(maru_server, busy_poll_us):
    """A reply slower than the client's spin (the server stopped for 0.3 s here) is still
    awaited in poll(), up to the timeout; one within it never sleeps. Either way the same
    bytes come back."""
    import signal

    with MaruHandler(
        server_url=maru_server.url,
        pool_size="4M",
        busy_poll_us=busy_poll_us,
        timeout_ms=5000,
        local_index=False,  # (exists must be a request here)
    ) as h:
        store_and_read(h, "spin")
        assert h._rpc.busy_poll_ns == busy_poll_us * 1000
        resumed: list[float] = []

        def resume() -> None:
            resumed.append(time.monotonic())
            os.kill(maru_server.pid, signal.SIGCONT)

        os.kill(maru_server.pid, signal.SIGSTOP)
        try:
            threading.Timer(0.3, resume).start()
            assert h.batch_exists(["spin", "absent"]) == [True, False]
            assert resumed and time.monotonic() >= resumed[0]  # answered after the resume
        finally:
            os.kill(maru_server.pid, signal.SIGCONT)
        store_and_read(h, "spin-after")


def test_a_request_larger_than_the_socket_buffer_goes_whole(maru_server):
    """The client's socket is non-blocking: a request that does not fit the kernel buffer at
    once (tens of thousands of keys) is sent in pieces as the server drains it."""
    keys = [f"bulk-key-{i:08d}-{'x' * 40}" for i in range(40_000)]  # ~2.4 MB of keys
    with MaruHandler(server_url=maru_server.url, pool_size="4M") as h:
        store_and_read(h, keys[7])
        found = h.batch_exists(keys)
        assert found[7] is True and sum(found) == 1
        assert isinstance(h._rpc._channel(), _LocalChannel)  # not ZMQ
        assert server_stats(maru_server.url)["local_connections"] >= 1


def test_server_busy_poll_serves_the_same_and_rejects_a_negative_window(
    maru_server_factory, tmp_path
):
    server = maru_server_factory(
        tmp_path / "spin", pool_size="64M", extra_args=["--busy-poll-us", "500"]
    )
    with MaruHandler(server_url=server.url, pool_size="64M") as h:  # 50 one-chunk values
        for i in range(50):
            store_and_read(h, f"busy-{i}")
        assert h.batch_exists([f"busy-{i}" for i in range(50)]) == [True] * 50

    from maru.server.service import MaruService

    with pytest.raises(ValueError, match="busy_poll_us"):
        MaruService(None, "tcp://127.0.0.1:0", busy_poll_us=-1)  # type: ignore[arg-type]


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("local_socket", ["auto", "none"])
def test_a_thread_that_ends_leaves_no_connection_open(maru_server_factory, tmp_path, local_socket):
    """Each thread that sends has a connection of its own (ZMQ sockets are not thread-safe);
    its end closes it. Before, each one stayed open on both ends until the handler closed:
    every `maru-ready` thread (one per region taken ahead) and every short-lived worker of a
    caller left a Unix socket, or a ZMQ socket and its TCP connection, behind it."""
    server = maru_server_factory(
        tmp_path / "srv", pool_size="64M", extra_args=["--local-socket", local_socket]
    )
    threads = 40
    with MaruHandler(server_url=server.url, pool_size="4M") as h:
        store_and_read(h, "main")  # (this thread's connection, open from now on)
        descriptors = open_descriptors()
        connections = h.stats()["local_connections"]
        mine = h.stats()["instances"][h.instance_id]["local_connections"]  # (per instance)
        assert mine == (connections if local_socket == "auto" else 0)

        for _ in range(threads):
            thread = threading.Thread(target=h.healthcheck)  # (a request: a HEARTBEAT)
            thread.start()
            thread.join(10)
        left = open_descriptors() - descriptors
        assert left < threads // 4, f"{left} descriptors left by {threads} threads that ended"
        deadline = time.monotonic() + 10  # (the server sees a close when it next polls)
        while h.stats()["local_connections"] > connections and time.monotonic() < deadline:
            time.sleep(0.05)
        assert h.stats()["local_connections"] == connections
        assert h.stats()["instances"][h.instance_id]["local_connections"] == mine


@pytest.mark.parametrize("local_socket", ["auto", "none"])
def test_a_request_a_thread_sent_without_waiting_arrives_after_it_ends(
    maru_server_factory, tmp_path, local_socket
):
    """A lease's release is not waited for: the thread that sent it may end at once, and its
    connection's close must not lose it (over ZMQ, a close would drop what is still queued:
    it lingers instead). The lease timeout is long, so only the release ends the lease."""
    server = maru_server_factory(
        tmp_path / "srv",
        pool_size="64M",
        extra_args=["--local-socket", local_socket, "--lease-timeout", "120"],
    )
    with MaruHandler(server_url=server.url, pool_size="4M", local_index=False) as h:
        store_and_read(h, "leased")

        def read_and_go() -> None:
            found = h.lookup(["leased"], lease=True)
            assert found.infos()[0] is not None
            found.release()  # (sent, not waited for)

        thread = threading.Thread(target=read_and_go)
        thread.start()
        thread.join(10)
        deadline = time.monotonic() + 10
        while h.stats()["leases"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert h.stats()["leases"] == 0
