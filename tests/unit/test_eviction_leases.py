"""Eviction, read leases, pins and the crash reaper, tested on the Registry directly (plus the
few rules that live in MaruService.handle_frame): eviction order, what counts as use, what may never
be evicted, watermark arithmetic, evict-for-room in the caller's own regions, reclaiming the
regions of departed owners, and the counters that report all of it."""

from __future__ import annotations

import time

import pytest

from maru.common import protocol
from maru.common.protocol import (
    DeleteStatus,
    ErrorCode,
    MsgType,
    ProtocolError,
    RegisterStatus,
    freed_notices,
)
from maru.server.pool import REGION_ALIGNMENT, ShmPool
from maru.server.registry import Registry, delete_prefix
from maru.server.service import MaruService
from maru.server.token import TokenSigner

from .registry_calls import lease, locate, register
from .service_calls import locations, proof_of, register_body

KiB, MiB = 1 << 10, 1 << 20


def make_registry(tmp_path, pool_mib=16, high=0.5, low=0.25, lease_seconds=10.0) -> Registry:
    pool = ShmPool(str(tmp_path / "pool"), pool_mib * MiB)
    reg = Registry(
        pool,
        TokenSigner(b"e" * 32),
        high_watermark=high,
        low_watermark=low,
        lease_seconds=lease_seconds,
    )
    for iid in ("A", "B"):
        reg.instances.handshake(iid, 1)
    return reg


def fill(reg: Registry, iid: str, region_id: int, names: list[str], size: int = MiB) -> None:
    """Register `names` back to back in `region_id`, size bytes each, one batch per key (so
    eviction order is registration order and each register may trigger eviction)."""
    base = sum(1 for e in reg.keys.values() if e.region_id == region_id) * size
    for i, name in enumerate(names):
        status = register(reg, iid, [[name, region_id, base + i * size, size]])
        assert status == [RegisterStatus.REGISTERED], name


def consistent(reg: Registry) -> None:
    """Registry bookkeeping invariants: nothing leaked, nothing counted twice."""
    assert reg.live_bytes == sum(e.length for e in reg.keys.values())
    for rid, region in reg.regions.items():
        assert region.live_keys == sum(1 for e in reg.keys.values() if e.region_id == rid)
    assert reg.pool.used == sum(r.length for r in reg.regions.values())
    for key, entry in reg.keys.items():
        leased = sum(lease.entries.count(entry) for lease in reg.leases.values())
        assert entry.leases == leased, key


@pytest.fixture
def reg(tmp_path):
    return make_registry(tmp_path)


# -- eviction order (CLOCK) and what counts as use --------------------------------------------


def test_lru_evicts_oldest_first_down_to_low_watermark(reg):
    rid = reg.request_region("A", 16 * MiB).region_id
    names = [f"k{i}" for i in range(9)]
    fill(reg, "A", rid, names[:8])  # 8 MiB == high watermark of 16 MiB: nothing evicted
    assert reg.counters["evictions"] == 0 and len(reg.keys) == 8
    fill(reg, "A", rid, names[8:])  # 9 MiB > 8 MiB: evict down to 4 MiB (the oldest five)
    assert list(reg.keys) == ["k5", "k6", "k7", "k8"]
    assert reg.live_bytes == 4 * MiB
    assert reg.counters["evictions"] == 5 and reg.counters["bytes_evicted"] == 5 * MiB
    assert reg.instances["A"].evicted == 5
    # the owner is told which pages came free, so its allocator can reuse them
    assert reg.instances.take_freed("A") == [[rid, i * MiB, MiB] for i in range(5)]
    assert locate(reg, ["k0", "k4"])[0] == [None, None]
    consistent(reg)


def test_lookup_and_exists_count_as_use(reg):
    rid = reg.request_region("A", 16 * MiB).region_id
    fill(reg, "A", rid, [f"k{i}" for i in range(8)])
    assert locate(reg, ["k0"])[0][0] is not None  # touch by lookup
    assert reg.exists(["k1", "nope"]) == [True, False]  # touch by exists
    assert reg.exists([b"k2"]) == [False]  # bytes and str are different keys
    fill(reg, "A", rid, ["k8"])
    # evicted: the five oldest not used since: k2..k6; k0 and k1 got a second chance (their
    # CLOCK bits cleared, moved behind the newest key)
    assert list(reg.keys) == ["k7", "k8", "k0", "k1"]
    assert not any(e.referenced for e in reg.keys.values())


def test_a_miss_and_a_pin_do_not_reorder(reg):
    rid = reg.request_region("A", 16 * MiB).region_id
    fill(reg, "A", rid, [f"k{i}" for i in range(8)])
    locate(reg, ["missing"])
    reg.pins.pin(["k0"])
    reg.pins.unpin(["k0"])
    assert next(iter(reg.keys)) == "k0"
    assert not any(e.referenced for e in reg.keys.values())  # still the first candidate


# -- never evicted: pinned, leased --------------------------------------------------------------


def test_pinned_and_leased_keys_are_never_evicted(reg):
    rid = reg.request_region("A", 16 * MiB).region_id
    fill(reg, "A", rid, [f"k{i}" for i in range(8)])
    assert reg.pins.pin(["k0"], "B") == [True]
    lease_id = lease(reg, ["k1"], "B")
    assert lease_id > 0
    fill(reg, "A", rid, ["k8"])
    assert {"k0", "k1"} <= set(reg.keys)
    assert "k2" not in reg.keys and "k6" not in reg.keys  # the next oldest went instead
    assert reg.live_bytes <= 0.25 * reg.pool.capacity  # still reached the low watermark
    consistent(reg)


def test_when_everything_is_busy_nothing_is_evicted(reg):
    rid = reg.request_region("A", 16 * MiB).region_id
    fill(reg, "A", rid, [f"k{i}" for i in range(8)])
    reg.pins.pin([f"k{i}" for i in range(4)], "A")
    lease_id = lease(reg, [f"k{i}" for i in range(4, 8)], "B")
    # The newest key is the only idle one, but it was just reported REGISTERED: it stays,
    # and usage stays above the high watermark until something becomes idle.
    fill(reg, "A", rid, ["k8"])
    assert sorted(reg.keys) == [f"k{i}" for i in range(9)]
    assert reg.counters["evictions"] == 0
    assert reg.leases.release([lease_id], "B") == 1
    fill(reg, "A", rid, ["k9"])  # now the leased keys are idle again and go first, then k8
    assert sorted(reg.keys) == ["k0", "k1", "k2", "k3", "k9"]
    consistent(reg)


def test_leased_or_pinned_key_cannot_be_deleted(reg):
    rid = reg.request_region("A", 4 * MiB).region_id
    fill(reg, "A", rid, ["a", "b"])
    lease_id = lease(reg, ["a"], "B")
    reg.pins.pin(["b"], "B")
    assert reg.delete(["a", "b"]) == [DeleteStatus.PINNED, DeleteStatus.PINNED]
    assert delete_prefix(reg, "a") == (0, 1)  # (deleted, skipped)
    reg.leases.release([lease_id], "B")
    reg.pins.unpin(["b"], "B")
    assert reg.delete(["a", "b"]) == [DeleteStatus.DELETED, DeleteStatus.DELETED]
    consistent(reg)


# -- leases -------------------------------------------------------------------------------------


def test_lease_of_nothing_is_lease_zero(reg):
    assert lease(reg, ["missing", 5, None], "B") == 0
    assert not reg.leases


def test_leases_nest_and_release_is_idempotent(reg):
    rid = reg.request_region("A", 4 * MiB).region_id
    fill(reg, "A", rid, ["k"])
    first = lease(reg, ["k", "missing"], "B")
    second = lease(reg, ["k", "k"], "A")  # a key twice in one batch is held twice
    assert lease(reg, ["k"], None) == 0  # no instance, no lease: nobody could end it
    assert first != second and reg.keys["k"].leases == 3
    assert reg.leases[first].entries == [reg.keys["k"]]  # only keys that exist are held
    assert reg.leases.release([first, first, 999, "x", None], "B") == 1
    assert reg.keys["k"].busy and reg.delete(["k"]) == [DeleteStatus.PINNED]
    assert reg.leases.release([second], None) == 0  # only its owner ends it
    assert reg.leases.release([second], "A") == 1
    assert reg.keys["k"].leases == 0 and not reg.keys["k"].busy
    assert reg.instances["B"].leases == set()
    consistent(reg)


def test_lease_expires(tmp_path):
    reg = make_registry(tmp_path, lease_seconds=5.0)
    rid = reg.request_region("A", 4 * MiB).region_id
    fill(reg, "A", rid, ["k", "j"])
    now = time.monotonic()
    reg.leases.seconds = 1.0
    short = lease(reg, ["k"], "B")
    reg.leases.seconds = 5.0
    default = lease(reg, ["j"], "B")  # --lease-timeout: 5 s
    assert reg.leases.expire(now) == 0
    assert reg.leases.expire(now + 2.0) == 1 and short not in reg.leases
    assert reg.delete(["k"]) == [DeleteStatus.DELETED]
    assert reg.delete(["j"]) == [DeleteStatus.PINNED]
    assert reg.leases.expire(now + 6.0) == 1 and default not in reg.leases
    assert reg.counters["leases_expired"] == 2
    assert reg.instances["B"].leases == set()
    assert reg.delete(["j"]) == [DeleteStatus.DELETED]
    # releasing an expired lease is harmless and not double-counted
    assert reg.leases.release([short, default], "B") == 0
    consistent(reg)


def test_lease_on_key_deleted_meanwhile_is_harmless(reg):
    rid = reg.request_region("A", 4 * MiB).region_id
    fill(reg, "A", rid, ["k"])
    lease_id = lease(reg, ["k"], "B")
    reg.keys["k"].leases = 0  # simulate the key going (e.g. reaped owner + forced delete)
    assert reg.delete(["k"]) == [DeleteStatus.DELETED]
    fill(reg, "A", rid, ["k"])  # re-registered under the same name: a new entry
    new_lease = lease(reg, ["k"], "B")
    assert reg.leases.release([lease_id], "B") == 1
    # the old lease held the old entry: the new entry's lease count is untouched
    assert reg.keys["k"].leases == 1
    assert reg.leases.release([new_lease], "B") == 1
    assert reg.keys["k"].leases == 0  # never negative


# -- the reaper ---------------------------------------------------------------------------------


def test_reap_releases_pins_leases_and_regions(reg):
    pool = reg.pool
    used0 = pool.used
    ra = reg.request_region("A", 4 * MiB)
    empty = reg.request_region("A", 2 * MiB)
    rb = reg.request_region("B", 2 * MiB)
    fill(reg, "A", ra.region_id, ["a0", "a1"])
    reg.pins.pin(["a0"], "B")
    reg.pins.pin(["a0"], "A")  # A's own pin: stays after B goes
    lease_id = lease(reg, ["a1"], "B")
    now = time.monotonic()
    reg.instances["A"].last_seen = now  # A is alive
    reg.instances["B"].last_seen = now - 100  # B went silent
    assert reg.instances.reap(10.0, now) == ["B"]
    assert "B" not in reg.instances and reg.counters["instances_reaped"] == 1
    assert lease_id not in reg.leases and reg.keys["a1"].leases == 0
    assert reg.keys["a0"].pins == 1  # B's pin released, A's kept
    assert rb.region_id not in reg.regions  # B's keyless region went back to the pool
    assert reg.delete(["a1"]) == [DeleteStatus.DELETED]
    assert reg.delete(["a0"]) == [DeleteStatus.PINNED]
    # now A dies too: its keys stay readable, its regions are owner-disconnected
    assert reg.instances.reap(10.0, now + 100) == ["A"]
    assert locate(reg, ["a0"])[0] == [[ra.region_id, 0, MiB]]
    assert reg.regions[ra.region_id].returned
    assert empty.region_id not in reg.regions
    with pytest.raises(ProtocolError) as exc:  # a dead instance cannot write any more
        register(reg, "A", [["x", ra.region_id, 2 * MiB, 1]])
    assert exc.value.code == ErrorCode.UNKNOWN_INSTANCE
    assert reg.delete(["a0"]) == [DeleteStatus.DELETED]  # A's pin died with A
    assert ra.region_id not in reg.regions  # last key gone: region freed
    assert pool.used == used0 and not reg.regions
    consistent(reg)


def test_reap_spares_instances_heard_from(reg):
    now = time.monotonic()
    reg.instances["A"].last_seen = now - 5
    reg.instances["B"].last_seen = now - 20
    assert reg.instances.reap(10.0, now) == ["B"]
    assert reg.instances.reap(10.0, now) == []  # idempotent
    reg.instances.require("A")  # any request naming the instance refreshes it
    assert reg.instances.reap(10.0, time.monotonic() + 9.0) == []


def test_recycled_pid_inherits_nothing(reg):
    r = reg.request_region("A", 2 * MiB)
    fill(reg, "A", r.region_id, ["k"])
    reg.pins.pin(["k"], "A")
    reg.instances["A"].last_seen -= 100
    reg.instances.reap(10.0)
    # a new process with the same PID is a new instance: no regions, no pins, no leases
    assert reg.instances.handshake("C", 1) == []
    assert reg.regions.handles("C") == []
    assert reg.stats()["instances"]["C"]["pins"] == 0
    with pytest.raises(ProtocolError) as exc:
        reg.return_region("C", r.region_id, r.token)
    assert exc.value.code == ErrorCode.NOT_OWNER
    # even the same instance id coming back does not get its old regions or pins back
    assert reg.instances.handshake("A", 1) == []
    assert reg.keys["k"].pins == 0


# -- watermark arithmetic ----------------------------------------------------------------------


@pytest.mark.parametrize(("high", "low"), [(0.95, 0.85), (0.5, 0.25), (0.8, 0.8), (1.0, 0.5)])
def test_watermark_math(tmp_path, high, low):
    reg = make_registry(tmp_path, pool_mib=16, high=high, low=low)
    cap = reg.pool.capacity
    rid = reg.request_region("A", 16 * MiB).region_id
    # one byte-exact key up to the high watermark: no eviction
    at_high = int(high * cap)
    unit = 4 * KiB
    n = at_high // unit
    register(reg, "A", [[f"k{i}", rid, i * unit, unit] for i in range(n)])
    rest = at_high - n * unit
    if rest:
        register(reg, "A", [["rest", rid, n * unit, rest]])
    assert reg.live_bytes == at_high and reg.counters["evictions"] == 0
    if at_high + 1 <= cap:
        # one byte more crosses it: evict down to the low watermark (and no further than one
        # key's worth below it)
        register(reg, "A", [["over", rid, at_high, 1]])
        assert reg.counters["evictions"] > 0
        assert reg.live_bytes <= low * cap
        assert reg.live_bytes > low * cap - unit
        assert "over" in reg.keys  # the newest key is the last candidate
    consistent(reg)


def test_a_watermark_round_takes_its_victims_from_instances_over_their_fair_share(reg):
    """Two writers share a 16 MiB pool (a fair share of 8 MiB each). B, below its share,
    wrote first; A, over it, drives the pool past the high watermark. The round evicts A's
    oldest keys, not B's older ones: a pool-wide CLOCK took B's first (the flaky newcomer of
    `test_quotas.py`'s fair-share test), which freed room A could not use and cost B hits."""
    rid_b = reg.request_region("B", 4 * MiB).region_id
    rid_a = reg.request_region("A", 12 * MiB).region_id
    fill(reg, "B", rid_b, ["b0", "b1", "b2"])
    fill(reg, "A", rid_a, [f"a{i}" for i in range(6)])  # 9 MiB > 8: down to 4 MiB
    assert list(reg.keys) == ["b0", "b1", "b2", "a5"]
    assert reg.instances["B"].evicted == 0 and reg.instances["A"].evicted == 5
    consistent(reg)


def test_a_watermark_round_takes_the_rest_from_every_key_when_those_over_cannot_give_it(reg):
    """What the instances over their share cannot give (pinned keys, the keys just
    registered) comes from every key, in CLOCK order: the watermark is still kept."""
    rid_b = reg.request_region("B", 4 * MiB).region_id
    rid_a = reg.request_region("A", 12 * MiB).region_id
    fill(reg, "B", rid_b, ["b0", "b1", "b2"])
    fill(reg, "A", rid_a, [f"a{i}" for i in range(5)])
    reg.pins.pin(["a0", "a1", "a2", "a3"])
    fill(reg, "A", rid_a, ["a5"])  # 5 MiB wanted: a4 from A, then b0..b2 from the pool
    assert list(reg.keys) == ["a0", "a1", "a2", "a3", "a5"]
    assert reg.instances["B"].evicted == 3
    consistent(reg)


def test_one_writer_alone_is_never_over_its_share_and_its_watermark_is_unchanged(reg):
    rid = reg.request_region("A", 16 * MiB).region_id
    assert reg.grants.regions_over_share() == set()
    fill(reg, "A", rid, [f"k{i}" for i in range(9)])
    assert list(reg.keys) == ["k5", "k6", "k7", "k8"]


@pytest.mark.parametrize(("high", "low"), [(0.5, 0.6), (0.0, 0.0), (1.1, 0.5), (0.5, 0.0)])
def test_watermarks_are_validated(tmp_path, high, low):
    with pytest.raises(ValueError):
        make_registry(tmp_path, high=high, low=low)


# -- evict_for: only in the caller's own regions -------------------------------------------


def test_evict_for_only_evicts_in_own_regions(tmp_path):
    reg = make_registry(tmp_path, high=1.0, low=1.0)
    rb = reg.request_region("B", 4 * MiB).region_id
    ra = reg.request_region("A", 4 * MiB).region_id
    fill(reg, "B", rb, ["b0", "b1", "b2"])  # B's keys are the oldest
    fill(reg, "A", ra, ["a0", "a1", "a2"])
    lease(reg, ["a0"], "B")
    assert reg.eviction.evict_for("A", MiB + 1) == 2 * MiB  # a1, a2 (a0 is leased; B's untouched)
    assert sorted(reg.keys) == ["a0", "b0", "b1", "b2"]
    assert reg.instances.take_freed("A") == [[ra, MiB, MiB], [ra, 2 * MiB, MiB]]
    assert reg.instances.take_freed("B") == []
    assert reg.eviction.evict_for("A", MiB) == 0  # only a leased key left: nothing to give
    assert reg.counters["evictions"] == 2 and reg.counters["bytes_evicted"] == 2 * MiB
    for bad in (0, -1, "1M", None):
        with pytest.raises(ProtocolError) as exc:
            reg.eviction.evict_for("A", bad)
        assert exc.value.code == ErrorCode.BAD_REQUEST
    for bad_ahead in (-1, MiB + 1, True, "1M", None):  # (of the bytes asked: 0 to all)
        with pytest.raises(ProtocolError, match="'ahead'") as exc:
            reg.eviction.evict_for("A", MiB, bad_ahead)
        assert exc.value.code == ErrorCode.BAD_REQUEST
    with pytest.raises(ProtocolError) as exc:
        reg.eviction.evict_for("nobody", MiB)
    assert exc.value.code == ErrorCode.UNKNOWN_INSTANCE
    consistent(reg)


# -- reclaiming the regions of departed owners on POOL_FULL ----------------------------------


def test_pool_full_reclaims_an_orphan_region(tmp_path):
    reg = make_registry(tmp_path, pool_mib=8, high=1.0, low=1.0)
    ra = reg.request_region("A", 4 * MiB).region_id
    rb = reg.request_region("B", 4 * MiB).region_id
    fill(reg, "A", ra, ["a0", "a1"])
    fill(reg, "B", rb, ["b0"])
    with pytest.raises(ProtocolError) as exc:  # everyone is alive: nothing to reclaim
        reg.request_region("B", 2 * MiB)
    assert exc.value.code == ErrorCode.POOL_FULL
    reg.instances.disconnect("A")  # A is gone; its keys stay readable...
    assert reg.exists(["a0", "a1"]) == [True, True]
    # ...until a live instance needs the room: A's keys are evicted, its region freed
    h = reg.request_region("B", 4 * MiB)
    assert h.offset == 0 and ra not in reg.regions
    assert reg.exists(["a0", "a1", "b0"]) == [False, False, True]
    assert reg.counters["evictions"] == 2
    consistent(reg)


def test_a_region_taken_ahead_of_need_reclaims_nothing(tmp_path):
    """A region asked for ahead of need (REQUEST_REGION `ahead`: the client's
    `RegionSupply.ready`) on a full pool is POOL_FULL at once: an orphan's keys stay, where a
    write's request evicts them for its region."""
    reg = make_registry(tmp_path, pool_mib=8, high=1.0, low=1.0)
    ra = reg.request_region("A", 4 * MiB).region_id
    reg.request_region("B", 4 * MiB)
    fill(reg, "A", ra, ["a0", "a1"])
    reg.instances.disconnect("A")  # an orphan region: reclaimable for a write
    with pytest.raises(ProtocolError) as exc:
        reg.request_region("B", 4 * MiB, reclaim=False)
    assert exc.value.code == ErrorCode.POOL_FULL
    assert reg.exists(["a0", "a1"]) == [True, True] and reg.counters["evictions"] == 0
    reg.request_region("B", 4 * MiB)  # a write's: the orphan is reclaimed
    assert reg.exists(["a0", "a1"]) == [False, False]
    consistent(reg)


def test_an_absurd_region_size_is_refused_before_any_orphan_is_evicted(tmp_path):
    """Issue 13, scenario 9: a REQUEST_REGION of 2^62 bytes used to evict every orphaned key
    on its way to POOL_FULL."""
    reg = make_registry(tmp_path, pool_mib=8, high=1.0, low=1.0)
    ra = reg.request_region("A", 4 * MiB).region_id
    fill(reg, "A", ra, ["a0", "a1"])
    reg.instances.disconnect("A")  # an orphan region: reclaimable, but only for a request that fits
    for size in (2**62, 8 * MiB + 1):
        with pytest.raises(ProtocolError) as exc:
            reg.request_region("B", size)
        assert exc.value.code == ErrorCode.POOL_FULL
    assert reg.exists(["a0", "a1"]) == [True, True] and reg.counters["evictions"] == 0
    consistent(reg)


def test_orphan_reclaim_when_keys_of_orphans_interleave(tmp_path):
    """Keys of two orphan regions in alternating LRU order: evicting one region's worth of
    bytes in plain LRU order empties neither region, yet one region must be reclaimed."""
    reg = make_registry(tmp_path, pool_mib=8, high=1.0, low=1.0)
    r1 = reg.request_region("A", 2 * MiB).region_id
    r2 = reg.request_region("A", 2 * MiB).region_id
    reg.request_region("B", 4 * MiB)
    half = 512 * KiB
    for i in range(4):
        register(reg, "A", [[f"x{i}", r1, i * half, half]])
        register(reg, "A", [[f"y{i}", r2, i * half, half]])
    reg.instances.disconnect("A")
    h = reg.request_region("B", 2 * MiB)
    assert h.length == 2 * MiB
    assert (r1 in reg.regions) != (r2 in reg.regions)  # exactly one orphan reclaimed
    survivors = sorted(reg.keys)
    assert survivors in (["x0", "x1", "x2", "x3"], ["y0", "y1", "y2", "y3"])
    consistent(reg)


def test_orphan_reclaim_skips_busy_keys_and_live_owners(tmp_path):
    reg = make_registry(tmp_path, pool_mib=8, high=1.0, low=1.0)
    ra = reg.request_region("A", 4 * MiB).region_id
    rb = reg.request_region("B", 4 * MiB).region_id
    fill(reg, "A", ra, ["a0"])
    fill(reg, "B", rb, ["b0"])
    reg.instances.handshake("C", 3)
    reg.pins.pin(["a0"], "C")  # a live reader pinned the orphan's key
    reg.instances.disconnect("A")
    with pytest.raises(ProtocolError) as exc:
        reg.request_region("C", 2 * MiB)
    assert exc.value.code == ErrorCode.POOL_FULL
    assert reg.exists(["a0", "b0"]) == [True, True]  # neither pinned nor live keys evicted
    reg.pins.unpin(["a0"], "C")
    assert reg.request_region("C", 2 * MiB).length == 2 * MiB
    assert reg.exists(["a0", "b0"]) == [False, True]
    consistent(reg)


# -- taking parked regions back from idle live owners (issue 15) -----------------------------


def test_an_empty_parked_region_is_taken_back_without_evicting(tmp_path):
    reg = make_registry(tmp_path, pool_mib=8, high=1.0, low=1.0)
    ra = reg.request_region("A", 2 * MiB).region_id
    spare = reg.request_region("A", 2 * MiB).region_id
    rb = reg.request_region("B", 4 * MiB).region_id
    fill(reg, "A", ra, ["a0"])
    fill(reg, "B", rb, ["b0"])
    reg.instances.handshake("C", 3)
    with pytest.raises(ProtocolError) as exc:  # nothing parked: every region is in use
        reg.request_region("C", 2 * MiB)
    # C holds less than its fair share (8 MiB / 3): A and B, above theirs, are asked to give
    # regions back (on their next replies) and C to retry
    assert exc.value.code == ErrorCode.POOL_RECLAIMING
    assert reg.instances["A"].shed > 0 and reg.instances["B"].shed > 0
    assert reg.park("A", 1, [spare], []) == ([], [])
    h = reg.request_region("C", 2 * MiB)
    assert spare not in reg.regions and spare not in reg.instances["A"].regions
    assert reg.exists(["a0", "b0"]) == [True, True] and reg.counters["evictions"] == 0
    assert reg.counters["regions_reclaimed"] == 1 and h.owner == "C"
    # A learns it at its next park request (or handshake): the region is gone
    assert reg.park("A", 2, [spare], []) == ([], [spare])
    assert [r.region_id for r in map(reg.regions.get, [ra]) if r] == [ra]
    consistent(reg)


def test_a_parked_region_with_keys_is_emptied_and_its_owner_not_told_of_pages(tmp_path):
    """The keys of a parked region are evicted (CLOCK order among idle regions) and it frees;
    its owner gets no `freed` notice for them: the pages are no longer its own."""
    reg = make_registry(tmp_path, pool_mib=8, high=1.0, low=1.0)
    ra = reg.request_region("A", 4 * MiB).region_id
    rb = reg.request_region("B", 4 * MiB).region_id
    fill(reg, "A", ra, ["a0", "a1"])
    fill(reg, "B", rb, ["b0"])
    reg.park("A", 1, [ra], [])
    reg.instances.handshake("C", 3)
    h = reg.request_region("C", 4 * MiB)
    assert h.offset == 0 and ra not in reg.regions
    assert reg.exists(["a0", "a1", "b0"]) == [False, False, True]
    assert reg.instances.take_freed("A") == [] and reg.instances["A"].regions == set()
    consistent(reg)


def test_an_unparked_region_is_never_taken_back_even_by_a_late_park(tmp_path):
    """`seq` orders park requests: a park older than the unpark after which the owner writes
    again (a late copy, a retry) changes nothing."""
    reg = make_registry(tmp_path, pool_mib=4, high=1.0, low=1.0)
    ra = reg.request_region("A", 4 * MiB).region_id
    reg.instances.handshake("C", 3)
    assert reg.park("A", 5, [ra], []) == ([], [])
    assert reg.park("A", 6, [], [ra]) == ([ra], [])  # the owner may write there again
    assert reg.park("A", 5, [ra], []) == ([], [])  # the late copy of the park: ignored
    assert reg.park("A", 6, [], [ra]) == ([], [])  # a stale unpark unparks nothing either
    with pytest.raises(ProtocolError) as exc:
        reg.request_region("C", 2 * MiB)
    # (C, holding nothing, is owed one region: A is asked to give one back, none taken)
    assert exc.value.code == ErrorCode.POOL_RECLAIMING and ra in reg.instances["A"].regions
    for bad in [(-1, [ra], []), (True, [], []), (7, ["1"], [])]:
        with pytest.raises(ProtocolError) as exc:
            reg.park("A", *bad)
        assert exc.value.code == ErrorCode.BAD_REQUEST
    consistent(reg)


def test_a_writer_over_its_fair_share_takes_no_parked_region_of_one_within_its_own(tmp_path):
    """A holds 12 MiB of a 16 MiB pool (its fair share: 8); B's 4 MiB region, parked, holds
    keys. A's next region request is POOL_FULL (A evicts among its own keys), not B's keys
    evicted: before, any parked region was taken back for any requester. B's empty parked
    region and a region given back are still taken: they cost nobody a key."""
    reg = make_registry(tmp_path, pool_mib=16, high=1.0, low=1.0)
    ra = reg.request_region("A", 12 * MiB).region_id
    rb = reg.request_region("B", 4 * MiB).region_id
    fill(reg, "A", ra, ["a0"])
    fill(reg, "B", rb, ["b0", "b1"])
    reg.park("B", 1, [rb], [])
    with pytest.raises(ProtocolError) as exc:
        reg.request_region("A", 2 * MiB)
    assert exc.value.code == ErrorCode.POOL_FULL
    assert "over its fair share" in str(exc.value)
    assert reg.exists(["b0", "b1"]) == [True, True] and rb in reg.instances["B"].regions
    assert reg.counters["evictions"] == 0
    # B, below its share, still takes A's idle region back (A's parked keys go)
    reg.park("A", 1, [ra], [])
    assert reg.request_region("B", 2 * MiB).owner == "B"
    assert reg.exists(["a0"]) == [False]
    consistent(reg)


def test_a_writer_below_its_share_asks_those_over_theirs_before_it_empties_an_idle_one(tmp_path):
    """C, new, is below its share (16 MiB / 3 writers); A holds 12 MiB, all in use; B, within
    its share, parked its 4 MiB region of keys. C's request asks A to give back
    (POOL_RECLAIMING) and leaves B's keys: before, B's region was emptied at once. Once A
    parks a region, C takes that one."""
    reg = make_registry(tmp_path, pool_mib=16, high=1.0, low=1.0)
    ra = [reg.request_region("A", 4 * MiB).region_id for _ in range(3)]
    rb = reg.request_region("B", 4 * MiB).region_id
    fill(reg, "A", ra[0], ["a0"])
    fill(reg, "B", rb, ["b0", "b1"])
    reg.park("B", 1, [rb], [])
    reg.instances.handshake("C", 3)
    with pytest.raises(ProtocolError) as exc:
        reg.request_region("C", 2 * MiB)
    assert exc.value.code == ErrorCode.POOL_RECLAIMING and reg.instances["A"].shed > 0
    assert reg.exists(["b0", "b1"]) == [True, True] and rb in reg.instances["B"].regions
    reg.park("A", 1, [ra[0]], [])
    assert reg.request_region("C", 2 * MiB).owner == "C"
    assert reg.exists(["a0", "b0", "b1"]) == [False, True, True]
    consistent(reg)


def test_a_writer_over_its_share_with_no_region_large_enough_may_take_any_idle_one(tmp_path):
    """Evicting its own keys cannot make room for a value larger than every region it holds
    (here: none), so the request takes an idle region of an instance within its share, as
    before: the store succeeds instead of failing for a rule that could not help."""
    reg = make_registry(tmp_path, pool_mib=8, high=1.0, low=1.0)
    rb = reg.request_region("B", 2 * MiB).region_id
    fill(reg, "B", rb, ["b0"])
    reg.park("B", 1, [rb], [])
    assert reg.request_region("A", 8 * MiB).owner == "A"  # (over its 4 MiB share)
    assert reg.exists(["b0"]) == [False]
    consistent(reg)


def test_a_writer_over_its_fair_share_still_takes_an_empty_or_given_back_region(tmp_path):
    reg = make_registry(tmp_path, pool_mib=16, high=1.0, low=1.0)
    ra = reg.request_region("A", 12 * MiB).region_id
    rb = reg.request_region("B", 2 * MiB).region_id
    rb2 = reg.request_region("B", 2 * MiB).region_id
    fill(reg, "A", ra, ["a0"])
    fill(reg, "B", rb2, ["b0"])
    reg.park("B", 1, [rb], [])  # (empty)
    assert reg.request_region("A", 2 * MiB).owner == "A"
    assert rb not in reg.regions
    reg.return_region("B", rb2, reg.regions[rb2].token)
    assert reg.request_region("A", 2 * MiB).owner == "A"  # (B's given-back keys go)
    assert reg.exists(["b0", "a0"]) == [False, True]
    consistent(reg)


def test_a_parked_region_with_a_busy_key_is_not_taken_back(tmp_path):
    reg = make_registry(tmp_path, pool_mib=4, high=1.0, low=1.0)
    ra = reg.request_region("A", 4 * MiB).region_id
    fill(reg, "A", ra, ["a0"])
    reg.instances.handshake("C", 3)
    lease_id = lease(reg, ["a0"], "C")
    reg.park("A", 1, [ra], [])
    with pytest.raises(ProtocolError) as exc:
        reg.request_region("C", 2 * MiB)
    assert exc.value.code == ErrorCode.POOL_RECLAIMING  # (A asked to give one back)
    assert ra in reg.instances["A"].regions and reg.exists(["a0"]) == [True]
    reg.leases.release([lease_id], "C")
    assert reg.request_region("C", 2 * MiB).length == 2 * MiB
    consistent(reg)


def test_min_size_takes_what_is_free_before_reclaiming(tmp_path):
    reg = make_registry(tmp_path, pool_mib=8, high=1.0, low=1.0)
    ra = reg.request_region("A", 4 * MiB).region_id
    fill(reg, "A", ra, ["a0"])
    reg.park("A", 1, [ra], [])
    # 8 MiB wanted, 2 MiB needed: the free 4 MiB are enough, A's parked region stays
    assert reg.request_region("B", 8 * MiB, 2 * MiB).length == 2 * MiB
    assert ra in reg.regions and reg.exists(["a0"]) == [True]
    for bad in (0, -1, "2M"):
        with pytest.raises(ProtocolError) as exc:
            reg.request_region("B", 8 * MiB, bad)
        assert exc.value.code == ErrorCode.BAD_REQUEST
    consistent(reg)


# -- stats --------------------------------------------------------------------------------------


def test_stats_report_evictions_and_bytes(reg):
    rid = reg.request_region("A", 16 * MiB).region_id
    register(reg, "A", [[f"k{i}", rid, i * MiB, MiB - 100] for i in range(6)])
    register(reg, "A", [[f"k{i}", rid, i * MiB, MiB - 100] for i in range(6, 10)])
    stats = reg.stats()
    evicted = stats["counters"]["evictions"]
    assert evicted == 6  # 10 * (1 MiB - 100) > 8 MiB: down to <= 4 MiB (k6..k9 are new)
    assert stats["counters"]["bytes_evicted"] == evicted * (MiB - 100)
    assert stats["live_bytes"] == (10 - evicted) * (MiB - 100) == reg.live_bytes
    assert stats["instances"]["A"]["evicted"] == evicted
    assert stats["watermarks"] == {"high": 0.5, "low": 0.25}
    assert stats["keys"] == 10 - evicted
    # the whole thing crosses the wire
    protocol.encode(MsgType.STATS, 1, {"stats": stats}, reply=True)


# -- the same rules through the service ---------------------------------------------------------


@pytest.fixture
def service(tmp_path):
    svc = MaruService(make_registry(tmp_path, high=0.95, low=0.85), "tcp://127.0.0.1:0")
    try:
        yield svc
    finally:
        svc.close()


def call(svc, msg_type, body):
    """A request of the instance `body["iid"]` (created by `make_registry`), sent with its
    session credential; without "iid", an anonymous request."""
    body = dict(body)
    if "iid" in body:
        iid = body.pop("iid")
        body["session"] = svc.registry.instances.open_session(iid)
        if msg_type == protocol.MsgType.REQUEST_REGION:
            body["pool_proof"] = proof_of(svc, iid)
    _, reply = protocol.decode(svc.handle_frame(protocol.encode(msg_type, 7, body)))
    assert reply["ok"], reply
    return reply


def test_lookup_with_lease_holds_until_release(service):
    reg = service.registry
    rid = call(service, MsgType.REQUEST_REGION, {"iid": "A", "size": MiB})["region"][0]
    call(service, MsgType.REGISTER_KV, register_body("A", [["k", rid, 0, 10]]))
    reply = call(service, MsgType.LOOKUP_KV, {"iid": "B", "keys": ["k", "x"], "lease": True})
    lease_id = reply["lease_id"]
    assert lease_id > 0 and locations(reply)[0] == [rid, 0, 10]
    assert call(service, MsgType.DELETE_KV, {"keys": ["k"]})["results"] == [DeleteStatus.PINNED]
    assert call(service, MsgType.EVICT_FOR, {"iid": "A", "bytes": MiB})["freed_bytes"] == 0
    assert call(service, MsgType.RELEASE, {"iid": "A", "leases": [lease_id]})["released"] == 0
    assert call(service, MsgType.RELEASE, {"iid": "B", "leases": [lease_id]})["released"] == 1
    assert call(service, MsgType.EVICT_FOR, {"iid": "A", "bytes": 1})["freed_bytes"] == 10
    assert not reg.keys
    # a lookup without `lease` takes none; a lease on misses is lease 0
    assert call(service, MsgType.LOOKUP_KV, {"keys": ["k"]})["lease_id"] == 0
    assert call(service, MsgType.LOOKUP_KV, {"keys": ["k"], "lease": True})["lease_id"] == 0


def test_freed_pages_are_not_handed_out_on_a_fire_and_forget_release(service):
    """The handler sends RELEASE without waiting for its reply (and may never read it): the
    one-time `freed` notification must wait for a reply the client does read."""
    rid = call(service, MsgType.REQUEST_REGION, {"iid": "A", "size": MiB})["region"][0]
    call(service, MsgType.REGISTER_KV, register_body("A", [["k", rid, 0, 10]]))
    lease_id = call(service, MsgType.LOOKUP_KV, {"iid": "A", "keys": ["k"], "lease": True})[
        "lease_id"
    ]
    service.registry.leases.release([lease_id], "A")
    call(service, MsgType.DELETE_KV, {"iid": "B", "keys": ["k"]})
    assert "freed" not in call(service, MsgType.RELEASE, {"iid": "A", "leases": [lease_id]})
    assert freed_notices(call(service, MsgType.HEARTBEAT, {"iid": "A"})["freed"]) == [[rid, 0, 10]]


def test_housekeeping_expires_leases_and_reaps(service):
    reg = service.registry
    service.housekeeper.heartbeat_timeout = 10.0
    rid = call(service, MsgType.REQUEST_REGION, {"iid": "A", "size": MiB})["region"][0]
    call(service, MsgType.REGISTER_KV, register_body("A", [["k", rid, 0, 10]]))
    call(service, MsgType.LOOKUP_KV, {"iid": "A", "keys": ["k"], "lease": True})
    now = time.monotonic()
    service.housekeeping(now + reg.leases.seconds + 1)
    assert not reg.leases and reg.counters["leases_expired"] == 1
    service.housekeeper.next_reap = 0.0
    service.housekeeping(now + 100)
    assert "A" not in reg.instances and "B" not in reg.instances
    assert reg.regions[rid].returned and reg.exists(["k"]) == [True]


@pytest.mark.parametrize(
    ("msg_type", "body"),
    [
        (MsgType.HEARTBEAT, {}),
        (MsgType.LOOKUP_KV, {"keys": ["x"]}),
        (MsgType.EXISTS, {"keys": ["x"]}),
        (MsgType.PIN, {"keys": ["x"]}),
        (MsgType.RELEASE, {"leases": [1]}),
        (MsgType.STATS, {}),
    ],
)
def test_any_message_naming_an_instance_keeps_it_alive(service, msg_type, body):
    """The handler's heartbeat thread sends HEARTBEAT; a reader only sends lookups. Either must
    count as a sign of life, or idle and read-only clients are reaped while alive."""
    reg = service.registry
    service.housekeeper.heartbeat_timeout = 10.0
    reg.instances["A"].last_seen = time.monotonic() - 100
    reg.instances["B"].last_seen = time.monotonic() - 100
    call(service, msg_type, dict(body, iid="A"))
    assert reg.instances.reap(10.0) == ["B"]  # B said nothing (its handshake is old)
    assert "A" in reg.instances


def test_region_alignment_assumption():
    assert 2 * MiB == REGION_ALIGNMENT  # the pool arithmetic in this file relies on it


def test_freed_pages_in_a_late_reply_still_reach_the_owner():
    """Eviction tells the owner which pages came free on its next reply, once. If that reply
    arrives after the caller gave up (timeout), the pages must still be handed back, or they
    stay allocated in the client for good."""
    import zmq

    from maru.client.rpc import RpcClient
    from maru.common.errors import MaruConnectionError

    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    seen: list[list] = []
    client = RpcClient(f"tcp://127.0.0.1:{port}", timeout_ms=2000, reply_hook=seen.append)
    try:
        late = client.request(MsgType.HEARTBEAT, {"iid": "A"})
        assert router.poll(5000)
        ident, frame = router.recv_multipart()
        with pytest.raises(MaruConnectionError):
            late.result(timeout_ms=50)  # the caller gives up
        head, _ = protocol.decode(frame)
        router.send_multipart(
            [
                ident,
                protocol.encode(
                    head.msg_type, head.request_id, {"ok": True, "freed": [[1, 0, 5]]}, reply=True
                ),
            ]
        )
        nxt = client.request(MsgType.HEARTBEAT, {"iid": "A"})
        assert router.poll(5000)
        ident, frame = router.recv_multipart()
        head, _ = protocol.decode(frame)
        router.send_multipart(
            [ident, protocol.encode(head.msg_type, head.request_id, {"ok": True}, reply=True)]
        )
        assert nxt.result()["ok"] is True
        assert [body.get("freed") for body in seen] == [[[1, 0, 5]], None]
    finally:
        client.close()
        router.close(linger=0)


def test_a_stall_of_the_server_is_not_counted_as_client_silence(service):
    reg = service.registry
    now = time.monotonic()
    reg.instances["A"].last_seen = now - 3.0
    reg.instances["B"].last_seen = now - 3.0
    service._forgive_stall(0.5)  # ordinary jitter: no change
    assert reg.instances.reap(2.0, now) == ["A", "B"]
    reg.instances.handshake("A", 1)
    reg.instances.handshake("B", 1)
    reg.instances["A"].last_seen = now - 3.0
    reg.instances["B"].last_seen = now - 3.0
    service._forgive_stall(2.5)  # the server did not run for 2.5 s
    assert reg.instances.reap(2.0, now) == []
    assert reg.instances.reap(2.0, now + 2.0) == ["A", "B"]  # afterwards silence counts again
