"""MaruService.handle_frame: every frame gets exactly one reply, garbage included, and the
service keeps working afterwards. (The socket loop is covered by the integration tests.)"""

from __future__ import annotations

import msgpack
import pytest

from maru.common import protocol
from maru.common.protocol import HEADER, MAGIC, MAX_KEY_BYTES, ErrorCode, MsgType

from .service_calls import call, make_service, ok

MiB = 1 << 20


@pytest.fixture
def service(tmp_path):
    svc = make_service(tmp_path, pool_mib=16)
    yield svc
    svc.close()


def err(svc, msg_type, body) -> ErrorCode:
    reply = call(svc, msg_type, body)
    assert reply["ok"] is False, reply
    assert isinstance(reply["error"], str) and reply["error"]
    return ErrorCode(reply["code"])


def raw(svc, frame):
    return protocol.decode(svc.handle_frame(frame))


def test_handshake_region_register_lookup(service):
    hs = ok(service, MsgType.HANDSHAKE, {"iid": "A", "pid": 1})
    assert hs["regions"] == [] and hs["version"] == protocol.PROTOCOL_VERSION
    region = ok(service, MsgType.REQUEST_REGION, {"iid": "A", "size": MiB})["region"]
    rid = region[0]
    reply = ok(service, MsgType.REGISTER_KV, {"iid": "A", "entries": [["k", rid, 0, 5]]})
    assert reply["results"] == [0]
    reply = ok(service, MsgType.LOOKUP_KV, {"keys": ["k", "x"]})
    assert reply["locations"] == [[rid, 0, 5], None]
    assert reply["regions"] == [region]
    assert ok(service, MsgType.EXISTS, {"keys": ["k", "x"]})["results"] == [True, False]
    assert ok(service, MsgType.HEARTBEAT, {})["ok"] is True
    stats = ok(service, MsgType.STATS, {})["stats"]
    assert stats["keys"] == 1 and stats["operations"]["register_kv"]["count"] == 1


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"hello",
        b"\x00" * 100,
        b"GET / HTTP/1.1\r\n\r\n",
        HEADER.pack(b"XXXX", 1, 1, 0, 5) + msgpack.packb({}),
    ],
)
def test_garbage_gets_bad_frame(service, frame):
    _, body = raw(service, frame)
    assert body["ok"] is False and body["code"] == ErrorCode.BAD_FRAME


def test_bad_body_keeps_request_id(service):
    header, body = raw(service, HEADER.pack(MAGIC, 1, MsgType.STATS, 0, 77) + b"\xc1")
    assert header.request_id == 77 and header.msg_type == MsgType.STATS
    assert body["code"] == ErrorCode.BAD_FRAME


def test_bad_version(service):
    _, body = raw(service, HEADER.pack(MAGIC, 99, MsgType.STATS, 0, 3) + msgpack.packb({}))
    assert body["code"] == ErrorCode.BAD_VERSION
    assert "99" in body["error"]


@pytest.mark.parametrize("msg_type", [0, 200, 255])
def test_unknown_message_type(service, msg_type):
    assert err(service, msg_type, {}) == ErrorCode.UNKNOWN_TYPE


@pytest.mark.parametrize(
    ("msg_type", "body", "code"),
    [
        (MsgType.HANDSHAKE, {}, ErrorCode.BAD_REQUEST),
        (MsgType.HANDSHAKE, {"iid": 5}, ErrorCode.BAD_REQUEST),
        (MsgType.REQUEST_REGION, {"iid": "nobody", "size": MiB}, ErrorCode.UNKNOWN_INSTANCE),
        (MsgType.REQUEST_REGION, {"iid": "A", "size": True}, ErrorCode.BAD_REQUEST),
        (MsgType.REQUEST_REGION, {"iid": "A", "size": "big"}, ErrorCode.BAD_REQUEST),
        (MsgType.REQUEST_REGION, {"iid": "A", "size": 1 << 40}, ErrorCode.POOL_FULL),
        (MsgType.REGISTER_KV, {"iid": "A"}, ErrorCode.BAD_REQUEST),
        (MsgType.REGISTER_KV, {"iid": "A", "entries": "nope"}, ErrorCode.BAD_REQUEST),
        (MsgType.REGISTER_KV, {"iid": "ghost", "entries": []}, ErrorCode.UNKNOWN_INSTANCE),
        (MsgType.LOOKUP_KV, {"keys": "k"}, ErrorCode.BAD_REQUEST),
        (MsgType.LOOKUP_KV, {"keys": [None]}, ErrorCode.BAD_REQUEST),
        (MsgType.LOOKUP_KV, {"keys": ["k" * (MAX_KEY_BYTES + 1)]}, ErrorCode.KEY_TOO_LONG),
        (MsgType.LOOKUP_KV, {"keys": [b"k" * (MAX_KEY_BYTES + 1)]}, ErrorCode.KEY_TOO_LONG),
        (MsgType.LOOKUP_KV, {"keys": ["é" * 600]}, ErrorCode.KEY_TOO_LONG),  # 1200 bytes
        (MsgType.EXISTS, {"keys": ["k" * 5000]}, ErrorCode.KEY_TOO_LONG),
        (MsgType.PIN, {"keys": ["k" * 5000]}, ErrorCode.KEY_TOO_LONG),
        (MsgType.DELETE_KV, {"keys": ["k" * 5000]}, ErrorCode.KEY_TOO_LONG),
        (MsgType.LOOKUP_KV, {"keys": ["k"] * (protocol.MAX_BATCH + 1)}, ErrorCode.BAD_REQUEST),
        (MsgType.RETURN_REGION, {"iid": "A", "region_id": 1, "token": "x"}, ErrorCode.BAD_TOKEN),
        (MsgType.RETURN_REGION, {"iid": "A", "region_id": 42}, ErrorCode.UNKNOWN_REGION),
        (MsgType.REGION_ACCESS, {"region_id": 1, "token": "0" * 32}, ErrorCode.BAD_TOKEN),
        (MsgType.REGION_ACCESS, {"region_id": "1"}, ErrorCode.UNKNOWN_REGION),
    ],
)
def test_bad_requests_get_error_replies(service, msg_type, body, code):
    ok(service, MsgType.HANDSHAKE, {"iid": "A"})
    ok(service, MsgType.REQUEST_REGION, {"iid": "A", "size": MiB})
    assert err(service, msg_type, body) == code
    # and the service still works
    assert ok(service, MsgType.EXISTS, {"keys": ["k"]})["results"] == [False]


def test_key_of_maximum_length_is_fine(service):
    reply = ok(service, MsgType.LOOKUP_KV, {"keys": ["k" * MAX_KEY_BYTES, b"k" * MAX_KEY_BYTES]})
    assert reply["locations"] == [None, None]


def test_handler_bug_becomes_internal_error(service, monkeypatch):
    def boom(keys):
        raise RuntimeError("kaboom")

    monkeypatch.setattr(service.registry, "exists", boom)
    reply = call(service, MsgType.EXISTS, {"keys": ["k"]})
    assert reply["ok"] is False and reply["code"] == ErrorCode.INTERNAL
    assert "kaboom" in reply["error"]
    monkeypatch.undo()
    assert ok(service, MsgType.EXISTS, {"keys": ["k"]})["results"] == [False]


def test_freed_locations_piggyback_on_the_owners_next_reply(service):
    ok(service, MsgType.HANDSHAKE, {"iid": "A"})
    ok(service, MsgType.HANDSHAKE, {"iid": "B"})
    rid = ok(service, MsgType.REQUEST_REGION, {"iid": "A", "size": MiB})["region"][0]
    ok(service, MsgType.REGISTER_KV, {"iid": "A", "entries": [["k", rid, 4096, 10]]})
    # B deletes A's key: B's reply carries nothing, A's next reply carries the location
    assert "freed" not in ok(service, MsgType.DELETE_KV, {"iid": "B", "keys": ["k"]})
    assert ok(service, MsgType.HEARTBEAT, {"iid": "A"})["freed"] == [[rid, 4096, 10]]
    assert "freed" not in ok(service, MsgType.HEARTBEAT, {"iid": "A"})
