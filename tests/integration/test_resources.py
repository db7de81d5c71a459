"""Scenario 9 of issue 13 (P6): a server's resources are bounded per client. Real server, real
sockets, a real file descriptor limit (prlimit on the server process).

Before: with a 1,024 fd limit, 1,100 idle connections made the next snapshot fail and the
server exit; a client that never read its replies grew the server by ~500 MiB per 100
requests on the Unix socket and ~700 MiB on ZMQ (here: ~1,000 MiB for 100 replies of 10 MB).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time

import pytest
import zmq

from maru import MaruHandler
from maru.common import protocol
from maru.common.protocol import MsgType, unix_address

KEYS, NAME = 3000, 1000  # KEYS replies of ~3 MB each
REQUESTS = 100


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.mark.parametrize("channel", ["unix", "zmq"])
def test_a_client_that_never_reads_its_replies_stalls_only_itself(maru_server, channel):
    h = MaruHandler(server_url=maru_server.url, pool_size="64M", chunk_size_bytes="4K")
    stuck = None
    try:
        names = [f"k{i:05d}" + "x" * NAME for i in range(KEYS)]
        for i in range(0, KEYS, 1000):
            assert all(h.batch_store(names[i : i + 1000], [b"v"] * 1000))
        address = h.stats()["local_socket"]
        before = rss_mib(maru_server.pid)
        frame = protocol.encode(MsgType.KEYS, 1, {"limit": KEYS})
        if channel == "unix":
            stuck = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            stuck.connect(unix_address(address))
            stuck.setblocking(False)
            data = (protocol.stream_prefix(frame) + frame) * REQUESTS
            sent, deadline = 0, time.monotonic() + 30
            while sent < len(data) and time.monotonic() < deadline:
                try:
                    sent += stuck.send(data[sent:])
                except BlockingIOError:
                    time.sleep(0.01)
        else:
            stuck = zmq.Context.instance().socket(zmq.DEALER)
            stuck.setsockopt(zmq.RCVHWM, 1)  # its I/O thread stops reading, too
            stuck.setsockopt(zmq.LINGER, 0)
            stuck.connect(maru_server.url)
            for _ in range(REQUESTS):
                stuck.send(frame)
        # the others are served meanwhile, and the server does not grow with the backlog
        for round_ in range(20):
            assert h.store(f"after{round_}", b"z" * 1000)
            time.sleep(0.1)
        grown = rss_mib(maru_server.pid) - before
        stats = h.stats()
        print(f"\n{channel}: 100 unread replies of 3 MB grew the server by {grown:.0f} MiB")
        assert grown < 100  # before: ~300 MiB (16 MiB + one reply, or 16 replies, now)
        if channel == "zmq":
            assert stats["counters"]["replies_dropped"] > 0
        assert bytes(h.retrieve("after19").view) == b"z" * 1000
    finally:
        if stuck is not None:
            stuck.close()
        h.close()


def test_out_of_file_descriptors_refuses_connections_and_keeps_serving(maru_server_factory):
    server = maru_server_factory(pool_size="64M", extra_args=["--snapshot-mb", "0.002"])
    limit = 256
    subprocess.run(["prlimit", f"--pid={server.pid}", f"--nofile={limit}:{limit}"], check=True)
    h = MaruHandler(server_url=server.url, pool_size="16M", chunk_size_bytes="4K")
    idle: list[socket.socket] = []
    acknowledged: dict[str, bytes] = {}

    def store_some(tag: str) -> None:
        keys = [f"{tag}/{i}" for i in range(32)]
        values = [os.urandom(3000 + i) for i in range(32)]
        results = h.batch_store(keys, values)
        assert all(results)
        acknowledged.update(zip(keys, values))

    try:
        address = h.stats()["local_socket"]
        store_some("before")
        for _ in range(limit + 50):  # idle connections on the local socket: more than fit
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.connect(unix_address(address))  # queued in the backlog if not accepted
            idle.append(conn)
        time.sleep(1.5)
        log_mark = len(server.read_log())
        stats = h.stats()
        assert stats["local_connections"] <= limit - 64  # the reserve is kept
        for round_ in range(8):  # journal records, and snapshots (--snapshot-mb 0.002)
            store_some(f"unix{round_}")
        late = MaruHandler(server_url=server.url, pool_size="4M", timeout_ms=3000)
        assert late.connected  # a new TCP client finds a descriptor
        late.close()
        log = server.read_log()[log_mark:]
        assert "snapshot generation" in log and "cannot write a snapshot" not in log
        assert "refusing connections" in server.read_log()

        for _ in range(100):  # now TCP connections too: every descriptor is taken
            conn = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            conn.setblocking(False)  # (a full backlog would make connect wait for SYN retries)
            conn.connect_ex(("127.0.0.1", server.port))
            idle.append(conn)
        time.sleep(0.5)
        assert len(os.listdir(f"/proc/{server.pid}/fd")) >= limit - 4  # exhausted
        store_some("exhausted")  # the connected client is still served
        assert server.alive()
    finally:
        for conn in idle:
            conn.close()
        idle.clear()
    time.sleep(1.5)
    again = MaruHandler(server_url=server.url, pool_size="4M", timeout_ms=5000)
    assert again.connected  # connections are accepted again
    again.close()
    h.close()
    os.kill(server.pid, signal.SIGKILL)  # and nothing acknowledged was lost
    server.proc.wait(10)
    server.restart()
    with MaruHandler(server_url=server.url, pool_size="4M") as reader:
        keys = list(acknowledged)
        infos = reader.batch_retrieve(keys)
        lost = sum(i is None for i in infos)
        wrong = sum(i is not None and bytes(i.view) != acknowledged[k] for k, i in zip(keys, infos))
    print(f"\n{len(keys)} acknowledged keys, {lost} lost, {wrong} wrong after fd exhaustion")
    assert lost == 0 and wrong == 0


def test_a_client_that_reads_gets_every_reply_however_many_wait(maru_server):
    """Issue 40, case 7: ZeroMQ refuses a send (EAGAIN) once SNDHWM (16) replies to a peer are
    in its pipe, and the server dropped that reply: a client with more requests in flight
    than the network moves at once lost some although it read them all, each costing its
    caller `timeout_ms`. Here a client with 64 KEYS requests in flight (the RPC client's
    max_inflight), replies of ~300 KB, whose ZeroMQ takes one reply at a time (RCVHWM 1, a
    small receive buffer: a client whose I/O thread lags), reads them one by one. Now the
    replies ZeroMQ does not take wait for the peer: 64 of 64 come back, each listing every
    key, none dropped."""
    listed, lost = 0, 0
    reader = zmq.Context.instance().socket(zmq.DEALER)
    reader.setsockopt(zmq.RCVHWM, 1)
    reader.setsockopt(zmq.RCVBUF, 4096)
    reader.setsockopt(zmq.LINGER, 0)
    reader.setsockopt(zmq.RCVTIMEO, 20_000)  # a bound: before, a dropped reply never came
    with MaruHandler(server_url=maru_server.url, pool_size="64M", chunk_size_bytes="4K") as h:
        names = [f"k{i:05d}" + "x" * NAME for i in range(300)]
        assert all(h.batch_store(names, [b"v"] * 300))
        reader.connect(maru_server.url)
        for n in range(64):
            reader.send(protocol.encode(MsgType.KEYS, n + 1, {"limit": 300}))
        for _ in range(64):
            try:
                _, body = protocol.decode(reader.recv())
            except zmq.Again:
                lost = 64 - listed
                break
            listed += sorted(k[0] for k in body["keys"]) == names
        reader.close()
        dropped = h.stats()["counters"]["replies_dropped"]
    print(f"\n64 replies of 300 KB in flight: {listed} complete, {lost} lost, {dropped} dropped")
    assert (listed, lost, dropped) == (64, 0, 0)
