"""REGISTER_KV's bound on a region's live bytes: the keys registered in a region never hold more
bytes than the region has. Honest writers place each value in chunks of its own, so their keys
never come near it; a writer registering many keys over the same bytes would otherwise count
bytes that do not exist toward the pool's watermark, and make the server evict other
instances' keys (an eviction DoS), with quotas and shares seeing the same phantom bytes."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from maru.common.protocol import MsgType, RegisterStatus
from maru.server import persistence
from maru.server.pool import REGION_ALIGNMENT, ShmPool
from maru.server.registry import Registry
from maru.server.token import TokenSigner

from .registry_calls import register
from .service_calls import make_service, ok, register_body

KiB, MiB = 1 << 10, 1 << 20
REGION = REGION_ALIGNMENT  # a region asked for this many bytes has exactly this many
VALUE = 64 * KiB
FITS = REGION // VALUE  # values of VALUE bytes a region holds
REGISTERED, EXISTS, REJECTED = (int(s) for s in RegisterStatus)


class Records(list):
    """A journal that keeps its records (`Registry.journal`)."""

    def append(self, record: Any) -> None:
        super().append(record)


@pytest.fixture
def registry(tmp_path):
    reg = Registry(ShmPool(str(tmp_path / "pool"), 16 * MiB), TokenSigner(b"k" * 32))
    reg.instances.handshake("A", 100)
    reg.instances.handshake("B", 200)
    return reg


@pytest.fixture
def service(tmp_path):
    """A service whose pool (16 MiB) evicts down to 40% once registered bytes pass 50%."""
    pool = ShmPool(str(tmp_path / "pool"), 16 * MiB)
    reg = Registry(pool, TokenSigner(b"s" * 32), high_watermark=0.5, low_watermark=0.4)
    svc = make_service(tmp_path, registry=reg)
    for iid in ("A", "B"):
        ok(svc, MsgType.HANDSHAKE, {"iid": iid, "pid": 1})
    yield svc
    svc.close()


def region_of(svc, iid: str) -> int:
    region = ok(svc, MsgType.REQUEST_REGION, {"iid": iid, "size": REGION})["region"]
    assert region[3] == REGION
    return region[0]


def seal(svc, iid: str, rows: list[list[Any]]) -> list[int]:
    return ok(svc, MsgType.REGISTER_KV, register_body(iid, rows))["results"]


def stats(svc) -> dict[str, Any]:
    return ok(svc, MsgType.STATS, {})["stats"]


def filling(prefix: str, rid: int, count: int = FITS, start: int = 0) -> list[list[Any]]:
    """`count` adjacent values of VALUE bytes from offset `start`: an honest writer's batch."""
    return [[f"{prefix}{i}", rid, start + i * VALUE, VALUE] for i in range(count)]


def test_overlapping_keys_past_the_region_length_are_rejected(service, caplog):
    rid = region_of(service, "A")
    rows = [[f"over{i}", rid, 0, VALUE] for i in range(1000)]  # all over the same bytes
    with caplog.at_level(logging.WARNING, logger="maru.server.registry"):
        results = seal(service, "A", rows)
    assert results == [REGISTERED] * FITS + [REJECTED] * (1000 - FITS)
    region = service.registry.regions[rid]
    assert region.live_bytes == REGION and region.live_keys == FITS
    s = stats(service)
    assert s["live_bytes"] == REGION and s["keys"] == FITS
    assert s["counters"]["keys_over_region"] == 1000 - FITS
    assert s["counters"]["keys_registered"] == FITS
    # one WARNING for the batch, naming the instance and the region
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "A" in warnings[0].getMessage() and f"region {rid}" in warnings[0].getMessage()
    # the rejected keys are misses; a later batch in the full region is refused too
    reply = ok(service, MsgType.EXISTS, {"keys": ["over0", f"over{FITS}", "over999"]})
    assert reply["results"] == [True, False, False]
    assert seal(service, "A", [["late", rid, REGION - VALUE, VALUE]]) == [REJECTED]
    assert service.registry.regions[rid].live_bytes == REGION


def test_overlap_cannot_evict_another_instances_keys(service):
    b_keys = []
    for n in range(2):  # B holds 4 MiB of honest keys: below the 8 MiB watermark
        rows = filling(f"b{n}-", region_of(service, "B"))
        assert seal(service, "B", rows) == [REGISTERED] * FITS
        b_keys += [row[0] for row in rows]
    rid = region_of(service, "A")
    results = seal(service, "A", [[f"over{i}", rid, 0, VALUE] for i in range(1000)])
    assert results.count(REGISTERED) == FITS
    s = stats(service)
    assert s["live_bytes"] == 3 * REGION <= 0.5 * 16 * MiB
    assert s["counters"]["evictions"] == 0
    assert ok(service, MsgType.EXISTS, {"keys": b_keys})["results"] == [True] * len(b_keys)


def test_honest_batches_filling_regions_exactly_are_registered(service):
    one, two, three = (region_of(service, "A") for _ in range(3))
    assert seal(service, "A", filling("a", one)) == [REGISTERED] * FITS
    # one batch across two regions, each filled to its last byte
    rows = filling("b", two) + filling("c", three)
    assert seal(service, "A", rows) == [REGISTERED] * (2 * FITS)
    for rid in (one, two, three):
        assert service.registry.regions[rid].live_bytes == REGION
    assert stats(service)["counters"]["keys_over_region"] == 0


def test_small_values_each_in_a_page_of_their_own_are_registered(service):
    rid = region_of(service, "A")
    pages = REGION // (4 * KiB)
    rows = [[f"s{i}", rid, i * 4 * KiB, 100] for i in range(pages)]
    assert seal(service, "A", rows) == [REGISTERED] * pages
    assert service.registry.regions[rid].live_bytes == pages * 100


def test_a_region_holds_no_more_keys_than_pages(service):
    """Keys of one byte each take no room in bytes to speak of; each value of an honest writer
    has a page at least, so a region's keys never outnumber its pages: a flood of tiny keys
    cannot grow the server's memory (and its journal) without bound."""
    rid = region_of(service, "A")
    pages = REGION // (4 * KiB)
    rows = [[f"t{i}", rid, i * 8, 1] for i in range(4 * pages)]  # (8 bytes apart)
    results = seal(service, "A", rows)
    assert results == [REGISTERED] * pages + [REJECTED] * (3 * pages)
    assert service.registry.regions[rid].live_keys == pages
    assert stats(service)["counters"]["keys_over_region"] == 3 * pages
    other = region_of(service, "A")  # another region of the same writer takes its own
    assert seal(service, "A", [["u0", other, 0, 1], ["t0", rid, 0, 1]]) == [REGISTERED] * 2


def test_a_request_sent_again_is_registered_again(service):
    """A retry of a batch that filled its region names the same places: REGISTERED again (its
    keys are there already, so they take no more room), not REJECTED or EXISTS."""
    rid = region_of(service, "A")
    rows = filling("a", rid)
    assert seal(service, "A", rows) == [REGISTERED] * FITS
    assert seal(service, "A", rows) == [REGISTERED] * FITS
    assert service.registry.regions[rid].live_bytes == REGION
    # a key registered before is EXISTS wherever it is claimed, full region or not
    assert seal(service, "A", [["a0", rid, VALUE, VALUE]]) == [EXISTS]


def test_room_left_is_what_the_live_keys_leave(registry):
    rid = registry.request_region("A", REGION).region_id
    assert register(registry, "A", filling("a", rid, FITS - 1)) == [REGISTERED] * (FITS - 1)
    # two values for the last chunk: the first fits, the second does not; a key named again
    # in the batch (elsewhere) is EXISTS, and takes no room
    rows = [["x", rid, REGION - VALUE, VALUE], ["x", rid, 0, VALUE]]
    rows.append(["y", rid, REGION - VALUE, VALUE])
    assert register(registry, "A", rows) == [REGISTERED, EXISTS, REJECTED]
    # keys that go give their room back
    registry.delete(["a0", "a1"])
    assert register(registry, "A", filling("z", rid, 3)) == [REGISTERED] * 2 + [REJECTED]
    assert registry.regions[rid].live_bytes == REGION == registry.live_bytes


def test_each_region_of_a_batch_is_bounded_on_its_own(registry):
    full = registry.request_region("A", REGION).region_id
    empty = registry.request_region("A", REGION).region_id
    rows = [*filling("f", full), ["over", full, 0, VALUE], *filling("e", empty)]
    assert register(registry, "A", rows) == [REGISTERED] * FITS + [REJECTED] + [REGISTERED] * FITS
    assert registry.live_bytes == 2 * REGION
    assert registry.counters["keys_over_region"] == 1


def test_the_bound_holds_in_a_batch_screened_key_by_key(registry):
    """A batch with a bad key or location is screened key by key: the bound is the same."""
    mine = registry.request_region("A", REGION).region_id
    theirs = registry.request_region("B", REGION).region_id
    rows = [["", mine, 0, 1], ["t", theirs, 0, VALUE]]  # a bad key, B's region
    rows += [[f"o{i}", mine, 0, VALUE] for i in range(FITS + 5)]
    results = register(registry, "A", rows)
    assert results == [REJECTED, REJECTED] + [REGISTERED] * FITS + [REJECTED] * 5
    assert registry.regions[mine].live_bytes == REGION == registry.live_bytes
    assert registry.counters["keys_over_region"] == 5


def test_replay_restores_keys_accepted_before_the_bound(tmp_path):
    """A journal of a server without the bound may hold a region's keys past its length: a
    restart restores them all (they were answered REGISTERED), and the region takes no new
    key until enough of them go."""
    records = Records()
    reg = Registry(ShmPool(str(tmp_path / "pool"), 16 * MiB), TokenSigner(b"k" * 32))
    reg.journal = records
    reg.instances.handshake("A", 1)
    rid = reg.request_region("A", REGION).region_id
    over = [f"old{i}" for i in range(FITS + 8)]
    records.append(["K", over, [rid] * len(over), [0] * len(over), [VALUE] * len(over)])
    fresh = Registry(ShmPool(str(tmp_path / "pool"), 16 * MiB), TokenSigner(b"k" * 32))
    persistence.restore(fresh, None, list(records))
    assert all(key in fresh.keys for key in over)
    assert fresh.regions[rid].live_bytes == (FITS + 8) * VALUE == fresh.live_bytes
    fresh.instances.handshake("A", 1)
    assert register(fresh, "A", [["new", rid, 0, VALUE]]) == [REJECTED]
    fresh.delete(over[:9])
    assert register(fresh, "A", [["new", rid, 0, VALUE]]) == [REGISTERED]
