"""Registry rules, tested directly (no sockets): first writer wins, pinned delete refused,
deferred free, freed-page notification, token and ownership checks."""

from __future__ import annotations

import logging

import pytest

from maru.common.protocol import (
    MAX_KEY_BYTES,
    DeleteStatus,
    ErrorCode,
    ProtocolError,
    RegisterStatus,
)
from maru.server.pool import REGION_ALIGNMENT, ShmPool
from maru.server.registry import Registry
from maru.server.token import TokenSigner

from .registry_calls import locate, register

MiB = 1 << 20


@pytest.fixture
def registry(tmp_path):
    pool = ShmPool(str(tmp_path / "pool"), 16 * MiB)
    reg = Registry(pool, TokenSigner(b"k" * 32))
    reg.instances.handshake("A", 100)
    reg.instances.handshake("B", 200)
    return reg


def codes(excinfo) -> ErrorCode:
    return excinfo.value.code


def test_unknown_instance_must_handshake(registry):
    with pytest.raises(ProtocolError) as exc:
        registry.request_region("nobody", MiB)
    assert codes(exc) == ErrorCode.UNKNOWN_INSTANCE
    with pytest.raises(ProtocolError) as exc:
        register(registry, "nobody", [["k", 1, 0, 10]])
    assert codes(exc) == ErrorCode.UNKNOWN_INSTANCE


@pytest.mark.parametrize("iid", ["", None, 5, "x" * 129])
def test_handshake_rejects_bad_instance_ids(registry, iid):
    with pytest.raises(ProtocolError) as exc:
        registry.instances.handshake(iid, 1)
    assert codes(exc) == ErrorCode.BAD_REQUEST


def test_region_is_rounded_signed_and_returned_on_rehandshake(registry):
    h = registry.request_region("A", 3 * MiB)
    assert h.length == 2 * REGION_ALIGNMENT
    assert h.offset % REGION_ALIGNMENT == 0
    assert h.owner == "A"
    assert registry.signer.verify(h.token, h.region_id, h.path, h.offset, h.length)
    assert not registry.signer.verify(h.token, h.region_id, h.path, h.offset + 1, h.length)
    # a reconnecting instance is told which regions it still owns
    assert registry.instances.handshake("A", 101) == [h]
    assert registry.instances.handshake("B", 201) == []
    assert registry.regions.verified(h.region_id, h.token).handle() == h


def test_pool_full_is_an_error_naming_the_pool(registry, caplog):
    registry.request_region("A", 10 * MiB)
    with (
        caplog.at_level(logging.WARNING, logger="maru.server.registry"),
        pytest.raises(ProtocolError) as exc,
    ):
        registry.request_region("B", 8 * MiB)
    # (B is owed half the pool: A, over its half, is asked to give regions back)
    assert codes(exc) == ErrorCode.POOL_RECLAIMING and registry.instances["A"].shed
    assert registry.pool.name in str(exc.value)
    assert any(registry.pool.name in r.getMessage() for r in caplog.records)
    # a smaller region still fits
    assert registry.request_region("B", 6 * MiB).length == 6 * MiB


@pytest.mark.parametrize("size", [0, -1, "1M", None, 1.5])
def test_bad_region_size(registry, size):
    with pytest.raises(ProtocolError) as exc:
        registry.request_region("A", size)
    assert codes(exc) == ErrorCode.BAD_REQUEST


def test_first_writer_wins(registry):
    ra = registry.request_region("A", 2 * MiB)
    rb = registry.request_region("B", 2 * MiB)
    assert register(registry, "A", [["k", ra.region_id, 0, 100]]) == [RegisterStatus.REGISTERED]
    assert register(registry, "B", [["k", rb.region_id, 0, 100]]) == [RegisterStatus.EXISTS]
    assert register(registry, "A", [["k", ra.region_id, 4096, 100]]) == [RegisterStatus.EXISTS]
    locations, regions = locate(registry, ["k"])
    assert locations == [[ra.region_id, 0, 100]]
    assert regions == [ra]
    assert len(registry.keys) == 1
    assert registry.regions[rb.region_id].live_keys == 0
    assert registry.counters["keys_duplicate"] == 2


def test_the_same_registration_again_is_registered_not_exists(registry):
    """A REGISTER_KV that reaches the server twice (sent again after its connection was lost)
    names the very place the key is at: REGISTERED, so that its writer keeps the pages the
    key points at (EXISTS would make it take them for free, and write another value there)."""
    ra = registry.request_region("A", 2 * MiB)
    rows = [["k", ra.region_id, 0, 100], ["j", ra.region_id, 4096, 100]]
    assert register(registry, "A", rows) == [RegisterStatus.REGISTERED] * 2
    again = [["k", ra.region_id, 0, 100], ["j", ra.region_id, 4096, 99]]  # j: not the same
    assert register(registry, "A", again) == [RegisterStatus.REGISTERED, RegisterStatus.EXISTS]
    assert registry.regions[ra.region_id].live_keys == 2
    assert registry.counters["keys_registered"] == 2  # counted once


def test_duplicate_within_one_batch(registry):
    r = registry.request_region("A", 2 * MiB)
    statuses = register(registry, "A", [["k", r.region_id, 0, 10], ["k", r.region_id, 4096, 10]])
    assert statuses == [RegisterStatus.REGISTERED, RegisterStatus.EXISTS]
    assert registry.regions[r.region_id].live_keys == 1


def test_register_rejects_invalid_locations(registry):
    ra = registry.request_region("A", 2 * MiB)
    rb = registry.request_region("B", 2 * MiB)
    rid = ra.region_id
    entries = [
        ["other-region", rb.region_id, 0, 10],  # not the caller's region
        ["no-region", 999, 0, 10],
        ["past-end", rid, 2 * MiB - 5, 10],
        ["neg-offset", rid, -1, 10],
        ["zero-len", rid, 0, 0],
        ["neg-len", rid, 0, -10],
        [123, rid, 0, 10],  # key of the wrong type
        ["k" * (MAX_KEY_BYTES + 1), rid, 0, 10],  # oversized key
        ["ok", rid, 2 * MiB - 10, 10],  # exactly at the end: fine
    ]
    statuses = register(registry, "A", entries)
    assert statuses[:-1] == [RegisterStatus.REJECTED] * (len(entries) - 1)
    assert statuses[-1] == RegisterStatus.REGISTERED
    assert list(registry.keys) == ["ok"]


def test_register_decides_per_key_in_a_mixed_batch(registry):
    """Several regions and lengths in one batch: each key by the same rules, each region
    checked for itself; a key registered before is EXISTS even at an invalid location."""
    ra = registry.request_region("A", 2 * MiB)
    ra2 = registry.request_region("A", 2 * MiB)
    rb = registry.request_region("B", 2 * MiB)
    register(registry, "A", [["old", ra.region_id, 0, 10]])
    rows = [
        ["a", ra.region_id, 4096, 10],
        ["b", ra2.region_id, 0, 4096],
        ["old", rb.region_id, 0, 10],  # registered before: EXISTS, wherever it claims to be
        ["c", rb.region_id, 4096, 10],  # B's region
        ["a", ra2.region_id, 4096, 20],  # earlier in the batch
        ["d", ra2.region_id, 2 * MiB - 4096, 4097],  # past the end
        ["e", ra2.region_id, 8192, 100],
    ]
    R, E, X = RegisterStatus.REGISTERED, RegisterStatus.EXISTS, RegisterStatus.REJECTED
    assert register(registry, "A", rows) == [R, R, E, X, E, X, R]
    assert locate(registry, ["a", "b", "e"])[0] == [
        [ra.region_id, 4096, 10],
        [ra2.region_id, 0, 4096],
        [ra2.region_id, 8192, 100],
    ]
    assert registry.regions[ra2.region_id].live_keys == 2
    assert registry.live_bytes == 10 + 10 + 4096 + 100
    assert registry.instances["A"].keys_registered == 4
    assert registry.counters["keys_duplicate"] == 2


def test_a_valid_batch_of_mixed_regions_and_lengths_is_decided_in_bulk(registry, monkeypatch):
    """Every location valid (two regions, three lengths: a v2 call's pools sealed together,
    LMCache's short last chunk): no step per key, and the statuses of the key-by-key path
    (first writer wins, in the batch too); one bad location sends the batch key by key."""
    ra = registry.request_region("A", 2 * MiB)
    ra2 = registry.request_region("A", 2 * MiB)
    register(registry, "A", [["old", ra.region_id, 0, 10]])
    rows = [
        ["a", ra.region_id, 4096, 4096],
        ["b", ra2.region_id, 0, 100],
        ["old", ra2.region_id, 4096, 10],
        ["c", ra.region_id, 2 * MiB - 7, 7],  # exactly at the end
        ["a", ra2.region_id, 8192, 10],
    ]
    per_key = registry._screen_each
    monkeypatch.setattr(registry, "_screen_each", lambda *a: pytest.fail("decided key by key"))
    R, E, X = RegisterStatus.REGISTERED, RegisterStatus.EXISTS, RegisterStatus.REJECTED
    assert register(registry, "A", rows) == [R, R, E, R, E]
    assert locate(registry, ["a", "b", "c"])[0] == [
        [ra.region_id, 4096, 4096],
        [ra2.region_id, 0, 100],
        [ra.region_id, 2 * MiB - 7, 7],
    ]
    assert registry.live_bytes == 10 + 4096 + 100 + 7
    assert registry.regions[ra.region_id].live_keys == 3
    assert registry.counters["keys_duplicate"] == 2
    bad = [["d", ra.region_id, 0, 10], ["e", ra2.region_id, 2 * MiB - 7, 8]]  # e: 1 byte past
    with pytest.raises(pytest.fail.Exception):
        register(registry, "A", bad)
    monkeypatch.setattr(registry, "_screen_each", per_key)
    assert register(registry, "A", bad) == [R, X]


def test_lookup_misses_and_counters(registry):
    r = registry.request_region("A", 2 * MiB)
    register(registry, "A", [["a", r.region_id, 0, 1], [b"b", r.region_id, 4096, 2]])
    locations, regions = locate(registry, ["a", "missing", b"b", b"a", 42, None], "B")
    assert locations == [[r.region_id, 0, 1], None, [r.region_id, 4096, 2], None, None, None]
    assert regions == [r]
    assert registry.counters["hits"] == 2 and registry.counters["misses"] == 4
    assert registry.instances["B"].hits == 2
    assert registry.exists(["a", "b", b"b", 1]) == [True, False, True, False]


def test_pinned_delete_refused_until_unpinned(registry):
    r = registry.request_region("A", 2 * MiB)
    register(registry, "A", [["k", r.region_id, 0, 10]])
    assert registry.pins.pin(["k", "k", "missing"]) == [True, True, False]
    assert registry.delete(["k"]) == [DeleteStatus.PINNED]
    assert registry.pins.unpin(["k"]) == [True]
    assert registry.delete(["k"]) == [DeleteStatus.PINNED]  # still pinned once
    assert registry.pins.unpin(["k", "k"]) == [True, False]  # unpin below zero refused
    assert registry.delete(["k", "k", "missing"]) == [
        DeleteStatus.DELETED,
        DeleteStatus.NOT_FOUND,
        DeleteStatus.NOT_FOUND,
    ]
    assert locate(registry, ["k"])[0] == [None]


def test_a_leading_pin_stops_at_the_first_miss(registry):
    """PIN with "leading" (a prefix lookup's pin): the keys after a gap are neither pinned nor
    reported, so a caller that unpins only its hits leaves none behind; journaled: just those."""
    r = registry.request_region("A", 2 * MiB)
    register(registry, "A", [[f"k{i}", r.region_id, i * 4096, 10] for i in range(4)])
    assert registry.delete(["k1"]) == [DeleteStatus.DELETED]  # the gap
    journaled = []
    registry.pins._log = lambda *record: journaled.append(record)
    keys = ["k0", "k1", "k2", "k3"]
    assert registry.pins.pin(keys, "A", leading=True) == [True, False, False, False]
    assert journaled == [("P", "A", ["k0"])]
    assert registry.instances["A"].pins == {"k0": 1}
    assert [registry.keys[k].pins for k in ("k0", "k2", "k3")] == [1, 0, 0]
    assert registry.pins.pin(["gone", "k0"], "A", leading=True) == [False, False]  # none
    assert len(journaled) == 1
    assert registry.pins.unpin(["k0"], "A") == [True]
    assert registry.delete(["k2", "k3", "k0"]) == [DeleteStatus.DELETED] * 3
    # without it, as before: every key that exists
    register(registry, "A", [[f"k{i}", r.region_id, i * 4096, 10] for i in (2, 3)])
    assert registry.pins.pin(["k0", "k2", "k3"], "A") == [False, True, True]
    assert journaled[-1] == ("P", "A", ["k2", "k3"])


def test_freed_page_notification_goes_to_the_owner(registry):
    r = registry.request_region("A", 2 * MiB)
    register(registry, "A", [["k1", r.region_id, 0, 10], ["k2", r.region_id, 65536, 20]])
    assert registry.instances.take_freed("A") == []
    registry.delete(["k2"])  # whoever deletes, the owner is told
    assert registry.instances.take_freed("B") == []
    assert registry.instances.take_freed("A") == [[r.region_id, 65536, 20]]
    assert registry.instances.take_freed("A") == []  # delivered once
    assert registry.regions[r.region_id].live_keys == 1
    assert (
        registry.instances.take_freed("nobody") == [] and registry.instances.take_freed(None) == []
    )


def test_deferred_free(registry):
    pool = registry.pool
    r = registry.request_region("A", 2 * MiB)
    register(registry, "A", [["k1", r.region_id, 0, 10], ["k2", r.region_id, 4096, 10]])
    used = pool.used
    registry.return_region("A", r.region_id, r.token)
    # keys in a returned region stay readable; the region is not freed yet
    assert locate(registry, ["k1"])[0] == [[r.region_id, 0, 10]]
    assert r.region_id in registry.regions and pool.used == used
    assert registry.instances.handshake("A", 1) == []  # but A no longer owns it
    # ... and nobody may register into it any more
    assert register(registry, "A", [["k3", r.region_id, 8192, 10]]) == [RegisterStatus.REJECTED]
    registry.delete(["k1"])
    assert r.region_id in registry.regions and pool.used == used
    assert registry.instances.take_freed("A") == []  # returned region: pages are not handed back
    registry.delete(["k2"])  # last key: region goes back to the pool
    assert r.region_id not in registry.regions
    assert pool.used == used - r.length
    assert registry.counters["regions_freed"] == 1


def test_return_of_keyless_region_frees_at_once(registry):
    r = registry.request_region("A", 4 * MiB)
    assert registry.pool.used == 4 * MiB
    registry.return_region("A", r.region_id, r.token)
    assert registry.pool.used == 0 and not registry.regions
    # the space is reusable
    assert registry.request_region("B", 16 * MiB).offset == 0


def test_return_region_checks(registry):
    r = registry.request_region("A", 2 * MiB)
    with pytest.raises(ProtocolError) as exc:
        registry.return_region("A", r.region_id, "0" * 32)
    assert codes(exc) == ErrorCode.BAD_TOKEN
    with pytest.raises(ProtocolError) as exc:
        registry.return_region("A", r.region_id, None)
    assert codes(exc) == ErrorCode.BAD_TOKEN
    with pytest.raises(ProtocolError) as exc:
        registry.return_region("A", 999, r.token)
    assert codes(exc) == ErrorCode.UNKNOWN_REGION
    with pytest.raises(ProtocolError) as exc:
        registry.return_region("B", r.region_id, r.token)
    assert codes(exc) == ErrorCode.NOT_OWNER
    register(registry, "A", [["k", r.region_id, 0, 1]])
    registry.return_region("A", r.region_id, r.token)
    with pytest.raises(ProtocolError) as exc:  # twice
        registry.return_region("A", r.region_id, r.token)
    assert codes(exc) == ErrorCode.NOT_OWNER
    assert r.region_id in registry.regions  # still deferred


def test_region_access_needs_the_right_token(registry):
    r = registry.request_region("A", 2 * MiB)
    other = registry.request_region("B", 2 * MiB)
    with pytest.raises(ProtocolError) as exc:
        registry.regions.verified(r.region_id, other.token)
    assert codes(exc) == ErrorCode.BAD_TOKEN
    with pytest.raises(ProtocolError) as exc:
        registry.regions.verified("1", r.token)
    assert codes(exc) == ErrorCode.UNKNOWN_REGION


def test_disconnect_releases_regions_deferred(registry):
    r1 = registry.request_region("A", 2 * MiB)
    r2 = registry.request_region("A", 2 * MiB)
    register(registry, "A", [["k", r1.region_id, 0, 1]])
    registry.instances.disconnect("A")
    assert "A" not in registry.instances
    assert r2.region_id not in registry.regions  # keyless: freed now
    assert r1.region_id in registry.regions  # holds a key: deferred
    registry.delete(["k"])  # owner is gone: no notification, region freed
    assert not registry.regions and registry.pool.used == 0


def test_list_allocations_and_stats(registry):
    ra = registry.request_region("A", 2 * MiB)
    rb = registry.request_region("B", 2 * MiB)
    register(registry, "A", [["k", ra.region_id, 0, 100]])
    assert registry.regions.handles("A") == [ra]
    assert sorted(h.region_id for h in registry.regions.handles()) == [
        ra.region_id,
        rb.region_id,
    ]
    stats = registry.stats()
    assert stats["keys"] == 1 and stats["regions"] == 2
    assert stats["pool"]["used"] == 4 * MiB and stats["pool"]["kind"] == "shm"
    assert stats["instances"]["A"]["bytes_registered"] == 100
