"""`MaruHandler`: one inference instance's client of the Maru store.

The object lifecycle is the API, in Arrow Plasma's verbs; everything else is a convenience:

    reserve   alloc(size, count=1) -> AllocHandle   chunks of an owned region (no request)
    write     into handle.buf / handle.address      straight into shared memory
    seal      seal(keys, handle(s)) -> Sealing      one REGISTER_KV per batch; .wait()
    get       lookup(keys, lease=True) -> Lookup    one LOOKUP_KV per batch; read in place
    release   Lookup.release() / leaving its `with`
    delete    batch_delete(keys)

`store`, `retrieve`, `leased`, `exists`, `pin`... are those verbs put together
(`maru.client.conveniences`); the write verb `put` and the read verbs `read` / `read_many`
hold the data path (`maru.client.writes`, `reads`).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import suppress
from typing import Any

import numpy as np

from maru.client.chunks import AllocHandle, ChunkBook
from maru.client.cluster import ClusterPulls
from maru.client.coherence import Coherence, invalidate_ranges, software, write_back_handles
from maru.client.connecting import connect_failure, probe
from maru.client.conveniences import OriginalApi
from maru.client.localindex import LocalIndexClient, Prefix, joined, offered_index
from maru.client.mapping import RegionMapper
from maru.client.memcopy import CopyFaultError, copy_values, guard_faults
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
from maru.common.protocol import DeleteStatus, ErrorCode, Key, MsgType

log = logging.getLogger(__name__)

__all__ = ["AllocHandle", "MaruHandler", "MemoryInfo", "StoreOutcome"]


class _Heartbeat:
    """Tells the server we are alive even when idle (a silent instance is reaped: its pins,
    leases and regions released after the server's --heartbeat-timeout), and parks the
    regions we stopped writing in (`RegionSupply.tick`)."""

    def __init__(self, send: Callable[[], Any], name: str):
        self.interval = 5.0  # the server says how often, at handshake
        self._send, self._name = send, name
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
        while True:
            self._now.wait(self.interval)
            self._now.clear()
            if self._stop.is_set():
                return
            try:
                self._send()
            except MaruError as exc:
                log.debug("heartbeat failed: %s", exc)

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
        # what the helpers (seals, lookups, the index, the supply, the writes) share of us:
        # `request` is the one RPC client's, which adds the instance's session credential
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
        self._heartbeat = _Heartbeat(self._beat, f"maru-heartbeat-{self.instance_id[:8]}")
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
        """Handshake with the server; no region is taken (the first store takes one), so a
        connect succeeds even when the pool is full. False if it fails: then `connect_error`
        says why (`MaruServerDown`, `MaruConnectRefused`, `MaruVersionMismatch`), as does one
        WARNING. A refused TCP connection fails at once, not after `timeout_ms`."""
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
        """End this instance on the server (DISCONNECT: its pins and leases end, its regions
        go back; keys stay readable until evicted) and unmap. In a child forked after the
        handler was made, only its copies of the Unix sockets go: the instance, its threads
        and its locks are the parent's (one may have been held at the fork)."""
        self._closed = True
        if self._rpc.forked():
            self._connected, self._rpc.session = False, None
            self._rpc.close()
            return
        self._heartbeat.stop(timeout=self.config.timeout_ms / 1000 + 1)
        if self._connected:
            self._connected = False
            try:
                pending = self._request(MsgType.DISCONNECT, self._local_reads())
                pending.retry = False  # a server that forgot us has nothing of ours to end
                pending.result()
            except MaruError as exc:
                forgot = isinstance(exc, MaruServerError) and exc.code == ErrorCode.UNKNOWN_INSTANCE
                if not forgot:
                    log.warning("disconnect from %s failed: %s", self.config.server_url, exc)
        self._index = None
        self._rpc.session = None  # void now: never presented again
        self._chunks.clear()
        self._mapper.close()
        self._coherence.release()
        self._rpc.close()

    def _local_reads(self) -> dict[str, Any]:
        """The reads the local index answered since the last report, for the server's
        statistics (its hit counts would otherwise miss every read that sent no request)."""
        reads = self._index.take_reads() if self._index is not None else None
        return {"local_reads": reads} if reads else {}

    def _local_index(self) -> LocalIndexClient | None:
        """The server's index to read through without a request, if it offered one (after
        `_ensure_connected`: every read and existence check comes here)."""
        self._ensure_connected()
        return self._index

    def _ensure_connected(self) -> None:
        """Raise `MaruNotConnected` unless connected (a data operation before `connect()`
        succeeded or after `close()` is the caller's mistake, not a miss), and first, in a
        child forked after the handler was made, `MaruForkedError`: before any lock, which a
        thread of the parent may have held at the fork."""
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

    def _request(self, msg_type: MsgType, body: dict[str, Any]) -> PendingReply:
        """The handler's one way to send: as this instance (`Session.request`)."""
        return self._s.request(msg_type, body)

    def _handshake(self) -> int:
        """(Re)attach to the server; returns how many of our regions it no longer knows."""
        body = {"name": self.config.instance_id, "pid": os.getpid()}
        body["chunk_size"] = self._chunks.chunk_size
        reply = self._request(MsgType.HANDSHAKE, body).result()
        self._mapper.place = prove_or_refuse(self._rpc, reply, self.config, self._coherence)
        self._s.instance_id, self._rpc.session = reply["iid"], reply["session"]
        if self.config.local_socket:
            self._rpc.use_local_socket(reply.get("local_socket"), reply.get("uid"))
        self._index = offered_index(self._s, self._rpc.local_address, self._index, reply, body)
        self._heartbeat.interval = float(reply.get("heartbeat_interval", 5.0))
        self._cluster.handshake(reply)
        return self._supply.reattach(reply)

    def _on_unknown_instance(self, msg_type: int, request: dict[str, Any]) -> dict[str, Any]:
        """The server does not know our instance (it restarted, or reaped us): handshake
        again, once for all threads whose requests carried the old credential, and return
        `request` with the credential of now (`RpcClient` re-sends it)."""
        with self._rehandshake:
            if request.get("session") == self._rpc.session:
                try:
                    lost = self._handshake()
                except MaruConnectRefused as exc:  # (a new pool we do not map: no more I/O)
                    if self._connected:
                        log.error("%s", exc)
                        self._connected, self.connect_error, self._index = False, exc, None
                    raise
                if lost and msg_type == MsgType.REGISTER_KV:
                    raise RegionsLost(
                        f"maru-server at {self.config.server_url} restarted and forgot {lost} "
                        "of our regions"
                    )
        return {**request, "session": self._rpc.session} if "session" in request else request

    def _on_reply(self, body: dict[str, Any]) -> None:
        freed = body.get("freed")
        if freed:
            self._chunks.apply_freed(freed)
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
        """Reserve `count` values of `size` bytes as one contiguous run of chunks: free
        chunks in owned regions, else a new region below `pool_size`, else our own idle keys
        evicted (docs/architecture.md, reserve). None when the pool cannot supply them, or
        the chunks freed hold no run: reserve value by value then."""
        if size <= 0 or count <= 0:
            raise ValueError(f"alloc needs a positive size and count, got {size}, {count}")
        self._ensure_connected()  # (in a forked child: our chunks are the parent's)
        return self._writes.reserve(size, count) if self._may_write() else None

    def _may_write(self) -> bool:
        """Not while the server has been silent for two heartbeat intervals and does not
        answer now (`RpcClient.answers`)."""
        silent = self._rpc.last_reply < time.monotonic() - 2 * self._heartbeat.interval
        return not silent or self._rpc.answers()

    def free(self, handle: AllocHandle) -> None:
        """Give back chunks that were reserved but will not be sealed (in software coherence
        written back first: no dirty line of ours may later land on another host's value)."""
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
        """Publish written values under `keys` with one REGISTER_KV, sent now; `.wait()` gives
        a bool per key, `.outcomes()` STORED or EXISTED (first writer won). `handles`: one
        run holding every value (value i under `keys[i]`) or one handle per key (None: that
        key fails); `lengths`: one for all, or per key (default the size reserved).
        `checksums`: with `maru_checksums`, each value's maru64 made during the copy
        (`copy_many_hashed`); without, they are hashed in the pool."""
        sealing = self.prepare_seal(keys, handles, lengths)
        write_back_handles(handles, lengths)
        return sealing.send(checksums)

    def prepare_seal(
        self,
        keys: Sequence[Key],
        handles: AllocHandle | Sequence[AllocHandle | None],
        lengths: int | Sequence[int] | None = None,
    ) -> Sealing:
        """`seal`'s work that reads no value (key checks, the location columns), e.g. while
        the values are still being copied; `.send(checksums)` once they are written."""
        self._ensure_connected()
        # (logged here; the server rejects them)
        refuse_bad_stores(keys, (), self.refused_stores, self.instance_id)
        return Sealing(self._s, keys, handles, lengths)

    def put(self, puts: Sequence[Put], *, behind: bool = False) -> None:
        """The write verb: reserve, copy (each `Put`'s copy function), seal, for every put
        of the call; fills each put's `results` (and, waiting, `outcomes`). `behind`: return
        once the registrations are sent, reporting each sent value stored; this thread's
        next `confirm_writes` (or `put`) reads the replies (`maru.client.writes`)."""
        self._ensure_connected()
        if not self._may_write():  # (nothing is written)
            for put in puts:
                put.results, put.outcomes = [False] * len(put.keys), None
            return
        self._writes.put(puts, behind=behind)

    def confirm_writes(self, wait: bool = True) -> int:
        """Read the replies of this thread's write-behind `put`s: how many values they
        reported stored were not registered."""
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
        """Locate `keys` with one LOOKUP_KV, sent now (prepare the copy meanwhile)::

            with handler.lookup(keys, lease=True) as found:  # waits for the reply
                ...copy from found.addresses (int64; 0 for a miss), found.lengths...
            # leaving the block releases the lease

        With `lease` the hits cannot be evicted or deleted until released; use it from the
        thread that made it. `for_copy`: the caller copies the hits out, then takes as misses
        what `corrupt()` names (or all if `release(confirm=True)` says False); then the
        server's local index may answer without a request (each hit validated after the copy
        instead of leased). `prefix`: the keys are `prefix + key` (one prefix of the keys'
        type, or one per key). With a cluster tier behind the pool, the misses it holds are
        pulled first (one wait within --cluster-lookup-ms)."""
        if self._cluster.budget_s:
            self._cluster.pull(keys, prefix, self._local_index())
        return self._lookup(keys, lease, for_copy, prefix)

    def _lookup(self, keys: Sequence[Key], lease: bool, for_copy: bool, prefix: Prefix) -> Lookup:
        """`lookup` without the pull: for the read verbs, which pulled once already (a
        second wait would spend the budget twice in one call)."""
        index = self._local_index()
        if for_copy and index is not None:
            found = index.lookup(self._s, keys, prefix)
            if found is not None:
                return found
        return Lookup(self._s, joined(keys, prefix), lease)

    def read(
        self,
        keys: Sequence[Key],
        buffers: np.ndarray,
        sizes: np.ndarray,
        *,
        length: int,
        prefix: Prefix = "",
    ) -> list[bool]:
        """Copy each key's value of `length` bytes (parts of `sizes` back to back) into its
        row of `buffers` (int64 (keys, parts) pointers) and prove it: per key True where the
        bytes copied are the ones its writer stored; False for a miss, another length, an
        entry that changed during the copy, a lease that ended, and with `maru_checksums`
        bytes unlike their checksum (the rows of False keys may have been written). This
        thread's write-behind `put`s are confirmed first."""
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
        """The read verb where the destination is special (a pool copied through its own
        API, several pools in one lookup): one leased `lookup` of `keys`, each segment's
        hits copied by its copy function (`(count, length, copy)`, in key order), proven,
        released (`maru.client.reads.copy_and_prove`): per key (proven, mismatched). This
        thread's write-behind `put`s are confirmed first, as for `read`."""
        self._ensure_connected()
        self.confirm_writes()
        if self._cluster.budget_s:
            self._cluster.pull(keys, prefix, self._index)
        with self._copying:
            found = self._lookup(keys, True, True, prefix)  # sent now
            if software():  # (any copy reads in place; a fault there is the copy's)
                invalidate_ranges(*found.wait())
            return copy_and_prove(found, segments)

    # -- existence, pins, deletion -----------------------------------------------------------

    def batch_exists(self, keys: Sequence[Key], *, prefix: Prefix = "") -> list[bool]:
        """Whether each key (`prefix + key`, as in `lookup`) is registered."""
        index = self._local_index()
        found = index.exists(keys, prefix) if index is not None else None
        if found is not None and not self._cluster.budget_s:
            return found
        return self._cluster.exists(keys, prefix, found)  # (the server asked; misses pulled)

    def leading_hits(self, keys: Sequence[Key], *, prefix: Key = "") -> int:
        """How many of `keys` (`prefix + key`) from the start are registered: SGLang's
        `batch_exists`. Through the local index in one call that stops at the first miss."""
        index = self._local_index()
        counted = index.leading(keys, prefix) if index is not None else None
        if counted is not None and not self._cluster.budget_s:
            return counted
        return self._cluster.leading(keys, prefix, counted)  # (the server asked; misses pulled)

    def batch_delete(self, keys: Sequence[Key]) -> list[bool]:
        """True where the key was deleted; a pinned, leased or unknown key reports False."""
        return self._per_key(MsgType.DELETE_KV, keys, lambda s: s == DeleteStatus.DELETED)

    def _per_key(self, msg_type: MsgType, keys: Sequence[Key], ok: Callable[[Any], bool]):
        self._ensure_connected()
        if not keys:
            return []
        try:
            results = self._request(msg_type, {"keys": list(keys)}).result()["results"]
        except MaruError as exc:
            log.warning("%s of %d keys failed: %s", msg_type.name.lower(), len(keys), exc)
            return [False] * len(keys)
        return [ok(r) for r in results]
