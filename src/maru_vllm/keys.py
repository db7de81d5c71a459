"""What a key names. A hit is the bytes written under its key, or a miss: so besides vLLM's own
block hash (chained over the prefix) a key names everything else the value's bytes depend on:
the model (its weights' name, not only the served alias), the KV format (model dtype, KV cache
dtype, specs, the byte order a value is written in) and the rank's shard (PP stage, PCP and TP
rank), so an instance never reads bytes of another model, format or shard as a hit. This module
owns the namespace (`key_namespace`, `kv_namespace`: the model and format), the tokens a block
hash covers (`hash_block_size`) and the worker's shard (`parallel_rank`, `mla_shared`, which the
connector's `_scope` names); the scheduler and every worker compute them from the same configs
(docs/vllm.md).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from vllm.v1.core.kv_cache_utils import resolve_dcp_kv_block_size, resolve_kv_cache_block_sizes

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.kv_cache_layout import KVCacheLayout


_VALUE_FORMAT = 2  # bump when the connector changes how a value's bytes are laid out


def _canon(obj: Any) -> Any:
    """A JSON-able description of a config value (dataclasses field by field), the same in
    every process for the same value."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = {f.name: _canon(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        return {"@": type(obj).__qualname__, **fields}
    if isinstance(obj, enum.Enum):
        return f"{type(obj).__qualname__}.{obj.name}"
    if isinstance(obj, dict):
        return {str(k): _canon(v) for k, v in sorted(obj.items(), key=lambda kv: str(kv[0]))}
    if isinstance(obj, (list, tuple, set, frozenset)):
        items = [_canon(v) for v in obj]
        return sorted(items, key=repr) if isinstance(obj, (set, frozenset)) else items
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, torch.dtype):
        return str(obj)
    if hasattr(obj, "__dict__"):
        return {"@": type(obj).__qualname__, **_canon(vars(obj))}
    return f"{type(obj).__qualname__}:{obj}"


def _model_identity(model: Any) -> dict[str, Any]:
    """Which weights compute the KV: the model as given (path or hub id), its revisions and
    its architecture config (overrides applied). The key's model name is the served name, an
    alias (`--served-model-name`) that two deployments of other weights may share."""
    hf_config = getattr(model, "hf_config", None)
    try:
        arch = hf_config.to_dict() if hf_config is not None else None
    except Exception:  # (a config that cannot say itself: its type only)
        arch = type(hf_config).__qualname__
    if isinstance(arch, dict):  # (not the weights: where and by what it was read)
        arch = {k: v for k, v in arch.items() if k not in ("_name_or_path", "transformers_version")}
    return {
        "model": getattr(model, "model", None),
        "revision": getattr(model, "revision", None),
        "code_revision": getattr(model, "code_revision", None),
        "config": json.loads(json.dumps(arch, sort_keys=True, default=str)),
    }


def kv_namespace(
    vllm_config: VllmConfig,
    kv_cache_config: KVCacheConfig,
    groups: Sequence[int],
    block_size: int,
    layout: KVCacheLayout,
) -> str:
    """`<KV dtype>-<fingerprint>`: the KV cache dtype as resolved (the model's dtype where
    `cache_dtype` is "auto", else `cache_dtype`: fp8_e4m3 and fp8_e5m2 are both uint8 tensors),
    and a hash of everything else a value's bytes depend on that the scheduler knows: the
    model (`_model_identity`), its dtype and quantization, the cache's dtypes, each group's
    KV cache spec (heads, head size, dtype, quantization mode, ...), the value's byte order
    (the resolved layout), the tokens per block and how context parallelism splits them."""
    model, cache = vllm_config.model_config, vllm_config.cache_config
    parallel = vllm_config.parallel_config
    model_dtype = str(getattr(model, "dtype", None)).removeprefix("torch.")
    cache_dtype = str(getattr(cache, "cache_dtype", "auto"))
    fp8 = None
    if "fp8" in cache_dtype:  # plain "fp8" is e4m3fn on CUDA, e4m3fnuz on ROCm
        try:
            from vllm.platforms import current_platform

            fp8 = str(current_platform.fp8_dtype())
        except Exception:  # (no platform: the dtype string alone)
            fp8 = "?"
    desc = {
        "format": _VALUE_FORMAT,
        "model": _model_identity(model),
        "model_dtype": model_dtype,
        "quantization": getattr(model, "quantization", None),
        "cache_dtype": cache_dtype,
        "fp8": fp8,
        "skip_layers": _canon(getattr(cache, "kv_cache_dtype_skip_layers", None)),
        "mamba_dtypes": [
            str(getattr(cache, "mamba_cache_dtype", None)),
            str(getattr(cache, "mamba_ssm_cache_dtype", None)),
        ],
        "value_order": layout.name,
        "block_size": block_size,
        "dcp": getattr(parallel, "decode_context_parallel_size", 1),
        "pcp": getattr(parallel, "prefill_context_parallel_size", 1),
        "cp_interleave": getattr(parallel, "cp_kv_cache_interleave_size", 1),
        "groups": [_canon(kv_cache_config.kv_cache_groups[g].kv_cache_spec) for g in groups],
    }
    # an EAGLE-style drafter's layers are in the target's KV cache groups: its weights make
    # part of every value's bytes (none where speculative decoding keeps no KV of its own)
    spec = getattr(vllm_config, "speculative_config", None)
    draft = getattr(spec, "draft_model_config", None)
    if draft is not None:
        desc["drafter"] = {"method": str(spec.method), "model": _model_identity(draft)}
    digest = hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:16]
    kv_dtype = model_dtype if cache_dtype == "auto" else cache_dtype
    return f"{kv_dtype}-{digest}"


def key_namespace(
    key_prefix: str,
    vllm_config: VllmConfig,
    kv_cache_config: KVCacheConfig,
    groups: Sequence[int],
    block_size: int,
    layout: KVCacheLayout,
) -> str:
    """`<maru_key_prefix>/<served name>/<block size>/<kv_namespace>`: every key's beginning
    (the served name is for operators reading `maru keys`; the fingerprint decides)."""
    model = vllm_config.model_config
    name = model.served_model_name if model is not None else "model"
    if isinstance(name, (list, tuple)):
        name = name[0]
    kv = kv_namespace(vllm_config, kv_cache_config, groups, block_size, layout)
    return f"{key_prefix}/{name}/{block_size}/{kv}"


def mla_shared(vllm_config: VllmConfig) -> bool:
    """Whether every TP rank holds the same KV (MLA's latent KV), so TP rank 0 alone stores
    it; not where context parallelism splits the tokens between ranks (each its own)."""
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    use_mla = bool(model is not None and getattr(model, "use_mla", False))
    dcp = getattr(parallel, "decode_context_parallel_size", 1)
    return use_mla and dcp == 1 and getattr(parallel, "prefill_context_parallel_size", 1) == 1


def hash_block_size(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, groups: Sequence[int]
) -> int:
    """Tokens per entry of `Request.block_hashes`, which must be every saved group's tokens
    per block (under DCP: the block size times the DCP size), else hash i is not block i."""
    size = kv_cache_config.hash_block_size
    if size is None:
        size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)[1]
    dcp = vllm_config.parallel_config.decode_context_parallel_size
    for g in groups:
        spec = kv_cache_config.kv_cache_groups[g].kv_cache_spec
        if resolve_dcp_kv_block_size(spec, dcp) != size:
            raise ValueError(
                f"MaruKVConnector: KV cache group {g} has blocks of "
                f"{resolve_dcp_kv_block_size(spec, dcp)} tokens and block hashes cover {size}; "
                "it stores one value per block hash and does not support this model's groups"
            )
    return size


def parallel_rank(pp_size: int, pcp_size: int, tp_size: int) -> tuple[int, int, int]:
    """This worker's (PP stage, PCP rank, TP rank) from vLLM's process groups; (0, 0, 0) where
    they are not set up (a single process), when the config asks for one of each."""
    from vllm.distributed import parallel_state as ps

    rank = []
    for getter, size in (
        (ps.get_pp_group, pp_size),
        (ps.get_pcp_group, pcp_size),
        (ps.get_tp_group, tp_size),
    ):
        try:
            group = getter()
        except AssertionError:  # not initialized
            if size != 1:
                raise RuntimeError(
                    f"MaruKVConnector: {getter.__name__}: no process group for a size of {size}"
                ) from None
            rank.append(0)
            continue
        if group.world_size != size:
            raise RuntimeError(
                f"MaruKVConnector: {getter.__name__} has {group.world_size} ranks, the config "
                f"{size}"
            )
        rank.append(group.rank_in_group)
    return rank[0], rank[1], rank[2]
