"""MaruStorage against the real SGLang 0.5.23 classes on CPU (host pools, factory, config).

Needs SGLang (`make install` puts it in .venv); skipped without it. The CPU shims in
tests/sglang_cpu replace CUDA-only pieces of SGLang, never anything of ours.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

pytestmark = pytest.mark.sglang

import sglang_cpu  # noqa: E402

sglang_cpu.require()

import torch  # noqa: E402

import maru.client.handler as handler_module  # noqa: E402
import maru.client.localindex as localindex_module  # noqa: E402
import maru.client.writes as writes_module  # noqa: E402
from maru import MaruHandler  # noqa: E402
from maru.common.config import ConfigError  # noqa: E402
from maru.common.protocol import MsgType  # noqa: E402
from maru_sglang.maru_storage import KV_POOL_NAME, MaruStorage  # noqa: E402
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

from .workers import flip_byte  # noqa: E402

PAGES = 40


def _extra(url: str, **more) -> dict:
    return {**MARU_BACKEND, "maru_server_url": url, "maru_pool_size": "32M", **more}


def _storage(url: str, g: Geometry, pool=None, **cfg) -> MaruStorage:
    storage = MaruStorage(storage_config(is_mla=g.attn == "mla", extra=_extra(url), **cfg), {})
    storage.register_mem_pool_host(pool if pool is not None else make_host_pool(g))
    return storage


def _run_peer(role: str, url: str, seed: int, **extra) -> dict:
    proc = subprocess.run(
        [
            sys.executable,
            str(sglang_cpu.SHIM_DIR / "storage_peer.py"),
            role,
            url,
            str(PAGES),
            str(seed),
            json.dumps(extra),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=sglang_cpu.sglang_env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_two_processes_share_pages_for_every_layout(maru_server):
    """Process 1 stores with batch_set_v1; process 2, with its own host pool and its own
    MaruStorage, sees all pages with batch_exists and loads identical bytes."""
    written = _run_peer("writer", maru_server.url, seed=11)
    assert all(v["stored"] == PAGES for v in written.values()), written
    loaded = _run_peer("reader", maru_server.url, seed=11)
    assert set(loaded) == {
        "mha/page_first_direct",
        "mha/page_first",
        "mla/page_first_direct",
        "mla/page_first",
    }
    for name, outcome in loaded.items():
        assert outcome == {"exists": PAGES, "loaded": PAGES, "identical": PAGES}, name


@pytest.mark.parametrize(("server", "client"), [("software", None), ("hardware", "software")])
def test_software_coherence_shares_pages_between_processes_by_bytes(
    maru_server_factory, server, client
):
    """Software coherence through SGLang's real host pools and backend factory: by the
    server's `--coherence software`, or by `maru_coherence` against a hardware server. Every
    page read back is the bytes written; this machine is coherent, so the bytes cannot show
    the flushes: each process reports the mode it copied in and the cache lines its copies
    wrote back (the writer) and invalidated (the reader), which a loop that skipped its
    flushes would leave at 0."""
    url = maru_server_factory(pool_size="512M", extra_args=["--coherence", server]).url
    extra = {"report_coherence": True, **({"maru_coherence": client} if client else {})}
    written = _run_peer("writer", url, seed=13, **extra)
    loaded = _run_peer("reader", url, seed=13, **extra)
    # an MHA page is 1536 bytes (24 lines), an MLA page 960 (15); all under 4 KiB, so the
    # writer copies them with cached stores and writes back every line of every page (its
    # parts are whole lines), and the reader invalidates every line of every page it reads
    lines = PAGES * (24 + 24 + 15 + 15)
    modes = ["software"]
    assert written.pop("coherence") == {"modes": modes, "written_back": lines, "invalidated": 0}
    assert loaded.pop("coherence") == {"modes": modes, "written_back": 0, "invalidated": lines}
    assert all(v["stored"] == PAGES for v in written.values()), written
    for name, outcome in loaded.items():
        assert outcome == {"exists": PAGES, "loaded": PAGES, "identical": PAGES}, name


def test_a_write_whose_copy_faults_fails_its_pages_and_the_process_lives(maru_server):
    """The pool's file truncated under a writer (issue 40, case 6): `batch_set_v1`'s copies
    into its regions fault (SIGBUS), which killed the inference process; now those pages are
    False, their chunks given back, and every later read is a miss, never a wrong hit."""
    proc = subprocess.run(
        [
            sys.executable,
            str(sglang_cpu.SHIM_DIR / "storage_peer.py"),
            "truncated",
            maru_server.url,
            str(PAGES),
            "21",
            maru_server.pool_path,
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=sglang_cpu.sglang_env(),
    )
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    outcome = json.loads(proc.stdout.strip().splitlines()[-1])
    assert outcome == {"before": PAGES, "after": 0, "loaded": 0}, outcome
    assert "the pool's memory faulted under the copy" in proc.stderr


def test_geometry_mismatch_is_a_miss(maru_server):
    g = Geometry()
    writer = _storage(maru_server.url, g)
    idx = page_indices(0, 4, g.page_size)
    fill(writer.mem_pool_host, idx, expected_pages(writer.mem_pool_host, 4, seed=1))
    keys = [f"k{i}" for i in range(4)]
    assert writer.batch_set_v1(keys, idx) == [True] * 4
    assert writer.batch_exists(keys) == 4
    for other in (
        Geometry(head_dim=32),
        Geometry(layout="page_first"),
        Geometry(layers=4),
        Geometry(dtype=torch.float16),
        Geometry(page_size=8),
        Geometry(start_layer=3),  # (a PP stage of as many layers, elsewhere in the model)
    ):
        reader = _storage(maru_server.url, other)
        assert reader.batch_exists(keys) == 0, other
        assert reader.batch_get_v1(keys, page_indices(0, 4, other.page_size)) == [False] * 4
        reader.close()
    tp_other = _storage(maru_server.url, g, tp_rank=1, tp_size=2)
    assert tp_other.batch_exists(keys) == 0
    for s in (tp_other, writer):
        s.close()


def test_fp8_formats_never_read_each_others_pages(maru_server):
    """SGLang keeps an fp8 KV cache as bytes (the host pool's dtype is uint8 for fp8_e4m3 and
    fp8_e5m2 alike, and a page is as long either way): the namespace takes the format from
    SGLang's published `--kv-cache-dtype`, so a run of the other format misses, and a run of the
    same format hits the bytes written."""
    from sglang.srt.runtime_context import get_context

    g = Geometry(dtype=torch.float8_e5m2)
    keys = [f"fp8-{i}" for i in range(3)]
    idx = page_indices(0, 3, g.page_size)
    with get_context().override_server_args(kv_cache_dtype="fp8_e5m2"):
        writer = _storage(maru_server.url, g)
        assert writer.mem_pool_host.dtype == torch.uint8  # (what made the formats collide)
        pages = expected_pages(writer.mem_pool_host, 3, seed=8)
        fill(writer.mem_pool_host, idx, pages)
        assert writer.batch_set_v1(keys, idx) == [True] * 3
        writer.confirm_writes()
        same = _storage(maru_server.url, Geometry(dtype=torch.float8_e5m2))
    for setting in ("fp8_e4m3", "auto", "mxfp8"):
        with get_context().override_server_args(kv_cache_dtype=setting):
            other = _storage(maru_server.url, Geometry(dtype=torch.float8_e4m3fn))
        assert other.mem_pool_host.dtype == torch.uint8
        assert other.namespace != writer.namespace, setting
        assert other.batch_exists(keys) == 0, setting
        assert other.batch_get_v1(keys, page_indices(4, 3, g.page_size)) == [False] * 3
        other.close()
    dst = page_indices(4, 3, g.page_size)
    assert same.batch_get_v1(keys, dst) == [True] * 3
    assert all(torch.equal(x, y) for x, y in zip(read(same.mem_pool_host, dst, 3), pages))
    for s in (same, writer):
        s.close()


def test_mla_pages_are_shared_across_tp_ranks(maru_server):
    g = Geometry(attn="mla")
    rank0 = _storage(maru_server.url, g, tp_rank=0, tp_size=2)
    idx = page_indices(0, 3, g.page_size)
    pages = expected_pages(rank0.mem_pool_host, 3, seed=5)
    fill(rank0.mem_pool_host, idx, pages)
    assert rank0.batch_set_v1(["a", "b", "c"], idx) == [True] * 3
    rank1 = _storage(maru_server.url, g, tp_rank=1, tp_size=2)
    dst = page_indices(9, 3, g.page_size)
    assert rank1.batch_get_v1(["a", "b", "c"], dst) == [True] * 3
    got = read(rank1.mem_pool_host, dst, 3)
    assert all(torch.equal(x, y) for x, y in zip(got, pages))
    rank0.close()
    rank1.close()


def test_wrong_length_page_is_a_miss_not_a_partial_copy(maru_server):
    g = Geometry()
    storage = _storage(maru_server.url, g)
    pool = storage.mem_pool_host
    key = f"{storage.namespace}:short"
    with MaruHandler(server_url=maru_server.url, pool_size="8M") as other:
        assert other.store(key, b"\x7f" * 100)
    dst = page_indices(2, 1, g.page_size)
    before = read(pool, dst, 1)[0]
    assert storage.batch_exists(["short"]) == 1
    assert storage.batch_get_v1(["short"], dst) == [False]
    assert torch.equal(read(pool, dst, 1)[0], before)
    storage.close()


def test_bad_host_indices_fail_the_batch_and_leave_no_lease(maru_server):
    """batch_get_v1 sends its lookup before it checks the host indices (it prepares the copy
    while the server works): on bad indices the lease it took must still end."""
    g = Geometry()
    storage = _storage(maru_server.url, g)
    assert storage.batch_set_v1(["a", "b"], page_indices(0, 2, g.page_size)) == [True, True]
    short = page_indices(4, 1, g.page_size)  # one page of indices for two keys
    assert storage.batch_get_v1(["a", "b"], short) == [False, False]
    stats = storage.handler.stats()  # answered after the (unawaited) release
    assert stats["leases"] == 0
    assert storage.batch_get_v1(["a", "b"], page_indices(4, 2, g.page_size)) == [True, True]
    storage.close()


def test_host_indices_of_any_integer_form_address_the_same_pages(maru_server):
    """SGLang's host indices (a contiguous int64 CPU tensor) are read where they lie; an int32
    tensor, a strided view and a tensor that needs grad are copied first: the same pages."""
    g = Geometry()
    storage = _storage(maru_server.url, g)
    pool = storage.mem_pool_host
    src = page_indices(0, 3, g.page_size)
    pages = expected_pages(pool, 3, seed=7)
    fill(pool, src, pages)
    keys = ["i0", "i1", "i2"]
    assert storage.batch_set_v1(keys, src.to(torch.int32)) == [True] * 3
    dst = page_indices(8, 3, g.page_size)
    forms = {
        "in place": dst,
        "int32": dst.to(torch.int32),
        "strided": torch.stack([dst, dst + 1], dim=1)[:, 0],
        "float with grad": dst.to(torch.float64).requires_grad_(),
    }
    for name, indices in forms.items():
        fill(pool, dst, [torch.zeros_like(p) for p in pages])
        assert storage.batch_get_v1(keys, indices) == [True] * 3, name
        assert all(torch.equal(x, y) for x, y in zip(read(pool, dst, 3), pages)), name
    assert storage.batch_get_v1(keys, dst[: g.page_size * 2]) == [False] * 3  # short: no copy
    storage.close()


def test_partial_prefix_counts_consecutive_hits(maru_server):
    g = Geometry()
    storage = _storage(maru_server.url, g)
    idx = page_indices(0, 3, g.page_size)
    assert storage.batch_set_v1(["p0", "p1", "p2"], idx) == [True] * 3
    assert storage.batch_exists(["p0", "p1", "x", "p2"]) == 2
    assert storage.batch_exists(["x", "p0"]) == 0
    assert storage.batch_get_v1(["p0", "x"], page_indices(5, 2, g.page_size)) == [True, False]
    storage.close()


def test_layer_first_is_rejected_with_advice(maru_server):
    storage = MaruStorage(storage_config(extra=_extra(maru_server.url)), {})
    with pytest.raises(ValueError, match="page_first_direct"):
        storage.register_mem_pool_host(make_host_pool(Geometry(layout="layer_first")))
    storage.close()


def test_config_errors_name_the_key(maru_server):
    with pytest.raises(ConfigError, match="maru_pool_sise"):
        MaruStorage(storage_config(extra=_extra(maru_server.url, maru_pool_sise="1G")), {})
    with pytest.raises(ConfigError, match="maru_timeout_ms"):
        MaruStorage(storage_config(extra=_extra(maru_server.url, maru_timeout_ms="soon")), {})
    with pytest.raises(ConfigError, match="maru_eager_map"):
        MaruStorage(storage_config(extra=_extra(maru_server.url, maru_eager_map="maybe")), {})
    # strings and JSON values both work
    ok = MaruStorage(
        storage_config(
            extra=_extra(maru_server.url, maru_eager_map="false", maru_chunk_size_bytes="2M")
        ),
        {},
    )
    assert ok.config.eager_map is False and ok.config.chunk_size_bytes == 2 << 20
    ok.close()


def test_maru_pool_path_maps_the_pool_where_the_host_sees_it(maru_server, tmp_path):
    """SGLang's `maru_pool_path` reaches the config: a reader that maps the pool by another
    path (a hard link) loads the writer's pages byte for byte; one that names another file
    fails as documented, naming it."""
    elsewhere = maru_server.pool_path + ".elsewhere"
    os.link(maru_server.pool_path, elsewhere)
    try:
        g = Geometry()
        writer = _storage(maru_server.url, g)
        src = page_indices(0, 3, g.page_size)
        pages = expected_pages(writer.mem_pool_host, 3, seed=5)
        fill(writer.mem_pool_host, src, pages)
        assert writer.batch_set_v1(["w0", "w1", "w2"], src) == [True] * 3
        extra = _extra(maru_server.url, maru_pool_path=elsewhere)
        reader = MaruStorage(storage_config(extra=extra), {})
        reader.register_mem_pool_host(make_host_pool(g))
        assert reader.config.pool_path == elsewhere
        dst = page_indices(4, 3, g.page_size)
        assert reader.batch_get_v1(["w0", "w1", "w2"], dst) == [True] * 3
        got = read(reader.mem_pool_host, dst, 3)
        assert all(torch.equal(x, y) for x, y in zip(got, pages))
        reader.close()
        writer.close()
        zeros = tmp_path / "zeros"
        zeros.write_bytes(bytes(4096))
        with pytest.raises(RuntimeError, match=f"pool_path {zeros}"):
            MaruStorage(
                storage_config(extra=_extra(maru_server.url, maru_pool_path=str(zeros))), {}
            )
    finally:
        os.unlink(elsewhere)


def test_server_down_raises_the_documented_error(tmp_path):
    url = "tcp://127.0.0.1:9"  # discard port: nothing answers
    with pytest.raises(RuntimeError) as raised:
        MaruStorage(storage_config(extra=_extra(url, maru_timeout_ms=300)), {})
    # the seed's text first, exactly a RuntimeError, then why (once: no chained copy)
    assert type(raised.value) is RuntimeError
    assert str(raised.value).startswith(
        "Failed to connect MaruHandler to tcp://127.0.0.1:9: maru-server is down or unreachable"
    )
    assert raised.value.__cause__ is None and raised.value.__suppress_context__


def test_legacy_interface_round_trip(maru_server):
    g = Geometry()
    storage = _storage(maru_server.url, g)
    pool = storage.mem_pool_host
    pages = expected_pages(pool, 3, seed=9)
    assert storage.set("L0", pages[0])
    assert storage.batch_set(["L1", "L2"], pages[1:])
    assert storage.exists("L1") and not storage.exists("nope")
    got = storage.batch_get(
        ["L0", "L1", "L2", "nope"], [pool.get_dummy_flat_data_page() for _ in range(4)]
    )
    assert all(torch.equal(got[i], pages[i]) for i in range(3))
    assert got[3] is None
    single = storage.get("L2", pool.get_dummy_flat_data_page())
    assert torch.equal(single, pages[2])
    storage.close()


def test_clear_removes_only_this_namespace(maru_server):
    a = _storage(maru_server.url, Geometry())
    b = _storage(maru_server.url, Geometry(head_dim=32))
    idx = page_indices(0, 2, 4)
    assert a.batch_set_v1(["x", "y"], idx) == [True, True]
    assert b.batch_set_v1(["x", "y"], idx) == [True, True]
    a.clear()
    assert a.batch_exists(["x", "y"]) == 0
    assert b.batch_exists(["x", "y"]) == 2
    a.close()
    b.close()


def test_stats_detach_and_attach_again(maru_server):
    from sglang.srt.observability.metrics_collector import StorageMetrics

    g = Geometry()
    storage = _storage(maru_server.url, g)
    idx = page_indices(0, 2, g.page_size)
    assert storage.batch_set_v1(["s0", "s1"], idx) == [True, True]
    assert storage.batch_get_v1(["s0", "s1", "zz"], page_indices(4, 3, g.page_size)) == [
        True,
        True,
        False,
    ]
    stats = storage.get_stats()
    assert isinstance(stats, StorageMetrics)
    assert stats.backup_pgs == [2] and stats.prefetch_pgs == [3]
    assert stats.maru["hits"] == 2 and stats.maru["misses"] == 1
    assert stats.maru["bytes_written"] == 2 * storage._kv.page_bytes
    assert storage.get_stats().backup_pgs == []  # drained on each call, as SGLang expects
    storage.close()
    again = _storage(maru_server.url, g)  # runtime re-attach: new handler, same pages
    assert again.batch_exists(["s0", "s1"]) == 2
    again.close()


def test_dynamic_factory_loads_maru(maru_server):
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    g = Geometry()
    pool = make_host_pool(g)
    cfg = storage_config(extra=_extra(maru_server.url))
    backend = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    assert isinstance(backend, MaruStorage)
    backend.register_mem_pool_host(pool)
    assert backend.batch_set_v1(["f"], page_indices(0, 1, g.page_size)) == [True]
    backend.close()


def _wait_for_no_leases(handler: MaruHandler, bound_s: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + bound_s
    while handler.stats()["leases"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert handler.stats()["leases"] == 0


def test_a_copy_that_outlives_its_lease_is_a_miss(maru_server_factory, tmp_path, monkeypatch):
    """Issue 13, scenario 6: a copy that takes longer than --lease-timeout (the reader was
    descheduled, say) may read pages that were freed and written again meanwhile. The lease is
    confirmed after the copy, so the batch reads as misses, never as hits on those bytes."""
    server = maru_server_factory(tmp_path / "s", extra_args=["--lease-timeout", "0.3"])
    g = Geometry()
    writer, reader = _storage(server.url, g), _storage(server.url, g)
    src = page_indices(0, 2, g.page_size)
    fill(writer.mem_pool_host, src, expected_pages(writer.mem_pool_host, 2, seed=5))
    assert writer.batch_set_v1(["a", "b"], src) == [True, True]
    assert writer.confirm_writes() == 0
    original = handler_module.copy_values  # the request path's copy (MaruHandler.read)
    slow = {"copies": 0}

    def slow_copy(*args, **kwargs):
        slow["copies"] += 1
        _wait_for_no_leases(reader.handler)  # the server expired the lease mid-copy
        return original(*args, **kwargs)

    monkeypatch.setattr(handler_module, "copy_values", slow_copy)
    dst = page_indices(4, 2, g.page_size)
    assert reader.batch_get_v1(["a", "b"], dst) == [False, False]
    monkeypatch.undo()  # a copy within the lease is a hit, as before
    assert reader.batch_get_v1(["a", "b"], dst) == [True, True]
    got, want = read(reader.mem_pool_host, dst, 2), read(writer.mem_pool_host, src, 2)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert slow["copies"] == 1
    writer.close()
    reader.close()


def test_with_checksums_pages_are_hashed_by_the_copies_not_read_again(maru_server, monkeypatch):
    """`maru_checksums` on SGLang's data path: the writer's and the reader's checksums come
    from the copy loop (`copy_many_hashed`), for multi-part pages too; nothing hashes a page
    in the pool again (what made checksums cost 18-41% before), and the pages read back are
    the written ones, checked."""
    import maru.client.requests as requests
    import maru.client.writes as writes

    hashed_again = []
    real = requests.checksums
    for module in (requests, writes):  # (the read's lookup, the write's seal)
        monkeypatch.setattr(module, "checksums", lambda v: hashed_again.append(1) or real(v))
    g = Geometry()
    checked = MaruStorage(storage_config(extra=_extra(maru_server.url, maru_checksums=True)), {})
    checked.register_mem_pool_host(make_host_pool(g))
    pool = checked.mem_pool_host
    assert checked._kv.parts == 2  # K and V: one value from two places
    src = page_indices(0, PAGES, g.page_size)
    fill(pool, src, expected_pages(pool, PAGES, seed=9))
    keys = [f"fused-{i}" for i in range(PAGES)]
    assert checked.batch_set_v1(keys, src) == [True] * PAGES
    dst = page_indices(PAGES + 2, PAGES, g.page_size)
    assert checked.batch_get_v1(keys, dst) == [True] * PAGES
    assert all(torch.equal(a, b) for a, b in zip(read(pool, dst, PAGES), read(pool, src, PAGES)))
    assert hashed_again == []
    assert checked.handler.checksum_mismatches == 0
    # the stored checksums are those of the bytes in the pool, by the one hash
    found = checked.handler.lookup(checked._kv.keys(keys[:3]))
    assert not found.corrupt().any() and len(hashed_again) == 1
    checked.close()


def test_copies_shared_between_threads_read_back_the_bytes_written(maru_server):
    """`maru_copy_threads` 3: a 3 MiB write's copy and the read's go to the calling thread and
    two copier threads each (`copy_values`); another instance reads every page back as
    written, and with checksums (made by the three threads' copies) none mismatches."""
    import maru.common.memcopy as memcopy

    g = Geometry(page_size=16, layers=4, heads=8, head_dim=64)  # 128 KiB pages
    extra = _extra(maru_server.url, maru_copy_threads=3, maru_checksums=True)
    writer = MaruStorage(storage_config(extra=extra), {})
    writer.register_mem_pool_host(make_host_pool(g))
    reader = MaruStorage(storage_config(extra=extra), {})
    reader.register_mem_pool_host(make_host_pool(g))
    n = 24
    keys = [f"split-{i}" for i in range(n)]
    src, pages = _written(writer, g, keys, seed=5)
    before = memcopy.copier_tasks()
    assert writer.batch_set_v1(keys, src) == [True] * n
    assert memcopy.copier_tasks() - before == 2  # three threads' shares of 1 MiB: two copiers
    writer.confirm_writes()
    dst = page_indices(n + 2, n, g.page_size)
    assert reader.batch_get_v1(keys, dst) == [True] * n
    assert memcopy.copier_tasks() - before == 4  # the read's copy too
    assert all(torch.equal(a, b) for a, b in zip(read(reader.mem_pool_host, dst, n), pages))
    assert reader.handler.checksum_mismatches == 0
    writer.close()
    reader.close()


def _flipper(handler: Any, key: str, at: int) -> Callable[[], None]:
    """A call that flips one byte of `key`'s value where it lies now in the pool file (as
    `flip_byte`), found once: it still flips it after the key is dropped."""
    info = handler.batch_retrieve([key])[0]
    assert info is not None, key
    region = handler._mapper.get(info.region_id).handle
    path, where = region.path, region.offset + info.offset + at

    def flip() -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            (old,) = os.pread(fd, 1, where)
            os.pwrite(fd, bytes([old ^ 0xFF]), where)
        finally:
            os.close(fd)

    return flip


def _wait_gone(handler: MaruHandler, keys: list[str], timeout: float = 20.0) -> None:
    """Until none of `keys` exists (a drop the server makes on a report not waited for)."""
    deadline = time.monotonic() + timeout
    while any(handler.batch_exists(keys)):
        assert time.monotonic() < deadline, f"not dropped within {timeout} s: {keys}"
        time.sleep(0.05)


def _then(first: Callable[[], None], call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    first()
    return call(*args, **kwargs)


def test_a_page_corrupted_in_the_pool_is_a_miss_with_checksums(
    maru_server, monkeypatch, fused_copier
):
    """Issue 13, P8, through SGLang's interface: another process stores pages with
    `maru_checksums`; bytes of some are then overwritten in the pool file. A reader with
    checksums takes those as misses in `batch_get_v1` (and a page changed while it copies),
    counted, and the server drops them on its report: misses in `batch_get_v2`, the legacy
    `batch_get` and for every reader, until the writer stores them again; the other pages are
    hits with the written bytes. A reader without checksums reads the corrupted pages as hits."""
    from sglang.srt.mem_cache.hicache_storage import PoolTransfer

    seed, g = 21, Geometry()  # the peer's first geometry: MHA page_first_direct, many parts
    written = _run_peer("writer", maru_server.url, seed=seed, maru_checksums=True)
    assert written["mha/page_first_direct"] == {"stored": PAGES}
    keys = [f"{seed:x}-page-{i}" for i in range(PAGES)]
    extra = _extra(maru_server.url, maru_checksums=True)
    checked = MaruStorage(storage_config(extra=extra), {})
    checked.register_mem_pool_host(make_host_pool(g))
    plain = _storage(maru_server.url, g)
    pool = checked.mem_pool_host
    want = expected_pages(pool, PAGES, seed)
    assert pool.layout == "page_first_direct" and checked._kv.parts == 2  # K and V
    ns = [checked.namespace + ":" + k for k in keys]
    flip_byte(checked.handler, ns[5], at=checked._kv.page_bytes - 1)  # the last part's last byte
    flip_byte(checked.handler, ns[30])
    victims = {5, 30}

    def check(results: list[bool], dst) -> None:
        assert [i for i, ok in enumerate(results) if not ok] == sorted(victims)
        got = read(pool, dst, PAGES)
        for i in set(range(PAGES)) - victims:
            assert torch.equal(got[i].view(torch.uint8), want[i].view(torch.uint8)), i

    # Without checksums every corrupted page is a hit: the fault is real.
    assert plain.batch_get_v1(keys, page_indices(2, PAGES, g.page_size)) == [True] * PAGES
    wrong = read(plain.mem_pool_host, page_indices(2, PAGES, g.page_size), PAGES)
    same = [torch.equal(w.view(torch.uint8), x.view(torch.uint8)) for w, x in zip(wrong, want)]
    assert [i for i, ok in enumerate(same) if not ok] == sorted(victims)

    dst = page_indices(2, PAGES, g.page_size)
    check(checked.batch_get_v1(keys, dst), dst)
    # The reader told the server where it read them (CORRUPT_KV, not waited for), which
    # drops those entries: from then on misses for every reader (no mismatch), storable again.
    _wait_gone(checked.handler, [ns[i] for i in victims])
    transfer = PoolTransfer(name=KV_POOL_NAME, keys=keys, host_indices=dst)
    check(checked.batch_get_v2([transfer])[KV_POOL_NAME], dst)
    legacy = checked.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
    assert [i for i, t in enumerate(legacy) if t is None] == sorted(victims)
    assert checked.counters["pools"][KV_POOL_NAME]["checksum_mismatches"] == 2  # v1's
    assert checked.handler.checksum_mismatches == 2
    plain_dst = page_indices(2, PAGES, g.page_size)
    assert plain.batch_get_v1(keys, plain_dst) == [i not in victims for i in range(PAGES)]

    # A page changed after the lookup, while the reader copies: caught after the copy, on the
    # local index (probe, copy and check in one C call: the flip runs in its copier; page 11)
    # and on the request path (index off: between the lookup's reply and the copy; page 12),
    # and dropped as well: its bytes put back, it is still a miss.
    assert checked.handler._index is not None
    real = handler_module.copy_values
    for local, page in ((True, 11), (False, 12)):
        corrupt = _flipper(plain.handler, ns[page], at=700)
        with monkeypatch.context() as m:
            if local:
                m.setattr(localindex_module, "COPY_VALUES", fused_copier(corrupt))
            else:
                m.setattr(checked.handler, "_index", None)
                flipped = functools.partial(_then, corrupt, real)
                m.setattr(handler_module, "copy_values", flipped)
            results = checked.batch_get_v1(keys, dst)
        victims.add(page)
        assert [i for i, ok in enumerate(results) if not ok] == sorted(victims)
        _wait_gone(checked.handler, [ns[page]])
        corrupt()  # (the page's bytes as written again)
        again = checked.batch_get_v1(keys, dst)
        assert [i for i, ok in enumerate(again) if not ok] == sorted(victims)
    assert checked.handler.checksum_mismatches == 4

    # The writer stores its pages again: the dropped ones go in (the others are there), and
    # every page is a hit with its written bytes.
    _run_peer("writer", maru_server.url, seed=seed, maru_checksums=True)
    victims.clear()
    check(checked.batch_get_v1(keys, dst), dst)
    assert checked.handler.checksum_mismatches == 4
    checked.close()
    plain.close()


# -- write-behind: a write call returns before its registration is answered -----------------


@contextlib.contextmanager
def _server_paused(server, resume_after: float | None = None):
    """The server stopped (SIGSTOP) inside the block, so no request gets an answer; with
    `resume_after`, a timer resumes it that many seconds in. Resumed on the way out."""
    os.kill(server.pid, signal.SIGSTOP)
    timer = None
    if resume_after is not None:
        timer = threading.Timer(resume_after, os.kill, (server.pid, signal.SIGCONT))
        timer.start()
    try:
        yield
    finally:
        if timer is not None:
            timer.cancel()
        if server.alive():
            os.kill(server.pid, signal.SIGCONT)


def _written(storage, g: Geometry, keys: list[str], seed: int):
    """Fill host pages for `keys` (from page 0): their indices and contents."""
    src = page_indices(0, len(keys), g.page_size)
    pages = expected_pages(storage.mem_pool_host, len(keys), seed=seed)
    fill(storage.mem_pool_host, src, pages)
    return src, pages


def test_a_write_returns_before_its_registration_is_answered(maru_server):
    """With `maru_use_async_rpc` (the default) `batch_set_v1` returns once the pages are
    copied and their registration is sent: here the server is stopped, so no reply can have
    come. Until the server registers them the pages are misses everywhere, never other bytes;
    the writer's own next call waits for its registrations first (it finds its pages), and
    from then on every instance finds them, with the written bytes."""
    g = Geometry()
    writer, reader = _storage(maru_server.url, g), _storage(maru_server.url, g)
    keys = [f"behind-{i}" for i in range(4)]
    src, pages = _written(writer, g, keys, seed=21)
    assert writer.batch_set_v1(["warm"], src[: g.page_size]) == [True]  # holds a region now
    assert writer.confirm_writes() == 0  # (else the pause below could catch its reply)
    with _server_paused(maru_server):
        assert writer.batch_set_v1(keys, src) == [True] * 4
        assert reader.batch_exists(keys) == 0  # sent, not registered: misses
    with _server_paused(maru_server, resume_after=0.3):
        assert writer.batch_exists(keys) == 4  # waited for its registrations, then looked
    assert writer.confirm_writes() == 0
    assert reader.batch_exists(keys) == 4
    dst = page_indices(8, 4, g.page_size)
    assert reader.batch_get_v1(keys, dst) == [True] * 4
    assert all(torch.equal(a, b) for a, b in zip(read(reader.mem_pool_host, dst, 4), pages))
    assert writer.counters["late_write_failures"] == 0
    writer.close()
    reader.close()


def _recording(events: list[str], name: str, call):
    """`call`, noting `name` in `events` each time it is called (the order of a call's steps)."""

    def recorded(*args, **kwargs):
        events.append(name)
        return call(*args, **kwargs)

    return recorded


def _recording_copies(monkeypatch, events: list[str], finish: bool = False) -> None:
    """Note "copy" in `events` when the write verb begins a page copy (in C: `ValuesAt`) and,
    with `finish`, "finish" when it finishes one."""
    real = writes_module._c_copy_values_start

    class Flight:
        def __init__(self, flight):
            self.flight = flight

        def finish(self):
            if finish:
                events.append("finish")
            return self.flight.finish()

    def start(*args):
        events.append("copy")
        return Flight(real(*args))

    monkeypatch.setattr(writes_module, "_c_copy_values_start", start)


def test_a_write_reads_the_earlier_replies_after_its_copies_and_a_read_before(
    maru_server, monkeypatch
):
    """Where the thread's earlier replies are read: a write call after its own copies (the
    server answered meanwhile; read first, the last reply would cost its whole answer time),
    a read before it looks (so that it finds the thread's pages)."""
    g = Geometry()
    storage = _storage(maru_server.url, g)
    keys = [f"order-{i}" for i in range(4)]
    src, _ = _written(storage, g, keys, seed=24)
    events: list[str] = []
    wait = _recording(events, "reply", writes_module.Sealing.wait)
    monkeypatch.setattr(writes_module.Sealing, "wait", wait)
    _recording_copies(monkeypatch, events)
    assert storage.batch_set_v1(keys[:2], src[: 2 * g.page_size]) == [True, True]
    assert events == ["copy"]  # nothing waited for
    assert storage.batch_set_v1(keys[2:], src[2 * g.page_size :]) == [True, True]
    assert events == ["copy", "copy", "reply"]  # the first call's reply, after the copy
    assert storage.batch_exists(keys) == 4
    assert events == ["copy", "copy", "reply", "reply"]  # the second's, before looking
    storage.close()


def test_a_large_write_reads_the_replies_already_in_during_its_copy_and_waits_after(
    maru_server, monkeypatch
):
    """A write of a run of PIPELINE_MIN_PAGES or more starts its copy (the copier threads
    begin), reads the thread's earlier replies that are in, then finishes the copy and
    registers; a reply not in yet (the server stopped) is not waited for during the copy,
    only after it."""
    g = Geometry()
    storage = _storage(maru_server.url, g)
    n = 32
    keys = [f"window-{i}" for i in range(3 * n)]
    src, _ = _written(storage, g, keys[:n], seed=25)
    events: list[str] = []
    wait = _recording(events, "reply", writes_module.Sealing.wait)
    monkeypatch.setattr(writes_module.Sealing, "wait", wait)
    _recording_copies(monkeypatch, events, finish=True)
    assert storage.batch_set_v1(["warm"], src[: g.page_size]) == [True]  # holds a region now
    assert storage.confirm_writes() == 0
    events.clear()
    with _server_paused(maru_server, resume_after=0.5):
        assert storage.batch_set_v1(keys[:n], src) == [True] * n
        assert events == ["copy", "finish"]
        events.clear()
        assert storage.batch_set_v1(keys[n : 2 * n], src) == [True] * n
    assert events == ["copy", "finish", "reply"]  # not in (stopped): waited for after the copy
    ((_, second, _),) = storage.handler._writes._unconfirmed.sealings
    deadline = time.monotonic() + 10
    while not second.arrived() and time.monotonic() < deadline:
        time.sleep(0.01)
    events.clear()
    assert storage.batch_set_v1(keys[2 * n :], src) == [True] * n
    assert events == ["copy", "reply", "finish"]  # in: read during the copy
    assert storage.confirm_writes() == 0
    assert storage.batch_exists(keys) == 3 * n
    storage.close()


def test_a_registration_lost_after_the_write_returned_is_a_counted_miss(
    maru_server_factory, tmp_path, caplog
):
    """The server dies (SIGKILL) between a write call's return and its registration: the
    writer learns it at its next call (`confirm_writes` counts the pages, a WARNING says it,
    `late_write_failures` keeps it), and the pages are misses on the restarted server."""
    server = maru_server_factory(tmp_path / "s")
    g = Geometry()
    writer = _storage(server.url, g)
    keys = [f"lost-{i}" for i in range(3)]
    src, _ = _written(writer, g, keys, seed=22)
    assert writer.batch_set_v1(["warm"], src[: g.page_size]) == [True]
    assert writer.confirm_writes() == 0
    with _server_paused(server):
        assert writer.batch_set_v1(keys, src) == [True] * 3
        server.proc.kill()
        server.proc.wait(10)
    with caplog.at_level(logging.WARNING, logger="maru_sglang.maru_storage"):
        assert writer.confirm_writes() == 3
    assert "3 page(s) an earlier write reported stored may not be registered" in caplog.text
    assert writer.counters["late_write_failures"] == 3
    server.start()
    reader = _storage(server.url, g)
    assert reader.batch_exists(keys) == 0
    assert reader.batch_get_v1(keys, page_indices(8, 3, g.page_size)) == [False] * 3
    writer.close()
    reader.close()


def test_without_async_rpc_a_write_returns_once_registered(maru_server):
    """`maru_use_async_rpc=false`: no write-behind, `batch_set_v1` waits for the server (here
    stopped until a timer resumes it), and another instance finds the pages as soon as the
    call returns."""
    g = Geometry()
    config = storage_config(extra=_extra(maru_server.url, maru_use_async_rpc=False))
    writer = MaruStorage(config, {})
    writer.register_mem_pool_host(make_host_pool(g))
    reader = _storage(maru_server.url, g)
    keys = [f"sync-{i}" for i in range(4)]
    src, _ = _written(writer, g, keys, seed=23)
    assert writer.batch_set_v1(["warm"], src[: g.page_size]) == [True]
    with _server_paused(maru_server, resume_after=0.3):
        assert writer.batch_set_v1(keys, src) == [True] * 4
        assert reader.batch_exists(keys) == 4
    writer.close()
    reader.close()


def test_only_a_write_behind_seal_tells_the_server_no_one_waits_for_it(maru_server):
    """A seal sent write-behind says so ("behind"), so the server need not stay awake for the
    writer's next request (its spin would take a CPU that writer's copy uses); a seal whose
    writer waits (`maru_use_async_rpc=false`) does not, and both are registered."""
    g = Geometry()
    behind = _storage(maru_server.url, g)
    waiting = MaruStorage(
        storage_config(extra=_extra(maru_server.url, maru_use_async_rpc=False)), {}
    )
    waiting.register_mem_pool_host(make_host_pool(g))
    sent: list[tuple[str, object]] = []
    for name, storage in (("behind", behind), ("waiting", waiting)):
        session, request = storage.handler._s, storage.handler._s.request

        def noting(msg_type, body, name=name, request=request):
            if msg_type == MsgType.REGISTER_KV:
                sent.append((name, body.get("behind")))
            return request(msg_type, body)

        session.request = noting
        keys = [f"{name}-{i}" for i in range(4)]
        src, _ = _written(storage, g, keys, seed=24)
        assert storage.batch_set_v1(keys, src) == [True] * 4
        assert storage.batch_exists(keys) == 4
    assert set(sent) == {("behind", True), ("waiting", None)}
    behind.close()
    waiting.close()


def _page_of(key: str, page_bytes: int) -> bytes:
    """A page's bytes made from its key (another key's page, or a torn one, never matches)."""
    digest = hashlib.blake2b(key.encode(), digest_size=64).digest()
    return (digest * (page_bytes // 64 + 1))[:page_bytes]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_write_behind_under_eviction_deletes_and_server_kills(
    maru_server_factory, tmp_path, caplog
):
    """First rule under write-behind: a writer thread stores 32-page batches through
    `batch_set_v1` into a pool it overfills many times (constant eviction) and deletes some,
    a reader thread (another instance) reads random recent pages with `batch_get_v1` and
    checks every hit against its key's bytes, while the server is SIGKILLed and restarted
    every 3 s, so that registrations are lost between a write's return and its reply. 0 wrong
    pages among the hits; the reader did get hits, the writer did overfill the pool."""
    server = maru_server_factory(tmp_path / "s", pool_size="8M")
    g = Geometry()
    extra = {"maru_timeout_ms": "500"}
    writer = MaruStorage(storage_config(extra=_extra(server.url, maru_pool_size="4M", **extra)), {})
    writer.register_mem_pool_host(make_host_pool(g))
    reader = MaruStorage(storage_config(extra=_extra(server.url, maru_pool_size="1M", **extra)), {})
    reader.register_mem_pool_host(make_host_pool(g))
    page_bytes = writer._kv.page_bytes
    for name in ("maru", "maru_sglang"):  # failed calls while down: expected (reset after)
        caplog.set_level(logging.CRITICAL, logger=name)
    stop, written = threading.Event(), [0]
    counts = {"stored": 0, "reads": 0, "hits": 0, "wrong": 0, "errors": 0}

    def write() -> None:
        pool, batch = writer.mem_pool_host, 32
        idx = page_indices(0, batch, g.page_size)
        rng = random.Random(1)
        while not stop.is_set():
            keys = [f"wb-{written[0] + i}" for i in range(batch)]
            for i, key in enumerate(keys):
                page = torch.frombuffer(bytearray(_page_of(key, page_bytes)), dtype=torch.uint8)
                pool.set_from_flat_data_page(int(idx[i * g.page_size]), page.view(pool.dtype))
            try:
                counts["stored"] += sum(writer.batch_set_v1(keys, idx))
                if rng.random() < 0.2:  # deletes race the reads too
                    gone = [f"wb-{rng.randrange(max(0, written[0] - 64), written[0])}"]
                    writer.handler.batch_delete(writer._kv.keys(gone))
            except Exception:  # (the server is down: the next batch goes on)
                counts["errors"] += 1
            written[0] += batch

    def read() -> None:
        pool, rng = reader.mem_pool_host, random.Random(2)
        dst = page_indices(0, 16, g.page_size)
        while not stop.is_set():
            n = written[0]
            if n < 16:
                time.sleep(0.01)
                continue
            first = rng.randrange(max(0, n - 256), n - 15)
            keys = [f"wb-{i}" for i in range(first, first + 16)]
            try:
                hits = reader.batch_get_v1(keys, dst)
            except Exception:
                counts["errors"] += 1
                continue
            counts["reads"] += len(keys)
            for i, (key, hit) in enumerate(zip(keys, hits)):
                if hit:
                    counts["hits"] += 1
                    got = pool.get_data_page(int(dst[i * g.page_size]), flat=True)
                    if got.view(torch.uint8).numpy().tobytes() != _page_of(key, page_bytes):
                        counts["wrong"] += 1

    threads = [threading.Thread(target=f, daemon=True) for f in (write, read)]
    for t in threads:
        t.start()
    kills = 0
    try:
        for _ in range(4):
            time.sleep(3)
            server.proc.kill()
            server.proc.wait(10)
            server.start(server.port)
            kills += 1
        time.sleep(3)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    late = writer.counters["late_write_failures"]
    print(f"\nkills {kills}, {counts}, late write failures {late}")
    assert counts["wrong"] == 0
    assert counts["hits"] > 1000  # the reader read, and found pages
    assert counts["stored"] * 4096 > 4 * 8 * (1 << 20)  # the pool overfilled several times
    writer.close()
    reader.close()
