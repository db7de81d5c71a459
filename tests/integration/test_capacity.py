"""Capacity without hand sizing (issue 15): an instance takes regions as its data arrives, up
to `maru_pool_size`, and parks the ones it stopped writing in; the server takes parked regions
back when another instance needs room. Real server, real processes, bytes checked by digest."""

from __future__ import annotations

import time
import zlib

from maru import MaruHandler

from .workers import SPAWN, KiB, MiB, digest, make_value, run_processes, share_pool

# Ticks (heartbeats, which park idle regions) every second.
FAST_TICKS = ["--heartbeat-timeout", "3"]
# A reader may lease the whole pool at once (by default at most half of it: issue 40).
ALL_LEASES = ["--quota-lease-bytes", "100%"]


def wait_for(predicate, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_more_instances_than_the_pool_holds_caps_all_connect_and_store(maru_server_factory):
    """8 live instances with a 16 MiB cap each on a 32 MiB pool (the pool holds two caps):
    each connects without a region, stores at most 2 MiB in one region of 2 MiB (its first
    step), and reads everyone's values back intact."""
    server = maru_server_factory(pool_size="32M")
    n, count = 8, 8
    stored, checked = SPAWN.Barrier(n), SPAWN.Barrier(n)
    kw = {"pool_size": "16M", "chunk_size_bytes": "64K"}
    results = run_processes(
        [(share_pool, (server.url, me, n, count, kw, stored, checked)) for me in range(n)],
        timeout=180,
    )
    assert all(r["regions_at_connect"] == 0 for r in results)
    assert all(all(r["ok"]) for r in results), [r["ok"] for r in results]
    assert sum(r["wrong"] for r in results) == 0
    assert all(r["hits"] == n * count for r in results)  # nothing evicted: the pool has room
    assert all(r["held"] <= 2 * MiB for r in results), [r["held"] for r in results]


def _values(prefix: str, n: int, size: int) -> tuple[list[str], list[memoryview]]:
    keys = [f"{prefix}/{i}" for i in range(n)]
    return keys, [make_value(zlib.crc32(k.encode()), size) for k in keys]


def test_a_connect_on_a_pool_held_by_live_instances_gets_room_from_their_idle_regions(
    maru_server_factory,
):
    # (its reader leases every key of the pool at once: no bound on leased bytes)
    server = maru_server_factory(pool_size="16M", extra_args=[*FAST_TICKS, *ALL_LEASES])
    kw = {"server_url": server.url, "pool_size": "8M", "chunk_size_bytes": "64K"}
    a, b = MaruHandler(**kw), MaruHandler(**kw)
    c = None
    try:
        expected: dict[str, str] = {}
        for name, h in (("a", a), ("b", b)):
            keys, values = _values(name, 14, 512 * KiB)
            for i in range(0, 14, 2):  # 7 MiB, in regions of 2, 4 and 2 MiB (growing steps)
                assert all(h.batch_store(keys[i : i + 2], values[i : i + 2]))
            expected.update(zip(keys, map(digest, values)))
            assert len(h.owned_region_ids()) == 3
        # a value A reserved and has not written yet: its region must stay A's
        pending = a.alloc(512 * KiB)
        assert pending is not None
        stats = a.stats()
        assert stats["pool"]["free"] == 0  # every byte of the pool is in A's or B's regions
        region_count = {h: stats["instances"][h.instance_id]["regions"] for h in (a, b)}

        c = MaruHandler(**kw)  # connects on the full pool
        assert c.connected and c.owned_region_ids() == []

        def parked() -> bool:  # the server's view: A's idle regions and all of B's
            inst = c.stats()["instances"]
            return (
                inst[a.instance_id]["parked_regions"] == region_count[a] - 1
                and inst[b.instance_id]["parked_regions"] == region_count[b]
            )

        wait_for(parked, what="A and B to park their idle regions")
        keys, values = _values("c", 8, 512 * KiB)
        assert all(c.batch_store(keys, values))  # room taken back from A and B
        expected.update(zip(keys, map(digest, values)))
        after = c.stats()
        assert after["counters"]["regions_reclaimed"] >= 1
        assert pending.region_id in a.owned_region_ids()  # never the unsealed value's region

        # A writes its reserved value now: its pages were never anyone else's
        late = make_value(7, 512 * KiB)
        pending.buf[:] = late
        assert a.store("a/late", pending)
        expected["a/late"] = digest(late)
        # A and B store again (their parked regions unparked, or room taken back)
        for name, h in (("a2", a), ("b2", b)):
            keys, values = _values(name, 2, 512 * KiB)
            assert all(h.batch_store(keys, values))
            expected.update(zip(keys, map(digest, values)))

        wrong = hits = 0
        with MaruHandler(server_url=server.url, pool_size="2M") as reader:
            keys = list(expected)
            with reader.leased(keys) as infos:
                for key, info in zip(keys, infos):
                    if info is not None:
                        hits += 1
                        wrong += digest(info.view) != expected[key]
                found = dict(zip(keys, infos))
            assert wrong == 0
            # what was stored last is all there; older idle values may have been evicted
            last = ["a/late"] + [k for k in keys if k.startswith(("c/", "a2/", "b2/"))]
            assert all(found[k] is not None for k in last)
            assert hits >= len(last)
    finally:
        for h in (a, b, c):
            if h is not None:
                h.close()


def test_an_11_byte_key_does_not_keep_a_whole_region(maru_server_factory):
    """The README's `pool_size="1G"` no longer takes 1 GiB at connect: an 11-byte key gets one
    chunk's worth of region when the pool is short, and an idle holder gives it up to an
    instance that needs the whole pool."""
    # (a 7 MiB value is read under a lease: no bound on leased bytes)
    server = maru_server_factory(pool_size="8M", extra_args=[*FAST_TICKS, *ALL_LEASES])
    small = MaruHandler(server_url=server.url, pool_size="1G")
    try:
        assert small.store("hello/11", b"hello world")
        held = small.stats()["instances"][small.instance_id]["region_bytes"]
        assert held == 2 * MiB  # its first step (64 MiB) does not fit: what it needs
        with MaruHandler(server_url=server.url, pool_size="8M") as big:
            value = make_value(11, 7 * MiB + 1)  # eight 1 MiB chunks: the whole pool
            wait_for(
                lambda: big.stats()["instances"][small.instance_id]["parked_regions"] == 1,
                what="the small instance to park its region",
            )
            assert big.store("big", value)
            with big.leased(["big", "hello/11"]) as (info, gone):
                assert info is not None and digest(info.view) == digest(value)
                assert gone is None  # evicted with the region it was keeping
        # the small instance learns it at its next tick: it holds nothing now
        wait_for(lambda: small.owned_region_ids() == [], what="the region to be dropped")
        assert small.store("hello/again", b"hello again")  # and it can store again
    finally:
        small.close()
