"""`MaruKVConnector`: a vLLM v1 KV connector that shares KV blocks through Maru (docs/vllm.md).
A block's KV for every layer of a cache group is one Maru value, keyed by vLLM's own block hash
(chained over the prefix), so every instance that computes the same prefix finds the same keys.
The rest of the key names everything else the value's bytes depend on, so that an instance
never reads bytes of another model, format or shard as a hit (`maru_vllm.keys`; `_scope` here):
`<namespace>/<scope>/g<group>/<block hash>`, the namespace renewed by `reset_cache` (a weight
update). Where a block's bytes sit in vLLM's KV cache: `maru_vllm.layout`. A block that is
missing, evicted, of another size, or whose lease ended during the copy is reported by
`get_block_ids_with_load_errors`: vLLM recomputes it, never uses other bytes.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, SlidingWindowSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from maru import MaruConfig, MaruHandler
from maru.client import (
    ConfigError,
    Put,
    Throttle,
    parse_bool,
    parse_int,
    values_at,
)
from maru_vllm.keys import hash_block_size, key_namespace, mla_shared, parallel_rank
from maru_vllm.layout import (
    GroupLayout,
    check_host_memory,
    group_layout,
    resolved_layout,
    value_order,
)

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


def _connector_options(
    extra: dict[str, Any], vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
) -> dict[str, Any]:
    """Pop `CONNECTOR_KEYS` from `extra`, parsed as MaruConfig parses its keys ("false" is
    False, a count a positive integer): a bad value is a ConfigError naming its key.
    `maru_async_load` must stay true with several KV cache groups (a hybrid model: vLLM maps
    no failed block id back to its request, its scheduler raises; a failed load fails its
    request as a whole, which only an async load can report) and with several ranks a step
    (TP x PP x PCP): a synchronous load that fails on one rank is known to that rank only
    before the step's saves, while every rank's forward reads its blocks (all-reduce, the
    stages' hidden states), so the other ranks would save wrong KV."""
    groups = len(kv_cache_config.kv_cache_groups)
    parallel = vllm_config.parallel_config
    ranks = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
    ranks *= getattr(parallel, "prefill_context_parallel_size", 1)
    own = {key: extra.pop(key, default) for key, default in CONNECTOR_KEYS.items()}
    prefix = own["maru_key_prefix"]
    if not isinstance(prefix, str) or not prefix.strip():
        raise ConfigError(f"maru_key_prefix: expected a non-empty string, got {prefix!r}")
    own["maru_async_load"] = parse_bool(own["maru_async_load"], name="maru_async_load")
    for key in ("maru_load_threads", "maru_save_threads"):
        own[key] = parse_int(own[key], name=key, maximum=1024)
    if groups > 1 and not own["maru_async_load"]:
        raise ConfigError(
            f"maru_async_load: false is not supported with several KV cache groups ({groups}: "
            "a hybrid model); vLLM cannot be told which blocks of a synchronous load failed. "
            "Leave it true"
        )
    if ranks > 1 and not own["maru_async_load"]:
        raise ConfigError(
            f"maru_async_load: false is not supported with {ranks} ranks (tensor, pipeline or "
            "context parallel); a load that fails on one rank would leave the others saving "
            "KV computed over it. Leave it true"
        )
    return own


class _FailedLoads:
    """The scheduler's memory of loads: each request's last load (its first block and
    block ids per group) and where a failed one stopped. vLLM asks again after a failed load;
    matched from the same block, the same failure would repeat forever: a request is never
    matched from there again. Also the async loads not reported done yet, and the finished
    requests whose blocks the connector holds (`forget`), for the next step's metadata."""

    def __init__(self) -> None:
        self.loading: dict[str, tuple[int, list[list[int]]]] = {}
        self.failed_at: dict[str, int] = {}
        self.in_flight: set[str] = set()  # async loads the workers have not reported done
        self.held: set[str] = set()  # finished, blocks held until their saves are reported

    def started(self, req_id: str, first: int, block_ids: list[list[int]], wait: bool) -> None:
        """A load of `req_id` from block `first`; `wait`: async (reported by the workers)."""
        self.loading[req_id] = (first, block_ids)
        if wait:
            self.in_flight.add(req_id)

    def limit(self, req_id: str, last: int) -> int:
        """`last` (a match's end block), or where the request's load failed if earlier."""
        return min(last, self.failed_at.get(req_id, last))

    def note(self, output: Any) -> dict[str, int]:
        """A step's `KVConnectorOutput`: the loads done, and where failed ones stopped (their
        blocks among `invalid_block_ids`, or their request among `failed_recving`). Returns
        the loads that failed in it: request -> the first block that did not load."""
        invalid = output.invalid_block_ids or set()
        failed = output.failed_recving or set()
        done = output.finished_recving or set()
        self.in_flight -= done
        noted: dict[str, int] = {}
        if not (invalid or failed):  # (an async load's errors come by its finished pass)
            for req_id in done:
                self.loading.pop(req_id, None)
            return noted
        for req_id, (first, block_ids) in list(self.loading.items()):
            if req_id in done:
                del self.loading[req_id]
            if req_id in failed:
                stop = 0
            else:
                bad = [i for ids in block_ids for i, b in enumerate(ids) if b in invalid]
                if not bad:
                    continue
                stop = min(bad)
            at = first + stop
            self.failed_at[req_id] = noted[req_id] = min(at, self.failed_at.get(req_id, at))
        return noted

    def forget(self, req_id: str, saved: bool) -> bool:
        """`req_id` finished (`saved`: saves were started from its blocks): whether the
        connector holds its blocks until the workers report its saves. Not while its async
        load runs: vLLM holds them itself until that load is reported, and frees them at
        either report; a second report of a freed request ends vLLM's engine core."""
        self.loading.pop(req_id, None)
        self.failed_at.pop(req_id, None)
        hold = saved and req_id not in self.in_flight
        self.in_flight.discard(req_id)
        if hold:
            self.held.add(req_id)
        return hold

    def take_held(self) -> set[str]:
        held, self.held = self.held, set()
        return held


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
    """`written`: every block this step may write (allocated to a scheduled request, or a
    load's target), the blocks a save still copying must finish before (`handle_preemptions`);
    only where this instance saves. `held`: the step's finished requests whose blocks the
    scheduler side holds until the workers report their saves (`request_finished` said so)."""

    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)
    written: set[int] = field(default_factory=set)
    held: set[str] = field(default_factory=set)


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
        own = _connector_options(extra, vllm_config, kv_cache_config)
        self._maru_config = MaruConfig.from_mapping(extra, prefix="maru_")
        self._async_load = own["maru_async_load"]
        self._groups = tuple(kv_cache_config.prefix_cacheable_group_ids)
        self._specs = [kv_cache_config.kv_cache_groups[g].kv_cache_spec for g in self._groups]
        # several KV cache groups: a failed load fails its request (`_connector_options`)
        self._fail_whole_loads = len(kv_cache_config.kv_cache_groups) > 1
        self._block_size = hash_block_size(vllm_config, kv_cache_config, self._groups)
        self._value_layout = resolved_layout(vllm_config, kv_cache_config)
        parallel = vllm_config.parallel_config
        self._tp_size = parallel.tensor_parallel_size
        self._pp_size = parallel.pipeline_parallel_size
        self._pcp_size = getattr(parallel, "prefill_context_parallel_size", 1)
        self._mla_shared = mla_shared(vllm_config)
        self._eagle_drop = _drops_eagle_block(vllm_config)
        layout = (self._groups, self._block_size, self._value_layout)
        self._namespace = key_namespace(
            own["maru_key_prefix"], vllm_config, kv_cache_config, *layout
        )
        self._saves = self._kv_transfer_config.is_kv_producer
        self._handler: MaruHandler | None = None
        self._lock = threading.Lock()
        if role == KVConnectorRole.SCHEDULER:
            self._requests: dict[str, _ReqState] = {}
            self._matched: dict[str, tuple[int, int]] = {}
            self._failed = _FailedLoads()
            self._loads: list[Transfer] = []
            self._handler_for("2M")  # maru-server unreachable: a clear error at start
        else:
            self._rank = parallel_rank(self._pp_size, self._pcp_size, self._tp_size)
            self._layouts: dict[int, GroupLayout] = {}
            self._load_pool = ThreadPoolExecutor(
                int(own["maru_load_threads"]), thread_name_prefix="maru-load"
            )
            self._save_pool = ThreadPoolExecutor(
                int(own["maru_save_threads"]), thread_name_prefix="maru-save"
            )
            self._recving: dict[str, list[Future]] = {}
            self._sending: dict[str, list[Future]] = {}
            self._saving: dict[Future, frozenset[int]] = {}  # saves running: their blocks
            self._fenced: MaruConnectorMetadata | None = None
            # the step whose synchronous load failed: its forward read the failed blocks
            self._unsaved: MaruConnectorMetadata | None = None
            self._finished_reqs: set[str] = set()  # finished, with saves still running
            self._load_errors: set[int] = set()
            self._failed_loads: set[str] = set()  # requests whose load failed as a whole
            self._stats = MaruKVConnectorStats()

    # -- keys (maru_vllm.keys's docstring) ---------------------------------------------------

    def _scope(self, rank: tuple[int, int, int]) -> str:
        """`rank`: (PP stage, PCP rank, TP rank). Every stage holds other layers, every PCP
        and TP rank (DCP ranks are TP ranks) its own part of a block: one value each."""
        pp, pcp, tp = rank
        parts = [f"pp{pp}of{self._pp_size}"]
        if self._pcp_size > 1:
            parts.append(f"pcp{pcp}of{self._pcp_size}")
        # MLA without context parallelism: one copy per stage, written by TP rank 0
        parts.append("mla" if self._mla_shared else f"tp{tp}of{self._tp_size}")
        return "-".join(parts)

    def _ranks(self) -> list[tuple[int, int, int]]:
        """Every (PP stage, PCP rank, TP rank) whose own value a block needs."""
        tps = [0] if self._mla_shared else range(self._tp_size)
        return list(itertools.product(range(self._pp_size), range(self._pcp_size), tps))

    def _prefix(self, group: int, rank: tuple[int, int, int]) -> str:
        return f"{self._namespace}/{self._scope(rank)}/g{group}/"

    def reset_cache(self) -> bool:
        """`reset_prefix_cache(reset_connector=True)`, as vLLM asks after a weight update: the
        blocks stored so far may be of the weights before, so the keys take a new random part
        and none is a hit again (they leave the pool by eviction). Workers key as told."""
        self._namespace = f"{self._namespace.split('/reset-')[0]}/reset-{secrets.token_hex(8)}"
        return True

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
        group and every rank (each PP stage, PCP and TP rank), in one check; a prefix, never
        the last token. A group needs only the blocks vLLM keeps of it (`_hit_blocks`)."""
        bs = self._block_size
        first = num_computed_tokens // bs
        last = min(len(request.block_hashes), (request.num_tokens - 1) // bs)
        last = self._failed.limit(request.request_id, last)
        self._matched.pop(request.request_id, None)
        if last <= first or not self._groups:
            return 0, False
        hexes = [h.hex() for h in request.block_hashes[first:last]]
        scopes = [self._prefix(g, r) for g in self._groups for r in self._ranks()]
        # every (group, rank)'s keys in one call, each beside its prefix
        prefixes = [prefix for prefix in scopes for _ in hexes]
        found = _exists_or_miss(lambda: self._handler_for("2M"), hexes * len(scopes), prefixes)
        exists = np.array(found, dtype=bool)
        if exists.size != len(hexes) * len(scopes):
            return 0, False
        stored = exists.reshape(len(self._groups), -1, len(hexes)).all(axis=1)  # every rank
        hits = _hit_blocks(stored, first, self._specs, bs, self._eagle_drop)
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
        first, last = matched
        self._loads.append(self._transfer(request, block_ids, first, last))
        ids = [block_ids[g][first:last] for g in self._groups]  # (null ones too: by offset)
        self._failed.started(request.request_id, first, ids, self._async_load)

    def update_connector_output(self, connector_output: Any) -> None:
        """Where a load failed, remembered (`_FailedLoads`): the request's next match stops
        before it. vLLM recomputes the blocks from there, which a synchronous load had taken
        as saved (`saved_upto`, set as it was scheduled): they are saved once computed."""
        super().update_connector_output(connector_output)
        for req_id, at in self._failed.note(connector_output).items():
            state = self._requests.get(req_id)
            if state is not None and state.saved_upto is not None:
                state.saved_upto = min(state.saved_upto, at)

    def _transfer(
        self, request: Request, block_ids: list[list[int]], first: int, last: int
    ) -> Transfer:
        """Blocks [first, last) of `request` but null ones, keyed for rank (0, 0, 0)."""
        hexes = [h.hex() for h in request.block_hashes[first:last]]
        pairs = [
            _not_null([self._prefix(g, (0, 0, 0)) + h for h in hexes], block_ids[g][first:last])
            for g in self._groups
        ]
        return Transfer(request.request_id, [k for k, _ in pairs], [i for _, i in pairs])

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = MaruConnectorMetadata(loads=self._loads, held=self._failed.take_held())
        self._loads = []
        if self._saves:  # (blocks freed by a preemption or a sliding window, reused here)
            meta.written = _allocated_blocks(scheduler_output, meta.loads)
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
        """Keep the blocks until the workers report the request's saves done (`forget`)."""
        self._matched.pop(request.request_id, None)
        state = self._requests.pop(request.request_id, None)
        return self._failed.forget(request.request_id, bool(state and state.had_save)), None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, block_ids[0] if block_ids else [])

    # == worker side =========================================================================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Work out each cache group's block layout, then connect with one chunk per block
        value (the largest). KV caches outside CPU memory are refused (at the start)."""
        num_blocks = self._kv_cache_config.num_blocks
        order = value_order(self._value_layout)
        check_host_memory(kv_caches)
        for g in self._groups:
            names = [n for n in self._kv_cache_config.kv_cache_groups[g].layer_names]
            tensors = [kv_caches[n] for n in names if n in kv_caches]
            if tensors:
                self._layouts[g] = group_layout(tensors, num_blocks, order)
        if not self._layouts:
            log.warning("MaruKVConnector: no KV cache tensors of a prefix-cacheable group")
            return
        biggest = max(layout.value_size for layout in self._layouts.values())
        self._handler_for().set_chunk_size(-(-biggest // _ALIGN) * _ALIGN)
        log.info(
            "MaruKVConnector: %s, block values of %s bytes",
            self._prefix(0, self._rank),
            {g: lay.value_size for g, lay in self._layouts.items()},
        )

    def _rank_keys(self, transfer: Transfer) -> list[list[str]]:
        """The scheduler names rank (0, 0, 0)'s keys; a worker reads and writes its own
        rank's (the scope, third part from the end of a key)."""
        mine = self._scope(self._rank)
        if mine == self._scope((0, 0, 0)):
            return transfer.keys
        out = []
        for keys in transfer.keys:
            split = (k.rsplit("/", 3) for k in keys)
            out.append([f"{ns}/{mine}/{group}/{h}" for ns, _, group, h in split])
        return out

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """vLLM calls this before a step's forward (and its loads) may write any block: wait
        for the saves still copying a block this step writes. A preemption frees a request's
        blocks at once (only `request_finished` waits for its saves), as a sliding window
        frees the blocks it leaves; the scheduler may hand them to another request in the
        same step. Waiting here, the save copies the bytes it was given, never the new
        request's."""
        assert isinstance(kv_connector_metadata, MaruConnectorMetadata)
        self._fenced = kv_connector_metadata
        written = kv_connector_metadata.written
        with self._lock:
            for future in [f for f in self._saving if f.done()]:
                del self._saving[future]
            busy = [f for f, ids in self._saving.items() if not ids.isdisjoint(written)]
        if busy:
            start = time.perf_counter()
            wait_futures(busy)
            elapsed = time.perf_counter() - start
            log.debug("waited %.3f s for %d saves of reused blocks", elapsed, len(busy))

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, MaruConnectorMetadata)
        if meta is not self._fenced:  # (a model runner that did not call it: before loads)
            self.handle_preemptions(meta)
        for transfer in meta.loads:
            if self._async_load:
                future = self._load_pool.submit(self._load, transfer)
                with self._lock:
                    self._recving.setdefault(transfer.req_id, []).append(future)
            elif self._load(transfer):
                self._unsaved = meta  # (`wait_for_save` stores nothing of this step)

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
        """Start this step's saves: the blocks are full (the model no longer writes them), kept
        until `get_finished` reports the request, and not written again before the save ends
        (`handle_preemptions` waits for it where a step would). None in a step whose
        synchronous load failed: its forward read the blocks that did not load (the request's,
        and any request's sharing them as a local prefix hit), so what it computed may be
        wrong; vLLM recomputes the request, whose blocks are saved from there."""
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, MaruConnectorMetadata)
        failed, self._unsaved = meta is self._unsaved, None
        if failed and meta.saves:
            log.warning(
                "MaruKVConnector: a load failed: the step's %d saves skipped", len(meta.saves)
            )
        writer = not (self._mla_shared and self._rank[2] != 0)  # MLA: TP rank 0 writes
        for transfer in meta.saves:
            with self._lock:
                futures = self._sending.setdefault(transfer.req_id, [])
                if failed:
                    self._stats.add(save_failed=sum(map(len, transfer.block_ids)))
                if failed or not writer:
                    continue  # (still reported by get_finished: vLLM waits for every rank)
                future = self._save_pool.submit(self._save, transfer)
                futures.append(future)
                self._saving[future] = frozenset(itertools.chain(*transfer.block_ids))

    def _load(self, transfer: Transfer) -> bool:
        """Copy the blocks in (`_read_blocks`); whether any failed. A load that raises (the
        server gone, ...) fails every block of it. With several KV cache groups, a load with
        any error fails its request as a whole (`get_transfer_results`)."""
        start = time.perf_counter()
        try:
            keys = self._rank_keys(transfer)
            copied, errors = _read_blocks(
                self._handler_for(), self._layouts, self._groups, keys, transfer
            )
        except Exception as exc:  # (never blocks taken as loaded that were not)
            count = sum(len(ids) for ids in transfer.block_ids)
            log.error(
                "MaruKVConnector: load of %s failed (%s): %d blocks recomputed",
                transfer.req_id,
                exc,
                count,
            )
            copied, errors = 0, list(itertools.chain(*transfer.block_ids))
        loaded = sum(len(ids) for ids in transfer.block_ids) - len(errors)
        with self._lock:
            if errors and self._fail_whole_loads:
                self._failed_loads.add(transfer.req_id)
            else:
                self._load_errors.update(errors)
            elapsed = time.perf_counter() - start
            self._stats.add(
                loads=1,
                load_blocks=loaded,
                load_bytes=copied,
                load_s=elapsed,
                load_errors=len(errors),
            )
        return bool(errors)

    def _save(self, transfer: Transfer) -> None:
        """Every group's blocks through the handler's write verb (`MaruHandler.put`), waiting
        for the server's answer; a bad block id stores nothing of the request."""
        start = time.perf_counter()
        handler = self._handler_for()
        puts: list[Put] | None = None
        try:
            puts = _puts(self._groups, self._layouts, self._rank_keys(transfer), transfer)
        except ValueError as exc:
            log.error("MaruKVConnector: save of %s skipped: %s", transfer.req_id, exc)
        else:
            handler.put(puts)
        with self._lock:
            self._stats.add(saves=1, save_s=time.perf_counter() - start, **_saved(puts, transfer))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(requests whose saves are done, among those finished; requests whose loads are
        done). A failed transfer still finishes: its blocks are load errors, or unsaved."""
        with self._lock:
            meta = self._connector_metadata  # (the step's: vLLM calls this before clearing it)
            self._finished_reqs.update(_held(meta, finished_req_ids, self._sending))
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

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """`get_finished`'s, and among the loads done the requests whose load failed as a
        whole (several KV cache groups: `_load`), reported with them."""
        sending, recving = self.get_finished(finished_req_ids)
        done = set(recving or ())
        with self._lock:
            failed = self._failed_loads & done
            self._failed_loads -= failed
        return KVConnectorTransferResults(set(sending or ()), done, failed)

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


def _puts(
    groups: list[int], layouts: dict[int, GroupLayout], keys: list[list[str]], transfer: Transfer
) -> list[Put]:
    """A save's writes, a group's blocks each (`_save`); ValueError for a bad block id."""
    puts = []
    for g, group_keys, ids in zip(groups, keys, transfer.block_ids):
        layout = layouts.get(g)
        if layout is not None and ids:
            buffers = layout.addresses(ids)  # block by block, each in address order
            puts.append(Put(group_keys, layout.value_size, values_at(buffers, layout.length)))
    return puts


def _saved(puts: list[Put] | None, transfer: Transfer) -> dict[str, int]:
    """A save's counts for the statistics (`puts` None: nothing was stored)."""
    if puts is None:
        return {"save_failed": sum(len(ids) for ids in transfer.block_ids)}
    saved = sum(sum(put.results) for put in puts)
    return {
        "save_blocks": saved,
        "save_bytes": sum(sum(put.results) * put.uniform() for put in puts),
        "save_failed": sum(len(put.keys) for put in puts) - saved,
    }


def _read_blocks(
    handler: MaruHandler,
    layouts: dict[int, GroupLayout],
    groups: Sequence[int],
    keys: Sequence[Sequence[str]],
    transfer: Transfer,
) -> tuple[int, list[int]]:
    """A load's copy (`MaruHandler.read`: proven hits only): (bytes copied, failed block ids).
    Every block from the first not proven on is a load error that vLLM recomputes (proven ones
    after it were copied too: their key's own bytes, which the recompute overwrites)."""
    copied, errors = 0, []
    # every group's destinations first: a bad block id (ValueError) fails the load before
    # anything is copied (`_load`)
    where = [
        layouts[g].addresses(ids) if ids and g in layouts else None
        for g, ids in zip(groups, transfer.block_ids)
    ]
    for g, group_keys, ids, targets in zip(groups, keys, transfer.block_ids, where):
        layout = layouts.get(g)
        if not ids:
            continue
        if layout is None or targets is None:
            errors.extend(ids)
            continue
        proven = handler.read(group_keys, targets, layout.length, length=layout.value_size)
        hits = proven.index(False) if False in proven else len(proven)
        copied += hits * layout.value_size
        errors.extend(ids[hits:])
    return copied, errors


# vLLM 0.33's `BlockPool.null_block`: block 0, the first its free queue gives, never a
# request's own. A sliding window's blocks before the window stand for it in a request's block
# ids (`remove_skipped_blocks`, and a hit's skipped blocks): every request shares it.
_NULL_BLOCK = 0


def _not_null(keys: list[str], ids: list[int]) -> tuple[list[str], list[int]]:
    """`keys` and their block `ids`, less those of the null block: a load into it would
    write several requests' values into one block that vLLM's kernels take as empty, and
    a save from it would store its bytes under a block's key."""
    kept = [(key, b) for key, b in zip(keys, ids) if b != _NULL_BLOCK]
    return [key for key, _ in kept], [b for _, b in kept]


def _kept_from(spec: Any, tokens: int, block_size: int) -> int:
    """The first block vLLM keeps in a group of `spec` for a request with `tokens`
    computed; those before it are the null block (vLLM 0.33's `get_num_skipped_tokens` of
    `SlidingWindowManager` and `ChunkedLocalAttentionManager`). 0 where a group keeps all."""
    if isinstance(spec, SlidingWindowSpec):
        skipped = tokens - spec.sliding_window + 1 - spec.extra_retained_tokens
    elif isinstance(spec, ChunkedLocalAttentionSpec):
        skipped = tokens // spec.attention_chunk_size * spec.attention_chunk_size
    else:
        return 0
    return max(0, skipped) // block_size


def _drops_eagle_block(vllm_config: VllmConfig) -> bool:
    """Whether an EAGLE-style drafter (EAGLE, EAGLE3, MTP) builds a position's draft KV from
    the next token (vLLM 0.33's `SpeculativeConfig.use_eagle_block_drop`): its layers are in
    the KV cache groups, so the last position of a hit's last block holds KV of a token its
    key does not cover. vLLM's own prefix cache drops that block from a hit (`_hit_blocks`)."""
    speculative = vllm_config.speculative_config
    return bool(speculative is not None and speculative.use_eagle_block_drop())


def _hit_blocks(
    stored: np.ndarray, first: int, specs: Sequence[Any], block_size: int, drop_last: bool
) -> int:
    """How many blocks after `first` a load fills (`stored[g][i]`: group g's block first + i
    is stored): the most, h, where every group has stored the blocks vLLM keeps of it for
    first + h blocks computed, from `_kept_from` (not before `first`: local hits). A sliding
    window needs only its window's, as vLLM's own `SlidingWindowManager.find_longest_cache_hit`
    does; a group that keeps all needs them all. `drop_last` (`_drops_eagle_block`): the most
    below the longest hit, never its last block."""
    count = stored.shape[1]
    at = np.arange(count)
    # runs[g][i]: how many blocks up to i are stored in a row (0 where i is not)
    runs = at - np.maximum.accumulate(np.where(stored, -1, at), axis=1)
    for hits in range(count, 0, -1):
        end = first + hits
        need = [hits - max(0, _kept_from(s, end * block_size, block_size) - first) for s in specs]
        if all(runs[g, hits - 1] >= n for g, n in enumerate(need)):
            if not drop_last:
                return hits
            return _hit_blocks(stored[:, : hits - 1], first, specs, block_size, False)
    return 0


def _exists_or_miss(
    handler: Callable[[], MaruHandler], keys: list[str], prefixes: list[str]
) -> list[bool]:
    """`batch_exists`, or nothing where it raises (maru-server down and never connected):
    a miss, logged (at most every 10 s: the scheduler asks at every step). Raised into
    vLLM's scheduler, it would end the engine core."""
    try:
        return handler().batch_exists(keys, prefix=prefixes)
    except Exception as exc:
        held = _LOOKUP_FAILURES.allow("lookup")
        if held is not None:
            note = _LOOKUP_FAILURES.note(held)
            log.warning("MaruKVConnector: lookup failed (%s): a miss%s", exc, note)
        return []


_LOOKUP_FAILURES = Throttle()


def _held(
    meta: KVConnectorMetadata | None, finished: set[str], sending: dict[str, list[Future]]
) -> set[str]:
    """Among the step's `finished` requests, those to report once their saves are done: the
    ones whose blocks the scheduler side holds (`meta.held`). The others' saves are dropped
    from `sending`, never reported: vLLM frees their blocks itself (at their load's report),
    and reporting them as well would free the blocks twice. Without the step's metadata:
    every finished request with saves."""
    if not isinstance(meta, MaruConnectorMetadata):
        return {r for r in finished if r in sending}
    for r in finished - meta.held:
        for future in sending.pop(r, ()):  # (its errors still logged)
            future.add_done_callback(lambda f: _raise_unexpected([f]))
    return set(finished) & meta.held


def _raise_unexpected(futures: Sequence[Future]) -> None:
    """A transfer that raised (a bug, not a miss) is logged; its request still finishes."""
    for future in futures:
        exc = future.exception()
        if exc is not None:
            log.error("MaruKVConnector transfer failed", exc_info=exc)


def _allocated_blocks(scheduler_output: SchedulerOutput, loads: Sequence[Transfer]) -> set[int]:
    """Every block of the step's new and resumed requests, the blocks added to running ones,
    the loads' targets, and what the worker writes before the forward: the blocks it zeroes
    (of groups no load writes) and the targets of copy-on-write copies (block ids are shared
    by every group: one pool)."""
    ids: set[int] = set(getattr(scheduler_output, "new_block_ids_to_zero", None) or ())
    for copy in getattr(scheduler_output, "kv_cache_block_copies", None) or ():
        ids.add(copy.dst_block_id)
    for new in scheduler_output.scheduled_new_reqs:
        for group in new.block_ids:
            ids.update(group)
    for more in scheduler_output.scheduled_cached_reqs.new_block_ids:
        for group in more or ():
            ids.update(group)
    for transfer in loads:
        for group in transfer.block_ids:
            ids.update(group)
    return ids
