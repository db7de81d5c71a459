"""Wire format shared by client and server.

One ZMQ frame per message: a 16-byte header (`HEADER`: magic, PROTOCOL_VERSION, MsgType, flags
with FLAG_REPLY on replies, a request id the reply echoes) and a msgpack map; on the local Unix
socket each frame is preceded by its 4-byte big-endian length (`stream_prefix`, `StreamReader`).
A reply body is `{"ok": True, ...}` or `{"ok": False, "code": ErrorCode, "error": str}`. Only
metadata crosses the socket, never page bytes. A request without the `session` credential its
HANDSHAKE gave is anonymous (reads and operator actions only).

`MESSAGES` holds each message's one request form and one reply form (docs/protocol.md, from
`python -m maru.common.protocol`). Per-key numbers travel as packed columns of native int64s
(`pack_int64`): client and server share the node.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import msgpack

from maru.common import _keys

MAGIC = b"MARU"
PROTOCOL_VERSION = 4
HEADER = struct.Struct("!4sBBHQ")
STREAM_LENGTH = struct.Struct("!I")  # frame length on a stream transport
# One read from a stream socket (a longer frame takes several): below glibc's mmap threshold
# (128 KiB), so that the recv buffer allocated per read costs no mmap and munmap.
STREAM_RECV_BYTES = 1 << 16
FLAG_REPLY = 0x1

# The checksum column is named after its hash (`maru.common.checksum`): a checksum is only
# compared with one of the same hash, as a column of another name is not read.
CHECKSUMS = "maru64"

MAX_KEY_BYTES = 1024
MAX_KEY_CHARS = MAX_KEY_BYTES // 4  # a key of this many characters is within MAX_KEY_BYTES
KEY_TYPES = frozenset((str, bytes))  # exactly these: what msgpack decodes a key to
Key = str | bytes  # a key of the index (any other type is refused or a miss)
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
    DISCONNECT = 18  # end the caller's instance now: pins, leases and regions let go
    PARK_REGIONS = 19  # an idle owner lets the server take regions back (or takes them again)
    CORRUPT_KV = 20  # a reader's hits unlike their writer's checksum: drop those very entries


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
    STATE_UNAVAILABLE = 12  # the journal cannot be written: changes refused, reads go on
    QUOTA_EXCEEDED = 13  # the instance holds its quota of region bytes or leases
    # CURVE key removed from the allowlist, or not the process holding the session credential,
    # or (request id 0, then the connection closes) a user not allowed on the local socket
    NOT_AUTHORIZED = 14
    # No room now, but instances over their fair share of the pool were asked to give
    # regions back: a region request retried shortly gets one
    POOL_RECLAIMING = 15
    # (request id 0, then the connection closes) the server is short of file descriptors and
    # read none of the connection's requests: the client sends them over TCP instead
    LOCAL_SOCKET_FULL = 16


class RegisterStatus(IntEnum):
    """Per-key outcome of REGISTER_KV."""

    REGISTERED = 0  # also for a key registered before at the very place named (sent twice)
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


def encode(
    msg_type: int,
    request_id: int,
    body: dict[str, Any],
    *,
    reply: bool = False,
    version: int = PROTOCOL_VERSION,
) -> bytes:
    flags = FLAG_REPLY if reply else 0
    return HEADER.pack(MAGIC, version, int(msg_type), flags, request_id) + msgpack.packb(
        body, use_bin_type=True
    )


def encode_error(
    msg_type: int,
    request_id: int,
    code: ErrorCode,
    message: str,
    *,
    version: int = PROTOCOL_VERSION,
) -> bytes:
    """An error reply in header `version`: a peer of another protocol version is answered in
    its own, so it can decode the error (whose body is the same in every version)."""
    return encode(
        msg_type,
        request_id,
        {"ok": False, "code": int(code), "error": message},
        reply=True,
        version=version,
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
        peer, me = ("server", "client") if header.flags & FLAG_REPLY else ("client", "server")
        raise ProtocolError(
            ErrorCode.BAD_VERSION,
            f"protocol version mismatch: this {me} speaks version {PROTOCOL_VERSION}, the "
            f"{peer} speaks version {header.version}; install the same Maru release on both",
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
    """Cuts a byte stream into frames (`feed`, then `frames()`). A length above MAX_FRAME_BYTES
    is a ProtocolError: the stream cannot be resynchronised, so the caller closes it."""

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


# -- keys and packed columns ----------------------------------------------------------------


def check_key_batch(keys: Any) -> None:
    """A batch of keys is a sequence of keys: one str or bytes given as the batch would be
    taken for one key per character (`batch_delete("abc")` deleting "a", "b" and "c")."""
    if isinstance(keys, (str, bytes, bytearray, memoryview)):
        raise TypeError(
            f"keys: a sequence of keys, not one {type(keys).__name__} (a single key: [key])"
        )


def check_key(key: Any) -> str | bytes:
    """The project's one key check: `key` if exactly str or bytes, not empty, at most
    MAX_KEY_BYTES encoded; else ProtocolError (KEY_TOO_LONG or BAD_REQUEST)."""
    if type(key) is str:  # exact types: what msgpack decodes and the key index holds
        if len(key) > MAX_KEY_CHARS and len(key.encode()) > MAX_KEY_BYTES:
            raise ProtocolError(ErrorCode.KEY_TOO_LONG, f"key longer than {MAX_KEY_BYTES} bytes")
    elif type(key) is bytes:
        if len(key) > MAX_KEY_BYTES:
            raise ProtocolError(ErrorCode.KEY_TOO_LONG, f"key longer than {MAX_KEY_BYTES} bytes")
    else:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, f"a key must be str or bytes, got {type(key).__name__}"
        )
    if not key:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "a key must not be empty")
    return key


def all_keys_valid(keys: Sequence[Any]) -> bool:
    """True if every key passes `check_key`: one C pass for the usual batch (only str and
    bytes, none empty, none long enough to need encoding), `check_key` per key otherwise."""
    if _keys.fit(keys, MAX_KEY_CHARS):
        return True
    try:
        for key in keys:
            check_key(key)
    except ProtocolError:
        return False
    return True


INT64 = struct.Struct("=q")
MAX_COUNT = (1 << 63) - 1  # the largest byte count or size a request may carry (an int64)


def check_count(value: Any, name: str) -> int:
    """The one range check of a byte count or size a request carries: `value` if an int (not a
    bool) in [1, MAX_COUNT], as the C key index and the journal hold int64s; else BAD_REQUEST."""
    if type(value) is not int or not 0 < value <= MAX_COUNT:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            f"field {name!r}: expected an integer in [1, {MAX_COUNT}], got {value!r:.40}",
        )
    return value


def pack_int64(values: Any) -> bytes:
    """A packed column: native int64s, one per key (`array('q', values).tobytes()`)."""
    return array("q", values).tobytes()


def freed_columns(freed: bytes) -> tuple[memoryview, memoryview, memoryview]:
    """A reply's `freed` read back: its (region ids, offsets, lengths) columns, one entry a
    page (packed int64 triples, as `Registry._drop_keys` collects them)."""
    if not isinstance(freed, bytes) or len(freed) % (3 * INT64.size):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "field 'freed': expected packed int64 triples")
    triples = memoryview(freed).cast("q")
    return triples[0::3], triples[1::3], triples[2::3]


def freed_notices(freed: bytes) -> list[list[int]]:
    """A reply's `freed` as [region_id, offset, length] lists (tests, the cluster tier)."""
    return [list(notice) for notice in zip(*(c.tolist() for c in freed_columns(freed)))]


def unpack_int64(column: Any, count: int, name: str) -> memoryview:
    """A packed column read back (a memoryview of int64s), checked to hold `count` values."""
    if not isinstance(column, bytes) or len(column) != count * INT64.size:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, f"field {name!r}: expected {count} packed int64 values"
        )
    return memoryview(column).cast("q")


# -- the messages: (field, type, meaning) per field; fields any reply may carry: REPLY_EXTRAS --

I64S = "bytes: packed int64 per key"
HANDLE = "[region_id, path, offset, length, token, owner]"

_LOCAL_READS = (
    "optional: reads the client answered from the local index since its last report, "
    "[lookups, hits, exists, exists hits]; the server counts them as if asked"
)
MESSAGES: dict[MsgType, tuple[list[tuple[str, str, str]], list[tuple[str, str, str]]]] = {
    MsgType.HANDSHAKE: (
        [
            ("name", "str", "the client's name for itself (maru_instance_id); any string"),
            (
                "session",
                "str",
                "optional: the credential of an earlier handshake, to resume its instance if the"
                " server still has it (else a new one); NOT_AUTHORIZED while another process"
                " holds it (docs/reliability.md)",
            ),
            ("pid", "int", "the client's process id (informational)"),
            ("chunk_size", "int", "the client's allocation unit in bytes (statistics)"),
            (
                "nonce",
                "str",
                "fresh random ASCII, 1-64 characters: the server proves it holds the pool key "
                "by the reply's pool.mark.proof of it",
            ),
        ],
        [
            ("iid", "str", "the instance id the server gave: the name, '.', 8 hex digits"),
            ("session", "str", "the credential every later request of the instance carries"),
            ("epoch", "str", "changes on every server start"),
            ("version", "int", "PROTOCOL_VERSION"),
            (
                "pool",
                "map",
                "pool kind, path, capacity, used, free, generation, and mark: {generation, "
                "epoch, file, offset, span, proof, live}, what the pool's mark holds and where "
                "it lies (in `file` under the pool's path, '' for the pool file itself: `span` "
                "bytes mapped at `offset`), an HMAC of the request's nonce keyed by the pool "
                "key in the mark (`maru.common.poolmark.server_proof`; the key itself is never "
                "sent), and the live count the server wrote beside the mark for this handshake "
                "(shm and devdax pools; absent elsewhere); a client reads the mark and the count "
                "through the path it maps and checks them before it uses the pool: a count "
                "below `live` is a copy of the pool (docs/reliability.md)",
            ),
            ("regions", f"[{HANDLE}]", "regions the instance owns"),
            ("heartbeat_interval", "float", "seconds between heartbeats"),
            ("local_socket", "str | nil", "the server's Unix socket, if any"),
            ("uid", "int", "the server's user id: clients use the Unix socket only if it is its"),
            (
                "local_index",
                "str | nil",
                "the path of the server's shared key index (docs/architecture.md); only in a "
                "reply on the Unix socket, else nil",
            ),
            (
                "pool_index",
                "map | nil",
                "the in-pool key index (maru-server --index-slots), in every reply: {file, "
                "offset, length, slots, id}: `length` bytes at `offset` of `file` under the "
                "pool's path ('' for the pool file itself), mapped through the path the client "
                "proved the pool's mark at; `id` is the table's index id (docs/architecture.md)",
            ),
            (
                "coherence",
                "str",
                "'hardware' or 'software' (`--coherence`): whether the copies into and out of "
                "the pool flush their cache lines (docs/architecture.md, Coherence); absent "
                "from an older server: hardware",
            ),
            (
                "cluster",
                "map | nil",
                "{kind, lookup_ms}: a cluster tier is behind the pool (`--cluster`) and a "
                "lookup may wait lookup_ms for its misses to be pulled (EXISTS with `pull`); "
                "nil or absent: none",
            ),
        ],
    ),
    MsgType.REQUEST_REGION: (
        [
            ("session", "str", "the owner"),
            ("size", "int", "bytes wanted (rounded up to the pool's alignment)"),
            (
                "min_size",
                "int",
                "optional, default size: the least accepted, reclaiming idle regions to make room",
            ),
            (
                "ahead",
                "bool",
                "optional, default false: a region taken ahead of need (the client's "
                "`RegionSupply.ready`): `POOL_FULL` at once where the pool has no free room for "
                "it, nothing reclaimed (no key evicted) for it",
            ),
            (
                "pool_proof",
                "str",
                "the owner's proof that it reads the pool: an HMAC of its instance id keyed by "
                "the pool key in the pool's mark, which never crosses a socket "
                "(`maru.common.poolmark.pool_proof`); NOT_AUTHORIZED without it",
            ),
        ],
        [("region", HANDLE, "the new region, writable by its owner")],
    ),
    MsgType.RETURN_REGION: (
        [
            ("session", "str", "the owner"),
            ("region_id", "int", ""),
            ("token", "str", "its HMAC token"),
        ],
        [],
    ),
    MsgType.REGION_ACCESS: (
        [("region_id", "int", ""), ("token", "str", "its HMAC token")],
        [("region", HANDLE, "")],
    ),
    MsgType.REGISTER_KV: (
        [
            ("session", "str", "the owner of the regions"),
            ("keys", "[str | bytes]", "keys to seal"),
            ("region_ids", I64S, "where each key's bytes are"),
            ("offsets", I64S, "byte offset in the region"),
            ("lengths", I64S, "byte length (> 0)"),
            (
                CHECKSUMS,
                I64S,
                "optional: the writer's maru64 checksum of each value's bytes as stored (as "
                "int64; 0: none), kept with the key",
            ),
            (
                "ahead",
                "int",
                "optional: bytes to evict in the caller's own regions before these keys are "
                "sealed (never one of them), room for its next writes (as EVICT_FOR's "
                "`ahead`: room already on its way is not evicted again); the pages come back "
                "as `freed`",
            ),
            (
                "behind",
                "bool",
                "optional, default false: the writer reads this reply only after its next copy "
                "(write-behind), so the server need not stay awake for its next request "
                "(`--busy-poll-us`) unless its seals come close together",
            ),
            (
                "tokens",
                "[[int, str]]",
                "optional: [region id, token] of each region named, as granted; a key in a "
                "region whose token is another (the server knows another region by that id: "
                "it restarted on a new pool or state) is REJECTED. Maru's clients send it",
            ),
        ],
        [("results", "[int]", "RegisterStatus per key")],
    ),
    MsgType.LOOKUP_KV: (
        [
            ("session", "str", "optional: counts hits per instance; a lease needs it"),
            ("keys", "[str | bytes]", ""),
            ("lease", "bool", "hold the hits against eviction and deletion until RELEASE"),
        ],
        [
            ("region_ids", I64S, "0 for a miss (region ids start at 1)"),
            ("offsets", I64S, "0 for a miss"),
            ("lengths", I64S, "0 for a miss"),
            (CHECKSUMS, I64S, "the writer's maru64; 0 for a miss or a key stored without one"),
            ("regions", f"[{HANDLE}]", "handles of the regions the hits live in"),
            ("lease_id", "int", "0: no lease taken"),
        ],
    ),
    MsgType.EXISTS: (
        [
            ("session", "str", "optional"),
            ("keys", "[str | bytes]", ""),
            (
                "pull",
                "bool",
                "optional: pull the misses the server's cluster tier may hold (ask again while "
                "`pulling` > 0, within the HANDSHAKE's lookup_ms)",
            ),
            (
                "wait_ms",
                "int",
                "optional, with `pull`: the reply waits until none of the misses is being "
                "pulled, or this long (at most lookup_ms): the client is answered when its pulls "
                "land instead of asking again; a server without it answers at once",
            ),
        ],
        [
            ("results", "[bool]", "per key"),
            (
                "pulling",
                "int",
                "how many of the misses are being pulled now (0 without `pull` or a tier; with "
                "`wait_ms`, those still on their way when the wait ended)",
            ),
        ],
    ),
    MsgType.PIN: (
        [
            ("session", "str", "the pin holder"),
            ("keys", "[str | bytes]", ""),
            (
                "leading",
                "bool",
                "optional, default false: pin only the keys from the start up to the first "
                "that does not exist (a prefix lookup's hits); those after it are neither "
                "pinned nor reported true. Without it, every key that exists is pinned",
            ),
        ],
        [("results", "[bool]", "pinned, per key")],
    ),
    MsgType.UNPIN: (
        [("session", "str", "the pin holder"), ("keys", "[str | bytes]", "")],
        [("results", "[bool]", "unpinned, per key")],
    ),
    MsgType.DELETE_KV: (
        [("session", "str", "optional"), ("keys", "[str | bytes]", "")],
        [("results", "[int]", "DeleteStatus per key")],
    ),
    MsgType.CORRUPT_KV: (
        [
            ("session", "str", "the reader reporting (logged); optional"),
            (
                "keys",
                "[str | bytes]",
                "hits whose bytes the reader found unlike their writer's checksum under a "
                "lease that held (or through the local index, its slot unchanged); sent once "
                "a lookup, not waited for",
            ),
            ("region_ids", I64S, "where the reader was told each key lies (LOOKUP_KV's)"),
            ("offsets", I64S, "likewise"),
            ("lengths", I64S, "likewise"),
            (CHECKSUMS, I64S, "the writer's checksum the reader was given"),
        ],
        [
            (
                "results",
                "[int]",
                "DeleteStatus per key: DELETED, the entry dropped; NOT_FOUND, the key is gone "
                "or registered elsewhere or anew (never dropped); PINNED, pinned or leased by "
                "another reader, kept (as DELETE_KV keeps it)",
            )
        ],
    ),
    MsgType.LIST_ALLOCATIONS: (
        [
            ("owner", "str", "optional: only this instance's regions"),
            ("from_id", "int", "optional: only regions of this id or higher (ids only grow)"),
        ],
        [("regions", f"[{HANDLE}]", "")],
    ),
    MsgType.STATS: ([], [("stats", "map", "see docs/operations.md")]),
    MsgType.HEARTBEAT: (
        [("session", "str", ""), ("local_reads", "list[int]", _LOCAL_READS)],
        [],
    ),
    MsgType.DISCONNECT: (
        [
            (
                "session",
                "str",
                "the instance to end; its credential is void afterwards, for good: a HANDSHAKE"
                " with it gets a new instance",
            ),
            ("local_reads", "list[int]", _LOCAL_READS),
        ],
        [
            ("pins", "int", "pins dropped"),
            ("leases", "int", "leases ended"),
            ("regions", "int", "regions given back (their keys stay readable)"),
        ],
    ),
    MsgType.PARK_REGIONS: (
        [
            ("session", "str", "the owner"),
            (
                "seq",
                "int",
                "increases with every request: an older one than the last applied changes nothing",
            ),
            (
                "park",
                "[int]",
                "regions the owner will not write in before it unparks them: the "
                "server may take them back (their keys evicted) when the pool has no room",
            ),
            ("unpark", "[int]", "regions the owner wants to write in again"),
        ],
        [
            ("unparked", "[int]", "the regions of unpark that are the owner's to write in again"),
            ("gone", "[int]", "regions named that the owner no longer owns (taken back)"),
        ],
    ),
    MsgType.DELETE_PREFIX: (
        [
            ("session", "str", "optional"),
            ("prefix", "str | bytes", "non-empty; ignored with all"),
            ("all", "bool", "optional: every key (`maru clear`)"),
            (
                "cluster",
                "bool",
                "optional, default false: also remove the cluster tier's objects of those keys "
                "from Mooncake (with all: every object of the tier's tenant), values only the "
                "cluster holds included; after what the tier published before, never what it "
                "publishes after. The prefix is then at most a key (1024 bytes)",
            ),
        ],
        [
            ("deleted", "int", ""),
            ("pinned", "int", "matching keys kept (pinned or leased)"),
            (
                "cluster",
                "bool",
                "the removal from the cluster was sent, not waited for (false: not asked, no "
                "tier, or the tier not connected)",
            ),
        ],
    ),
    MsgType.RELEASE: (
        [("session", "str", "only the lease's owner ends it"), ("leases", "[int]", "")],
        [("released", "int", "leases ended")],
    ),
    MsgType.EVICT_FOR: (
        [
            ("session", "str", "the caller"),
            ("bytes", "int", "to free in the caller's own regions"),
            (
                "ahead",
                "int",
                "optional, at most `bytes`: of them, room for the next writes, not this one "
                "(room already on its way is not evicted again; a spilling cluster tier "
                "publishes their victims first)",
            ),
        ],
        [("freed_bytes", "int", "the victims' bytes (with `ahead`, some may come later)")],
    ),
    MsgType.KEYS: (
        [
            ("prefix", "str | bytes", "optional"),
            ("limit", "int", f"optional, default 100, at most {MAX_LIST_KEYS}"),
        ],
        [
            ("keys", "[[key, length, owner]]", "most recently used first"),
            ("truncated", "bool", "more keys matched"),
            ("limit", "int", "the limit applied"),
        ],
    ),
}

REPLY_EXTRAS = [
    ("ok", "bool", "every reply"),
    (
        "freed",
        "bytes: packed int64 (region_id, offset, length) per page",
        "pages of the caller's regions whose keys went "
        "away since its last reply (not on RELEASE replies): the client may reuse them",
    ),
    (
        "shed",
        "int",
        "bytes of regions the server asks the caller to give back (RETURN_REGION): it holds "
        "more than its fair share of the pool and another instance has none to get",
    ),
    ("code", "int", "error replies: ErrorCode"),
    ("error", "str", "error replies: what went wrong"),
]


_TABLE = ["| field | type | meaning |", "|---|---|---|"]


def _row(field: tuple[str, str, str]) -> str:
    name, kind, meaning = (part.replace("|", "\\|") for part in field)
    return f"| `{name}` | {kind} | {meaning} |"


def render_schema() -> str:
    """docs/protocol.md: every message's request and reply fields, and the codes."""
    lines = [
        f"# Wire protocol (version {PROTOCOL_VERSION})",
        "",
        "Generated from `maru.common.protocol.MESSAGES` by `python -m maru.common.protocol`;",
        "a test checks that this file matches the code. Framing: see the module docstring and",
        "docs/architecture.md. Each message has one request form and one reply form.",
        "",
    ]
    for msg_type, (request, reply) in MESSAGES.items():
        lines += [f"## {msg_type.name} ({int(msg_type)})", ""]
        for title, fields in (("request", request), ("reply", reply)):
            if not fields:
                lines += [f"{title}: no fields", ""]
                continue
            lines += [f"{title}:", "", *_TABLE, *map(_row, fields), ""]
    lines += ["## Fields any reply may carry", "", *_TABLE, *map(_row, REPLY_EXTRAS)]
    for enum in (ErrorCode, RegisterStatus, DeleteStatus):
        lines += ["", f"## {enum.__name__}", "", "| value | name |", "|---|---|"]
        lines += [f"| {int(v)} | `{v.name}` |" for v in enum]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render_schema(), end="")
