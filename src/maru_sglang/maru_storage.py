"""SGLang HiCache L3 backend: `MaruStorage`.

Loaded by SGLang's dynamic backend factory (`cls(storage_config, {})`, then
`register_mem_pool_host(pool)`) with `--hicache-storage-backend dynamic` and the extra config
`{"backend_name": "maru", "module_path": "maru_sglang.maru_storage", "class_name": "MaruStorage",
"interface_v1": 1, "maru_server_url": ..., "maru_pool_size": ...}`.

Zero-copy: a page's parts in the host pool (K and V buffers, a Mamba state's temporal and conv
tensors, an indexer page...) are copied straight into one shared-memory allocation, back to
back, and back again on a hit: one copy per part, all of a batch's parts of one pool in one
call (`maru.client.memcopy.copy_many`, streaming stores). One metadata RPC per batch each way,
across every pool of the batch; no intermediate buffer.

Two interfaces, one data path (`_write` / `_read`):
- v1 (`batch_set_v1` / `batch_get_v1` / `batch_exists`): the KV pool, for every model;
- v2 (`register_mem_host_pool_v2`, `batch_exists_v2`, `batch_get_v2`, `batch_set_v2`): the
  sidecar pools of hybrid models (Mamba, SWA, DSA indexer, DeepSeek-V4 compressed pools, draft
  pools), which SGLang's `HybridCacheController` drives; see `pools.py` for how each pool's
  keys are scoped.

Beside it: `hit_policy.py` (which prefix `batch_exists_v2` reports, from the one existence
answer), `storage_stats.py` (the counters and SGLang's `StorageMetrics`), `legacy.py` (the
interface with `interface_v1` off, page tensors copied one by one).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolTransfer,
    PoolTransferResult,
)

from maru import MaruConfig, MaruHandler
from maru.client.memcopy import CopyFaultError
from maru.client.requests import Sealing
from maru_sglang.hit_policy import PoolPresence, usable_prefix
from maru_sglang.legacy import LegacyInterface
from maru_sglang.pools import (
    KV_POOL_NAME,
    PoolIO,
    chunk_size_for,
    is_rank_replicated,
    page_namespace,
    sidecar_namespace,
)
from maru_sglang.storage_stats import StorageStats

__all__ = ["KV_POOL_NAME", "MaruStorage", "chunk_size_for", "page_namespace"]

log = logging.getLogger(__name__)

SUPPORTED_LAYOUTS = ("page_first_direct", "page_first")

# Waiting for the replies (`maru_use_async_rpc` off), a call's last run (a v1 batch's only one)
# is registered in up to PIPELINE_PIECES pieces of at least PIPELINE_MIN_PAGES pages, each sent
# while the next piece is copied. With write-behind nothing waits for the last reply, and one
# REGISTER_KV costs less than two: one piece (docs/performance-history.md, issue 17 session 15).
PIPELINE_PIECES = 2
PIPELINE_MIN_PAGES = 32


@dataclasses.dataclass
class _Batch:
    """One pool's share of a storage call: its pages' keys and where they are in the host
    pool (`buffers`: `PoolIO.pointers`, one row per page); `results` is filled in."""

    pool: PoolIO
    keys: list[str]
    buffers: np.ndarray | None = None
    results: list[bool] = dataclasses.field(default_factory=list)


# a Sealing's pages, in the order of its keys: (batch, first page, count)
Owners = list[tuple[_Batch, int, int]]


class _Unconfirmed(threading.local):
    """One thread's registrations whose replies a write call did not wait for (write-behind),
    each with the batches it answers for and the results the call reported."""

    def __init__(self) -> None:
        self.sealings: list[tuple[Owners, Sealing, list[bool]]] = []


def _query(parts: list[tuple[PoolIO, list[str]]]) -> tuple[list[str], str | list[str]]:
    """Several pools' page hashes as one handler call takes them: the hashes, and the
    prefix of their pools' namespaces (one for one pool, else one per hash), which the
    handler's index paths take beside them (no string made per key)."""
    if len(parts) == 1:
        pool, hashes = parts[0]
        return hashes, pool.prefix
    return [h for _, hashes in parts for h in hashes], [p.prefix for p, hs in parts for _ in hs]


def open_handler(
    extra: dict[str, Any], tp_rank: int, tp_size: int, **overrides: Any
) -> tuple[MaruConfig, MaruHandler]:
    """The `maru_*` keys of an SGLang extra config -> a connected handler (MaruStorage and the
    linker both start here). `overrides`: MaruConfig fields the caller derives (a chunk size).
    Not connected -> `RuntimeError: Failed to connect MaruHandler to <url>: <why>`."""
    config = MaruConfig.from_mapping(extra, prefix="maru_")
    # Each rank is an instance of its own (the server names it, the name only reads well): a
    # configured name gets the rank, so ranks stay apart in `maru stats`.
    if "maru_instance_id" in extra and tp_size > 1:
        overrides.setdefault("instance_id", f"{config.instance_id}/tp{tp_rank}")
    if overrides:
        config = dataclasses.replace(config, **overrides)
    handler = MaruHandler(config)
    if not handler.connected:
        # The seed's text first (`RuntimeError: Failed to connect MaruHandler to <url>`), then
        # why (down, refused, another version), once.
        error = handler.connect_error
        handler.close()
        reason = f": {error.reason}" if error is not None else ""
        raise RuntimeError(
            f"Failed to connect MaruHandler to {config.server_url}{reason}"
        ) from None
    return config, handler


class _FaultedCopy:
    """A copy that faulted as it began: `finish()` raises the fault (`MaruStorage._copy_in`)."""

    def __init__(self, exc: CopyFaultError):
        self.exc = exc

    def finish(self) -> None:
        raise self.exc


class MaruStorage(LegacyInterface, HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig, args: Any = None):
        self.storage_config = storage_config
        extra = dict(storage_config.extra_config or {})
        # Unless the user chose one, the chunk size follows the page sizes (known only when
        # the pools register, before any chunk is reserved): with the 1 MiB default a 16 KiB
        # page would hold 1 MiB.
        self._chunk_from_page = "maru_chunk_size_bytes" not in extra
        self.config, self.handler = open_handler(
            extra, storage_config.tp_rank, storage_config.tp_size
        )
        self.mem_pool_host: Any = None
        self.namespace = ""  # the KV pool's
        self._kv: PoolIO | None = None
        self.pools: dict[str, PoolIO] = {}
        self._stats = StorageStats(bool(storage_config.enable_storage_metrics))
        self._unconfirmed = _Unconfirmed()
        # the ids of threads with unconfirmed registrations: a read's check is a set lookup
        # (a thread-local lookup costs ~3x more); only a thread adds or removes its own id
        self._unconfirmed_threads: set[int] = set()
        log.info(
            "MaruStorage connected to %s as instance %s",
            self.config.server_url,
            self.handler.instance_id,
        )

    # -- registration ------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """The KV pool (the anchor of a hybrid model's pool group)."""
        layout = getattr(mem_pool_host, "layout", None)
        logical = getattr(mem_pool_host, "kv_buffer", True) is None
        if layout not in SUPPORTED_LAYOUTS and not logical:
            raise ValueError(
                f"MaruStorage does not support host memory layout {layout!r}: "
                "use --hicache-mem-layout page_first_direct (or page_first)"
            )
        super().register_mem_pool_host(mem_pool_host)
        replicated = bool(self.storage_config.is_mla_model)
        namespace = "" if logical else page_namespace(self.storage_config, mem_pool_host)
        self._kv = PoolIO(KV_POOL_NAME, mem_pool_host, namespace, replicated)
        self.pools[KV_POOL_NAME] = self._kv
        self.namespace = namespace
        self._fit_chunk_size()
        log.info(
            "MaruStorage: KV namespace %s, %d-byte pages in %d part(s), layout %s",
            namespace or "(logical pool: nothing stored)",
            self._kv.page_bytes,
            self._kv.parts,
            layout,
        )

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """A hybrid model's host pool (SGLang registers the KV anchor here too). Each pool's
        pages get a namespace of their own (`pools.sidecar_namespace`)."""
        name = str(host_pool_name)
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        if name == KV_POOL_NAME:
            if host_pool is not self.mem_pool_host:
                self.register_mem_pool_host(host_pool)
            return
        replicated = is_rank_replicated(self.storage_config, host_pool)
        probe = PoolIO(name, host_pool, "", replicated)
        namespace = sidecar_namespace(
            self.storage_config, name, host_pool, probe.part_sizes, replicated
        )
        probe.namespace = namespace
        self.pools[name] = probe
        log.info(
            "MaruStorage: pool %s namespace %s, %d-byte pages in %d part(s)%s%s",
            name,
            namespace,
            probe.page_bytes,
            probe.parts,
            ", rank-replicated" if replicated else "",
            ", whole-page copies" if probe.whole_page else "",
        )

    def on_host_pools_registered(self) -> None:
        """Every pool of this attach is known: size the chunks for all of them."""
        self._fit_chunk_size()
        log.info("MaruStorage: pools %s", ", ".join(sorted(self.pools)))

    def _fit_chunk_size(self) -> None:
        """One chunk per page of the smallest pool (rounded up to 4 KiB): a larger pool's page
        takes a run of chunks, wasting less than one chunk; only before any chunk is used."""
        sizes = [p.page_bytes for p in self.pools.values() if p.page_bytes]
        if not self._chunk_from_page or not sizes:
            return
        chunk = min(chunk_size_for(size) for size in sizes)
        if chunk > self.config.pool_size or chunk == self.handler.get_chunk_size():
            return
        try:
            self.handler.set_chunk_size(chunk)
        except RuntimeError as exc:  # chunks in use (a pool registered after the first write)
            log.info("MaruStorage: chunk size stays %d: %s", self.handler.get_chunk_size(), exc)
            return
        self.config = self.handler.config
        log.info("MaruStorage: chunk size %d bytes", chunk)

    @property
    def _page_bytes(self) -> int:
        """Bytes of one KV page."""
        return self._kv.page_bytes if self._kv is not None else 0

    def _require_pool(self) -> PoolIO:
        if self._kv is None:
            raise RuntimeError("MaruStorage: register_mem_pool_host() was not called")
        return self._kv

    # -- the data path, shared by v1 and v2 --------------------------------------------------

    def _prepare(self, batch: _Batch, host_indices: torch.Tensor | None, op: str) -> bool:
        """Host pointers for `batch`; False (the batch fails) when the indices do not cover
        its pages."""
        batch.buffers = batch.pool.pointers(host_indices, len(batch.keys))
        if batch.buffers is None:
            got = host_indices.numel() if host_indices is not None else 0
            log.error(
                "%s: pool %s: %d host indices for %d keys (page size %d)",
                op,
                batch.pool.name,
                got,
                len(batch.keys),
                batch.pool.page_size,
            )
            batch.results = [False] * len(batch.keys)
            return False
        return True

    def _write(self, batches: list[_Batch]) -> None:
        """Copy every batch's pages into a shared allocation (one run per pool) and register
        them. A run of at least PIPELINE_MIN_PAGES pages is sealed as soon as it is copied, so
        that its registration is in flight while the rest is copied (the call's last run, with
        nothing after it to hide behind, in up to PIPELINE_PIECES pieces when the call waits
        for the replies); smaller runs, and pages placed one by one, are sealed together at
        the end. With `maru_checksums` each page is hashed as it is copied (no second read).
        Fills each batch's `results`.

        Write-behind (with `maru_use_async_rpc`, the default): the call returns once every
        page is copied and its registration sent, reporting each sent page as stored; the
        replies are read by this thread's next call (`confirm_writes`: a read first, a write
        after its own copies). A page is in the pool before its key is sent, so the only thing
        deferred is learning that a registration failed (server gone or restarted): such a
        page reads as a miss, and is logged and counted then (`late_write_failures`)."""
        start = time.perf_counter()
        handler = self.handler
        hashed, threads = handler.config.checksums, handler.config.copy_threads
        behind = self.config.use_async_rpc
        pieces = 1 if behind else PIPELINE_PIECES
        sealings: list[tuple[Owners, Sealing]] = []
        rest: list[tuple[_Batch, list[str], Any, np.ndarray | None]] = []  # sealed together
        # (no region unmapped under the copies: `MaruHandler.copying`)
        with handler.copying():
            for number, batch in enumerate(batches, 1):
                pool, n, buffers = batch.pool, len(batch.keys), batch.buffers
                assert buffers is not None
                batch.results = [False] * n
                ns_keys = pool.keys(batch.keys)
                run = handler.alloc(pool.page_bytes, n)
                if run is None:  # no free run: page by page (each may evict in our own regions)
                    rest.append((batch, ns_keys, *self._copy_pages(batch, hashed)))
                    continue
                if n < PIPELINE_MIN_PAGES:
                    copied, sums = self._copy_in(pool, run, buffers, 0, n, hashed, threads)
                    if copied:
                        rest.append((batch, ns_keys, run, sums))
                    continue
                step = n if number < len(batches) else max(PIPELINE_MIN_PAGES, -(-n // pieces))
                for first in range(0, n, step):
                    last = min(n, first + step)
                    piece = run.slice(first, last) if step < n else run
                    copy = self._start_copy(pool, piece, buffers, first, last, hashed, threads)
                    # While the copier threads copy, this thread makes the registration
                    # ready (it reads no page) and, on the call's last copy, reads the
                    # earlier calls' replies that are in and need no re-handshake
                    # (`Sealing.arrived`); the rest after the copy.
                    sealing = handler.prepare_seal(ns_keys[first:last], piece, pool.page_bytes)
                    if behind and number == len(batches) and last == n:
                        self.confirm_writes(wait=False)
                    copied, sums = self._copy_in(pool, piece, buffers, first, last, hashed, 0, copy)
                    if copied:
                        sealings.append(([(batch, first, last - first)], sealing.send(sums)))
        if len(rest) == 1:  # (one run or one batch's pages: sealed as they are)
            batch, ns_keys, handles, sums = rest[0]
            sealing = handler.seal(ns_keys, handles, batch.pool.page_bytes, checksums=sums)
            sealings.append(([(batch, 0, len(ns_keys))], sealing))
        elif rest:
            sealings.append(self._seal_together(rest))
        # The earlier calls' replies, now: the server answered them during this call's copies
        # (read at the start of the call, the last one would cost its whole answer time).
        self.confirm_writes()
        for owners, sealing in sealings:
            results, at = sealing.hoped() if behind else sealing.wait(), 0
            for batch, first, count in owners:
                batch.results[first : first + count] = results[at : at + count]
                at += count
            if behind:
                self._unconfirmed.sealings.append((owners, sealing, results))
                self._unconfirmed_threads.add(threading.get_ident())
        self._stats.account_write(batches, time.perf_counter() - start)

    def confirm_writes(self, wait: bool = True) -> int:
        """Wait until the server has registered every page this thread's write calls
        returned for (write-behind, see `_write`): from then on every instance finds them.
        The thread's own later calls do it by themselves (a read before it looks, a write
        after its copies); another instance reading right after a write (a test, a handover)
        calls it. Returns the number of pages those calls reported stored whose registration
        failed (logged, counted as `late_write_failures`): they read as misses. `wait=False`:
        only the registrations whose replies are in, oldest first (a write's, during its copy)."""
        thread = threading.get_ident()
        if thread not in self._unconfirmed_threads:  # (a read's usual case)
            return 0
        unconfirmed = self._unconfirmed.sealings
        if not wait:
            ready = 0
            while ready < len(unconfirmed) and unconfirmed[ready][1].arrived():
                ready += 1
            unconfirmed, self._unconfirmed.sealings = unconfirmed[:ready], unconfirmed[ready:]
        else:
            self._unconfirmed.sealings = []
        if not self._unconfirmed.sealings:
            self._unconfirmed_threads.discard(thread)
        if not unconfirmed:
            return 0
        lost_total = 0
        for owners, sealing, reported in unconfirmed:
            results, at = sealing.wait(), 0
            if results == reported:  # (the usual outcome: no per-page step)
                continue
            for batch, _first, count in owners:
                span = zip(reported[at : at + count], results[at : at + count])
                lost = sum(1 for said, got in span if said and not got)
                at += count
                if lost:
                    self._stats.count(batch.pool.name, late_write_failures=lost)
                    lost_total += lost
        if lost_total:
            log.warning(
                "MaruStorage: %d page(s) an earlier write reported stored may not be registered "
                "(the reason is logged above): they may read as misses",
                lost_total,
            )
        return lost_total

    def _copy_pages(self, batch: _Batch, hashed: bool) -> tuple[list[Any], np.ndarray | None]:
        """`batch` page by page, when no run of its size is free: an allocation per page
        (None where none could be made) and, with `hashed`, each page's checksum."""
        handler, pool, buffers = self.handler, batch.pool, batch.buffers
        assert buffers is not None
        handles = [handler.alloc(pool.page_bytes) for _ in batch.keys]
        sums = np.zeros(len(handles), np.int64)
        for i, handle in enumerate(handles):
            if handle is not None:
                copied, got = self._copy_in(pool, handle, buffers, i, i + 1, hashed)
                if not copied:  # the key fails (sealed with no handle)
                    handles[i] = None
                sums[i] = got[0] if got is not None else 0
        return handles, sums if hashed else None

    @staticmethod
    def _start_copy(
        pool: PoolIO,
        handle: Any,
        buffers: np.ndarray,
        first: int,
        last: int,
        hashed: bool,
        threads: int,
    ) -> Any:
        """`pool.copy_in` begun into `handle`; a fault while it begins (a pool copied page
        by page) is kept for `_copy_in` to report at `finish()`."""
        try:
            return pool.copy_in(
                handle.address, handle.stride, buffers, first, last, hashed, threads
            )
        except CopyFaultError as exc:
            return _FaultedCopy(exc)

    def _copy_in(
        self,
        pool: PoolIO,
        handle: Any,
        buffers: np.ndarray,
        first: int,
        last: int,
        hashed: bool,
        threads: int = 1,
        started: Any = None,
    ) -> tuple[bool, np.ndarray | None]:
        """Copy pages [first, last) of a batch into `handle` (or finish `started`, the copy
        begun there): (True, checksums); or (False, None) if the pool's memory faulted under
        it (its file truncated, its filesystem out of room): the pages fail, the handle's
        chunks are given back unsealed, and the process lives (`maru.client.memcopy`)."""
        if started is None:
            started = self._start_copy(pool, handle, buffers, first, last, hashed, threads)
        try:
            return True, started.finish()
        except CopyFaultError as exc:
            log.warning(
                "write: pages %d-%d of a %s batch failed, the pool's memory faulted under "
                "the copy: %s",
                first,
                last - 1,
                pool.name,
                exc,
            )
            self.handler.free(handle)
            return False, None

    def _seal_together(self, rest: list) -> tuple[Owners, Sealing]:
        """One registration for several whole batches' pages (`_write`'s `rest`): the batches
        it answers for, as `_write` keeps them, and the Sealing."""
        keys: list[str] = []
        handles: list[Any] = []
        lengths: list[int] = []
        sums: list[np.ndarray] = []
        owners: Owners = []
        for batch, ns_keys, held, batch_sums in rest:
            n = len(ns_keys)
            keys += ns_keys
            handles += held if isinstance(held, list) else held.split()
            lengths += [batch.pool.page_bytes] * n
            owners.append((batch, 0, n))
            if batch_sums is not None:
                sums.append(batch_sums)
        checksums = np.concatenate(sums) if sums else None
        return owners, self.handler.seal(keys, handles, lengths, checksums=checksums)

    def _read(self, batches: list[_Batch], host_indices: list[torch.Tensor | None]) -> None:
        """Copy every batch's hits into its host pool and prove them: a page stored with
        another length is a miss; so is, with `maru_checksums`, a page whose bytes no longer
        match their checksum after the copy, and on the local index a page whose entry changed
        during the copy; a lease that ended mid-copy makes every page a miss (not proven). A
        batch of a pool copied by `copy_values` is one `MaruHandler.read` (on the local index
        one C call, no request): every v1 call, and each pool of a v2 call while the index is
        local. The rest (pools copied through their own API; every pool of a v2 call on the
        request path) take one leased lookup together (`_read_pools`). Fills each batch's
        `results`."""
        self.confirm_writes()
        start = time.perf_counter()
        handler = self.handler
        one_by_one = len(batches) == 1 or handler.reads_locally
        rest: list[tuple[_Batch, torch.Tensor | None]] = []
        for batch, indices in zip(batches, host_indices):
            pool = batch.pool
            if pool.whole_page or not one_by_one:
                rest.append((batch, indices))
            elif self._prepare(batch, indices, "read"):
                assert batch.buffers is not None
                mismatches = handler.checksum_mismatches
                batch.results = handler.read(
                    batch.keys,
                    batch.buffers,
                    pool.sizes,
                    length=pool.page_bytes,
                    prefix=pool.prefix,
                )
                if handler.checksum_mismatches != mismatches:
                    self._stats.count(
                        pool.name, checksum_mismatches=handler.checksum_mismatches - mismatches
                    )
        if rest:
            together = [b for b, _ in rest]
            keys, prefix = _query([(b.pool, b.keys) for b in together])
            with handler.copying():
                self._read_pools(together, [i for _, i in rest], keys, prefix)
        self._stats.account_read(batches, time.perf_counter() - start)

    def _read_pools(
        self,
        batches: list[_Batch],
        host_indices: list[torch.Tensor | None],
        keys: list[str],
        prefix: str | list[str],
    ) -> None:
        """`_read` of several pools (v2), or of a pool copied page by page through its API."""
        hashed = self.handler.config.checksums
        found = self.handler.lookup(keys, lease=True, for_copy=True, prefix=prefix)  # sent now
        try:
            ready = [self._prepare(b, idx, "read") for b, idx in zip(batches, host_indices)]
            offset = 0
            for batch, ok in zip(batches, ready):
                first, offset = offset, offset + len(batch.keys)
                if ok:
                    copy = functools.partial(
                        batch.pool.copy_out,
                        buffers=batch.buffers,
                        hashed=hashed,
                        threads=self.config.copy_threads,
                    )
                    found.copy_out(copy, batch.pool.page_bytes, start=first, stop=offset)
            corrupt = found.corrupt()  # after the copies, of the bytes the copies read
        except BaseException:
            found.release()
            raise
        copied = found.copied if found.copied is not None else np.zeros(len(keys), bool)
        proven = copied & ~corrupt
        if not found.release(confirm=True):  # the lease ended mid-copy: not proven
            log.warning("read: the lease on %d pages ended during the copy", len(keys))
            proven[:] = False
        offset = 0
        for batch, ok in zip(batches, ready):
            seg = slice(offset, offset + len(batch.keys))
            offset = seg.stop
            if ok:
                batch.results = proven[seg].tolist()
                bad = int(np.count_nonzero(copied[seg] & corrupt[seg]))
                if bad:
                    self._stats.count(batch.pool.name, checksum_mismatches=bad)

    # -- v1: the KV pool ---------------------------------------------------------------------

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Copy each KV page's parts from the host pool into one shared allocation, then
        register the batch; returns without waiting for the reply (write-behind, `_write`)."""
        kv = self._require_pool()
        if not keys:
            return []
        if kv.logical:
            return [True] * len(keys)
        batch = _Batch(kv, list(keys))
        if self._prepare(batch, host_indices, "batch_set_v1"):
            self._write([batch])
        return batch.results

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Copy each stored page into the host pool and prove it (`_read`): on the local
        index one C call and no request, else one leased lookup (no instance evicts or deletes
        the pages mid-copy); True per page proven."""
        kv = self._require_pool()
        if not keys:
            return []
        if kv.logical:
            return [True] * len(keys)
        batch = _Batch(kv, list(keys))
        self._read([batch], [host_indices])
        # One line per prefetch batch (at most 128 pages): the examples and the P2P test look
        # for it in the second instance's log.
        log.info("batch_get_v1 result: %d/%d hits", sum(batch.results), len(keys))
        return batch.results

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """Number of consecutive stored KV pages from the start: on the local index no request
        and nothing probed after the first miss, else one EXISTS request."""
        kv = self._require_pool()
        if kv.logical:
            return len(keys)
        self.confirm_writes()
        return self.handler.leading_hits(keys, prefix=kv.prefix)

    # -- v2: every pool ----------------------------------------------------------------------

    def _pool_for(self, transfer: PoolTransfer) -> PoolIO | None:
        pool = self.pools.get(str(transfer.name))
        if pool is None:
            log.error("pool %s was never registered: its pages are misses", transfer.name)
        return pool

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """The usable prefix of `keys` (KV page hashes) given every pool's hit policy, with one
        RPC for the KV pages and every pool's pages together; the policies' arithmetic is in
        `hit_policy.usable_prefix`."""
        kv = self._require_pool()
        n = len(keys)
        transfers = list(pool_transfers or [])
        own_keys: list[list[str]] = []  # per transfer: the page hashes to look up
        for t in transfers:
            block = t.hit_policy == PoolHitPolicy.BLOCK_GROUPS
            own_keys.append(list(t.keys or []) if block else list(keys))
        parts = [] if kv.logical else [(kv, keys)]
        pools = [self.pools.get(str(t.name)) for t in transfers]
        parts += [(p, hs) for p, hs in zip(pools, own_keys) if p is not None and not p.logical]
        query, prefix = _query(parts)
        self.confirm_writes()
        found = self.handler.batch_exists(query, prefix=prefix) if query else []
        present = np.array(found, dtype=bool)
        offset = 0 if kv.logical else n
        answers: list[PoolPresence] = []
        for t, pool, hashes in zip(transfers, pools, own_keys):
            mine: np.ndarray | None = None  # never registered
            if pool is not None and pool.logical:
                mine = np.ones(len(hashes), dtype=bool)
            elif pool is not None:
                mine = present[offset : offset + len(hashes)]
                offset += len(hashes)
            window = max(1, len(t.keys or ()))
            answers.append(
                PoolPresence(str(t.name), t.hit_policy, mine, window, t.group_pages, t.block_pages)
            )
        kv_present = np.ones(n, dtype=bool) if kv.logical else present[:n]
        return PoolTransferResult(*usable_prefix(kv_present, answers, KV_POOL_NAME))

    def _v2_batches(self, transfers: list[PoolTransfer], op: str, writing: bool):
        """Split a v2 call into per-pool batches; the results of pools that need no IO (not
        registered, logical, bad indices, or rank-replicated on a rank that does not write)
        are settled here."""
        results: dict[str, list[bool]] = {}
        batches: list[_Batch] = []
        indices: list[torch.Tensor | None] = []
        for t in transfers:
            name, keys = str(t.name), list(t.keys or [])
            pool = self._pool_for(t)
            if pool is None:
                results[name] = [False] * len(keys)
            elif not keys:
                results[name] = []
            elif pool.logical:
                results[name] = [True] * len(keys)
            elif writing and pool.replicated and not self.storage_config.is_storage_writer:
                # The same bytes on every rank: the writer rank stores them (SGLang's
                # controllers count a non-writer's backup as done, as here).
                results[name] = [True] * len(keys)
            else:
                batch = _Batch(pool, keys)
                if writing and not self._prepare(batch, t.host_indices, op):
                    results[name] = batch.results
                    continue
                batches.append(batch)
                indices.append(t.host_indices)
        return results, batches, indices

    def batch_get_v2(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> dict[str, list[bool]]:
        """Read every transfer's pages into its host pool: one leased lookup for all pools,
        one copy per page part. A pool's result list is per key."""
        results, batches, indices = self._v2_batches(transfers, "batch_get_v2", writing=False)
        if batches:
            self._read(batches, indices)
        for batch in batches:
            results[batch.pool.name] = batch.results
        log.info(
            "batch_get_v2 result: %s",
            ", ".join(f"{name} {sum(r)}/{len(r)}" for name, r in results.items()),
        )
        return results

    def batch_set_v2(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> dict[str, list[bool]]:
        """Write every transfer's pages from its host pool: one allocation run and one copy
        per page part per pool; a large pool's run registered while the next is copied, small
        ones together (`_write`)."""
        results, batches, _ = self._v2_batches(transfers, "batch_set_v2", writing=True)
        if batches:
            self._write(batches)
        for batch in batches:
            results[batch.pool.name] = batch.results
        return results

    # -- housekeeping ------------------------------------------------------------------------

    def clear(self) -> None:
        """Remove every page of this instance's namespaces (each registered pool's; other
        models, ranks and geometries are untouched)."""
        self.confirm_writes()
        for namespace in sorted({p.namespace for p in self.pools.values() if p.namespace}):
            removed = self.handler.delete_prefix(namespace + ":")
            log.info("MaruStorage: cleared %d pages of namespace %s", removed, namespace)

    @property
    def counters(self) -> dict[str, Any]:
        """Cumulative counters over every pool, and per pool under `pools`."""
        return self._stats.counters

    def get_stats(self) -> Any:
        """SGLang's StorageMetrics (pages per batch and GB/s, drained on each call), with our
        cumulative counters (totals, and per pool under `pools`) attached as `.maru`."""
        return self._stats.get_stats()

    def close(self) -> None:
        """Detach: end this instance on the server (its leases, pins and regions go at once;
        the pages it stored stay readable by others until evicted)."""
        self.confirm_writes()
        self.handler.close()
