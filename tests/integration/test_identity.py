"""Identity is a credential the server issues (issue 13, P3): a process that picks another's
instance name gets an instance of its own, and no client can release, unpin, return, evict
from or register into what another instance holds. Real server, real processes."""

from __future__ import annotations

import os

import pytest

from maru import MaruHandler
from maru.client.rpc import RpcClient
from maru.common.errors import MaruServerError
from maru.common.protocol import ErrorCode, MsgType, RegisterStatus, pack_int64

from .workers import SPAWN, digest, make_value, retrieve_keys, run_processes

NAME = "sglang-host:30000"  # what the docs once suggested for every TP rank


def churn(url: str, prefix: str, seed: int, barrier) -> dict:
    """Store 16 values a round and delete 8 of them, for 20 rounds, in a small pool: pages
    are reused all the time. Returns the instance id and the digests of the keys it kept."""
    h = MaruHandler(
        server_url=url,
        instance_id=NAME,
        pool_size="1M",
        chunk_size_bytes="64K",
        auto_expand=False,
        timeout_ms=10_000,
    )
    kept: dict[str, str] = {}
    try:
        barrier.wait(30)
        for r in range(20):
            keys = [f"{prefix}/{r}/{i}" for i in range(16)]
            values = [make_value(seed + r * 100 + i, 20_000 + 997 * i) for i in range(16)]
            results = h.batch_store(keys, values)
            for key, value, ok in zip(keys, values, results):
                if ok:
                    kept[key] = digest(value)
            gone = [k for k in keys[::2] if k in kept]
            for key, deleted in zip(gone, h.batch_delete(gone)):
                if deleted:
                    del kept[key]
        return {"iid": h.instance_id, "kept": kept}
    finally:
        h.close()


def test_two_live_processes_with_one_instance_name_get_two_instances(maru_server):
    """Scenario 5: both processes write and reuse pages at the same time; with one shared
    instance they wrote into each other's pages (256 of 640 values wrong)."""
    barrier = SPAWN.Barrier(2)
    a, b = run_processes(
        [(churn, (maru_server.url, "a", 1, barrier)), (churn, (maru_server.url, "b", 9, barrier))],
        timeout=120,
    )
    assert a["iid"] != b["iid"]
    assert a["iid"].startswith(NAME + ".") and b["iid"].startswith(NAME + ".")
    kept = {**a["kept"], **b["kept"]}
    assert len(kept) > 100  # acknowledged, and not deleted
    keys = list(kept)
    read = retrieve_keys(maru_server.url, keys, batch=64)["digests"]
    wrong = sum(got is not None and got != kept[k] for k, got in zip(keys, read))
    hits = sum(got is not None for got in read)  # the rest were evicted to make room
    assert wrong == 0 and hits >= 16


@pytest.fixture
def victim(maru_server):
    h = MaruHandler(
        server_url=maru_server.url, instance_id="victim", pool_size="4M", chunk_size_bytes="64K"
    )
    yield h
    h.close()


def test_no_client_can_act_on_another_instances_pins_leases_regions_or_pages(maru_server, victim):
    """Scenario 8: a client that knows the victim's instance id, lease ids and region tokens
    (LIST_ALLOCATIONS hands them to anyone) still cannot touch what the victim holds."""
    values = {f"v{i}": os.urandom(30_000 + i) for i in range(8)}
    assert victim.batch_store(list(values), list(values.values())) == [True] * 8
    assert victim.pin("v0")
    lease = victim.lookup(["v1", "v2"], lease=True)
    lease.wait()
    assert lease.lease_id > 0
    region = victim.list_allocations()[0]
    vid = victim.instance_id

    attacker = RpcClient(maru_server.url, timeout_ms=5000)
    mine = attacker.request(MsgType.HANDSHAKE, {"name": "victim"}).result()
    assert mine["iid"] != vid  # the same name is another instance
    forged = attacker.request(MsgType.HANDSHAKE, {"name": "x", "session": f"{vid}~{'f' * 32}"})
    assert forged.result()["iid"] != vid  # a made-up credential is no credential
    sessions = {"own": mine["session"], "forged": f"{vid}~{'0' * 32}", "none": None}

    def send(msg_type: MsgType, body: dict, session: str | None) -> dict:
        if session is not None:
            body = {**body, "session": session}
        try:
            return attacker.request(msg_type, body).result()
        except MaruServerError as exc:
            return {"ok": False, "code": exc.code}

    succeeded = []
    for who, session in sessions.items():
        ids = [lease.lease_id, *range(1, 50)]  # its real lease id (ids start at random)
        released = send(MsgType.RELEASE, {"leases": ids}, session)
        if released.get("released"):
            succeeded.append((who, "release"))
        unpinned = send(MsgType.UNPIN, {"keys": ["v0"]}, session)
        if any(unpinned.get("results") or ()):
            succeeded.append((who, "unpin"))
        freed = send(MsgType.EVICT_FOR, {"bytes": 4 << 20}, session)
        if freed.get("freed_bytes"):
            succeeded.append((who, "evict"))
        body = {
            "keys": ["intruder"],
            "region_ids": pack_int64([region.region_id]),
            "offsets": pack_int64([0]),
            "lengths": pack_int64([100]),
        }
        registered = send(MsgType.REGISTER_KV, body, session)
        if registered.get("results") == [RegisterStatus.REGISTERED]:
            succeeded.append((who, "register"))
        returned = send(
            MsgType.RETURN_REGION, {"region_id": region.region_id, "token": region.token}, session
        )
        if returned.get("ok"):
            succeeded.append((who, "return"))
        else:
            assert returned["code"] in (ErrorCode.NOT_OWNER, ErrorCode.UNKNOWN_INSTANCE)
    attacker.close()
    assert succeeded == []

    # The victim's state is intact: its pin, its lease, its region and its bytes.
    assert victim.delete("v0") is False  # still pinned
    assert victim.delete("v1") is False  # still leased
    lease.release()
    assert victim.owned_region_ids() == [region.region_id]
    assert not victim.exists("intruder")
    with MaruHandler(server_url=maru_server.url, pool_size="1M") as reader:
        got = [bytes(i.view) if i else None for i in reader.batch_retrieve(list(values))]
    assert got == list(values.values())


def test_a_reconnect_resumes_the_same_instance(maru_server, victim):
    """The session credential is what a reconnect presents: after the server forgets the
    session (a restart), the same handler comes back as the same instance, with its regions."""
    assert victim.store("k", b"x" * 1000)
    before = (victim.instance_id, victim.owned_region_ids())
    victim._handshake()
    assert (victim.instance_id, victim.owned_region_ids()) == before


def test_close_ends_the_instance_its_pins_leases_and_regions(maru_server):
    """close() sends DISCONNECT: pins and leases end at once (not at the reaper's timeout), the
    regions go back, the keys stay readable, and the old credential is void."""
    h = MaruHandler(server_url=maru_server.url, pool_size="1M", chunk_size_bytes="64K")
    assert h.batch_store(["p", "l"], [b"p" * 5000, b"l" * 5000]) == [True, True]
    assert h.pin("p")
    lease = h.lookup(["l"], lease=True)
    lease.wait()
    assert lease.lease_id > 0
    session = h._session
    h.close()

    with MaruHandler(server_url=maru_server.url, pool_size="1M") as other:
        assert bytes(other.retrieve("l").view) == b"l" * 5000  # keys outlive their writer
        assert other.delete("p") and other.delete("l")  # no pin, no lease holds them now
        owners = {r.owner for r in other.list_allocations()}
        assert h.instance_id not in owners
    rpc = RpcClient(maru_server.url, timeout_ms=5000)
    with pytest.raises(MaruServerError) as err:
        rpc.request(MsgType.PIN, {"keys": ["x"], "session": session}).result()
    rpc.close()
    assert err.value.code == ErrorCode.UNKNOWN_INSTANCE
