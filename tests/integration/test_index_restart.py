"""An in-pool index table (`maru-server --index-slots`) outlives its server in the pool: every
later start retires it, whatever that start's own flags (docs/architecture.md, "The in-pool
index", "Its life"). Before: a start without `--index-slots` (or with `--no-local-index`) left
it current, so a reader that had sent nothing since the restart took a deleted key's chunk,
rewritten with another key's bytes, as a hit."""

from __future__ import annotations

import hashlib
import os
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from maru import MaruHandler
from maru.client.localindex import LocalIndexClient
from maru.common.shmindex import area_views, map_area
from maru.server.localindex import LocalIndex, retire_in_pool
from maru.server.pool import REGION_ALIGNMENT, DevDaxPool

KiB, MiB = 1 << 10, 1 << 20
CHUNK = 64 * KiB
HEARTBEAT = "60"  # a heartbeat every 20 s: the reader re-handshakes in none of these tests


def value(key: str, version: int = 0) -> bytes:
    digest = hashlib.sha256(f"{key}@{version}".encode()).digest()
    return (digest * (CHUNK // 32 + 1))[:CHUNK]


def handler(url: str, **kw: Any) -> MaruHandler:
    kw.setdefault("pool_size", "64M")
    return MaruHandler(server_url=url, chunk_size_bytes=CHUNK, **kw)


def read(h: MaruHandler, keys: list[str]) -> list[bytes | None]:
    """`MaruHandler.read` into rows of CHUNK bytes: each key's bytes where proven, else None."""
    out = np.zeros((len(keys), CHUNK), np.uint8)
    buffers = (out.ctypes.data + np.arange(len(keys), dtype=np.int64) * CHUNK)[:, None]
    proven = h.read(keys, buffers, np.array([CHUNK], np.int64), length=CHUNK)
    return [bytes(out[i]) if ok else None for i, ok in enumerate(proven)]


@pytest.mark.parametrize(
    "restart_flags",
    [[], ["--no-local-index"], ["--index-slots", "2048"]],
    ids=["no-index-slots", "no-local-index", "other-index-slots"],
)
def test_a_restart_without_the_in_pool_index_retires_the_table_left_in_the_pool(
    maru_server_factory, restart_flags
):
    """A server with `--index-slots 1024` is SIGKILLed and restarted on the same shm pool and
    state (restored: the same generation, the same region tags) with other index flags. The
    writer re-handshakes, deletes k0 and k1 and fills every free chunk (theirs too) with new
    keys; the reader, which sent nothing since the restart, reads k0 and k1: misses, never the
    new keys' bytes (before the fix: both hits, with other keys' bytes)."""
    server = maru_server_factory(
        pool_size="64M", extra_args=["--index-slots", "1024", "--heartbeat-timeout", HEARTBEAT]
    )
    keys = [f"k{i}" for i in range(4)]
    with handler(server.url, pool_size="2M") as w, handler(server.url) as r:
        assert all(w.batch_store(keys, [value(k) for k in keys]))
        assert r._index is not None and r._index.path is None  # the in-pool table
        fallbacks = r._index.fallbacks
        assert read(r, keys) == [value(k) for k in keys]  # (maps the writer's region)
        assert read(r, keys) == [value(k) for k in keys]
        assert r._index.fallbacks == fallbacks + 1  # the second read: the index alone

        server.proc.kill()
        server.proc.wait(10)
        server.extra_args = ("--heartbeat-timeout", HEARTBEAT, *restart_flags)
        server.start(server.port)

        assert w.batch_delete(keys[:2]) == [True, True]  # (the writer's re-handshake)
        w._chunks.settle()
        more = [f"new{i}" for i in range(30)]  # every free chunk, the freed two too
        assert all(w.batch_store(more, [value(k, 1) for k in more]))
        got = read(r, keys)  # the reader's first word to the server since the restart
        assert got[:2] == [None, None], "a deleted key's chunk, rewritten, read as a hit"
        assert got[2:] == [value(k) for k in keys[2:]]
        assert read(r, more) == [value(k, 1) for k in more]


def _devdax_with_table(path: str, slots: int) -> tuple[LocalIndex, Any]:
    """A devdax stand-in served with `--index-slots slots` (its mark written, its table
    formatted, a reader on it), then left as a SIGKILL leaves it: the table never retired."""
    pool = DevDaxPool(path, index_slots=slots)
    pool.generation = "gen-1"
    pool.write_mark(pool.generation, "epoch-1")
    index = LocalIndex("devdax", path, pool.generation, in_pool=pool)
    index.publish(["k"], [1], [0], [CHUNK], regions={1: SimpleNamespace(token="ab" * 8)})
    reader = LocalIndexClient.in_pool(SimpleNamespace(local=path), index.offer())
    assert reader is not None and not reader._reader.retired and reader._reader.count == 1
    return index, reader._reader


@pytest.mark.parametrize("slots", [0, 1024, 1 << 14], ids=["none", "same-slots", "more-slots"])
def test_a_devdax_start_retires_the_table_an_earlier_start_left_whatever_its_slots(tmp_path, slots):
    """A devdax pool's area lies before the mark's unit and grows down with the slots: the
    next start finds the earlier table there whatever its own `--index-slots` (0 included)."""
    path = str(tmp_path / "dax")
    with open(path, "wb") as f:
        f.truncate(16 * MiB)
    earlier, reader = _devdax_with_table(path, 1024)
    assert retire_in_pool(DevDaxPool(path, index_slots=slots))
    assert reader.retired  # the reader's next copy is not proven; it asks the server
    assert not retire_in_pool(DevDaxPool(path, index_slots=slots))  # (nothing current left)
    earlier.table.writer.close()
    earlier.table.map.close()


def test_a_devdax_start_leaves_bytes_that_are_no_table_of_this_pool_alone(tmp_path):
    """Region bytes where an area could lie are touched only if they are a current table of
    the pool's generation (the mark's): a copy of another pool life's header is left as is."""
    path = str(tmp_path / "dax")
    with open(path, "wb") as f:
        f.truncate(16 * MiB)
    earlier, _ = _devdax_with_table(path, 1024)
    earlier.table.writer.close()
    earlier.table.map.close()
    pool = DevDaxPool(path)
    pool.write_mark("gen-2", "epoch-2")  # (another life of the pool since)
    with open(path, "rb") as f:
        before = f.read()
    assert not retire_in_pool(pool)
    with open(path, "rb") as f:
        assert f.read() == before
    area = map_area(path, pool.mark_offset - REGION_ALIGNMENT, REGION_ALIGNMENT)
    table, use = area_views(area, 1024)
    assert table[48:56].tobytes() == bytes(8)  # (still not retired)
    table.release()
    use.release()
    area.close()
    os.unlink(path)
