"""Smoke test: the real SGLang 0.5.23 works on this CPU-only machine with HiCache.

(a) in-process: HiCacheStorage imports, a real MHATokenToKVPoolHost is built on CPU in the
    ``page_first_direct`` and ``page_first`` layouts and the ``direct`` io shims round-trip;
(b) a real ``sglang.launch_server`` on CPU with the built-in ``file`` L3 backend serves a prompt
    from storage after ``/flush_cache``.

Install SGLang first: ``scripts/install_sglang_cpu.sh``. Skipped when sglang is not installed.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import sglang_cpu

sglang_cpu.require()

from sglang_cpu.server import flush_cache, generate, running_server  # noqa: E402
from sglang_cpu.tiny_model import build_tiny_model, make_prompt  # noqa: E402

pytestmark = pytest.mark.sglang

PAGE = 4
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 16


def _device_pool(torch):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return MHATokenToKVPool(
        size=128,
        page_size=PAGE,
        dtype=torch.bfloat16,
        head_num=KV_HEADS,
        head_dim=HEAD_DIM,
        layer_num=LAYERS,
        device="cpu",
        enable_memory_saver=False,
        start_layer=0,
        end_layer=LAYERS,
    )


def _host_pool(device_pool, layout, **kwargs):
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    return MHATokenToKVPoolHost(
        device_pool.get_device_pool_infos()[0].buffer_info,
        2.0,  # host_to_device_ratio
        0,  # host_size (GB); 0 -> use the ratio
        PAGE,
        layout,
        device="cpu",
        device_capacity_tokens=device_pool.size,
        start_layer=0,
        end_layer=LAYERS,
        **kwargs,
    )


def test_hicache_storage_api_imports():
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    assert {"get", "batch_get", "set", "batch_set", "exists"} <= HiCacheStorage.__abstractmethods__
    assert "is_page_first_layout" in HiCacheStorageConfig.__dataclass_fields__
    assert callable(StorageBackendFactory.create_backend)


@pytest.mark.parametrize("layout", ["page_first_direct", "page_first"])
def test_mha_host_pool_on_cpu(layout):
    import torch

    dev = _device_pool(torch)
    host = _host_pool(dev, layout, pin_memory=False)
    assert host.pin_memory is False
    tokens = host.size
    if layout == "page_first_direct":
        assert tuple(host.kv_buffer.shape) == (2, tokens // PAGE, LAYERS, PAGE, KV_HEADS, HEAD_DIM)
    else:
        assert tuple(host.kv_buffer.shape) == (2, tokens, LAYERS, KV_HEADS, HEAD_DIM)

    host_idx = host.alloc(2 * PAGE)
    ptrs, sizes = host.get_page_buffer_meta(host_idx)
    page_bytes = LAYERS * PAGE * KV_HEADS * HEAD_DIM * 2  # bf16
    assert len(ptrs) == 2 * 2 and sizes == [page_bytes] * 4  # K and V per page

    # Flat pages round-trip through the storage-facing helpers.
    host.kv_buffer.normal_()
    page = host.get_data_page(int(host_idx[0]), flat=True).clone()
    host.set_from_flat_data_page(int(host_idx[PAGE]), page)
    assert torch.equal(host.get_data_page(int(host_idx[PAGE]), flat=True), page)

    if layout == "page_first_direct":
        # The `direct` io shims: device -> host (backup) -> device (load) is exact.
        for layer in range(LAYERS):
            dev.k_buffer[layer].normal_()
            dev.v_buffer[layer].normal_()
        src = torch.arange(8, 8 + 2 * PAGE)
        ref = [(dev.k_buffer[i][src].clone(), dev.v_buffer[i][src].clone()) for i in range(LAYERS)]
        host.backup_from_device_all_layer(dev, host_idx, src, "direct")
        dst = torch.arange(40, 40 + 2 * PAGE)
        for layer in range(LAYERS):
            host.load_to_device_per_layer(dev, host_idx, dst, layer, "direct")
        for layer, (k, v) in enumerate(ref):
            assert torch.equal(dev.k_buffer[layer][dst], k)
            assert torch.equal(dev.v_buffer[layer][dst], v)


def test_host_pool_pin_memory_forced_off_on_cpu():
    import torch

    # SGLang's own default is pin_memory=True, which needs cudaHostRegister.
    host = _host_pool(_device_pool(torch), "page_first_direct")
    assert host.pin_memory is False


def test_mla_host_pool_direct_round_trip():
    import torch
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    kv_lora_rank, rope_dim = 32, 16
    dev = MLATokenToKVPool(
        128, PAGE, torch.bfloat16, kv_lora_rank, rope_dim, LAYERS, "cpu", False, 0, LAYERS
    )
    host = MLATokenToKVPoolHost(
        dev.get_device_pool_infos()[0].buffer_info,
        2.0,
        0,
        PAGE,
        "page_first_direct",
        device="cpu",
        device_capacity_tokens=dev.size,
        start_layer=0,
        end_layer=LAYERS,
        target_layer_num=LAYERS,
    )
    assert host.pin_memory is False
    assert tuple(host.kv_buffer.shape[1:]) == (LAYERS, PAGE, 1, kv_lora_rank + rope_dim)
    for layer in range(LAYERS):
        dev.kv_buffer[layer].normal_()
    host_idx, src, dst = host.alloc(2 * PAGE), torch.arange(8, 16), torch.arange(40, 48)
    ref = [dev.kv_buffer[layer][src].clone() for layer in range(LAYERS)]
    host.backup_from_device_all_layer(dev, host_idx, src, "direct")
    for layer in range(LAYERS):
        host.load_to_device_per_layer(dev, host_idx, dst, layer, "direct")
    for layer in range(LAYERS):
        assert torch.equal(dev.kv_buffer[layer][dst], ref[layer])


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"))


def _wait_stable_file_count(directory: Path, minimum: int, timeout: float = 30.0) -> int:
    """Write-through to L3 is asynchronous: wait until the file count settles."""
    deadline = time.monotonic() + timeout
    last, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        count = sum(1 for _ in directory.glob("*.bin"))
        if count != last:
            last, since = count, time.monotonic()
        elif count >= minimum and time.monotonic() - since >= 1.0:
            return count
        time.sleep(0.2)
    return last


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_server_reuses_kv_from_file_storage(tiny_model, tmp_path):
    storage_dir = tmp_path / "l3"
    storage_dir.mkdir()
    prompt_tokens = 64
    prompt = make_prompt(prompt_tokens, seed=7)
    args = [
        "--enable-hierarchical-cache",
        "--hicache-io-backend", "direct",
        "--hicache-mem-layout", "page_first_direct",
        "--hicache-storage-backend", "file",
        "--hicache-storage-backend-extra-config", '{"prefetch_threshold": 4}',
    ]  # fmt: skip
    env = {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(storage_dir)}

    log = tmp_path / "server.log"
    with running_server(tiny_model, extra_args=args, env=env, page_size=PAGE, log_path=log) as srv:
        print(f"sglang server up in {srv.startup_seconds:.1f} s at {srv.base_url}")
        first = generate(srv.base_url, prompt, max_new_tokens=8)
        assert first["meta_info"]["prompt_tokens"] == prompt_tokens
        assert first["meta_info"]["cached_tokens"] == 0

        full_pages = prompt_tokens // PAGE
        stored = _wait_stable_file_count(storage_dir, minimum=full_pages - 1)
        assert stored >= full_pages - 1, srv.log_tail()

        flush_cache(srv.base_url)
        second = generate(srv.base_url, prompt, max_new_tokens=8)

    meta = second["meta_info"]
    details = meta["cached_tokens_details"]
    print("cached_tokens_details:", details)
    assert details is not None, meta
    assert details["storage_backend"] == "HiCacheFile"
    # Whole pages of the prompt, minus the last one (its last token is always recomputed).
    assert details["storage"] == (full_pages - 1) * PAGE
    assert details["device"] == 0 and details["host"] == 0
    assert meta["cached_tokens"] == details["storage"]
    assert second["output_ids"] == first["output_ids"]
    assert second["text"] == first["text"]
