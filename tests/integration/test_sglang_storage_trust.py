"""MaruStorage given host indices that do not fit its host pool (SGLang's real host pools on
CPU): every such page fails cleanly, no byte outside the pool's pages is read into a key nor
written over, and no page is reported loaded with another key's bytes.

The host pool's buffer is moved into the middle of a larger tensor of known guard bytes (the
real SGLang pool object, only its `kv_buffer` placed there), so that a copy that strays
outside the pool lands in memory the test owns and can check instead of corrupting the heap.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.sglang

import sglang_cpu  # noqa: E402

sglang_cpu.require()

import torch  # noqa: E402

from maru_sglang.maru_storage import MaruStorage  # noqa: E402
from sglang_cpu.host_pools import (  # noqa: E402
    Geometry,
    expected_pages,
    fill,
    make_host_pool,
    page_indices,
    read,
    storage_config,
)
from sglang_cpu.p2p import MARU_BACKEND  # noqa: E402

GUARD = 64 * 1024  # guard bytes on each side of the pool's buffer (pages here are < 2 KiB)
PATTERN = 0xA5

GEOMETRIES = [
    Geometry(attn=attn, layout=layout)
    for attn in ("mha", "mla")
    for layout in ("page_first_direct", "page_first")
]


def _ids(g: Geometry) -> str:
    return f"{g.attn}-{g.layout}"


def _guarded_pool(g: Geometry):
    """A real host pool whose `kv_buffer` lies between two guard areas; (pool, guard)."""
    pool = make_host_pool(g)
    buf = pool.kv_buffer
    nbytes = buf.numel() * buf.element_size()
    guard = torch.full((GUARD + nbytes + GUARD,), PATTERN, dtype=torch.uint8)
    inner = guard[GUARD : GUARD + nbytes]
    inner.copy_(buf.reshape(-1).view(torch.uint8))
    pool.kv_buffer = inner.view(buf.dtype).view(buf.shape)
    return pool, guard


def _guards_intact(guard: torch.Tensor) -> bool:
    return bool((guard[:GUARD] == PATTERN).all()) and bool((guard[-GUARD:] == PATTERN).all())


def _storage(url: str, g: Geometry, pool) -> MaruStorage:
    extra = {**MARU_BACKEND, "maru_server_url": url, "maru_pool_size": "32M"}
    storage = MaruStorage(storage_config(is_mla=g.attn == "mla", extra=extra), {})
    storage.register_mem_pool_host(pool)
    return storage


def _pages_in_pool(pool) -> int:
    return pool.size // pool.page_size


@pytest.mark.parametrize("g", GEOMETRIES, ids=_ids)
def test_indices_outside_the_host_pool_are_refused_and_touch_nothing(maru_server, g):
    """A page index past the pool's last page or below 0 would address memory outside the
    pool's buffers: a set must not store those bytes under a key, a get must not write over
    them. Each such batch fails whole (False per key), nothing stored, the guards intact."""
    pool, guard = _guarded_pool(g)
    storage = _storage(maru_server.url, g, pool)
    page = g.page_size
    src = page_indices(0, 2, page)
    pages = expected_pages(pool, 2, seed=3)
    fill(pool, src, pages)
    assert storage.batch_set_v1(["s0", "s1"], src) == [True, True]
    last = _pages_in_pool(pool) - 1
    outside = {
        "past the end": page_indices(last + 1, 1, page),
        "below 0": page_indices(-1, 1, page),
        "last, then past the end": page_indices(last, 2, page),
    }
    for name, indices in outside.items():
        keys = [f"{name}-{i}" for i in range(indices.numel() // page)]
        got = storage.batch_get_v1(["s0", "s1"][: len(keys)], indices)
        assert _guards_intact(guard), f"{name}: a get wrote outside the pool"
        assert got == [False] * len(keys), name
        assert storage.batch_set_v1(keys, indices) == [False] * len(keys), name
        assert storage.batch_exists(keys) == 0, name
    # the pool still works: in-range pages load their own bytes
    dst = page_indices(last - 1, 2, page)
    assert storage.batch_get_v1(["s0", "s1"], dst) == [True, True]
    assert all(torch.equal(x, y) for x, y in zip(read(pool, dst, 2), pages))
    storage.close()


@pytest.mark.parametrize("g", GEOMETRIES[:2], ids=_ids)
def test_a_page_whose_indices_are_not_one_aligned_run_is_refused(maru_server, g):
    """SGLang's host pages are runs of `page_size` slots starting at a multiple of it. A page
    starting mid-page (a copy would take half of two pages) or whose slots are not one run
    (the copy would take slots the caller did not name) would store other bytes than the
    caller's under its key: refused, nothing stored."""
    pool, guard = _guarded_pool(g)
    storage = _storage(maru_server.url, g, pool)
    page = g.page_size
    fill(pool, page_indices(0, 4, page), expected_pages(pool, 4, seed=5))
    run = page_indices(1, 1, page)
    scattered = run.clone()
    scattered[-1] = 3 * page  # the last slot elsewhere
    cases = {
        "misaligned": run + 1,
        "scattered": scattered,
        "reversed": run.flip(0),
    }
    for name, indices in cases.items():
        assert storage.batch_set_v1([name], indices) == [False], name
        assert storage.batch_exists([name]) == 0, name
    assert _guards_intact(guard)
    storage.close()


def test_a_get_naming_one_host_page_for_two_keys_reports_no_wrong_hit(maru_server):
    """Two keys loaded into one host page: the page can hold only one of them, so at most one
    key may be reported loaded, and the one reported must be the page's bytes."""
    g = Geometry()
    pool = make_host_pool(g)
    storage = _storage(maru_server.url, g, pool)
    page = g.page_size
    src = page_indices(0, 2, page)
    pages = expected_pages(pool, 2, seed=9)
    fill(pool, src, pages)
    assert storage.batch_set_v1(["a", "b"], src) == [True, True]
    dst = page_indices(6, 1, page)
    twice = torch.cat([dst, dst])
    got = storage.batch_get_v1(["a", "b"], twice)
    loaded = read(pool, dst, 1)[0]
    for key, hit, expected in zip("ab", got, pages):
        if hit:
            assert torch.equal(loaded, expected), f"{key} reported loaded, page holds other bytes"
    storage.close()


def _dcp_pool(dcp_size: int, dcp_rank: int):
    """A real MLA host pool of one decode-context-parallel rank: SGLang's host indices are
    then logical (a page is `page_size * dcp_size` of them), each rank holding its share."""
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    g = Geometry(attn="mla", page_size=8)
    device = MLATokenToKVPool(
        512,
        g.page_size,
        g.dtype,
        kv_lora_rank=g.kv_lora_rank,
        qk_rope_head_dim=g.rope_dim,
        layer_num=g.layers,
        device="cpu",
        enable_memory_saver=False,
        start_layer=0,
        end_layer=g.layers - 1,
    )
    return MLATokenToKVPoolHost(
        device.get_device_pool_infos()[0].buffer_info,
        2,
        0,
        g.page_size,
        "page_first_direct",
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=device.size,
        start_layer=0,
        end_layer=g.layers - 1,
        target_layer_num=g.layers,
        dcp_size=dcp_size,
        dcp_rank=dcp_rank,
    )


def test_a_dcp_rank_stores_and_loads_its_share_of_logical_pages(maru_server):
    """Under DCP SGLang addresses the host pool by logical pages (`logical_page_size`
    indices each, `get_data_page(logical index)`): MaruStorage registers such a pool and
    moves exactly the page `get_data_page` names, and refuses indices beyond `logical_size`."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    pool = _dcp_pool(2, 0)
    logical = pool.logical_page_size
    extra = {**MARU_BACKEND, "maru_server_url": maru_server.url, "maru_pool_size": "32M"}
    base = storage_config(is_mla=True, tp_size=2, extra=extra).__dict__
    config = HiCacheStorageConfig(
        **{**base, "dcp_size": 2, "dcp_rank": 0, "logical_page_size": logical}
    )
    storage = MaruStorage(config, {})
    storage.register_mem_pool_host(pool)
    src = torch.arange(0, 3 * logical, dtype=torch.int64)
    pages = expected_pages(pool, 3, seed=21)
    for i, data in enumerate(pages):
        pool.set_from_flat_data_page(i * logical, data)
    assert storage.batch_set_v1(["d0", "d1", "d2"], src) == [True] * 3
    dst = torch.arange(5 * logical, 8 * logical, dtype=torch.int64)
    assert storage.batch_get_v1(["d0", "d1", "d2"], dst) == [True] * 3
    for i, data in enumerate(pages):
        assert torch.equal(pool.get_data_page(int(dst[i * logical]), flat=True), data)
    past = torch.arange(pool.logical_size, pool.logical_size + logical, dtype=torch.int64)
    assert storage.batch_get_v1(["d0"], past) == [False]
    storage.close()
