"""`MaruHandler`: one inference instance's view of the Maru store.

The object lifecycle is Plasma's: **alloc** pages in a region this instance owns, **write** the
bytes straight into shared memory, **register** (seal) the key with the server, and from then
on any instance can **retrieve** it: a lookup RPC returns (region, offset, length) and the reader
copies from its own mapping of the same memory. Only metadata crosses the socket.

Pages: each owned region is cut into pages of `chunk_size_bytes`; a value takes a contiguous
run of pages. Page bookkeeping lives here (not on the server), so a batch store costs one RPC.
When a key in one of our regions disappears server-side, the server piggy-backs its location on
our next reply (`freed`) and the pages return to our free lists.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from maru.client.mapping import MappedRegion, RegionMapper
from maru.client.rpc import PendingReply, RpcClient
from maru.common.config import MaruConfig
from maru.common.errors import MaruConnectionError, MaruError, MaruServerError
from maru.common.extents import ExtentAllocator
from maru.common.protocol import DeleteStatus, ErrorCode, MsgType, RegisterStatus
from maru.common.region import RegionHandle

log = logging.getLogger(__name__)

Key = str | bytes
Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True)
class MemoryInfo:
    """Where a stored value lives. `view` is a read-only memoryview over the shared bytes
    (no copy was made); `address` is the same bytes' virtual address in this process."""

    view: memoryview
    region_id: int
    page_index: int
    offset: int
    length: int
    address: int


@dataclass(frozen=True)
class AllocHandle:
    """Pages allocated in an owned region, not yet registered. Write into `buf` (or at
    `address`), then pass the handle to `store`/`batch_store`, or give it back with `free`."""

    buf: memoryview
    region_id: int
    offset: int
    length: int
    address: int


class PageRun:
    """`count` equal allocations back to back in one owned region, not yet registered (what
    `alloc_run` returns): value i is at `address + i * stride` (offset `offset + i * stride`).
    The lean form of a list of `AllocHandle`s, for integrations that write by address."""

    __slots__ = ("address", "count", "offset", "region_id", "stride")

    def __init__(self, region_id: int, offset: int, address: int, stride: int, count: int):
        self.region_id = region_id
        self.offset = offset
        self.address = address
        self.stride = stride
        self.count = count

    def slice(self, start: int, stop: int) -> PageRun:
        """Values [start, stop) of this run, as a run of their own."""
        skip = start * self.stride
        return PageRun(
            self.region_id, self.offset + skip, self.address + skip, self.stride, stop - start
        )


class _RegionsLost(MaruError):
    """The server restarted and forgot regions we had written into; their region ids may
    already name other memory, so a registration into them must not be sent again."""


class _OwnedRegion:
    __slots__ = ("mapped", "pages", "sticky")

    def __init__(self, mapped: MappedRegion, chunk: int):
        self.mapped = mapped
        self.pages = ExtentAllocator(mapped.handle.length // chunk)
        self.sticky: set[int] = set()  # first pages of merged runs that must not be freed


class LeasedAddresses:
    """A leased lookup in flight (`MaruHandler.leased_addresses`): sent when created, waited
    for on entering, its lease released on leaving."""

    __slots__ = ("_handler", "_keys", "_pending", "lease_id")

    def __init__(self, handler: MaruHandler, keys: Sequence[Key]):
        self._handler = handler
        self._keys = keys
        self._pending = handler._submit_lookup_addresses(keys)
        self.lease_id = 0

    def __enter__(self) -> tuple[np.ndarray, np.ndarray]:
        addresses, lengths, self.lease_id = self._handler._lookup_addresses(
            self._keys, self._pending
        )
        self._pending = None
        return addresses, lengths

    def __exit__(self, *exc: object) -> None:
        if self.lease_id:
            self._handler._release(self.lease_id)
            self.lease_id = 0


class MaruHandler:
    def __init__(self, config: MaruConfig | None = None, **overrides: Any):
        if config is None:
            config = MaruConfig(**overrides)
        elif overrides:
            raise TypeError("pass either a MaruConfig or keyword overrides, not both")
        self.config = config
        self.instance_id = config.instance_id
        self._chunk = config.chunk_size_bytes
        self._rpc = RpcClient(
            config.server_url,
            timeout_ms=config.timeout_ms,
            max_inflight=config.max_inflight if config.use_async_rpc else 1,
            reply_hook=self._on_reply,
            busy_poll_us=config.busy_poll_us,
        )
        self._mapper = RegionMapper()
        self._owned: dict[int, _OwnedRegion] = {}
        self._lock = threading.RLock()  # guards _owned and the page allocators
        self._expand_lock = threading.Lock()
        self._connected = False
        self._heartbeat_interval = 5.0
        self._heartbeat_stop = threading.Event()
        self._heartbeat_thread: threading.Thread | None = None
        if config.auto_connect and not self.connect():
            log.warning("could not connect to maru-server at %s", config.server_url)

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self._connected

    def connect(self) -> bool:
        """Handshake with the server and map our first region. False if it is unreachable."""
        try:
            self._handshake()
            if not self._owned:
                self._expand(self.config.pool_size)
            if self.config.eager_map:
                reply = self._rpc.call(MsgType.LIST_ALLOCATIONS, {"iid": self.instance_id})
                for fields in reply["regions"]:
                    self._map(RegionHandle.from_wire(fields))
        except MaruError as exc:
            log.warning("connect to %s failed: %s", self.config.server_url, exc)
            self._connected = False
            return False
        self._connected = True
        self._start_heartbeat()
        return True

    def _start_heartbeat(self) -> None:
        """Tell the server we are alive even when idle; a silent instance is reaped (its pins,
        leases and regions released) after the server's --heartbeat-timeout."""
        if self._heartbeat_thread is not None and self._heartbeat_thread.is_alive():
            return
        self._heartbeat_stop.clear()
        self._heartbeat_thread = threading.Thread(
            target=self._heartbeat_loop, name=f"maru-heartbeat-{self.instance_id[:8]}", daemon=True
        )
        self._heartbeat_thread.start()

    def _heartbeat_loop(self) -> None:
        while not self._heartbeat_stop.wait(self._heartbeat_interval):
            try:
                self._call(MsgType.HEARTBEAT, {})
            except MaruError as exc:
                log.debug("heartbeat failed: %s", exc)

    def close(self) -> None:
        """Return owned regions to the server (keys in them stay readable) and unmap."""
        if self._connected:
            for owned in list(self._owned.values()):
                h = owned.mapped.handle
                try:
                    self._rpc.call(
                        MsgType.RETURN_REGION,
                        {"iid": self.instance_id, "region_id": h.region_id, "token": h.token},
                    )
                except MaruError as exc:
                    log.warning("returning region %d failed: %s", h.region_id, exc)
        self._connected = False
        self._heartbeat_stop.set()
        if self._heartbeat_thread is not None:
            self._heartbeat_thread.join(timeout=self.config.timeout_ms / 1000 + 1)
        with self._lock:
            self._owned.clear()
        self._mapper.close()
        self._rpc.close()

    def __enter__(self) -> MaruHandler:
        if not self._connected and not self.connect():
            raise RuntimeError(f"Failed to connect MaruHandler to {self.config.server_url}")
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get_chunk_size(self) -> int:
        return self._chunk

    # -- RPC plumbing ------------------------------------------------------------------------

    def _handshake(self) -> int:
        """(Re)attach to the server; returns how many of our regions it no longer knows."""
        with self._lock:
            known = sorted(self._owned)
        reply = self._rpc.call(
            MsgType.HANDSHAKE,
            {
                "iid": self.instance_id,
                "pid": os.getpid(),
                "page_size": self._chunk,
                "known_regions": known,
            },
        )
        if self.config.local_socket:
            self._rpc.use_local_socket(reply.get("local_socket"))
        used = {rid: extents for rid, extents in reply.get("used", ())}
        self._heartbeat_interval = float(reply.get("heartbeat_interval", 5.0))
        still_owned = {h.region_id: h for h in map(RegionHandle.from_wire, reply["regions"])}
        lost = 0
        with self._lock:
            for region_id in list(self._owned):
                if region_id not in still_owned:
                    log.warning("server no longer knows region %d; dropping it", region_id)
                    del self._owned[region_id]
                    self._mapper.unmap(region_id)
                    lost += 1
            for handle in still_owned.values():
                if handle.region_id not in self._owned:
                    self._reserve_used(self._adopt(handle), used.get(handle.region_id, ()))
        return lost

    def _reserve_used(self, owned: _OwnedRegion, extents: Any) -> None:
        """Mark the pages of keys still registered in an adopted region as taken, one extent
        per key so that the key's deletion frees exactly its pages. Keys sharing a page (the
        predecessor used smaller pages) are merged into a run that is never freed piecemeal:
        it comes back only with the region."""
        chunk = self._chunk
        runs: list[list[int]] = []  # [first page, end page, keys in run]
        for offset, length in sorted(extents):
            first, end = offset // chunk, -(-(offset + length) // chunk)
            if runs and first < runs[-1][1]:
                runs[-1][1] = max(runs[-1][1], end)
                runs[-1][2] += 1
            else:
                runs.append([first, end, 1])
        for first, end, keys in runs:
            owned.pages.reserve(first, end - first)
            if keys > 1:
                owned.sticky.add(first)

    def _call(self, msg_type: MsgType, body: dict[str, Any]) -> dict[str, Any]:
        """One RPC; re-handshakes once if the server restarted and forgot us."""
        body["iid"] = self.instance_id
        try:
            return self._rpc.call(msg_type, body)
        except MaruServerError as exc:
            if exc.code != ErrorCode.UNKNOWN_INSTANCE:
                raise
            log.info("maru-server does not know us (restarted?); handshaking again")
            lost = self._handshake()
            if not self._owned and msg_type != MsgType.REQUEST_REGION:
                self._expand(self.config.pool_size)  # stay usable even with auto_expand off
            if lost and msg_type == MsgType.REGISTER_KV:
                raise _RegionsLost(
                    f"maru-server at {self.config.server_url} restarted and forgot {lost} of "
                    "our regions"
                ) from None
            return self._rpc.call(msg_type, body)

    def _on_reply(self, body: dict[str, Any]) -> None:
        freed = body.get("freed")
        if not freed:
            return
        with self._lock:
            for region_id, offset, _length in freed:
                owned = self._owned.get(region_id)
                page = offset // self._chunk
                if (
                    owned is not None
                    and page not in owned.sticky
                    and owned.pages.is_allocated(page)
                ):
                    owned.pages.free_extent(page)

    # -- regions -----------------------------------------------------------------------------

    def _adopt(self, handle: RegionHandle) -> _OwnedRegion:
        owned = _OwnedRegion(self._mapper.map(handle, writable=True), self._chunk)
        self._owned[handle.region_id] = owned
        return owned

    def _expand(self, size: int) -> _OwnedRegion:
        reply = self._call(MsgType.REQUEST_REGION, {"size": size})
        with self._lock:
            return self._adopt(RegionHandle.from_wire(reply["region"]))

    def _map(self, handle: RegionHandle) -> MappedRegion:
        mapped = self._mapper.get(handle.region_id)
        if mapped is not None and mapped.handle == handle:
            return mapped
        return self._mapper.map(
            handle, writable=handle.owner == self.instance_id and handle.region_id in self._owned
        )

    # -- alloc / store -----------------------------------------------------------------------

    def _try_alloc(self, pages: int) -> AllocHandle | None:
        with self._lock:
            for owned in self._owned.values():
                first = owned.pages.allocate(pages)
                if first is not None:
                    return self._handle_at(owned, first, pages)
        return None

    def batch_alloc(self, sizes: Sequence[int]) -> list[AllocHandle | None]:
        """Pages for many values. A batch of equal sizes (SGLang's pages) is carved as one
        contiguous run with a single search; otherwise, or if no run fits, value by value."""
        if not sizes:
            return []
        size = sizes[0]
        if size > 0 and all(s == size for s in sizes):
            pages = -(-size // self._chunk)
            with self._lock:
                for owned in self._owned.values():
                    firsts = owned.pages.allocate_run(pages, len(sizes))
                    if firsts is not None:
                        return [self._handle_at(owned, f, pages) for f in firsts]
        return [self.alloc(s) for s in sizes]

    def alloc_run(self, size: int, count: int) -> PageRun | None:
        """`count` values of `size` bytes as one contiguous run of pages in an owned region,
        with one search and no per-value objects. None when no owned region has such a run
        free: `batch_alloc` then has every resort (new regions, eviction)."""
        if size <= 0 or count <= 0:
            raise ValueError(f"alloc_run needs a positive size and count, got {size}, {count}")
        pages = -(-size // self._chunk)
        with self._lock:
            for owned in self._owned.values():
                firsts = owned.pages.allocate_run(pages, count)
                if firsts is not None:
                    offset = firsts[0] * self._chunk
                    mapped = owned.mapped
                    return PageRun(
                        mapped.handle.region_id,
                        offset,
                        mapped.address + offset,
                        pages * self._chunk,
                        count,
                    )
        return None

    def free_run(self, run: PageRun, indices: Sequence[int] | None = None) -> None:
        """Give back the values of `run` (all, or those at `indices`) that will not be
        registered."""
        chunk = self._chunk
        with self._lock:
            owned = self._owned.get(run.region_id)
            mapped = owned.mapped if owned is not None else None
            if mapped is None or not (
                mapped.address <= run.address < mapped.address + mapped.handle.length
            ):
                return  # the region is gone (server restart): nothing of ours to free
            for i in range(run.count) if indices is None else indices:
                first = (run.offset + i * run.stride) // chunk
                if owned.pages.is_allocated(first):
                    owned.pages.free_extent(first)

    def _handle_at(self, owned: _OwnedRegion, first_page: int, pages: int) -> AllocHandle:
        offset = first_page * self._chunk
        mapped = owned.mapped
        return AllocHandle(
            mapped.view[offset : offset + pages * self._chunk],
            mapped.handle.region_id,
            offset,
            pages * self._chunk,
            mapped.address + offset,
        )

    def alloc(self, size: int) -> AllocHandle | None:
        """Reserve pages for a value of `size` bytes; None when the pool cannot supply them.

        Order of resort: free pages in owned regions; a new region (`auto_expand`); evicting
        the least-recently-used idle keys in our own regions (the server picks them and tells
        us which pages came free). So a store does not fail just because memory is full of
        old pages."""
        if size <= 0:
            raise ValueError(f"alloc size must be positive, got {size}")
        pages = -(-size // self._chunk)
        handle = self._try_alloc(pages)
        if handle is not None:
            return handle
        with self._expand_lock:
            handle = self._try_alloc(pages)  # another thread may have made room meanwhile
            if handle is not None:
                return handle
            if self.config.auto_expand:
                try:
                    owned = self._expand(max(self.config.region_expand_size, pages * self._chunk))
                    with self._lock:
                        first = owned.pages.allocate(pages)
                    if first is not None:
                        return self._handle_at(owned, first, pages)
                except MaruServerError as exc:
                    if exc.code != ErrorCode.POOL_FULL:
                        log.warning("instance %s: cannot expand: %s", self.instance_id, exc)
                        return None
                    log.info("instance %s: %s; evicting in own regions", self.instance_id, exc)
                except MaruConnectionError as exc:
                    log.warning("instance %s: cannot expand: %s", self.instance_id, exc)
                    return None
            return self._alloc_by_evicting(size, pages)

    def _alloc_by_evicting(self, size: int, pages: int) -> AllocHandle | None:
        want = pages * self._chunk
        for _ in range(6):  # evicted pages may not be contiguous: ask for more each round
            try:
                freed = self._call(MsgType.EVICT_FOR, {"bytes": want})["freed_bytes"]
            except MaruError as exc:
                log.warning("instance %s: eviction request failed: %s", self.instance_id, exc)
                return None
            handle = self._try_alloc(pages)  # the reply's `freed` list was applied already
            if handle is not None:
                return handle
            if not freed:
                break
            want *= 2
        log.warning(
            "instance %s: no room for %d bytes in pool (all pages pinned, leased or fragmented)",
            self.instance_id,
            size,
        )
        return None

    def _region_of(self, handle: AllocHandle) -> _OwnedRegion | None:
        """The owned region `handle` was allocated in, or None if that region is gone. The
        address check matters after a server restart: a new region may reuse the old id."""
        owned = self._owned.get(handle.region_id)
        if owned is None:
            return None
        mapped = owned.mapped
        if not mapped.address <= handle.address < mapped.address + mapped.handle.length:
            return None
        return owned

    def free(self, handle: AllocHandle) -> None:
        """Give back pages that were allocated but will not be registered."""
        with self._lock:
            owned = self._region_of(handle)
            if owned is not None:
                owned.pages.free_extent(handle.offset // self._chunk)

    def store(
        self,
        key: Key,
        data: Buffer | None = None,
        *,
        handle: AllocHandle | None = None,
        length: int | None = None,
    ) -> bool:
        """Store one value: either copy `data` in, or publish a `handle` already written."""
        if (data is None) == (handle is None):
            raise ValueError("store() takes exactly one of data= or handle=")
        if data is not None:
            return self.batch_store([key], [data])[0]
        assert handle is not None
        return self.batch_store(
            [key], handles=[handle], lengths=None if length is None else [length]
        )[0]

    def batch_store(
        self,
        keys: Sequence[Key],
        datas: Sequence[Buffer] | None = None,
        *,
        handles: Sequence[AllocHandle | None] | None = None,
        lengths: Sequence[int] | None = None,
    ) -> list[bool]:
        """Store many values with one register RPC.

        With `datas`: allocate pages and copy each value in (one memcpy per value).
        With `handles`: the caller already wrote the bytes (zero-copy integrations);
        `lengths` gives each value's byte length (default: the handle's page-rounded length).
        A key that already exists reports True (first writer won; our pages are given back).
        """
        n = len(keys)
        if datas is not None:
            if handles is not None or len(datas) != n:
                raise ValueError("batch_store needs one data per key and no handles")
            lengths = [memoryview(d).nbytes for d in datas]
            if min(lengths, default=1) > 0:
                handles = self.batch_alloc(lengths)
            else:  # an empty value cannot be stored: that key reports False
                handles = [self.alloc(s) if s > 0 else None for s in lengths]
            for data, size, h in zip(datas, lengths, handles):
                if h is not None:
                    h.buf[:size] = memoryview(data).cast("B")
        elif handles is None or len(handles) != n:
            raise ValueError("batch_store needs datas or one handle per key")
        if lengths is None:
            lengths = [h.length if h is not None else 0 for h in handles]

        entries, positions = [], []
        for i, (key, h, size) in enumerate(zip(keys, handles, lengths)):
            if h is not None and self._region_of(h) is not None:
                entries.append([key, h.region_id, h.offset, size])
                positions.append(i)
        results = [False] * n
        if not entries:
            return results
        try:
            reply = self._call(MsgType.REGISTER_KV, {"entries": entries})
        except _RegionsLost as exc:
            if datas is None:  # the caller's bytes are in memory the server forgot
                log.warning("register of %d keys failed: %s", len(entries), exc)
                return results
            log.info("%s; writing the %d values again", exc, len(entries))
            return self.batch_store(keys, datas)
        except MaruError as exc:
            # Outcome unknown: the server may have registered some keys, so their pages must
            # not be reused. They stay allocated until the region is returned.
            log.warning("register of %d keys failed: %s", len(entries), exc)
            return results
        for i, status in zip(positions, reply["results"]):
            h = handles[i]
            if status == RegisterStatus.REGISTERED:
                results[i] = True
            else:
                self.free(h)
                results[i] = status == RegisterStatus.EXISTS
        return results

    def register_run(self, keys: Sequence[Key], run: PageRun, length: int) -> list[bool]:
        """Publish the values of `run` (already written; value i under `keys[i]`, `length`
        bytes each) with one REGISTER_KV in columnar form. Same outcomes as `batch_store`: an
        existing key reports True (first writer won) and its pages come back to us."""
        n = len(keys)
        if n != run.count:
            raise ValueError(f"register_run: {n} keys for a run of {run.count}")
        if not n:
            return []
        body = self._run_body(keys, run, length)
        try:
            reply = self._call(MsgType.REGISTER_KV, body)
        except MaruServerError as exc:
            if exc.code != ErrorCode.BAD_REQUEST or "entries" not in str(exc):
                log.warning("register of %d keys failed: %s", n, exc)
                return [False] * n
            # A server without the columnar form: the same registration as entries.
            entries = [[k, run.region_id, o, length] for k, o in zip(keys, body["offsets"])]
            try:
                reply = self._call(MsgType.REGISTER_KV, {"entries": entries})
            except MaruError as exc2:
                log.warning("register of %d keys failed: %s", n, exc2)
                return [False] * n
        except MaruError as exc:
            # _RegionsLost: the bytes are in memory the server forgot. Otherwise the outcome
            # is unknown (some keys may be registered), so the pages stay allocated until the
            # region is returned.
            log.warning("register of %d keys failed: %s", n, exc)
            return [False] * n
        return self._run_outcome(run, reply["results"])

    def submit_register_run(
        self, keys: Sequence[Key], run: PageRun, length: int
    ) -> Callable[[], list[bool]]:
        """`register_run` without waiting for the reply, so that the caller can write the next
        values meanwhile. Returns a function giving the outcome (call it from this thread)."""
        n = len(keys)
        if n != run.count:
            raise ValueError(f"register_run: {n} keys for a run of {run.count}")
        if not n or not self.config.use_async_rpc:
            results = self.register_run(keys, run, length)
            return lambda: results
        body = self._run_body(keys, run, length)
        body["iid"] = self.instance_id
        try:
            pending = self._rpc.submit(MsgType.REGISTER_KV, body)
        except MaruError:
            return lambda: self.register_run(keys, run, length)

        def outcome() -> list[bool]:
            try:
                reply = pending.result()
            except MaruServerError as exc:
                if exc.code in (ErrorCode.UNKNOWN_INSTANCE, ErrorCode.BAD_REQUEST):
                    # The server restarted (re-handshake) or lacks the columnar form.
                    return self.register_run(keys, run, length)
                log.warning("register of %d keys failed: %s", n, exc)
                return [False] * n
            except MaruError as exc:  # outcome unknown: the pages stay allocated
                log.warning("register of %d keys failed: %s", n, exc)
                return [False] * n
            return self._run_outcome(run, reply["results"])

        return outcome

    @staticmethod
    def _run_body(keys: Sequence[Key], run: PageRun, length: int) -> dict[str, Any]:
        offsets = list(range(run.offset, run.offset + run.count * run.stride, run.stride))
        body = {"keys": list(keys), "region_id": run.region_id, "offsets": offsets}
        body["length"] = length
        return body

    def _run_outcome(self, run: PageRun, statuses: list[int]) -> list[bool]:
        if statuses.count(RegisterStatus.REGISTERED) == run.count:
            return [True] * run.count
        self.free_run(run, [i for i, st in enumerate(statuses) if st != RegisterStatus.REGISTERED])
        return [st in (RegisterStatus.REGISTERED, RegisterStatus.EXISTS) for st in statuses]

    # -- retrieve ----------------------------------------------------------------------------

    def retrieve(self, key: Key) -> MemoryInfo | None:
        return self.batch_retrieve([key])[0]

    def batch_retrieve(self, keys: Sequence[Key]) -> list[MemoryInfo | None]:
        """Locate many keys with one lookup RPC; views point into shared memory (no copy).

        The bytes stay valid while the key is registered; to copy them out safely while other
        instances may delete or evict, use `leased(keys)`."""
        return self._lookup(keys, lease=False)[0]

    @contextmanager
    def leased(self, keys: Sequence[Key]) -> Iterator[list[MemoryInfo | None]]:
        """Like `batch_retrieve`, but the found keys cannot be evicted or deleted until the
        block ends (or the server's lease timeout passes, if this process dies)::

            with handler.leased(keys) as infos:
                ...copy out of info.view / info.address...
        """
        infos, lease_id = self._lookup(keys, lease=True)
        try:
            yield infos
        finally:
            if lease_id:
                self._release(lease_id)

    def _release(self, lease_id: int) -> None:
        body = {"iid": self.instance_id, "leases": [lease_id]}
        try:
            if self.config.use_async_rpc:
                self._rpc.submit(MsgType.RELEASE, body)  # reply collected by a later call
            else:
                self._rpc.call(MsgType.RELEASE, body)
        except MaruError as exc:  # the lease expires by itself on the server
            log.debug("releasing lease %d failed: %s", lease_id, exc)

    def _lookup(self, keys: Sequence[Key], *, lease: bool) -> tuple[list[MemoryInfo | None], int]:
        if not keys:
            return [], 0
        body: dict[str, Any] = {"keys": list(keys)}
        if lease:
            body["lease"] = True
        try:
            reply = self._call(MsgType.LOOKUP_KV, body)
        except MaruError as exc:
            log.warning("lookup of %d keys failed: %s", len(keys), exc)
            return [None] * len(keys), 0
        mapped: dict[int, MappedRegion] = {}
        for fields in reply["regions"]:
            handle = RegionHandle.from_wire(fields)
            mapped[handle.region_id] = self._map(handle)
        out: list[MemoryInfo | None] = []
        chunk = self._chunk
        for loc in reply["locations"]:
            if loc is None:
                out.append(None)
                continue
            region_id, offset, length = loc
            region = mapped[region_id]
            view = region.view[offset : offset + length]
            if not view.readonly:
                view = view.toreadonly()
            out.append(
                MemoryInfo(
                    view, region_id, offset // chunk, offset, length, region.address + offset
                )
            )
        return out, int(reply.get("lease_id", 0))

    def leased_addresses(self, keys: Sequence[Key]) -> LeasedAddresses:
        """The lean form of `leased` for integrations that copy by address::

            lookup = handler.leased_addresses(keys)  # the request is on its way
            ...prepare the copy while the server looks the keys up...
            with lookup as (addresses, lengths):  # int64 arrays, 0 and 0 for a miss
                ...copy...                        # the found keys cannot be evicted or deleted

        One lookup RPC with a columnar reply, no view or `MemoryInfo` per key. Use it from one
        thread, and always enter it (leaving it releases the lease)."""
        return LeasedAddresses(self, keys)

    def _lookup_addresses_body(self, keys: Sequence[Key]) -> dict[str, Any]:
        return {"keys": list(keys), "lease": True, "columnar": True, "packed": True}

    def _submit_lookup_addresses(self, keys: Sequence[Key]) -> PendingReply | None:
        if not keys:
            return None
        body = self._lookup_addresses_body(keys)
        body["iid"] = self.instance_id
        try:
            return self._rpc.submit(MsgType.LOOKUP_KV, body)
        except MaruError:
            return None  # `_lookup_addresses` tries again (and reports)

    def _lookup_addresses(
        self, keys: Sequence[Key], pending: PendingReply | None
    ) -> tuple[np.ndarray, np.ndarray, int]:
        """The outcome of a leased columnar lookup sent as `pending` (None: send it now):
        int64 arrays of addresses and lengths (0 and 0 for a miss), and the lease id."""
        n = len(keys)
        if not n:
            return np.zeros(0, np.int64), np.zeros(0, np.int64), 0
        try:
            reply = None
            if pending is not None:
                try:
                    reply = pending.result()
                except MaruServerError as exc:
                    if exc.code != ErrorCode.UNKNOWN_INSTANCE:
                        raise
            if reply is None:
                # Submitting failed, or the server restarted and forgot us: one more try as a
                # plain call (`_call` handshakes again if need be).
                reply = self._call(MsgType.LOOKUP_KV, self._lookup_addresses_body(keys))
        except MaruError as exc:
            log.warning("lookup of %d keys failed: %s", n, exc)
            return np.zeros(n, np.int64), np.zeros(n, np.int64), 0
        lease_id = int(reply.get("lease_id", 0))
        try:
            if "region_ids" not in reply:  # a server without the columnar form
                locs = [loc or (0, 0, 0) for loc in reply["locations"]]
                region_ids, offsets, lengths = (np.array(c, np.int64) for c in zip(*locs))
            else:  # packed (bytes of int64s), or lists from a server without the packed form
                region_ids, offsets, lengths = (
                    np.frombuffer(c, np.int64) if isinstance(c, bytes) else np.array(c, np.int64)
                    for c in (reply["region_ids"], reply["offsets"], reply["lengths"])
                )
            if not len(region_ids) == len(offsets) == len(lengths) == n:
                raise ValueError(f"{len(region_ids)} locations")
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("lookup of %d keys: malformed reply (%s); treated as misses", n, exc)
            return np.zeros(n, np.int64), np.zeros(n, np.int64), lease_id
        # Region id 0 is never used: it marks a miss (address 0).
        addresses = np.zeros(n, np.int64)
        for fields in reply["regions"]:
            handle = RegionHandle.from_wire(fields)
            in_region = region_ids == handle.region_id
            addresses[in_region] = offsets[in_region] + self._map(handle).address
        return addresses, lengths, lease_id

    # -- existence, pinning, deletion --------------------------------------------------------

    def exists(self, key: Key) -> bool:
        return self.batch_exists([key])[0]

    def batch_exists(self, keys: Sequence[Key]) -> list[bool]:
        if not keys:
            return []
        try:
            return list(self._call(MsgType.EXISTS, {"keys": list(keys)})["results"])
        except MaruError as exc:
            log.warning("exists of %d keys failed: %s", len(keys), exc)
            return [False] * len(keys)

    def pin(self, key: Key) -> bool:
        return self.batch_pin([key])[0]

    def unpin(self, key: Key) -> bool:
        return self.batch_unpin([key])[0]

    def batch_pin(self, keys: Sequence[Key]) -> list[bool]:
        """Pinned keys cannot be deleted (or, later, evicted) until unpinned."""
        return self._batch_bool(MsgType.PIN, keys)

    def batch_unpin(self, keys: Sequence[Key]) -> list[bool]:
        return self._batch_bool(MsgType.UNPIN, keys)

    def delete(self, key: Key) -> bool:
        return self.batch_delete([key])[0]

    def batch_delete(self, keys: Sequence[Key]) -> list[bool]:
        """True where the key was deleted; a pinned or unknown key reports False."""
        if not keys:
            return []
        try:
            reply = self._call(MsgType.DELETE_KV, {"keys": list(keys)})
        except MaruError as exc:
            log.warning("delete of %d keys failed: %s", len(keys), exc)
            return [False] * len(keys)
        return [s == DeleteStatus.DELETED for s in reply["results"]]

    def delete_prefix(self, prefix: Key) -> int:
        """Delete every unpinned key that starts with `prefix`; returns how many went."""
        return int(self._call(MsgType.DELETE_PREFIX, {"prefix": prefix})["deleted"])

    def _batch_bool(self, msg_type: MsgType, keys: Sequence[Key]) -> list[bool]:
        if not keys:
            return []
        try:
            return list(self._call(msg_type, {"keys": list(keys)})["results"])
        except MaruError as exc:
            log.warning("%s of %d keys failed: %s", msg_type.name.lower(), len(keys), exc)
            return [False] * len(keys)

    # -- introspection -----------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """The server's statistics (pool usage, keys, per-instance counters)."""
        return self._call(MsgType.STATS, {})["stats"]

    def list_allocations(self, *, all_instances: bool = False) -> list[RegionHandle]:
        body: dict[str, Any] = {} if all_instances else {"owner": self.instance_id}
        return [
            RegionHandle.from_wire(f) for f in self._call(MsgType.LIST_ALLOCATIONS, body)["regions"]
        ]

    def owned_region_ids(self) -> list[int]:
        with self._lock:
            return list(self._owned)

    def free_pages(self) -> int:
        with self._lock:
            return sum(o.pages.free for o in self._owned.values())
