"""`MaruHandler`: one inference instance's client of the Maru store.

The API is the object lifecycle in Arrow Plasma's verbs (docs/architecture.md): reserve
(`alloc`), write (into `handle.buf`), seal (`seal`), get (`lookup`), release
(`Lookup.release`), delete (`batch_delete`). `store`, `retrieve`, `exists`, `pin`... put them
together (`maru.client.conveniences`); `put` and `read` / `read_many` are the data path's
verbs (`maru.client.writes`, `reads`).
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import suppress
from typing import Any

import numpy as np

from maru.client.chunks import AllocHandle, ChunkBook
from maru.client.cluster import ClusterPulls
from maru.client.coherence import Coherence, software, write_back_handles
from maru.client.connecting import connect_failure, probe
from maru.client.conveniences import OriginalApi
from maru.client.localindex import LocalIndexClient, Prefix, joined, offered_index
from maru.client.mapping import RegionMapper
from maru.client.poolpath import prove_or_refuse
from maru.client.reads import Segment, copy_and_prove
from maru.client.requests import Lookup, MemoryInfo, RegionsLost
from maru.client.rpc import FORKS, PendingReply, RpcClient
from maru.client.session import Session
from maru.client.supply import RegionSupply
from maru.client.writes import Put, Sealing, StoreOutcome, Writes, refuse_bad_stores
from maru.common.config import MaruConfig
from maru.common.errors import (
    MaruConnectError,
    MaruConnectRefused,
    MaruError,
    MaruForkedError,
    MaruNotConnected,
    MaruServerError,
)
from maru.common.memcopy import CopyFaultError, copy_values, guard_faults
from maru.common.protocol import ErrorCode, Key, MsgType, check_key_batch

log = logging.getLogger(__name__)

# How often, between beats, an instance that maps every region (`eager_map`) looks at the
# local index's count of regions made: a reader maps and populates another instance's new
# region within this, before its first read of it (the look costs one load, no request).
WATCH_S = 0.25

__all__ = ["AllocHandle", "MaruHandler", "MemoryInfo", "StoreOutcome"]


class _Heartbeat:
    """Beats even when idle (a silent instance is reaped after --heartbeat-timeout: its pins,
    leases and regions released), and parks idle regions (`RegionSupply.tick`). Between beats
    it calls `watch` every WATCH_S (`MaruHandler._watch_regions`: no request unless the local
    index says a region was made)."""

    def __init__(self, send: Callable[[], Any], name: str, watch: Callable[[], Any]):
        self.interval = 5.0  # the server says how often, at handshake
        self._send, self._name, self._watch = send, name, watch
        self._stop = threading.Event()
        self._now = threading.Event()  # `wake`: beat now, not at the end of the interval
        self._thread: threading.Thread | None = None

    def wake(self) -> None:
        self._now.set()

    def start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._now.clear()
            self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        next_beat = time.monotonic() + self.interval
        while True:
            woken = self._now.wait(max(0.0, min(next_beat - time.monotonic(), WATCH_S)))
            self._now.clear()
            if self._stop.is_set():
                return
            beat = woken or time.monotonic() >= next_beat
            try:
                if beat:
                    next_beat = time.monotonic() + self.interval
                    self._send()
                else:
                    self._watch()
            except MaruError as exc:
                log.debug("%s failed: %s", "heartbeat" if beat else "region watch", exc)
            except Exception:  # (a bug: never let it end the beats, the instance would be reaped)
                log.exception("%s failed", "heartbeat" if beat else "region watch")

    def stop(self, timeout: float) -> None:
        self._stop.set()
        self._now.set()
        if self._thread is not None:
            self._thread.join(timeout)


class MaruHandler(OriginalApi):
    def __init__(self, config: MaruConfig | None = None, **overrides: Any):
        if config is None:
            config = MaruConfig(**overrides)
        elif overrides:
            raise TypeError("pass either a MaruConfig or keyword overrides, not both")
        self._mapper = RegionMapper(populate=config.eager_map)  # (pages mapped in bulk)
        self._copying = self._mapper.copying()  # (`copying()`, kept: every read enters it)
        self._chunks = ChunkBook(config.chunk_size_bytes)
        self._rehandshake = threading.Lock()  # one re-handshake for all threads at a time
        self._rpc = RpcClient(
            config.server_url,
            timeout_ms=config.timeout_ms,
            max_inflight=config.max_inflight if config.use_async_rpc else 1,
            reply_hook=self._on_reply,
            on_unknown_instance=self._on_unknown_instance,
            busy_poll_us=config.busy_poll_us,
            server_public_key=config.server_public_key,
            client_secret_key=config.curve_client_key,
        )
        # what the helpers share of us; its `request` adds the instance's session credential

        self._s = Session(config, self._rpc.request, self._chunks, self._mapper)
        guard_faults()  # (a faulthandler enabled since import would see the pool's faults first)
        self._connected = False
        self._closed = False  # close() was called (then "Not connected" says so)
        self.connect_error: MaruConnectError | None = None  # why the last connect() failed
        self._supply = RegionSupply(self._s, self._rpc.request)
        self._writes = Writes(self._s, self._supply)
        self._index: LocalIndexClient | None = None  # the server's, on its node (handshake)
        self._coherence = Coherence(config.coherence)  # agreed at each handshake
        self._cluster = ClusterPulls(self._request, self._per_key)  # a tier behind the pool
        self._heartbeat = _Heartbeat(
            self._beat, f"maru-heartbeat-{self.instance_id[:8]}", self._watch_regions
        )
        if config.auto_connect:
            self.connect()

    # -- connection --------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self._connected

    @property
    def coherence(self) -> str | None:
        """The coherence mode agreed with the server ("hardware" or "software"; None before
        the first handshake)."""
        return self._coherence.mode

    @property
    def reads_locally(self) -> bool:
        """Whether reads go through the server's shared-memory index (no request), as on the
        server's node; they still fall back to requests key by key where it cannot answer."""
        return self._index is not None

    def connect(self) -> bool:
        """Handshake (no region taken: it succeeds on a full pool). False on failure, with one
        WARNING and `connect_error` saying why (`MaruServerDown`, `MaruConnectRefused`,
        `MaruVersionMismatch`); a refused TCP connection fails at once, not after `timeout_ms`."""
        try:
            probe(self.config.server_url, self.config.timeout_ms)
            self._handshake()
            if self.config.eager_map:  # every region of the pool, mapped now
                self._s.map_new_regions(self._supply.pool_generation)
            if self.config.ready_at_connect:  # our share, taken and populated meanwhile
                self._supply.ready(self.config.pool_size)
        except MaruError as exc:
            self.connect_error = connect_failure(self.config.server_url, exc)
            log.warning("%s", self.connect_error)
            self._connected = False
            return False
        self.connect_error = None
        self._connected = True
        self._heartbeat.start()
        return True

    def close(self) -> None:
        """DISCONNECT (pins and leases end, regions go back, keys stay readable), then unmap.
        In a child forked after the handler was made only its socket copies close: the
        instance, threads and locks are the parent's (one may have been held at the fork)."""
        self._closed = True
        if self._rpc.forked():
            self._connected, self._rpc.session = False, None
            self._rpc.close()
            return
        self._heartbeat.stop(timeout=self.config.timeout_ms / 1000 + 1)
        connected, self._connected = self._connected, False  # (no write starts from here on)
        # A copy another thread still runs writes into our regions: DISCONNECT frees an
        # empty one at once, and another instance's values would take its pages.
        if connected and not self._mapper.wait_copies(self._mapper.close_wait_s):
            log.warning(
                "closing with copies still in flight after %.1f s", self._mapper.close_wait_s
            )
        # The credential void (a seal sent from here on is refused: its copy may have gone to
        # private memory), then our regions fenced before DISCONNECT (`RegionMapper.close`): a
        # write through a view kept from before never lands in pages another instance gets.
        with self._rehandshake:  # (one in progress ends first; none begins after: `_closed`)
            session, self._rpc.session = self._rpc.session, None
        self._chunks.clear()
        self._mapper.close()
        if connected:
            try:
                body = {**self._local_reads(), "session": session}
                pending = self._request(MsgType.DISCONNECT, body)
                pending.retry = False  # a server that forgot us has nothing of ours to end
                pending.result()
            except MaruError as exc:
                forgot = isinstance(exc, MaruServerError) and exc.code == ErrorCode.UNKNOWN_INSTANCE
                if not forgot:
                    log.warning("disconnect from %s failed: %s", self.config.server_url, exc)
        self._index = None
        self._coherence.release()
        self._rpc.close()

    def _local_reads(self) -> dict[str, Any]:
        """The local index's reads since the last report: the server's hit counts see no
        read that sent no request."""
        reads = self._index.take_reads() if self._index is not None else None
        return {"local_reads": reads} if reads else {}

    def _local_index(self) -> LocalIndexClient | None:
        """The server's index, if it offered one; every read and existence check comes here."""
        self._ensure_connected()
        return self._index

    def _ensure_connected(self) -> None:
        """`MaruNotConnected` unless connected (a caller's mistake, not a miss); first, in a
        forked child, `MaruForkedError`, before any lock a parent's thread may have held."""
        if self._connected:
            if FORKS[0] != self._rpc.forks:  # (`RpcClient.check_fork`, inline: every verb)
                raise MaruForkedError(self._rpc.created_in)
            return
        if self._closed:
            why = "this MaruHandler was closed"
        elif self.connect_error is not None:
            why = f"connect() failed ({self.connect_error.reason}); call connect() again"
        else:
            why = "call connect() first (auto_connect was off)"
        raise MaruNotConnected(self.config.server_url, why)

    def _beat(self) -> None:
        if self._connected:  # (not after a refused re-handshake: `_on_unknown_instance`)
            self._supply.tick(self._local_reads())
            if self.config.eager_map:  # (the regions made since the last beat)
                self._s.map_new_regions(self._supply.pool_generation)
            self._mapper.let_go_removed()  # (others' regions freed since: their files gone)

    def _watch_regions(self) -> None:
        """Between beats (`eager_map`): map the regions made since we last looked as soon as
        the local index says one was (a first read of another instance's new region then finds
        it mapped, not a heartbeat later), and populate the pages their writers backed since
        (`RegionMapper.follow_backing`)."""
        if not (self._connected and self.config.eager_map):
            return
        index = self._index
        if index is not None and index.regions_made() > self._s.regions_seen[1]:
            self._s.map_new_regions(self._supply.pool_generation)
        self._mapper.follow_backing()

    def _request(self, msg_type: MsgType, body: dict[str, Any]) -> PendingReply:
        """The handler's one way to send: as this instance (`Session.request`)."""
        return self._s.request(msg_type, body)

    def _handshake(self) -> int:
        """(Re)attach; returns how many of our regions the server no longer knows."""
        body = {"name": self.config.instance_id, "pid": os.getpid()}
        body["chunk_size"] = self._chunks.chunk_size
        body["nonce"] = secrets.token_hex(16)  # (the server proves its pool key by it)
        reply = self._request(MsgType.HANDSHAKE, body).result()
        self._mapper.place = prove_or_refuse(
            self._rpc, reply, self.config, self._coherence, body["nonce"]
        )
        self._s.instance_id, self._rpc.session = reply["iid"], reply["session"]
        if self.config.local_socket:
            self._rpc.use_local_socket(reply.get("local_socket"), reply.get("uid"))
        self._index = offered_index(self._s, self._rpc.local_address, self._index, reply, body)
        self._heartbeat.interval = float(reply.get("heartbeat_interval", 5.0))
        self._cluster.handshake(reply)
        return self._supply.reattach(reply)

    def _on_unknown_instance(self, msg_type: int, request: dict[str, Any]) -> dict[str, Any]:
        """The server forgot us (restarted, or reaped us): handshake again, once for all
        threads that sent the old credential; `request` with the new one, for `RpcClient`."""
        with self._rehandshake:
            if self._closed:  # (its credential voided by `close`: never a new instance)
                raise MaruNotConnected(self.config.server_url, "this MaruHandler was closed")
            if request.get("session") == self._rpc.session:
                try:
                    lost = self._handshake()
                except MaruConnectRefused as exc:  # (a new pool we do not map: no more I/O)
                    if self._connected:
                        log.error("%s", exc)
                        self._connected, self.connect_error, self._index = False, exc, None
                    raise
                if lost and msg_type == MsgType.REGISTER_KV:  # (else: `Sealing.wait` sees it)
                    raise RegionsLost(
                        f"maru-server at {self.config.server_url} restarted and forgot {lost} "
                        "of our regions"
                    )
        if "pool_proof" in request:  # (ours is the new instance's: `prove_or_refuse`)
            request = {**request, "pool_proof": self._mapper.pool_proof}
        return {**request, "session": self._rpc.session} if "session" in request else request

    def _on_reply(self, body: dict[str, Any]) -> None:
        freed = body.get("freed")
        if freed:
            self._chunks.note_freed(freed)  # (applied off the write's path: `settle`)
        shed = body.get("shed")
        if shed:  # (given back by the heartbeat thread: this thread may hold the supply)
            self._supply.shed(shed)
            self._heartbeat.wake()

    # -- regions -----------------------------------------------------------------------------

    @property
    def config(self) -> MaruConfig:
        return self._s.config

    @property
    def instance_id(self) -> str:
        """This instance's name (the server's, from the handshake on)."""
        return self._s.instance_id

    # -- reserve, write, seal ----------------------------------------------------------------

    def alloc(self, size: int, count: int = 1) -> AllocHandle | None:
        """One contiguous run of chunks for `count` values of `size` bytes (docs/architecture.md,
        reserve). None when no run can be had: reserve value by value then."""
        if size <= 0 or count <= 0:
            raise ValueError(f"alloc needs a positive size and count, got {size}, {count}")
        self._ensure_connected()  # (in a forked child: our chunks are the parent's)
        return self._writes.reserve(size, count) if self._may_write() else None

    def _may_write(self) -> bool:
        """False when the server was silent for two heartbeats and does not answer now."""
        silent = self._rpc.last_reply < time.monotonic() - 2 * self._heartbeat.interval
        return not silent or self._rpc.answers()

    def free(self, handle: AllocHandle) -> None:
        """Give back reserved chunks that will not be sealed; in software coherence written
        back first, so no dirty line of ours lands on another host's value later."""
        with suppress(CopyFaultError):  # (its memory is gone: nothing to keep)
            write_back_handles(handle, None)
        self._chunks.give_back(handle)

    def seal(
        self,
        keys: Sequence[Key],
        handles: AllocHandle | Sequence[AllocHandle | None],
        lengths: int | Sequence[int] | None = None,
        *,
        checksums: np.ndarray | None = None,
    ) -> Sealing:
        """Publish written values under `keys` with one REGISTER_KV, sent now (`Sealing`).
        `handles`: one run (value i under `keys[i]`) or one per key (None: that key fails);
        `lengths`: one or per key (default the size reserved); `checksums`: with
        `maru_checksums`, each value's maru64 from the copy, else hashed in the pool."""
        sealing = self.prepare_seal(keys, handles, lengths)
        write_back_handles(handles, lengths)
        return sealing.send(checksums)

    def prepare_seal(
        self,
        keys: Sequence[Key],
        handles: AllocHandle | Sequence[AllocHandle | None],
        lengths: int | Sequence[int] | None = None,
    ) -> Sealing:
        """`seal` without reading a value (e.g. during the copy); `.send(checksums)` after."""
        check_key_batch(keys)
        self._ensure_connected()
        # (logged here; the server rejects them)
        refuse_bad_stores(keys, (), self.refused_stores, self.instance_id)
        return Sealing(self._s, keys, handles, lengths)

    def put(self, puts: Sequence[Put], *, behind: bool = False) -> None:
        """The write verb (`maru.client.writes`): fills each put's `results` (and, waiting,
        `outcomes`). `behind`: return once the registrations are sent, each sent value
        reported stored; this thread's next `confirm_writes` (or `put`) reads the replies."""
        self._ensure_connected()
        if not self._may_write():  # (nothing is written)
            for put in puts:
                put.results, put.outcomes = [False] * len(put.keys), None
            return
        self._writes.put(puts, behind=behind)

    def confirm_writes(self, wait: bool = True) -> int:
        """How many values this thread's write-behind `put`s reported stored were not."""
        if threading.get_ident() not in self._writes.unconfirmed_threads:  # (a read's case)
            return 0
        return self._writes.confirm(wait)

    # -- get, release ------------------------------------------------------------------------

    def lookup(
        self,
        keys: Sequence[Key],
        *,
        lease: bool = False,
        for_copy: bool = False,
        prefix: Prefix = "",
    ) -> Lookup:
        """Locate `keys` with one LOOKUP_KV, sent now; entering the `Lookup` waits, leaving
        it releases. `lease`: hits cannot be evicted or deleted until released (from this
        thread). `for_copy`: the caller copies the hits, then takes as misses what
        `corrupt()` names (all if `release(confirm=True)` is False), so the local index may
        answer instead (validated after the copy, not leased); asked of the server, the
        hits are leased whatever `lease` says (else nothing would prove the copy). `prefix`:
        keys are `prefix + key` (one prefix, or one per key). A cluster tier's misses are
        pulled first (one wait within --cluster-lookup-ms)."""
        check_key_batch(keys)
        if self._cluster.budget_s:
            self._cluster.pull(keys, prefix, self._local_index())
        return self._lookup(keys, lease, for_copy, prefix)

    def _lookup(self, keys: Sequence[Key], lease: bool, for_copy: bool, prefix: Prefix) -> Lookup:
        """`lookup` without the pull, for the read verbs, which pulled already."""
        index = self._local_index()
        if for_copy and index is not None:
            found = index.lookup(self._s, keys, prefix)
            if found is not None:
                return found
        return Lookup(self._s, joined(keys, prefix), lease or for_copy)

    def read(
        self,
        keys: Sequence[Key],
        buffers: np.ndarray,
        sizes: np.ndarray,
        *,
        length: int,
        prefix: Prefix = "",
    ) -> list[bool]:
        """Copy each key's `length` bytes (parts of `sizes`) into its row of `buffers` (int64
        (keys, parts) pointers); per key True only where the bytes are proven its writer's,
        else False (a miss, another length, an entry changed or a lease ended during the
        copy, a checksum mismatch; that row may have been written). This thread's
        write-behind `put`s are confirmed first. ValueError for `sizes` that are not int64
        parts summing to `length`, or `buffers` that are not int64 pointers, one per key and
        part (whichever path answers: the copy trusts them)."""
        check_key_batch(keys)
        buffers, sizes = _read_destinations(len(keys), buffers, sizes, length)
        self._ensure_connected()
        self.confirm_writes()
        if self._cluster.budget_s:  # (the misses a cluster tier holds, pulled first)
            self._cluster.pull(keys, prefix, self._index)
        hashed = self.config.checksums
        with self._copying:
            index = self._index
            if index is not None:
                proven = index.read(self._s, keys, prefix, buffers, sizes, length, hashed)
                if proven is not None:
                    return proven
            copy = functools.partial(
                copy_values,
                buffers=buffers,
                sizes=sizes,
                to_values=False,
                hashed=hashed,
                threads=self.config.copy_threads,
            )
            found = self._lookup(keys, True, True, prefix)
            return copy_and_prove(found, [(len(keys), length, copy)])[0].tolist()

    def read_many(
        self,
        keys: Sequence[Key],
        segments: Sequence[Segment] | Callable[[], Sequence[Segment]],
        *,
        prefix: Prefix = "",
    ) -> tuple[np.ndarray, np.ndarray]:
        """`read` for special destinations (a pool with its own copy API, several pools): one
        leased lookup, each `(count, length, copy)` segment copied in key order, proven and
        released (`copy_and_prove`): per key (proven, mismatched)."""
        check_key_batch(keys)
        self._ensure_connected()
        self.confirm_writes()
        if self._cluster.budget_s:
            self._cluster.pull(keys, prefix, self._index)
        with self._copying:
            found = self._lookup(keys, True, True, prefix)  # sent now
            # (`read`'s path; its copy is the caller's, which need not invalidate what it
            # reads in place: done first, a hit whose lines fault there a miss never copied)
            return copy_and_prove(found, segments, invalidate=software())

    # -- existence, pins, deletion -----------------------------------------------------------

    def batch_exists(self, keys: Sequence[Key], *, prefix: Prefix = "") -> list[bool]:
        """Whether each key (`prefix + key`, as in `lookup`; in the key scope) is registered."""
        keys = self._in_scope(keys)  # (checks the batch)
        index = self._local_index()
        found = index.exists(keys, prefix) if index is not None else None
        if found is not None and not self._cluster.budget_s:
            return found
        return self._cluster.exists(keys, prefix, found)  # (the server asked; misses pulled)

    def leading_hits(self, keys: Sequence[Key], *, prefix: Key = "") -> int:
        """How many of `keys` (`prefix + key`) from the start are registered (SGLang's
        `batch_exists`)."""
        check_key_batch(keys)
        index = self._local_index()
        counted = index.leading(keys, prefix) if index is not None else None
        if counted is not None and not self._cluster.budget_s:
            return counted
        return self._cluster.leading(keys, prefix, counted)  # (the server asked; misses pulled)

    def _per_key(
        self, msg_type: MsgType, keys: Sequence[Key], ok: Callable[[Any], bool]
    ) -> list[bool]:
        """One request on `keys`: per key, `ok` of its result; all False if the request
        failed (logged)."""
        results = self._ask_per_key(msg_type, keys, ok)
        return [False] * len(keys) if results is None else results

    def _ask_per_key(
        self,
        msg_type: MsgType,
        keys: Sequence[Key],
        ok: Callable[[Any], bool],
        extra: dict[str, Any] | None = None,
    ) -> list[bool] | None:
        """`_per_key` (with `extra` fields in the request), None if the request failed
        (logged): for a caller that must tell a failed request from keys that each said no."""
        check_key_batch(keys)
        self._ensure_connected()
        if not keys:
            return []
        try:
            body = {"keys": list(keys), **(extra or {})}
            results = self._request(msg_type, body).result()["results"]
        except MaruError as exc:
            log.warning("%s of %d keys failed: %s", msg_type.name.lower(), len(keys), exc)
            return None
        return [ok(r) for r in results]


def _read_destinations(
    n: int, buffers: Any, sizes: Any, length: int
) -> tuple[np.ndarray, np.ndarray]:
    """`read`'s destinations checked, as (n, parts) int64 pointers and int64 parts: a copy of
    a `length`-byte value into parts that do not add up to it would write past them."""
    sizes = np.asarray(sizes)
    if (
        sizes.dtype != np.int64
        or sizes.ndim != 1
        or not len(sizes)
        or (sizes < 0).any()
        or int(sizes.sum()) != length
    ):
        raise ValueError("read: sizes must be int64 parts summing to length")
    buffers = np.asarray(buffers)
    if buffers.dtype != np.int64 or buffers.size != n * len(sizes):
        raise ValueError(
            f"read: buffers must be int64 pointers, {n} keys of {len(sizes)} parts; "
            f"got {buffers.size} of {buffers.dtype}"
        )
    return np.ascontiguousarray(buffers).reshape(n, len(sizes)), sizes
