"""Fuzzing the wire protocol (hypothesis): random and truncated frames, wrong types, huge
declared lengths, bad tokens and unknown instances.

In-process against `MaruService.handle_frame`: every frame gets exactly one reply that decodes,
is marked as a reply, and is either `ok` or an error with a known code that is not INTERNAL
(INTERNAL means a server bug); afterwards the registry's bookkeeping is consistent and a valid
STATS still works. Then a bounded number of frames against a live `maru-server` over a raw
DEALER socket: every frame is answered, the process survives, leases and fuzz-created
instances expire, and pool usage adds up."""

from __future__ import annotations

import time

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from maru import MaruHandler
from maru.client.poolpath import prove
from maru.common import protocol
from maru.common.protocol import FLAG_REPLY, HEADER, MAGIC, PROTOCOL_VERSION, ErrorCode, MsgType
from maru.server.pool import ShmPool
from maru.server.registry import Registry
from maru.server.service import MaruService
from maru.server.token import TokenSigner

from .registry_calls import register

MiB = 1 << 20
KNOWN_IIDS = ["fz", "fz-2"]
KNOWN_KEYS = ["k0", "k1", b"k2", "k3"]
INT64_EDGES = [2**63 - 1, 2**63, 2**64 - 1]  # msgpack carries up to 2**64 - 1; C holds int64

# -- strategies -----------------------------------------------------------------------------------

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=16)
    | st.binary(max_size=16)
)
values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.text(max_size=6) | st.integers(-5, 5), children, max_size=4)
    ),
    max_leaves=10,
)
small_ints = st.integers(min_value=-2, max_value=8)
plain_keys = st.sampled_from(KNOWN_KEYS) | st.text(max_size=8) | st.binary(max_size=8)
keys = plain_keys | plain_keys | values


def field_strategies(region_ids: list[int], tokens: list[str], sessions: list[str]) -> dict:
    """Per field: mostly plausible values (known sessions, tokens, keys), sometimes anything."""
    region_id = st.sampled_from(region_ids) | small_ints | values
    token = st.sampled_from(tokens) | st.text(max_size=40) | values

    def column(ints):  # mostly packed int64s (of any count: it must match the keys'), or anything
        return st.lists(ints, max_size=6).map(protocol.pack_int64) | st.binary(max_size=24) | values

    return {
        "name": st.sampled_from(KNOWN_IIDS) | st.text(max_size=12) | values,
        "session": st.sampled_from(sessions) | st.text(max_size=12) | values,
        "pid": st.integers(-(2**63), 2**64 - 1) | values,
        "size": st.integers(-1, 1 << 40) | st.sampled_from(INT64_EDGES) | values,
        "region_id": region_id,
        "token": token,
        "region_ids": column(st.sampled_from(region_ids) | small_ints),
        "offsets": column(st.integers(-1, 4 * MiB) | st.sampled_from([0, 4096, 2 * MiB - 100])),
        "lengths": column(small_ints | st.integers(-1, 3 * MiB) | st.sampled_from([100, 4096])),
        "keys": st.lists(plain_keys, max_size=6) | st.lists(keys, max_size=6) | values,
        "lease": st.booleans() | values,
        "leases": st.lists(small_ints | values, max_size=4) | values,
        "bytes": st.integers(-1, 1 << 40) | st.sampled_from(INT64_EDGES) | values,
        "prefix": st.sampled_from(["k", b"k", ""]) | values,
        "owner": st.sampled_from(KNOWN_IIDS) | values,
    }


known_types = st.sampled_from([int(t) for t in MsgType])
msg_types = known_types | st.integers(0, 255)
request_ids = st.integers(0, 2**64 - 1)


def header(msg_type: int, request_id: int, *, version: int = PROTOCOL_VERSION, flags: int = 0):
    return HEADER.pack(MAGIC, version, msg_type, flags, request_id)


HUGE_LENGTH_BODIES = [
    b"\xdb\xff\xff\xff\xffabc",  # str32 claiming 4 GiB
    b"\xc6\xff\xff\xff\xff\x00",  # bin32
    b"\xdd\xff\xff\xff\xff\x01",  # array32
    b"\xdf\xff\xff\xff\xff\x01",  # map32
    b"\x81\xa4keys\xdd\x7f\xff\xff\xff",  # {"keys": array of 2**31 - 1 (absent) items}
    b"\x81\xa4keys\xdc\xff\xff" + b"\xa1k" * 10,  # array16 of 65535 with 10 present
    b"\x82\xa3iid\xa2fz\xa4keys\xdd\x00\x01\x00\x00",  # 65536 keys, none present
    b"\xc7\xff\x05",  # ext8 longer than the frame
]


def frames(region_ids: list[int], tokens: list[str], sessions: list[str]):
    fields = field_strategies(region_ids, tokens, sessions)
    structured = st.builds(
        lambda t, rid, body: header(t, rid) + msgpack.packb(body, use_bin_type=True),
        known_types,  # (unknown types are covered by the other shapes)
        request_ids,
        st.fixed_dictionaries({}, optional=fields),
    )
    any_body = st.builds(
        lambda t, rid, body: header(t, rid) + msgpack.packb(body, use_bin_type=True),
        msg_types,
        request_ids,
        values,
    )
    truncated = st.builds(lambda f, cut: f[: max(0, len(f) - cut)], structured, st.integers(1, 40))
    bad_header = st.builds(
        lambda v, t, fl, rid, tail: HEADER.pack(MAGIC, v, t, fl, rid) + tail,
        st.integers(0, 255),
        st.integers(0, 255),
        st.integers(0, 0xFFFF),
        request_ids,
        st.binary(max_size=32),
    )
    huge = st.builds(
        lambda t, rid, body: header(t, rid) + body,
        msg_types,
        request_ids,
        st.sampled_from(HUGE_LENGTH_BODIES),
    )
    malformed = st.one_of(any_body, truncated, bad_header, huge, st.binary(max_size=48))
    return structured, malformed


def check_reply(frame: bytes, reply: bytes) -> dict:
    """One well-formed reply, in the request's protocol version (a request of another version
    gets a BAD_VERSION error it can read); an error carries a known, non-INTERNAL code."""
    head = protocol.decode_header(reply)
    body = msgpack.unpackb(reply[HEADER.size :])
    assert head.flags & FLAG_REPLY
    if len(frame) >= HEADER.size and frame[:4] == MAGIC:
        assert head.request_id == HEADER.unpack_from(frame)[4]
        assert head.version == HEADER.unpack_from(frame)[1]
    if head.version != PROTOCOL_VERSION:
        assert body["code"] == ErrorCode.BAD_VERSION
    if body.get("ok") is not True:
        assert body["ok"] is False
        assert isinstance(body["error"], str) and body["error"]
        code = ErrorCode(body["code"])
        assert code != ErrorCode.INTERNAL, body["error"]
    return body


def consistent(reg: Registry) -> None:
    assert reg.live_bytes == sum(e.length for e in reg.keys.values())
    for rid, region in reg.regions.items():
        assert region.live_keys == sum(1 for e in reg.keys.values() if e.region_id == rid)
    assert reg.pool.used == sum(r.length for r in reg.regions.values())
    for entry in reg.keys.values():
        assert entry.leases == sum(lease.entries.count(entry) for lease in reg.leases.values())
        assert entry.pins >= 0
    for lease_id in (lid for inst in reg.instances.values() for lid in inst.leases):
        assert lease_id in reg.leases


# -- in process --------------------------------------------------------------------------------


class Target:
    def __init__(self, tmp_path):
        reg = Registry(ShmPool(str(tmp_path / "pool"), 64 * MiB), TokenSigner(b"f" * 32))
        self.service = MaruService(reg, "tcp://127.0.0.1:0", heartbeat_timeout=3600)
        self.sessions = []
        for iid in KNOWN_IIDS:
            reg.instances.handshake(iid, 1)
            self.sessions.append(reg.instances.open_session(iid))
        handle = reg.request_region("fz", 2 * MiB)
        rows = [[k, handle.region_id, i * 4096, 100] for i, k in enumerate(KNOWN_KEYS)]
        register(reg, "fz", rows)
        self.region_ids = [handle.region_id]
        self.tokens = [handle.token]
        self.replies = {"ok": 0, "error": 0}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    t = Target(tmp_path_factory.mktemp("fuzz"))
    yield t
    t.service.close()


def _fuzz_in_process(target: Target, which: int, max_examples: int):
    @settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(frame=frames(target.region_ids, target.tokens, target.sessions)[which])
    def run(frame):
        body = check_reply(frame, target.service.handle_frame(frame))
        target.replies["ok" if body.get("ok") else "error"] += 1
        consistent(target.service.registry)
        stats = target.service.handle_frame(protocol.encode(MsgType.STATS, 1, {}))
        assert protocol.decode(stats)[1]["ok"] is True

    run()


def test_fuzz_handle_frame_well_formed_frames_with_odd_fields(target):
    """Decodable frames of known types whose fields are plausible or of any type: these
    reach the handlers and the registry."""
    target.replies.update(ok=0, error=0)
    _fuzz_in_process(target, 0, 500)
    print(f"\nin-process fuzz (well-formed): {target.replies}")
    # both paths were exercised, and the service still does real work
    assert target.replies["ok"] > 0 and target.replies["error"] > 0
    svc = target.service
    reply = protocol.decode(svc.handle_frame(protocol.encode(MsgType.HANDSHAKE, 5, {"name": "z"})))
    assert reply[1]["ok"] is True


def test_fuzz_handle_frame_malformed_frames(target):
    """Garbage, truncated frames, bad headers and versions, huge declared lengths, bodies
    that are not maps."""
    target.replies.update(ok=0, error=0)
    _fuzz_in_process(target, 1, 250)
    print(f"\nin-process fuzz (malformed): {target.replies}")
    assert target.replies["error"] > 0
    svc = target.service
    reply = protocol.decode(svc.handle_frame(protocol.encode(MsgType.HANDSHAKE, 5, {"name": "z"})))
    assert reply[1]["ok"] is True


@pytest.mark.parametrize("body", HUGE_LENGTH_BODIES)
@pytest.mark.parametrize("msg_type", [MsgType.LOOKUP_KV, MsgType.REGISTER_KV, MsgType.STATS])
def test_huge_declared_lengths_are_bad_frames(target, msg_type, body):
    frame = header(msg_type, 9) + body
    reply = check_reply(frame, target.service.handle_frame(frame))
    assert reply["ok"] is False
    assert reply["code"] in (ErrorCode.BAD_FRAME, ErrorCode.BAD_REQUEST)


@pytest.mark.parametrize(
    "body",
    [
        {"name": "p", "pid": 1e300},  # would be int(1e300): not encodable in a STATS reply
        {"name": "p", "pid": float("inf")},
        {"name": "p", "pid": float("nan")},
        {"name": "p", "pid": "123"},
        {"name": "p", "pid": [1]},
        {"name": "p", "pid": -5},
    ],
)
def test_handshake_with_a_strange_pid_does_not_poison_stats(target, body):
    frame = protocol.encode(MsgType.HANDSHAKE, 3, body)
    check_reply(frame, target.service.handle_frame(frame))
    stats = protocol.decode(target.service.handle_frame(protocol.encode(MsgType.STATS, 4, {})))
    assert stats[1]["ok"] is True
    instances = stats[1]["stats"]["instances"]
    pids = [inst["pid"] for iid, inst in instances.items() if iid.startswith("p.")]
    assert pids and all(isinstance(pid, int) and 0 <= pid < 2**63 for pid in pids)


@pytest.mark.parametrize("session", [["a"], {"x": 1}, {"": None}, [[]], 1.5, "fz~00"])
@pytest.mark.parametrize(
    "msg_type", [MsgType.LOOKUP_KV, MsgType.PIN, MsgType.UNPIN, MsgType.HEARTBEAT]
)
def test_unhashable_or_odd_session_is_not_an_internal_error(target, msg_type, session):
    frame = protocol.encode(msg_type, 3, {"session": session, "keys": ["k0"], "lease": True})
    body = check_reply(frame, target.service.handle_frame(frame))
    if body["ok"] and "lease_id" in body:
        target.service.registry.leases.release([body["lease_id"]], None)


# -- against a live server -----------------------------------------------------------------------


class Dealer:
    def __init__(self, url: str):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(url)

    def exchange(self, parts: list[bytes], timeout_ms: int = 10_000) -> bytes:
        self.sock.send_multipart(parts)
        assert self.sock.poll(timeout_ms), "maru-server did not answer"
        reply = self.sock.recv_multipart()
        assert len(reply) == 1
        return reply[0]

    def close(self) -> None:
        self.sock.close(linger=0)


def _stats(dealer: Dealer) -> dict:
    body = protocol.decode(dealer.exchange([protocol.encode(MsgType.STATS, 1, {})]))[1]
    assert body["ok"] is True
    return body["stats"]


def test_fuzz_live_server(maru_server_factory, tmp_path):
    server = maru_server_factory(
        tmp_path / "srv",
        pool_size="64M",
        extra_args=["--heartbeat-timeout", "1.5", "--lease-timeout", "1"],
    )
    victim = MaruHandler(server_url=server.url, pool_size="4M", chunk_size_bytes=4096)
    dealer = Dealer(server.url)
    try:
        assert victim.batch_store(["v0", "v1", b"v2"], [b"a" * 5000, b"b" * 10, b"c" * 7])
        mine = victim.list_allocations()
        region_ids, tokens = [h.region_id for h in mine], [h.token for h in mine]
        counts = {"ok": 0, "error": 0, "frames": 0}
        sessions = []
        for iid in KNOWN_IIDS:  # so that some fuzzed requests act as a real instance
            reply = dealer.exchange([protocol.encode(MsgType.HANDSHAKE, 1, {"name": iid})])
            sessions.append(protocol.decode(reply)[1]["session"])

        structured, malformed = frames(region_ids, tokens, sessions)

        @settings(
            max_examples=150,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(frame=structured | structured | malformed, extra=st.integers(0, 9))
        def run(frame, extra):
            parts = [frame] if extra else [frame, frame[:3]]  # sometimes 2 parts: not ours
            reply = dealer.exchange(parts)
            body = check_reply(frame if extra else b"", reply)
            counts["ok" if body.get("ok") else "error"] += 1
            counts["frames"] += 1

        run()
        # an empty frame and a frame over the size limit
        check_reply(b"", dealer.exchange([b""]))
        big = header(MsgType.EXISTS, 77) + b"\x00" * protocol.MAX_FRAME_BYTES
        body = check_reply(big, dealer.exchange([big], timeout_ms=30_000))
        assert body["ok"] is False and body["code"] == ErrorCode.BAD_FRAME
        assert counts["frames"] >= 50 and counts["error"] > 0
        print(f"\nlive fuzz: {counts}")

        # the server is alive and answers valid requests
        assert server.alive()
        stats = _stats(dealer)
        # leases taken by fuzzed lookups expire; fuzz-created instances are reaped (they send
        # nothing more), which frees their regions; the victim (heart-beating) stays
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            stats = _stats(dealer)
            if stats["leases"] == 0 and set(stats["instances"]) == {victim.instance_id}:
                break
            time.sleep(0.2)
        assert stats["leases"] == 0
        assert set(stats["instances"]) == {victim.instance_id}
        listed = protocol.decode(
            dealer.exchange([protocol.encode(MsgType.LIST_ALLOCATIONS, 2, {})])
        )[1]["regions"]
        assert stats["pool"]["used"] == sum(r[3] for r in listed)
        assert stats["regions"] == len(listed)
        # the victim still works end to end
        assert victim.store("after-fuzz", b"z" * 3000)
        info = victim.retrieve("after-fuzz")
        assert info is not None and bytes(info.view) == b"z" * 3000
        log = server.read_log()
        assert "Traceback" not in log and "internal error" not in log
    finally:
        dealer.close()
        victim.close()


@pytest.mark.parametrize("value", [2**63, 2**64 - 1, 0, -1, True, 1.0])
@pytest.mark.parametrize(
    "msg_type, field",
    [
        (MsgType.EVICT_FOR, "bytes"),
        (MsgType.REQUEST_REGION, "size"),
        (MsgType.REQUEST_REGION, "min_size"),
    ],
)
def test_byte_counts_out_of_range_are_bad_requests_from_a_live_server(
    maru_server, msg_type, field, value
):
    """Issue 40, case 8: a byte count of 2**63 or more (EVICT_FOR's reached the C eviction
    walk: OverflowError, INTERNAL) is refused at the protocol edge with BAD_REQUEST naming
    the field; the largest int64 is served (nothing to evict; a region larger than the
    pool is POOL_FULL; a min_size above size asks for no more than size)."""
    dealer = Dealer(maru_server.url)
    try:
        reply = dealer.exchange([protocol.encode(MsgType.HANDSHAKE, 1, {"name": "edge"})])
        hello = protocol.decode(reply)[1]
        proof = prove(hello["pool"], None, hello["iid"]).proof  # (as a client proves the pool)
        body = {"session": hello["session"], "bytes": 4096, "size": 2 * MiB, field: value}
        body["pool_proof"] = proof
        frame = protocol.encode(msg_type, 2, body)
        answer = check_reply(frame, dealer.exchange([frame]))
        assert (answer["ok"], answer["code"]) == (False, ErrorCode.BAD_REQUEST)
        assert repr(field) in answer["error"]
        body[field] = 2**63 - 1
        frame = protocol.encode(msg_type, 3, body)
        answer = check_reply(frame, dealer.exchange([frame]))
        if field == "bytes":
            assert answer["ok"] is True and answer["freed_bytes"] == 0
        elif field == "size":
            assert answer["code"] == ErrorCode.POOL_FULL  # larger than the pool
        else:  # (a region of `size`: the least accepted is never more)
            assert answer["ok"] is True and answer["region"][3] == 2 * MiB
        assert "internal error" not in maru_server.read_log()
    finally:
        dealer.close()
