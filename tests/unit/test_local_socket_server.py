"""`LocalSocketServer` in-process: what the RPC loop relies on when the system runs short."""

from __future__ import annotations

import os
import resource
import socket
import time
import uuid

import zmq

from maru.common import protocol
from maru.common.protocol import MsgType, unix_address
from maru.server.local_socket import LocalSocketServer


def _lowest_free_fd() -> int:
    fd = os.dup(0)
    os.close(fd)
    return fd


def test_out_of_file_descriptors_pauses_accepting_instead_of_spinning():
    """A failed accept leaves the connection queued and the listener readable: polling it
    would spin at 100% CPU. The server stops watching it for a while, then accepts again."""
    server = LocalSocketServer(f"@maru-test-{uuid.uuid4().hex}")
    poller = zmq.Poller()
    server.attach(poller)
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.settimeout(10)
    answered: list[bytes] = []

    def handle(frame: bytes, peer: object = None) -> bytes:
        answered.append(frame)
        return protocol.encode(MsgType.HEARTBEAT, 1, {"ok": True}, reply=True)

    try:
        client.connect(unix_address(server.address))
        listener_fd = server.listener.fileno()
        assert dict(poller.poll(5000)).get(listener_fd)
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (_lowest_free_fd(), hard))
        try:
            server.serve(dict(poller.poll(0)), handle)  # accept fails: EMFILE
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert server.accept_paused_until > time.monotonic()
        assert not server.connections
        assert listener_fd not in dict(poller.poll(100))  # not watched: no spinning
        server.resume_accepting_if_due(server.accept_paused_until + 0.1)
        assert server.accept_paused_until == 0.0
        server.serve(dict(poller.poll(5000)), handle)  # the queued connection, accepted now
        assert len(server.connections) == 1
        request = protocol.encode(MsgType.HEARTBEAT, 1, {})
        client.sendall(protocol.stream_prefix(request) + request)
        deadline = time.monotonic() + 5
        while not answered and time.monotonic() < deadline:
            server.serve(dict(poller.poll(100)), handle)
        assert answered == [request]
        reader = protocol.StreamReader()
        while not reader.has_frame():
            reader.feed(client.recv(65536))
        header, body = protocol.decode(reader.frames()[0])
        assert header.msg_type == MsgType.HEARTBEAT and body["ok"] is True
    finally:
        client.close()
        server.close()


def test_auto_names_differ_between_servers_and_survive_restarts(tmp_path):
    """Two servers in different network namespaces can both be `tcp://0.0.0.0:5555`; a client
    told the name of one must never reach the other under the same name. The tag comes from
    the state dir's secret: stable across restarts, different between servers."""
    from maru.server.local_socket import local_address
    from maru.server.token import TokenSigner, load_or_create_secret

    endpoint = "tcp://0.0.0.0:5555"
    first = TokenSigner(load_or_create_secret(tmp_path / "a")).server_tag()
    again = TokenSigner(load_or_create_secret(tmp_path / "a")).server_tag()
    other = TokenSigner(load_or_create_secret(tmp_path / "b")).server_tag()
    assert first == again != other
    assert local_address("auto", endpoint, first) == f"@maru:{endpoint}:{first}"
    assert local_address("auto", endpoint, first) != local_address("auto", endpoint, other)
    assert local_address("none", endpoint, first) is None
    assert local_address("/run/maru.sock", endpoint, first) == "/run/maru.sock"
