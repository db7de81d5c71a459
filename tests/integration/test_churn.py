"""Churn: store three times the pool's capacity of unique keys while readers in other processes
read random earlier keys under read leases and check every value's key-bound checksum.

Asserted: every store succeeds (eviction makes room, nothing fails because the pool is full of
old pages), no reader ever sees a corrupted value, registered bytes end under the high
watermark, evictions happened and account exactly for what was stored minus what is live, and
the most recent keys are all still there."""

from __future__ import annotations

import hashlib
import random
import time
from typing import Any

import numpy as np

from maru import MaruHandler

from .workers import SPAWN

KiB, MiB = 1 << 10, 1 << 20
POOL = 256 * MiB
CHUNK = 64 * KiB
TAG = 16  # blake2b(key + rest) at the front of every value
BATCH = 8
READERS = 2


def key_of(i: int) -> str:
    return f"churn-{i}"


def size_of(i: int) -> int:
    """64 KiB .. 1 MiB, mostly not a page multiple (at most 4 KiB short of one)."""
    rng = random.Random(i)
    return rng.randint(1, 16) * CHUNK - rng.randrange(0, 4 * KiB)


def make_value(i: int) -> bytes:
    key, size = key_of(i), size_of(i)
    words = -(-(size - TAG) // 8)
    rest = (np.arange(words, dtype=np.uint64) * np.uint64(2 * i + 1)).tobytes()[: size - TAG]
    return hashlib.blake2b(key.encode() + rest, digest_size=TAG).digest() + rest


def intact(i: int, view: memoryview) -> bool:
    if view.nbytes != size_of(i):
        return False
    h = hashlib.blake2b(key_of(i).encode(), digest_size=TAG)
    h.update(view[TAG:])
    return h.digest() == bytes(view[:TAG])


def reader(url: str, seed: int, stored: Any, done: Any, ready: Any) -> dict:
    """Until `done`: pick keys among those stored so far (half among the most recent, half
    anywhere), read them under a lease, verify. Returns counts."""
    h = MaruHandler(server_url=url, pool_size="2M", chunk_size_bytes=CHUNK, timeout_ms=10_000)
    assert h.connected
    ready.set()
    rng = random.Random(seed)
    counts = {"reads": 0, "hits": 0, "misses": 0, "corrupt": 0, "leased_batches": 0}
    bad: list[str] = []
    try:
        while not done.is_set():
            n = stored.value
            if n < BATCH:
                time.sleep(0.001)
                continue
            picks = {rng.randrange(max(0, n - 200), n) for _ in range(2)}
            picks |= {rng.randrange(0, n) for _ in range(2)}
            idx = sorted(picks)
            with h.leased([key_of(i) for i in idx]) as infos:
                counts["leased_batches"] += 1
                for i, info in zip(idx, infos):
                    counts["reads"] += 1
                    if info is None:
                        counts["misses"] += 1
                    elif intact(i, info.view):
                        counts["hits"] += 1
                    else:
                        counts["corrupt"] += 1
                        if len(bad) < 5:
                            bad.append(f"{key_of(i)}: {info.length} bytes at {info.offset}")
        counts["bad"] = bad
        return counts
    finally:
        h.close()


def _run_reader(out_q: Any, *args: Any) -> None:
    import traceback

    try:
        out_q.put(reader(*args))
    except BaseException:
        out_q.put({"error": traceback.format_exc()})


def test_churn_three_times_the_pool(maru_server_factory, tmp_path):
    server = maru_server_factory(tmp_path / "srv", pool_size="256M")
    stored, done = SPAWN.Value("i", 0, lock=False), SPAWN.Event()
    out_q = SPAWN.Queue()
    readies = [SPAWN.Event() for _ in range(READERS)]
    procs = [
        SPAWN.Process(
            target=_run_reader,
            args=(out_q, server.url, 1000 + r, stored, done, readies[r]),
            daemon=True,
        )
        for r in range(READERS)
    ]
    for p in procs:
        p.start()
    results: list[dict] = []
    try:
        for ev in readies:
            assert ev.wait(60), "a reader did not start"
        # the writer: small regions at first, growing up to the whole pool
        writer = MaruHandler(
            server_url=server.url,
            pool_size="256M",
            expand_size="4M",
            chunk_size_bytes=CHUNK,
            timeout_ms=10_000,
        )
        assert writer.connected
        total = failures = i = 0
        while total < 3 * POOL:
            idx = list(range(i, i + BATCH))
            ok = writer.batch_store([key_of(j) for j in idx], [make_value(j) for j in idx])
            failures += ok.count(False)
            total += sum(size_of(j) for j in idx)
            i += BATCH
            stored.value = i
        done.set()
        for _ in procs:
            result = out_q.get(timeout=60)
            assert "error" not in result, result.get("error")
            results.append(result)
        n_keys = i
        stats = writer.stats()
        # the newest keys are all there and intact (the writer checks them itself)
        recent = list(range(n_keys - 4 * BATCH, n_keys))
        with writer.leased([key_of(j) for j in recent]) as infos:
            assert all(info is not None and intact(j, info.view) for j, info in zip(recent, infos))
        writer.close()
    finally:
        done.set()
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()

    counters = stats["counters"]
    live = stats["live_bytes"]
    summary = {
        "keys_stored": n_keys,
        "bytes_stored": total,
        "pool": POOL,
        "evictions": counters["evictions"],
        "bytes_evicted": counters["bytes_evicted"],
        "live_bytes": live,
        "live_fraction": round(live / POOL, 4),
        "pool_used_fraction": round(stats["pool"]["used"] / POOL, 4),
        "readers": [{k: v for k, v in r.items() if k != "bad"} for r in results],
    }
    print("\nchurn:", summary)

    assert failures == 0, f"{failures} stores failed"
    assert total >= 3 * POOL
    corrupt = sum(r["corrupt"] for r in results)
    assert corrupt == 0, [r["bad"] for r in results]
    assert all(r["hits"] > 0 for r in results), results  # the readers did check values
    assert live <= stats["watermarks"]["high"] * POOL
    assert counters["evictions"] > 0
    # exact accounting: everything registered is either live or was evicted
    assert counters["keys_registered"] == n_keys
    assert stats["keys"] == n_keys - counters["evictions"]
    assert counters["bytes_evicted"] == total - live
    assert stats["leases"] == 0  # every reader lease was released


def test_a_lease_keeps_bytes_stable_while_eviction_reuses_pages(maru_server):
    """What the readers above rely on, made deterministic: a writer whose only region is full
    must evict to store; a leased key is skipped and its bytes stay put, while the pages of a
    key read without a lease are evicted and overwritten under the reader's feet."""
    writer = MaruHandler(
        server_url=maru_server.url, pool_size="4M", chunk_size_bytes=CHUNK, auto_expand=False
    )
    reader = MaruHandler(server_url=maru_server.url, pool_size="2M", chunk_size_bytes=CHUNK)
    try:
        big = iter([j for j in range(2000) if size_of(j) > 15 * CHUNK])  # 16-page values
        first = [next(big) for _ in range(4)]
        assert writer.batch_store([key_of(j) for j in first], [make_value(j) for j in first])
        assert writer.free_chunks() == 0  # 4 values of 16 pages fill the 64-page region
        leased_key = first[0]
        with reader.leased([key_of(leased_key)]) as (info,):
            assert info is not None and intact(leased_key, info.view)
            # every further store must evict; the leased key is never the victim
            for _ in range(6):
                j = next(big)
                assert writer.store(key_of(j), make_value(j))
            assert intact(leased_key, info.view)
            assert reader.batch_exists([key_of(j) for j in first]) == [True, False, False, False]
        evicted_before = reader.stats()["counters"]["evictions"]
        assert evicted_before >= 3

        # the same without a lease: the key goes and its pages are rewritten
        victim = j
        unleased = reader.retrieve(key_of(victim))
        assert unleased is not None and intact(victim, unleased.view)
        overwritten = False
        for _ in range(10):
            j = next(big)
            assert writer.store(key_of(j), make_value(j))
            if not intact(victim, unleased.view):
                overwritten = True
                break
        assert overwritten  # the hazard a lease prevents
        assert not reader.exists(key_of(victim))
        assert reader.stats()["leases"] == 0
    finally:
        writer.close()
        reader.close()
