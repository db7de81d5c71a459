"""Real SGLang host KV pools on CPU, filled with reproducible data (tests only).

`make_pools` builds the device pool SGLang would build (on CPU) and the host pool on top of it,
exactly as SGLang's controllers do, with `pin_memory=False` (pinning needs CUDA);
`make_host_pool` is its host pool alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TOKENS = 512  # device pool capacity; the host pool gets 2x (host_to_device_ratio)


@dataclass(frozen=True)
class Geometry:
    attn: str = "mha"  # "mha" or "mla"
    layout: str = "page_first_direct"
    page_size: int = 4
    layers: int = 3
    heads: int = 2
    head_dim: int = 16
    kv_lora_rank: int = 32
    rope_dim: int = 8
    dtype: torch.dtype = torch.bfloat16
    start_layer: int = 0  # a PP stage's first layer


def make_pools(g: Geometry, tokens: int | None = None):
    """The device pool SGLang would build (on CPU) for `g`, of `tokens` tokens (default: the
    module's `TOKENS` when called, which benchmarks set), and the host pool (2x) on top of it,
    exactly as SGLang's controllers build them, with `pin_memory=False` (pinning needs CUDA):
    `(device_pool, host_pool)`."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    tokens = TOKENS if tokens is None else tokens
    first, last = g.start_layer, g.start_layer + g.layers - 1
    if g.attn == "mha":
        device_cls, host_cls = MHATokenToKVPool, MHATokenToKVPoolHost
        shape = {"head_num": g.heads, "head_dim": g.head_dim}
    else:
        device_cls, host_cls = MLATokenToKVPool, MLATokenToKVPoolHost
        shape = {"kv_lora_rank": g.kv_lora_rank, "qk_rope_head_dim": g.rope_dim}
    device_pool = device_cls(
        tokens,
        g.page_size,
        g.dtype,
        layer_num=g.layers,
        device="cpu",
        enable_memory_saver=False,
        start_layer=first,
        end_layer=last,
        **shape,
    )
    host_kwargs = (
        {"write_back_staging": device_pool.hicache_write_back_staging}
        if g.attn == "mha"
        else {"target_layer_num": g.layers}
    )
    host_pool = host_cls(
        device_pool.get_device_pool_infos()[0].buffer_info,
        2,  # host_to_device_ratio
        0,
        g.page_size,
        g.layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=device_pool.size,
        start_layer=first,
        end_layer=last,
        **host_kwargs,
    )
    return device_pool, host_pool


def make_host_pool(g: Geometry):
    """The host pool of `make_pools` (over a device pool of `TOKENS` tokens)."""
    return make_pools(g)[1]


def page_indices(first_page: int, pages: int, page_size: int) -> torch.Tensor:
    """Token indices of `pages` consecutive host pages starting at page `first_page`."""
    start = first_page * page_size
    return torch.arange(start, start + pages * page_size, dtype=torch.int64)


def expected_pages(pool, pages: int, seed: int) -> list[torch.Tensor]:
    """Reproducible page contents (flat, in the pool's dtype), the same in every process."""
    gen = torch.Generator().manual_seed(seed)
    numel = pool.get_dummy_flat_data_page().numel()
    return [torch.randn(numel, generator=gen).to(pool.dtype) for _ in range(pages)]


def fill(pool, indices: torch.Tensor, pages: list[torch.Tensor]) -> None:
    for i, page in enumerate(pages):
        pool.set_from_flat_data_page(int(indices[i * pool.page_size]), page)


def read(pool, indices: torch.Tensor, pages: int) -> list[torch.Tensor]:
    return [
        pool.get_data_page(int(indices[i * pool.page_size]), flat=True).clone()
        for i in range(pages)
    ]


def storage_config(
    *,
    model: str = "tiny-test",
    tp_rank: int = 0,
    tp_size: int = 1,
    is_mla: bool = False,
    extra: dict | None = None,
):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=is_mla,
        enable_storage_metrics=True,
        is_page_first_layout=False,
        model_name=model,
        extra_config=extra or {},
    )
