"""Wire format: round trips, error replies, and garbage that must raise ProtocolError."""

from __future__ import annotations

import random

import msgpack
import pytest

from maru.common import protocol
from maru.common.protocol import (
    FLAG_REPLY,
    HEADER,
    MAGIC,
    PROTOCOL_VERSION,
    ErrorCode,
    MsgType,
    ProtocolError,
)


def test_round_trip_request():
    body = {"iid": "inst", "keys": ["a", b"\x00\xff", "ü" * 10], "n": 2**40, "none": None}
    frame = protocol.encode(MsgType.LOOKUP_KV, 123456789012, body)
    assert frame[:4] == MAGIC
    header, decoded = protocol.decode(frame)
    assert header.version == PROTOCOL_VERSION
    assert header.msg_type == MsgType.LOOKUP_KV
    assert header.flags == 0
    assert header.request_id == 123456789012
    assert decoded == body
    assert isinstance(decoded["keys"][1], bytes)  # bin stays bin, str stays str


def test_round_trip_reply_flag_and_int_keys():
    frame = protocol.encode(MsgType.STATS, 7, {"ok": True, 5: "int key"}, reply=True)
    header, body = protocol.decode(frame)
    assert header.flags & FLAG_REPLY
    assert body == {"ok": True, 5: "int key"}


def test_error_reply():
    frame = protocol.encode_error(MsgType.REGISTER_KV, 9, ErrorCode.BAD_TOKEN, "nope")
    header, body = protocol.decode(frame)
    assert header.request_id == 9 and header.flags & FLAG_REPLY
    assert body == {"ok": False, "code": int(ErrorCode.BAD_TOKEN), "error": "nope"}


def test_max_request_id():
    frame = protocol.encode(MsgType.HEARTBEAT, 2**64 - 1, {})
    assert protocol.decode(frame)[0].request_id == 2**64 - 1


def _frame(magic=MAGIC, version=PROTOCOL_VERSION, msg_type=1, body=b"\x80"):
    return HEADER.pack(magic, version, msg_type, 0, 1) + body


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        (b"", ErrorCode.BAD_FRAME),
        (b"MARU", ErrorCode.BAD_FRAME),
        (b"x" * 15, ErrorCode.BAD_FRAME),
        (_frame(magic=b"XXXX"), ErrorCode.BAD_FRAME),
        (_frame(version=PROTOCOL_VERSION + 1), ErrorCode.BAD_VERSION),
        (_frame(version=0), ErrorCode.BAD_VERSION),
        (_frame(body=b""), ErrorCode.BAD_FRAME),  # no body at all
        (_frame(body=b"\xc1"), ErrorCode.BAD_FRAME),  # reserved msgpack byte
        (_frame(body=b"\x81\xa1a"), ErrorCode.BAD_FRAME),  # truncated map
        (_frame(body=msgpack.packb([1, 2, 3])), ErrorCode.BAD_FRAME),  # not a map
        (_frame(body=msgpack.packb("str")), ErrorCode.BAD_FRAME),
        (_frame(body=msgpack.packb({}) + b"trailing"), ErrorCode.BAD_FRAME),
    ],
)
def test_garbage_raises_protocol_error(frame, code):
    with pytest.raises(ProtocolError) as exc:
        protocol.decode(frame)
    assert exc.value.code == code


def test_decode_header_survives_a_bad_body():
    """The server needs msg_type and request_id to address its error reply."""
    header = protocol.decode_header(_frame(msg_type=77, body=b"\xc1"))
    assert header.msg_type == 77 and header.request_id == 1


def test_oversized_frame_rejected():
    frame = _frame(body=b"\x80" + b"\x00" * (protocol.MAX_FRAME_BYTES - HEADER.size))
    assert len(frame) > protocol.MAX_FRAME_BYTES
    with pytest.raises(ProtocolError) as exc:
        protocol.decode(frame)
    assert exc.value.code == ErrorCode.BAD_FRAME


def test_random_garbage_only_ever_raises_protocol_error():
    rng = random.Random(42)
    for _ in range(2000):
        n = rng.randint(0, 64)
        tail = bytes(rng.getrandbits(8) for _ in range(n))
        frame = HEADER.pack(MAGIC, PROTOCOL_VERSION, rng.randint(0, 255), 0, 0) + tail
        try:
            _, body = protocol.decode(frame)
        except ProtocolError as exc:
            assert exc.code == ErrorCode.BAD_FRAME
        else:
            assert isinstance(body, dict)


def test_stream_reader_cuts_frames_across_arbitrary_reads():
    frames = [protocol.encode(MsgType.EXISTS, i, {"keys": ["k" * i]}) for i in range(1, 6)]
    stream = b"".join(protocol.stream_prefix(f) + f for f in frames)
    reader = protocol.StreamReader()
    got = []
    for i in range(0, len(stream), 7):  # 7-byte reads split prefixes and bodies
        reader.feed(stream[i : i + 7])
        got += reader.frames()
    assert got == frames and reader.buffered == 0 and not reader.has_frame()


def test_stream_reader_limit_leaves_the_rest_buffered():
    frame = protocol.encode(MsgType.HEARTBEAT, 1, {})
    reader = protocol.StreamReader()
    reader.feed((protocol.stream_prefix(frame) + frame) * 3)
    assert reader.frames(2) == [frame, frame]
    assert reader.has_frame()
    assert reader.frames() == [frame] and not reader.has_frame()


def test_stream_reader_refuses_an_impossible_length():
    reader = protocol.StreamReader()
    reader.feed(protocol.STREAM_LENGTH.pack(protocol.MAX_FRAME_BYTES + protocol.HEADER.size + 1))
    with pytest.raises(protocol.ProtocolError) as exc:
        reader.frames()
    assert exc.value.code == protocol.ErrorCode.BAD_FRAME


@pytest.mark.parametrize(
    ("key", "code"),
    [
        ("", ErrorCode.BAD_REQUEST),
        (b"", ErrorCode.BAD_REQUEST),
        (5, ErrorCode.BAD_REQUEST),
        ("x" * (protocol.MAX_KEY_BYTES + 1), ErrorCode.KEY_TOO_LONG),
        ("é" * (protocol.MAX_KEY_BYTES // 2 + 1), ErrorCode.KEY_TOO_LONG),  # 2 bytes each
    ],
)
def test_the_key_check_refuses_empty_mistyped_and_long_keys(key, code):
    with pytest.raises(ProtocolError) as exc:
        protocol.check_key(key)
    assert exc.value.code == code
    assert protocol.all_keys_valid(["fine", key]) is False
    assert protocol.all_keys_valid(["fine", "x" * protocol.MAX_KEY_BYTES, b"k"]) is True


def test_the_rpc_client_sends_the_frame_protocol_encode_makes():
    """The client builds a request's frame itself (the data path's one request form): it must
    be byte for byte what `protocol.encode` makes, which the server decodes."""
    import itertools
    from types import SimpleNamespace

    from maru.client.rpc import _Channel

    sent: list[bytes] = []
    client = SimpleNamespace(max_inflight=4, request_ids=itertools.count(2**40))
    channel = _Channel(client, "test")  # type: ignore[arg-type]
    channel._send = sent.append  # type: ignore[method-assign]
    body = {"iid": "inst", "keys": ["a", b"\x00\xff"], "n": 2**40, "none": None}
    channel.request(MsgType.REGISTER_KV, body)
    assert sent == [protocol.encode(MsgType.REGISTER_KV, 2**40, body)]
