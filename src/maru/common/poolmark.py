"""The pool's mark: which server state serves a pool, in the pool's own memory beside the
regions (written at every start, `maru.server.cli.claim_pool`): magic, the pool's generation,
that start's epoch, a digest. The server reads it to tell whether another server used the pool
since its state was saved; a client, to prove that what it maps is the server's pool before it
touches anything there (`maru.client.poolpath`; the HANDSHAKE says where and what to expect).
"""

from __future__ import annotations

import hashlib
import mmap
import os

from maru.common._shmindex import flush_lines
from maru.common.shmindex import map_area

MARK_MAGIC = b"MARUPOOL"
MARK_BYTES = len(MARK_MAGIC) + 16 + 16 + 8


def _mark_digest(body: bytes) -> bytes:
    return hashlib.blake2b(body, digest_size=8).digest()


def encode_mark(generation: str, epoch: str) -> bytes:
    body = MARK_MAGIC + generation.encode().ljust(16)[:16] + epoch.encode().ljust(16)[:16]
    return body + _mark_digest(body)


def decode_mark(raw: bytes) -> tuple[str, str] | None:
    """(generation, epoch) of a mark; None for none (zeros, a torn write, other bytes)."""
    body, digest = raw[: MARK_BYTES - 8], raw[MARK_BYTES - 8 : MARK_BYTES]
    if not body.startswith(MARK_MAGIC) or _mark_digest(body) != digest:
        return None
    start = len(MARK_MAGIC)
    return body[start : start + 16].decode().strip(), body[start + 16 :].decode().strip()


def read_mark_window(path: str, offset: int, span: int) -> bytes:
    """The mark's bytes at `offset` of `path`, through a read-only mapping of `span` bytes (a
    devdax device has no read(), and wants aligned mappings); OSError, or ValueError (too short).
    Its lines are evicted from this CPU's cache first: without coherence, a line cached by an
    earlier read would show an older mark (a refused connect, not a wrong hit)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        with (
            mmap.mmap(fd, span, mmap.MAP_SHARED, mmap.PROT_READ, offset=offset) as mm,
            memoryview(mm) as view,
            view[:MARK_BYTES] as mark,
        ):
            flush_lines(mark, True)
            return bytes(mark)
    finally:
        os.close(fd)


def write_mark_window(path: str, offset: int, span: int, mark: bytes) -> None:
    """Write `mark` at `offset` of `path` through a mapping of `span` bytes there, and write
    its lines back to memory (readers on other hosts of a pod read memory, not our cache)."""
    with map_area(path, offset, span) as mm:
        mm[: len(mark)] = mark
        with memoryview(mm) as view, view[: len(mark)] as line:
            flush_lines(line)
        mm.flush()
