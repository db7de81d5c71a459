"""CORRUPT_KV on the registry (`drop_corrupt`): a key a reader found unlike its writer's
checksum is dropped only if its entry is still the very one the reader read, and not while
another reader holds it leased (as a delete keeps it); a newer value is never dropped."""

from __future__ import annotations

import logging

import pytest

from maru.common.protocol import DeleteStatus, freed_notices
from maru.server.pool import ShmPool
from maru.server.registry import Registry, drop_corrupt
from maru.server.token import TokenSigner

from .registry_calls import lease, locate

MiB = 1 << 20
DELETED, NOT_FOUND, PINNED = DeleteStatus.DELETED, DeleteStatus.NOT_FOUND, DeleteStatus.PINNED


@pytest.fixture
def registry(tmp_path):
    pool = ShmPool(str(tmp_path / "pool"), 16 * MiB)
    reg = Registry(pool, TokenSigner(b"k" * 32))
    reg.instances.handshake("A", 100)
    reg.instances.handshake("B", 200)
    return reg


def store(reg: Registry, key: str, rid: int, offset: int, checksum: int) -> None:
    assert reg.register("A", [key], [rid], [offset], [10], [checksum]) == [0]


def test_only_the_entry_read_is_dropped_and_the_key_can_be_stored_again(registry, caplog):
    rid = registry.request_region("A", 2 * MiB).region_id
    store(registry, "k", rid, 0, 77)
    store(registry, "j", rid, 4096, 78)
    registry.instances["A"].freed.clear()
    read = (rid, 0, 10, 77)
    # Not the entry read: another place, length or checksum, or no such key
    others = [(rid, 4096, 10, 77), (rid, 0, 9, 77), (rid, 0, 10, 5), (rid + 1, 0, 10, 77)]
    assert drop_corrupt(registry, ["k"] * 4 + ["nope"], [*others, read], "B") == [NOT_FOUND] * 5
    with caplog.at_level(logging.ERROR, logger="maru.server.registry"):
        assert drop_corrupt(registry, ["k", "k"], [read, read], "B") == [DELETED, NOT_FOUND]
    assert "'k' dropped: B read its 10 bytes at region" in caplog.text
    assert registry.counters["corrupt_dropped"] == 1
    assert registry.counters["keys_deleted"] == 0  # (not an operator's delete)
    assert locate(registry, ["k", "j"])[0] == [None, [rid, 4096, 10]]
    assert freed_notices(bytes(registry.instances["A"].freed)) == [[rid, 0, 10]]  # reusable
    # The first writer no longer holds the key: a correct store of it is taken
    store(registry, "k", rid, 8192, 77)
    assert drop_corrupt(registry, ["k"], [read], "B") == [NOT_FOUND]  # stored anew: kept
    assert locate(registry, ["k"])[0] == [[rid, 8192, 10]]
    assert registry.counters["corrupt_dropped"] == 1


def test_a_key_another_reader_holds_leased_or_pinned_is_kept(registry):
    rid = registry.request_region("A", 2 * MiB).region_id
    store(registry, "k", rid, 0, 77)
    read = (rid, 0, 10, 77)
    lease_id = lease(registry, ["k"], "A")
    assert drop_corrupt(registry, ["k"], [read], "B") == [PINNED]  # A still copies it
    assert registry.leases.release([lease_id], "A") == 1
    assert registry.pins.pin(["k"]) == [True]
    assert drop_corrupt(registry, ["k"], [read], "B") == [PINNED]
    assert registry.pins.unpin(["k"]) == [True]
    assert registry.counters["corrupt_dropped"] == 0
    assert drop_corrupt(registry, ["k"], [read], "B") == [DELETED]
    assert locate(registry, ["k"])[0] == [None]
