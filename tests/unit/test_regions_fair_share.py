"""Fair shares count writers: the instances that hold or asked for regions, not those that
only read (docs/architecture.md, "Capacity: regions as data arrives")."""

from __future__ import annotations

import pytest

from maru.common.protocol import ErrorCode, ProtocolError
from maru.server.pool import ShmPool
from maru.server.registry import Registry
from maru.server.token import TokenSigner

from .registry_calls import locate

MiB = 1 << 20


def make_registry(tmp_path, pool_mib: int = 16) -> Registry:
    pool = ShmPool(str(tmp_path / "pool"), pool_mib * MiB)
    return Registry(pool, TokenSigner(b"f" * 32), high_watermark=1.0, low_watermark=1.0)


def test_readers_do_not_keep_a_writer_at_one_region_while_another_holds_the_pool(tmp_path):
    """A 16 MiB pool: writer A holds 14 MiB, writer B one 2 MiB region, six readers look keys
    up. Two writers: B is owed 8 MiB, so A is asked to give 6 MiB back. Before, the share was
    the pool over all eight instances (2 MiB): B was never below it, nobody was asked, and B
    got POOL_FULL for as long as the readers lived."""
    reg = make_registry(tmp_path)
    for iid in ("A", "B", *(f"reader{i}" for i in range(6))):
        reg.instances.handshake(iid, 1)
    reg.request_region("A", 14 * MiB)
    reg.request_region("B", 2 * MiB)
    for i in range(6):
        locate(reg, ["k"], f"reader{i}")  # (they live and read, never ask for a region)
    with pytest.raises(ProtocolError) as exc:
        reg.request_region("B", 2 * MiB)
    assert exc.value.code == ErrorCode.POOL_RECLAIMING  # before: POOL_FULL, nobody asked
    assert reg.grants.fair_share() == 8 * MiB
    assert reg.instances["A"].shed == 6 * MiB  # down to its share, no further
    assert reg.instances["reader0"].shed == 0


def test_a_writer_asked_to_give_back_keeps_its_share_of_writers_not_of_readers(tmp_path):
    """Writer A holds the whole 16 MiB pool; writer C asks for its first region while six
    readers are connected. A gives back down to half the pool (two writers), not to a ninth
    of it (every instance): before, it was asked for 14 MiB, evicting keys nobody needed
    the room of; and a reader that asks for a region becomes a writer owed its share."""
    reg = make_registry(tmp_path)
    for iid in ("A", "C", *(f"reader{i}" for i in range(6))):
        reg.instances.handshake(iid, 1)
    reg.request_region("A", 16 * MiB)
    with pytest.raises(ProtocolError) as exc:
        reg.request_region("C", 2 * MiB)
    assert exc.value.code == ErrorCode.POOL_RECLAIMING
    assert reg.instances["A"].shed == 8 * MiB  # before: 14 MiB (16 - 16 / 9 rounded up)
    assert reg.instances["C"].writer and not reg.instances["reader0"].writer
    with pytest.raises(ProtocolError):
        reg.request_region("reader0", 2 * MiB)  # now a writer too: three shares
    assert reg.grants.fair_share() == 16 * MiB // 3


def test_a_writer_that_went_away_holds_no_one_back(tmp_path):
    """An instance below its share that asked others to give back, then disconnected, no
    longer keeps the others from growing past their shares (`RegionGrants.wanting`)."""
    reg = make_registry(tmp_path, pool_mib=8)
    for iid in ("A", "B", "C"):
        reg.instances.handshake(iid, 1)
    reg.request_region("A", 4 * MiB)
    reg.request_region("B", 4 * MiB)
    with pytest.raises(ProtocolError) as exc:
        reg.request_region("C", 2 * MiB)
    assert exc.value.code == ErrorCode.POOL_RECLAIMING  # C waits for A and B to give back
    reg.instances.disconnect("C")
    reg.return_region("B", *_first(reg, "B"))
    assert reg.request_region("A", 4 * MiB).length == 4 * MiB  # before: POOL_FULL (C waited)


def _first(reg: Registry, iid: str) -> tuple[int, str]:
    region = reg.regions[min(reg.instances[iid].regions)]
    return region.region_id, region.token
