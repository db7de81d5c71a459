"""Red team, a CXL pod: a host whose `maru_pool_path` names a copy of the pool, not the pool.

On another host of a pod the pool is what that host's `maru_pool_path` maps (a bind mount, a
devdax device). A copy of the pool file taken while the server runs (`cp` of the pool to
"share" it, a snapshot restored at that path) holds the server's mark, its epoch and its pool
key too: it passed the mark check, the host's values were written into the copy and registered,
and every other host read them as hits with the bytes of the real pool (4 of 4 wrong here,
before the fix; with the in-pool index too). Now the server raises a live count beside the
mark at every HANDSHAKE and says in the reply what it wrote; the client must read at least that
through its own mapping: a copy, frozen when it was copied, is a refused connect, never a write
nor a read. The same pool mapped at another path (a hard link here, as a bind mount is on
another host) and a burst of handshakes at once still connect.

A client on this host with `pool_path` set maps exactly as one on another host does (through
that path, over TCP): no namespaces needed, and no root.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from maru import MaruHandler

CHUNK = 64 * 1024


def value(key: str) -> bytes:
    digest = hashlib.sha256(key.encode()).digest()
    return (digest * (CHUNK // 32 + 1))[:CHUNK]


def handler(url: str, **kw: Any) -> MaruHandler:
    return MaruHandler(
        server_url=url, chunk_size_bytes=CHUNK, pool_size="2M", timeout_ms=5000, **kw
    )


def read(h: MaruHandler, keys: list[str]) -> list[bytes | None]:
    """`MaruHandler.read` (the in-pool index, else requests): each key's bytes, or None."""
    out = np.zeros((len(keys), CHUNK), np.uint8)
    buffers = (out.ctypes.data + np.arange(len(keys), dtype=np.int64) * CHUNK)[:, None]
    proven = h.read(keys, buffers, np.array([CHUNK], np.int64), length=CHUNK)
    return [bytes(out[i]) if ok else None for i, ok in enumerate(proven)]


def test_a_pool_path_naming_a_copy_of_the_live_pool_is_refused(maru_server_factory):
    """Host A stores; the pool file is copied (sparse bytes, the mark and its key included)
    and host B's `pool_path` names the copy: B's connect is refused, naming the copy, and A
    reads no key B could have stored. Mutation: the server's `handshake_fields` sends no
    `live` (or the client skips the check in `poolpath.prove`): B connects, stores 4 values
    into the copy, and A reads all 4 as hits of other bytes."""
    server = maru_server_factory(pool_size="64M", extra_args=["--index-slots", "1024"])
    copy = server.pool_path + ".copy"
    with handler(server.url) as a:
        assert a.connected
        assert all(a.batch_store(["a0"], [value("a0")]))
        shutil.copyfile(server.pool_path, copy)
        try:
            b = handler(server.url, pool_path=copy)
            keys = [f"b{i}" for i in range(4)]
            try:
                if b.connected:  # (the fault: what B writes lands in its copy)
                    b.batch_store(keys, [value(k) for k in keys])
            finally:
                b.close()
            got = read(a, keys)
            wrong = [k for k, g in zip(keys, got) if g is not None and g != value(k)]
            assert wrong == [], f"host A read {len(wrong)} of B's keys with other bytes"
            assert not b.connected
            why = str(b.connect_error)
            assert copy in why and "a copy of the pool" in why, why
            assert read(a, ["a0"]) == [value("a0")]  # the real pool serves on
        finally:
            os.unlink(copy)


def test_the_pool_itself_at_another_path_connects_through_a_burst_of_handshakes(
    maru_server_factory,
):
    """The pool mapped at another path (a hard link: the same file, as a bind mount is on
    another host) passes: 8 handlers connect at once (their counts written in any order, the
    pool's only grows), store, and read each other's values by their bytes."""
    server = maru_server_factory(pool_size="64M", extra_args=["--index-slots", "1024"])
    link = server.pool_path + ".host-b"
    os.link(server.pool_path, link)
    try:
        with ThreadPoolExecutor(8) as pool:
            handlers = list(pool.map(lambda _: handler(server.url, pool_path=link), range(8)))
        try:
            assert [h.connected for h in handlers] == [True] * 8, [
                str(h.connect_error) for h in handlers
            ]
            for i, h in enumerate(handlers):
                assert all(h.batch_store([f"h{i}"], [value(f"h{i}")]))
            keys = [f"h{i}" for i in range(8)]
            assert read(handlers[0], keys) == [value(k) for k in keys]
            assert read(handlers[-1], keys) == [value(k) for k in keys]
        finally:
            for h in handlers:
                h.close()
    finally:
        os.unlink(link)
