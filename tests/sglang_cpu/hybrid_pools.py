"""Real SGLang 0.5.23 host pools of hybrid models on CPU, as `HybridCacheController` registers
them with a storage backend (tests only).

Each `Hybrid` is one model kind: the KV anchor pool plus its sidecar pools, each with the hit
policy and index source SGLang's pool assembler gives it:

- `mamba`: MHA KV + `MambaPoolHost` (one state slot per page, TRAILING_PAGES, window 1:
  Qwen3-Next, Nemotron-H, Falcon-H1);
- `swa`: MHA KV + a second MHA pool as the sliding-window KV (TRAILING_PAGES, window 2);
- `dsa`: MLA KV + `DSAIndexerPoolHost` (ALL_PAGES, indices from the KV pool: DeepSeek-V3.2).

Page contents are random bytes from a seed, the same in every process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from sglang_cpu.host_pools import Geometry, make_host_pool

MAMBA_SLOTS = 24  # device state slots; the host pool gets 2x
DSA_PAGE = 64  # the DSA indexer pages by 64 tokens


@dataclass
class Sidecar:
    name: str
    pool: Any
    policy: str  # a PoolHitPolicy value
    window: int = 1  # TRAILING_PAGES: pages that must exist at the end of a prefix
    from_kv: bool = False  # indices_from_pool=KV: the KV pages' indices and keys


@dataclass
class Hybrid:
    kind: str
    kv: Any
    is_mla: bool
    sidecars: list[Sidecar] = field(default_factory=list)

    @property
    def page_size(self) -> int:
        return self.kv.page_size


def _mamba_pool(
    conv_dim: int = 16,
    *,
    layers: int = 2,
    temporal: tuple[int, ...] = (4, 8),
    conv_rows: int = 3,
    slots: int = MAMBA_SLOTS,
    host_ratio: float = 2,
    shared_device_slot: bool = False,
    temporal_dtype: torch.dtype = torch.float32,
):
    """A `MambaPoolHost` (page_first_direct) over device state buffers of `slots` slots: per
    layer a temporal state of shape `temporal` (`temporal_dtype`, SGLang's default float32)
    and a bf16 conv state of (`conv_rows`, `conv_dim`). The host pool holds
    `slots * host_ratio` states (+1).

    `shared_device_slot`: the device buffers are one slot broadcast over `slots` (they then
    only lend shapes and pointers: device<->host copies would all hit that slot), so that a
    benchmark can ask for real model state sizes without allocating the device side."""
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    def device(shape, dtype):
        if shared_device_slot:
            return torch.zeros(layers, 1, *shape, dtype=dtype).expand(layers, slots, *shape)
        return torch.zeros(layers, slots, *shape, dtype=dtype)

    info = MambaStateBufferInfo(
        temporal=device(temporal, temporal_dtype),
        conv=(device((conv_rows, conv_dim), torch.bfloat16),),
    )
    return MambaPoolHost(
        info, host_ratio, 0, device_capacity=slots, pin_memory=False, layout="page_first_direct"
    )


def _dsa_pools(layers: int = 3):
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
    from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost, make_dsa_indexer_pool_decl
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    from sglang.srt.runtime_context import get_parallel

    kv_lora_rank, rope = 32, 8
    parallel = get_parallel()
    try:
        parallel.attn_dcp_size  # noqa: B018 (published by a server or a test's ServerArgs)
        published = True
    except RuntimeError:
        published = False

    def build():
        device = DSATokenToKVPool(
            512,
            DSA_PAGE,
            kv_lora_rank,
            torch.bfloat16,
            rope,
            layers,
            "cpu",
            index_head_dim=128,
            enable_memory_saver=False,
            kv_cache_dim=kv_lora_rank + rope,
            start_layer=0,
            end_layer=layers - 1,
        )
        kv = MLATokenToKVPoolHost(
            device.get_device_pool_infos()[0].buffer_info,
            2,
            0,
            DSA_PAGE,
            "page_first_direct",
            pin_memory=False,
            device="cpu",
            device_capacity_tokens=device.size,
            start_layer=0,
            end_layer=layers - 1,
            target_layer_num=layers,
        )
        indexer = DSAIndexerPoolHost(make_dsa_indexer_pool_decl(device), kv, pin_memory=False)
        return kv, indexer

    if published:
        return build()
    with parallel.override(attn_dcp_size=1):  # what a one-GPU server publishes
        return build()


def make_hybrid(kind: str) -> Hybrid:
    if kind == "mamba":
        return Hybrid(
            kind,
            make_host_pool(Geometry()),
            False,
            [Sidecar("mamba", _mamba_pool(), "trailing_pages", window=1)],
        )
    if kind == "swa":
        swa = make_host_pool(Geometry(layers=2, head_dim=8))
        return Hybrid(
            kind,
            make_host_pool(Geometry()),
            False,
            [Sidecar("swa", swa, "trailing_pages", window=2)],
        )
    if kind == "dsa":
        kv, indexer = _dsa_pools()
        return Hybrid(kind, kv, True, [Sidecar("indexer", indexer, "all_pages", from_kv=True)])
    raise ValueError(kind)


KINDS = ("mamba", "swa", "dsa")


def register(storage, hybrid: Hybrid) -> None:
    """As `HybridCacheController.attach_storage_backend` does: the anchor, then every entry of
    the pool group (the anchor included) through v2, then the end of the burst."""
    storage.register_mem_pool_host(hybrid.kv)
    storage.register_mem_host_pool_v2(hybrid.kv, "kv")
    for sidecar in hybrid.sidecars:
        storage.register_mem_host_pool_v2(sidecar.pool, sidecar.name)
    storage.on_host_pools_registered()


def page_bytes(pool) -> int:
    dummy = pool.get_dummy_flat_data_page()
    return dummy.numel() * dummy.element_size()


def random_pages(pool, count: int, seed: int) -> list[torch.Tensor]:
    """`count` pages of random bytes (uint8, flat), the same in every process."""
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, 256, (page_bytes(pool),), generator=gen, dtype=torch.uint8)
        for _ in range(count)
    ]


def slots(pool, first_page: int, pages: int) -> torch.Tensor:
    """Host indices of `pages` consecutive pages of `pool` from page `first_page`."""
    start = first_page * pool.page_size
    return torch.arange(start, start + pages * pool.page_size, dtype=torch.int64)


def fill_bytes(pool, indices: torch.Tensor, pages: list[torch.Tensor]) -> None:
    dtype = pool.get_dummy_flat_data_page().dtype
    for i, page in enumerate(pages):
        pool.set_from_flat_data_page(int(indices[i * pool.page_size]), page.view(dtype))


def read_bytes(pool, indices: torch.Tensor, pages: int) -> list[torch.Tensor]:
    return [
        pool.get_data_page(int(indices[i * pool.page_size]), flat=True)
        .contiguous()
        .view(torch.uint8)
        .clone()
        for i in range(pages)
    ]


def transfer(sidecar: Sidecar, keys: list[str], host_indices: torch.Tensor):
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    return PoolTransfer(
        name=PoolName(sidecar.name)
        if sidecar.name in PoolName._value2member_map_
        else sidecar.name,
        host_indices=host_indices,
        keys=keys,
        hit_policy=PoolHitPolicy(sidecar.policy),
        indices_from_pool=PoolName.KV if sidecar.from_kv else None,
    )
