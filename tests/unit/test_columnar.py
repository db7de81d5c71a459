"""REGISTER_KV and LOOKUP_KV in columnar form (the SGLang hot path): the same rules and outcomes
as the per-entry forms, which keep working beside them."""

from __future__ import annotations

import pytest

from maru.common.protocol import MAX_KEY_BYTES, ErrorCode, MsgType, RegisterStatus

from .service_calls import call, make_service, ok

MiB = 1 << 20
REG, EXISTS, REJ = (int(s) for s in RegisterStatus)


@pytest.fixture
def service(tmp_path):
    svc = make_service(tmp_path, pool_mib=16)
    yield svc
    svc.close()


def region(svc, iid="A"):
    ok(svc, MsgType.HANDSHAKE, {"iid": iid, "pid": 1, "page_size": 4096})
    handle = ok(svc, MsgType.REQUEST_REGION, {"iid": iid, "size": MiB})["region"]
    assert handle[3] == 2 * MiB  # regions are 2 MiB aligned
    return handle[0]


def register(svc, keys, rid, offsets, length, iid="A"):
    body = {"iid": iid, "keys": keys, "region_id": rid, "offsets": offsets, "length": length}
    return ok(svc, MsgType.REGISTER_KV, body)["results"]


def test_columnar_register_and_lookup(service):
    rid = region(service)
    assert register(service, ["a", "b", "c"], rid, [0, 4096, 8192], 100) == [REG] * 3
    # Same outcomes as the entries form: duplicates, bad offsets, bad keys.
    too_long = "k" * (MAX_KEY_BYTES + 1)
    got = register(service, ["a", "d", "e", too_long, 5], rid, [0, -1, 2 * MiB - 99, 0, 0], 100)
    assert got == [EXISTS, REJ, REJ, REJ, REJ]
    assert register(service, ["f"], rid, [2 * MiB - 100], 100) == [REG]  # ends at the end
    # Lookup, columnar, with a lease: misses are 0 0 0.
    reply = ok(service, MsgType.LOOKUP_KV, {"iid": "A", "keys": ["a", "x", "c"], "columnar": True})
    assert reply["region_ids"] == [rid, 0, rid]
    assert reply["offsets"] == [0, 0, 8192]
    assert reply["lengths"] == [100, 0, 100]
    assert [r[0] for r in reply["regions"]] == [rid]
    assert "lease_id" not in reply
    # The entries form sees the same keys.
    reply = ok(service, MsgType.LOOKUP_KV, {"keys": ["b", "x"]})
    assert reply["locations"] == [[rid, 4096, 100], None]
    stats = service.registry.stats()
    assert stats["keys"] == 4 and stats["live_bytes"] == 400
    assert stats["counters"]["keys_duplicate"] == 1


def test_columnar_lookup_lease_blocks_delete_until_release(service):
    rid = region(service)
    register(service, ["a", "b"], rid, [0, 4096], 10)
    body = {"iid": "A", "keys": ["a", "b", "a", "zz"], "columnar": True, "lease": True}
    lease_id = ok(service, MsgType.LOOKUP_KV, body)["lease_id"]
    assert lease_id
    assert ok(service, MsgType.DELETE_KV, {"keys": ["a"]})["results"] == [2]  # leased
    # Only the instance that took a lease ends it (lease ids are guessable).
    assert ok(service, MsgType.RELEASE, {"iid": "B", "leases": [lease_id]})["released"] == 0
    assert ok(service, MsgType.RELEASE, {"leases": [lease_id]})["released"] == 0
    assert service.registry.counters["releases_refused"] == 2
    if lease_id == 1:  # `true` is not lease 1, and must not get past the owner check as it
        assert ok(service, MsgType.RELEASE, {"iid": "B", "leases": [True]})["released"] == 0
    assert ok(service, MsgType.DELETE_KV, {"keys": ["a"]})["results"] == [2]  # still leased
    assert ok(service, MsgType.RELEASE, {"iid": "A", "leases": [lease_id]})["released"] == 1
    assert ok(service, MsgType.DELETE_KV, {"keys": ["a", "b"]})["results"] == [0, 0]
    reply = ok(service, MsgType.LOOKUP_KV, {"keys": ["a"], "columnar": True, "lease": True})
    assert reply["lease_id"] == 0 and reply["region_ids"] == [0]


@pytest.mark.parametrize(
    "body",
    [
        {"keys": ["a"], "offsets": [0, 1], "length": 10},  # lengths differ
        {"keys": ["a"], "offsets": "0", "length": 10},
        {"keys": "a", "offsets": [0], "length": 10},
    ],
)
def test_columnar_register_bad_shape(service, body):
    rid = region(service)
    reply = call(service, MsgType.REGISTER_KV, {"iid": "A", "region_id": rid, **body})
    assert reply["ok"] is False and reply["code"] == ErrorCode.BAD_REQUEST


def test_columnar_register_wrong_region_or_length(service):
    rid = region(service)
    other = region(service, "B")
    assert register(service, ["a"], other, [0], 10) == [REJ]  # not the caller's region
    assert register(service, ["a"], 999, [0], 10) == [REJ]
    assert register(service, ["a", "b"], rid, [0, 0], 0) == [REJ, REJ]
    assert register(service, ["a"], rid, [0], True) == [REJ]
    assert service.registry.stats()["keys"] == 0


def test_both_register_forms_reject_a_bool_for_a_number(service):
    """msgpack has a boolean type, and Python counts True as the int 1: a client bug sending
    `true` for an offset, length or region id must be REJECTED in either form, not stored at
    offset 1."""
    rid = region(service)
    for form in ("columnar", "entries"):
        for region_id, offset, length in ((rid, True, 10), (rid, 0, True), (True, 0, 10)):
            key = f"{form}-{region_id}-{offset}-{length}"
            if form == "columnar":
                got = register(service, [key], region_id, [offset], length)
            else:
                body = {"iid": "A", "entries": [[key, region_id, offset, length]]}
                got = ok(service, MsgType.REGISTER_KV, body)["results"]
            assert got == [REJ], (form, region_id, offset, length)
    assert service.registry.stats()["keys"] == 0
