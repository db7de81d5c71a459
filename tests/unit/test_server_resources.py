"""One client cannot grow the server without bound nor take its loop from the others: each
request that creates server state (instances, their processes' pidfds, pins, keys under
leases) is refused past a bound (QUOTA_EXCEEDED, before any side effect), and requests that
walk every key (DELETE_PREFIX, KEYS) take a bounded share of the loop's time."""

from __future__ import annotations

import dataclasses
import socket
import time

import pytest

from maru.common.protocol import ErrorCode, MsgType, ProtocolError
from maru.server.local_socket import Peer

from .service_calls import call, make_service, ok, on_peer, refused, register_body

MiB = 1 << 20
PAGE = 4096


def keys_of(svc, iid: str, n: int, size: int = 16 * MiB) -> list[str]:
    """`n` keys registered by `iid`, one page each, in a region of its own."""
    rid = ok(svc, MsgType.REQUEST_REGION, {"iid": iid, "size": size})["region"][0]
    keys = [f"{iid}-{i}" for i in range(n)]
    rows = [[k, rid, i * PAGE, PAGE] for i, k in enumerate(keys)]
    assert ok(svc, MsgType.REGISTER_KV, register_body(iid, rows))["results"] == [0] * n
    return keys


# -- instances ----------------------------------------------------------------------------


def test_new_instances_past_the_cap_are_refused_and_a_freed_place_is_taken(service):
    """Each HANDSHAKE without a live credential makes an Instance (and a credential, a log
    line, a pass of every reap and fair-share count): past `max_instances`, refused; a
    reconnect of a live one still resumes it; a place freed (disconnect, reap) is taken."""
    table = service.registry.instances
    table.max_instances = 8
    for n in range(8):
        ok(service, MsgType.HANDSHAKE, {"iid": f"i{n}"})
    why = refused(service, MsgType.HANDSHAKE, {"iid": "late"})
    assert "8 instances" in why and "--max-instances" in why
    assert len(table) == 8 and "late" not in table
    ok(service, MsgType.HANDSHAKE, {"iid": "i3"})  # its credential: resumed, not new
    assert len(table) == 8
    ok(service, MsgType.DISCONNECT, {"iid": "i0"})
    ok(service, MsgType.HANDSHAKE, {"iid": "late"})
    refused(service, MsgType.HANDSHAKE, {"iid": "later"})
    # Instances that handshook and went silent are reaped, freeing their places.
    table.reap(timeout=15.0, now=time.monotonic() + 16.0)
    assert len(table) == 0
    ok(service, MsgType.HANDSHAKE, {"iid": "later"})


def test_one_process_holds_at_most_its_cap_of_instances_and_pidfds(service):
    """On the local socket the first request of each instance claims it for the peer process
    (a pidfd each): past `max_per_process` instances of one process, refused, no pidfd taken;
    another process is not held back by it (its count is its own)."""
    table = service.registry.instances
    table.max_per_process = 3
    names = [f"p{n}" for n in range(5)]
    for name in names:
        ok(service, MsgType.HANDSHAKE, {"iid": name})
    mine, theirs = socket.socketpair()
    try:
        peer = Peer(mine)
        replies = [on_peer(service, peer, MsgType.HEARTBEAT, {"iid": n}) for n in names]
        assert [r["ok"] for r in replies] == [True, True, True, False, False]
        assert replies[3]["code"] == ErrorCode.QUOTA_EXCEEDED
        assert "3 instances" in replies[3]["error"]
        held = [n for n in table if table.processes.holder(n) is not None]
        assert len(held) == 3
        # One of them goes: the process may hold another.
        assert on_peer(service, peer, MsgType.DISCONNECT, {"iid": "p0"})["ok"]
        assert on_peer(service, peer, MsgType.HEARTBEAT, {"iid": "p3"})["ok"]
    finally:
        mine.close()
        theirs.close()


# -- pins and leases ----------------------------------------------------------------------


def test_pins_past_the_per_instance_cap_are_refused_whole(service):
    """An instance pins at most `max_keys` keys at once (each an entry of its own and of every
    snapshot, and a key eviction cannot take): a PIN that would pass it pins nothing;
    pinning a key again takes no more room; an unpin gives room back."""
    service.registry.pins.max_keys = 10
    ok(service, MsgType.HANDSHAKE, {"iid": "W"})
    keys = keys_of(service, "W", 16)
    assert ok(service, MsgType.PIN, {"iid": "W", "keys": keys[:8]})["results"] == [True] * 8
    assert ok(service, MsgType.PIN, {"iid": "W", "keys": keys[6:10]})["results"] == [True] * 4
    why = refused(service, MsgType.PIN, {"iid": "W", "keys": keys[9:12]})
    assert "pinned keys" in why
    inst = service.registry.instances["W"]
    assert len(inst.pins) == 10 and keys[10] not in inst.pins
    assert ok(service, MsgType.PIN, {"iid": "W", "keys": keys[:10]})["results"] == [True] * 10
    ok(service, MsgType.UNPIN, {"iid": "W", "keys": keys[:2]})
    ok(service, MsgType.UNPIN, {"iid": "W", "keys": keys[:2]})
    assert ok(service, MsgType.PIN, {"iid": "W", "keys": keys[10:12]})["results"] == [True] * 2


def test_keys_under_leases_past_the_per_instance_cap_are_refused(service):
    """However few bytes its keys hold, an instance holds at most `max_keys` keys under
    leases (each lease keeps a reference per key until released or expired): a leased lookup
    past it is QUOTA_EXCEEDED (a client reads misses) and takes nothing; RELEASE frees it."""
    service.registry.leases.max_keys = 10
    ok(service, MsgType.HANDSHAKE, {"iid": "R"})
    keys = keys_of(service, "R", 8)
    first = ok(service, MsgType.LOOKUP_KV, {"iid": "R", "keys": keys, "lease": True})
    assert first["lease_id"]
    why = refused(service, MsgType.LOOKUP_KV, {"iid": "R", "keys": keys, "lease": True})
    assert "keys under leases" in why
    assert len(service.registry.leases) == 1
    ok(service, MsgType.RELEASE, {"iid": "R", "leases": [first["lease_id"]]})
    assert ok(service, MsgType.LOOKUP_KV, {"iid": "R", "keys": keys, "lease": True})["lease_id"]
    # Without a lease there is nothing to hold: never refused.
    assert ok(service, MsgType.LOOKUP_KV, {"iid": "R", "keys": keys})["lease_id"] == 0


def test_the_lease_quota_holds_on_the_local_socket_as_over_tcp(service):
    """`--quota-leases` is checked where every leased lookup goes (`Registry.lookup`), so a
    client on the local socket is held to it as one over TCP is."""
    service.registry.quota_leases = 2
    for name in ("L", "T"):
        ok(service, MsgType.HANDSHAKE, {"iid": name})
    local = {"iid": "L", "keys": keys_of(service, "L", 2), "lease": True}
    tcp = {"iid": "T", "keys": local["keys"], "lease": True}
    mine, theirs = socket.socketpair()
    try:
        peer = Peer(mine)
        for _ in range(2):
            assert on_peer(service, peer, MsgType.LOOKUP_KV, local)["lease_id"]
            assert ok(service, MsgType.LOOKUP_KV, tcp)["lease_id"]  # (no peer: TCP)
        again = on_peer(service, peer, MsgType.LOOKUP_KV, local)
        assert again["ok"] is False and again["code"] == ErrorCode.QUOTA_EXCEEDED
        refused(service, MsgType.LOOKUP_KV, tcp)
    finally:
        mine.close()
        theirs.close()
    assert len(service.registry.leases) == 4


# -- requests that walk every key ---------------------------------------------------------


def test_walks_take_a_share_of_the_time_after_a_burst():
    """The budget of requests that walk every key, on a clock of its own (no wall time in a
    test): walks of 0.5 s back to back are served until more than the burst (1 s) is owed,
    then refused saying when to retry, and served again once a share (1/4) of the time since
    has paid the debt down."""
    from maru.server.service import WalkBudget

    now = [100.0]
    budget = WalkBudget(share=0.25, burst=1.0, clock=lambda: now[0])

    def walk() -> None:
        with budget.walk("KEYS"):
            now[0] += 0.5  # (the walk's own time)

    for _ in range(3):  # owed after each: 0.5, 0.875, 1.25 (1/4 of each walk's time paid)
        walk()
    with pytest.raises(ProtocolError) as refused_walk:  # 1.125 owed: past the burst
        walk()
    assert refused_walk.value.code == ErrorCode.QUOTA_EXCEEDED
    assert "retry in 0.5 s" in str(refused_walk.value)  # (0.125 s over, paid at 1/4)
    now[0] += 0.4
    with pytest.raises(ProtocolError):  # 1.025 owed
        walk()
    now[0] += 0.2
    walk()  # 0.975 owed: served


def test_walks_past_the_budget_are_refused_by_the_service(tmp_path):
    """DELETE_PREFIX and KEYS (any client may send them, anonymous too) go through the budget:
    past it QUOTA_EXCEEDED saying when to retry, nothing deleted; served again once paid."""
    svc = make_service(tmp_path, pool_mib=16)
    try:
        ok(svc, MsgType.HANDSHAKE, {"iid": "W"})
        keys_of(svc, "W", 4, size=2 * MiB)
        svc.walks.owed = svc.walks.burst + 10.0  # (as after walks back to back)
        for msg_type, body in (
            (MsgType.KEYS, {"prefix": "W"}),
            (MsgType.DELETE_PREFIX, {"prefix": "W"}),
        ):
            assert "retry in" in refused(svc, msg_type, body)
        svc.walks.owed = 0.0  # (paid): the refused DELETE_PREFIX deleted nothing
        assert len(ok(svc, MsgType.KEYS, {"prefix": "W", "limit": 10})["keys"]) == 4
    finally:
        svc.close()


# -- a full pool's refusals --------------------------------------------------------------


def test_a_region_request_on_a_full_pool_with_nothing_to_reclaim_walks_no_key(service):
    """A REQUEST_REGION that finds the pool full looks for an idle region to reclaim; with no
    candidate (every region live and in use) it must not walk every key in Python: a client
    asking again and again would hold the loop."""
    reg = service.registry
    ok(service, MsgType.HANDSHAKE, {"iid": "A", "pid": 1})
    keys_of(service, "A", 64, size=60 * MiB)  # (nearly the whole 64 MiB pool, live)
    walks = []

    class Counted:  # (the C key index's type cannot be patched: eviction sees this instead)
        def __getattr__(self, name):
            return getattr(reg.keys, name)

        def values(self):
            walks.append(1)
            return reg.keys.values()

    reg.eviction.view = dataclasses.replace(reg.eviction.view, keys=Counted())
    reply = call(service, MsgType.REQUEST_REGION, {"iid": "A", "size": 16 * MiB})
    assert reply["ok"] is False and reply["code"] == ErrorCode.POOL_FULL, reply
    assert walks == []
