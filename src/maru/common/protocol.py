"""Wire format shared by client and server.

One ZMQ frame per message: a fixed 16-byte header followed by a msgpack map. On the server's
local Unix socket (same messages, a byte stream) each frame is preceded by its length as a
4-byte big-endian integer (`stream_prefix`, `StreamReader`).

    magic  b"MARU"   4 bytes
    version          1 byte   (PROTOCOL_VERSION)
    msg_type         1 byte   (MsgType)
    flags            2 bytes  (FLAG_REPLY on replies)
    request_id       8 bytes  (echoed in the reply; lets many requests be in flight)

A reply body is `{"ok": True, ...fields}` or `{"ok": False, "code": ErrorCode, "error": str}`.
Only metadata crosses this socket: keys and (region, offset, length) triples, never page bytes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import msgpack

MAGIC = b"MARU"
PROTOCOL_VERSION = 1
HEADER = struct.Struct("!4sBBHQ")
STREAM_LENGTH = struct.Struct("!I")  # frame length on a stream transport
# One read from a stream socket (a longer frame takes several). Below glibc's mmap threshold
# (128 KiB) on purpose: a recv buffer is allocated per read, and at 256 KiB each read paid for
# an mmap and munmap, 20-28 us on the test VM against 1.7 us for 64 KiB.
STREAM_RECV_BYTES = 1 << 16
FLAG_REPLY = 0x1

MAX_KEY_BYTES = 1024
KEY_TYPES = frozenset((str, bytes))  # exactly these: what msgpack decodes a key to
MAX_BATCH = 65536
MAX_FRAME_BYTES = 64 << 20
MAX_LIST_KEYS = 10000  # most keys one KEYS request returns


class MsgType(IntEnum):
    HANDSHAKE = 1
    REQUEST_REGION = 2
    RETURN_REGION = 3
    REGION_ACCESS = 4
    REGISTER_KV = 5
    LOOKUP_KV = 6
    EXISTS = 7
    PIN = 8
    UNPIN = 9
    DELETE_KV = 10
    LIST_ALLOCATIONS = 11
    STATS = 12
    HEARTBEAT = 13
    DELETE_PREFIX = 14
    RELEASE = 15  # end read leases
    EVICT_FOR = 16  # make room in the caller's own regions
    KEYS = 17  # list keys by prefix (operators: `maru keys`), at most MAX_LIST_KEYS


class ErrorCode(IntEnum):
    BAD_FRAME = 1
    BAD_VERSION = 2
    UNKNOWN_TYPE = 3
    BAD_REQUEST = 4
    UNKNOWN_INSTANCE = 5
    UNKNOWN_REGION = 6
    BAD_TOKEN = 7
    NOT_OWNER = 8
    POOL_FULL = 9
    KEY_TOO_LONG = 10
    INTERNAL = 11


class RegisterStatus(IntEnum):
    """Per-key outcome of REGISTER_KV."""

    REGISTERED = 0
    EXISTS = 1  # first writer won; the caller's bytes are not referenced and may be reused
    REJECTED = 2  # location invalid (outside the caller's region, unknown region, bad key)


class DeleteStatus(IntEnum):
    DELETED = 0
    NOT_FOUND = 1
    PINNED = 2


class ProtocolError(Exception):
    """A frame could not be decoded or a request is invalid; carries the wire error code."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Header:
    version: int
    msg_type: int
    flags: int
    request_id: int


def encode(msg_type: int, request_id: int, body: dict[str, Any], *, reply: bool = False) -> bytes:
    flags = FLAG_REPLY if reply else 0
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, int(msg_type), flags, request_id) + msgpack.packb(
        body, use_bin_type=True
    )


def encode_error(msg_type: int, request_id: int, code: ErrorCode, message: str) -> bytes:
    return encode(
        msg_type, request_id, {"ok": False, "code": int(code), "error": message}, reply=True
    )


def decode_header(frame: bytes) -> Header:
    if len(frame) < HEADER.size:
        raise ProtocolError(
            ErrorCode.BAD_FRAME, f"frame of {len(frame)} bytes is shorter than the header"
        )
    magic, version, msg_type, flags, request_id = HEADER.unpack_from(frame)
    if magic != MAGIC:
        raise ProtocolError(ErrorCode.BAD_FRAME, "bad magic: not a Maru frame")
    return Header(version, msg_type, flags, request_id)


def decode(frame: bytes) -> tuple[Header, dict[str, Any]]:
    """Decode a whole frame; raises ProtocolError with the code the peer should see."""
    header = decode_header(frame)
    return header, decode_body(frame, header)


def decode_body(frame: bytes, header: Header) -> dict[str, Any]:
    """The body of a frame whose header `decode_header` already read (the server reads the
    header first, so that even a bad body gets an error reply with the right request id)."""
    if header.version != PROTOCOL_VERSION:
        raise ProtocolError(
            ErrorCode.BAD_VERSION,
            f"protocol version {header.version} unsupported (server speaks {PROTOCOL_VERSION})",
        )
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"frame of {len(frame)} bytes exceeds the limit")
    try:
        body = msgpack.unpackb(
            memoryview(frame)[HEADER.size :],
            raw=False,
            strict_map_key=False,
            max_bin_len=MAX_FRAME_BYTES,
            max_str_len=MAX_FRAME_BYTES,
            max_array_len=4 * MAX_BATCH,
            max_map_len=4 * MAX_BATCH,
        )
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(ErrorCode.BAD_FRAME, f"body is not valid msgpack: {exc}") from None
    if not isinstance(body, dict):
        raise ProtocolError(ErrorCode.BAD_FRAME, "body must be a msgpack map")
    return body


def stream_prefix(frame: bytes) -> bytes:
    """The length prefix that precedes `frame` on a stream transport."""
    return STREAM_LENGTH.pack(len(frame))


class StreamReader:
    """Cuts a byte stream into frames. `feed` bytes as they arrive, then take the complete
    frames from `frames()`. A length above MAX_FRAME_BYTES is a ProtocolError: the stream
    cannot be resynchronised after it, so the caller closes the connection."""

    __slots__ = ("_buffer",)

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> None:
        self._buffer += data

    def frames(self, limit: int | None = None) -> list[bytes]:
        """The complete frames buffered (at most `limit`; the rest stay for the next call)."""
        out: list[bytes] = []
        buffer = self._buffer
        start, size = 0, len(buffer)
        prefix = STREAM_LENGTH.size
        while size - start >= prefix and (limit is None or len(out) < limit):
            (length,) = STREAM_LENGTH.unpack_from(buffer, start)
            if length > MAX_FRAME_BYTES + HEADER.size:
                raise ProtocolError(
                    ErrorCode.BAD_FRAME, f"frame of {length} bytes exceeds the limit"
                )
            end = start + prefix + length
            if end > size:
                break
            out.append(bytes(buffer[start + prefix : end]))
            start = end
        if start:
            del buffer[:start]
        return out

    def has_frame(self) -> bool:
        """Whether a complete frame is buffered."""
        buffer = self._buffer
        if len(buffer) < STREAM_LENGTH.size:
            return False
        (length,) = STREAM_LENGTH.unpack_from(buffer)
        return len(buffer) >= STREAM_LENGTH.size + length

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as frames."""
        return len(self._buffer)


def unix_address(address: str) -> str:
    """A Unix socket address as `socket` takes it: "@name" is Linux's abstract namespace."""
    return "\0" + address[1:] if address.startswith("@") else address
