"""The RPC loop's handlers, one per message type, in the table `MaruService.handle_frame`
serves: each turns a decoded request body into a reply body (or raises `ProtocolError`).
A handler sees the service only as a `Server`; `maru.server.service` owns the loop, the
sockets and the authentication that puts the requester's instance into the body ("iid": None
for an anonymous request, an operator's or an unknown session's).
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Callable
from contextlib import AbstractContextManager, suppress
from typing import Any, Protocol

from maru.common import protocol
from maru.common.protocol import (
    CHECKSUMS,
    MAX_BATCH,
    MAX_LIST_KEYS,
    ErrorCode,
    MsgType,
    ProtocolError,
    RegisterStatus,
    all_keys_valid,
    check_count,
    check_key,
    unpack_int64,
)
from maru.server.cluster.tier import ClusterTier
from maru.server.grants import over_quota
from maru.server.housekeeping import Housekeeping
from maru.server.journal import JournalWriteError
from maru.server.local_socket import LocalSocketServer
from maru.server.registry import Registry, clear_all, delete_prefix, drop_corrupt, list_keys

log = logging.getLogger("maru.server.service")


class Walks(Protocol):
    def walk(self, what: str) -> AbstractContextManager[None]: ...


class Server(Protocol):
    """What a handler sees of `MaruService`."""

    registry: Registry
    epoch: str  # changes on every start: clients notice restarts
    new_instance_id: Callable[[str], str]
    housekeeper: Housekeeping
    local: LocalSocketServer | None
    coherence: str  # announced at HANDSHAKE (`--coherence`)
    walks: Walks  # time for requests that walk every key (`maru.server.service.WalkBudget`)
    cluster: ClusterTier | None  # `--cluster`: sealed keys go to its publish queue

    def stats(self) -> dict[str, Any]: ...


Handler = Callable[[Server, dict[str, Any]], dict[str, Any]]

# In a reply, not sent: (keys, their indices, seconds) an EXISTS waits for the tier's pulls
WAIT = "_wait"


# Requests that change what the journal keeps: refused (STATE_UNAVAILABLE, before any side
# effect) while the journal cannot be written. Reads, leases and heartbeats go on.
CHANGES = frozenset(
    {
        MsgType.REGISTER_KV,
        MsgType.DELETE_KV,
        MsgType.CORRUPT_KV,
        MsgType.DELETE_PREFIX,
        MsgType.PIN,
        MsgType.UNPIN,
        MsgType.REQUEST_REGION,
        MsgType.RETURN_REGION,
        MsgType.EVICT_FOR,
        MsgType.DISCONNECT,
    }
)


def _batch(body: dict[str, Any], name: str) -> list[Any]:
    """A list field of at most MAX_BATCH items."""
    items = body.get(name)
    if not isinstance(items, list):
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"field {name!r} missing or of the wrong type")
    if len(items) > MAX_BATCH:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"batch of {len(items)} exceeds {MAX_BATCH}")
    return items


def _keys(body: dict[str, Any]) -> list[Any]:
    """The "keys" of a request on existing keys. A bad key is a client bug: KEY_TOO_LONG or
    BAD_REQUEST (for the first bad key) rather than a silent miss."""
    keys = _batch(body, "keys")
    if not all_keys_valid(keys):
        for key in keys:
            check_key(key)
    return keys


def _flag(body: dict[str, Any], name: str) -> bool:
    """An optional true-or-false field (absent: false)."""
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"{name}: true or false")
    return value


def _region_tokens(body: dict[str, Any]) -> dict[int, str] | None:
    """REGISTER_KV's optional "tokens": [[region id, token], ...], the writer's regions as
    granted (None: absent, nothing checked)."""
    pairs = body.get("tokens")
    if pairs is None:
        return None
    if not isinstance(pairs, list) or len(pairs) > MAX_BATCH:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "tokens: a list of [region id, token]")
    tokens: dict[int, str] = {}
    for pair in pairs:
        if (
            not isinstance(pair, list)
            or len(pair) != 2
            or type(pair[0]) is not int
            or not isinstance(pair[1], str)
        ):
            raise ProtocolError(ErrorCode.BAD_REQUEST, "tokens: a list of [region id, token]")
        tokens[pair[0]] = pair[1]
    return tokens


def _owner(body: dict[str, Any]) -> str:
    """The instance of a request that only an instance may make (pins)."""
    iid = body["iid"]
    if iid is None:
        raise ProtocolError(ErrorCode.UNKNOWN_INSTANCE, "unknown session: handshake first")
    return iid


def _instance_name(name: Any) -> str:
    """A client's chosen name, as the start of its instance id: printable ASCII (ids go into
    credentials and log lines), at most 100 characters."""
    if not isinstance(name, str) or not name:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "field 'name' missing or not a string")
    return "".join(c if c.isascii() and c.isprintable() and c != "~" else "_" for c in name[:100])


def _new_instance_id(server: Server, name: str) -> str:
    """A new instance's id (`Server.new_instance_id`), never one the server has now (a live
    instance's, or one a restart restored): `InstanceTable.handshake` would attach the
    newcomer to that instance, its credential, its regions to write into, its pins and
    leases. (Drawn with 64 random bits, a repeat is not expected; one is drawn again.)"""
    iid = server.new_instance_id(name)
    while iid in server.registry.instances:
        log.warning("a new instance of %r drew the id of a live one (%s): drawn again", name, iid)
        iid = f"{name}.{secrets.token_hex(8)}"
    return iid


def on_handshake(server: Server, body: dict[str, Any]) -> dict[str, Any]:
    """Attach a process as an instance: the one its session credential names while this
    server still has it (a reconnect, or the first contact after a restart), else a new one
    whose id this server picks. A process never gets another's instance by choosing its
    name, nor one that ended (DISCONNECT, reaping): that credential resumes nothing again."""
    iid = server.registry.signer.session_owner(body.get("session"))
    if iid is not None and iid not in server.registry.instances:
        log.info("a credential of instance %s, which is gone: a new instance", iid)
        iid = None
    if iid is None:
        # (at most --max-instances; a full table reaps an instance that holds nothing and
        # sent no request for over a heartbeat interval, if one does)
        server.registry.instances.admit(_heartbeat_interval(server))
        iid = _new_instance_id(server, _instance_name(body.get("name")))
    pid = body.get("pid")
    if type(pid) is not int or not 0 <= pid < 2**63:
        pid = 0  # informational only; must stay encodable in STATS replies
    chunk = body.get("chunk_size")
    if type(chunk) is not int or not 0 < chunk < 2**40:
        chunk = 0
    regions = server.registry.instances.handshake(iid, pid, chunk)
    # The /dev/shm index only over the Unix socket, whose peer is surely on this node (a TCP
    # peer, even via 127.0.0.1, may not be); the in-pool index on every socket: the client
    # proves that pool memory by its mark before it maps anything.
    index = server.registry.local_index
    local = index is not None and body.get("via_local") is True
    return {
        "iid": iid,
        "session": server.registry.instances.open_session(iid),
        "epoch": server.epoch,
        "version": protocol.PROTOCOL_VERSION,
        "pool": server.registry.pool.handshake_fields(body.get("nonce")),
        "regions": [h.to_wire() for h in regions],
        "heartbeat_interval": _heartbeat_interval(server),
        "local_socket": server.local.address if server.local is not None else None,
        "uid": os.getuid(),
        "local_index": index.path if local else None,
        "pool_index": index.offer() if index is not None else None,
        "coherence": server.coherence,
        "cluster": server.cluster.announce() if server.cluster is not None else None,
    }


def _heartbeat_interval(server: Server) -> float:
    """How often clients beat (told at HANDSHAKE): three beats to a --heartbeat-timeout."""
    return server.housekeeper.heartbeat_timeout / 3


def on_heartbeat(server: Server, body: dict[str, Any]) -> dict[str, Any]:
    """A sign of life (`InstanceTable.touch` marks no use for it); one that reports reads the
    client answered from the local index (`_count_local_reads`) is a sign of use too
    (`InstanceTable.beat`)."""
    _count_local_reads(server, body)
    reads = body.get("local_reads")
    server.registry.instances.beat(body["iid"], bool(reads and (reads[0] or reads[2])))
    return {}


def on_request_region(server: Server, body: dict[str, Any]) -> dict[str, Any]:
    """A writable region, only for an instance that proves it reads the pool (its
    `pool_proof`): anyone else could register keys over bytes it never wrote."""
    least, ahead = body.get("min_size"), body.get("ahead", False)
    if not isinstance(ahead, bool):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "ahead: true or false")
    reg = server.registry
    iid = _owner(body)
    if not reg.pool.proven(iid, body.get("pool_proof")):
        held = reg.log_throttle.allow(("unproven", iid))
        if held is not None:
            log.warning(
                "instance %s asked for a region without proving it reads the pool (pid %s): "
                "refused%s",
                iid,
                reg.instances.require(iid).pid,
                reg.log_throttle.note(held),
            )
        raise ProtocolError(
            ErrorCode.NOT_AUTHORIZED,
            "no region for a process that has not proven it reads the pool: REQUEST_REGION's "
            "pool_proof (from the pool key in the pool's mark) is missing or wrong; only a "
            "process that maps the pool may write to it",
        )
    handle = reg.request_region(iid, body.get("size"), least, reclaim=not ahead)
    return {"region": handle.to_wire()}


def on_park_regions(server: Server, body: dict[str, Any]) -> dict[str, Any]:
    unparked, gone = server.registry.park(
        body["iid"], body.get("seq"), _batch(body, "park"), _batch(body, "unpark")
    )
    return {"unparked": unparked, "gone": gone}


def on_return_region(server: Server, body: dict[str, Any]) -> dict[str, Any]:
    server.registry.return_region(body["iid"], body.get("region_id"), body.get("token"))
    return {}


def _count_local_reads(server: Server, body: dict[str, Any]) -> None:
    """HEARTBEAT and DISCONNECT may carry the reads the client answered from the local
    index: [lookups, hits, exists, exists hits], each 0 <= hits <= its total."""
    reads = body.get("local_reads")
    if reads is None:
        return
    if (
        not isinstance(reads, list)
        or len(reads) != 4
        or not all(type(n) is int and 0 <= n < 1 << 48 for n in reads)
        or reads[1] > reads[0]
        or reads[3] > reads[2]
    ):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "local_reads: four counts, hits <= total")
    lookups, hits, exists, exists_hits = reads
    server.registry.count_reads(body["iid"], lookups, hits, exists, exists_hits)


def on_disconnect(server: Server, body: dict[str, Any]) -> dict[str, Any]:
    _count_local_reads(server, body)
    pins, leases, regions = server.registry.instances.disconnect(
        _owner(body), "disconnected by its client"
    )
    return {"pins": pins, "leases": leases, "regions": regions}


def on_region_access(server: Server, body: dict[str, Any]) -> dict[str, Any]:
    region = server.registry.regions.verified(body.get("region_id"), body.get("token"))
    return {"region": region.handle().to_wire()}


def on_register_kv(server: Server, body: dict[str, Any]) -> dict[str, Any]:
    """A bad key is REJECTED (not an error): the rest of the batch is registered. With
    "ahead" (a full writer's room for its next writes, asked with its seal rather than in an
    EVICT_FOR of its own), that many bytes are evicted in its regions first, as
    `Eviction.evict_for` evicts room ahead, so never the keys being sealed; their pages reach
    it as this reply's `freed`."""
    iid = body["iid"]
    keys = _batch(body, "keys")
    ahead = body.get("ahead", 0)
    if type(ahead) is not int or ahead:  # (checked before any change; 0: none)
        check_count(ahead, "ahead")
    region_ids, offsets, lengths = (
        unpack_int64(body.get(name), len(keys), name).tolist()
        for name in ("region_ids", "offsets", "lengths")
    )
    checksums = body.get(CHECKSUMS)  # optional: the writer's checksum of each value
    if checksums is not None:
        checksums = unpack_int64(checksums, len(keys), CHECKSUMS).tolist()
    tokens = _region_tokens(body)
    if ahead:
        # An eviction that cannot be journaled changed nothing; the seal then needs the same
        # journal, and is refused or goes on as it can be written.
        with suppress(JournalWriteError):
            server.registry.eviction.evict_for(iid, ahead, ahead)
    results = server.registry.register(iid, keys, region_ids, offsets, lengths, checksums, tokens)
    if server.cluster is not None:
        server.cluster.sealed(keys, results, RegisterStatus.REGISTERED)
    return {"results": results}


def on_lookup_kv(server: Server, body: dict[str, Any]) -> dict[str, Any]:
    """The columns are bytes of native int64s (client and server share the node), read by
    the client with numpy, no Python int per key; the lease is taken in the same pass."""
    region_ids, offsets, lengths, checksums, regions, lease_id = server.registry.lookup(
        _keys(body), body["iid"], body.get("lease") is True
    )
    return {
        "region_ids": region_ids,
        "offsets": offsets,
        "lengths": lengths,
        CHECKSUMS: checksums,
        "regions": [h.to_wire() for h in regions],
        "lease_id": lease_id,
    }


def on_exists(server: Server, body: dict[str, Any]) -> dict[str, Any]:
    """With "pull" (after a miss, on a server with a cluster tier): the misses the cluster may
    hold are pulled, "pulling" saying how many are on their way. With "wait_ms" too, the reply
    waits (`maru.server.cluster.waits`) until none is; without, the client asks again."""
    keys = _keys(body)
    results = server.registry.exists(keys, body["iid"])
    reply: dict[str, Any] = {"results": results, "pulling": 0}
    if body.get("pull") is True and server.cluster is not None and not all(results):
        index = [i for i, hit in enumerate(results) if not hit]
        missing = [keys[i] for i in index]
        reply["pulling"] = server.cluster.want(missing)
        wait_ms = body.get("wait_ms")
        if reply["pulling"] and type(wait_ms) is int and wait_ms > 0:
            wait_s = min(wait_ms, server.cluster.lookup_ms) / 1000
            reply[WAIT] = (missing, index, wait_s)
    return reply


def on_evict_for(server: Server, body: dict[str, Any]) -> dict[str, Any]:
    eviction = server.registry.eviction
    freed = eviction.evict_for(body["iid"], body.get("bytes"), body.get("ahead", 0))
    return {"freed_bytes": freed}


def on_pin(server: Server, body: dict[str, Any]) -> dict[str, Any]:
    """PIN, for at most `Pins.max_keys` keys and `Pins.max_bytes` bytes of one instance at
    once (a pinned key is never evicted), checked in one pass (`Pins.admit`)."""
    keys, iid, reg = _keys(body), _owner(body), server.registry
    pins, leading = reg.pins, _flag(body, "leading")
    over = pins.admit(keys, iid, leading)
    if over is not None:
        unit, held, asked, most = over
        what = f"pinned {unit} ({asked} more asked)"
        raise over_quota(reg.log_throttle, reg.instances[iid], what, held, most)
    return {"results": pins.pin(keys, iid, leading)}


def on_delete_prefix(server: Server, body: dict[str, Any]) -> dict[str, Any]:
    """The pool's keys of a prefix (or every key); with "cluster", the cluster tier's objects
    of them too, sent to its sidecar and not waited for (`ClusterTier.clear`): the reply's
    "cluster" says whether that removal was sent."""
    cluster = _flag(body, "cluster")
    prefix = None
    if body.get("all") is True:  # `maru clear`
        with server.walks.walk("DELETE_PREFIX"):
            deleted, pinned = clear_all(server.registry)
        what = "every key"
    else:
        prefix = body.get("prefix")
        if cluster:  # (a prefix no longer than a key: the regex Mooncake compiles stays small)
            check_key(prefix)
        with server.walks.walk("DELETE_PREFIX"):
            deleted, pinned = delete_prefix(server.registry, prefix)
        what = f"prefix {prefix!r:.200}"
    iid = body["iid"]
    log.info(
        "%d keys deleted (%s, by %s); %d pinned or leased kept",
        deleted,
        what,
        f"instance {iid}" if iid else "an operator",
        pinned,
        extra={"instance": iid} if iid else None,
    )
    sent = False
    if cluster and server.cluster is not None:
        sent = server.cluster.clear(prefix)
    elif cluster:
        log.info("%s: not removed from a cluster: this server has no tier (--cluster)", what)
    return {"deleted": deleted, "pinned": pinned, "cluster": sent}


def on_corrupt_kv(server: Server, body: dict[str, Any]) -> dict[str, Any]:
    """A reader's checksum mismatches: each key dropped if still the entry it read."""
    keys = _keys(body)
    columns = [
        unpack_int64(body.get(name), len(keys), name).tolist()
        for name in ("region_ids", "offsets", "lengths", CHECKSUMS)
    ]
    places = list(zip(*columns))
    reporter = body["iid"] or "an anonymous reader"
    return {"results": drop_corrupt(server.registry, keys, places, reporter)}


def on_list_keys(server: Server, body: dict[str, Any]) -> dict[str, Any]:
    limit = body.get("limit", 100)
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "limit must be a positive integer")
    limit = min(limit, MAX_LIST_KEYS)
    with server.walks.walk("KEYS"):
        keys, truncated = list_keys(server.registry, body.get("prefix"), limit)
    return {"keys": keys, "truncated": truncated, "limit": limit}


def on_list_allocations(server: Server, body: dict[str, Any]) -> dict[str, Any]:
    owner, from_id = body.get("owner"), body.get("from_id", 0)
    if type(from_id) is not int:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "from_id must be an integer")
    handles = server.registry.regions.handles(owner if isinstance(owner, str) else None)
    return {"regions": [h.to_wire() for h in handles if h.region_id >= from_id]}


HANDLERS: dict[int, Handler] = {
    MsgType.HANDSHAKE: on_handshake,
    MsgType.REQUEST_REGION: on_request_region,
    MsgType.RETURN_REGION: on_return_region,
    MsgType.REGION_ACCESS: on_region_access,
    MsgType.REGISTER_KV: on_register_kv,
    MsgType.LOOKUP_KV: on_lookup_kv,
    MsgType.EXISTS: on_exists,
    MsgType.PIN: on_pin,
    MsgType.UNPIN: lambda s, b: {"results": s.registry.pins.unpin(_keys(b), _owner(b))},
    MsgType.RELEASE: lambda s, b: {
        "released": s.registry.leases.release(_batch(b, "leases"), b["iid"])
    },
    MsgType.EVICT_FOR: on_evict_for,
    MsgType.DELETE_KV: lambda s, b: {"results": s.registry.delete(_keys(b))},
    MsgType.CORRUPT_KV: on_corrupt_kv,
    MsgType.LIST_ALLOCATIONS: on_list_allocations,
    MsgType.STATS: lambda s, b: {"stats": s.stats()},
    MsgType.HEARTBEAT: on_heartbeat,
    MsgType.DELETE_PREFIX: on_delete_prefix,
    MsgType.KEYS: on_list_keys,
    MsgType.DISCONNECT: on_disconnect,
    MsgType.PARK_REGIONS: on_park_regions,
}
