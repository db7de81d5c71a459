"""One SGLang host pool as `MaruStorage` stores it: its key namespace, the geometry of a page
(`get_page_buffer_meta`: a pointer and size per part), and the copies between the host pool
and shared memory, where a page is one allocation holding its parts back to back.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

from maru.client import (
    CopyStarted,
    copy_many,
    copy_many_hashed,
    copy_values,
    copy_values_start,
    page_pointers,
)

log = logging.getLogger(__name__)

KV_POOL_NAME = "kv"
_ALLOC_ALIGN = 4096  # MaruConfig rounds chunk_size_bytes up to a multiple of this

# Host pool classes whose pages are the same on every TP rank of an MLA model (as Mooncake keys
# them). A pool not listed keeps the rank in its namespace: fewer hits, never two ranks' bytes
# under one key. Mamba state is TP-sharded even in MLA models.
RANK_REPLICATED_POOLS = frozenset(
    {
        "MLATokenToKVPoolHost",
        "DSAIndexerPoolHost",
        "DeepSeekV4PagedHostPool",
        "DeepSeekV4StateHostPool",
        "LogicalHostPool",
    }
)


def chunk_size_for(page_bytes: int) -> int:
    """The chunk size that wastes nothing on `page_bytes`-sized values (every value MaruStorage
    stores is one page): one chunk per page, rounded up to 4 KiB."""
    return max(_ALLOC_ALIGN, -(-page_bytes // _ALLOC_ALIGN) * _ALLOC_ALIGN)


def _digest(fields: Sequence[str]) -> str:
    return hashlib.sha256("|".join(fields).encode()).hexdigest()[:16]


def _scope_fields(storage_config: HiCacheStorageConfig, pool: Any) -> list[str]:
    """What every pool's namespace shares: PP stage (and its first layer where not 0: a custom
    layer split, `SGLANG_PP_LAYER_PARTITION`, gives a stage as many layers at another
    place), attention-CP and DP ranks."""
    start = int(getattr(pool, "start_layer", 0) or 0)
    return [
        f"pp={storage_config.pp_rank}/{storage_config.pp_size}",
        *([f"start_layer={start}"] if start else []),
        f"cp={storage_config.attn_cp_rank}/{storage_config.attn_cp_size}",
        f"dp={storage_config.dp_rank}",
    ]


# Element types that do not say what their bytes mean: SGLang keeps a quantized KV cache
# (fp8 of either format, mxfp8, fp4) as bytes, in the device pool and in the host pool alike.
_BYTE_DTYPES = (torch.uint8, torch.int8)
_PRIVATE_FORMAT: str | None = None  # this process's format where SGLang published none


def _kv_format_fields(dtype: Any) -> list[str]:
    """For a pool of bytes, what its bytes encode: SGLang's `--kv-cache-dtype` as the scheduler
    published it (fp8_e4m3 and fp8_e5m2 pages are the same length, so without it one model
    run each way would read the other's pages as hits), and ROCm's fp8 variant. Where SGLang
    published no setting (a pool built outside a server), a namespace of this process alone:
    misses for every other instance, never another format's bytes."""
    if dtype not in _BYTE_DTYPES:
        return []  # (the dtype says it: bf16, fp16, fp32)
    setting = _kv_cache_dtype_setting()
    if setting is None:
        global _PRIVATE_FORMAT
        if _PRIVATE_FORMAT is None:
            _PRIVATE_FORMAT = f"unpublished-{os.urandom(8).hex()}"
            log.warning(
                "MaruStorage: the KV cache is stored as %s and SGLang published no "
                "--kv-cache-dtype in this process, so what its bytes encode is unknown: its "
                "pages are kept apart from every other instance's (no shared hits)",
                dtype,
            )
        setting = _PRIVATE_FORMAT
    return [f"kv={setting}", f"rocm={bool(torch.version.hip)}"]


def _kv_cache_dtype_setting() -> str | None:
    """SGLang's `--kv-cache-dtype` (auto, fp8_e4m3, fp8_e5m2, mxfp8, ...) in this process, or
    None when no server published it."""
    try:
        from sglang.srt.runtime_context import get_model

        return str(get_model().kv_cache_dtype)
    except (ImportError, ValueError, AttributeError):
        pass
    try:  # (SGLang releases before the runtime context)
        from sglang.srt.server_args import get_global_server_args

        return str(get_global_server_args().kv_cache_dtype)
    except Exception:  # (not there, or not set: both mean unknown)
        return None


# Load formats that read the checkpoint at `--model-path` as it is: every other one (`dummy`:
# random weights; `bitsandbytes`, `layered`, `flash_rl`: quantized while loading;
# `remote_instance`, `ipc_cache`, ...: weights from elsewhere) is named in the namespace.
_CHECKPOINT_FORMATS = frozenset(
    {"auto", "pt", "safetensors", "instanttensor", "npcache", "fastsafetensors", "local_cached",
     "runai_streamer"}
)  # fmt: skip


def _published(bag: str) -> Any:
    """SGLang's published `get_<bag>()` config bag in this process, or None (no server)."""
    try:
        from sglang.srt import runtime_context

        return getattr(runtime_context, f"get_{bag}")()
    except (ImportError, ValueError, AttributeError):
        return None


def _set(bag: Any, name: str) -> Any:
    value = getattr(bag, name, None)
    return None if value in (None, "", "{}", [], False) else value


def weight_version() -> str:
    """SGLang's weight version in this process (`--weight-version`, "default"): a weight update
    that names one (`/update_weights_from_*` with `weight_version`, as RL loops send) changes it
    in the scheduler, where storage runs; "default" where none is published."""
    serving = _published("serving")
    version = getattr(serving, "weight_version", None) if serving is not None else None
    return str(version) if version else "default"


def _weights_fields(storage_config: HiCacheStorageConfig, pool: Any) -> list[str]:
    """What the weights are, beyond the model name, each only where it is set: SGLang gives
    storage its served model name, which an alias (`--served-model-name`) makes say nothing of
    the checkpoint; `--revision`; a load format that does not read the checkpoint as it is
    (`dummy`); online quantization (`--quantization`, `--modelopt-quant`, KV scales from
    `--quantization-param-path`); `--json-model-override-args` (rope scaling, layer count);
    custom weight loaders; for a KV cache not in the model's dtype (fp8), an explicit
    `--dtype` (the activations cast into it); and the weight version where not "default"
    (`weight_version`: updates change it). Nothing where SGLang published no setting (a pool
    built outside a server) or all are defaults: those namespaces are unchanged."""
    model = _published("model")
    if model is None:
        return []
    fields: list[str] = []
    path = _set(model, "model_path")
    name = storage_config.model_name or ""
    tag = getattr(pool, "storage_format_tag", None)
    if tag and name.endswith(f"-{tag}"):  # (`storage_model_name` tags a host pool's format)
        name = name[: -len(tag) - 1]
    if path is not None and str(path) != name:
        fields.append(f"weights={path}")
    for setting in ("revision", "quantization", "modelopt_quant", "quantize_and_serve",
                    "rl_quant_profile", "quantization_param_path", "json_model_override_args",
                    "custom_weight_loader", "modelopt_checkpoint_restore_path"):  # fmt: skip
        value = _set(model, setting)
        if value is not None:
            fields.append(f"{setting}={value}")
    load_format = str(getattr(model, "load_format", "auto") or "auto")
    if load_format not in _CHECKPOINT_FORMATS:
        fields.append(f"load_format={load_format}")
    kv = str(getattr(model, "kv_cache_dtype", "auto") or "auto")
    dtype = str(getattr(model, "dtype", "auto") or "auto")
    if kv != "auto" and dtype != "auto":
        fields.append(f"model_dtype={dtype}")
    version = weight_version()
    if version != "default":
        fields.append(f"weight_version={version}")
    return fields


_PRIVATE_DRAFT: str | None = None  # this process's draft model where SGLang published none


def _draft_fields(name: str) -> list[str]:
    """For a speculative draft pool (`draft`, `draft_indexer`, `draft_swa`), the draft model:
    its pages are computed by the draft's weights, which the target's model name does not
    name, and two drafts of one geometry (EAGLE heads of one target) write pages of one
    length. Where SGLang published no setting, a namespace of this process alone."""
    if not name.startswith("draft"):
        return []
    try:
        from sglang.srt.runtime_context import get_spec

        spec = get_spec()
        setting = (
            f"{spec.speculative_algorithm}:{spec.speculative_draft_model_path}"
            f"@{spec.speculative_draft_model_revision}"
        )
        # (each only where set: a draft's own quantization, load format, KV format)
        quant = _set(spec, "speculative_draft_model_quantization")
        if quant is not None:
            setting += f"|quantization={quant}"
        load_format = _set(spec, "speculative_draft_load_format")
        if load_format is not None and str(load_format) not in _CHECKPOINT_FORMATS:
            setting += f"|load_format={load_format}"
        kv = _set(spec, "speculative_draft_kv_cache_dtype")
        if kv is not None and str(kv) != "auto":
            setting += f"|kv={kv}"
    except (ImportError, ValueError, AttributeError):
        global _PRIVATE_DRAFT
        if _PRIVATE_DRAFT is None:
            _PRIVATE_DRAFT = f"unpublished-{os.urandom(8).hex()}"
            log.warning(
                "MaruStorage: SGLang published no speculative draft model in this process: "
                "its draft pools' pages are kept apart from every other instance's"
            )
        setting = _PRIVATE_DRAFT
    return [f"draft_model={setting}"]


def page_namespace(storage_config: HiCacheStorageConfig, pool: Any) -> str:
    """The KV pool's namespace: a short hash of every field a KV page's bytes depend on (the
    layout: `page_first` and `page_first_direct` order a page differently; the TP shard only for
    MHA). A mismatch in any field gives another namespace: a miss, never garbage."""
    fields: list[str] = [
        f"model={storage_config.model_name or ''}",
        f"dtype={pool.dtype}",
        f"layers={pool.layer_num}",
        f"page={pool.page_size}",
        f"layout={pool.layout}",
        *_kv_format_fields(pool.dtype),
        *_weights_fields(storage_config, pool),
    ]
    if storage_config.is_mla_model:
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
    return _digest(fields + _scope_fields(storage_config, pool))


def is_rank_replicated(storage_config: HiCacheStorageConfig, pool: Any) -> bool:
    """Whether `pool`'s pages are identical on every TP rank (so one rank writes them and
    every rank reads them)."""
    if not storage_config.is_mla_model:
        return False
    return any(cls.__name__ in RANK_REPLICATED_POOLS for cls in type(pool).__mro__)


def _state_fields(pool: Any) -> list[str]:
    """A state pool's element types and shapes where its `dtype` tells only part of them
    (`MambaPoolHost`: `dtype` is the conv state's; the SSM state's is its own, from
    SGLANG_MAMBA_SSM_DTYPE or the model config, and slot side states have theirs). bf16 and
    fp16 states, or int32 and fp32 side states, are as long: part sizes cannot tell them
    apart. Nothing for a pool without them (its namespace is unchanged)."""
    fields: list[str] = []
    temporal = getattr(pool, "temporal_dtype", None)
    if temporal is not None:
        shape = tuple(getattr(pool, "temporal_state_shape", ()))
        fields.append(f"temporal={temporal}{shape}")
    conv = getattr(pool, "conv_state_shapes", None)
    if conv is not None:
        fields.append(f"conv={[tuple(s) for s in conv]}")
    side = getattr(pool, "slot_state_buffers", None) or ()
    if side:
        fields.append("side=" + ",".join(f"{b.dtype}{tuple(b.shape[1:])}" for b in side))
    return fields


def sidecar_namespace(
    storage_config: HiCacheStorageConfig,
    name: str,
    pool: Any,
    part_sizes: Sequence[int],
    replicated: bool,
) -> str:
    """A sidecar pool's namespace: as `page_namespace`, with the pool's name and class and its
    part sizes (heads, state shapes and dims show there), and the DCP shard instead of the TP
    one when rank-replicated. No two pools, and no two geometries, share keys."""
    fields = [
        f"pool={name}",
        f"class={type(pool).__name__}",
        f"model={storage_config.model_name or ''}",
        f"dtype={getattr(pool, 'dtype', '')}",
        f"layers={getattr(pool, 'layer_num', '')}",
        f"page={getattr(pool, 'page_size', '')}",
        f"layout={getattr(pool, 'layout', '')}",
        f"parts={','.join(map(str, part_sizes))}",
        *_state_fields(pool),
        *_kv_format_fields(getattr(pool, "dtype", None)),
        *_draft_fields(name),
        *_weights_fields(storage_config, pool),
    ]
    if replicated:
        fields.append(f"dcp={storage_config.dcp_rank}/{storage_config.dcp_size}")
    else:
        fields.append(f"tp={storage_config.tp_rank}/{storage_config.tp_size}")
    return _digest(fields + _scope_fields(storage_config, pool))


def _index_space(pool: Any) -> tuple[int, int]:
    """(page, slots): how many host indices make a page, and how many there are. Under DCP
    SGLang addresses the pool by logical slots (`logical_page_size` a page, `logical_size` in
    all, this rank holding its share of each page); else these are `page_size` and `size`."""
    page = int(getattr(pool, "logical_page_size", None) or getattr(pool, "page_size", 1) or 1)
    slots = int(getattr(pool, "logical_size", None) or getattr(pool, "size", 0) or 0)
    return page, slots // page * page


def _affine_page_pointers(pool: Any, parts: int) -> list[tuple[int, int]] | None:
    """In page-first layouts each page part's pointer is affine in the page's first index t:
    `ptr = base + t * stride`. Learn (base, stride) per part from `get_page_buffer_meta` on two
    pages and check it on two more; None if the pool does not follow it."""
    page, slots = _index_space(pool)
    pages = slots // page
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


def _index_memory(host_indices: torch.Tensor) -> tuple[int, int, Any]:
    """(address, count, owner): `count` int64 host indices at `address`, kept alive by
    `owner`. SGLang's (contiguous int64 on CPU) are read in place, others copied; what cannot
    be read as integers is a ValueError."""
    t = host_indices
    try:
        if t.is_cpu and t.dtype is torch.int64 and t.is_contiguous():
            return t.data_ptr(), t.numel(), t
        array = np.ascontiguousarray(t.detach().cpu().numpy(), np.int64)
    except (AttributeError, TypeError, RuntimeError, NotImplementedError) as exc:
        raise ValueError(f"host indices not readable as integers: {exc}") from None
    return array.ctypes.data, array.size, array


_NO_PARTS = np.zeros((0, 2), np.int64)  # (`page_pointers` that only checks the pages)


def check_pages(address: int, count: int, page: int, slots: int | None, distinct: bool) -> None:
    """ValueError, saying why, unless the `count` int64 indices at `address` are whole pages
    of a pool of `slots` (None: unbounded): each `page` consecutive slots from a multiple of
    `page`, below `slots`; with `distinct`, no page twice. The check of `page_pointers`, in
    C, with no pointer made (`PoolIO.pointers` makes them in the same pass where it can)."""
    page_pointers(address, count, page, _NO_PARTS, **_checks(slots, distinct))


def _checks(slots: int | None, distinct: bool) -> dict[str, Any]:
    return {"slots": (1 << 63) - 1 if slots is None else slots, "distinct": distinct}


class PoolIO:
    """How one registered host pool's pages are keyed and copied. A logical pool (`page_bytes`
    0: DeepSeek-V4's KV anchor) is never stored and always "present": the sidecars decide the
    hit. A pool `get_page_buffer_meta` cannot describe (a Mamba pool with slot side states) is
    copied whole-page through `get_data_page` / `set_from_flat_data_page`."""

    def __init__(self, name: str, pool: Any, namespace: str, replicated: bool):
        self.name = name
        self.pool = pool
        self.set_namespace(namespace)
        self.replicated = replicated
        # host indices a page; pages start at a multiple of it below `slots`: indices outside
        # would address memory that is not the pool's (`pointers` refuses them)
        self.page_size, self.slots = _index_space(pool)
        self.whole_page = False
        self.affine: np.ndarray | None = None  # (parts, 2): each part's base and stride
        probe = torch.arange(self.page_size, dtype=torch.int64)
        meta = None
        try:
            meta = pool.get_page_buffer_meta(probe)  # None: a logical pool
        except NotImplementedError as exc:
            log.info("pool %s: %s; stored whole-page", name, exc)
            self.whole_page = True
        if self.whole_page:
            dummy = pool.get_dummy_flat_data_page()
            self.part_sizes = [dummy.numel() * dummy.element_size()]
        elif meta is None:  # a logical pool: no bytes behind its pages
            self.part_sizes = []
        else:
            ptrs, sizes = meta
            self.part_sizes = [int(s) for s in sizes]
            if len(ptrs) != len(self.part_sizes):
                raise ValueError(f"pool {name}: get_page_buffer_meta gave unpaired lists")
            model = _affine_page_pointers(pool, len(ptrs))
            if model is not None:
                self.affine = np.array(model, dtype=np.int64).reshape(len(ptrs), 2)
        if not self.slots and self.part_sizes:
            log.warning("pool %s states no size: its host indices are not bounds-checked", name)
        self.parts = len(self.part_sizes)
        self.page_bytes = sum(self.part_sizes)
        self.logical = self.page_bytes == 0  # (an attribute: every call asks)
        # (copied page by page in address order by `copy_values`: docs/performance.md)
        self.sizes = np.array(self.part_sizes, dtype=np.int64)

    def set_namespace(self, namespace: str) -> None:
        """Key this pool's pages under `namespace`; `prefix`, what its stored keys start with,
        is made once here (every data call passes it)."""
        self.namespace = namespace
        self.prefix = f"{namespace}:"

    def keys(self, keys: Sequence[str]) -> list[str]:
        prefix = self.prefix
        return [prefix + k for k in keys]

    def pointers(
        self, host_indices: torch.Tensor | None, pages: int, distinct: bool = False
    ) -> np.ndarray:
        """The host pool's side of a batch: a (pages, parts) int64 array, each page part's
        pointer. A whole-page pool gets (pages, 1): the pages' first indices (its copies go
        through the pool). ValueError, saying why, unless the indices are `pages` pages of
        this pool, each `page_size` consecutive slots from a multiple of it below its size
        (else a copy would read or write memory that is not the page's, or not the pool's);
        with `distinct` (a read), no page twice. Checked in C, in the pointers' pass."""
        page = self.page_size
        if host_indices is None:
            raise ValueError("no host indices")
        address, count, indices = _index_memory(host_indices)
        if count != pages * page:
            raise ValueError(f"{count} host indices for {pages} keys (page size {page})")
        if self.affine is not None:  # (checked as the pointers are made: no array a step)
            checks = _checks(self.slots or None, distinct)  # (0: a pool that states none)
            raw = page_pointers(address, count, page, self.affine, **checks)
            return np.frombuffer(raw, np.int64).reshape(-1, self.parts)
        check_pages(address, count, page, self.slots or None, distinct)
        firsts = np.asarray(indices)[::page].astype(np.int64)  # no Python loop per page
        if self.whole_page:
            return firsts[:, None]
        ptrs, _ = self.pool.get_page_buffer_meta(host_indices.cpu())
        return np.array(ptrs, dtype=np.int64).reshape(pages, self.parts)

    def copy_in(
        self,
        targets: np.ndarray,
        buffers: np.ndarray,
        first: int,
        last: int,
        hashed: bool = False,
        threads: int = 1,
    ) -> CopyStarted:
        """The write verb's copy (`maru.client.CopyIn`): start copying pages [first, last) of
        a batch (`buffers`: its `pointers`) to `targets`, each page's parts back to back;
        `.finish()` completes it and gives, with `hashed`, each page's checksum."""
        if self.whole_page:
            hashes = np.zeros(last - first, np.int64)
            for i, index in enumerate(buffers[first:last, 0].tolist()):
                data = self.pool.get_data_page(index, flat=True).contiguous()
                hashes[i] = self._copy_page(int(targets[i]), data.data_ptr(), hashed)
            return CopyStarted(None, hashed, hashes if hashed else None)
        return copy_values_start(
            targets, buffers[first:last], self.sizes, to_values=True, hashed=hashed, threads=threads
        )

    def copy_out(
        self, addresses: np.ndarray, buffers: np.ndarray, hashed: bool = False, threads: int = 1
    ) -> np.ndarray | None:
        """Copy each page at `addresses` (0: skipped) into the host pool (`buffers`: the
        batch's `pointers`); with `hashed`, return each page's checksum as read (0: skipped)."""
        if self.whole_page:
            page = self.pool.get_dummy_flat_data_page()
            hashes = np.zeros(len(addresses), np.int64)
            for i, (address, index) in enumerate(zip(addresses.tolist(), buffers[:, 0].tolist())):
                if address:
                    hashes[i] = self._copy_page(page.data_ptr(), address, hashed)
                    self.pool.set_from_flat_data_page(index, page)
            return hashes if hashed else None
        return copy_values(
            addresses, buffers, self.sizes, to_values=False, hashed=hashed, threads=threads
        )

    def _copy_page(self, dst: int, src: int, hashed: bool) -> int:
        """One whole page (`page_bytes`), and its checksum when `hashed` (else 0), through a
        copy loop: in software coherence it writes the pool's lines back (or invalidates them)
        as every other copy does, and a fault of the pool's memory is a `CopyFaultError`."""
        one = np.array([[dst]], np.int64), np.array([[src]], np.int64)
        if not hashed:
            copy_many(*one, [self.page_bytes], streaming=False)
            return 0
        return int(copy_many_hashed(*one, [self.page_bytes], streaming=False)[0])


@dataclasses.dataclass
class Batch:
    """One pool's share of a storage call: its pages' keys and where they are in the host
    pool (`buffers`: `PoolIO.pointers`, one row per page); `results` is filled in."""

    pool: PoolIO
    keys: list[str]
    buffers: np.ndarray | None = None
    results: list[bool] = dataclasses.field(default_factory=list)
