"""A failed connect says which failure it was (down, refused, another version), as
a `MaruConnectError` subclass whose message starts with the seed's `Failed to connect
MaruHandler to <url>`; it is said once (one WARNING, no second attempt in `with`), and a port
where nothing listens fails at once rather than after the RPC deadline."""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import zmq

from maru import (
    MaruConnectError,
    MaruConnectRefused,
    MaruError,
    MaruHandler,
    MaruServerDown,
    MaruVersionMismatch,
)
from maru.common import protocol


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def warnings_naming(caplog, url: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and url in r.getMessage()
    ]


@pytest.mark.timeout(30)
def test_nobody_listening_fails_at_once_and_says_it_once(caplog):
    url = f"tcp://127.0.0.1:{free_port()}"
    with caplog.at_level(logging.WARNING, logger="maru"):
        # a deadline far beyond the test's timeout: only the TCP probe can fail this in time
        h = MaruHandler(server_url=url, timeout_ms=600_000)
        assert not h.connected
        error = h.connect_error
        assert isinstance(error, MaruServerDown)
        assert isinstance(error, MaruConnectError) and isinstance(error, MaruError)
        assert isinstance(error, RuntimeError)  # what the seed raised
        assert str(error) == (
            f"Failed to connect MaruHandler to {url}: maru-server is down or unreachable "
            "(connection refused: is maru-server running on that port?)"
        )
        with pytest.raises(MaruServerDown) as raised:
            h.__enter__()  # the constructor's error, not a second attempt
        assert raised.value is error
    assert warnings_naming(caplog, url) == [str(error)]


@pytest.mark.timeout(30)
def test_a_port_that_never_answers_is_down_after_the_deadline():
    with socket.socket() as listener:  # accepts TCP, never speaks ZMTP
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        url = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
        with pytest.raises(MaruServerDown, match=r"^Failed to connect MaruHandler to .*300 ms"):
            MaruHandler(server_url=url, timeout_ms=300).__enter__()


@contextmanager
def fake_server(reply_body: dict, version: int = protocol.PROTOCOL_VERSION) -> Iterator[str]:
    """A ROUTER that answers the first request with `reply_body` in protocol `version`."""
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")

    def serve() -> None:
        if router.poll(10_000):
            peer, frame = router.recv_multipart()
            header = protocol.decode_header(frame)
            reply = protocol.encode(
                header.msg_type, header.request_id, reply_body, reply=True, version=version
            )
            router.send_multipart([peer, reply])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"tcp://127.0.0.1:{port}"
    finally:
        thread.join(10)
        router.close(linger=0)


@pytest.mark.timeout(30)
def test_a_server_of_another_version():
    with fake_server({"ok": True}, version=protocol.PROTOCOL_VERSION + 1) as url:
        h = MaruHandler(server_url=url, timeout_ms=5000)
    assert isinstance(h.connect_error, MaruVersionMismatch)
    assert str(h.connect_error).startswith(f"Failed to connect MaruHandler to {url}: ")
    assert f"version {protocol.PROTOCOL_VERSION + 1}" in str(h.connect_error)
    h.close()


@pytest.mark.timeout(30)
def test_a_server_that_refuses_the_handshake():
    body = {"ok": False, "code": int(protocol.ErrorCode.BAD_REQUEST), "error": "no thanks"}
    with fake_server(body) as url:
        h = MaruHandler(server_url=url, timeout_ms=5000)
    assert isinstance(h.connect_error, MaruConnectRefused)
    assert str(h.connect_error) == (
        f"Failed to connect MaruHandler to {url}: the server refused the connection (no thanks)"
    )
    h.close()


@contextmanager
def http_server() -> Iterator[str]:
    """A real HTTP server (Python's), on a port a client mistakes for maru-server's."""
    from http.server import HTTPServer, SimpleHTTPRequestHandler

    server = HTTPServer(("127.0.0.1", 0), SimpleHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"tcp://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


@pytest.mark.timeout(60)
def test_something_else_on_the_port_is_said_at_once():
    """Not "down or unreachable" after the deadline: what answered was not maru-server."""
    with http_server() as url:
        # a deadline beyond the test's timeout: only the probe can tell this in time
        h = MaruHandler(server_url=url, timeout_ms=600_000)
    assert isinstance(h.connect_error, MaruConnectRefused)
    assert str(h.connect_error).startswith(
        f"Failed to connect MaruHandler to {url}: something other than maru-server answered "
        "on that port (it sent b'"  # (Python's server answers a line it cannot parse)
    )
    h.close()
