"""The local index under stress (issue 17, part 1): two writers overfill a small pool (eviction
never stops) and delete some of their keys, three readers read random recent keys through the
local index (copying reads validated after the copy, as the SGLang backend reads: half of them
through `MaruHandler.read`, where probe, copy and check are one C call) and check every copy
against its key, while the server is SIGKILLed and restarted every few seconds.

Asserted: 0 wrong bytes among the reads taken as hits, and that the readers did read through
the index (many hits, some entries found changed after the copy), so the test cannot pass by
reading nothing. Marked `slow` (about 40 s); `-s` prints the counts."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import random
import time
from typing import Any

import numpy as np
import pytest

from maru import MaruHandler
from maru.common.errors import MaruError

from .workers import SPAWN

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(180),
]

KiB = 1 << 10
CHUNK = 64 * KiB
WRITERS, READERS = 2, 3
DURATION_S, RESTART_EVERY_S = 30.0, 5.0
BATCH = 8


def key_of(writer: int, i: int) -> str:
    return f"stress-{writer}:{hashlib.sha256(str(i).encode()).hexdigest()}"  # SGLang-like


def size_of(key: str) -> int:
    return random.Random(key).randint(1, 4) * CHUNK - random.Random(key + "!").randrange(4 * KiB)


def value_of(key: str) -> bytes:
    """The key's own bytes: its digest repeated (another key's bytes, or a half-written
    value, never matches)."""
    size = size_of(key)
    digest = hashlib.blake2b(key.encode(), digest_size=32).digest()
    return (digest * (size // 32 + 1))[:size]


def _connect(url: str, stop: Any, **kw: Any) -> MaruHandler | None:
    logging.getLogger("maru").setLevel(logging.CRITICAL)  # failed calls while down: expected
    while not stop.is_set():
        h = MaruHandler(server_url=url, chunk_size_bytes=CHUNK, timeout_ms=1000, **kw)
        if h.connected:
            return h
        h.close()
        time.sleep(0.1)
    return None


def writer(url: str, w: int, progress: Any, stop: Any, out: Any) -> None:
    h = _connect(url, stop, pool_size="24M")
    stored = deleted = 0
    i = 0
    rng = random.Random(w)
    while h is not None and not stop.is_set():
        keys = [key_of(w, i + j) for j in range(BATCH)]
        try:
            stored += sum(h.batch_store(keys, [value_of(k) for k in keys]))
            if rng.random() < 0.3:  # delete a few recent keys: readers race deletions too
                old = [key_of(w, rng.randrange(max(0, i - 32), i + BATCH)) for _ in range(3)]
                deleted += sum(h.batch_delete(old))
        except MaruError:
            time.sleep(0.05)
        i += BATCH
        progress[w] = i
    if h is not None:
        h.close()
    out.put(("writer", {"stored": stored, "deleted": deleted}))


def _read_into(h: MaruHandler, key: str) -> tuple[bytes | None, bool, bool, bool]:
    """One key through `MaruHandler.read` into a host buffer of its size (values differ in
    length, a read takes one): (its bytes if proven or changed, changed during the copy, True,
    answered by the index)."""
    size = size_of(key)
    out = np.zeros(size, np.uint8)
    index = h._index
    fallbacks, stale = (index.fallbacks, index.stale) if index is not None else (0, 0)
    proven = h.read([key], np.array([[out.ctypes.data]], np.int64), np.array([size]), length=size)
    local = index is not None and index.fallbacks == fallbacks  # (no lookup was asked)
    changed = local and index.stale > stale
    return (out.tobytes() if proven[0] or changed else None), changed, True, local


def reader(url: str, r: int, progress: Any, stop: Any, out: Any) -> None:
    h = _connect(url, stop, pool_size="2M")
    counts = {"reads": 0, "hits": 0, "wrong": 0, "wrong_bytes": 0, "local": 0, "stale": 0}
    counts.update(fused_local=0, fused_stale=0)
    rng = random.Random(100 + r)
    while h is not None and not stop.is_set():
        w = rng.randrange(WRITERS)
        n = progress[w]
        if n == 0:
            time.sleep(0.01)
            continue
        first = rng.randrange(max(0, n - 96), n)
        keys = [key_of(w, i) for i in range(first, min(n, first + 16))]
        fused = rng.random() < 0.5  # `MaruHandler.read`: probe, copy, check in one C call
        try:
            if fused:
                outcomes = [_read_into(h, key) for key in keys]
            else:
                with h.lookup(keys, lease=True, for_copy=True) as found:
                    local = type(found).__name__ == "IndexLookup"
                    copies = [
                        ctypes.string_at(int(a), int(n)) if a else None
                        for a, n in zip(found.addresses, found.lengths)
                    ]
                    changed = found.corrupt().tolist()
                    held = found.release(confirm=True)
                outcomes = [(d, b, held, local) for d, b in zip(copies, changed)]
        except MaruError:
            continue
        counts["reads"] += len(keys)
        for key, (data, bad, held, local) in zip(keys, outcomes):
            if data is None or not held:
                continue
            if bad:
                counts["stale"] += 1
                counts["fused_stale"] += fused
                continue
            counts["hits"] += 1
            counts["local"] += local
            counts["fused_local"] += fused and local
            want = value_of(key)
            if data != want:
                counts["wrong"] += 1
                counts["wrong_bytes"] += sum(a != b for a, b in zip(data, want)) + abs(
                    len(data) - len(want)
                )
    if h is not None:
        h.close()
    out.put(("reader", counts))


def test_index_reads_under_writes_evictions_deletes_and_server_restarts(maru_server_factory):
    server = maru_server_factory(pool_size="48M")
    progress = SPAWN.Array("q", WRITERS)
    stop, out = SPAWN.Event(), SPAWN.Queue()
    procs = [
        SPAWN.Process(target=writer, args=(server.url, w, progress, stop, out), daemon=True)
        for w in range(WRITERS)
    ] + [
        SPAWN.Process(target=reader, args=(server.url, r, progress, stop, out), daemon=True)
        for r in range(READERS)
    ]
    for p in procs:
        p.start()
    restarts = 0
    try:
        end = time.monotonic() + DURATION_S
        while time.monotonic() < end - RESTART_EVERY_S:
            time.sleep(RESTART_EVERY_S)
            server.proc.kill()
            server.proc.wait(10)
            server.start(server.port)
            restarts += 1
        time.sleep(max(0.0, end - time.monotonic()))
    finally:
        stop.set()
    results = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(10)
    readers = [c for kind, c in results if kind == "reader"]
    writers = [c for kind, c in results if kind == "writer"]
    total = {k: sum(c.get(k, 0) for c in readers) for k in readers[0]}
    stored = sum(c["stored"] for c in writers)
    print(f"\nrestarts {restarts}, stored {stored}, deleted {sum(c['deleted'] for c in writers)}")
    print(total)
    assert (total["wrong"], total["wrong_bytes"]) == (0, 0)
    assert restarts >= 4
    assert stored * CHUNK > 4 * 48 * (1 << 20)  # overfilled several times: constant eviction
    assert total["local"] > 2000  # hits read through the index, none of them wrong
    assert total["fused_local"] > 1000  # (of them through `MaruHandler.read`)
    assert total["stale"] > 0  # and entries that changed during a copy were caught
