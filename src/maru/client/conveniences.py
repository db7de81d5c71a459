"""The original Maru API's conveniences, a base of `MaruHandler`: each is the lifecycle's verbs
(`put`, `seal`, `lookup`, `_per_key`) put together; of its own only the book of the pins its
callers hold (`_PinBook`), so that a view is never handed out under a pin that has ended."""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np

from maru.client.chunks import AllocHandle
from maru.client.coherence import invalidate_ranges, software
from maru.client.requests import Lookup, MemoryInfo
from maru.client.writes import Put, Sealing, StoreOutcome, from_pointers
from maru.common.errors import LeaseExpired, MaruError, MaruNotConnected
from maru.common.protocol import DeleteStatus, Key, MsgType, check_key_batch
from maru.common.region import RegionHandle

if TYPE_CHECKING:
    from typing_extensions import Self  # (typing's from Python 3.11)

    from maru.client.cluster import ClusterPulls
    from maru.client.localindex import LocalIndexClient
    from maru.client.rpc import PendingReply, RpcClient
    from maru.client.session import Session
    from maru.client.supply import RegionSupply
    from maru.common.config import MaruConfig

log = logging.getLogger("maru.client.handler")

Buffer = bytes | bytearray | memoryview


def _bytes_of(value: Any) -> np.ndarray | None:
    """The bytes of a value to store, as a uint8 array; None for one that is not bytes-like (a
    str, None, a number, a non-contiguous view): refused like a bad key, not a TypeError."""
    try:
        return np.frombuffer(memoryview(value).cast("B"), np.uint8)
    except TypeError:
        return None


_NO_VALUE: Any = object()  # `store(key)` with no value at all (a mistake in the call)


class _PinBook:
    """The pins this handler's callers took and have not let go, per key by the instance
    that took them. An instance reaped or forgotten by a restart (the handler handshakes
    again, as a new instance) loses its pins: a get of a key pinned only under such an
    instance would be a view its caller believes pinned but nothing keeps in place, so
    `batch_retrieve` makes it a miss (`lost`) until the caller unpins it or pins it again."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[Key, Counter[str]] = {}

    def took(self, instance_id: str, keys: Sequence[Key]) -> None:
        with self._lock:
            for key in keys:
                self._held.setdefault(key, Counter())[instance_id] += 1

    def let_go(self, instance_id: str, keys: Sequence[Key], unpinned: Sequence[bool]) -> None:
        """One pin per key let go by its caller: the current instance's where the server
        dropped one of it, else one the handler lost (an unpin the server answered False)."""
        with self._lock:
            for key, ok in zip(keys, unpinned):
                held = self._held.get(key)
                if not held:
                    continue
                lost = [iid for iid in held if iid != instance_id]
                iid = instance_id if (ok and held[instance_id]) or not lost else lost[0]
                held[iid] -= 1
                if held[iid] <= 0:
                    del held[iid]
                if not held:
                    del self._held[key]

    def holds_any(self) -> bool:
        with self._lock:
            return bool(self._held)

    def lost(self, instance_id: str, keys: Sequence[Key]) -> list[bool]:
        """Per key, whether every pin its callers hold was taken by an instance that ended."""
        with self._lock:
            if not self._held:
                return [False] * len(keys)
            return [bool(h) and not h[instance_id] for h in map(self._held.get, keys)]


_PIN_BOOK_LOCK = threading.Lock()


class OriginalApi:
    """The conveniences; `MaruHandler`, deriving from it, provides the verbs declared here."""

    alloc: Callable[..., AllocHandle | None]
    free: Callable[[AllocHandle], None]
    seal: Callable[..., Sealing]
    put: Callable[..., None]
    lookup: Callable[..., Lookup]
    batch_exists: Callable[..., list[bool]]
    _per_key: Callable[..., list[bool]]
    _ask_per_key: Callable[..., list[bool] | None]
    _ensure_connected: Callable[[], None]
    _request: Callable[..., PendingReply]
    _local_reads: Callable[[], dict[str, Any]]
    _local_index: Callable[[], LocalIndexClient | None]
    _cluster: ClusterPulls
    _connected: bool
    _closed: bool
    _supply: RegionSupply
    _handshake: Callable[[], int]
    connect: Callable[[], bool]
    close: Callable[[], None]
    connect_error: MaruError | None
    _s: Session
    _rpc: RpcClient
    config: MaruConfig
    instance_id: str

    # -- connection --------------------------------------------------------------------------

    def __enter__(self) -> Self:
        """Raises the `MaruConnectError` of the constructor's connect (not tried again), or of
        a first connect when `auto_connect` was off."""
        if not self._connected and (self.connect_error is not None or not self.connect()):
            error = self.connect_error
            self.close()
            assert error is not None
            raise error
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- key scope ---------------------------------------------------------------------------

    _key_scope = ""
    _key_scope_bytes = b""

    @property
    def key_scope(self) -> str:
        """What the original API's keyed verbs put after every key they send: `store`,
        `batch_store`, `store_outcomes`, `retrieve`, `batch_retrieve`, `leased`, `exists`,
        `batch_exists`, `pin`, `unpin`, `batch_pin`, `batch_unpin`, `delete`, `batch_delete`
        ("": nothing, until `set_key_scope`). The lifecycle's verbs (`seal`, `put`, `lookup`,
        `read`...) send keys as given; `delete_prefix` matches every scope's keys."""
        return self._key_scope

    def set_key_scope(self, scope: str) -> None:
        """Scope this handler's keys, for a caller whose keys do not name everything their
        bytes depend on: LMCache's name no KV layout, so `CxlMemoryAdapter` sets a digest of
        it, and two engines of one model name but other layouts miss each other's values
        instead of reading them. Set before the handler stores or pins anything, once: another
        scope, or one set later, is a ValueError (the keys it stored or pinned would be lost
        to it: misses, pins never let go)."""
        if not isinstance(scope, str) or not scope or len(scope) > 64:
            raise ValueError(f"key scope: a str of 1 to 64 characters, got {scope!r}")
        if scope == self._key_scope:
            return
        if self._key_scope:
            raise ValueError(
                f"key scope: this handler's keys are scoped {self._key_scope!r} already, not "
                f"{scope!r} (one handler per KV layout)"
            )
        book = self._pin_book
        if not self._s.chunks.untouched() or (book is not None and book.holds_any()):
            raise ValueError(
                "key scope: set it before this handler stores, reserves or pins anything "
                "(what it stored or pinned would be lost to the scope)"
            )
        self._key_scope, self._key_scope_bytes = scope, scope.encode()

    def _in_scope(self, keys: Sequence[Key]) -> Sequence[Key]:
        """`keys` as the original API's verbs send them: each non-empty str or bytes key with
        the scope after it; a key of another type, or empty, as it is (refused as before)."""
        check_key_batch(keys)
        scope, tail = self._key_scope, self._key_scope_bytes
        if not scope:
            return keys
        return [
            k + scope if type(k) is str and k else k + tail if type(k) is bytes and k else k
            for k in keys
        ]

    # -- regions and pages -------------------------------------------------------------------

    def get_chunk_size(self) -> int:
        return self._s.chunks.chunk_size

    def set_chunk_size(self, size: int | str) -> None:
        """Change the allocation unit before the first chunk is reserved (SGLang's page size
        is known only after connecting); the owned regions are cut again."""
        config = dataclasses.replace(self.config, chunk_size_bytes=size)  # validates it
        if config.chunk_size_bytes == self._s.chunks.chunk_size:
            return
        # (under the supply's lock: no region taken ahead, `RegionSupply.ready`, is adopted
        # between the re-cut and the handshake's list of our regions, which would drop it)
        with self._supply.lock:
            if not self._s.chunks.untouched():
                raise RuntimeError("set_chunk_size: chunks are already reserved")
            owned = [m for m in map(self._s.mapper.get, self._s.chunks.region_ids()) if m]
            self._s.chunks.set_chunk_size(config.chunk_size_bytes, owned)
            self._s.config = config
            if self._connected:  # the server counts our chunks in its page statistics
                self._handshake()

    def on_region_added(self, listener: Callable[[int], None]) -> None:
        """Call `listener(region_id)` for every region mapped into this process (owned or
        another instance's), those mapped already included."""
        self._s.mapper.add_listener(listener)

    def on_region_closing(self, listener: Callable[[int], None]) -> None:
        """Call `listener(address)` just before a region mapped there is unmapped, after the last
        copy that could use it: e.g. to unregister it from a device driver before reuse."""
        self._s.mapper.add_close_listener(listener)

    def get_buffer_view(self, region_id: int, offset: int, size: int) -> memoryview | None:
        """The bytes [offset, offset + size) of a mapped region (writable if we own it); None
        if the region is not mapped here or the range is outside it."""
        self._rpc.check_fork()  # a child writing there would write into its parent's pages
        view = self._s.mapper.view(region_id, offset, size)
        if view is not None and software():  # (read in place: no stale line of ours)
            address = np.frombuffer(view, np.uint8).ctypes.data if size else 0
            if invalidate_ranges(np.array([address]), np.array([size])) is not None:
                return None
        return view

    def get_region_page_count(self, region_id: int) -> int:
        """How many chunks a mapped region holds (0 if it is not mapped here)."""
        mapped = self._s.mapper.get(region_id)
        return mapped.handle.length // self._s.chunks.chunk_size if mapped is not None else 0

    def owned_region_ids(self) -> list[int]:
        return self._s.chunks.region_ids()

    def free_chunks(self) -> int:
        """Free chunks in owned regions."""
        return self._s.chunks.free_chunks()

    def store(
        self,
        key: Key,
        value: Buffer | AllocHandle | None = _NO_VALUE,
        *,
        data: Buffer | None = None,
        handle: AllocHandle | None = None,
        length: int | None = None,
    ) -> bool:
        """Store one value: `store(key, handle)` publishes a handle already written,
        `store(key, data)` (or `data=`) copies bytes in. True when the key is stored, also when
        it already was (keys are content hashes: the first value stays; `store_outcomes` tells
        the two apart). False, with a WARNING saying why, for a bad key (not str/bytes, empty,
        too long), a value not bytes-like (a str, None), empty or larger than the pool, or no
        room. ValueError only for a call that gives no value or two."""
        if value is not _NO_VALUE:
            if data is not None or handle is not None:  # (two values: neither is taken)
                raise ValueError("store() takes exactly one of data or handle")
            if not isinstance(value, AllocHandle):
                return self.batch_store([key], datas=[value])[0]
            handle = value
        if (data is None) == (handle is None):
            raise ValueError("store() takes exactly one of data or handle")
        if handle is not None:
            keys = self._in_scope([key])
            return self.seal(keys, [handle], None if length is None else [length]).wait()[0]
        return self.batch_store([key], datas=[data])[0]

    def batch_store(
        self,
        keys: Sequence[Key],
        values: Sequence[Buffer] | Sequence[AllocHandle | None] | None = None,
        *,
        datas: Sequence[Buffer] | None = None,
        handles: Sequence[AllocHandle | None] | None = None,
        lengths: Sequence[int] | None = None,
    ) -> list[bool]:
        """Store many values with one REGISTER_KV. `batch_store(keys, handles)` publishes
        handles already written (`lengths`: each value's length, default its `alloc` size);
        `batch_store(keys, datas)` reserves chunks and copies each value in. A key that
        already exists reports True (first writer won; our chunks come back)."""
        keys = self._in_scope(keys)  # (checks the batch)
        if values is not None:
            if any(isinstance(v, AllocHandle) for v in values):
                handles = values  # type: ignore[assignment]
            else:
                datas = values  # type: ignore[assignment]
        if handles is not None:
            if datas is not None or len(handles) != len(keys):
                raise ValueError("batch_store needs one handle per key and no data")
            return self.seal(keys, handles, lengths).wait()
        if datas is None or len(datas) != len(keys):
            raise ValueError("batch_store needs one data or one handle per key")
        return self._store_datas(keys, datas).results

    def store_outcomes(self, keys: Sequence[Key], datas: Sequence[Buffer]) -> list[StoreOutcome]:
        """`batch_store(keys, datas)` that tells, per key, STORED (now), EXISTED (the key was
        there: it keeps its first value, ours was not used) or FAILED."""
        keys = self._in_scope(keys)
        if len(datas) != len(keys):
            raise ValueError("store_outcomes needs one data per key")
        put = self._store_datas(keys, datas)
        return put.outcomes or [StoreOutcome.FAILED] * len(keys)

    def _store_datas(self, keys: Sequence[Key], datas: Sequence[Buffer]) -> Put:
        """`put` of bytes, copied from the buffers (a refused value gets no chunks)."""
        self._ensure_connected()
        views = [_bytes_of(d) for d in datas]  # None: not bytes-like, refused as a bad key is
        sizes = [-1 if v is None else v.size for v in views]
        pointers = [0 if v is None else v.ctypes.data for v in views]
        put = Put(keys, sizes, from_pointers(pointers, sizes))
        self.put([put])
        return put

    def reserve_values(self, size: int, count: int) -> list[AllocHandle] | None:
        """`count` values of `size` bytes for a caller that writes them itself (LMCache's
        allocator): one run if free, else value by value; None (nothing kept) if any is missing."""
        run = self.alloc(size, count)
        if run is not None:
            return run.split()
        handles: list[AllocHandle] = []
        try:
            while count > 1 and len(handles) < count:  # (one value: alloc already evicted)
                handle = self.alloc(size)
                if handle is None:
                    break
                handles.append(handle)
        finally:
            if len(handles) < count:  # (none kept: a partial batch is of no use)
                for handle in handles:
                    self.free(handle)
        return handles if len(handles) == count else None

    def retrieve(self, key: Key) -> MemoryInfo | None:
        return self.batch_retrieve([key])[0]

    def batch_retrieve(self, keys: Sequence[Key]) -> list[MemoryInfo | None]:
        """Views into shared memory (no copy), one lookup, valid while the key is registered: to
        copy them out while other instances may delete or evict, use `leased(keys)` (or pin
        them first, as LMCache does). A key pinned here only under an instance that has ended
        since (reaped, or forgotten by a server restart: its pins went with it) is a miss,
        WARNING: nothing keeps its view in place any more (`_PinBook`)."""
        keys = self._in_scope(keys)
        infos = self.lookup(keys).infos()
        book = self._pin_book
        if book is not None:  # (the instance asked after the lookup: it may have changed)
            lost = book.lost(self.instance_id, keys)
            if any(lost):
                log.warning(
                    "instance %s: %d of %d keys (first %r) were pinned by this handler under "
                    "an instance that ended since (reaped, or a server restart), their pins "
                    "with it: misses until unpinned or pinned again",
                    self.instance_id,
                    sum(lost),
                    len(keys),
                    next(k for k, gone in zip(keys, lost) if gone),
                )
                infos = [None if gone else info for info, gone in zip(infos, lost)]
        return infos

    @contextmanager
    def leased(self, keys: Sequence[Key]) -> Iterator[list[MemoryInfo | None]]:
        """`batch_retrieve` whose hits are neither evicted nor deleted until the block ends.
        Leaving it confirms the lease (one round trip): if it ended before (the block outlived
        --lease-timeout, or the server restarted), raises `LeaseExpired` naming the hits, whose
        bytes read may not be theirs. A block left by an exception just releases."""
        found = self.lookup(self._in_scope(keys), lease=True)
        try:
            infos = found.infos()
            yield infos
        except BaseException:
            found.release()
            raise
        if not found.release(confirm=True):
            raise LeaseExpired([key for key, info in zip(keys, infos) if info is not None])

    def exists(self, key: Key, *, prefix: Key = "") -> bool:
        return self.batch_exists([key], prefix=prefix)[0]

    def pin(self, key: Key) -> bool:
        return self.batch_pin([key])[0]

    def unpin(self, key: Key) -> bool:
        return self.batch_unpin([key])[0]

    def batch_pin(self, keys: Sequence[Key], *, leading: bool = True) -> list[bool]:
        """Pinned keys are neither deleted nor evicted until unpinned (or until this instance
        disconnects or is reaped). LMCache's pinned lookups come here: with a cluster tier
        behind the pool, the misses it holds are pulled first (within --cluster-lookup-ms).

        By default (`leading`) only the keys from the start up to the first miss are pinned,
        in one request: a prefix lookup (LMCache's `batched_contains(pin=True)`) uses those
        and unpins only those; a key after the gap, pinned too, would stay pinned for the
        instance's whole life. Keys after the first miss are neither pinned nor reported
        True. `leading=False`: every key that exists is pinned."""
        keys = self._in_scope(keys)
        if self._cluster.budget_s:
            self._cluster.pull(keys, "", self._local_index())
        # (the instance before the request: one that ends during it makes these pins look
        # lost, a miss, never the other way round)
        instance_id = self.instance_id
        if not leading:
            pinned = self._per_key(MsgType.PIN, keys, bool)
        else:
            asked = self._ask_per_key(MsgType.PIN, keys, bool, {"leading": True})
            if asked is None:
                return [False] * len(keys)
            pinned = asked
            run = pinned.index(False) if False in pinned else len(pinned)
            after = [key for key, ok in zip(keys[run:], pinned[run:]) if ok]
            if after:  # a server that ignores `leading` (older) pinned past the gap: let go
                self._per_key(MsgType.UNPIN, after, bool)
                pinned[run:] = [False] * (len(pinned) - run)
        if any(pinned):
            self._pins().took(instance_id, [key for key, ok in zip(keys, pinned) if ok])
        return pinned

    _pin_book: _PinBook | None = None

    def _pins(self) -> _PinBook:
        book = self._pin_book
        if book is None:
            with _PIN_BOOK_LOCK:  # (made once, at the first pin)
                book = self._pin_book
                if book is None:
                    book = self._pin_book = _PinBook()
        return book

    def batch_unpin(self, keys: Sequence[Key]) -> list[bool]:
        """False (logged at WARNING) where this instance holds no pin on the key: never
        pinned, or its pins went with it when it was reaped (a reader on another host silent
        past --heartbeat-timeout) or disconnected, and the bytes of views read under them may
        have been reused since."""
        keys = self._in_scope(keys)
        results = self._ask_per_key(MsgType.UNPIN, keys, bool)
        if self._pin_book is not None:  # (the caller lets go of them, whatever the answer)
            answered = [False] * len(keys) if results is None else results
            self._pin_book.let_go(self.instance_id, keys, answered)
        if results is None:
            return [False] * len(keys)
        lost = [key for key, ok in zip(keys, results) if not ok]
        if lost:
            log.warning(
                "instance %s: unpin of %d of %d keys (first %r) found no pin of ours: never "
                "pinned, or dropped when this instance was reaped or disconnected; zero-copy "
                "views read under such a pin may have been reused",
                self.instance_id,
                len(lost),
                len(keys),
                lost[0],
            )
        return results

    def delete_prefix(self, prefix: Key, *, cluster: bool = False) -> int:
        """Delete every unpinned key that starts with `prefix`; returns how many went.
        `cluster`: the server's cluster tier also removes their objects from Mooncake, else
        the next lookup on any node pulls the values back (a WARNING when its tier is not
        connected: then only the pool was cleared; a server without a tier has only a pool)."""
        self._ensure_connected()
        body: dict[str, Any] = {"prefix": prefix}
        if cluster:
            body["cluster"] = True
        reply = self._request(MsgType.DELETE_PREFIX, body).result()
        if cluster and not reply.get("cluster"):
            tier = bool(self._cluster.budget_s)  # (HANDSHAKE announced one)
            log.log(
                logging.WARNING if tier else logging.INFO,
                "delete_prefix(%r): only the pool was cleared: %s",
                prefix,
                "the server's cluster tier is not connected (`maru status` says why)"
                if tier
                else "the server has no cluster tier",
            )
        return int(reply["deleted"])

    def delete(self, key: Key) -> bool:
        return self.batch_delete([key])[0]

    def batch_delete(self, keys: Sequence[Key]) -> list[bool]:
        """True where the key was deleted; a pinned, leased or unknown key reports False."""
        keys = self._in_scope(keys)
        return self._per_key(MsgType.DELETE_KV, keys, lambda s: s == DeleteStatus.DELETED)

    def copying(self) -> AbstractContextManager[None]:
        """Around a copy at addresses this handler gave: no region is closed under it (e.g. by
        another thread's re-handshake), only after the last such block."""
        return self._s.mapper.copying()

    # -- introspection -----------------------------------------------------------------------

    @property
    def refused_stores(self) -> Counter[str]:
        """Stores refused before anything was sent, by reason (see `refuse_bad_stores`)."""
        return self._s.refused_stores

    @property
    def checksum_mismatches(self) -> int:
        """Hits taken as misses: bytes unlike their writer's checksum."""
        return self._s.checksum_mismatches

    @property
    def leases_ended(self) -> int:
        """Hits taken as misses because their lease ended before their copy was confirmed
        (--lease-timeout, a server restart): their pages may have been reused, so a checksum
        unlike theirs then is counted here, not in `checksum_mismatches`."""
        return self._s.leases_ended

    def stats(self) -> dict[str, Any]:
        """The server's statistics (pool usage, keys, per-instance counters): asked without a
        handshake (a handler not connected yet may ask), but not of a closed handler."""
        if self._closed:
            raise MaruNotConnected(self.config.server_url, "this MaruHandler was closed")
        return self._request(MsgType.STATS, {}).result()["stats"]

    get_stats = stats  # the original Maru's name for it

    def healthcheck(self) -> bool:
        """Whether this handler is connected and the server answers a heartbeat now (the
        original Maru's check); False, with the reason logged, otherwise. Never raises."""
        if not self._connected:
            return False
        try:
            self._request(MsgType.HEARTBEAT, self._local_reads()).result()
        except MaruError as exc:
            log.warning("healthcheck of %s failed: %s", self.config.server_url, exc)
            return False
        return True

    def list_allocations(self, *, all_instances: bool = False) -> list[RegionHandle]:
        body: dict[str, Any] = {} if all_instances else {"owner": self.instance_id}
        reply = self._request(MsgType.LIST_ALLOCATIONS, body).result()
        return [RegionHandle.from_wire(f) for f in reply["regions"]]
