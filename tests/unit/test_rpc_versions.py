"""A client that meets a server of another protocol version fails the request at once with an
error naming both versions (never a timeout, never a misread reply)."""

from __future__ import annotations

import threading

import pytest
import zmq

from maru.client.rpc import RpcClient
from maru.common import protocol
from maru.common.errors import MaruServerError


@pytest.mark.parametrize("server_version", [1, protocol.PROTOCOL_VERSION + 1])
def test_a_reply_of_another_version_fails_the_request_naming_both(server_version):
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")

    def old_server() -> None:
        # Answers like a server of `server_version` would: a well-formed "ok" in its own
        # version's header.
        if router.poll(5000):
            peer, frame = router.recv_multipart()
            header = protocol.decode_header(frame)
            reply = protocol.encode(
                header.msg_type,
                header.request_id,
                {"ok": True},
                reply=True,
                version=server_version,
            )
            router.send_multipart([peer, reply])

    thread = threading.Thread(target=old_server, daemon=True)
    thread.start()
    client = RpcClient(f"tcp://127.0.0.1:{port}", timeout_ms=3000)
    try:
        with pytest.raises(MaruServerError) as exc:
            client.request(protocol.MsgType.HEARTBEAT, {"iid": "x"}).result()
        assert exc.value.code == protocol.ErrorCode.BAD_VERSION
        message = str(exc.value)
        assert f"version {server_version}" in message
        assert f"version {protocol.PROTOCOL_VERSION}" in message
    finally:
        thread.join(5)
        client.close()
        router.close(linger=0)
