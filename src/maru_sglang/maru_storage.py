"""SGLang HiCache L3 backend: `MaruStorage`.

Loaded by SGLang's dynamic backend factory (`cls(storage_config, {})`, then
`register_mem_pool_host(pool)`) with `--hicache-storage-backend dynamic` and the extra config
`{"backend_name": "maru", "module_path": "maru_sglang.maru_storage", "class_name": "MaruStorage",
"interface_v1": 1, "maru_server_url": ..., "maru_pool_size": ...}`.

Zero-copy v1 path: a page's K and V buffers in the host pool are copied straight into one
shared-memory allocation, K then V, and back again on a hit: one copy per part, all of a
batch's parts in one call (`maru.client.memcopy.copy_many`, streaming stores). One metadata RPC per
batch each way; no intermediate buffer.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
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
)

from maru import MaruConfig, MaruHandler
from maru.client.memcopy import copy_many

log = logging.getLogger(__name__)

SUPPORTED_LAYOUTS = ("page_first_direct", "page_first")
KV_POOL_NAME = "kv"

_memmove = ctypes.memmove
# batch_set_v1 registers a batch in up to PIPELINE_PIECES pieces of at least PIPELINE_MIN_PAGES
# pages, each sent while the next piece is copied (smaller batches: one registration).
PIPELINE_PIECES = 2
PIPELINE_MIN_PAGES = 32
_ALLOC_ALIGN = 4096  # MaruConfig.chunk_size_bytes must be a multiple of this


def chunk_size_for(page_bytes: int) -> int:
    """The allocation granularity that wastes nothing on `page_bytes`-sized values: every value
    MaruStorage stores is one whole SGLang page, so one chunk per page (rounded up to 4 KiB)."""
    return max(_ALLOC_ALIGN, -(-page_bytes // _ALLOC_ALIGN) * _ALLOC_ALIGN)


def _storage_metrics_cls() -> Any:
    try:
        from sglang.srt.observability.metrics_collector import StorageMetrics
    except ImportError:  # older/newer SGLang moved it; stats then come back as a dict
        return None
    return StorageMetrics


def page_namespace(storage_config: HiCacheStorageConfig, pool: Any) -> str:
    """A short hash of everything that must match for two instances to share a page.

    Model, page geometry, dtype and the byte order of a page (which differs between
    `page_first` and `page_first_direct`), and for MHA the TP shard (MLA pages are the same on
    every rank). A mismatch in any field gives a different namespace: a miss, never garbage.
    """
    is_mla = bool(storage_config.is_mla_model)
    fields: list[str] = [
        f"model={storage_config.model_name or ''}",
        f"dtype={pool.dtype}",
        f"layers={pool.layer_num}",
        f"page={pool.page_size}",
        f"layout={pool.layout}",
    ]
    if is_mla:
        fields += [
            "attn=mla",
            f"lora={getattr(pool, 'kv_lora_rank', '')}",
            f"rope={getattr(pool, 'qk_rope_head_dim', '')}",
            f"dim={getattr(pool, 'kv_cache_dim', '')}",
            f"dcp={storage_config.dcp_rank}/{storage_config.dcp_size}",
        ]
    else:
        fields += [
            "attn=mha",
            f"heads={pool.head_num}",
            f"head_dim={pool.head_dim}",
            f"v_head_dim={getattr(pool, 'v_head_dim', pool.head_dim)}",
            f"tp={storage_config.tp_rank}/{storage_config.tp_size}",
        ]
    fields += [
        f"pp={storage_config.pp_rank}/{storage_config.pp_size}",
        f"cp={storage_config.attn_cp_rank}/{storage_config.attn_cp_size}",
        f"dp={storage_config.dp_rank}",
    ]
    return hashlib.sha256("|".join(fields).encode()).hexdigest()[:16]


def _affine_page_pointers(pool: Any, parts: int) -> list[tuple[int, int]] | None:
    """In the page_first layouts each page part's pointer is affine in the page's first token
    index t: `ptr = base + t * stride`. Learn (base, stride) per part from `get_page_buffer_meta`
    on three pages and check it on a fourth; None (keep calling `get_page_buffer_meta`, a Python
    loop per page) if the pool does not follow it."""
    page = pool.page_size
    pages = int(getattr(pool, "size", 0)) // page
    if pages < 4:
        return None

    def meta(first_page: int) -> tuple[list[int], list[int]]:
        t = first_page * page
        ptrs, sizes = pool.get_page_buffer_meta(torch.arange(t, t + page, dtype=torch.int64))
        return list(ptrs), list(sizes)

    p0, s0 = meta(0)
    p1, _ = meta(1)
    if len(p0) != parts or len(p1) != parts:
        return None
    model = []
    for j in range(parts):
        stride, rem = divmod(p1[j] - p0[j], page)
        if rem:
            return None
        model.append((p0[j], stride))
    for probe in (pages // 2, pages - 1):
        ptrs, sizes = meta(probe)
        if sizes != s0 or ptrs != [b + probe * page * st for b, st in model]:
            return None
    return model


class MaruStorage(HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig, args: Any = None):
        self.storage_config = storage_config
        extra = dict(storage_config.extra_config or {})
        config = MaruConfig.from_mapping(extra, prefix="maru_")
        # Each rank is an instance of its own (the server names it, the name only reads
        # well): a configured name gets the rank, so ranks stay apart in `maru stats`.
        if "maru_instance_id" in extra and storage_config.tp_size > 1:
            config = dataclasses.replace(
                config, instance_id=f"{config.instance_id}/tp{storage_config.tp_rank}"
            )
        self.config = config
        # Unless the user chose one, the chunk size follows the page size (known only at
        # register_mem_pool_host, when the handler's chunk size is set before any chunk is
        # reserved): with the 1 MiB default a 16 KiB page would hold 1 MiB.
        self._chunk_from_page = "maru_chunk_size_bytes" not in extra
        self.enable_metrics = bool(storage_config.enable_storage_metrics)
        self.handler = MaruHandler(self.config)
        if not self.handler.connected:
            # The seed's text first (`RuntimeError: Failed to connect MaruHandler to <url>`),
            # then why (down, refused, pool full, another version), once.
            error = self.handler.connect_error
            self.handler.close()
            reason = f": {error.reason}" if error is not None else ""
            raise RuntimeError(
                f"Failed to connect MaruHandler to {self.config.server_url}{reason}"
            ) from None
        self.mem_pool_host: Any = None
        self.namespace = ""
        self._page_bytes = 0
        self._parts_per_page = 0
        self._stats_lock = threading.Lock()
        self._reset_metrics()
        self.counters = {
            "hits": 0,
            "misses": 0,
            "bytes_read": 0,
            "bytes_written": 0,
            "pages_written": 0,
            "get_seconds": 0.0,
            "set_seconds": 0.0,
        }
        log.info(
            "MaruStorage connected to %s as instance %s",
            self.config.server_url,
            self.handler.instance_id,
        )

    # -- registration ------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        layout = getattr(mem_pool_host, "layout", None)
        if layout not in SUPPORTED_LAYOUTS:
            raise ValueError(
                f"MaruStorage does not support host memory layout {layout!r}: "
                "use --hicache-mem-layout page_first_direct (or page_first)"
            )
        super().register_mem_pool_host(mem_pool_host)
        self.namespace = page_namespace(self.storage_config, mem_pool_host)
        probe = torch.arange(mem_pool_host.page_size, dtype=torch.int64)
        ptrs, sizes = mem_pool_host.get_page_buffer_meta(probe)
        self._parts_per_page = len(ptrs)
        self._part_sizes = list(sizes)
        self._page_bytes = sum(sizes)
        self._affine = _affine_page_pointers(mem_pool_host, len(ptrs))
        chunk = chunk_size_for(self._page_bytes)
        if self._chunk_from_page and chunk <= self.config.pool_size:
            self.handler.set_chunk_size(chunk)
            self.config = self.handler.config
        log.info(
            "MaruStorage: namespace %s, %d-byte pages in %d part(s), layout %s, chunk %d bytes",
            self.namespace,
            self._page_bytes,
            self._parts_per_page,
            layout,
            self.handler.get_chunk_size(),
        )

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        if str(host_pool_name) == KV_POOL_NAME:
            return super().register_mem_host_pool_v2(host_pool, host_pool_name)
        raise NotImplementedError(
            f"MaruStorage does not store sidecar pool {str(host_pool_name)!r} (Mamba/SWA/"
            "indexer state of hybrid models) yet; storing KV alone would restore half a state"
        )

    def _keys(self, keys: list[str]) -> list[str]:
        ns = self.namespace
        return [f"{ns}:{k}" for k in keys]

    def _copy_in(self, dst: int, stride: int, columns: list[np.ndarray], first: int, last: int):
        """Copy pages [first, last) of the batch from the host pool to `dst`, `stride` apart,
        each page's parts back to back."""
        starts = dst + np.arange(last - first, dtype=np.int64) * stride
        offset = 0
        for ptrs, size in zip(columns, self._part_sizes):
            copy_many(starts + offset, ptrs[first:last], size)
            offset += size

    def _copy_out(self, addresses: np.ndarray, columns: list[np.ndarray]) -> None:
        """Copy pages from `addresses` (each page's parts back to back) into the host pool."""
        offset = 0
        for ptrs, size in zip(columns, self._part_sizes):
            copy_many(ptrs, addresses + offset, size)
            offset += size

    def _part_pointers(self, host_indices: torch.Tensor, pages: int) -> list[np.ndarray] | None:
        """Per page part, the int64 pointers of that part of each page of `host_indices` in
        the host pool (None if the indices do not cover `pages` pages). Computed from the first
        token of each page (`_affine_page_pointers`); else through `get_page_buffer_meta`."""
        page = self.mem_pool_host.page_size
        if host_indices.numel() != pages * page:
            return None
        if self._affine is not None:
            firsts = host_indices.numpy()[::page].astype(np.int64)  # no Python loop per page
            return [firsts * stride + base for base, stride in self._affine]
        ptrs, _ = self.mem_pool_host.get_page_buffer_meta(host_indices)
        parts = self._parts_per_page
        return [np.array(ptrs[j::parts], dtype=np.int64) for j in range(parts)]

    def _require_pool(self) -> None:
        if self.mem_pool_host is None:
            raise RuntimeError("MaruStorage: register_mem_pool_host() was not called")

    # -- v1 zero-copy path -------------------------------------------------------------------

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Copy each page's parts from the host pool into one shared allocation, then register
        the whole batch with one RPC."""
        self._require_pool()
        if not keys:
            return []
        start = time.perf_counter()
        n = len(keys)
        columns = self._part_pointers(host_indices, n)
        if columns is None:
            log.error("batch_set_v1: %d host indices for %d keys", host_indices.numel(), n)
            return [False] * n
        page_bytes = self._page_bytes
        ns_keys = self._keys(keys)
        # The common case: one contiguous run of chunks, sealed piece by piece: each piece's
        # registration is in flight while the next piece is copied.
        run = self.handler.alloc(page_bytes, n)
        if run is not None:
            step = max(PIPELINE_MIN_PAGES, -(-n // PIPELINE_PIECES))
            sealings = []
            for first in range(0, n, step):
                last = min(n, first + step)
                piece = run.slice(first, last)
                self._copy_in(piece.address, piece.stride, columns, first, last)
                sealings.append(self.handler.seal(ns_keys[first:last], piece, page_bytes))
            results = [ok for sealing in sealings for ok in sealing.wait()]
        else:  # no free run: page by page (each may evict in our own regions)
            handles = [self.handler.alloc(page_bytes) for _ in range(n)]
            for i, handle in enumerate(handles):
                if handle is not None:
                    self._copy_in(handle.address, page_bytes, columns, i, i + 1)
            results = self.handler.seal(ns_keys, handles, page_bytes).wait()
        elapsed = time.perf_counter() - start
        ok = sum(results)
        with self._stats_lock:
            self.counters["bytes_written"] += ok * page_bytes
            self.counters["pages_written"] += ok
            self.counters["set_seconds"] += elapsed
            if self.enable_metrics:
                self._backup_pgs.append(len(keys))
                self._backup_bw.append(ok * page_bytes / max(elapsed, 1e-9) / 1e9)
        return results

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """One lookup RPC (leasing the pages so no instance evicts or deletes them mid-copy;
        the host pointers are computed while it is in flight), then one copy per page part
        from the shared mapping into the host pool. A page stored with another length is a
        miss."""
        self._require_pool()
        if not keys:
            return []
        start = time.perf_counter()
        n = len(keys)
        lookup = self.handler.lookup(self._keys(keys), lease=True)  # sent now: the server
        try:
            columns = self._part_pointers(host_indices, n)  # looks up while we compute these
        except BaseException:
            lookup.release()
            raise
        page_bytes = self._page_bytes
        with lookup as found:
            addresses, lengths = found.addresses, found.lengths
            if columns is None:
                log.error("batch_get_v1: %d host indices for %d keys", host_indices.numel(), n)
                return [False] * n
            hit = lengths == page_bytes
            results = hit.tolist()
            sources = addresses
            if not hit.all():  # copy the hits only
                sources = sources[hit]
                columns = [ptrs[hit] for ptrs in columns]
            self._copy_out(sources, columns)
            if not found.release(confirm=True):  # the lease ended mid-copy: not proven
                log.warning("batch_get_v1: the lease on %d pages ended during the copy", n)
                results = [False] * n
        for i in np.flatnonzero((lengths != 0) & ~hit):  # stored with another page size
            log.warning(
                "page %s has %d bytes, expected %d: treated as a miss",
                keys[i],
                lengths[i],
                page_bytes,
            )
        elapsed = time.perf_counter() - start
        hits = sum(results)
        # One line per prefetch batch (at most 128 pages): the examples and the P2P test look
        # for it in the second instance's log.
        log.info("batch_get_v1 result: %d/%d hits", hits, len(keys))
        with self._stats_lock:
            self.counters["hits"] += hits
            self.counters["misses"] += len(keys) - hits
            self.counters["bytes_read"] += hits * page_bytes
            self.counters["get_seconds"] += elapsed
            if self.enable_metrics:
                self._prefetch_pgs.append(len(keys))
                self._prefetch_bw.append(hits * page_bytes / max(elapsed, 1e-9) / 1e9)
        return results

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """Number of consecutive stored pages from the start, with one RPC."""
        found = self.handler.batch_exists(self._keys(keys))
        for i, hit in enumerate(found):
            if not hit:
                return i
        return len(found)

    # -- legacy path (interface_v1 off) ------------------------------------------------------

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        self._require_pool()
        if target_locations is None:
            target_locations = [self.mem_pool_host.get_dummy_flat_data_page() for _ in keys]
        out: list[torch.Tensor | None] = []
        with self.handler.lookup(self._keys(keys), lease=True) as found:
            for info, target in zip(found.infos(), target_locations):
                nbytes = target.numel() * target.element_size()
                if info is None or info.length != nbytes or not target.is_contiguous():
                    out.append(None)
                    continue
                _memmove(target.data_ptr(), info.address, nbytes)
                out.append(target)
            if not found.release(confirm=True):  # the lease ended mid-copy: not proven
                out = [None] * len(keys)
        hits = sum(t is not None for t in out)
        with self._stats_lock:
            self.counters["hits"] += hits
            self.counters["misses"] += len(keys) - hits
        return out

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        self._require_pool()
        if values is None or len(values) != len(keys):
            return False
        handles, lengths = [], []
        for value in values:
            value = value.contiguous()
            nbytes = value.numel() * value.element_size()
            handle = self.handler.alloc(nbytes)
            if handle is not None:
                _memmove(handle.address, value.data_ptr(), nbytes)
            handles.append(handle)
            lengths.append(nbytes)
        return all(self.handler.seal(self._keys(keys), handles, lengths).wait())

    def exists(self, key: str) -> bool:
        return self.handler.exists(self._keys([key])[0])

    # -- housekeeping ------------------------------------------------------------------------

    def clear(self) -> None:
        """Remove every page of this instance's namespace (other models are untouched)."""
        if self.namespace:
            removed = self.handler.delete_prefix(self.namespace + ":")
            log.info("MaruStorage: cleared %d pages of namespace %s", removed, self.namespace)

    def _reset_metrics(self) -> None:
        self._prefetch_pgs: list[int] = []
        self._backup_pgs: list[int] = []
        self._prefetch_bw: list[float] = []
        self._backup_bw: list[float] = []

    def get_stats(self) -> Any:
        """SGLang's StorageMetrics (pages per batch and GB/s, drained on each call), with our
        cumulative counters attached as `.maru`."""
        with self._stats_lock:
            cls = _storage_metrics_cls()
            counters = dict(self.counters)
            if cls is None:
                return counters
            metrics = cls()
            metrics.prefetch_pgs.extend(self._prefetch_pgs)
            metrics.backup_pgs.extend(self._backup_pgs)
            metrics.prefetch_bandwidth.extend(self._prefetch_bw)
            metrics.backup_bandwidth.extend(self._backup_bw)
            self._reset_metrics()
        metrics.maru = counters
        return metrics

    def close(self) -> None:
        self.handler.close()
