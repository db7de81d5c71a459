"""SGLang's real HiCache controllers over MaruStorage on CPU, as the controller tests
(tests/e2e/test_sglang_controller.py, test_sglang_hybrid_controller.py) build them: each
controller stands for one SGLang instance's cache side (device pool, allocator, host pool).

Import after `sglang_cpu.require()`; a test module takes the `runtime` fixture by name:
``from sglang_cpu.controllers import runtime  # noqa: E402, F401``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from sglang_cpu.host_pools import Geometry, make_pools
from sglang_cpu.p2p import MARU_BACKEND
from sglang_cpu.tiny_model import build_tiny_model

PAGE = 4  # the page size of the published ServerArgs and of every pool
QUEUE_TIMEOUT = 30.0


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    """What the SGLang scheduler process does before it builds a controller: publish its
    ServerArgs (the controller reads TP/PP/DCP ranks from it)."""
    from sglang.srt import runtime_context
    from sglang.srt.runtime_context import SpawnRanks
    from sglang.srt.server_args import ServerArgs

    model = build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"))
    args = ServerArgs(model_path=str(model), device="cpu", page_size=PAGE)
    runtime_context.publish(args, role="test", ranks=SpawnRanks(world_rank=0))
    return args


def cache_side(tokens: int, attn: str = "mha", **shape: int) -> tuple[Any, Any, Any]:
    """A device KV pool of `tokens` tokens (`attn`, `shape`: the other fields of a
    `Geometry`, pages of `PAGE` tokens), its paged allocator and the host pool on top of it
    (`host_pools.make_pools`): `(device, allocator, host)`."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

    g = Geometry(attn, page_size=PAGE, **shape)
    device, host = make_pools(g, tokens)
    allocator = PagedTokenToKVPoolAllocator(
        tokens, g.page_size, g.dtype, "cpu", device, need_sort=False
    )
    return device, allocator, host


def make_controller(cls: type, allocator: Any, host: Any, url: str, name: str, model: str):
    """A controller of class `cls` (`HiCacheController`, `HybridCacheController`) over `host`
    (a host pool or a `HostPoolGroup`), as SGLang's scheduler builds it for one rank with
    `--hicache-write-policy write_through --hicache-io-backend direct
    --hicache-storage-backend dynamic` and Maru's extra config (instance `name`, a 32M pool on
    the maru-server at `url`)."""
    # Exactly what `--hicache-storage-backend-extra-config` carries (the server pops
    # prefetch_threshold into the constructor argument, as done here).
    extra = {
        **MARU_BACKEND,
        "maru_server_url": url,
        "maru_pool_size": "32M",
        "maru_instance_id": name,
    }
    return cls(
        allocator,
        host,
        PAGE,
        None,  # tp_group: a single rank
        threading.Event(),
        write_policy="write_through",
        io_backend="direct",
        storage_backend="dynamic",
        prefetch_threshold=PAGE,
        model_name=model,
        storage_backend_extra_config=extra,
        enable_storage_metrics=True,
    )


def prefetch_acks(ctrl: Any) -> Iterator[Any]:
    """The acks of the prefetch the io thread now serves, up to the one that completes the
    request (`QUEUE_TIMEOUT` for them all)."""
    deadline = time.monotonic() + QUEUE_TIMEOUT
    while True:
        ack = ctrl.ack_prefetch_queue.get(timeout=max(0.1, deadline - time.monotonic()))
        yield ack
        if ack.completed_req:
            return
