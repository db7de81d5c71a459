"""In-process `MaruService` for unit tests: frames go through `handle_frame`, no socket."""

from __future__ import annotations

from typing import Any

from maru.common import protocol
from maru.server.pool import ShmPool
from maru.server.registry import Registry
from maru.server.service import MaruService
from maru.server.token import TokenSigner

MiB = 1 << 20


def make_service(tmp_path, pool_mib: int = 16, registry: Registry | None = None) -> MaruService:
    if registry is None:
        registry = Registry(ShmPool(str(tmp_path / "pool"), pool_mib * MiB), TokenSigner(b"s" * 32))
    return MaruService(registry, "tcp://127.0.0.1:0")


def call(svc: MaruService, msg_type: int, body: dict[str, Any], request_id: int = 7) -> dict:
    """One request frame in, its reply out; the reply must echo the id and carry the flag."""
    header, reply = protocol.decode(svc.handle_frame(protocol.encode(msg_type, request_id, body)))
    assert header.request_id == request_id
    assert header.flags & protocol.FLAG_REPLY
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
