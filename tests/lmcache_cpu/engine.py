"""An `LMCacheEngine` with the shipped `MaruBackend` as its only backend, on CPU.

Everything is LMCache's own (config, metadata, `LMCacheEngineBuilder`, token database,
storage manager, `MaruBackend`, async lookup client and server) except the GPU connector:
`CpuKVConnector` stands in for it, because the real ones are CUDA kernels.
"""

from __future__ import annotations

import multiprocessing
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")  # no usage report from tests

import pytest
import torch
from lmcache.v1.cache_engine import LMCacheEngine, LMCacheEngineBuilder
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.gpu_connector import GPUConnectorInterface
from lmcache.v1.lookup_client.factory import LookupClientFactory
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.metadata import LMCacheMetadata


@pytest.fixture(autouse=True)
def keep_start_method() -> Iterator[None]:
    """LMCacheEngine's constructor forces multiprocessing's start method to "spawn" for the
    whole process; the in-process tests put back what the rest of the session had. A test
    module takes it by name: `keep_start_method = E.keep_start_method`."""
    before = multiprocessing.get_start_method(allow_none=True)
    yield
    multiprocessing.set_start_method(before, force=True)


@dataclass(frozen=True)
class Geometry:
    """A small model's KV layout. One full chunk (2 x layers x chunk x heads x head_size x 2
    bytes) must be a multiple of 4 KiB: `MaruBackend` makes it Maru's allocation unit."""

    layers: int = 2
    heads: int = 4
    head_size: int = 32
    chunk: int = 16  # LMCache's chunk_size, tokens
    dtype: torch.dtype = torch.bfloat16
    mla: bool = False  # one latent (K only, `heads` 1) per token and layer: LMCache's KV_MLA_FMT

    @property
    def kv(self) -> int:
        return 1 if self.mla else 2

    @property
    def fmt(self) -> MemoryFormat:
        return MemoryFormat.KV_MLA_FMT if self.mla else MemoryFormat.KV_2LTD

    @property
    def hidden(self) -> int:
        return self.heads * self.head_size

    @property
    def token_bytes(self) -> int:
        return self.kv * self.layers * self.hidden * self.dtype.itemsize

    @property
    def chunk_bytes(self) -> int:
        return self.chunk * self.token_bytes

    @property
    def kv_shape(self) -> tuple[int, int, int, int, int]:
        return (self.layers, self.kv, self.chunk, self.heads, self.head_size)


GEOMETRY = Geometry()


class CpuKVConnector(GPUConnectorInterface):
    """STAND-IN for LMCache's GPU connector (its real ones are CUDA kernels): the same
    gather/scatter on CPU. `kvcaches` is vLLM's paged KV cache, one tensor per layer of
    [2, slots, hidden]; `slot_mapping[i]` is token i's slot. `batched_from_gpu` copies
    tokens [start, end) of every layer into a memory object ([2, layers, tokens, hidden],
    LMCache's KV_2LTD) with one gather per layer and K/V, `batched_to_gpu` copies a memory
    object back into the slots."""

    def __init__(self, geometry: Geometry = GEOMETRY):
        self.geometry = geometry

    def _pairs(self, memory_objs, starts, ends, kwargs):
        slots = kwargs["slot_mapping"]
        for obj, start, end in zip(memory_objs, starts, ends):
            tensor, part = obj.tensor, slots[start:end]
            if tensor.shape[2] != len(part):  # (index_select's out= would resize, not fail)
                raise ValueError(f"{len(part)} slots for a {tensor.shape[2]}-token object")
            yield tensor, part

    def from_gpu(self, memory_obj, start: int, end: int, **kwargs: Any) -> None:
        self.batched_from_gpu([memory_obj], [start], [end], **kwargs)

    def to_gpu(self, memory_obj, start: int, end: int, **kwargs: Any) -> None:
        self.batched_to_gpu([memory_obj], [start], [end], **kwargs)

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs: Any) -> None:
        caches = kwargs["kvcaches"]
        for tensor, slots in self._pairs(memory_objs, starts, ends, kwargs):
            for layer, cache in enumerate(caches):
                for kv in range(self.geometry.kv):  # one gather into the object (contiguous)
                    torch.index_select(cache[kv], 0, slots, out=tensor[kv, layer])

    def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kwargs: Any) -> None:
        caches = kwargs["kvcaches"]
        for tensor, slots in self._pairs(memory_objs, starts, ends, kwargs):
            for layer, cache in enumerate(caches):
                cache[:, slots] = tensor[:, layer]

    def get_shape(self, num_tokens: int) -> torch.Size:
        g = self.geometry
        return torch.Size([g.kv, g.layers, num_tokens, g.hidden])


def config(
    url: str,
    *,
    pool_bytes: int = 16 << 20,
    async_loading: bool = False,
    instance_name: str | None = None,
    geometry: Geometry = GEOMETRY,
    extra_config: dict[str, Any] | None = None,
) -> LMCacheEngineConfig:
    """LMCache's config with Maru as the only backend: `maru_path` set, no local CPU cache.
    (`maru_pool_size` is in GB, as in LMCache's YAML.)"""
    extra: dict[str, Any] = {"maru_timeout_ms": 10_000, **(extra_config or {})}
    if instance_name:
        extra["maru_instance_id"] = instance_name
    host_port = url.removeprefix("tcp://")
    return LMCacheEngineConfig.from_defaults(
        chunk_size=geometry.chunk,
        local_cpu=False,
        max_local_cpu_size=0,
        maru_path=f"maru://{host_port}",
        maru_pool_size=pool_bytes / 1024**3,
        save_unfull_chunk=True,  # store the last, partial chunk too
        enable_async_loading=async_loading,
        extra_config=extra,
    )


def metadata(
    geometry: Geometry = GEOMETRY,
    engine_id: str | None = None,
    *,
    world_size: int = 1,
    worker_id: int = 0,
) -> LMCacheMetadata:
    return LMCacheMetadata(
        model_name="maru-tiny",
        world_size=world_size,
        local_world_size=world_size,
        worker_id=worker_id,
        local_worker_id=worker_id,
        kv_dtype=geometry.dtype,
        kv_shape=geometry.kv_shape,
        role="worker",
        chunk_size=geometry.chunk,
        engine_id=engine_id or uuid.uuid4().hex,
        use_mla=geometry.mla,
    )


class Engine:
    """An `LMCacheEngine` built as LMCache's own manager builds it: `LMCacheEngineBuilder`,
    then (with `enable_async_loading`) the worker-side async lookup server from
    `LookupClientFactory`, then `post_init`. `close()` destroys it through the builder (which
    closes the MaruBackend and so its handler: DISCONNECT)."""

    def __init__(
        self,
        cfg: LMCacheEngineConfig,
        meta: LMCacheMetadata,
        connector: GPUConnectorInterface | None = None,
    ):
        self.config, self.metadata = cfg, meta
        self.instance_id = f"maru-test-{uuid.uuid4().hex[:8]}"
        self.engine: LMCacheEngine = LMCacheEngineBuilder.get_or_create(
            self.instance_id,
            cfg,
            meta,
            connector or CpuKVConnector(),
            lambda *a: None,
            lambda obj, *a: obj,
        )
        self.lookup_server = None
        if cfg.enable_async_loading:
            self.lookup_server = LookupClientFactory.create_lookup_server(self.engine, meta)
        self.engine.post_init(async_lookup_server=self.lookup_server)
        self._closed = False

    def lookup_client(self):
        """The scheduler side of the lookup (LMCache's own factory picks the class); not
        closed by the tests (see `close`)."""
        return LookupClientFactory.create_lookup_client(self.config, self.metadata)

    @property
    def backend(self):
        """The engine's only storage backend: LMCache's shipped MaruBackend."""
        assert self.engine.storage_manager is not None
        backends = self.engine.storage_manager.storage_backends
        assert list(backends) == ["MaruBackend"], f"backends: {list(backends)}"
        return backends["MaruBackend"]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # (The async lookup server is left to the process's exit: LMCache's `close()` of it,
        # and of the lookup client, blocks in zmq's context term while their receive thread
        # waits in recv; LMCache's own manager gives each a 10 s timeout. Both are daemons.)
        LMCacheEngineBuilder.destroy(self.instance_id)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- a prompt's KV cache in vLLM's paged layout ------------------------------------------------


def kv_caches(slots: int, geometry: Geometry = GEOMETRY, seed: int | None = None) -> list:
    """One [2, slots, hidden] tensor per layer ([1, ...] for MLA): random (reproducible from
    `seed`) or zeros."""
    g = geometry
    if seed is None:
        return [torch.zeros(g.kv, slots, g.hidden, dtype=g.dtype) for _ in range(g.layers)]
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(g.kv, slots, g.hidden, generator=gen).to(g.dtype) for _ in range(g.layers)]


def slot_mapping(tokens: int, slots: int, seed: int) -> torch.Tensor:
    """Where each token of the prompt sits in the paged cache (distinct slots, shuffled)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(slots, generator=gen)[:tokens]


def gathered(caches: list, slots: torch.Tensor) -> torch.Tensor:
    """The prompt's KV as [2, layers, tokens, hidden], read from the paged cache."""
    return torch.stack([cache[:, slots] for cache in caches], dim=1)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte-for-byte equality (bf16 compared as raw 16-bit words: NaN patterns included)."""
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def prompt(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 32_000, (n,), generator=gen).tolist()


FMT = MemoryFormat.KV_2LTD  # LMCache's format for (non-MLA) KV chunks


def scope(geometry: Geometry = GEOMETRY) -> str:
    """The key scope `CxlMemoryAdapter` gives the handler of an engine of this geometry."""
    from maru_lmcache.adapter import layout_scope

    meta = metadata(geometry)
    return layout_scope(meta.get_shapes(), meta.get_dtypes(), geometry.fmt)


def key_strings(
    engine: LMCacheEngine, tokens: list[int], geometry: Geometry = GEOMETRY
) -> list[str]:
    """The Maru keys LMCache's chunks of the prompt lie under: `CacheEngineKey.to_string()`
    in the layout's key scope (what a handler without that scope reads them as)."""
    tail = scope(geometry)
    return [key.to_string() + tail for _, _, key in engine.token_database.process_tokens(tokens)]
