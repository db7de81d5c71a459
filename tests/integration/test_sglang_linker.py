"""MaruCacheLinker against the real SGLang 0.5.23 classes on CPU: device KV pools, the paged
allocator, `LayerWiseLoadCounter` (as the KV pool's layer hook), the dynamic linker factory,
and MaruStorage on a `page_first_direct` host pool (the same pages through the other path).

Two linkers in one process stand for two instances (each its own MaruHandler: its own
instance on the server, its own regions), one real maru-server.

Where torch sees a GPU the same tests run with the device pools on it: the copies are then the
CUDA path's (one kernel over the registered shared mapping). In CI there is none: CPU.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(180)]
TESTS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TESTS))

pytest.importorskip("torch")
import sglang_cpu  # noqa: E402

sglang_cpu.apply()  # before SGLang is first imported
pytest.importorskip("sglang")

import torch  # noqa: E402

from maru_sglang.cuda import register_with_cuda  # noqa: E402
from maru_sglang.linker import MaruCacheLinker  # noqa: E402
from maru_sglang.maru_storage import MaruStorage  # noqa: E402
from sglang_cpu.host_pools import storage_config  # noqa: E402
from sglang_cpu.p2p import MARU_BACKEND  # noqa: E402
from sglang_cpu.tiny_model import build_tiny_model  # noqa: E402

PAGE, LAYERS, HEADS, HEAD_DIM = 4, 3, 2, 16
KV_LORA_RANK, ROPE_DIM = 32, 16
TOKENS = 512
PAGES = 20
WAIT = 30.0  # seconds any wait in these tests may take at most
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    """What SGLang's scheduler process does before it builds its cache: publish ServerArgs
    (the linker reads the TP/DP ranks there, as HiCache's controller does)."""
    from sglang.srt import runtime_context
    from sglang.srt.runtime_context import SpawnRanks
    from sglang.srt.server_args import ServerArgs

    model = build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"))
    args = ServerArgs(model_path=str(model), device=DEVICE, page_size=PAGE)
    runtime_context.publish(args, role="test", ranks=SpawnRanks(world_rank=0))
    return args


class Instance:
    """One instance's cache side: a device KV pool, its allocator, and the linker on it."""

    def __init__(self, args, url: str, attn: str = "mha", **extra):
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

        common = dict(device=DEVICE, enable_memory_saver=False, start_layer=0, end_layer=LAYERS - 1)
        if attn == "mha":
            self.device = MHATokenToKVPool(
                TOKENS, PAGE, torch.bfloat16, head_num=HEADS, head_dim=HEAD_DIM,
                layer_num=LAYERS, **common,
            )  # fmt: skip
            self.buffers = [list(self.device.k_buffer), list(self.device.v_buffer)]
        elif attn == "mla_fp4":  # fp4 latent rows plus a block-scale row per token
            from sglang.srt.mem_cache.memory_pool import MLATokenToKVPoolFP4

            self.device = MLATokenToKVPoolFP4(
                TOKENS, PAGE, torch.bfloat16, kv_lora_rank=KV_LORA_RANK,
                qk_rope_head_dim=ROPE_DIM, layer_num=LAYERS, **common,
            )  # fmt: skip
            self.buffers = [list(self.device.kv_buffer), list(self.device.kv_scale_buffer)]
        else:
            self.device = MLATokenToKVPool(
                TOKENS, PAGE, torch.bfloat16, kv_lora_rank=KV_LORA_RANK,
                qk_rope_head_dim=ROPE_DIM, layer_num=LAYERS, **common,
            )  # fmt: skip
            self.buffers = [list(self.device.kv_buffer)]
        self.allocator = PagedTokenToKVPoolAllocator(
            TOKENS, PAGE, torch.bfloat16, DEVICE, self.device, need_sort=False
        )
        self.params = CacheInitParams(
            disable=False,
            req_to_token_pool=None,
            token_to_kv_pool_allocator=self.allocator,
            page_size=PAGE,
        )
        config = {"maru_server_url": url, "maru_pool_size": "32M", **extra}
        self.linker = MaruCacheLinker(
            args, self.params, components={ComponentType.FULL}, extra_config=config
        )
        # What SGLang's registry does: the KV pool waits on the linker's counter per layer.
        self.device.register_layer_transfer_counter(self.linker.layer_done_counter)

    def fill(self, slots: torch.Tensor, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for part in self.buffers:
            for buf in part:
                buf[slots] = torch.randn(buf[slots].shape, generator=gen).to(buf.device, buf.dtype)

    def rows(self, slots: torch.Tensor, layer: int | None = None) -> list[torch.Tensor]:
        layers = range(LAYERS) if layer is None else [layer]
        return [part[i][slots].view(torch.uint8).clone() for part in self.buffers for i in layers]

    def close(self) -> None:
        self.linker.close()


def _kv(keys, slots=None):
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    return [PoolTransfer(name=PoolName.KV, device_indices=slots, keys=list(keys))]


def _hashes(n: int, tag: str = "p") -> list[str]:
    return [f"{tag}{i:04d}" for i in range(n)]


def _offload(inst: Instance, keys: list[str], slots: torch.Tensor) -> bool:
    assert inst.linker.offload(_kv(keys, slots))
    _wait(lambda: inst.linker.num_completed_offloads() >= 1)
    return inst.linker.pop_completed_offload()


def _wait(cond) -> None:
    import time

    deadline = time.monotonic() + WAIT
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _load(inst: Instance, rid: str, keys: list[str]) -> tuple[torch.Tensor, int]:
    """What the tree does for an external hit: allocate slots, queue, start, and the
    forward's per-layer waits; returns the slots and the counter index."""
    slots = inst.allocator.alloc(len(keys) * PAGE)
    assert inst.linker.load(rid, _kv(keys, slots))
    index = inst.linker.start_layer_wise_loading()
    assert index >= 0
    return slots, index


@pytest.fixture
def pair(runtime, maru_server):
    made: list[Instance] = []

    def make(attn: str = "mha", **extra) -> Instance:
        inst = Instance(runtime, maru_server.url, attn, **extra)
        made.append(inst)
        return inst

    yield make
    for inst in made:
        inst.close()


@pytest.mark.parametrize("attn", ["mha", "mla"])
def test_pages_offloaded_by_one_instance_load_into_another(pair, attn):
    a, b = pair(attn), pair(attn)
    keys = _hashes(PAGES)
    slots = a.allocator.alloc(PAGES * PAGE)
    a.fill(slots, seed=1)
    assert _offload(a, keys, slots)
    assert a.linker.counters["offloaded_pages"] == PAGES

    assert b.linker.lookup("r1", _kv(keys)) == list(range(1, PAGES + 1))
    assert b.linker.lookup("r1", _kv([*keys[:5], "never-written", *keys[5:]])) == [1, 2, 3, 4, 5]
    got, index = _load(b, "r1", keys)
    b.linker.layer_done_counter.set_consumer(index)
    for layer in range(LAYERS):  # the forward: waits per layer, then reads that layer
        b.device.get_key_buffer(layer)
        assert all(torch.equal(x, y) for x, y in zip(b.rows(got, layer), a.rows(slots, layer)))
    assert b.linker.finish_layer_wise_loading(index) is True
    assert all(torch.equal(x, y) for x, y in zip(b.rows(got), a.rows(slots)))
    c = b.linker.counters
    assert c["loaded_pages"] == PAGES and c["bytes_loaded"] == PAGES * b.linker.layout.page_bytes
    assert c["load_failures"] == 0


def test_layer_zero_is_usable_while_later_layers_still_load(pair):
    """Layer-wise: the forward's wait for layer 0 returns while layer 1 is still being copied
    (held here), and layer 0's rows are already the stored ones."""
    a, b = pair(), pair()
    keys = _hashes(PAGES, "lw")
    slots = a.allocator.alloc(PAGES * PAGE)
    a.fill(slots, seed=2)
    assert _offload(a, keys, slots)

    hold = threading.Event()
    real = b.linker.layout.load_layers

    def held_load_layers(sources, firsts):
        for layer, landed in enumerate(real(sources, firsts)):
            if layer == 0:  # on a GPU: landed before layer 1 is held (on CPU it has already)
                landed.synchronize()
            if layer == 1:
                assert hold.wait(WAIT)
            yield landed

    b.linker.layout.load_layers = held_load_layers
    got, index = _load(b, "r", keys)
    counter = b.linker.layer_done_counter
    counter.set_consumer(index)
    counter.wait_until(0)
    futures = counter.futures[index]
    assert not futures[1].done() and not futures[LAYERS - 1].done()
    assert all(torch.equal(x, y) for x, y in zip(b.rows(got, 0), a.rows(slots, 0)))
    hold.set()
    assert b.linker.finish_layer_wise_loading(index) is True
    assert all(torch.equal(x, y) for x, y in zip(b.rows(got), a.rows(slots)))


def test_a_page_gone_before_load_is_a_miss_not_an_abort(pair, maru_server):
    a, b = pair(), pair()
    keys = _hashes(8, "gone")
    slots = a.allocator.alloc(8 * PAGE)
    a.fill(slots, seed=3)
    assert _offload(a, keys, slots)
    assert b.linker.lookup("r", _kv(keys)) == list(range(1, 9))
    assert a.linker.handler.delete(b.linker.keys([keys[3]])[0])  # evicted since the lookup
    dest = b.allocator.alloc(8 * PAGE)
    assert b.linker.load("r", _kv(keys, dest)) is False  # SGLang frees the slots, recomputes
    assert b.linker.start_layer_wise_loading() == -1
    assert b.linker.counters["loads_refused"] == 1
    # Slots that are not whole pages are refused too, never copied to.
    assert b.linker.load("r", _kv(keys[:1], torch.arange(1, 1 + PAGE))) is False
    # So is one page named for two keys: one's bytes would be reported loaded for both.
    twice = torch.cat([dest[:PAGE], dest[:PAGE]])
    assert b.linker.load("r", _kv(keys[:2], twice)) is False


def test_lease_lost_during_the_load_fails_the_batch(pair, maru_server):
    """The server restarts between `load` (pages leased) and the copy: the lease cannot be
    confirmed, so the last layer fails and finish says False (SGLang aborts the requests)."""
    a, b = pair(), pair()
    keys = _hashes(6, "lease")
    slots = a.allocator.alloc(6 * PAGE)
    a.fill(slots, seed=4)
    assert _offload(a, keys, slots)
    dest = b.allocator.alloc(6 * PAGE)
    assert b.linker.load("r", _kv(keys, dest))
    maru_server.restart()
    index = b.linker.start_layer_wise_loading()
    assert b.linker.finish_layer_wise_loading(index) is False
    assert b.linker.counters["load_failures"] == 1 and b.linker.counters["loaded_pages"] == 0


def test_cancel_reset_and_repeated_offloads(pair):
    a = pair()
    keys = _hashes(4, "c")
    slots = a.allocator.alloc(4 * PAGE)
    a.fill(slots, seed=5)
    assert _offload(a, keys, slots)
    assert _offload(a, keys, slots)  # already stored: nothing copied, still a success
    assert a.linker.counters["offload_skipped_pages"] == 4
    assert a.linker.counters["offloaded_pages"] == 4
    dest = a.allocator.alloc(4 * PAGE)
    assert a.linker.load("r", _kv(keys, dest))
    with pytest.raises(RuntimeError, match="already queued"):
        a.linker.load("r", _kv(keys, dest))
    assert a.linker.cancel_queued_load("r") is True
    assert a.linker.cancel_queued_load("r") is False
    assert a.linker.start_layer_wise_loading() == -1
    assert a.linker.offload(_kv(keys, slots))
    a.linker.reset()  # waits for the offload, forgets its result
    assert a.linker.num_completed_offloads() == 0
    assert a.linker.offload(_kv(keys, torch.arange(3))) is False  # not whole pages


def test_same_pages_as_maru_storage_on_a_page_first_direct_host_pool(pair, maru_server):
    """The linker stores a page in the byte order and namespace of MaruStorage's
    page_first_direct KV pages: a HiCache L3 instance reads the linker's pages (and a model
    of another name misses)."""
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    a = pair()
    keys = _hashes(6, "x")
    slots = a.allocator.alloc(6 * PAGE)
    a.fill(slots, seed=6)
    assert _offload(a, keys, slots)

    host = MHATokenToKVPoolHost(
        a.device.get_device_pool_infos()[0].buffer_info, 2, 0, PAGE, "page_first_direct",
        pin_memory=False, device="cpu", device_capacity_tokens=a.device.size,
        start_layer=0, end_layer=LAYERS - 1,
        write_back_staging=a.device.hicache_write_back_staging,
    )  # fmt: skip
    extra = {**MARU_BACKEND, "maru_server_url": maru_server.url, "maru_pool_size": "32M"}
    model = a.linker.storage_config.model_name
    for name, hits in ((model, 6), ("another-model", 0)):
        storage = MaruStorage(storage_config(model=name, extra=extra), {})
        try:
            storage.register_mem_pool_host(host)
            assert (storage.namespace == a.linker.namespace) == (name == model)
            host_slots = host.alloc(6 * PAGE)
            assert storage.batch_get_v1(keys, host_slots) == [True] * hits + [False] * (6 - hits)
            for i in range(hits):
                page = host.get_data_page(int(host_slots[i * PAGE]), flat=True)
                rows = slots[i * PAGE : (i + 1) * PAGE]
                # K of layers 0..L-1, then V of layers 0..L-1
                want = torch.cat(
                    [buf[rows].view(torch.uint8).flatten() for part in a.buffers for buf in part]
                ).cpu()
                assert torch.equal(page.view(torch.uint8), want)
            host.free(host_slots)
        finally:
            storage.close()


def test_linker_and_maru_storage_agree_on_an_fp8_namespace():
    """An fp8 device pool's dtype is float8 and its host pool's uint8 (both store bytes): the
    linker names its pages as MaruStorage does, per format (one format's pages are never the
    other's), so the two still share them."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.runtime_context import get_context

    from maru_sglang.linker import DevicePageLayout
    from maru_sglang.pools import page_namespace
    from sglang_cpu.host_pools import Geometry, make_host_pool

    seen = {}
    for dtype, setting in (
        (torch.bfloat16, "auto"),
        (torch.float8_e4m3fn, "fp8_e4m3"),
        (torch.float8_e5m2, "fp8_e5m2"),
    ):
        g = Geometry(dtype=dtype)
        device = MHATokenToKVPool(
            512, g.page_size, dtype, head_num=g.heads, head_dim=g.head_dim,
            layer_num=g.layers, device="cpu", enable_memory_saver=False,
            start_layer=0, end_layer=g.layers - 1,
        )  # fmt: skip
        layout = DevicePageLayout(device, g.page_size)
        with get_context().override_server_args(kv_cache_dtype=setting):
            linker_ns = page_namespace(storage_config(), layout.geometry)
            storage_ns = page_namespace(storage_config(), make_host_pool(g))
        assert linker_ns == storage_ns, dtype
        seen[dtype] = linker_ns
    assert len(set(seen.values())) == 3


def test_another_geometry_is_another_namespace(pair):
    from sglang.srt.mem_cache.hicache_storage import PoolName

    mha, mla = pair("mha"), pair("mla")
    assert mha.linker.namespace != mla.linker.namespace
    assert mha.linker.pools == {PoolName.KV: mha.linker.layout}


def test_a_device_pool_laid_out_by_pages_is_refused(runtime, maru_server, monkeypatch):
    """SGLANG_USE_HND_KVCACHE lays the device KV out by pages (HND: a row is a page). The
    linker addresses token rows: a load of page 1 (slots 4..7) went to the rows of pages 4..7,
    other requests' pages, and reported the batch landed, page 1 untouched. Refused now."""
    monkeypatch.setenv("SGLANG_USE_HND_KVCACHE", "1")
    with pytest.raises(ValueError, match="one row per token slot"):
        Instance(runtime, maru_server.url)


def test_the_shared_mapping_is_registered_with_cuda_only_on_a_gpu(pair):
    """On a GPU every mapped region is registered (the copy kernel reaches the pages) and a
    region is unregistered as it is unmapped; without CUDA the step is skipped, cleanly."""
    a, b = pair(), pair()
    registration = a.linker.registration
    if DEVICE == "cpu":
        assert registration is None
        assert register_with_cuda(a.linker.handler, a.linker.layout.device) is None
        return
    keys = _hashes(4, "reg")
    slots = a.allocator.alloc(4 * PAGE)
    a.fill(slots, seed=7)
    assert _offload(a, keys, slots)
    lookup = b.linker.handler.lookup(b.linker.keys(keys), lease=True)
    lookup.wait()  # a's region, mapped read-only in b, registered read-only
    page = b.linker.layout.page_bytes
    assert b.linker.registration.covers(lookup.addresses, page)
    assert not b.linker.registration.covers(lookup.addresses + (1 << 40), page)
    # The driver holds it: registering the range again is refused (already registered).
    address = int(lookup.addresses[0])
    assert b.linker.registration.driver.register(address, page, read_only=True) != 0
    lookup.release()
    b.close()  # unmaps every region, each unregistered first (the handler's close listener)
    assert not b.linker.registration.covers(lookup.addresses, page)
    assert b.linker.registration._ranges == {}  # nothing left registered


def test_the_dynamic_factory_builds_it_and_a_down_server_is_a_clear_error(runtime, tmp_path):
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
    from sglang.srt.mem_cache.unified_cache.linker_factory import create_unified_cache_linker

    with pytest.raises(
        RuntimeError, match=r"Failed to connect MaruHandler to tcp://127\.0\.0\.1:1"
    ):
        Instance(runtime, "tcp://127.0.0.1:1", maru_timeout_ms=300)
    config = {
        "linker": "MaruCacheLinker",
        "linker_module_path": "maru_sglang.linker",
        "linker_extra_config": {"maru_server_url": "tcp://127.0.0.1:1", "maru_timeout_ms": 300},
    }
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    device = MHATokenToKVPool(
        64, PAGE, torch.bfloat16, head_num=HEADS, head_dim=HEAD_DIM, layer_num=LAYERS,
        device="cpu", enable_memory_saver=False, start_layer=0, end_layer=LAYERS - 1,
    )  # fmt: skip
    alloc = PagedTokenToKVPoolAllocator(64, PAGE, torch.bfloat16, "cpu", device, need_sort=False)
    params = CacheInitParams(False, None, alloc, PAGE)
    # The factory imports our module and checks it is a complete UnifiedCacheLinker; the
    # constructor then fails only on the connection.
    with pytest.raises(RuntimeError, match="Failed to connect MaruHandler"):
        create_unified_cache_linker(
            runtime, params, backend="dynamic", config=config, components={ComponentType.FULL}
        )
    with pytest.raises(ValueError, match="FULL KV only"):
        create_unified_cache_linker(
            runtime,
            params,
            backend="dynamic",
            config=config,
            components={ComponentType.FULL, ComponentType.SWA},
        )


def test_a_block_scaled_mla_cache_is_refused(runtime, maru_server):
    """An MLA fp4 device pool keeps each row's block scales in `kv_scale_buffer`. The linker
    stored and loaded the latent rows only and reported the load landed: the slots kept
    other tokens' scales, so the KV dequantized wrong. Refused at start now, as scaled MHA
    caches are (SGLang's MLA host pool refuses it for HiCache too)."""
    with pytest.raises(ValueError, match=r"scaled .*kv_scale_buffer"):
        Instance(runtime, maru_server.url, "mla_fp4")
