"""`PendingReply.arrived()`: a write asks it while its copier threads copy into a region, so it
must say True only for a reply that `result()` gives at once without another request: never
one that makes the client handshake again (which may unmap that region). A scripted ZMQ
ROUTER plays the server."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from maru.client.rpc import RpcClient
from maru.common import protocol
from maru.common.errors import MaruServerError
from maru.common.protocol import ErrorCode, MsgType

REPLIES = [
    {"ok": True, "results": [1]},
    {"ok": False, "code": int(ErrorCode.UNKNOWN_INSTANCE), "error": "unknown instance"},
    {"ok": False, "code": int(ErrorCode.KEY_TOO_LONG), "error": "key too long"},
]


def _serve(router: zmq.Socket) -> None:
    """Answer one request per scripted reply, in order."""
    for body in REPLIES:
        if not router.poll(5000):
            return
        peer, frame = router.recv_multipart()
        header = protocol.decode_header(frame)
        reply = protocol.encode(header.msg_type, header.request_id, body, reply=True)
        router.send_multipart([peer, reply])


def _in(pending, seconds: float = 5.0) -> None:
    """Until the reply has reached the client (arrived() takes it in as it looks)."""
    deadline = time.monotonic() + seconds
    while pending.body is None and time.monotonic() < deadline:
        pending.arrived()
        time.sleep(0.005)
    assert pending.body is not None


def test_arrived_only_for_replies_that_need_no_further_request():
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    thread = threading.Thread(target=_serve, args=(router,), daemon=True)
    thread.start()
    handshakes: list[int] = []

    def rehandshake(msg_type: int, request: dict) -> dict:
        handshakes.append(msg_type)
        raise MaruServerError(ErrorCode.UNKNOWN_INSTANCE, "not again (test)")

    client = RpcClient(f"tcp://127.0.0.1:{port}", timeout_ms=3000, on_unknown_instance=rehandshake)
    try:
        ok = client.request(MsgType.REGISTER_KV, {"keys": ["a"]})
        _in(ok)
        assert ok.arrived() and ok.result()["results"] == [1]

        unknown = client.request(MsgType.REGISTER_KV, {"keys": ["b"]})
        _in(unknown)
        assert not unknown.arrived()  # in, but result() would handshake again
        assert handshakes == []  # arrived() itself never does
        with pytest.raises(MaruServerError):
            unknown.result()
        assert handshakes == [MsgType.REGISTER_KV]

        refused = client.request(MsgType.REGISTER_KV, {"keys": ["c" * 10]})
        _in(refused)
        assert refused.arrived()  # an error reply: result() raises it at once
        with pytest.raises(MaruServerError) as exc:
            refused.result()
        assert exc.value.code == ErrorCode.KEY_TOO_LONG
    finally:
        thread.join(5)
        client.close()
        router.close(linger=0)
