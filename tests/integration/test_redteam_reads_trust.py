"""A reader's local index table that the next server cannot open (another layout version: a
server upgraded while readers of the old one run) is still retired at that server's start.

A read through the local index is proven by its table staying current: the server retires its
table before it can reuse pages (a starting server retires the tables an earlier one left).
`retire_earlier` retired a /dev/shm table through a `Writer`, and one of another layout
version made that raise: the table was removed, never retired. `retire_in_pool` left such an
in-pool table "as is". A reader still mapping it (an old build never handshakes again; a
current one only at its next heartbeat) sends no request for its reads, and went on proving
copies from it while the restarted server deleted the key and wrote another key's bytes into
its chunk: a hit of the other value's bytes. Now the header's `retired` word is set wherever
the magic says it is a Maru index, so the reader's copy is a miss.

Real `maru-server` processes; the old layout is simulated by rewriting the version word of the
table the reader has open, while the server is down.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from maru import MaruHandler

A, B = b"A" * 100_000, b"B" * 100_000  # k's bytes, and k2's, written where k was


def _read(h: MaruHandler, key: str) -> tuple[bool, bytes]:
    """`MaruHandler.read` of `key` (A's length) into a host buffer: (proven, its bytes)."""
    out = np.zeros(len(A), np.uint8)
    buffers = np.array([[out.ctypes.data]], np.int64)
    proven = h.read([key], buffers, np.array([len(A)], np.int64), length=len(A))
    return proven[0], bytes(out)


def _set_version(path: str, at: int, version: int) -> None:
    """Write the layout version word of the table header at offset `at` of `path`."""
    fd = os.open(path, os.O_RDWR)
    try:
        assert os.pwrite(fd, version.to_bytes(8, "little"), at + 8) == 8
    finally:
        os.close(fd)


@pytest.mark.parametrize("where", ["dev-shm", "in-pool"])
def test_a_table_of_another_layout_is_retired_by_the_next_server(maru_server_factory, where):
    """Mutation: the code before this (a table no `Writer` opens is removed, or left as is,
    unretired): the read of k is proven with k2's bytes."""
    in_pool = ["--index-slots", "1024"] if where == "in-pool" else []
    # (a heartbeat every 20 s: the reader sends no request between the restart and its read)
    slow_beat = ["--heartbeat-timeout", "60"]
    server = maru_server_factory(pool_size="64M", extra_args=[*slow_beat, *in_pool])
    # an owner of 1 MiB chunks in one 2 MiB region: k2 goes where k was once k is deleted
    w = MaruHandler(server_url=server.url, pool_size="2M", chunk_size_bytes="1M", auto_expand=False)
    r = MaruHandler(server_url=server.url, pool_size="2M")
    try:
        assert w.batch_store(["k", "filler"], [A, b"f" * 100]) == [True, True]
        assert _read(r, "k") == (True, A)
        assert r._index is not None and r._index._reader.index_id  # read through the index
        index = r.stats()["local_index"]
        assert index["in_pool"] == bool(in_pool)
        if in_pool:
            table, at = server.pool_path, int(index["path"].rsplit(" ", 1)[1])
        else:
            table, at = r._index.path, 0
        k_at = r.batch_retrieve(["k"])[0]
        assert k_at is not None

        server.proc.kill()
        assert server.proc.wait(10) == -9
        _set_version(table, at, 2)  # an earlier layout's table, mapped by its reader
        server.extra_args = tuple(slow_beat)  # (in the pool: no table formatted over it)
        server.start(server.port)
        assert "another layout version" in server.read_log()

        assert w.delete("k")
        assert w.store("k2", B)
        k2_at = w.batch_retrieve(["k2"])[0]  # the fault is real: k2 lies where k was
        assert (k2_at.region_id, k2_at.offset) == (k_at.region_id, k_at.offset)

        proven, data = _read(r, "k")
        assert not proven, "k read through a table no server retired: k2's bytes" * (data == B)
        assert _read(r, "k2") == (True, B)
    finally:
        r.close()
        w.close()
