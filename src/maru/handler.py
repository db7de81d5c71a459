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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from maru.config import MaruConfig
from maru.errors import MaruConnectionError, MaruError, MaruServerError
from maru.pool.extents import ExtentAllocator
from maru.pool.mapping import MappedRegion, RegionMapper
from maru.pool.region import RegionHandle
from maru.protocol import DeleteStatus, ErrorCode, MsgType, RegisterStatus
from maru.rpc import RpcClient

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


class _OwnedRegion:
    __slots__ = ("mapped", "pages")

    def __init__(self, mapped: MappedRegion, chunk: int):
        self.mapped = mapped
        self.pages = ExtentAllocator(mapped.handle.length // chunk)


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
        )
        self._mapper = RegionMapper()
        self._owned: dict[int, _OwnedRegion] = {}
        self._lock = threading.RLock()  # guards _owned and the page allocators
        self._expand_lock = threading.Lock()
        self._connected = False
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
        return True

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

    def _handshake(self) -> None:
        reply = self._rpc.call(MsgType.HANDSHAKE, {"iid": self.instance_id, "pid": os.getpid()})
        still_owned = {h.region_id: h for h in map(RegionHandle.from_wire, reply["regions"])}
        with self._lock:
            for region_id in list(self._owned):
                if region_id not in still_owned:
                    log.warning("server no longer knows region %d; dropping it", region_id)
                    del self._owned[region_id]
                    self._mapper.unmap(region_id)
            for handle in still_owned.values():
                if handle.region_id not in self._owned:
                    self._adopt(handle)

    def _call(self, msg_type: MsgType, body: dict[str, Any]) -> dict[str, Any]:
        """One RPC; re-handshakes once if the server restarted and forgot us."""
        body["iid"] = self.instance_id
        try:
            return self._rpc.call(msg_type, body)
        except MaruServerError as exc:
            if exc.code != ErrorCode.UNKNOWN_INSTANCE:
                raise
            log.info("maru-server does not know us (restarted?); handshaking again")
            self._handshake()
            return self._rpc.call(msg_type, body)

    def _on_reply(self, body: dict[str, Any]) -> None:
        freed = body.get("freed")
        if not freed:
            return
        with self._lock:
            for region_id, offset, _length in freed:
                owned = self._owned.get(region_id)
                if owned is not None:
                    owned.pages.free_extent(offset // self._chunk)

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
            for region_id, owned in self._owned.items():
                first = owned.pages.allocate(pages)
                if first is not None:
                    offset = first * self._chunk
                    mapped = owned.mapped
                    return AllocHandle(
                        mapped.view[offset : offset + pages * self._chunk],
                        region_id,
                        offset,
                        pages * self._chunk,
                        mapped.address + offset,
                    )
        return None

    def alloc(self, size: int) -> AllocHandle | None:
        """Reserve pages for a value of `size` bytes; None when the pool cannot supply them."""
        if size <= 0:
            raise ValueError(f"alloc size must be positive, got {size}")
        pages = -(-size // self._chunk)
        handle = self._try_alloc(pages)
        if handle is not None or not self.config.auto_expand:
            if handle is None:
                log.warning(
                    "instance %s: owned regions are full (auto_expand off)", self.instance_id
                )
            return handle
        with self._expand_lock:
            handle = self._try_alloc(pages)  # another thread may have expanded meanwhile
            if handle is not None:
                return handle
            try:
                owned = self._expand(max(self.config.region_expand_size, pages * self._chunk))
            except MaruServerError as exc:
                log.warning("instance %s: cannot store %d bytes: %s", self.instance_id, size, exc)
                return None
            except MaruConnectionError as exc:
                log.warning("instance %s: cannot expand: %s", self.instance_id, exc)
                return None
            with self._lock:
                first = owned.pages.allocate(pages)
            if first is None:
                return None
            offset = first * self._chunk
            return AllocHandle(
                owned.mapped.view[offset : offset + pages * self._chunk],
                owned.mapped.handle.region_id,
                offset,
                pages * self._chunk,
                owned.mapped.address + offset,
            )

    def free(self, handle: AllocHandle) -> None:
        """Give back pages that were allocated but will not be registered."""
        with self._lock:
            owned = self._owned.get(handle.region_id)
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
            handles = []
            for data, size in zip(datas, lengths):
                h = self.alloc(size) if size > 0 else None
                if h is not None:
                    h.buf[:size] = memoryview(data).cast("B")
                handles.append(h)
        elif handles is None or len(handles) != n:
            raise ValueError("batch_store needs datas or one handle per key")
        if lengths is None:
            lengths = [h.length if h is not None else 0 for h in handles]

        entries, positions = [], []
        for i, (key, h, size) in enumerate(zip(keys, handles, lengths)):
            if h is not None:
                entries.append([key, h.region_id, h.offset, size])
                positions.append(i)
        results = [False] * n
        if not entries:
            return results
        try:
            reply = self._call(MsgType.REGISTER_KV, {"entries": entries})
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

    # -- retrieve ----------------------------------------------------------------------------

    def retrieve(self, key: Key) -> MemoryInfo | None:
        return self.batch_retrieve([key])[0]

    def batch_retrieve(self, keys: Sequence[Key]) -> list[MemoryInfo | None]:
        """Locate many keys with one lookup RPC; views point into shared memory (no copy)."""
        if not keys:
            return []
        try:
            reply = self._call(MsgType.LOOKUP_KV, {"keys": list(keys)})
        except MaruError as exc:
            log.warning("lookup of %d keys failed: %s", len(keys), exc)
            return [None] * len(keys)
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
        return out

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
