"""Where a block's bytes sit in vLLM's KV cache: for each cache group, the segments of a block
(address, stride, length) across its layers' KV views (`GroupLayout`), and the byte order of a
stored value, the engine's resolved layout's (`resolved_layout`, `value_order`). A value's bytes
are a function of the block's logical KV and that order only, not of the memory's strides or
kernel block size, so the key (`maru_vllm.keys`, which names the order) describes them. The
copies dereference these addresses in this process: KV caches in CPU memory only
(`check_host_memory`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from vllm.v1.kv_cache_layout import KVCacheLayout

from maru.client import page_pointers

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


@dataclass
class GroupLayout:
    """For one cache group: block b's bytes are segments s at `base[s] + b * stride[s]`, each
    `length[s]` bytes; a stored value is the segments back to back. `blocks`: the KV cache's
    blocks (ids 0 to blocks - 1)."""

    base: np.ndarray
    stride: np.ndarray
    length: np.ndarray
    value_size: int
    blocks: int
    affine: np.ndarray = field(init=False)  # (segments, 2): each one's (base, stride)

    def __post_init__(self) -> None:
        self.affine = np.ascontiguousarray(np.stack([self.base, self.stride], axis=1), np.int64)

    def addresses(self, block_ids: Sequence[int]) -> np.ndarray:
        """[blocks, segments] int64: where each segment of each block is. ValueError (saying
        why) for an id outside the KV cache, or one given twice: vLLM's block pool never
        gives one, but a load would write outside the KV cache (or two values into a block)
        and a save store other memory under a block's key. One C pass checks and computes
        (`page_pointers`, SGLang's `check_pages`)."""
        ids = np.ascontiguousarray(block_ids, dtype=np.int64)
        try:
            raw = page_pointers(
                ids.ctypes.data, len(ids), 1, self.affine, slots=self.blocks, distinct=True
            )
        except ValueError as exc:
            raise ValueError(f"block ids of a KV cache of {self.blocks} blocks: {exc}") from None
        return np.frombuffer(raw, np.int64).reshape(len(ids), len(self.base))


# The logical dims of a vLLM 0.33 per-layer KV view `[B, H, N, C]` (vllm.v1.kv_cache_layout).
_H, _N, _C = 1, 2, 3
_MAX_SEGMENTS = 1 << 16  # per block and layer: beyond, the layout is not worth copying


def value_order(layout: KVCacheLayout) -> tuple[int, ...]:
    """The order of H, N, C in a stored value: the engine's resolved layout's (so that a
    layer's block is one dense run in the usual case), whatever order the memory has."""
    return tuple(d for d in layout.layer_view_order if d != 0)


def _layer_segments(
    kv: torch.Tensor, num_blocks: int, order: tuple[int, ...]
) -> list[tuple[int, int, int]]:
    """(address, stride, length) of the runs of one logical block of a `[B, H, N, C]` layer
    view (B a multiple of `num_blocks`: kernel blocks), in the value's byte order `order`
    (tokens: kernel block, then token in it). The value's bytes are a function of the view's
    logical contents and `order` only: not of its strides or kernel block size."""
    if kv.ndim != 4 or kv.shape[0] % num_blocks:
        raise ValueError(
            f"a KV view of shape {tuple(kv.shape)} is not [B, H, N, C] with B a multiple of "
            f"{num_blocks}; MaruKVConnector does not support this layout"
        )
    ratio = kv.shape[0] // num_blocks
    el = kv.element_size()
    dims: list[tuple[int, int]] = []  # (size, byte stride), outermost first
    for d in order:
        if d == _N:
            dims.append((ratio, kv.stride(0) * el))
        dims.append((kv.shape[d], kv.stride(d) * el))
    dims = [(n, st) for n, st in dims if n > 1]
    run = el
    while dims and dims[-1][1] == run:  # merge the dense innermost dims into one run
        run *= dims.pop()[0]
    count = int(np.prod([n for n, _ in dims], dtype=np.int64))
    if count > _MAX_SEGMENTS:
        raise ValueError(
            f"KV layout {tuple(kv.shape)} / strides {kv.stride()}: a block is {count} runs of "
            f"{run} bytes; MaruKVConnector does not support this layout"
        )
    block_stride = kv.stride(0) * el * ratio
    return [
        (kv.data_ptr() + sum(i * st for i, (_, st) in zip(idx, dims)), block_stride, run)
        for idx in itertools.product(*(range(n) for n, _ in dims))
    ]


def group_layout(
    tensors: Sequence[torch.Tensor], num_blocks: int, order: tuple[int, ...]
) -> GroupLayout:
    # each segment once, in order: layers may share one KV cache (cross-layer sharing)
    segs = list(
        dict.fromkeys(seg for kv in tensors for seg in _layer_segments(kv, num_blocks, order))
    )
    base, stride, length = (np.array(col, dtype=np.int64) for col in zip(*segs))
    return GroupLayout(base, stride, length, int(length.sum()), num_blocks)


_LAYOUT_ALIASES = {"NHD": "LBNHC", "HND": "LBHNC"}


def resolved_layout(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> KVCacheLayout:
    """The engine's resolved KV cache layout: the same on the scheduler and every worker
    (vLLM's engine core resolves it once and hands it to both); LBNHC where unresolved."""
    name = kv_cache_config.kv_cache_layout or vllm_config.cache_config.kv_cache_layout
    name = _LAYOUT_ALIASES.get(name or "LBNHC", name or "LBNHC")
    return KVCacheLayout[name]


def check_host_memory(kv_caches: dict[str, torch.Tensor]) -> None:
    """The copies dereference the KV caches' addresses in this process: a GPU's would crash
    the worker at its first transfer. Refused at the start instead, naming the device."""
    devices = sorted({str(kv.device) for kv in kv_caches.values() if kv.device.type != "cpu"})
    if devices:
        raise ValueError(
            f"MaruKVConnector: KV caches on {', '.join(devices)}; it copies blocks through "
            "host memory and supports KV caches in CPU memory only (vLLM's CPU backend)"
        )
