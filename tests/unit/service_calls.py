"""In-process `MaruService` for unit tests: frames go through `handle_frame`, no socket."""

from __future__ import annotations

import weakref
from typing import Any

from maru.client.poolpath import prove
from maru.common import protocol
from maru.common.protocol import ErrorCode, MsgType
from maru.server.local_socket import Peer
from maru.server.pool import ShmPool
from maru.server.registry import Registry
from maru.server.service import MaruService
from maru.server.token import TokenSigner

MiB = 1 << 20
PAGE = 4096


def make_service(tmp_path, pool_mib: int = 16, registry: Registry | None = None) -> MaruService:
    """A service whose instance ids are the names tests give them (a real server appends a
    random suffix to each)."""
    if registry is None:
        registry = Registry(ShmPool(str(tmp_path / "pool"), pool_mib * MiB), TokenSigner(b"s" * 32))
    svc = MaruService(registry, "tcp://127.0.0.1:0")
    svc.new_instance_id = str
    return svc


# Tests name instances ("iid": "A"); the server names them itself and authenticates each
# request by its session credential. `call` keeps, per service, the session of each name's
# last HANDSHAKE and sends it in the name's place (a name never handshaken: no session, an
# anonymous request), and with a REQUEST_REGION that names none, the pool proof the handshake's
# instance makes as a client does (`prove`: from the pool's mark).
_sessions: weakref.WeakKeyDictionary[MaruService, dict[Any, str]] = weakref.WeakKeyDictionary()
_proofs: weakref.WeakKeyDictionary[MaruService, dict[Any, str]] = weakref.WeakKeyDictionary()


def wire_body(svc: MaruService, msg_type: int, body: dict[str, Any]) -> dict[str, Any]:
    """`body` as the client sends it: "iid" (a test's name for an instance) replaced by the
    name (HANDSHAKE) and the session credential of that name's last handshake, if any."""
    body = dict(body)
    name = body.pop("iid", None)
    if msg_type == protocol.MsgType.HANDSHAKE:
        body["name"] = name
    session = _sessions.setdefault(svc, {}).get(name)
    if session is not None:
        body["session"] = session
    if msg_type == protocol.MsgType.REQUEST_REGION and "pool_proof" not in body:
        body["pool_proof"] = _proofs.setdefault(svc, {}).get(name, "")
    return body


def proof_of(svc: MaruService, instance_id: str) -> str:
    """The pool proof instance `instance_id` makes as a client does: from the pool's mark, read
    where the handshake says (`prove`)."""
    return prove(svc.registry.pool.handshake_fields(), None, instance_id).proof


def call(svc: MaruService, msg_type: int, body: dict[str, Any], request_id: int = 7) -> dict:
    """One request frame in, its reply out; the reply must echo the id and carry the flag."""
    wire = wire_body(svc, msg_type, body)
    header, reply = protocol.decode(svc.handle_frame(protocol.encode(msg_type, request_id, wire)))
    assert header.request_id == request_id
    assert header.flags & protocol.FLAG_REPLY
    if msg_type == protocol.MsgType.HANDSHAKE and reply.get("ok"):
        _sessions[svc][body.get("iid")] = reply["session"]
        _proofs.setdefault(svc, {})[body.get("iid")] = proof_of(svc, reply["iid"])
    return reply


def ok(svc: MaruService, msg_type: int, body: dict[str, Any]) -> dict:
    reply = call(svc, msg_type, body)
    assert reply["ok"], reply
    return reply


def register_body(iid: str, rows: list[list[Any]]) -> dict[str, Any]:
    """A REGISTER_KV request of one [key, region_id, offset, length] row per key."""
    keys, region_ids, offsets, lengths = (list(c) for c in zip(*rows)) if rows else ([],) * 4
    return {
        "iid": iid,
        "keys": keys,
        "region_ids": protocol.pack_int64(region_ids),
        "offsets": protocol.pack_int64(offsets),
        "lengths": protocol.pack_int64(lengths),
    }


def locations(reply: dict[str, Any]) -> list[list[int] | None]:
    """A LOOKUP_KV reply's columns as one [region_id, offset, length] per key, None for a miss."""
    columns = (
        memoryview(reply[name]).cast("q").tolist() for name in ("region_ids", "offsets", "lengths")
    )
    return [[r, o, n] if r else None for r, o, n in zip(*columns)]


def refused(svc, msg_type, body) -> str:
    """The error of a request that must be refused with QUOTA_EXCEEDED."""
    reply = call(svc, msg_type, body)
    assert reply["ok"] is False, reply
    assert reply["code"] == ErrorCode.QUOTA_EXCEEDED, reply
    return reply["error"]


def on_peer(svc, peer: Peer, msg_type, body) -> dict:
    """One request on a local-socket connection (`peer`), as `call` sends it."""
    frame = protocol.encode(msg_type, 9, wire_body(svc, msg_type, body))
    return protocol.decode(svc.handle_frame(frame, peer))[1]


def page_keys(svc, iid: str, pages: list[int]) -> list[str]:
    """Keys registered by `iid` in a region of its own, key i `pages[i]` pages long."""
    rid = ok(svc, MsgType.REQUEST_REGION, {"iid": iid, "size": 16 * MiB})["region"][0]
    keys, rows, at = [], [], 0
    for i, n in enumerate(pages):
        keys.append(f"{iid}-{i}")
        rows.append([keys[-1], rid, at, n * PAGE])
        at += n * PAGE
    assert ok(svc, MsgType.REGISTER_KV, register_body(iid, rows))["results"] == [0] * len(keys)
    return keys
