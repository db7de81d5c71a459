"""MaruStorage driven by SGLang's real `HiCacheController` (its backup and prefetch threads).

Two controllers stand for two SGLang instances (each its own device pool, host pool and
MaruStorage / MaruHandler), sharing one real `maru-server`:

1. controller A: KV in its device pool -> `write()` (device -> host, the `direct` io shim) ->
   `write_storage()`: the backup thread calls `batch_set_v1` (write-through to Maru);
2. controller B: `prefetch()`: the prefetch thread calls `batch_exists`; the test plays the
   scheduler's part (allocate host pages for the hit, queue the operation); the io thread calls
   `batch_get_v1`; then `load()` + `start_loading()` copy host -> device.

Asserted: B's host pages and device KV are byte-identical to A's, the zero-copy v1 interface
was used both ways (never the legacy `batch_get` / `batch_set`), the batches were split as
SGLang splits them (128 pages), and a prompt that diverges after some pages hits only those.

Runs in-process in a few seconds; needs SGLang (skipped without it).
"""

from __future__ import annotations

import functools
import logging

import pytest

import sglang_cpu

sglang_cpu.require()

import torch  # noqa: E402

from maru_sglang.maru_storage import chunk_size_for  # noqa: E402
from sglang_cpu.controllers import (  # noqa: E402
    PAGE,
    QUEUE_TIMEOUT,
    cache_side,
    make_controller,
    prefetch_acks,
    runtime,  # noqa: F401 (a fixture)
)
from sglang_cpu.p2p import l3_keys, wait_l3_stable  # noqa: E402

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(180)]

# 3 layers of KV: 2 heads of 16 (MHA), or a latent of 32 and a rope part of 16 (MLA)
SHAPE = {"layers": 3, "heads": 2, "head_dim": 16, "kv_lora_rank": 32, "rope_dim": 16}
DEVICE_TOKENS = 1024
PAGES = 150  # more than SGLang's STORAGE_BATCH_SIZE (128): two batches each way


class Instance:
    """One SGLang instance's cache side: device pool + allocator, host pool, controller."""

    def __init__(self, attn: str, url: str, name: str):
        from sglang.srt.managers.cache_controller import HiCacheController

        self.device, self.allocator, self.host = cache_side(DEVICE_TOKENS, attn, **SHAPE)
        self.ctrl = make_controller(
            HiCacheController, self.allocator, self.host, url, name, "tiny-controller-test"
        )
        self.storage = self.ctrl.storage_backend
        self.calls: dict[str, list[int]] = {}
        for method in ("batch_set_v1", "batch_get_v1", "batch_exists", "batch_get", "batch_set"):
            self._spy(method)

    def _spy(self, method: str) -> None:
        """Record the batch size of every call the controller's threads make."""
        real = getattr(self.storage, method)
        calls = self.calls.setdefault(method, [])

        @functools.wraps(real)
        def wrapper(keys, *args, **kwargs):
            calls.append(len(keys))
            return real(keys, *args, **kwargs)

        setattr(self.storage, method, wrapper)

    def kv_buffers(self) -> list[torch.Tensor]:
        if hasattr(self.device, "k_buffer"):
            return list(self.device.k_buffer) + list(self.device.v_buffer)
        return list(self.device.kv_buffer)

    def device_bytes(self, indices: torch.Tensor) -> list[torch.Tensor]:
        return [b[indices].view(torch.uint8).clone() for b in self.kv_buffers()]

    def host_bytes(self, host_indices: torch.Tensor) -> list[torch.Tensor]:
        return [
            self.host.get_data_page(int(host_indices[i]), flat=True).view(torch.uint8).clone()
            for i in range(0, len(host_indices), PAGE)
        ]

    def close(self) -> None:
        self.ctrl.detach_storage_backend()  # stops the storage threads, closes MaruStorage


def _wait_event(ack) -> None:
    ack.finish_event.synchronize()  # torch.cpu events: the copy already ran synchronously


def _prefetch(inst: Instance, rid: str, token_ids: list[int]):
    """The controller's prefetch threads plus the scheduler's part of SGLang's prefetch."""
    ctrl = inst.ctrl
    op = ctrl.prefetch(rid, token_ids)
    hit = ctrl.prefetch_hit_queue.get(timeout=QUEUE_TIMEOUT)  # after batch_exists
    assert hit is op
    if op.storage_hit_count == 0:
        return op, None, 0
    host_indices = ctrl.mem_pool_host.alloc(op.storage_hit_count)
    assert host_indices is not None
    op.host_indices = host_indices
    ctrl.prefetch_buffer.put(op)  # the io thread now calls batch_get_v1
    completed = 0
    for ack in prefetch_acks(ctrl):
        if ack.completed_tokens is not None:
            completed = ack.completed_tokens
    return op, host_indices, completed


@pytest.mark.parametrize("attn", ["mha", "mla"])
def test_controller_backup_then_prefetch_through_maru(runtime, maru_server, attn, caplog):  # noqa: F811
    from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    caplog.set_level(logging.INFO, logger="maru_sglang.maru_storage")
    tokens = PAGES * PAGE
    token_ids = [(i * 7919 + 13) % 30000 for i in range(tokens)]
    keys = get_storage_hash_str(token_ids, None, page_size=PAGE)
    assert len(keys) == PAGES
    batches = [STORAGE_BATCH_SIZE, PAGES - STORAGE_BATCH_SIZE]

    a = Instance(attn, maru_server.url, f"instance-a-{attn}")
    b = None
    try:
        assert type(a.storage).__name__ == "MaruStorage"
        assert a.ctrl.page_set_func == a.ctrl._page_set_zero_copy  # interface_v1 honoured
        # No maru_chunk_size_bytes given: one allocation chunk per page, nothing wasted.
        assert a.storage.handler.get_chunk_size() == chunk_size_for(a.storage._kv.page_bytes)

        # -- instance A: device -> host -> Maru (write-through) ---------------------------
        gen = torch.Generator().manual_seed(1234)
        src = a.allocator.alloc(tokens)
        for buf in a.kv_buffers():
            buf[src] = torch.randn(buf[src].shape, generator=gen).to(buf.dtype)
        reference = a.device_bytes(src)

        host_a = a.ctrl.write(src, node_id=1)
        assert host_a is not None
        _wait_event(a.ctrl.ack_write_queue.pop(0))
        backup_id = a.ctrl.write_storage(host_a, token_ids, hash_value=keys)
        done = a.ctrl.ack_backup_queue.get(timeout=QUEUE_TIMEOUT)
        assert done.id == backup_id
        assert done.completed_tokens == tokens, "backup thread did not store every page"
        assert a.calls["batch_set_v1"] == batches
        assert a.calls["batch_set"] == []
        written = a.storage.counters
        assert written["pages_written"] == PAGES
        assert written["bytes_written"] == PAGES * a.storage._kv.page_bytes
        # write-behind: the backup thread's last call returned before the server answered
        # its registration; the server holds the pages within its reply time
        assert wait_l3_stable(maru_server.url, PAGES, timeout=10, settle=0.1) == PAGES
        host_a_bytes = a.host_bytes(host_a)

        # -- instance B: Maru -> host (prefetch threads) -> device --------------------------
        b = Instance(attn, maru_server.url, f"instance-b-{attn}")
        assert b.storage.namespace == a.storage.namespace
        assert b.storage.handler.config.instance_id != a.storage.handler.config.instance_id
        op, host_b, completed = _prefetch(b, "req-full", token_ids)
        assert op.storage_hit_count == tokens
        assert op.hash_value == keys
        assert completed == tokens
        assert b.calls["batch_exists"] == batches
        assert b.calls["batch_get_v1"] == batches, "zero-copy v1 path not used"
        assert b.calls["batch_get"] == []
        assert b.storage.counters["hits"] == PAGES and b.storage.counters["misses"] == 0
        messages = [r.getMessage() for r in caplog.records]
        for n in batches:
            assert f"batch_get_v1 result: {n}/{n} hits" in messages

        got = b.host_bytes(host_b)
        assert len(got) == PAGES
        assert all(torch.equal(x, y) for x, y in zip(got, host_a_bytes)), "host pages differ"

        dst = b.ctrl.load(host_b, node_id=2)
        assert dst is not None
        b.ctrl.start_loading()
        _wait_event(b.ctrl.ack_load_queue.pop(0))
        loaded = b.device_bytes(dst)
        assert all(torch.equal(x, y) for x, y in zip(loaded, reference)), "device KV differs"

        # -- a prompt that diverges after 40 pages hits exactly those 40 ---------------------
        shared = 40 * PAGE
        other = token_ids[:shared] + [(t + 1) % 30000 for t in token_ids[shared:]]
        op2, host_b2, completed2 = _prefetch(b, "req-partial", other)
        assert op2.storage_hit_count == shared
        assert completed2 == shared
        got2 = b.host_bytes(host_b2)
        assert all(torch.equal(x, y) for x, y in zip(got2, host_a_bytes[:40]))
        b.ctrl.mem_pool_host.free(host_b2)

        # -- a prompt never stored: no hit, no read ------------------------------------------
        reads = len(b.calls["batch_get_v1"])
        op3, _, _ = _prefetch(b, "req-miss", [t + 3 for t in token_ids[: 8 * PAGE]])
        assert op3.storage_hit_count == 0
        assert len(b.calls["batch_get_v1"]) == reads

        metrics = b.storage.get_stats()
        assert list(metrics.prefetch_pgs) == [*batches, 40]
    finally:
        if b is not None:
            b.close()
        a.close()
    assert l3_keys(maru_server.url) == PAGES, "pages must outlive the instance that wrote them"
