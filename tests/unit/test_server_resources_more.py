"""More bounds on what one client can take from the others: the bytes an instance pins
(a pinned key is never evicted: pins past a per-instance byte quota are refused whole, as
leases are past `--quota-lease-bytes`), and the places of `--max-instances` (a full table
makes room by reaping the instances that hold nothing and have been idle, oldest first,
before it refuses a handshake)."""

from __future__ import annotations

import logging
import socket

from maru.common.protocol import ErrorCode, MsgType
from maru.server import persistence
from maru.server.journal import Journal
from maru.server.local_socket import Peer
from maru.server.pool import ShmPool
from maru.server.registry import Registry
from maru.server.token import TokenSigner

from .service_calls import call, make_service, ok, on_peer, page_keys, refused

MiB = 1 << 20
PAGE = 4096


def pin_counts(svc, keys: list[str]) -> list[int]:
    return [entry.pins for entry in svc.registry.keys.get_many(keys)]


# -- the bytes an instance pins -----------------------------------------------------------


def test_pinned_bytes_past_the_quota_are_refused_whole(service, caplog):
    """Any instance may pin any key (`maru keys` lists them all), and a pinned key is never
    evicted: an instance pins at most `max_bytes` of keys at once, counted once per key
    however often it pins it. A PIN past it pins nothing (QUOTA_EXCEEDED, a WARNING); a
    leading PIN counts only the run it pins; an unpin gives room back."""
    service.registry.pins.max_bytes = 10 * PAGE
    for name in ("W", "P"):
        ok(service, MsgType.HANDSHAKE, {"iid": name})
    # W's keys, pinned by P: 4 keys of 2 pages, then 8 of 1 page
    keys = page_keys(service, "W", [2] * 4 + [1] * 8)
    big, small = keys[:4], keys[4:]
    pin = {"iid": "P", "keys": big[:3]}  # 6 pages
    assert ok(service, MsgType.PIN, pin)["results"] == [True] * 3
    assert ok(service, MsgType.PIN, pin)["results"] == [True] * 3  # pinned again: no bytes
    assert ok(service, MsgType.PIN, {"iid": "P", "keys": small[:4]})["results"] == [True] * 4
    # 10 pages pinned: one more page, in a batch of one new key and old ones, is refused whole
    before = pin_counts(service, keys)
    with caplog.at_level(logging.WARNING, logger="maru.server.registry"):
        why = refused(service, MsgType.PIN, {"iid": "P", "keys": [*small[:4], small[4]]})
    assert "pinned bytes" in why and str(10 * PAGE) in why
    assert any("pinned bytes" in r.getMessage() for r in caplog.records)
    assert pin_counts(service, keys) == before  # nothing pinned, not even the old keys again
    assert small[4] not in service.registry.instances["P"].pins
    # A leading PIN pins (and counts) the keys up to the first miss only
    lead = {"iid": "P", "keys": [big[0], "no-such-key", big[3]], "leading": True}
    assert ok(service, MsgType.PIN, lead)["results"] == [True, False, False]
    # Unpinned down to nothing of a key, its bytes are free again
    ok(service, MsgType.UNPIN, {"iid": "P", "keys": [big[0]] * 3})
    assert ok(service, MsgType.PIN, {"iid": "P", "keys": small[4:6]})["results"] == [True] * 2
    refused(service, MsgType.PIN, {"iid": "P", "keys": [small[6]]})
    # Another instance's pins are its own
    ok(service, MsgType.HANDSHAKE, {"iid": "Q"})
    assert ok(service, MsgType.PIN, {"iid": "Q", "keys": keys[1:8]})["results"] == [True] * 7


def test_replay_restores_pins_past_the_quota_and_counts_them(tmp_path):
    """The journal's pins come back whole whatever the quota (a restart must not drop what
    the server acknowledged), and count toward it: a new PIN past it is refused until they
    are unpinned."""
    state, pool_path = tmp_path / "state", str(tmp_path / "pool")
    signer = TokenSigner(b"s" * 32)
    journal = Journal(state, fsync_interval=0)
    journal.load()  # (opens it for writing)
    reg = Registry(ShmPool(pool_path, 64 * MiB), signer, journal=journal)
    svc = make_service(tmp_path, registry=reg)
    try:
        ok(svc, MsgType.HANDSHAKE, {"iid": "W"})
        session = ok(svc, MsgType.HANDSHAKE, {"iid": "P"})["session"]
        keys = page_keys(svc, "W", [1] * 12)
        assert ok(svc, MsgType.PIN, {"iid": "P", "keys": keys[:8]})["results"] == [True] * 8
    finally:
        svc.close()
        journal.close()
    journal = Journal(state, fsync_interval=0)
    again = Registry(ShmPool(pool_path, 64 * MiB), signer, journal=journal)
    again.pins.max_bytes = 4 * PAGE  # a smaller quota than the pins it replays
    persistence.restore(again, *journal.load())
    svc = make_service(tmp_path, registry=again)
    try:
        assert pin_counts(svc, keys[:8]) == [1] * 8
        assert ok(svc, MsgType.HANDSHAKE, {"iid": "P", "session": session})["iid"] == "P"
        refused(svc, MsgType.PIN, {"iid": "P", "keys": [keys[8]]})
        ok(svc, MsgType.UNPIN, {"iid": "P", "keys": keys[:5]})
        assert ok(svc, MsgType.PIN, {"iid": "P", "keys": [keys[8]]})["results"] == [True]
    finally:
        svc.close()
        journal.close()


# -- places among --max-instances ---------------------------------------------------------


def test_a_full_table_reaps_the_oldest_idle_instance_holding_nothing(service, clock):
    """One client handshaking 4096 times (heartbeats keeping each alive) filled the table
    and locked every other client out. A handshake into a full table reaps, oldest idle
    first, an instance holding nothing (no region, pin, lease) that sent no request but
    heartbeats for longer than the heartbeat interval: it loses only its place, and its
    client handshakes again when told UNKNOWN_INSTANCE. Refused only if none qualifies."""
    service.housekeeper.heartbeat_timeout = 1.5  # clients beat every 0.5 s
    table = service.registry.instances
    table.max_instances = 6
    for name in ("W", "P", "L", "old"):
        ok(service, MsgType.HANDSHAKE, {"iid": name})
    keys = page_keys(service, "W", [1] * 4)  # W holds a region
    ok(service, MsgType.PIN, {"iid": "P", "keys": keys[:1]})  # P a pin
    assert ok(service, MsgType.LOOKUP_KV, {"iid": "L", "keys": keys, "lease": True})["lease_id"]
    clock(0.1)
    ok(service, MsgType.HANDSHAKE, {"iid": "young"})
    ok(service, MsgType.HANDSHAKE, {"iid": "busy"})
    clock(0.7)
    for name in ("W", "P", "L", "old", "young", "busy"):
        ok(service, MsgType.HEARTBEAT, {"iid": name})  # beats alone are not requests
    ok(service, MsgType.EXISTS, {"iid": "busy", "keys": keys})  # busy asked: not idle
    reaped = service.registry.counters["instances_reaped"]
    ok(service, MsgType.HANDSHAKE, {"iid": "new1"})
    assert "old" not in table and "young" in table
    ok(service, MsgType.HANDSHAKE, {"iid": "new2"})
    assert "young" not in table
    assert service.registry.counters["instances_reaped"] == reaped + 2
    assert sorted(table) == ["L", "P", "W", "busy", "new1", "new2"]
    why = refused(service, MsgType.HANDSHAKE, {"iid": "new3"})
    assert "--max-instances" in why
    # The reaped one is told it is unknown (its client handshakes again): a place frees once
    # another idles
    reply = call(service, MsgType.HEARTBEAT, {"iid": "old"})
    assert reply["code"] == ErrorCode.UNKNOWN_INSTANCE, reply
    refused(service, MsgType.HANDSHAKE, {"iid": "old"})
    clock(0.7)
    ok(service, MsgType.EXISTS, {"iid": "new2", "keys": keys})
    ok(service, MsgType.HANDSHAKE, {"iid": "old"})  # busy, idle since its EXISTS, goes first
    assert sorted(table) == ["L", "P", "W", "new1", "new2", "old"]


def test_a_watched_live_process_is_reaped_when_idle_only_if_it_holds_nothing(service, clock):
    """An instance whose process is watched (a pidfd: local socket) and alive is never
    reaped for silence; making room, it is reaped for idleness only when it holds nothing
    (a re-handshake is all that costs it), and its pidfd goes with it."""
    service.housekeeper.heartbeat_timeout = 1.5  # clients beat every 0.5 s
    table = service.registry.instances
    table.max_instances = 3
    for name in ("W", "holder", "empty"):
        ok(service, MsgType.HANDSHAKE, {"iid": name})
    keys = page_keys(service, "W", [1] * 2)
    mine, theirs = socket.socketpair()
    try:
        peer = Peer(mine)
        for name in ("holder", "empty"):
            assert on_peer(service, peer, MsgType.HEARTBEAT, {"iid": name})["ok"]
            assert table.processes.holder(name) is not None
        assert on_peer(service, peer, MsgType.PIN, {"iid": "holder", "keys": keys[:1]})["ok"]
        clock(0.7)
        ok(service, MsgType.EXISTS, {"iid": "W", "keys": keys})
        ok(service, MsgType.HANDSHAKE, {"iid": "next"})
        assert "empty" not in table and table.processes.holder("empty") is None
        assert "holder" in table and table.processes.holder("holder") is not None
        refused(service, MsgType.HANDSHAKE, {"iid": "later"})
    finally:
        mine.close()
        theirs.close()
