"""The RPC loop: one ROUTER socket, one thread, one request at a time.

Every frame gets a reply, even garbage: a malformed frame, an unknown version or type, or a
handler bug produces an error reply and the loop carries on. The loop never touches page bytes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from maru import protocol
from maru.protocol import MAX_BATCH, MAX_KEY_BYTES, ErrorCode, MsgType, ProtocolError
from maru.server.journal import Journal
from maru.server.registry import Registry, check_key

log = logging.getLogger(__name__)

Handler = Callable[[dict[str, Any]], dict[str, Any]]


def _field(body: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    value = body.get(name)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"field {name!r} missing or of the wrong type")
    return value


def _keys(body: dict[str, Any], name: str = "keys") -> list[Any]:
    keys = _field(body, name, list)
    if len(keys) > MAX_BATCH:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"batch of {len(keys)} exceeds {MAX_BATCH}")
    if name == "keys":
        # An oversized or mistyped key is a client bug: answer KEY_TOO_LONG / BAD_REQUEST
        # rather than a silent miss. (Fast path: a short str/bytes cannot be too long.)
        for key in keys:
            if not (isinstance(key, (str, bytes)) and len(key) <= MAX_KEY_BYTES // 4):
                check_key(key)
    return keys


class MaruService:
    def __init__(
        self,
        registry: Registry,
        bind_url: str,
        *,
        journal: Journal | None = None,
        heartbeat_timeout: float = 15.0,
    ):
        self.registry = registry
        self.bind_url = bind_url
        self.journal = journal
        self.heartbeat_timeout = heartbeat_timeout
        self._next_reap = 0.0
        self.epoch = f"{time.time_ns():x}"  # changes on every start: clients notice restarts
        self._stop = threading.Event()
        self.op_stats: dict[str, list[float]] = {}  # name -> [count, total seconds]
        self._handlers: dict[int, Handler] = {
            MsgType.HANDSHAKE: self._handshake,
            MsgType.REQUEST_REGION: self._request_region,
            MsgType.RETURN_REGION: self._return_region,
            MsgType.REGION_ACCESS: self._region_access,
            MsgType.REGISTER_KV: self._register_kv,
            MsgType.LOOKUP_KV: self._lookup_kv,
            MsgType.EXISTS: self._exists,
            MsgType.PIN: lambda b: {"results": self.registry.pin(_keys(b), b.get("iid"))},
            MsgType.UNPIN: lambda b: {"results": self.registry.unpin(_keys(b), b.get("iid"))},
            MsgType.RELEASE: lambda b: {"released": self.registry.release(_keys(b, "leases"))},
            MsgType.EVICT_FOR: self._evict_for,
            MsgType.DELETE_KV: lambda b: {
                "results": [int(s) for s in self.registry.delete(_keys(b))]
            },
            MsgType.LIST_ALLOCATIONS: self._list_allocations,
            MsgType.STATS: self._stats,
            MsgType.HEARTBEAT: lambda b: {},
            MsgType.DELETE_PREFIX: self._delete_prefix,
        }
        self.context = zmq.Context.instance()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.socket.bind(bind_url)
        self.endpoint = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)

    # -- handlers ----------------------------------------------------------------------------

    def _handshake(self, body: dict[str, Any]) -> dict[str, Any]:
        iid = _field(body, "iid", str)
        regions = self.registry.handshake(iid, int(body.get("pid") or 0))
        return {
            "epoch": self.epoch,
            "version": protocol.PROTOCOL_VERSION,
            "pool": self.registry.pool.stats(),
            "regions": [h.to_wire() for h in regions],
            "heartbeat_interval": self.heartbeat_timeout / 3,
        }

    def _request_region(self, body: dict[str, Any]) -> dict[str, Any]:
        handle = self.registry.request_region(_field(body, "iid", str), _field(body, "size", int))
        return {"region": handle.to_wire()}

    def _return_region(self, body: dict[str, Any]) -> dict[str, Any]:
        self.registry.return_region(
            _field(body, "iid", str), body.get("region_id"), body.get("token")
        )
        return {}

    def _region_access(self, body: dict[str, Any]) -> dict[str, Any]:
        handle = self.registry.region_access(body.get("region_id"), body.get("token"))
        return {"region": handle.to_wire()}

    def _register_kv(self, body: dict[str, Any]) -> dict[str, Any]:
        entries = _keys(body, "entries")
        statuses = self.registry.register(_field(body, "iid", str), entries)
        return {"results": [int(s) for s in statuses]}

    def _lookup_kv(self, body: dict[str, Any]) -> dict[str, Any]:
        keys = _keys(body)
        locations, regions = self.registry.lookup(keys, body.get("iid"))
        reply = {"locations": locations, "regions": [h.to_wire() for h in regions]}
        if body.get("lease"):
            reply["lease_id"] = self.registry.lease(keys, body.get("iid"))
        return reply

    def _evict_for(self, body: dict[str, Any]) -> dict[str, Any]:
        freed = self.registry.evict_for(_field(body, "iid", str), _field(body, "bytes", int))
        return {"freed_bytes": freed}

    def _delete_prefix(self, body: dict[str, Any]) -> dict[str, Any]:
        deleted, pinned = self.registry.delete_prefix(body.get("prefix"))
        return {"deleted": deleted, "pinned": pinned}

    def _exists(self, body: dict[str, Any]) -> dict[str, Any]:
        return {"results": self.registry.exists(_keys(body))}

    def _list_allocations(self, body: dict[str, Any]) -> dict[str, Any]:
        owner = body.get("owner")
        handles = self.registry.list_allocations(owner if isinstance(owner, str) else None)
        return {"regions": [h.to_wire() for h in handles]}

    def _stats(self, body: dict[str, Any]) -> dict[str, Any]:
        stats = self.registry.stats()
        stats["epoch"] = self.epoch
        stats["operations"] = {
            name: {"count": int(c), "total_seconds": t} for name, (c, t) in self.op_stats.items()
        }
        return {"stats": stats}

    # -- loop --------------------------------------------------------------------------------

    def handle_frame(self, frame: bytes) -> bytes:
        """Turn one request frame into one reply frame. Never raises."""
        msg_type, request_id = 0, 0
        try:
            header = protocol.decode_header(frame)
            msg_type, request_id = header.msg_type, header.request_id
            _, body = protocol.decode(frame)
            handler = self._handlers.get(msg_type)
            if handler is None:
                raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"unknown message type {msg_type}")
            start = time.perf_counter()
            reply = handler(body)
            name = MsgType(msg_type).name.lower()
            stat = self.op_stats.setdefault(name, [0, 0.0])
            stat[0] += 1
            stat[1] += time.perf_counter() - start
            reply["ok"] = True
            freed = self.registry.take_freed(body.get("iid"))
            if freed:
                reply["freed"] = freed
            return protocol.encode(msg_type, request_id, reply, reply=True)
        except ProtocolError as exc:
            log.debug("request error (%s): %s", exc.code.name, exc)
            return protocol.encode_error(msg_type, request_id, exc.code, str(exc))
        except Exception as exc:
            log.exception("internal error handling message type %s", msg_type)
            return protocol.encode_error(
                msg_type, request_id, ErrorCode.INTERNAL, f"internal server error: {exc}"
            )

    def serve_forever(self, poll_ms: int = 200) -> None:
        log.info(
            "maru-server listening on %s (pool %s, %d bytes)",
            self.endpoint,
            self.registry.pool.name,
            self.registry.pool.capacity,
        )
        sock = self.socket
        while not self._stop.is_set():
            ready = sock.poll(poll_ms, zmq.POLLIN)
            self.housekeeping()
            if not ready:
                continue
            while True:
                try:
                    parts = sock.recv_multipart(zmq.NOBLOCK, copy=True)
                except zmq.Again:
                    break
                if len(parts) != 2:
                    # A DEALER sends exactly one frame; anything else is not ours to parse.
                    reply = protocol.encode_error(
                        0, 0, ErrorCode.BAD_FRAME, f"expected 1 frame, got {len(parts) - 1}"
                    )
                else:
                    reply = self.handle_frame(parts[1])
                try:
                    sock.send_multipart([parts[0], reply], zmq.NOBLOCK)
                except zmq.ZMQError as exc:  # peer vanished; nothing to do
                    log.debug("reply dropped: %s", exc)
        log.info("maru-server stopping")

    def housekeeping(self, now: float | None = None) -> None:
        """Between requests: expire read leases, reap silent instances, fsync the journal
        (batched), and snapshot it when it has grown."""
        now = time.monotonic() if now is None else now
        self.registry.expire_leases(now)
        if now >= self._next_reap:
            self.registry.reap(self.heartbeat_timeout, now)
            self._next_reap = now + min(1.0, self.heartbeat_timeout / 4)
        if self.journal is not None:
            self.journal.sync()
            if self.journal.needs_snapshot:
                self.journal.write_snapshot(self.registry.snapshot_state())

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        self.socket.close(linger=0)
        if self.journal is not None:
            self.journal.close()
