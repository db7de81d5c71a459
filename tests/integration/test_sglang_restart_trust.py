"""`MaruStorage` (SGLang's HiCache L3) across evictions and `maru-server` restarts: a page
`batch_get_v1` reports True holds the bytes written under its key, or it is a miss; never
another instance's bytes.

SGLang's real host pools on CPU (MHA, MLA), a real `maru-server`. Between SGLang's
`batch_exists` and `batch_get_v1` (its prefetch gap), during a `batch_get_v1` copy and during a
write-behind `batch_set_v1` (its chunks reserved, its registration not yet confirmed), the keys
are deleted or evicted, or the server is SIGKILLed and started again with the same
arguments (restored from its state dir, or `--no-restore`: a new pool generation); another
instance then writes values of its own (every byte 0xEE) into the pages the old keys lay in.
Every host-pool page reported loaded is compared byte for byte with what was written.
"""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.sglang

import sglang_cpu  # noqa: E402

sglang_cpu.require()

import torch  # noqa: E402

import maru.client.handler as handler_module  # noqa: E402
import maru.client.writes as writes_module  # noqa: E402
from maru_sglang.maru_storage import MaruStorage  # noqa: E402
from pool_places import OtherInstance  # noqa: E402
from pool_places import places as pool_places  # noqa: E402
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

POOL = 8 << 20  # the server's pool: small, so that another instance's writes evict ours
N = 8  # pages per prompt
GEOMETRIES = [Geometry(attn="mha"), Geometry(attn="mla")]


def _ids(g: Geometry) -> str:
    return g.attn


def _storage(url: str, g: Geometry, **extra: Any) -> MaruStorage:
    """A MaruStorage over a real host pool, as SGLang's factory makes one."""
    cfg = {**MARU_BACKEND, "maru_server_url": url, "maru_pool_size": "2M", **extra}
    storage = MaruStorage(storage_config(is_mla=g.attn == "mla", extra=cfg), {})
    storage.register_mem_pool_host(make_host_pool(g))
    return storage


def _write(storage: MaruStorage, keys: list[str], seed: int) -> list[torch.Tensor]:
    """Fill host pages 0.. with random pages and `batch_set_v1` them (write-behind, then
    confirmed); the pages written."""
    pool = storage.mem_pool_host
    src = page_indices(0, len(keys), pool.page_size)
    pages = expected_pages(pool, len(keys), seed=seed)
    fill(pool, src, pages)
    assert storage.batch_set_v1(keys, src) == [True] * len(keys)
    assert storage.confirm_writes() == 0
    return pages


def _get(storage: MaruStorage, keys: list[str], expected: list[torch.Tensor]) -> list[bool]:
    """`batch_get_v1` into host pages 32.. (zeroed first); every page reported True must hold
    exactly its key's written bytes (asserted here); the results."""
    pool = storage.mem_pool_host
    dst = page_indices(32, len(keys), pool.page_size)
    zero = torch.zeros_like(pool.get_dummy_flat_data_page())
    fill(pool, dst, [zero] * len(keys))
    got = storage.batch_get_v1(keys, dst)
    loaded = read(pool, dst, len(keys))
    wrong = [
        k for k, hit, a, b in zip(keys, got, loaded, expected) if hit and not torch.equal(a, b)
    ]
    assert wrong == [], f"reported loaded with other bytes: {wrong}"
    return got


def _where(storage: MaruStorage, keys: list[str]) -> list[tuple[str, int] | None]:
    """Where each key's page lies in the pool file (path, offset); None for a miss."""
    return pool_places(storage.handler, storage._kv.keys(keys))


def _other(url: str, storage: MaruStorage) -> OtherInstance:
    """Another instance writing values of one page's size, one chunk per page as MaruStorage's."""
    return OtherInstance(url, storage._kv.page_bytes, storage.handler.get_chunk_size())


# -- 1. evicted or deleted in SGLang's prefetch gap ------------------------------------------


@pytest.mark.parametrize("index", [True, False], ids=["local_index", "requests"])
@pytest.mark.parametrize("g", GEOMETRIES, ids=_ids)
def test_pages_evicted_or_deleted_between_exists_and_get_are_misses(maru_server_factory, g, index):
    """Writer A stored 8 pages; reader B's `batch_exists` counted all 8. Before B's
    `batch_get_v1`, pages 4.. are deleted and another instance fills the pool until the server
    evicted the rest and every page the 8 lay in holds its bytes. B's get reports all 8 False
    (none True with 0xEE). Written again, B loads all 8 with their own bytes: nothing of B's
    turned the misses into anything. `requests`: no local index (leased lookups)."""
    server = maru_server_factory(pool_size="8M")
    a = _storage(server.url, g)
    b = _storage(server.url, g, maru_local_index=index)
    other = _other(server.url, a)
    try:
        keys = [f"gap-{i}" for i in range(N)]
        pages = _write(a, keys, seed=1)
        places = _where(a, keys)
        a.close()  # (its region goes back: the other instance may get it)
        assert b.batch_exists(keys) == N
        assert b.handler.reads_locally == index
        assert b.handler.batch_delete(b._kv.keys(keys[4:])) == [True] * 4
        rewritten = other.write(places, 4 * POOL // other.size, "gap")
        assert rewritten == [True] * N  # every old page holds the other's bytes
        assert b.handler.batch_exists(b._kv.keys(keys)) == [False] * N
        assert _get(b, keys, pages) == [False] * N
        assert other.wrong() == []
        a = _storage(server.url, g)
        again = _write(a, keys, seed=1)
        assert b.batch_exists(keys) == N
        assert _get(b, keys, again) == [True] * N
    finally:
        other.close()
        a.close()
        b.close()


# -- 2. a restart in the gap, during a get's copy, during a write-behind set -----------------


@pytest.mark.parametrize("in_pool", [False, True], ids=["shm_index", "in_pool_index"])
@pytest.mark.parametrize("no_restore", [False, True], ids=["restored", "no_restore"])
@pytest.mark.parametrize("g", GEOMETRIES, ids=_ids)
def test_a_restart_between_exists_and_get_loads_only_own_bytes(
    maru_server_factory, g, no_restore, in_pool
):
    """B counted A's 8 pages (through the local index); the server is SIGKILLed and started
    again, and another instance writes until the old pages hold its bytes (a new generation)
    or 512 values (restored). B's get loads each page with its own bytes or reports it False:
    restored, all 8 (the keys were restored); a new generation, none (every old key is gone),
    also in `batch_exists`. `in_pool_index`: the server's index in the pool (`--index-slots`),
    not in /dev/shm."""
    extra = ["--index-slots", "auto"] if in_pool else []
    server = maru_server_factory(pool_size="8M", extra_args=extra)
    a = _storage(server.url, g)
    b = _storage(server.url, g)
    try:
        keys = [f"restart-gap-{i}" for i in range(N)]
        pages = _write(a, keys, seed=2)
        places = _where(a, keys)
        assert b.batch_exists(keys) == N
        assert b.handler.reads_locally
        server.kill_and_start(no_restore)
        other = _other(server.url, a)
        try:
            rewritten = other.write(places if no_restore else [None], 512, "gap")
            if no_restore:
                assert rewritten == [True] * N  # the new pool's pages where the old lay
            got = _get(b, keys, pages)
            assert got == [not no_restore] * N
            assert b.batch_exists(keys) == (0 if no_restore else N)
            assert other.wrong() == []
        finally:
            other.close()
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("no_restore", [False, True], ids=["restored", "no_restore"])
@pytest.mark.parametrize("g", GEOMETRIES, ids=_ids)
def test_a_restart_during_a_gets_copy_is_a_miss(maru_server_factory, g, no_restore, monkeypatch):
    """B (no local index: a leased lookup, then the copy) is in the middle of `batch_get_v1`:
    its lookup answered and leased, the server SIGKILLed and started again before the copy.
    The lease ended with the restart, so another instance may delete the 8 keys (restored:
    no lease holds them now) and fill the pool until every page they lay in holds its bytes,
    all before B's copy reads them. Every page is reported False, whatever the copy read
    (restored: the other's bytes; a new generation: the old pool's, which B still maps), and
    the next get too (the keys are gone)."""
    server = maru_server_factory(pool_size="8M")
    a = _storage(server.url, g)
    b = _storage(server.url, g, maru_local_index=False)
    other = None
    try:
        keys = [f"restart-copy-{i}" for i in range(N)]
        pages = _write(a, keys, seed=3)
        places = _where(a, keys)
        a.close()  # (its region goes back: the other instance may get it)
        real = handler_module.copy_values
        seen: dict[str, Any] = {}

        def copy_values(*args: Any, **kwargs: Any) -> Any:
            nonlocal other
            if not seen:  # (the lookup is answered, its lease taken: the copy begins)
                server.kill_and_start(no_restore)
                other = _other(server.url, b)
                seen["deleted"] = other.h.batch_delete(b._kv.keys(keys))
                seen["rewritten"] = other.write(places, 4 * POOL // other.size, "copy")
            return real(*args, **kwargs)

        monkeypatch.setattr(handler_module, "copy_values", copy_values)
        assert b.batch_exists(keys) == N
        assert _get(b, keys, pages) == [False] * N
        assert seen["rewritten"] == [True] * N, seen
        assert seen["deleted"] == [not no_restore] * N  # (a new generation: gone already)
        assert _get(b, keys, pages) == [False] * N
        assert other is not None and other.wrong() == []
    finally:
        if other is not None:
            other.close()
        a.close()
        b.close()


@pytest.mark.parametrize("no_restore", [False, True], ids=["restored", "no_restore"])
@pytest.mark.parametrize("g", GEOMETRIES, ids=_ids)
def test_a_restart_during_a_write_behind_set_registers_only_its_own_bytes(
    maru_server_factory, g, no_restore, monkeypatch
):
    """A's write-behind `batch_set_v1`: its chunks reserved, the server SIGKILLed and started
    again as the copy begins, another instance writes into the pool (in a new generation,
    from the place A's region lay), then the copy and the registration go on. Restored, the
    pages are registered and B loads them with A's bytes; a new generation, none is (refused
    at the seal if A's heartbeat met the new server first, else counted as a late write
    failure): B reports all False, and the other instance's values keep their bytes. Written
    again, every page loads whole."""
    server = maru_server_factory(pool_size="8M")
    a = _storage(server.url, g)
    b = _storage(server.url, g)
    other = None
    try:
        _write(a, ["warm"], seed=4)  # (A holds a region now: the next set's chunks are in it)
        keys = [f"restart-set-{i}" for i in range(N)]
        pool = a.mem_pool_host
        src = page_indices(0, N, pool.page_size)
        pages = expected_pages(pool, N, seed=5)
        fill(pool, src, pages)
        real = writes_module._c_copy_values_start
        armed = [True]

        def start(*args: Any) -> Any:
            nonlocal other
            if armed[0]:  # (the chunks are reserved: the copy begins)
                armed[0] = False
                server.kill_and_start(no_restore)
                other = _other(server.url, a)
                other.write([None], 512, "set")
            return real(*args)

        monkeypatch.setattr(writes_module, "_c_copy_values_start", start)
        sent = a.batch_set_v1(keys, src)  # (write-behind: True per page sent)
        assert not armed[0]
        monkeypatch.undo()
        lost = a.confirm_writes()
        assert a.counters["late_write_failures"] == lost
        got = _get(b, keys, pages)
        assert sum(got) == sum(sent) - lost  # a page sent and not lost is registered
        # restored: the region and the keys are known again; a new generation: the chunks
        # lay in the old pool, so none is registered (refused at once, or counted lost)
        assert got == [not no_restore] * N, (sent, lost)
        assert other is not None and other.wrong() == []
        again = _write(a, keys, seed=5)
        assert _get(b, keys, again) == [True] * N
        assert other.wrong() == []
    finally:
        if other is not None:
            other.close()
        a.close()
        b.close()


# -- 3. a new pool generation under running instances -----------------------------------------


@pytest.mark.parametrize("g", GEOMETRIES, ids=_ids)
def test_a_new_generation_under_running_storages_misses_every_old_key(maru_server_factory, g):
    """A and B ran (A wrote 8 pages, B loaded them; A still holds free chunks of its region).
    The server restarts with `--no-restore` and another instance fills the new pool's pages
    where the old ones lay. A's next set, whose chunks come from the region it held (unless its
    heartbeat met the new server first), is never registered over the other's pages: each of
    its pages loads with A's bytes or is a miss, and the other's values keep their bytes.
    Every old key misses in both (`batch_exists`, `batch_get_v1`, the handler's own
    `batch_exists` on the new server's index). Nothing MaruStorage keeps
    (its KV pool, namespace, chunk size) turned a miss into a hit; after one more set
    every page loads whole, in B and in a fresh instance."""
    server = maru_server_factory(pool_size="8M")
    a = _storage(server.url, g)
    b = _storage(server.url, g)
    other = None
    try:
        keys = [f"gen-{i}" for i in range(N)]
        pages = _write(a, keys, seed=6)
        places = _where(a, keys)
        assert _get(b, keys, pages) == [True] * N
        kv, namespace, chunk = a._kv, a.namespace, a.handler.get_chunk_size()
        server.kill_and_start(no_restore=True)
        other = _other(server.url, a)
        assert other.write(places, 512, "gen") == [True] * N
        # A's first call since: a set whose chunks come from the region A held before (unless
        # its heartbeat met the new server first): refused, a miss, never the other's pages
        new = [f"gen-new-{i}" for i in range(N)]
        pool = a.mem_pool_host
        src = page_indices(0, N, pool.page_size)
        new_pages = expected_pages(pool, N, seed=7)
        fill(pool, src, new_pages)
        sent = a.batch_set_v1(new, src)  # (write-behind: True per page sent)
        lost = a.confirm_writes()
        assert sum(_get(b, new, new_pages)) == sum(sent) - lost
        assert other.wrong() == []
        for s in (a, b):
            assert s.batch_exists(keys) == 0
            assert _get(s, keys, pages) == [False] * N
            assert s.handler.batch_exists(s._kv.keys(keys)) == [False] * N
        assert (a._kv, a.namespace, a.handler.get_chunk_size()) == (kv, namespace, chunk)
        again = _write(a, new, seed=7)
        assert _get(b, new, again) == [True] * N
        fresh = _storage(server.url, g)
        try:
            assert fresh.batch_exists(keys) == 0
            assert _get(fresh, new, again) == [True] * N
        finally:
            fresh.close()
        assert other.wrong() == []
    finally:
        if other is not None:
            other.close()
        a.close()
        b.close()
