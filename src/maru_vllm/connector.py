"""`MaruKVConnector`: a vLLM v1 KV connector that shares KV blocks through Maru (docs/vllm.md).
A block's KV for every layer of a cache group is one Maru value, keyed by vLLM's own block hash
(chained over the prefix), so every instance that computes the same prefix finds the same keys.
A block that is missing, evicted, of another size, or whose lease ended during the copy is
reported by `get_block_ids_with_load_errors`: vLLM recomputes it, never uses other bytes.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from maru import MaruConfig, MaruHandler
from maru.client import Put, values_at

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

_ALIGN = 4096  # MaruConfig rounds chunk_size_bytes up to a multiple of this
# kv_connector_extra_config keys of the connector itself (docs/vllm.md); every other maru_*
# key is a MaruConfig field (an unknown one is an error naming it).
CONNECTOR_KEYS = {
    "maru_key_prefix": "vllm",
    "maru_async_load": True,
    "maru_load_threads": 4,
    "maru_save_threads": 2,
}


# -- metadata: what the scheduler tells the workers each step ------------------------------


@dataclass
class Transfer:
    """Blocks of one request to load or save: per cache group, the keys and vLLM block ids
    (aligned: keys[g][i] is the value of block block_ids[g][i])."""

    req_id: str
    keys: list[list[str]]
    block_ids: list[list[int]]


@dataclass
class MaruConnectorMetadata(KVConnectorMetadata):
    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)


@dataclass
class MaruKVConnectorStats(KVConnectorStats):
    """Counters since the last reset, summed over workers (seconds: each transfer's wall time)."""

    _FIELDS = (
        "loads",
        "load_blocks",
        "load_bytes",
        "load_s",
        "load_errors",
        "saves",
        "save_blocks",
        "save_bytes",
        "save_s",
        "save_failed",
    )

    def __post_init__(self) -> None:
        for name in self._FIELDS:
            self.data.setdefault(name, 0)

    def reset(self) -> None:
        self.data = dict.fromkeys(self._FIELDS, 0)

    def add(self, **counts: float) -> None:
        for name, value in counts.items():
            self.data[name] += value

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name in self._FIELDS:
            self.data[name] += other.data.get(name, 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = dict(self.data)
        for kind in ("load", "save"):
            seconds = self.data[f"{kind}_s"]
            out[f"{kind}_gbps"] = self.data[f"{kind}_bytes"] / seconds / 1e9 if seconds else 0.0
        return out

    def is_empty(self) -> bool:
        return not (self.data["loads"] or self.data["saves"])


# -- where a block's bytes are in vLLM's KV cache ------------------------------------------


@dataclass
class _GroupLayout:
    """For one cache group: block b's bytes are segments s at `base[s] + b * stride[s]`, each
    `length[s]` bytes; a stored value is the segments back to back."""

    base: np.ndarray
    stride: np.ndarray
    length: np.ndarray
    value_size: int

    def addresses(self, block_ids: Sequence[int]) -> np.ndarray:
        """[blocks, segments] int64: where each segment of each block is."""
        ids = np.asarray(block_ids, dtype=np.int64)
        return self.base[None, :] + ids[:, None] * self.stride[None, :]


def _layer_segments(kv: torch.Tensor, num_blocks: int) -> list[tuple[int, int, int]]:
    """(address, stride, length) of the dense runs of one logical block of a layer view with
    blocks at dim 0 (B a multiple of `num_blocks`: kernel blocks). Dims of a larger stride than
    the block's lie outside it (K and V planes of `[2, B, ...]`): one segment per index."""
    if kv.shape[0] % num_blocks:
        raise ValueError(f"a KV view of {kv.shape[0]} blocks is not a multiple of {num_blocks}")
    ratio = kv.shape[0] // num_blocks
    el = kv.element_size()
    block_stride = kv.stride(0) * el
    outer = [d for d in range(1, kv.ndim) if kv.stride(d) * el > block_stride]
    inner = [d for d in range(1, kv.ndim) if d not in outer]
    page = el * int(np.prod([kv.shape[d] for d in inner], dtype=np.int64))
    span = el + sum((kv.shape[d] - 1) * kv.stride(d) * el for d in inner)
    if span != page:
        raise ValueError(
            f"KV layout {tuple(kv.shape)} / strides {kv.stride()}: a block's bytes are not one "
            "dense run; MaruKVConnector does not support this layout"
        )
    if ratio > 1 and block_stride == page:  # the kernel blocks of a block are adjacent
        page, ratio = page * ratio, 1
    segments = []
    for idx in itertools.product(*(range(kv.shape[d]) for d in outer)):
        off = sum(i * kv.stride(d) * el for i, d in zip(idx, outer))
        for r in range(ratio):
            segments.append((kv.data_ptr() + off + r * block_stride, block_stride * ratio, page))
    return segments


def _group_layout(tensors: Sequence[torch.Tensor], num_blocks: int) -> _GroupLayout:
    # each segment once, in order: layers may share one KV cache (cross-layer sharing)
    segs = list(dict.fromkeys(seg for kv in tensors for seg in _layer_segments(kv, num_blocks)))
    base, stride, length = (np.array(col, dtype=np.int64) for col in zip(*segs))
    return _GroupLayout(base, stride, length, int(length.sum()))


# -- the connector ----------------------------------------------------------------------------


@dataclass
class _ReqState:
    request: Request
    block_ids: list[list[int]]
    saved_upto: int | None = None  # blocks [0, saved_upto) need no save (None: not known yet)
    had_save: bool = False


class MaruKVConnector(KVConnectorBase_V1, SupportsHMA):
    """See the module docstring. `kv_connector_extra_config` takes every `maru_*` key of
    `MaruConfig` (`maru_server_url`, `maru_pool_size`, ...) and `CONNECTOR_KEYS`."""

    # Where vLLM's metrics say our hits came from: this node's host memory (vLLM 0.33 asks).
    _cache_hit_source = CacheHitSource.HOST

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        own = {key: extra.pop(key, default) for key, default in CONNECTOR_KEYS.items()}
        self._maru_config = MaruConfig.from_mapping(extra, prefix="maru_")
        self._async_load = bool(own["maru_async_load"])
        self._block_size = vllm_config.cache_config.block_size
        self._groups = tuple(kv_cache_config.prefix_cacheable_group_ids)
        model = vllm_config.model_config
        self._use_mla = bool(model is not None and getattr(model, "use_mla", False))
        self._tp_size = vllm_config.parallel_config.tensor_parallel_size
        name = model.served_model_name if model is not None else "model"
        if isinstance(name, (list, tuple)):
            name = name[0]
        self._namespace = f"{own['maru_key_prefix']}/{name}/{self._block_size}"
        self._saves = self._kv_transfer_config.is_kv_producer
        self._handler: MaruHandler | None = None
        self._lock = threading.Lock()
        if role == KVConnectorRole.SCHEDULER:
            self._requests: dict[str, _ReqState] = {}
            self._matched: dict[str, tuple[int, int]] = {}
            self._loads: list[Transfer] = []
        else:
            self._rank = _tp_rank()
            self._layouts: dict[int, _GroupLayout] = {}
            self._load_pool = ThreadPoolExecutor(
                int(own["maru_load_threads"]), thread_name_prefix="maru-load"
            )
            self._save_pool = ThreadPoolExecutor(
                int(own["maru_save_threads"]), thread_name_prefix="maru-save"
            )
            self._recving: dict[str, list[Future]] = {}
            self._sending: dict[str, list[Future]] = {}
            self._finished_reqs: set[str] = set()  # finished, with saves still running
            self._load_errors: set[int] = set()
            self._stats = MaruKVConnectorStats()

    # -- keys -------------------------------------------------------------------------------

    def _scope(self, rank: int) -> str:
        # MLA's latent KV is the same on every TP rank: one copy, written by rank 0.
        return "mla" if self._use_mla else f"tp{rank}of{self._tp_size}"

    def _prefix(self, group: int, rank: int) -> str:
        return f"{self._namespace}/{self._scope(rank)}/g{group}/"

    def _keys(self, hashes: Sequence[bytes], group: int, rank: int) -> list[str]:
        prefix = self._prefix(group, rank)
        return [prefix + h.hex() for h in hashes]

    def _handler_for(self, pool_size: int | str | None = None) -> MaruHandler:
        if self._handler is None:
            config = self._maru_config
            if pool_size is not None:
                config = dataclasses.replace(config, pool_size=pool_size)
            handler = MaruHandler(dataclasses.replace(config, auto_connect=False))
            if not handler.connect():
                raise RuntimeError(f"Failed to connect MaruHandler to {config.server_url}")
            self._handler = handler
        return self._handler

    # == scheduler side ======================================================================

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """How many tokens after `num_computed_tokens` are stored as whole blocks, for every
        group and rank, in one check; a prefix, never the last token."""
        bs = self._block_size
        first = num_computed_tokens // bs
        last = min(len(request.block_hashes), (request.num_tokens - 1) // bs)
        self._matched.pop(request.request_id, None)
        if last <= first or not self._groups:
            return 0, False
        hexes = [h.hex() for h in request.block_hashes[first:last]]
        ranks = [0] if self._use_mla else range(self._tp_size)
        scopes = [self._prefix(g, r) for g in self._groups for r in ranks]
        # every (group, rank)'s keys in one call, each beside its prefix
        prefixes = [prefix for prefix in scopes for _ in hexes]
        found = self._handler_for("2M").batch_exists(hexes * len(scopes), prefix=prefixes)
        exists = np.array(found, dtype=bool)
        if exists.size != len(hexes) * len(scopes):
            return 0, False
        everywhere = exists.reshape(-1, len(hexes)).all(axis=0)
        hits = len(hexes) if everywhere.all() else int(np.argmin(everywhere))
        if not hits:
            return 0, False
        self._matched[request.request_id] = (first, first + hits)
        return hits * bs - (num_computed_tokens - first * bs), self._async_load

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        block_ids = [list(ids) for ids in blocks.get_block_ids()]
        state = self._requests.setdefault(request.request_id, _ReqState(request, block_ids))
        state.block_ids = block_ids
        matched = self._matched.pop(request.request_id, None)
        if num_external_tokens <= 0 or matched is None:
            return
        self._loads.append(self._transfer(request, block_ids, *matched))

    def _transfer(
        self, request: Request, block_ids: list[list[int]], first: int, last: int
    ) -> Transfer:
        """Blocks [first, last) of `request`, keyed for rank 0 (see `_rank_keys`)."""
        hashes = request.block_hashes[first:last]
        return Transfer(
            request.request_id,
            [self._keys(hashes, g, 0) for g in self._groups],
            [block_ids[g][first:last] for g in self._groups],
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = MaruConnectorMetadata(loads=self._loads)
        self._loads = []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is None:
                continue
            state.block_ids = [list(ids) for ids in new.block_ids]
            if state.saved_upto is None:  # computed before: local prefix hit or loaded
                state.saved_upto = new.num_computed_tokens // self._block_size
            self._add_save(meta, state, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if req_id in cached.resumed_req_ids:
                    state.block_ids = [list(ids) for ids in new_ids]
                else:
                    for mine, more in zip(state.block_ids, new_ids):
                        mine.extend(more)
            computed = cached.num_computed_tokens[i] + scheduled.get(req_id, 0)
            self._add_save(meta, state, computed)
        return meta

    def _add_save(self, meta: MaruConnectorMetadata, state: _ReqState, computed: int) -> None:
        if not self._saves or not self._groups:
            return
        first = state.saved_upto or 0
        last = min(len(state.request.block_hashes), computed // self._block_size)
        # (blocks not allocated: never, vLLM allocated the blocks it schedules)
        if last <= first or any(len(state.block_ids[g]) < last for g in self._groups):
            return
        meta.saves.append(self._transfer(state.request, state.block_ids, first, last))
        state.saved_upto = last
        state.had_save = True

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Keep the blocks until the workers report the request's saves done."""
        self._matched.pop(request.request_id, None)
        state = self._requests.pop(request.request_id, None)
        return bool(state is not None and state.had_save), None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, block_ids[0] if block_ids else [])

    # == worker side =========================================================================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Work out each cache group's block layout, then connect with one chunk per block
        value (the largest)."""
        num_blocks = self._kv_cache_config.num_blocks
        for g in self._groups:
            names = [n for n in self._kv_cache_config.kv_cache_groups[g].layer_names]
            tensors = [kv_caches[n] for n in names if n in kv_caches]
            if tensors:
                self._layouts[g] = _group_layout(tensors, num_blocks)
        if not self._layouts:
            log.warning("MaruKVConnector: no KV cache tensors of a prefix-cacheable group")
            return
        biggest = max(layout.value_size for layout in self._layouts.values())
        self._handler_for().set_chunk_size(-(-biggest // _ALIGN) * _ALIGN)
        log.info(
            "MaruKVConnector: rank %d, %s, block values of %s bytes",
            self._rank,
            self._scope(self._rank),
            {g: lay.value_size for g, lay in self._layouts.items()},
        )

    def _rank_keys(self, transfer: Transfer) -> list[list[str]]:
        """The scheduler names rank 0's keys; a worker reads and writes its own rank's."""
        if self._use_mla or self._rank == 0:
            return transfer.keys
        old, new = f"/{self._scope(0)}/", f"/{self._scope(self._rank)}/"
        return [[k.replace(old, new, 1) for k in keys] for keys in transfer.keys]

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, MaruConnectorMetadata)
        for transfer in meta.loads:
            if self._async_load:
                future = self._load_pool.submit(self._load, transfer)
                with self._lock:
                    self._recving.setdefault(transfer.req_id, []).append(future)
            else:
                self._load(transfer)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # whole blocks are loaded before the step (sync) or between steps (async)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return  # blocks are saved whole, all layers at once, in wait_for_save

    def wait_for_save(self) -> None:
        """Start this step's saves: the blocks are full (the model no longer writes them) and
        kept until `get_finished` reports the request."""
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, MaruConnectorMetadata)
        if self._use_mla and self._rank != 0:
            return
        for transfer in meta.saves:
            future = self._save_pool.submit(self._save, transfer)
            with self._lock:
                self._sending.setdefault(transfer.req_id, []).append(future)

    def _load(self, transfer: Transfer) -> None:
        """Copy the blocks in (`MaruHandler.read`: proven hits only); every block from the
        first not proven on is a load error that vLLM recomputes (proven ones after it were
        copied too: their key's own bytes, which the recompute overwrites)."""
        start = time.perf_counter()
        copied = 0
        errors: list[int] = []
        handler = self._handler_for()
        for g, keys, ids in zip(self._groups, self._rank_keys(transfer), transfer.block_ids):
            layout = self._layouts.get(g)
            if not ids:
                continue
            if layout is None:
                errors.extend(ids)
                continue
            proven = handler.read(
                keys, layout.addresses(ids), layout.length, length=layout.value_size
            )
            hits = proven.index(False) if False in proven else len(proven)
            copied += hits * layout.value_size
            errors.extend(ids[hits:])
        loaded = sum(len(ids) for ids in transfer.block_ids) - len(errors)
        with self._lock:
            self._load_errors.update(errors)
            self._stats.add(
                loads=1,
                load_blocks=loaded,
                load_bytes=copied,
                load_s=time.perf_counter() - start,
                load_errors=len(errors),
            )

    def _save(self, transfer: Transfer) -> None:
        """Every group's blocks through the handler's write verb (`MaruHandler.put`), waiting
        for the server's answer."""
        start = time.perf_counter()
        handler = self._handler_for()
        puts = []
        for g, keys, ids in zip(self._groups, self._rank_keys(transfer), transfer.block_ids):
            layout = self._layouts.get(g)
            if layout is not None and ids:
                buffers = layout.addresses(ids)  # block by block, each in address order
                puts.append(Put(keys, layout.value_size, values_at(buffers, layout.length)))
        handler.put(puts)
        saved = sum(sum(put.results) for put in puts)
        failed = sum(len(put.keys) for put in puts) - saved
        nbytes = sum(sum(put.results) * put.uniform() for put in puts)
        with self._lock:
            self._stats.add(
                saves=1,
                save_blocks=saved,
                save_bytes=nbytes,
                save_s=time.perf_counter() - start,
                save_failed=failed,
            )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(requests whose saves are done, among those finished; requests whose loads are
        done). A failed transfer still finishes: its blocks are load errors, or unsaved."""
        with self._lock:
            self._finished_reqs.update(r for r in finished_req_ids if r in self._sending)
            sending = {
                r for r in self._finished_reqs if all(f.done() for f in self._sending.get(r, ()))
            }
            recving = {r for r, fs in self._recving.items() if all(f.done() for f in fs)}
            for r in sending:
                self._finished_reqs.discard(r)
                _raise_unexpected(self._sending.pop(r, ()))
            for r in recving:
                _raise_unexpected(self._recving.pop(r, ()))
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.role != KVConnectorRole.WORKER:
            return None
        with self._lock:
            if self._stats.is_empty():
                return None
            stats, self._stats = self._stats, MaruKVConnectorStats()
        return stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return MaruKVConnectorStats(data=dict(data or {}))

    def shutdown(self) -> None:
        """Let running transfers end, then close the handler (its pins and leases end)."""
        if self.role == KVConnectorRole.WORKER:
            self._load_pool.shutdown(wait=True)
            self._save_pool.shutdown(wait=True)
        if self._handler is not None:
            self._handler.close()
            self._handler = None


def _raise_unexpected(futures: Sequence[Future]) -> None:
    """A transfer that raised (a bug, not a miss) is logged; its request still finishes."""
    for future in futures:
        exc = future.exception()
        if exc is not None:
            log.error("MaruKVConnector transfer failed", exc_info=exc)


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()
    except (AssertionError, ImportError, RuntimeError):  # no TP group (a single process)
        return 0
