"""DISCONNECT while another thread of the same handler still copies a value into its region.

`MaruHandler.close()` ends the instance at once: the server frees a region with no key in it
on the spot and may hand its pages to another instance. A store running on another thread of
the closing process is still copying into that region; were DISCONNECT sent before that copy
ends, its bytes would land in the new owner's pages, under the new owner's registered key (a
hit with the wrong bytes). Real server, A and B in separate processes.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from maru import MaruHandler

from .workers import SPAWN

BIG = 384 << 20  # A's copy takes a good part of a second: B's store overtakes it


def closing_writer(url: str, started, out) -> None:
    """A: store one big value on a thread and close the handler while it copies."""
    h = MaruHandler(server_url=url, pool_size="512M", chunk_size_bytes="1M", timeout_ms=10_000)
    value = np.full(BIG, ord("A"), np.uint8)
    t = threading.Thread(target=lambda: out.put(h.store("a/big", value)))
    t.start()
    time.sleep(0.02)  # (the copy has begun)
    started.set()
    h.close()
    t.join(60)


def test_a_close_never_frees_a_region_another_thread_still_writes(maru_server_factory):
    """A closes while its other thread copies a 384 MiB value; B then stores into the room the
    server freed. Before: ~163 MB of B's registered value were A's bytes (3 runs of 3); now
    `close()` waits for the copies in flight before DISCONNECT."""
    server = maru_server_factory(pool_size="512M", extra_args=["--heartbeat-timeout", "5"])
    b = MaruHandler(
        server_url=server.url, pool_size="512M", chunk_size_bytes="1M", timeout_ms=10_000
    )
    value = np.full(BIG, ord("B"), np.uint8)
    started, out = SPAWN.Event(), SPAWN.Queue()
    a = SPAWN.Process(target=closing_writer, args=(server.url, started, out))
    a.start()
    try:
        assert started.wait(60)
        deadline = time.monotonic() + 20
        while len(b.stats()["instances"]) > 1 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert b.store("b/big", value)  # into A's old pages, once the server freed them
        out.get(timeout=60)
        a.join(60)
        info = b.retrieve("b/big")
        assert info is not None
        wrong = int(np.count_nonzero(np.frombuffer(info.view, np.uint8) != ord("B")))
        print(f"\n{wrong} of B's {BIG} bytes read as A's")
        assert wrong == 0
    finally:
        if a.is_alive():
            a.kill()
        a.join(10)
        b.close()
