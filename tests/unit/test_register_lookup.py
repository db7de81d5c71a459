"""REGISTER_KV and LOOKUP_KV, the data path's two requests, in their one (v2) form: packed
int64 columns per key; every rule of sealing and leasing, through the real `handle_frame`."""

from __future__ import annotations

import pytest

from maru.common.protocol import MAX_KEY_BYTES, ErrorCode, MsgType, RegisterStatus, pack_int64

from .service_calls import call, locations, make_service, ok, register_body

MiB = 1 << 20
REG, EXISTS, REJ = (int(s) for s in RegisterStatus)


@pytest.fixture
def service(tmp_path):
    svc = make_service(tmp_path, pool_mib=16)
    yield svc
    svc.close()


def region(svc, iid="A"):
    ok(svc, MsgType.HANDSHAKE, {"iid": iid, "pid": 1, "chunk_size": 4096})
    handle = ok(svc, MsgType.REQUEST_REGION, {"iid": iid, "size": MiB})["region"]
    assert handle[3] == 2 * MiB  # regions are 2 MiB aligned
    return handle[0]


def register(svc, keys, rid, offsets, length, iid="A"):
    """One region and one length for every key (what MaruStorage sends)."""
    rows = [[key, rid, offset, length] for key, offset in zip(keys, offsets)]
    return ok(svc, MsgType.REGISTER_KV, register_body(iid, rows))["results"]


def test_register_and_lookup(service):
    rid = region(service)
    assert register(service, ["a", "b", "c"], rid, [0, 4096, 8192], 100) == [REG] * 3
    # Duplicates (elsewhere: at its own place it is the same registration, REGISTERED), bad
    # offsets, bad keys: decided key by key.
    too_long = "k" * (MAX_KEY_BYTES + 1)
    offsets = [12288, -1, 2 * MiB - 99, 0, 0]
    got = register(service, ["a", "d", "e", too_long, 5], rid, offsets, 100)
    assert got == [EXISTS, REJ, REJ, REJ, REJ]
    assert register(service, ["f"], rid, [2 * MiB - 100], 100) == [REG]  # ends at the end
    # Lookup without a lease: misses are 0 0 0, lease_id 0.
    reply = ok(service, MsgType.LOOKUP_KV, {"iid": "A", "keys": ["a", "x", "c"], "lease": False})
    assert locations(reply) == [[rid, 0, 100], None, [rid, 8192, 100]]
    assert [r[0] for r in reply["regions"]] == [rid]
    assert reply["lease_id"] == 0
    stats = service.registry.stats()
    assert stats["keys"] == 4 and stats["live_bytes"] == 400
    assert stats["counters"]["keys_duplicate"] == 1


def test_one_batch_across_regions_and_lengths(service):
    """The general form: each key names its own region and length."""
    a, b = region(service), region(service)
    rows = [["x", a, 0, 10], ["y", b, 4096, 20], ["z", a, 8192, 30], ["x", b, 0, 5]]
    got = ok(service, MsgType.REGISTER_KV, register_body("A", rows))["results"]
    assert got == [REG, REG, REG, EXISTS]  # first writer wins, within a batch too
    reply = ok(service, MsgType.LOOKUP_KV, {"keys": ["x", "y", "z"], "lease": False})
    assert locations(reply) == [[a, 0, 10], [b, 4096, 20], [a, 8192, 30]]


def test_lookup_lease_blocks_delete_until_release(service):
    rid = region(service)
    register(service, ["a", "b"], rid, [0, 4096], 10)
    body = {"iid": "A", "keys": ["a", "b", "a", "zz"], "lease": True}
    lease_id = ok(service, MsgType.LOOKUP_KV, body)["lease_id"]
    assert lease_id
    assert ok(service, MsgType.DELETE_KV, {"keys": ["a"]})["results"] == [2]  # leased
    # Only the instance that took a lease ends it (lease ids are guessable).
    assert ok(service, MsgType.RELEASE, {"iid": "B", "leases": [lease_id]})["released"] == 0
    assert ok(service, MsgType.RELEASE, {"leases": [lease_id]})["released"] == 0
    assert service.registry.counters["releases_refused"] == 2
    # `true` is not a lease id (not 1 either), and must not get past the owner check as one
    assert ok(service, MsgType.RELEASE, {"iid": "B", "leases": [True]})["released"] == 0
    assert ok(service, MsgType.DELETE_KV, {"keys": ["a"]})["results"] == [2]  # still leased
    assert ok(service, MsgType.RELEASE, {"iid": "A", "leases": [lease_id]})["released"] == 1
    assert ok(service, MsgType.DELETE_KV, {"keys": ["a", "b"]})["results"] == [0, 0]
    reply = ok(service, MsgType.LOOKUP_KV, {"keys": ["a"], "lease": True})
    assert reply["lease_id"] == 0 and locations(reply) == [None]


@pytest.mark.parametrize(
    "columns",
    [
        {"region_ids": pack_int64([1, 1]), "offsets": pack_int64([0]), "lengths": pack_int64([1])},
        {"region_ids": [1], "offsets": [0], "lengths": [10]},  # lists: not the v2 form
        {"region_ids": b"\x01" * 12, "offsets": pack_int64([0]), "lengths": pack_int64([1])},
        {"offsets": pack_int64([0]), "lengths": pack_int64([1])},
    ],
    ids=["count-mismatch", "lists", "ragged-bytes", "missing-column"],
)
def test_register_bad_shape_is_a_bad_request(service, columns):
    region(service)
    reply = call(service, MsgType.REGISTER_KV, {"iid": "A", "keys": ["a"], **columns})
    assert reply["ok"] is False and reply["code"] == ErrorCode.BAD_REQUEST
    assert service.registry.stats()["keys"] == 0


def test_register_wrong_region_or_length(service):
    rid = region(service)
    other = region(service, "B")
    assert register(service, ["a"], other, [0], 10) == [REJ]  # not the caller's region
    assert register(service, ["a"], 999, [0], 10) == [REJ]
    assert register(service, ["a"], 0, [0], 10) == [REJ]  # 0 marks a miss: never a region
    assert register(service, ["a", "b"], rid, [0, 0], 0) == [REJ, REJ]
    assert register(service, ["a"], rid, [0], -5) == [REJ]
    assert register(service, ["a"], rid, [2 * MiB], 1) == [REJ]  # past the region's end
    assert service.registry.stats()["keys"] == 0
