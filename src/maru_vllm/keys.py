"""What a key names. A hit is the bytes written under its key, or a miss: so besides vLLM's own
block hash (chained over the prefix) a key names everything else the value's bytes depend on:
the model (its weights' name, not only the served alias, and where they are loaded from), the
KV format (model dtype, KV cache dtype, specs, the byte order a value is written in), what else
changes the KV (LongRoPE's and Llama 4's `max_model_len` choices, the pipeline split) and the
rank's shard (PP stage, PCP and TP rank), so an instance never reads bytes of another model,
format or shard as a hit. This module
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
    out = {
        "model": getattr(model, "model", None),
        "revision": getattr(model, "revision", None),
        "code_revision": getattr(model, "code_revision", None),
        "config": json.loads(json.dumps(arch, sort_keys=True, default=str)),
    }
    # where the weights are read from when not `model` (`--model-weights`: `model` then holds
    # the config files only); named only where set, so other models keep their keys
    if getattr(model, "model_weights", None):
        out["weights"] = model.model_weights
    return out


# load formats that read the checkpoint `model` names (or `model_weights`): their weights are
# the model's; any other (`dummy`: random weights, `tensorizer`: a file of its extra config,
# a registered loader, ...) is named in the key
_CHECKPOINT_FORMATS = frozenset(
    {
        "auto",
        "hf",
        "pt",
        "safetensors",
        "npcache",
        "fastsafetensors",
        "instanttensor",
        "mistral",
        "runai_streamer",
        "runai_streamer_sharded",
        "sharded_state",
    }
)


def _long_rope(model: Any) -> list[Any]:
    """LongRoPE (Phi-3 and kin) rotates keys with its long factors at every position iff
    `max_model_len` exceeds `original_max_position_embeddings` (vLLM's
    `Phi3LongRoPEScaledRotaryEmbedding`): one entry per LongRoPE parameter set, which
    factors it uses; none for other models (whose rotary `max_model_len` does not change)."""
    from vllm.transformers_utils.config import iter_rope_parameters

    text = getattr(model, "hf_text_config", None)
    max_len = getattr(model, "max_model_len", None)
    out: list[Any] = []
    for params in iter_rope_parameters(text) if text is not None else ():
        if (params.get("rope_type") or params.get("type")) != "longrope":
            continue
        original = params.get("original_max_position_embeddings")
        original = original or getattr(text, "original_max_position_embeddings", None)
        long = max_len > original if isinstance(max_len, int) and original else max_len
        out.append({"long": long})
    return out


def _llama4_temperature(model: Any) -> bool:
    """Llama 4 scales the queries of its NoPE layers past 8K positions where
    `attn_temperature_tuning` is on (the generation config's, else `max_model_len` > 32K:
    vLLM's `Llama4ForCausalLM`): the layers after them then compute other KV."""
    try:
        gen = dict(model.try_get_generation_config() or {})
    except Exception:  # (no generation config to read: vLLM's default)
        gen = {}
    gen.update(getattr(model, "override_generation_config", None) or {})
    return bool(gen.get("attn_temperature_tuning", model.max_model_len > 32768))


def _other_inputs(vllm_config: VllmConfig) -> dict[str, Any]:
    """What else a value's bytes depend on that the model's identity does not name, each only
    where it is set (so that every instance without it keeps its keys): a loader that does
    not read the model's checkpoint, an online quantization's config, a model class
    override, what `max_model_len` changes in the KV (LongRoPE's factors, Llama 4's query
    temperature), and the pipeline split (`VLLM_PP_LAYER_PARTITION`: with 3 stages or more,
    stage 1 of "2,3,3" and of "3,3,2" hold as many layers, other ones)."""
    model = vllm_config.model_config
    out: dict[str, Any] = {}
    load = getattr(vllm_config, "load_config", None)
    load_format = str(getattr(load, "load_format", "auto"))
    if load_format not in _CHECKPOINT_FORMATS:
        extra = _canon(getattr(load, "model_loader_extra_config", None))
        out["loader"] = {"format": load_format, "extra": extra}
    if getattr(model, "quantization_config", None) is not None:
        out["quantization_config"] = _canon(model.quantization_config)
    if getattr(model, "model_class_overrides", None):
        out["model_class_overrides"] = _canon(model.model_class_overrides)
    if long_rope := _long_rope(model):
        out["long_rope"] = long_rope
    archs = [*(getattr(model, "architectures", None) or ())]
    archs += getattr(getattr(model, "hf_config", None), "architectures", None) or []
    if any("Llama4" in str(a) for a in archs):
        out["attn_temperature_tuning"] = _llama4_temperature(model)
    pp = getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1)
    if pp > 1:
        import vllm.envs as envs

        partition = envs.VLLM_PP_LAYER_PARTITION
        if partition is not None:
            out["pp_partition"] = [int(n) for n in str(partition).split(",")]
        elif pp > 2:  # (so that values of a split named before this are never read as these)
            out["pp_partition"] = "default"
    return json.loads(json.dumps(out, sort_keys=True, default=str))


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
    (the resolved layout), the tokens per block and how context parallelism splits them,
    and `_other_inputs` (each only where set: the weights' loader and source, online
    quantization, what `max_model_len` changes, the pipeline split)."""
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
    desc.update(_other_inputs(vllm_config))
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
