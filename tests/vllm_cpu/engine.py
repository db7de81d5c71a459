"""A step-by-step vLLM engine on CPU around `MaruKVConnector`: vLLM's real `VllmConfig`,
`Scheduler` (which creates the scheduler-side connector through vLLM's `KVConnectorFactory`
from `kv_connector_module_path`), `Request` with vLLM's block hasher, `allocate_kv_cache`
(vLLM's KV cache tensors and per-layer views, on CPU), `KVConnectorOutput` /
`ModelRunnerOutput`, and the worker-side connector from the same factory.

The one stand-in is the model's forward pass (`forward`): for every scheduled token it writes
a KV value that depends only on (layer, position, token id), as a real model's does on the
prompt prefix, so that two engines computing the same prompt hold the same bytes, and a block
loaded from Maru can be compared with what computing it gives.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

BLOCK = 16
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
EOS = 0
_none_hash = False


# A KV cache dtype of one byte (vLLM's fp8 caches are uint8 tensors): what its bytes encode.
FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def stage_layers(stage: int = 0) -> tuple[str, ...]:
    """The attention layers of pipeline stage `stage` (two each; stage 0's are `LAYERS`)."""
    return tuple(f"model.layers.{2 * stage + i}.self_attn.attn" for i in range(2))


def kv_spec(mla: bool = False, dtype: torch.dtype = torch.float16):
    if mla:
        return MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=24, dtype=dtype)
    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=dtype)


def kv_cache_config(
    num_blocks: int,
    mla: bool = False,
    dtype: torch.dtype = torch.float16,
    layers: tuple[str, ...] = LAYERS,
    hybrid: bool = False,
    window: int = 1024,
) -> KVCacheConfig:
    """Layer-outermost (vLLM's LBNHC): each layer a region of `num_blocks` pages. `hybrid`:
    two KV cache groups (HMA), full attention (the first layer) and sliding window (the
    second; a window of `window` tokens: by default longer than the tests' prompts), one
    block pool."""
    spec = kv_spec(mla, dtype)
    page = spec.page_size_bytes
    if hybrid:
        window = SlidingWindowSpec(
            block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=dtype, sliding_window=window
        )
        size = page * num_blocks * len(layers)
        tensors = [
            KVCacheTensor(
                size=size,
                layers=[name],
                layer_stride=page * num_blocks,
                block_stride=page,
                offset=i * page * num_blocks,
            )
            for i, name in enumerate(layers)
        ]
        return KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=tensors,
            kv_cache_groups=[
                KVCacheGroupSpec([layers[0]], spec),
                KVCacheGroupSpec([layers[1]], window),
            ],
        )
    tensor = KVCacheTensor(
        size=page * num_blocks * len(layers),
        layers=list(layers),
        layer_stride=page * num_blocks,
        block_stride=page,
    )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[tensor],
        kv_cache_groups=[KVCacheGroupSpec(list(layers), spec)],
    )


def vllm_config(
    model_dir: str,
    url: str,
    *,
    dtype: str = "float16",
    cache_dtype: str = "auto",
    policy: str = "fcfs",
    max_num_batched_tokens: int = 512,
    pp: int = 1,
    served_model_name: str | None = None,
    **extra: Any,
) -> VllmConfig:
    """`kv_connector_extra_config` = the maru_* keys; policy: recompute failed loads. `dtype`:
    the model's, `cache_dtype`: the KV cache's (vLLM's `--kv-cache-dtype`), `pp`: pipeline
    stages, `served_model_name`: vLLM's `--served-model-name`."""
    model = ModelConfig(model=model_dir, dtype=dtype, seed=0, served_model_name=served_model_name)
    config = VllmConfig(
        model_config=model,
        scheduler_config=SchedulerConfig(
            max_num_seqs=16,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=2048,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
            policy=policy,
        ),
        cache_config=CacheConfig(
            block_size=BLOCK,
            gpu_memory_utilization=0.9,
            enable_prefix_caching=True,
            cache_dtype=cache_dtype,
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector="MaruKVConnector",
            kv_connector_module_path="maru_vllm",
            kv_role="kv_both",
            kv_connector_extra_config={"maru_server_url": url, "maru_pool_size": "16M", **extra},
            kv_load_failure_policy="recompute",
        ),
        device_config=DeviceConfig("cpu"),
    )
    config.parallel_config.pipeline_parallel_size = pp  # (the stages: tests' own processes)
    return config


def kv_value(
    layer: int, positions: torch.Tensor, tokens: torch.Tensor, shape, view_dtype, cache_dtype="auto"
) -> torch.Tensor:
    """What the stand-in model computes for these tokens: [tokens, H, C] in the KV cache's
    dtype (`view_dtype`; an fp8 `cache_dtype` encoded as its bytes)."""
    h, c = shape
    grid = torch.arange(h * c, dtype=torch.float32).reshape(1, h, c)
    x = tokens.float().reshape(-1, 1, 1) * 0.37 + positions.float().reshape(-1, 1, 1) * 1.3
    value = torch.sin(x + layer * 7.0 + grid * 0.013)
    if cache_dtype in FP8:
        return value.to(FP8[cache_dtype]).view(view_dtype)
    return value.to(view_dtype)


class MiniEngine:
    """One vLLM instance: scheduler, worker connector, KV cache, and the step loop."""

    def __init__(
        self,
        model_dir: str,
        url: str,
        *,
        num_blocks: int = 128,
        mla: bool = False,
        stage: int = 0,
        layout: str = "LBNHC",
        hybrid: bool = False,
        window: int = 1024,
        **extra,
    ):
        """`stage`: the pipeline stage this worker runs (`extra` "pp": how many; vLLM's PP
        group must be set up in the process for a stage other than 0). `layout`: the KV cache
        layout the engine resolved (a `KVCacheLayout` name: LBNHC is NHD, LBHNC HND).
        `hybrid`: two KV cache groups (`kv_cache_config`), the second's window `window`."""
        global _none_hash
        if not _none_hash:
            init_none_hash(sha256)
            _none_hash = True
        self.config = vllm_config(model_dir, url, **extra)
        self.cache_dtype = self.config.cache_config.cache_dtype
        dtype = kv_cache_dtype_str_to_dtype(self.cache_dtype, self.config.model_config)
        self.layers = stage_layers(stage)
        self.first_layer = 2 * stage  # (the stand-in model's layer index of self.layers[0])
        self.kv_config = kv_cache_config(num_blocks, mla, dtype, self.layers, hybrid, window)
        # each layer's KV cache group (its block ids)
        self.layer_group = {
            name: g
            for g, group in enumerate(self.kv_config.kv_cache_groups)
            for name in group.layer_names
        }
        self.kv_config.kv_cache_layout = layout  # (as vLLM's engine core sets it)
        self.config.cache_config.num_gpu_blocks = num_blocks
        self.scheduler = Scheduler(
            vllm_config=self.config,
            kv_cache_config=self.kv_config,
            log_stats=True,
            structured_output_manager=StructuredOutputManager(self.config),
            block_size=BLOCK,
        )
        self.worker = KVConnectorFactory.create_connector(
            self.config, KVConnectorRole.WORKER, self.kv_config
        )
        self.kv = allocate_kv_cache(
            self.kv_config,
            torch.device("cpu"),
            KVCacheLayout[layout],
            [BLOCK] * len(self.kv_config.kv_cache_groups),
        )
        self.worker.register_kv_caches(self.kv)
        self.block_ids: dict[str, list[int]] = {}  # each request's blocks (group 0)
        self.group_blocks: dict[str, list[list[int]]] = {}  # ... of every group
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, set[int]] = {}  # positions the stand-in model computed
        self.load_errors: set[int] = set()
        self.failed_recving: set[str] = set()  # requests whose load failed (as a whole)
        self.finished: set[str] = set()
        self.stats: list[dict] = []
        self.hits_by_source: dict[str, int] = {}  # vLLM's connector hit tokens, by tier
        self._ids = itertools.count()

    def add(self, tokens: list[int], max_tokens: int = 1, priority: int = 0) -> str:
        request = self.request(tokens, max_tokens, priority)
        req_id = request.request_id
        self.scheduler.add_request(request)
        self.tokens[req_id] = list(tokens)
        self.computed[req_id] = set()
        return req_id

    def request(self, tokens: list[int], max_tokens: int = 1, priority: int = 0) -> Request:
        """A vLLM `Request` of this engine (its block hashes), not added to the scheduler."""
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        params.update_from_generation_config({}, EOS)
        return Request(
            request_id=f"req-{next(self._ids)}",
            prompt_token_ids=list(tokens),
            sampling_params=params,
            pooling_params=None,
            mm_features=None,
            block_hasher=get_request_block_hasher(BLOCK, sha256),
            priority=priority,
        )

    def forward(self, out) -> None:
        """The stand-in model: KV for every scheduled token, into its slot."""
        for req_id, n in out.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            start = request.num_computed_tokens - n  # (schedule() advanced it already)
            positions = torch.arange(start, start + n)
            tokens = torch.tensor(request.all_token_ids[start : start + n])
            offsets = positions % BLOCK
            for layer, name in enumerate(self.layers, self.first_layer):
                ids = self.group_blocks[req_id][self.layer_group[name]]
                blocks = torch.tensor(ids)[positions // BLOCK]
                view = self.kv[name]  # [B, H, N, C]
                shape = (view.shape[1], view.shape[3])
                value = kv_value(layer, positions, tokens, shape, view.dtype, self.cache_dtype)
                view[blocks, :, offsets] = value
            self.computed[req_id].update(positions.tolist())

    def step(self, before_load=None) -> Any:
        out = self.scheduler.schedule()
        for new in out.scheduled_new_reqs:
            self.group_blocks[new.req_id] = [list(ids) for ids in new.block_ids]
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if cached.new_block_ids[i] is not None:
                if req_id in cached.resumed_req_ids:
                    self.group_blocks[req_id] = [list(ids) for ids in cached.new_block_ids[i]]
                else:
                    for mine, more in zip(self.group_blocks[req_id], cached.new_block_ids[i]):
                        mine.extend(more)
        self.block_ids.update((r, ids[0]) for r, ids in self.group_blocks.items())
        meta = out.kv_connector_metadata
        if before_load is not None:
            before_load(meta)
        # as vLLM's model runner: before the step writes a block (then the loads, the forward)
        self.worker.handle_preemptions(meta)
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(None)
        self.forward(out)
        self.worker.wait_for_save()
        # (as vLLM 0.33's model runner: `get_transfer_results`, failed loads among them)
        results = self.worker.get_transfer_results(out.finished_req_ids)
        errors = self.worker.get_block_ids_with_load_errors()
        self.failed_recving |= results.failed_recving
        self.load_errors |= errors
        self.worker.clear_connector_metadata()
        stats = self.worker.get_kv_connector_stats()
        if stats is not None:
            self.stats.append(stats.reduce())
        req_ids = list(out.num_scheduled_tokens)
        output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[self._sampled(r) for r in req_ids],
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=[],
            kv_connector_output=KVConnectorOutput(
                finished_sending=results.finished_sending or None,
                finished_recving=results.finished_recving or None,
                failed_recving=results.failed_recving,
                invalid_block_ids=errors,
            ),
        )
        for request_outputs in self.scheduler.update_from_output(out, output).values():
            said = request_outputs.scheduler_stats
            hits = said.connector_prefix_cache_stats if said is not None else None
            for source, n in (hits.hits_by_source if hits is not None else {}).items():
                self.hits_by_source[source.value] = self.hits_by_source.get(source.value, 0) + n
            for o in request_outputs.outputs:
                if o.finish_reason is not None:
                    self.finished.add(o.request_id)
        return out

    def _sampled(self, req_id: str) -> list[int]:
        """A token once the prompt is computed; none for a chunk of a longer prefill (as
        vLLM's model runner does)."""
        request = self.scheduler.requests[req_id]
        return [7] if request.num_computed_tokens >= request.num_prompt_tokens else []

    def run(self, req_ids: set[str], timeout: float = 60.0, before_load=None) -> int:
        """Step until the requests are finished and their blocks freed (saves reported),
        idling a little on steps that schedule nothing (transfers running); returns steps."""
        deadline = time.monotonic() + timeout
        for steps in itertools.count(1):
            out = self.step(before_load)
            if req_ids <= self.finished and not self.scheduler.has_requests():
                return steps
            if time.monotonic() > deadline:
                raise TimeoutError(f"requests {req_ids} not done within {timeout} s")
            if not out.num_scheduled_tokens:
                time.sleep(0.005)
        raise AssertionError("unreachable")

    def _block_layers(self, req_id: str, n_blocks: int) -> Iterator[tuple]:
        """Each of the request's first blocks in every layer whose group keeps it (not one
        where it is vLLM's null block, block 0: a sliding window's blocks before the window):
        (block index, block id, layer name, the block's view [H, N, C], what computing it
        gives as bytes [N, H, C])."""
        tokens = torch.tensor(self.tokens[req_id])
        for b in range(n_blocks):
            positions = torch.arange(b * BLOCK, (b + 1) * BLOCK)
            for layer, name in enumerate(self.layers, self.first_layer):
                block = self.group_blocks[req_id][self.layer_group[name]][b]
                if block == 0:
                    continue
                view = self.kv[name]
                shape = (view.shape[1], view.shape[3])
                want = kv_value(
                    layer, positions, tokens[positions], shape, view.dtype, self.cache_dtype
                )
                yield b, block, name, view[block], want.view(torch.uint8)

    def blocks_match(self, req_id: str, n_blocks: int) -> list[bool]:
        """Whether each of the request's first blocks holds what computing it gives, in
        every group that keeps it."""
        out = [True] * n_blocks
        for b, _, _, stored, want in self._block_layers(req_id, n_blocks):
            got = stored.permute(1, 0, 2).contiguous()  # [N, H, C]
            out[b] &= torch.equal(got.view(torch.uint8), want)
        return out

    def blocks_diagnosis(self, req_id: str, n_blocks: int) -> list[str]:
        """For each of the request's first blocks that `blocks_match` finds wrong, per layer,
        what its bytes are instead, so that a failure says which mechanism wrote them: all
        zeros (pages dropped or a block never written), the right KV in another layout's
        order (a value of another layout loaded), or other bytes (where the first
        difference is, and the block's address)."""
        out = []
        for b, block, name, stored, want in self._block_layers(req_id, n_blocks):
            got = stored.permute(1, 0, 2).contiguous().view(torch.uint8)  # [N, H, C]
            if torch.equal(got, want):
                continue
            raw = stored.contiguous().view(torch.uint8)  # [H, N, C], as logical
            if not got.any():
                what = "zeros"
            elif torch.equal(raw.flatten(), want.flatten()):
                what = "the right KV in [N, H, C] order where [H, N, C] is read"
            else:
                flat_got, flat_want = got.flatten(), want.flatten()
                diff = (flat_got != flat_want).nonzero().flatten()
                what = f"{len(diff)} of {flat_got.numel()} bytes differ from {int(diff[0])}"
            at = stored.data_ptr()
            out.append(f"block {b} (id {block}) layer {name} at {at:#x}: {what}")
        return out

    def close(self) -> None:
        self.worker.shutdown()
        self.scheduler.connector.shutdown()
