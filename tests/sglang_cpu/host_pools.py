"""Real SGLang host KV pools on CPU, filled with reproducible data (tests only).

`make_host_pool` builds the device pool SGLang would build (on CPU) and the host pool on top of
it, exactly as SGLang's controllers do, with `pin_memory=False` (pinning needs CUDA).
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


def make_host_pool(g: Geometry):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    first, last = g.start_layer, g.start_layer + g.layers - 1
    common = dict(device="cpu", enable_memory_saver=False, start_layer=first, end_layer=last)
    if g.attn == "mha":
        device_pool = MHATokenToKVPool(
            TOKENS,
            g.page_size,
            g.dtype,
            head_num=g.heads,
            head_dim=g.head_dim,
            layer_num=g.layers,
            **common,
        )
        return MHATokenToKVPoolHost(
            device_pool.get_device_pool_infos()[0].buffer_info,
            2,
            0,
            g.page_size,
            g.layout,
            pin_memory=False,
            device="cpu",
            device_capacity_tokens=device_pool.size,
            start_layer=device_pool.start_layer,
            end_layer=device_pool.end_layer,
            write_back_staging=device_pool.hicache_write_back_staging,
        )
    device_pool = MLATokenToKVPool(
        TOKENS,
        g.page_size,
        g.dtype,
        kv_lora_rank=g.kv_lora_rank,
        qk_rope_head_dim=g.rope_dim,
        layer_num=g.layers,
        **common,
    )
    return MLATokenToKVPoolHost(
        device_pool.get_device_pool_infos()[0].buffer_info,
        2,
        0,
        g.page_size,
        g.layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=device_pool.size,
        start_layer=first,
        end_layer=last,
        target_layer_num=g.layers,
    )


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
