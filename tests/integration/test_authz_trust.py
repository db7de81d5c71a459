"""Authorization of the server's requests (docs/reliability.md, "Identity and ownership"): what
one instance sends never hands it another's instance, regions, pins or leases, and leaves
nothing behind that grows with every client that came and went. The service runs in this
process (frames through `MaruService.handle_frame`, its TCP port on 127.0.0.1:0), so that a
test can make happen at once what the server's randomness makes happen once in a while."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from maru.client.poolpath import prove
from maru.common import protocol
from maru.common.protocol import ErrorCode, MsgType, ProtocolError, RegisterStatus, pack_int64
from maru.server.pool import ShmPool
from maru.server.registry import Registry
from maru.server.service import MaruService
from maru.server.token import TokenSigner

MiB = 1 << 20


@pytest.fixture
def service(tmp_path: Path) -> Iterator[MaruService]:
    """A 16 MiB pool's service, no local socket (its TCP port is ephemeral, and unused)."""
    registry = Registry(ShmPool(str(tmp_path / "pool"), 16 * MiB), TokenSigner(b"a" * 32))
    svc = MaruService(registry, "tcp://127.0.0.1:0", local_socket=None)
    try:
        yield svc
    finally:
        svc.close()


def send(svc: MaruService, msg_type: int, body: dict[str, Any]) -> dict[str, Any]:
    """One request frame in, its reply body out (an error's too: "ok" False and its "code")."""
    _, reply = protocol.decode(svc.handle_frame(protocol.encode(msg_type, 1, body)))
    return reply


def attach(svc: MaruService, name: str) -> dict[str, Any]:
    """A new process's HANDSHAKE (no credential): the reply, with its pool proof added."""
    reply = send(svc, MsgType.HANDSHAKE, {"name": name, "pid": 1})
    assert reply["ok"], reply
    reply["proof"] = prove(svc.registry.pool.handshake_fields(), None, reply["iid"]).proof
    return reply


def test_a_new_instance_never_gets_the_id_credential_or_regions_of_a_live_one(
    service: MaruService,
) -> None:
    """A new instance's id is its name and 32 random bits, which meet a live instance's of the
    same name now and then (every TP rank gives one name; an attacker reads a victim's off
    LIST_ALLOCATIONS and asks again and again). Forced here: the second process must still get
    an instance of its own. Before: it got the writer's instance, its credential and its
    region, into which it could write and register, and which it could return."""
    service.new_instance_id = lambda name: f"{name}.00000000"  # every draw the same
    writer = attach(service, "rank")
    region = send(
        service,
        MsgType.REQUEST_REGION,
        {"session": writer["session"], "size": 2 * MiB, "pool_proof": writer["proof"]},
    )["region"]

    other = attach(service, "rank")
    assert other["iid"] != writer["iid"]
    assert other["session"] != writer["session"]
    assert other["regions"] == []  # before: the writer's region, to write into
    returned = send(
        service,
        MsgType.RETURN_REGION,
        {"session": other["session"], "region_id": region[0], "token": region[4]},
    )
    assert returned.get("code") == ErrorCode.NOT_OWNER
    register = {
        "keys": ["intruder"],
        "region_ids": pack_int64([region[0]]),
        "offsets": pack_int64([0]),
        "lengths": pack_int64([4096]),
    }
    results = send(service, MsgType.REGISTER_KV, {**register, "session": other["session"]})
    assert results["results"] == [RegisterStatus.REJECTED]
    # The writer's own instance goes on as before, alone in its region.
    mine = send(
        service, MsgType.REGISTER_KV, {**register, "keys": ["w"], "session": writer["session"]}
    )
    assert mine["results"] == [RegisterStatus.REGISTERED]
    assert service.registry.regions[region[0]].owner == writer["iid"]


def test_instances_that_asked_for_room_and_left_are_not_kept_waiting_forever(
    tmp_path: Path,
) -> None:
    """An instance below its fair share that finds the pool full is noted as waiting
    (`RegionGrants.wanting`) until it gets a region. One that went away first stayed there
    for good, each request walking past it: a client that comes back as a new instance each
    time grew the server by one entry per visit (before: all 40 left behind)."""
    pool = ShmPool(str(tmp_path / "pool"), 8 * MiB)
    reg = Registry(pool, TokenSigner(b"a" * 32), high_watermark=1.0, low_watermark=1.0)
    reg.instances.handshake("A", 1)
    reg.request_region("A", 8 * MiB)  # the whole pool
    for n in range(40):
        iid = f"visitor{n}"
        reg.instances.handshake(iid, 1)
        with pytest.raises(ProtocolError) as exc:
            reg.request_region(iid, 2 * MiB)
        assert exc.value.code == ErrorCode.POOL_RECLAIMING
        reg.instances.disconnect(iid)
    reg.instances.handshake("B", 1)
    with pytest.raises(ProtocolError):
        reg.request_region("B", 2 * MiB)
    assert set(reg.grants.wanting) <= {"B"}
