"""`MaruCacheLinker`: SGLang's `UnifiedCacheLinker` over Maru, KV copied straight between the
DEVICE KV pool and the shared pool (docs/sglang.md). A page is stored as MaruStorage stores a
`page_first_direct` host page, under the same namespace, so the two share pages; any difference
in model, dtype, geometry or rank is another namespace, a miss.

Threads: SGLang's calls run on the scheduler thread; one thread copies loads layer by layer, one
writes and seals offloads. First rule: a load copies only leased pages, and its last layer
completes only once every lease held throughout (`_load_batch`); else SGLang aborts the
requests before their output is used.
"""

from __future__ import annotations

import errno
import logging
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolName, PoolTransfer
from sglang.srt.mem_cache.unified_cache.unified_cache_linker import (
    LayerWiseLoadCounter,
    UnifiedCacheLinker,
)
from sglang.srt.utils import get_device_module

from maru.client import (
    CopyFaultError,
    Lookup,
    Put,
    copy_many,
    copy_values,
    invalidate_ranges,
    write_back_ranges,
)
from maru_sglang.cuda import ALIGN, copy_pieces, register_with_cuda
from maru_sglang.maru_storage import open_handler
from maru_sglang.pools import check_pages, chunk_size_for, page_namespace, weight_version

__all__ = ["DevicePageLayout", "MaruCacheLinker"]

log = logging.getLogger(__name__)
device_module = get_device_module()

# The host layout whose page bytes the linker reproduces (and whose namespace it shares).
STORED_LAYOUT = "page_first_direct"

_COUNTERS = (
    "lookups",
    "lookup_hit_pages",
    "loads",  # requests whose load was queued
    "loads_refused",  # refused at queue time (a page gone): the request recomputes
    "loaded_pages",
    "load_failures",  # batches reported failed (lease lost, checksum): requests aborted
    "offloads",
    "offloaded_pages",  # pages copied and sealed
    "offload_skipped_pages",  # already in Maru (another instance wrote them): not copied
    "offload_failures",
    "bytes_loaded",
    "bytes_offloaded",
)


# What a CPU copy returns in place of a GPU copy's CUDA event: landed when the call returns.
LANDED = SimpleNamespace(query=lambda: True, synchronize=lambda: None)


class DevicePageLayout:
    """One device KV pool as pages in Maru. A stored page is, for MHA, the K rows of its tokens
    for layers 0..L-1, then the V rows (a `page_first_direct` host page); for MLA the latent
    rows. Each (part, layer) piece is `page_size` consecutive rows of one buffer: one copy.
    Copies return `LANDED` (CPU) or a CUDA event recorded after them (GPU)."""

    def __init__(self, kvcache: Any, page_size: int):
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

        self.page_size = page_size
        if getattr(kvcache, "page_size", page_size) != page_size:
            raise ValueError(
                f"device KV pool page size {kvcache.page_size} != tree page size {page_size}"
            )
        # A block-scaled cache (MHA fp8/fp4, MLA fp4) keeps each row's scales in buffers of
        # their own, which a stored page does not hold: loaded without them, the rows would
        # dequantize with whatever scales the slots held before.
        scaled = sorted(
            name
            for name, value in vars(kvcache).items()
            if "scale_buffer" in name and value is not None
        )
        if scaled:
            raise ValueError(
                "MaruCacheLinker does not support scaled (fp8/fp4) KV caches "
                f"({type(kvcache).__name__}: {', '.join(scaled)})"
            )
        if isinstance(kvcache, MLATokenToKVPool):
            self.is_mla = True
            parts = [list(kvcache.kv_buffer)]
            self.geometry = SimpleNamespace(
                kv_lora_rank=kvcache.kv_lora_rank,
                qk_rope_head_dim=kvcache.qk_rope_head_dim,
                kv_cache_dim=kvcache.kv_cache_dim,
            )
        elif isinstance(kvcache, MHATokenToKVPool):
            self.is_mla = False
            parts = [list(kvcache.k_buffer), list(kvcache.v_buffer)]
            self.geometry = SimpleNamespace(
                head_num=kvcache.head_num,
                head_dim=kvcache.head_dim,
                v_head_dim=getattr(kvcache, "v_head_dim", kvcache.head_dim),
            )
        else:
            raise ValueError(
                f"MaruCacheLinker supports MHATokenToKVPool and MLATokenToKVPool device pools, "
                f"not {type(kvcache).__name__}"
            )
        self.layers = len(parts[0])
        if not self.layers or any(len(p) != self.layers for p in parts):
            raise ValueError("device KV pool: every part needs one buffer per layer")
        row_bytes = []
        for buffers in parts:
            rows = {b.nbytes // b.shape[0] for b in buffers}  # contiguous: the row stride
            if len(rows) != 1 or any(not b.is_contiguous() for b in buffers):
                raise ValueError("device KV pool: buffers of one part must be contiguous alike")
            row_bytes.append(rows.pop())
        self.rows = min(b.shape[0] for p in parts for b in p)
        # Every address here is a token slot's row. A pool led by pages (HND, AITER's
        # vectorized_5d: a row is a page) would send a page's copy to the rows of other slots.
        layout = getattr(kvcache, "kv_cache_layout", "nhd")
        if layout != "nhd" or self.rows < kvcache.size:
            raise ValueError(
                f"MaruCacheLinker needs a device KV pool with one row per token slot (NHD); "
                f"this one is laid out {layout!r} ({self.rows} rows for {kvcache.size} slots)"
            )
        self.device = parts[0][0].device
        self.row_bytes = row_bytes
        self.on_gpu = self.device.type == "cuda"
        if self.on_gpu:
            if any(r % ALIGN for r in row_bytes):
                raise ValueError(f"device KV pool: GPU copies need rows of {ALIGN}-byte multiples")
            self.load_stream = torch.cuda.Stream(self.device)
            self.store_stream = torch.cuda.Stream(self.device)
        # bases[part][layer]: the address of row 0 of that buffer
        self.bases = np.array([[b.data_ptr() for b in p] for p in parts], dtype=np.int64)
        self.piece_bytes = [page_size * r for r in row_bytes]  # one (part, layer) of a page
        self.part_bytes = [self.layers * p for p in self.piece_bytes]
        self.part_offsets = np.cumsum([0, *self.part_bytes[:-1]]).tolist()
        self.page_bytes = sum(self.part_bytes)
        # What page_namespace reads of a host pool, for the host pool this page order is (its
        # dtype the stored one, as the host pool's: uint8 for a quantized KV cache).
        self.geometry.__dict__.update(
            dtype=getattr(kvcache, "store_dtype", kvcache.dtype),
            start_layer=getattr(kvcache, "start_layer", 0),
            layer_num=self.layers,
            page_size=page_size,
            layout=STORED_LAYOUT,
        )
        self.buffers = parts

    def firsts(
        self, indices: torch.Tensor | None, pages: int, distinct: bool = False
    ) -> np.ndarray | None:
        """The first token slot of each page of `indices`; None unless they are exactly
        `pages` whole pages, page-aligned, consecutive slots within each page, in the pool;
        with `distinct` (a load), no page twice (two keys loaded into one page: one's bytes
        would be reported loaded for both)."""
        p = self.page_size
        if indices is None or indices.numel() != pages * p:
            return None
        slots = np.ascontiguousarray(indices.detach().to("cpu", torch.int64).numpy())
        try:  # (the host pools' check: `pools.check_pages`)
            check_pages(slots.ctypes.data, slots.size, p, self.rows // p * p, distinct)
        except ValueError:
            return None
        return slots[::p].copy()

    def settle(self) -> None:
        """Return once every copy queued on this layout has landed."""
        if self.on_gpu:
            self.load_stream.synchronize()
            self.store_stream.synchronize()

    def load_layers(self, sources: np.ndarray, firsts: np.ndarray) -> Iterator[Any]:
        """Copy the pages at `sources` (shared mapping) into the device rows at `firsts`,
        yielding each layer's copy (CPU: done; GPU: every layer queued before the first)."""
        parts = range(len(self.part_offsets))
        if not self.on_gpu:  # plain (not streaming) stores: the forward reads these rows next
            for layer in range(self.layers):
                dst = np.stack(
                    [self.bases[p, layer] + firsts * self.row_bytes[p] for p in parts], 1
                )
                offsets = [self.part_offsets[p] + layer * self.piece_bytes[p] for p in parts]
                src = sources[:, None] + np.array(offsets, np.int64)
                copy_many(dst, src, self.piece_bytes, streaming=False)
                yield LANDED
            return
        sizes = np.array(self.piece_bytes, np.int64)
        # [layer, page, part] addresses: the row of one launch per layer
        dst = self.bases.T[:, None, :] + firsts[None, :, None] * np.array(self.row_bytes)
        layer_offsets = np.arange(self.layers, dtype=np.int64)[:, None] * sizes
        src = sources[None, :, None] + (np.array(self.part_offsets) + layer_offsets)[:, None, :]
        yield from copy_pieces(dst, src, sizes, self.load_stream)

    def store(self, targets: np.ndarray, firsts: np.ndarray, threads: int = 1) -> Any:
        """Copy whole pages from the device rows at `firsts` to `targets` in the shared
        mapping, in stored order (on CPU shared by `threads` threads)."""
        pieces = [(p, layer) for p in range(len(self.part_offsets)) for layer in range(self.layers)]
        rows = np.stack([self.bases[p, lay] + firsts * self.row_bytes[p] for p, lay in pieces], 1)
        sizes = [self.piece_bytes[p] for p, _ in pieces]  # a stored page: its pieces end to end
        if self.on_gpu:  # one launch
            dst = targets[:, None] + np.cumsum([0, *sizes[:-1]], dtype=np.int64)
            return copy_pieces(dst[None], rows[None], np.array(sizes), self.store_stream)[0]
        copy_values(targets, rows, sizes, to_values=True, threads=threads)
        return LANDED


@dataclass
class _Load:
    """A request's queued load: its pages' device slots and their leased locations."""

    rid: str
    firsts: np.ndarray
    lookup: Lookup


class MaruCacheLinker(UnifiedCacheLinker):
    """`UnifiedCacheLinker` whose external store is Maru (FULL KV: MHA and MLA pools)."""

    def __init__(
        self,
        server_args: Any,
        params: Any,
        *,
        components: Any = None,
        extra_config: dict[str, Any] | None = None,
        forward_stream: Any = None,
    ):
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

        if components is not None and set(components) != {ComponentType.FULL}:
            names = sorted(getattr(c, "name", str(c)) for c in components)
            raise ValueError(f"MaruCacheLinker stores FULL KV only; the model needs {names}")
        self.forward_stream = forward_stream
        self.page_size = int(params.page_size)
        kvcache = params.token_to_kv_pool_allocator.get_kvcache()
        self.layout = DevicePageLayout(kvcache, self.page_size)
        self.storage_config = _storage_config(server_args, params, self.layout.is_mla)
        self._weights = weight_version()  # what the namespace names (`prefix` follows it)
        self.namespace = page_namespace(self.storage_config, self.layout.geometry)
        # MLA pages are the same on every rank: rank 0 writes them, every rank reads them.
        self.offload_owner = not self.layout.is_mla or self.storage_config.tp_rank == 0
        extra = dict(extra_config or {})
        overrides = {}
        if "maru_chunk_size_bytes" not in extra:
            overrides["chunk_size_bytes"] = chunk_size_for(self.layout.page_bytes)
        self.config, self.handler = open_handler(
            extra, self.storage_config.tp_rank, self.storage_config.tp_size, **overrides
        )
        try:
            self.registration = register_with_cuda(self.handler, self.layout.device)
        except BaseException:
            self.handler.close()
            raise
        self.pools = {PoolName.KV: self.layout}
        self.layer_done_counter = LayerWiseLoadCounter(self.layout.layers)
        self._lock = threading.Lock()
        self._stats = {**dict.fromkeys(_COUNTERS, 0), "load_seconds": 0.0, "offload_seconds": 0.0}
        self._pending: dict[str, _Load] = {}  # queued by load(), started by the next start
        self._load_queue: queue.Queue = queue.Queue()
        self._offload_queue: queue.Queue = queue.Queue()
        self._offload_results: queue.Queue[bool] = queue.Queue()
        self._closed = False
        self._load_thread = threading.Thread(
            target=self._serve, args=(self._load_queue, self._load_batch), daemon=True,
            name="maru-linker-load",
        )  # fmt: skip
        self._offload_thread = threading.Thread(
            target=self._serve, args=(self._offload_queue, self._offload_pages), daemon=True,
            name="maru-linker-offload",
        )  # fmt: skip
        self._load_thread.start()
        self._offload_thread.start()
        log.info(
            "MaruCacheLinker connected to %s as instance %s: namespace %s, %d-byte pages "
            "(%d layers, %s), tp %d/%d",
            self.config.server_url,
            self.handler.instance_id,
            self.namespace,
            self.layout.page_bytes,
            self.layout.layers,
            "MLA" if self.layout.is_mla else "MHA",
            self.storage_config.tp_rank,
            self.storage_config.tp_size,
        )

    # -- keys ---------------------------------------------------------------------------------

    @property
    def prefix(self) -> str:
        """What the Maru key of a page hash starts with (MaruStorage's for the same pages): its
        namespace follows SGLang's weight version, as MaruStorage's does (`_follow_weights`)."""
        version = weight_version()
        if version != self._weights:
            self.namespace = page_namespace(self.storage_config, self.layout.geometry)
            log.warning(
                "MaruCacheLinker: SGLang's weight version is %r (was %r): namespace %s",
                version,
                self._weights,
                self.namespace,
            )
            self._weights = version
        return f"{self.namespace}:"

    def keys(self, hashes: Sequence[str]) -> list[str]:
        """Maru keys of page hashes (MaruStorage's KV keys for the same pages)."""
        prefix = self.prefix
        return [prefix + h for h in hashes]

    @staticmethod
    def _kv(transfers: Sequence[PoolTransfer]) -> PoolTransfer | None:
        return next((t for t in transfers if t.name == PoolName.KV), None)

    def _count(self, **deltas: float) -> None:
        with self._lock:
            for name, value in deltas.items():
                self._stats[name] += value

    # -- scheduler thread ---------------------------------------------------------------------

    def lookup(self, rid: str, transfers: list[PoolTransfer]) -> list[int]:
        """Every prefix length (pages) stored whole: 1..n for the n leading stored pages."""
        kv = self._kv(transfers)
        if kv is None or not kv.keys:
            return []
        run = self.handler.leading_hits(kv.keys, prefix=self.prefix)
        self._count(lookups=1, lookup_hit_pages=run)
        return list(range(1, run + 1))

    def load(self, rid: str, transfers: list[PoolTransfer]) -> bool:
        """Lease every page now (no instance evicts or deletes them until the copy is done)
        and queue the copy; False (recompute) if the slots are not whole pages or a page is
        gone or of another length."""
        kv = self._kv(transfers)
        if kv is None or not kv.keys:
            return False
        if rid in self._pending:
            raise RuntimeError(f"MaruCacheLinker: a load for {rid} is already queued")
        pages = len(kv.keys)
        firsts = self.layout.firsts(kv.device_indices, pages, distinct=True)
        if firsts is None:
            log.error("load %s: device slots are not %d distinct whole pages: refused", rid, pages)
            self._count(loads_refused=1)
            return False
        lookup = self.handler.lookup(kv.keys, lease=True, prefix=self.prefix)
        _, lengths = lookup.wait()
        if not (lengths == self.layout.page_bytes).all():
            log.info(
                "load %s: %d of %d pages gone, %d of another length since lookup: recompute",
                rid,
                int((lengths == 0).sum()),
                pages,
                int(((lengths != 0) & (lengths != self.layout.page_bytes)).sum()),
            )
        elif not self._registered(lookup.addresses):
            log.warning("load %s: pages outside the CUDA-registered mapping: recompute", rid)
        elif invalidate_ranges(lookup.addresses, lengths) is not None:  # (software coherence)
            log.warning("load %s: the pool's memory faulted: recompute", rid)
        else:
            self._pending[rid] = _Load(rid, firsts, lookup)
            return True
        lookup.release()
        self._count(loads_refused=1)
        return False

    def _registered(self, addresses: np.ndarray) -> bool:
        """Every page at `addresses` is in a region registered with CUDA (the only host memory
        the copy kernel may touch); True on CPU."""
        return self.registration is None or self.registration.covers(
            addresses, self.layout.page_bytes
        )

    def start_layer_wise_loading(self) -> int:
        """Hand the queued loads to the load thread; the counter index the forward waits on
        (-1: nothing to load)."""
        if not self._pending:
            return -1
        loads, self._pending = list(self._pending.values()), {}
        index = self.layer_done_counter.update_producer()
        ready = device_module.Event()  # slot allocations before the copies (a GPU's stream)
        ready.record()
        self._load_queue.put((index, loads, ready))
        self._count(loads=len(loads))
        return index

    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        return self.layer_done_counter.finish(counter_index)

    def cancel_queued_load(self, rid: str) -> bool:
        load = self._pending.pop(rid, None)
        if load is None:
            return False
        load.lookup.release()
        return True

    def offload(self, transfers: list[PoolTransfer], session_id: str | None = None) -> bool:
        """Queue the pages for the offload thread; False if they are not whole pages."""
        kv = self._kv(transfers)
        if kv is None or not kv.keys:
            return False
        firsts = self.layout.firsts(kv.device_indices, len(kv.keys))
        if firsts is None:
            log.error("offload: device slots are not %d whole pages: refused", len(kv.keys))
            return False
        if not self.offload_owner:  # MLA on a rank > 0: rank 0 writes the same bytes
            self._offload_results.put(True)
            return True
        self._offload_queue.put((self.keys(kv.keys), firsts, self.record_offload_ready()))
        return True

    def num_completed_offloads(self) -> int:
        return self._offload_results.qsize()

    def pop_completed_offload(self) -> bool:
        return self._offload_results.get_nowait()

    # -- worker threads -----------------------------------------------------------------------

    @staticmethod
    def _serve(tasks: queue.Queue, work: Any) -> None:
        while True:
            task = tasks.get()
            try:
                if task is None:
                    return
                work(*task)
            except BaseException:  # a worker never dies: each task reports its own failure
                log.exception("MaruCacheLinker worker task failed")
            finally:
                tasks.task_done()

    def _load_batch(self, index: int, loads: list[_Load], ready: Any) -> None:
        """Copy the batch layer by layer, completing each as it lands except the last: that
        one only once every lease held to the end and checksums match, else the batch fails."""
        start = time.perf_counter()
        counter, last = self.layer_done_counter, self.layout.layers - 1
        released = False
        try:
            ready.synchronize()
            sources = np.concatenate([load.lookup.addresses for load in loads])
            firsts = np.concatenate([load.firsts for load in loads])
            landed: list[Any] = []
            done = 0  # layers completed
            with self.handler.copying():  # no region unmapped before the last copy landed
                try:
                    for layer, copy in enumerate(self.layout.load_layers(sources, firsts)):
                        landed.append(copy)
                        while done < min(layer + 1, last) and landed[done].query():
                            counter.complete(index, done)
                            done += 1
                    for layer in range(done, last):
                        landed[layer].synchronize()
                        counter.complete(index, layer)
                finally:
                    self.layout.settle()
            released = True
            proven = [self._proven(load) for load in loads]  # releases every lease
            if not all(proven):
                bad = [load.rid for load, ok in zip(loads, proven) if not ok]
                raise RuntimeError(f"pages of {bad} not proven after the copy (lease/checksum)")
            counter.complete(index, last)
            pages = int(firsts.size)
            self._count(
                loaded_pages=pages,
                bytes_loaded=pages * self.layout.page_bytes,
                load_seconds=time.perf_counter() - start,
            )
            log.info("linker load: %d pages from Maru for %d request(s)", pages, len(loads))
        except BaseException as error:
            counter.fail(index, error)
            self._count(load_failures=1)
            log.error("linker load of %d request(s) failed: %s", len(loads), error)
            if not released:
                for load in loads:
                    load.lookup.release()

    @staticmethod
    def _proven(load: _Load) -> bool:
        """After the copy: no page changed under its checksum and the lease held throughout."""
        corrupt = bool(load.lookup.corrupt().any())
        return load.lookup.release(confirm=True) and not corrupt

    def _offload_pages(self, keys: list[str], firsts: np.ndarray, ready: list[Any]) -> None:
        """Write the pages not in Maru yet (one existence RPC), seal them (one RPC), and
        report one result: True when every page is in Maru afterwards."""
        start = time.perf_counter()
        ok = False
        try:
            for event in ready:
                event.synchronize()
            present = np.array(self.handler.batch_exists(keys), dtype=bool)
            todo = np.flatnonzero(~present)
            stored = 0
            if todo.size:
                stored = self._write(
                    [keys[i] for i in todo.tolist()], firsts[todo], self.layout.page_bytes
                )
            ok = stored == todo.size
            self._count(
                offloads=1,
                offloaded_pages=stored,
                offload_skipped_pages=len(keys) - todo.size,
                bytes_offloaded=stored * self.layout.page_bytes,
                offload_seconds=time.perf_counter() - start,
            )
        finally:
            if not ok:
                self._count(offload_failures=1)
            self._offload_results.put(ok)

    def _write(self, keys: list[str], firsts: np.ndarray, page_bytes: int) -> int:
        """Write `keys`' pages from the device rows at `firsts`; the number sealed (or found
        sealed). Chunks outside the CUDA-registered mapping are not copied into: those fail."""

        def copy(targets: np.ndarray, first: int, last: int, hashed: bool, threads: int) -> None:
            if not self._registered(targets):
                log.warning("offload: reserved chunks outside the CUDA-registered mapping")
                raise CopyFaultError(errno.EFAULT, "chunks outside the CUDA-registered mapping")
            self.layout.store(targets, firsts[first:last], threads).synchronize()
            write_back_ranges(targets, page_bytes)  # (software coherence: a device wrote them)

        put = Put(keys, page_bytes, copy, "linker")
        self.handler.put([put])
        return int(sum(put.results))

    # -- lifecycle ----------------------------------------------------------------------------

    def reset(self) -> None:
        """Drop queued loads (their leases end), wait for the threads to finish what they
        started, forget completed offloads and the layer counter."""
        for load in self._pending.values():
            load.lookup.release()
        self._pending.clear()
        self._load_queue.join()
        self._offload_queue.join()
        while not self._offload_results.empty():  # (no thread adds to it now)
            self._offload_results.get_nowait()
        self.layer_done_counter.reset()

    def close(self) -> None:
        """Quiesce (as `reset`), stop the threads, end this instance on the server (the pages
        stay readable by others until evicted)."""
        if self._closed:
            return
        self._closed = True
        self.reset()
        self._load_queue.put(None)
        self._offload_queue.put(None)
        self._load_thread.join()
        self._offload_thread.join()
        log.info("MaruCacheLinker closing: %s", self.counters)
        self.handler.close()

    @property
    def counters(self) -> dict[str, float]:
        """Cumulative counts: lookups, loads, pages and bytes each way, failures, seconds."""
        with self._lock:
            return dict(self._stats)


def _storage_config(server_args: Any, params: Any, is_mla: bool) -> HiCacheStorageConfig:
    """The ranks and model name HiCache's controller would give MaruStorage in this process
    (`HiCacheController._generate_storage_config`), so both paths name pages alike."""
    from sglang.srt.layers.dp_attention import is_dp_attention_enabled
    from sglang.srt.runtime_context import get_parallel

    ranks = get_parallel()
    if is_dp_attention_enabled():
        tp_rank, tp_size, dp_rank = ranks.attn_tp_rank, ranks.attn_tp_size, ranks.attn_dp_rank
    else:
        tp_rank, tp_size, dp_rank = ranks.tp_rank, ranks.tp_size, 0
    dcp_size = ranks.attn_dcp_size
    if dcp_size > 1:
        raise ValueError("MaruCacheLinker does not support decode context parallelism (DCP)")
    model = getattr(server_args, "served_model_name", None) or server_args.model_path
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=params.pp_rank,
        pp_size=params.pp_size,
        attn_cp_rank=params.attn_cp_rank,
        attn_cp_size=params.attn_cp_size,
        is_mla_model=is_mla,
        enable_storage_metrics=False,
        is_page_first_layout=False,
        model_name=model,
        dp_rank=dp_rank,
        dcp_size=dcp_size,
        dcp_rank=ranks.attn_dcp_rank,
    )
