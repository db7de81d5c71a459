"""Red-team checks of the first rule on SGLang's storage path (a hit is the bytes written
under that key, or a miss), for two attacks the other SGLang tests leave open:

* the legacy interface (`interface_v1` off, `legacy.py`) mixed with v1 users of the same keys
  on one server: a page is found through either interface only by an instance of the same
  page format; `page_first` and `page_first_direct` pages are as long but order their bytes
  differently, so each must miss the other's pages through both interfaces;
* write-behind (`maru_use_async_rpc`, the default) under back-pressure (`maru_max_inflight`)
  while the server is stopped (SIGSTOP): every call times out on its predecessor's
  registration, and SGLang refills the same host pages with other keys' bytes right after
  each call returns; once the server runs again every page a reader loads is its own key's
  bytes, and the late registrations did land.

SGLang's real MHA host pools on CPU, a real `maru-server`, no SGLang server.
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal

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


def _storage(url: str, g: Geometry, **extra) -> MaruStorage:
    config = {**MARU_BACKEND, "maru_server_url": url, "maru_pool_size": "32M", **extra}
    storage = MaruStorage(storage_config(extra=config), {})
    storage.register_mem_pool_host(make_host_pool(g))
    return storage


def _page_of(key: str, page_bytes: int) -> bytes:
    """A page's bytes made from its key (another key's page never matches)."""
    digest = hashlib.blake2b(key.encode(), digest_size=64).digest()
    return (digest * (page_bytes // 64 + 1))[:page_bytes]


def test_legacy_and_v1_users_share_pages_only_within_one_page_format(maru_server):
    """Instance A (`page_first_direct`) stores pages through the legacy interface and
    through v1; instance B (`page_first`, pages of the same length in another byte order)
    stores other bytes under the same keys. Each instance reads back, through both
    interfaces, exactly its own bytes: the legacy interface keys pages in the instance's
    namespace as v1 does. Fails if `legacy.py` stored or looked up keys without the pool's
    prefix (e.g. `Put(keys, ...)` instead of `kv.keys(keys)` and `prefix=""` in
    `batch_get`): B's legacy read would then load A's `page_first_direct` bytes into its
    `page_first` pool as a hit."""
    a = _storage(maru_server.url, Geometry())
    b = _storage(maru_server.url, Geometry(layout="page_first"))
    assert a._kv.page_bytes == b._kv.page_bytes and a.namespace != b.namespace
    pa, pb = a.mem_pool_host, b.mem_pool_host
    legacy, v1 = ["legacy-0", "legacy-1"], ["v1-0", "v1-1"]
    keys = legacy + v1
    src = page_indices(0, 2, 4)
    dst = page_indices(8, 4, 4)

    def store(storage, pool, seed: int) -> dict[str, torch.Tensor]:
        pages = expected_pages(pool, 4, seed=seed)
        assert storage.batch_set(legacy, pages[:2])
        fill(pool, src, pages[2:])
        assert storage.batch_set_v1(v1, src) == [True, True]
        assert storage.confirm_writes() == 0
        return dict(zip(keys, pages))

    want_a = store(a, pa, seed=1)
    # B's legacy reads of A's keys, before B stored anything under them: all misses
    dummies = [pb.get_dummy_flat_data_page() for _ in keys]
    assert b.batch_get(keys, dummies) == [None] * 4
    assert b.batch_get_v1(keys, dst) == [False] * 4
    assert b.batch_exists(keys) == 0 and not b.exists("legacy-0")
    want_b = store(b, pb, seed=2)

    for storage, pool, want in ((a, pa, want_a), (b, pb, want_b)):
        got = storage.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
        assert all(t is not None and torch.equal(t, want[k]) for k, t in zip(keys, got))
        assert storage.batch_get_v1(keys, dst) == [True] * 4
        loaded = read(pool, dst, 4)
        assert all(torch.equal(page, want[k]) for k, page in zip(keys, loaded))
    a.close()
    b.close()


def test_write_behind_against_a_stopped_server_under_back_pressure_loads_only_own_bytes(
    maru_server, caplog
):
    """`maru_max_inflight` 2 and a 400 ms timeout; the server stopped (SIGSTOP). Six
    `batch_set_v1` calls of 4 keys each reuse host pages 0-3, refilled with the next keys'
    bytes as soon as a call returns (SGLang frees backed-up host pages). Each call returns
    [True] * 4 (write-behind) after timing out on its predecessor's registration, whose
    outcome is then unknown. The server resumes; three more calls reuse the same host pages.
    A second instance loads every key: every hit is its own key's bytes, and all 36 are
    hits (the late registrations landed on the chunks the writer kept for them). Fails if a
    registration whose reply timed out gave its chunks back (`Sealing.wait` taking every
    `MaruError` as a refusal): the later calls reuse those chunks, the server then seals the
    old keys onto them, and the reader loads the newer keys' bytes under the old keys."""
    g = Geometry()
    writer = _storage(maru_server.url, g, maru_max_inflight="2", maru_timeout_ms="400")
    reader = _storage(maru_server.url, g)
    pool, page_bytes = writer.mem_pool_host, writer._kv.page_bytes
    src = page_indices(0, 4, g.page_size)
    caplog.set_level(logging.CRITICAL, logger="maru")  # (the timeouts are expected)

    def put(keys: list[str]) -> list[bool]:
        for i, key in enumerate(keys):
            page = torch.frombuffer(bytearray(_page_of(key, page_bytes)), dtype=torch.uint8)
            pool.set_from_flat_data_page(int(src[i * g.page_size]), page.view(pool.dtype))
        return writer.batch_set_v1(keys, src)

    assert put([f"warm-{i}" for i in range(4)]) == [True] * 4
    assert writer.confirm_writes() == 0
    written: list[str] = []
    os.kill(maru_server.pid, signal.SIGSTOP)
    try:
        for call in range(6):
            keys = [f"stopped-{call}-{i}" for i in range(4)]
            assert put(keys) == [True] * 4
            written += keys
    finally:
        os.kill(maru_server.pid, signal.SIGCONT)
    writer.confirm_writes()  # (the last call's outcome: unknown or stored)
    for call in range(3):
        keys = [f"resumed-{call}-{i}" for i in range(4)]
        assert put(keys) == [True] * 4
        written += keys
    writer.confirm_writes()

    dst = page_indices(8, 4, g.page_size)
    hits, wrong = 0, []
    for first in range(0, len(written), 4):
        keys = written[first : first + 4]
        results = reader.batch_get_v1(keys, dst)
        for i, (key, hit) in enumerate(zip(keys, results)):
            if hit:
                hits += 1
                got = pool_bytes(reader.mem_pool_host, int(dst[i * g.page_size]))
                if got != _page_of(key, page_bytes):
                    wrong.append(key)
    assert wrong == []
    assert hits == len(written) == 36
    writer.close()
    reader.close()


def pool_bytes(pool, index: int) -> bytes:
    """The host page at token index `index`, as bytes."""
    return pool.get_data_page(index, flat=True).view(torch.uint8).numpy().tobytes()


class _NoBufferPool:
    """A real host pool seen without its `kv_buffer` attribute (None, as SGLang's logical
    pools have) while it still describes pages with bytes."""

    kv_buffer = None

    def __init__(self, pool):
        self._pool = pool

    def __getattr__(self, name):
        return getattr(self._pool, name)


def test_a_pool_without_kv_buffer_but_with_page_bytes_is_refused(maru_server):
    """`kv_buffer` None marks a logical pool, stored under no namespace (it stores nothing).
    A pool that says so but describes pages with bytes would store them under no model,
    dtype or geometry: every model's pages under one key. Refused at registration."""
    config = {**MARU_BACKEND, "maru_server_url": maru_server.url, "maru_pool_size": "32M"}
    storage = MaruStorage(storage_config(extra=config), {})
    try:
        with pytest.raises(ValueError, match="no kv_buffer"):
            storage.register_mem_pool_host(_NoBufferPool(make_host_pool(Geometry())))
    finally:
        storage.close()
