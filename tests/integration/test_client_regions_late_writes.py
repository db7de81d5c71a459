"""A write through a view kept after `MaruHandler.close()` never lands in the pool.

LMCache's memory objects (and any caller of `alloc`) hold views of the handler's regions; a
Python view keeps the mapping alive after `close()`. DISCONNECT frees an empty region at once,
and the server hands its pages to the next instance that asks: a late write through the kept
view then overwrote that instance's registered values (a hit with the wrong bytes). Real
server; the closing writer A and the next owner B are separate processes.
"""

from __future__ import annotations

import numpy as np

from maru import MaruHandler

from .workers import SPAWN

MiB = 1 << 20
VALUES = 4


def late_writer(url: str, closed, go, out) -> None:
    """A: reserve a run, keep its view, close, and write through the view once B stored."""
    h = MaruHandler(server_url=url, pool_size="8M", chunk_size_bytes="1M", timeout_ms=10_000)
    handle = h.alloc(MiB, VALUES)
    assert handle is not None
    kept = handle.buf  # (what LMCache's memory objects hold)
    kept[:] = b"a" * len(kept)
    where = (h._mapper.get(handle.region_id).handle.offset, handle.offset)
    h.close()
    closed.set()
    if not go.wait(60):
        out.put(("timeout", where))
        return
    try:
        np.frombuffer(kept, np.uint8)[:] = ord("L")  # the late write
        out.put(("wrote", where))
    except Exception as exc:  # (refused outright is fine too: nothing reached the pool)
        out.put((f"refused: {exc!r}", where))


def test_a_view_kept_after_close_never_writes_the_next_owners_values(maru_server_factory):
    """Before: 4 of 4 of B's values read back as A's late bytes (B's hit, A's bytes)."""
    server = maru_server_factory(pool_size="8M")
    closed, go, out = SPAWN.Event(), SPAWN.Event(), SPAWN.Queue()
    a = SPAWN.Process(target=late_writer, args=(server.url, closed, go, out))
    a.start()
    b = None
    try:
        assert closed.wait(60)
        b = MaruHandler(
            server_url=server.url, pool_size="8M", chunk_size_bytes="1M", timeout_ms=10_000
        )
        keys = [f"b/{i}" for i in range(VALUES)]
        for i, key in enumerate(keys):
            assert b.store(key, np.full(MiB, ord("0") + i, np.uint8))
        go.set()
        what, (a_region_at, a_offset) = out.get(timeout=60)
        a.join(60)
        infos = b.batch_retrieve(keys)
        assert all(info is not None for info in infos)
        ours = {b._mapper.get(info.region_id).handle.offset + info.offset for info in infos}
        # (the test means something only if B's values took A's kept pages)
        assert a_region_at + a_offset in ours, (a_region_at, a_offset, ours)
        wrong = [
            key
            for i, (key, info) in enumerate(zip(keys, infos))
            if bytes(info.view) != bytes([ord("0") + i]) * MiB
        ]
        print(f"\nA's late write: {what}; {len(wrong)} of B's {VALUES} values wrong")
        assert wrong == []
    finally:
        go.set()
        if a.is_alive():
            a.kill()
        a.join(10)
        if b is not None:
            b.close()
