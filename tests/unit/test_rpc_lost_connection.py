"""A local-socket connection that closes before any reply: its requests are sent again over
ZMQ only when the server said, with its one refusal frame, that it read none of them. A server
killed after it served the first request of a new connection closes it the same way without
the frame; sending a REGISTER_KV again then gets EXISTS, and its writer took its own sealed
pages for free (the soak's wrong reads). A scripted Unix socket and a scripted ZMQ ROUTER
play the two sides of the server."""

from __future__ import annotations

import os
import socket
import threading

import pytest
import zmq

from maru.client.rpc import RpcClient
from maru.common import protocol
from maru.common.errors import MaruConnectionError
from maru.common.protocol import ErrorCode, MsgType


class _Router:
    """The server's ZMQ side: answers every request `ok`, counting them."""

    def __init__(self) -> None:
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.requests: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(50):
                continue
            peer, frame = self.sock.recv_multipart()
            header = protocol.decode_header(frame)
            self.requests.append(header.msg_type)
            reply = protocol.encode(header.msg_type, header.request_id, {"ok": True}, reply=True)
            self.sock.send_multipart([peer, reply])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


def _local_server(path: str, refuse: bool) -> threading.Thread:
    """Accepts one connection and reads its request; then closes it, after a LOCAL_SOCKET_FULL
    refusal frame (`refuse`) or as a server killed after serving it would (no frame)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(4)

    def serve() -> None:
        conn, _ = listener.accept()
        conn.settimeout(5)
        if refuse:
            frame = protocol.encode_error(0, 0, ErrorCode.LOCAL_SOCKET_FULL, "out of fds (test)")
            conn.sendall(protocol.stream_prefix(frame) + frame)
        else:
            conn.recv(1 << 16)  # the request, served (say), and then the server dies
        conn.close()
        listener.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("refuse", [False, True], ids=["closed-after-serving", "refused"])
def test_a_request_goes_again_over_zmq_only_when_the_server_refused_it(tmp_path, refuse):
    router = _Router()
    path = str(tmp_path / "local.sock")
    server = _local_server(path, refuse)
    client = RpcClient(f"tcp://127.0.0.1:{router.port}", timeout_ms=2000)
    try:
        client.use_local_socket(path, os.geteuid())
        pending = client.request(MsgType.REGISTER_KV, {"keys": ["a"]})
        if refuse:  # none of it was read: sent again over ZMQ, answered there
            assert pending.result()["ok"]
            assert router.requests == [MsgType.REGISTER_KV]
        else:  # maybe served: its outcome is unknown, never sent a second time
            with pytest.raises(MaruConnectionError):
                pending.result()
            assert router.requests == []
    finally:
        server.join(5)
        client.close()
        router.close()
