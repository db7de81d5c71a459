"""The local socket reads a connection's requests no faster than it serves them: a client that
writes small requests faster than 256 a turn (`FRAMES_PER_WAKEUP`) must not grow the server's
buffer of its unread requests without bound (`LocalSocketServer` in-process, a real socket)."""

from __future__ import annotations

import socket
import threading
import uuid

import zmq

from maru.common import protocol
from maru.common.protocol import MsgType, unix_address
from maru.server.local_socket import LocalSocketServer, Peer

MiB = 1 << 20


def test_a_client_writing_faster_than_it_is_served_does_not_grow_the_server_without_bound():
    """Before: each turn read 64 KiB and served 256 frames of 20 bytes (5 KiB), so the buffer
    of requests read but not served grew by about 59 KiB a turn: 11.6 MiB after 200 turns,
    and on for as long as the client writes (the server's memory, a client's to take)."""
    server = LocalSocketServer(f"@maru-test-{uuid.uuid4().hex}")
    poller = zmq.Poller()
    server.attach(poller)
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    request = protocol.encode(MsgType.HEARTBEAT, 1, {})
    reply = protocol.encode(MsgType.HEARTBEAT, 1, {"ok": True}, reply=True)
    frame = protocol.stream_prefix(request) + request
    served = [0]

    def handle(data: bytes, peer: Peer | None = None) -> bytes:
        served[0] += 1
        return reply

    stop = threading.Event()

    def write() -> None:  # as fast as the socket takes them
        with client.makefile("wb") as out:
            chunk = frame * 4096
            while not stop.is_set():
                try:
                    out.write(chunk)
                    out.flush()
                except OSError:
                    return

    def read() -> None:  # it reads its replies: nothing is held back for it
        while not stop.is_set():
            try:
                if not client.recv(1 << 20):
                    return
            except OSError:
                return

    try:
        client.connect(unix_address(server.address))
        workers = [threading.Thread(target=f, daemon=True) for f in (write, read)]
        for worker in workers:
            worker.start()
        biggest = 0
        for _ in range(200):
            server.serve(dict(poller.poll(1000)), handle)
            for conn in server.connections.values():
                biggest = max(biggest, conn.reader.buffered)
        assert served[0] >= 200 * 100  # it was served meanwhile
        assert biggest <= 2 * MiB, f"{biggest / MiB:.1f} MiB of unread requests buffered"
    finally:
        stop.set()
        client.shutdown(socket.SHUT_RDWR)
        client.close()
        server.close()
