"""The pool's mark: which server state serves a pool, in the pool's own memory beside the
regions (written at every start, `maru.server.state_dir.claim_pool`): magic, the pool's generation,
that start's epoch, the start's pool key, a digest. The server reads it to tell whether another
server used the pool since its state was saved; a client, to prove that what it maps is the
server's pool before it touches anything there (`maru.client.poolpath`; the HANDSHAKE says
where and what to expect).

The pool key is the one part of the mark that never crosses a socket: only a process that can
read the pool knows it. Each side of a connection shows the other it knows it: the server at
HANDSHAKE (`server_proof`, of the client's nonce), so a client never talks to a process that
took the server's port; a client to take a region (`pool_proof`, of its instance id), so a
process that cannot map the pool (another user's, reaching an unauthenticated TCP port)
cannot register keys whose bytes it never wrote.
"""

from __future__ import annotations

import hashlib
import hmac
import mmap
import os

from maru.common._shmindex import flush_lines
from maru.common.shmindex import map_area

MARK_MAGIC = b"MARUPOOL"
POOL_KEY_BYTES = 16
_NAMES = len(MARK_MAGIC) + 16 + 16  # magic, generation, epoch
MARK_BYTES = _NAMES + POOL_KEY_BYTES + 8  # and the pool key, the digest
_KEYLESS_BYTES = _NAMES + 8  # a mark written before pool keys (read, to restore its state)
# The live count: a u64 on the line after the mark's, in a pool whose mark lies in a window of
# its own (shm, devdax). The server raises it at every HANDSHAKE, writes it into the pool, and
# says in the reply what it wrote: a client that reads less through its mapping maps a copy
# of the pool (which holds the mark, its key too), frozen when it was copied, not the pool.
LIVE_AT = 64
LIVE_BYTES = 8


def _mark_digest(body: bytes) -> bytes:
    return hashlib.blake2b(body, digest_size=8).digest()


def encode_mark(generation: str, epoch: str, key: bytes) -> bytes:
    """The mark of a start: its `key` (`POOL_KEY_BYTES` random bytes) is the pool key."""
    if len(key) != POOL_KEY_BYTES:
        raise ValueError(f"a pool key has {POOL_KEY_BYTES} bytes, not {len(key)}")
    body = MARK_MAGIC + generation.encode().ljust(16)[:16] + epoch.encode().ljust(16)[:16] + key
    return body + _mark_digest(body)


def parse_mark(raw: bytes) -> tuple[str, str, bytes] | None:
    """(generation, epoch, pool key) of a mark; the key b"" in a keyless one (written before
    pool keys); None for none (zeros, a torn write, other bytes)."""
    if not raw.startswith(MARK_MAGIC):
        return None
    for size, key_bytes in ((MARK_BYTES, POOL_KEY_BYTES), (_KEYLESS_BYTES, 0)):
        body, digest = raw[: size - 8], raw[size - 8 : size]
        if len(digest) == 8 and _mark_digest(body) == digest:
            start = len(MARK_MAGIC)
            names = body[start : start + 16].decode(), body[start + 16 : _NAMES].decode()
            return names[0].strip(), names[1].strip(), body[_NAMES : _NAMES + key_bytes]
    return None


def decode_mark(raw: bytes) -> tuple[str, str] | None:
    """(generation, epoch) of a mark; None for none (zeros, a torn write, other bytes)."""
    parsed = parse_mark(raw)
    return parsed[:2] if parsed is not None else None


def _hmac(key: bytes, purpose: bytes, text: str) -> str:
    return hmac.new(key, purpose + b"\0" + text.encode(), "sha256").hexdigest()[:32]


def pool_proof(key: bytes, instance_id: str) -> str:
    """What instance `instance_id` shows to take a region (REQUEST_REGION's `pool_proof`): an
    HMAC of its id keyed by the pool key, which only a reader of the pool knows. Bound to the
    id, so one instance's proof seen on the wire is no other's."""
    return _hmac(key, b"maru-pool-proof", instance_id)


def server_proof(key: bytes, nonce: str) -> str:
    """What the server shows a client at HANDSHAKE (the reply's `pool.mark.proof`): an HMAC of
    the client's fresh `nonce` keyed by the pool key. Only the server that wrote the mark (or
    a reader of the pool) can make it: a process that took the server's port cannot, and the
    client then never sends it a write nor believes one of its locations."""
    return _hmac(key, b"maru-pool-server", nonce)


def read_mark_window(path: str, offset: int, span: int) -> bytes:
    """The mark's bytes at `offset` of `path`, through a read-only mapping of `span` bytes (a
    devdax device has no read(), and wants aligned mappings); OSError, or ValueError (too short).
    Its lines are evicted from this CPU's cache first: without coherence, a line cached by an
    earlier read would show an older mark (a refused connect, not a wrong hit)."""
    return _read_window(path, offset, span, 0, MARK_BYTES)


def read_live_window(path: str, offset: int, span: int) -> int | None:
    """The live count after the mark at `offset` of `path` (a window of `span` bytes), read
    from memory as the mark is (`read_mark_window`); None where the window has no room for it."""
    if span < LIVE_AT + LIVE_BYTES:
        return None
    return int.from_bytes(_read_window(path, offset, span, LIVE_AT, LIVE_BYTES), "little")


def _read_window(path: str, offset: int, span: int, at: int, length: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        with (
            mmap.mmap(fd, span, mmap.MAP_SHARED, mmap.PROT_READ, offset=offset) as mm,
            memoryview(mm) as view,
            view[at : at + length] as part,
        ):
            flush_lines(part, True)
            return bytes(part)
    finally:
        os.close(fd)


def write_mark_window(path: str, offset: int, span: int, mark: bytes) -> None:
    """Write `mark` at `offset` of `path` through a mapping of `span` bytes there, and write
    its lines back to memory (readers on other hosts of a pod read memory, not our cache)."""
    _write_window(path, offset, span, 0, mark)


def write_live_window(path: str, offset: int, span: int, count: int) -> bool:
    """Write the live `count` after the mark at `offset` of `path` (a window of `span` bytes),
    as the mark is written (`write_mark_window`); False where the window has no room for it."""
    if span < LIVE_AT + LIVE_BYTES:
        return False
    _write_window(path, offset, span, LIVE_AT, count.to_bytes(LIVE_BYTES, "little"))
    return True


def _write_window(path: str, offset: int, span: int, at: int, data: bytes) -> None:
    with map_area(path, offset, span) as mm:
        mm[at : at + len(data)] = data
        with memoryview(mm) as view, view[at : at + len(data)] as line:
            flush_lines(line)
        mm.flush()
