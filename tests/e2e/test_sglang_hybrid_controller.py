"""MaruStorage driven by SGLang's real `HybridCacheController` (its backup and prefetch threads)
for a Mamba hybrid model: an MHA KV pool plus a `MambaPoolHost` state pool in a real
`HostPoolGroup`, as SGLang builds them for Qwen3-Next-like models.

Two controllers stand for two SGLang instances sharing one real `maru-server`:

1. controller A: host pages of a prompt (KV + the Mamba state at its last page) ->
   `write_storage(..., extra_pools=[mamba])`: the backup thread calls `batch_set_v2` for the
   state and `batch_set_v1` for the KV pages;
2. controller B: `prefetch(..., extra_pools=[mamba])`: the prefetch thread calls
   `batch_exists_v2`; the test plays the scheduler's part (host slots for the hit and the state);
   the io thread calls `batch_get_v1` and then `batch_get_v2` for the state.

Asserted: B's KV pages and Mamba state are byte-identical to A's; a longer prompt whose state
exists only at the stored node end hits exactly that node; without the state, the KV pages
alone are no hit.
"""

from __future__ import annotations

import pytest

import sglang_cpu

sglang_cpu.require()

import torch  # noqa: E402

from sglang_cpu.controllers import (  # noqa: E402
    PAGE,
    QUEUE_TIMEOUT,
    cache_side,
    make_controller,
    prefetch_acks,
    runtime,  # noqa: F401 (a fixture)
)
from sglang_cpu.hybrid_pools import _mamba_pool, fill_bytes, random_pages, read_bytes  # noqa: E402

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(180)]

SHAPE = {"layers": 3, "heads": 2, "head_dim": 16}  # 3 layers of KV: 2 heads of 16
DEVICE_TOKENS = 512
PAGES = 10


class Instance:
    """One hybrid SGLang instance's cache side: KV device pool, host pool group, controller."""

    def __init__(self, url: str, name: str):
        from sglang.srt.mem_cache.hicache_storage import PoolName
        from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
            HybridCacheController,
        )
        from sglang.srt.mem_cache.pool_host import HostPoolGroup, PoolEntry

        device, allocator, self.kv = cache_side(DEVICE_TOKENS, **SHAPE)
        self.mamba = _mamba_pool()
        self.group = HostPoolGroup(
            [
                PoolEntry(PoolName.KV, self.kv, device, lambda i: i, is_primary_index_anchor=True),
                PoolEntry(PoolName.MAMBA, self.mamba, None, lambda i: i),
            ]
        )
        self.ctrl = make_controller(
            HybridCacheController, allocator, self.group, url, name, "tiny-hybrid-controller-test"
        )
        self.storage = self.ctrl.storage_backend
        self.calls: dict[str, int] = {}
        for method in ("batch_set_v1", "batch_set_v2", "batch_exists_v2", "batch_get_v1",
                       "batch_get_v2", "batch_exists"):  # fmt: skip
            self._spy(method)

    def _spy(self, method: str) -> None:
        real = getattr(self.storage, method)
        self.calls[method] = 0

        def wrapper(*args, **kwargs):
            self.calls[method] += 1
            return real(*args, **kwargs)

        setattr(self.storage, method, wrapper)

    def close(self) -> None:
        self.ctrl.detach_storage_backend()


def _mamba_transfer(keys, host_indices=None):
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    return PoolTransfer(
        name=PoolName.MAMBA,
        host_indices=host_indices,
        keys=keys,
        hit_policy=PoolHitPolicy.TRAILING_PAGES,
    )


def _prefetch(inst: Instance, rid: str, token_ids: list[int]):
    """The controller's prefetch threads plus the scheduler's part of SGLang's prefetch."""
    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
    from sglang.srt.mem_cache.hicache_storage import PoolName

    ctrl = inst.ctrl
    state = _mamba_transfer([""])  # a window of one page
    op = ctrl.prefetch(CacheRequestHandle(rid, 0), token_ids, extra_pools=[state])
    assert ctrl.prefetch_hit_queue.get(timeout=QUEUE_TIMEOUT) is op  # after batch_exists_v2
    if op.storage_hit_count == 0:
        return op, None, None, {}
    op.host_indices = inst.group.alloc(op.storage_hit_count)
    state.host_indices = inst.group.alloc(1, pool=PoolName.MAMBA)
    ctrl.prefetch_buffer.put(op)  # the io thread: batch_get_v1, then batch_get_v2
    pool_hits: dict = {}
    for ack in prefetch_acks(ctrl):
        if ack.pool_hits is not None:
            pool_hits = ack.pool_hits
    return op, op.host_indices, state.host_indices, pool_hits


def test_hybrid_controller_backup_then_prefetch_through_maru(runtime, maru_server):  # noqa: F811
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    tokens = PAGES * PAGE
    token_ids = [(i * 7919 + 13) % 30000 for i in range(tokens)]
    keys = get_storage_hash_str(token_ids, None, page_size=PAGE)
    a = Instance(maru_server.url, "hybrid-a")
    b = None
    try:
        assert sorted(a.storage.pools) == ["kv", "mamba"]
        # -- instance A: host pages + the state at the prompt's end -> Maru -----------------
        host_a = a.group.alloc(tokens)
        kv_pages = random_pages(a.kv, PAGES, seed=1)
        fill_bytes(a.kv, host_a, kv_pages)
        state_a = a.group.alloc(1, pool=PoolName.MAMBA)
        state_page = random_pages(a.mamba, 1, seed=2)
        fill_bytes(a.mamba, state_a, state_page)
        a.ctrl.write_storage(
            host_a, token_ids, hash_value=keys, extra_pools=[_mamba_transfer(keys[-1:], state_a)]
        )
        done = a.ctrl.ack_backup_queue.get(timeout=QUEUE_TIMEOUT)
        assert done.completed_tokens == tokens
        assert done.pool_storage_result.extra_pool_hit_pages == {"mamba": 1}
        assert a.calls["batch_set_v2"] == 1 and a.calls["batch_set_v1"] == 1

        # -- instance B: Maru -> host through the prefetch threads ---------------------------
        b = Instance(maru_server.url, "hybrid-b")
        op, host_b, state_b, pool_hits = _prefetch(b, "req-full", token_ids)
        assert op.storage_hit_count == tokens
        assert b.calls["batch_exists_v2"] == 1 and b.calls["batch_exists"] == 0
        assert b.calls["batch_get_v1"] == 1 and b.calls["batch_get_v2"] == 1
        assert pool_hits.get("mamba") == 1
        assert all(torch.equal(x, y) for x, y in zip(read_bytes(b.kv, host_b, PAGES), kv_pages))
        assert torch.equal(read_bytes(b.mamba, state_b, 1)[0], state_page[0])
        b.group.free(host_b)
        b.group.free(state_b, pool=PoolName.MAMBA)

        # -- a longer prompt: its KV and state exist only up to the stored node end ----------
        longer = token_ids + [(t + 5) % 30000 for t in token_ids[: 3 * PAGE]]
        op2, host_b2, state_b2, _ = _prefetch(b, "req-longer", longer)
        assert op2.storage_hit_count == tokens
        assert torch.equal(read_bytes(b.mamba, state_b2, 1)[0], state_page[0])
        b.group.free(host_b2)
        b.group.free(state_b2, pool=PoolName.MAMBA)

        # -- the state is gone: the KV pages alone are no hit --------------------------------
        assert b.storage.handler.delete(b.storage.pools["mamba"].keys(keys[-1:])[0])
        reads = b.calls["batch_get_v1"]
        op3, _, _, _ = _prefetch(b, "req-no-state", token_ids)
        assert op3.storage_hit_count == 0
        assert b.calls["batch_get_v1"] == reads
        stats = b.storage.get_stats().maru["pools"]
        assert stats["mamba"]["hits"] == 2 and stats["kv"]["hits"] == 2 * PAGES
    finally:
        if b is not None:
            b.close()
        a.close()
