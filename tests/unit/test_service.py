"""MaruService.handle_frame: every frame gets exactly one reply, garbage included, and the
service keeps working afterwards. (The socket loop is covered by the integration tests.)"""

from __future__ import annotations

import msgpack
import pytest

from maru.common import protocol
from maru.common.protocol import (
    HEADER,
    MAGIC,
    MAX_KEY_BYTES,
    ErrorCode,
    MsgType,
    RegisterStatus,
    freed_notices,
)

from .service_calls import call, locations, make_service, ok, register_body, wire_body

MiB = 1 << 20
BAD = ErrorCode.BAD_REQUEST


@pytest.fixture
def service(tmp_path):
    svc = make_service(tmp_path, pool_mib=16)
    yield svc
    svc.close()


def err(svc, msg_type, body) -> ErrorCode:
    reply = call(svc, msg_type, body)
    assert reply["ok"] is False, reply
    assert isinstance(reply["error"], str) and reply["error"]
    return ErrorCode(reply["code"])


def raw(svc, frame):
    return protocol.decode(svc.handle_frame(frame))


def test_handshake_region_register_lookup(service):
    hs = ok(service, MsgType.HANDSHAKE, {"iid": "A", "pid": 1})
    assert hs["regions"] == [] and hs["version"] == protocol.PROTOCOL_VERSION
    region = ok(service, MsgType.REQUEST_REGION, {"iid": "A", "size": MiB})["region"]
    rid = region[0]
    reply = ok(service, MsgType.REGISTER_KV, register_body("A", [["k", rid, 0, 5]]))
    assert reply["results"] == [0]
    reply = ok(service, MsgType.LOOKUP_KV, {"keys": ["k", "x"]})
    assert locations(reply) == [[rid, 0, 5], None]
    assert reply["regions"] == [region]
    assert ok(service, MsgType.EXISTS, {"keys": ["k", "x"]})["results"] == [True, False]
    assert ok(service, MsgType.HEARTBEAT, {})["ok"] is True
    stats = ok(service, MsgType.STATS, {})["stats"]
    assert stats["keys"] == 1 and stats["operations"]["register_kv"]["count"] == 1
    # a seal naming its region's token as granted is registered; another token, not
    token = region[4]
    right = {**register_body("A", [["k2", rid, 4096, 5]]), "tokens": [[rid, token]]}
    assert ok(service, MsgType.REGISTER_KV, right)["results"] == [0]
    wrong = {**register_body("A", [["k3", rid, 8192, 5]]), "tokens": [[rid, "other"]]}
    assert ok(service, MsgType.REGISTER_KV, wrong)["results"] == [RegisterStatus.REJECTED]
    assert ok(service, MsgType.EXISTS, {"keys": ["k2", "k3"]})["results"] == [True, False]


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"hello",
        b"\x00" * 100,
        b"GET / HTTP/1.1\r\n\r\n",
        HEADER.pack(b"XXXX", 1, 1, 0, 5) + msgpack.packb({}),
    ],
)
def test_garbage_gets_bad_frame(service, frame):
    _, body = raw(service, frame)
    assert body["ok"] is False and body["code"] == ErrorCode.BAD_FRAME


def test_bad_body_keeps_request_id(service):
    frame = HEADER.pack(MAGIC, protocol.PROTOCOL_VERSION, MsgType.STATS, 0, 77) + b"\xc1"
    header, body = raw(service, frame)
    assert header.request_id == 77 and header.msg_type == MsgType.STATS
    assert body["code"] == ErrorCode.BAD_FRAME


@pytest.mark.parametrize("version", [1, 99])
def test_a_request_of_another_version_gets_an_error_it_can_read(service, version):
    """Answered in the request's own version (the error body has one form in every version),
    naming both versions; a version-1 client shows it instead of failing to decode."""
    request = protocol.encode(MsgType.HANDSHAKE, 3, {"iid": "old"}, version=version)
    reply = service.handle_frame(request)
    header = protocol.decode_header(reply)
    assert (header.version, header.request_id, header.msg_type) == (version, 3, MsgType.HANDSHAKE)
    assert header.flags & protocol.FLAG_REPLY
    body = msgpack.unpackb(reply[HEADER.size :])
    assert body["ok"] is False and body["code"] == ErrorCode.BAD_VERSION
    assert f"version {protocol.PROTOCOL_VERSION}" in body["error"]
    assert f"version {version}" in body["error"]
    assert "old" not in service.registry.instances


@pytest.mark.parametrize("msg_type", [0, 200, 255])
def test_unknown_message_type(service, msg_type):
    assert err(service, msg_type, {}) == ErrorCode.UNKNOWN_TYPE


@pytest.mark.parametrize(
    ("msg_type", "body", "code"),
    [
        (MsgType.HANDSHAKE, {}, ErrorCode.BAD_REQUEST),
        (MsgType.HANDSHAKE, {"iid": 5}, ErrorCode.BAD_REQUEST),
        (MsgType.REQUEST_REGION, {"iid": "nobody", "size": MiB}, ErrorCode.UNKNOWN_INSTANCE),
        (MsgType.REQUEST_REGION, {"iid": "A", "size": True}, ErrorCode.BAD_REQUEST),
        (MsgType.REQUEST_REGION, {"iid": "A", "size": "big"}, ErrorCode.BAD_REQUEST),
        (MsgType.REQUEST_REGION, {"iid": "A", "size": 1 << 40}, ErrorCode.POOL_FULL),
        (MsgType.REQUEST_REGION, {"iid": "A", "size": MiB, "ahead": 1}, ErrorCode.BAD_REQUEST),
        (MsgType.REGISTER_KV, {"iid": "A"}, ErrorCode.BAD_REQUEST),
        (MsgType.REGISTER_KV, {"iid": "A", "keys": "nope"}, ErrorCode.BAD_REQUEST),
        (MsgType.REGISTER_KV, register_body("ghost", []), ErrorCode.UNKNOWN_INSTANCE),
        (MsgType.REGISTER_KV, {**register_body("A", [["k", 1, 0, 1]]), "offsets": [0]}, BAD),
        (MsgType.REGISTER_KV, {**register_body("A", [["k", 1, 0, 1]]), "lengths": b"\1"}, BAD),
        (MsgType.REGISTER_KV, {**register_body("A", [["k", 1, 0, 1]]), "keys": []}, BAD),
        (MsgType.REGISTER_KV, {"iid": "A", "keys": ["k"]}, BAD),
        (MsgType.REGISTER_KV, {**register_body("A", [["k", 1, 0, 1]]), "tokens": "t"}, BAD),
        (MsgType.REGISTER_KV, {**register_body("A", [["k", 1, 0, 1]]), "tokens": [[1]]}, BAD),
        (
            MsgType.REGISTER_KV,
            {**register_body("A", [["k", 1, 0, 1]]), "tokens": [["1", "t"]]},
            BAD,
        ),
        (MsgType.LOOKUP_KV, {"keys": "k"}, ErrorCode.BAD_REQUEST),
        (MsgType.LOOKUP_KV, {"keys": [None]}, ErrorCode.BAD_REQUEST),
        (MsgType.LOOKUP_KV, {"keys": ["k" * (MAX_KEY_BYTES + 1)]}, ErrorCode.KEY_TOO_LONG),
        (MsgType.LOOKUP_KV, {"keys": [b"k" * (MAX_KEY_BYTES + 1)]}, ErrorCode.KEY_TOO_LONG),
        (MsgType.LOOKUP_KV, {"keys": ["é" * 600]}, ErrorCode.KEY_TOO_LONG),  # 1200 bytes
        (MsgType.EXISTS, {"keys": ["k" * 5000]}, ErrorCode.KEY_TOO_LONG),
        (MsgType.PIN, {"keys": ["k" * 5000]}, ErrorCode.KEY_TOO_LONG),
        (MsgType.PIN, {"iid": "A", "keys": ["k"], "leading": 1}, ErrorCode.BAD_REQUEST),
        (MsgType.PIN, {"iid": "A", "keys": ["k"], "leading": "yes"}, ErrorCode.BAD_REQUEST),
        (MsgType.DELETE_KV, {"keys": ["k" * 5000]}, ErrorCode.KEY_TOO_LONG),
        (MsgType.LOOKUP_KV, {"keys": ["k"] * (protocol.MAX_BATCH + 1)}, ErrorCode.BAD_REQUEST),
        (MsgType.RETURN_REGION, {"iid": "A", "region_id": 1, "token": "x"}, ErrorCode.BAD_TOKEN),
        (MsgType.RETURN_REGION, {"iid": "A", "region_id": 42}, ErrorCode.UNKNOWN_REGION),
        (MsgType.REGION_ACCESS, {"region_id": 1, "token": "0" * 32}, ErrorCode.BAD_TOKEN),
        (MsgType.REGION_ACCESS, {"region_id": "1"}, ErrorCode.UNKNOWN_REGION),
    ],
)
def test_bad_requests_get_error_replies(service, msg_type, body, code):
    ok(service, MsgType.HANDSHAKE, {"iid": "A"})
    ok(service, MsgType.REQUEST_REGION, {"iid": "A", "size": MiB})
    assert err(service, msg_type, body) == code
    # and the service still works
    assert ok(service, MsgType.EXISTS, {"keys": ["k"]})["results"] == [False]


def test_key_of_maximum_length_is_fine(service):
    reply = ok(service, MsgType.LOOKUP_KV, {"keys": ["k" * MAX_KEY_BYTES, b"k" * MAX_KEY_BYTES]})
    assert locations(reply) == [None, None]


def test_handler_bug_becomes_internal_error(service, monkeypatch):
    def boom(keys, iid):
        raise RuntimeError("kaboom")

    monkeypatch.setattr(service.registry, "exists", boom)
    reply = call(service, MsgType.EXISTS, {"keys": ["k"]})
    assert reply["ok"] is False and reply["code"] == ErrorCode.INTERNAL
    assert "kaboom" in reply["error"]
    monkeypatch.undo()
    assert ok(service, MsgType.EXISTS, {"keys": ["k"]})["results"] == [False]


def test_freed_locations_piggyback_on_the_owners_next_reply(service):
    ok(service, MsgType.HANDSHAKE, {"iid": "A"})
    ok(service, MsgType.HANDSHAKE, {"iid": "B"})
    rid = ok(service, MsgType.REQUEST_REGION, {"iid": "A", "size": MiB})["region"][0]
    ok(service, MsgType.REGISTER_KV, register_body("A", [["k", rid, 4096, 10]]))
    # B deletes A's key: B's reply carries nothing, A's next reply carries the location
    assert "freed" not in ok(service, MsgType.DELETE_KV, {"iid": "B", "keys": ["k"]})
    assert freed_notices(ok(service, MsgType.HEARTBEAT, {"iid": "A"})["freed"]) == [[rid, 4096, 10]]
    assert "freed" not in ok(service, MsgType.HEARTBEAT, {"iid": "A"})


def test_a_seal_asking_room_ahead_evicts_the_callers_oldest_keys_never_its_own(service):
    """REGISTER_KV with "ahead": that many bytes are evicted in the caller's own regions,
    oldest first (another instance's keys untouched), before the keys are sealed, so never
    one of them; the pages come back in the same reply. A bad "ahead" is refused before
    anything is sealed or evicted."""
    ok(service, MsgType.HANDSHAKE, {"iid": "A"})
    ok(service, MsgType.HANDSHAKE, {"iid": "B"})
    rid = ok(service, MsgType.REQUEST_REGION, {"iid": "A", "size": MiB})["region"][0]
    other = ok(service, MsgType.REQUEST_REGION, {"iid": "B", "size": MiB})["region"][0]
    ok(service, MsgType.REGISTER_KV, register_body("B", [["b0", other, 0, 10]]))
    rows = [[f"a{i}", rid, 4096 * i, 10] for i in range(4)]
    ok(service, MsgType.REGISTER_KV, register_body("A", rows))
    for bad in (-1, "20", "", None, True, False, 1.5, 1 << 63):
        body = {**register_body("A", [["new", rid, 4096 * 4, 10]]), "ahead": bad}
        assert err(service, MsgType.REGISTER_KV, body) == ErrorCode.BAD_REQUEST
    assert ok(service, MsgType.EXISTS, {"keys": ["new"]})["results"] == [False]
    body = {**register_body("A", [["new", rid, 4096 * 4, 10]]), "ahead": 20}
    reply = ok(service, MsgType.REGISTER_KV, body)
    assert reply["results"] == [protocol.RegisterStatus.REGISTERED]
    assert freed_notices(reply["freed"]) == [[rid, 0, 10], [rid, 4096, 10]]
    keys = ["a0", "a1", "a2", "a3", "new", "b0"]
    assert ok(service, MsgType.EXISTS, {"keys": keys})["results"] == [False, False] + [True] * 4
    # more room asked than the caller's keys hold: all of them go, but not the one sealed now
    body = {**register_body("A", [["last", rid, 4096 * 5, 10]]), "ahead": 1000}
    assert ok(service, MsgType.REGISTER_KV, body)["results"] == [protocol.RegisterStatus.REGISTERED]
    keys = ["a2", "a3", "new", "last", "b0"]
    assert ok(service, MsgType.EXISTS, {"keys": keys})["results"] == [False] * 3 + [True] * 2


def test_the_loop_stays_awake_after_requests_but_not_for_a_write_behind_writers_seals(
    service, monkeypatch
):
    """The loop spins for a request's sender's next request (`--busy-poll-us`), except after
    a seal its writer does not wait for ("behind"), which the writer's next copy follows: that
    spin would only take a CPU the copy uses. Small write-behind seals back to back (less
    than half the window apart) still keep it awake: there the next one comes within it."""
    clock = [100.0]
    monkeypatch.setattr("maru.server.service.perf_counter", lambda: clock[0])
    service.busy_poll_s = 1e-3
    ok(service, MsgType.HANDSHAKE, {"iid": "A"})
    rid = ok(service, MsgType.REQUEST_REGION, {"iid": "A", "size": MiB})["region"][0]

    def spins_after(msg_type: MsgType, body: dict, seconds_later: float) -> bool:
        clock[0] += seconds_later
        service.spin_wanted = None  # (as the loop sets it for each turn)
        ok(service, msg_type, body)
        return service.spin_wanted is not False

    def seal(i: int, behind: bool) -> dict:
        body = register_body("A", [[f"k{i}", rid, 4096 * i, 10]])
        return {**body, "behind": True} if behind else body

    assert spins_after(MsgType.EXISTS, {"keys": ["k0"]}, 0.01)  # (a read's request)
    assert not spins_after(MsgType.REGISTER_KV, seal(0, True), 0.01)  # a big write's pace
    assert not spins_after(MsgType.REGISTER_KV, seal(1, True), 0.0008)  # (0.8 ms apart)
    assert spins_after(MsgType.REGISTER_KV, seal(2, True), 0.0003)  # small writes, 0.3 ms
    assert spins_after(MsgType.REGISTER_KV, seal(3, False), 0.01)  # its writer waits
    assert not spins_after(MsgType.REGISTER_KV, seal(4, True), 0.01)
    assert (
        ok(service, MsgType.EXISTS, {"keys": [f"k{i}" for i in range(5)]})["results"] == [True] * 5
    )


def test_a_seal_goes_on_when_its_room_ahead_cannot_be_journaled(service, monkeypatch, tmp_path):
    """A REGISTER_KV whose "ahead" eviction cannot be journaled (it then changed nothing)
    still seals its keys, as far as the journal takes them; the writer asks again later."""
    from maru.server.journal import JournalWriteError

    def refused(*args):
        raise JournalWriteError(tmp_path, OSError(28, "No space left on device"))

    ok(service, MsgType.HANDSHAKE, {"iid": "A"})
    rid = ok(service, MsgType.REQUEST_REGION, {"iid": "A", "size": MiB})["region"][0]
    ok(service, MsgType.REGISTER_KV, register_body("A", [["old", rid, 0, 10]]))
    monkeypatch.setattr(service.registry.eviction, "evict_for", refused)
    body = {**register_body("A", [["new", rid, 4096, 10]]), "ahead": 10}
    assert ok(service, MsgType.REGISTER_KV, body)["results"] == [protocol.RegisterStatus.REGISTERED]
    assert ok(service, MsgType.EXISTS, {"keys": ["old", "new"]})["results"] == [True, True]


def test_every_message_replies_with_exactly_its_schema_fields(service):
    """Each message type, sent as its one request form, answers with the fields MESSAGES lists
    for its reply (all of them), plus "ok" and maybe "freed"; no other field."""
    hs = ok(service, MsgType.HANDSHAKE, {"iid": "A", "pid": 1, "chunk_size": 4096})
    region = ok(service, MsgType.REQUEST_REGION, {"iid": "A", "size": MiB})["region"]
    spare = ok(service, MsgType.REQUEST_REGION, {"iid": "A", "size": MiB})["region"]
    rid, token = region[0], region[4]
    rows = [["k", rid, 0, 10], ["j", rid, 4096, 10], ["p/1", rid, 8192, 10]]
    lease_id = 0
    requests = {
        MsgType.HANDSHAKE: {"iid": "A", "pid": 1, "chunk_size": 4096},
        MsgType.REQUEST_REGION: {"iid": "A", "size": MiB},
        MsgType.RETURN_REGION: {"iid": "A", "region_id": spare[0], "token": spare[4]},
        MsgType.REGION_ACCESS: {"region_id": rid, "token": token},
        MsgType.REGISTER_KV: register_body("A", rows),
        MsgType.LOOKUP_KV: {"iid": "A", "keys": ["k", "x"], "lease": True},
        MsgType.EXISTS: {"iid": "A", "keys": ["k", "x"]},
        MsgType.PIN: {"iid": "A", "keys": ["j"]},
        MsgType.UNPIN: {"iid": "A", "keys": ["j"]},
        MsgType.DELETE_KV: {"iid": "A", "keys": ["j"]},
        MsgType.CORRUPT_KV: {
            "iid": "A",
            "keys": ["j", "p/1"],
            **{name: protocol.pack_int64([0, 0]) for name in ("region_ids", "offsets")},
            **{name: protocol.pack_int64([0, 0]) for name in ("lengths", protocol.CHECKSUMS)},
        },
        MsgType.LIST_ALLOCATIONS: {"owner": "A"},
        MsgType.STATS: {},
        MsgType.HEARTBEAT: {"iid": "A"},
        MsgType.DELETE_PREFIX: {"iid": "A", "prefix": "p/"},
        MsgType.RELEASE: {"iid": "A", "leases": []},
        MsgType.EVICT_FOR: {"iid": "A", "bytes": 1},
        MsgType.KEYS: {"prefix": "", "limit": 10},
        MsgType.PARK_REGIONS: {"iid": "A", "seq": 1, "park": [spare[0]], "unpark": [rid]},
        MsgType.DISCONNECT: {"iid": "A"},  # last: A is gone afterwards
    }
    assert set(requests) == set(MsgType) == set(protocol.MESSAGES)
    assert hs["iid"] == "A" and "local_socket" in hs
    for msg_type, body in requests.items():
        if msg_type == MsgType.RELEASE:
            body = {**body, "leases": [lease_id]}
        request_fields = {name for name, _, _ in protocol.MESSAGES[msg_type][0]}
        assert set(wire_body(service, msg_type, body)) <= request_fields, msg_type
        reply = ok(service, msg_type, body)
        fields = {name for name, _, _ in protocol.MESSAGES[msg_type][1]}
        assert fields <= set(reply) <= fields | {"ok", "freed"}, (msg_type, sorted(reply))
        if msg_type == MsgType.LOOKUP_KV:
            lease_id = reply["lease_id"]
            assert lease_id > 0 and locations(reply) == [[rid, 0, 10], None]
        if msg_type == MsgType.DISCONNECT:
            assert reply == {"ok": True, "pins": 0, "leases": 0, "regions": 2}
    # A is gone: it owns nothing, and a request of its old session is refused
    assert ok(service, MsgType.LIST_ALLOCATIONS, {"owner": "A"})["regions"] == []
    assert call(service, MsgType.PIN, {"iid": "A", "keys": ["k"]})["code"] == (
        ErrorCode.UNKNOWN_INSTANCE
    )


def test_checksums_of_another_hash_are_not_taken(service):
    """The checksum column is named after its hash (`protocol.CHECKSUMS`, maru64): a writer
    from before (xxh3_64 sent as "checksums") stores its keys without one, and LOOKUP_KV
    replies carry the maru64 column only, so neither side compares one hash with the other."""
    ok(service, MsgType.HANDSHAKE, {"iid": "A", "pid": 1})
    rid = ok(service, MsgType.REQUEST_REGION, {"iid": "A", "size": MiB})["region"][0]
    sums = protocol.pack_int64([1234, 5678])
    old = {**register_body("A", [["old", rid, 0, 5]]), "checksums": sums[:8]}
    new = {**register_body("A", [["new", rid, 4096, 5]]), protocol.CHECKSUMS: sums[8:]}
    assert ok(service, MsgType.REGISTER_KV, old)["results"] == [0]
    assert ok(service, MsgType.REGISTER_KV, new)["results"] == [0]
    reply = ok(service, MsgType.LOOKUP_KV, {"keys": ["old", "new"]})
    assert "checksums" not in reply
    assert memoryview(reply[protocol.CHECKSUMS]).cast("q").tolist() == [0, 5678]
