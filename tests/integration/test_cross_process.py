"""Real separate processes (multiprocessing "spawn"), each with its own MaruHandler and its own
mmap of the pool, against a real `maru-server` subprocess."""

from __future__ import annotations

from maru import MaruHandler

from .workers import SPAWN, MiB, digest, mixed_sizes, retrieve_keys, run_processes, store_keys


def test_thousand_mixed_keys_stored_by_one_process_read_by_another(maru_server_factory):
    """A stores 1,000 random values of 4 KiB-8 MiB and exits; B, another process with its own
    handler, retrieves every one byte-identical through its own read-only mapping."""
    server = maru_server_factory(pool_size="4G")
    n = 1000
    sizes = mixed_sizes(n, seed=7)
    assert min(sizes) == 4096 and max(sizes) == 8 * MiB
    keys = [f"xproc/{i:04d}/{size}" for i, size in enumerate(sizes)]
    writer_kw = {"pool_size": "3G", "auto_expand": True}
    (a,) = run_processes([(store_keys, (server.url, keys, sizes, 1, 50, writer_kw))], 120)
    assert a["ok"] == [True] * n
    chunk = a["chunk"]
    assert a["total_pages"] - a["free_pages"] == sum(-(-s // chunk) for s in sizes)

    (b,) = run_processes([(retrieve_keys, (server.url, keys, 100))], 120)
    missing = [k for k, d in zip(keys, b["digests"]) if d is None]
    assert not missing, f"{len(missing)} keys missing, e.g. {missing[:3]}"
    assert b["lengths"] == sizes
    bad = [k for k, da, db in zip(keys, a["digests"], b["digests"]) if da != db]
    assert not bad, f"{len(bad)} values differ, e.g. {bad[:3]}"
    assert b["readonly"] and b["foreign"]  # B read A's pages from its own read-only mapping

    with MaruHandler(server_url=server.url, pool_size="2M") as h:
        stats = h.stats()
        assert stats["keys"] == n
        # A closed: its regions were returned but stay allocated while they hold keys
        assert set(a["regions"]) <= {r.region_id for r in h.list_allocations(all_instances=True)}
        assert stats["pool"]["used"] >= sum(sizes)  # regions taken as the data arrived


def test_same_key_race_between_two_writer_processes(maru_server_factory):
    """Two processes store the same 300 keys (different bytes) at the same moment: each key is
    registered exactly once, readers see the winner's bytes, and the loser's pages are free."""
    server = maru_server_factory(pool_size="512M")
    n = 300
    keys = [f"race/{i}" for i in range(n)]
    sizes = [4096 + 6000 * (i % 25) for i in range(n)]  # 4 KiB .. ~148 KiB: 1 to 3 pages
    kw = {"pool_size": "64M", "chunk_size_bytes": "64K", "auto_expand": False}
    barrier = SPAWN.Barrier(2)
    a, b = run_processes(
        [
            (store_keys, (server.url, keys, sizes, 10_000, 10, kw, barrier)),
            (store_keys, (server.url, keys, sizes, 20_000, 10, kw, barrier)),
        ],
        120,
    )
    assert a["ok"] == [True] * n and b["ok"] == [True] * n  # EXISTS reports True
    assert set(a["regions"]).isdisjoint(b["regions"])
    chunk = a["chunk"]
    won = {"a": 0, "b": 0}
    pages = {"a": 0, "b": 0}
    with MaruHandler(server_url=server.url, pool_size="2M") as h:
        infos = h.batch_retrieve(keys)
        for i, info in enumerate(infos):
            assert info is not None and info.length == sizes[i]
            winner = "a" if info.region_id in a["regions"] else "b"
            assert info.region_id in (a if winner == "a" else b)["regions"]
            expected = (a if winner == "a" else b)["digests"][i]
            assert digest(info.view) == expected, f"{keys[i]}: bytes are not the winner's"
            won[winner] += 1
            pages[winner] += -(-sizes[i] // chunk)
        counters = h.stats()["counters"]
    assert won["a"] + won["b"] == n
    assert counters["keys_registered"] == n  # exactly one registration per key
    assert counters["keys_duplicate"] == n  # and exactly one refused per key
    # no leaked page: each writer holds exactly the pages of the keys it won
    assert a["total_pages"] - a["free_pages"] == pages["a"]
    assert b["total_pages"] - b["free_pages"] == pages["b"]
