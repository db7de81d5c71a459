"""LMCache 0.5.6's shipped `MaruBackend`, unmodified, over our `maru` and `maru_lmcache`.

LMCache's real engine (`LMCacheEngineBuilder`, Maru as the only backend) in separate processes
against a real `maru-server`. The one stand-in is the GPU connector (`CpuKVConnector` in
tests/lmcache_cpu/engine.py): LMCache's real ones are CUDA kernels; it does their gather and
scatter between a paged KV cache and LMCache's memory objects on CPU. Nothing here patches
LMCache or maru. Needs LMCache (`make install`, scripts/install_lmcache_cpu.sh); skipped
without it.
"""

from __future__ import annotations

import gc
import logging
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.lmcache
TESTS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TESTS))

pytest.importorskip("lmcache")

import torch  # noqa: E402

from lmcache_cpu import engine as E  # noqa: E402
from lmcache_cpu import workers as W  # noqa: E402
from maru import MaruHandler  # noqa: E402
from maru.common.protocol import MsgType  # noqa: E402
from maru_lmcache import CxlMemoryAdapter  # noqa: E402

from .workers import run_processes  # noqa: E402

G = E.GEOMETRY
PROMPT = 3 * G.chunk + 5  # three full chunks and a partial one of 5 tokens
SLOTS = 128
DEADLINE = 180


keep_start_method = E.keep_start_method  # autouse (tests/lmcache_cpu/engine.py)


@pytest.fixture
def same_hash_seed(monkeypatch):
    """LMCache hashes chunks with Python's hash() when vLLM is absent: spawned processes
    need one PYTHONHASHSEED to derive the same keys (as a deployment does)."""
    monkeypatch.setenv("PYTHONHASHSEED", "0")


@pytest.mark.parametrize("async_loading", [False, True], ids=["sync", "async_loading"])
def test_prompt_stored_by_one_engine_is_retrieved_by_another(
    maru_server_factory, same_hash_seed, async_loading
):
    server = maru_server_factory(pool_size="256M")
    (a,) = run_processes([(W.store_prompt, (server.url, PROMPT, 7, SLOTS))], DEADLINE)
    assert len(a["keys"]) == 4

    # What the store holds: every chunk once, the partial one with its true size.
    with MaruHandler(server_url=server.url, pool_size="4M") as h:
        infos = h.batch_retrieve(a["keys"])
        assert [i.length for i in infos] == [G.chunk_bytes] * 3 + [5 * G.token_bytes]
        assert {i.region_id for i in infos}.isdisjoint(h.owned_region_ids())

    (b,) = run_processes(
        [(W.retrieve_prompt, (server.url, PROMPT, 7, SLOTS, async_loading))], DEADLINE
    )
    assert b["keys"] == a["keys"]
    assert b["lookup"] == PROMPT
    assert b["retrieved"] == PROMPT
    assert b["chunks_same"] == [True] * 4  # byte for byte, in B's own slots
    assert b["nonzero"]
    if async_loading:
        # LMCache's async prefetch pins the keys on the server and never unpins them; the
        # pins end when its MaruBackend closes (DISCONNECT), not at the server's reaping.
        assert b["delete_while_open"] == [False] * 4
        assert b["delete_after_close"] == [True] * 4


def test_backend_methods_across_processes(maru_server_factory):
    server = maru_server_factory(pool_size="256M")
    (a,) = run_processes([(W.backend_puts, (server.url, 3))], DEADLINE)
    assert a["done"] == a["keys"]  # on_complete_callback once per stored key, in order
    assert a["put_tasks_left"] == 0
    assert a["sizes"] == [G.chunk_bytes, G.chunk_bytes, 5 * G.token_bytes, G.token_bytes]
    assert a["dup_done"] == 1  # a duplicate put succeeds: the key is stored (first value)
    assert a["dup_chunks_back"] and a["no_double_free"]
    d0, d1, d2, d3 = a["digests"]

    (b,) = run_processes([(W.backend_gets, (server.url, 3))], DEADLINE)
    assert b["contains"] == [True, False]
    assert b["batched_contains"] == 2  # prefix up to the first miss
    assert b["batched_contains_all"] == 4
    assert b["get_blocking"] == [d0, [2, G.layers, G.chunk, G.hidden], 2]  # first value kept
    assert b["get_blocking_missing"]
    assert b["batched_get_blocking"] == [d0, None, d2, d3]
    assert b["batched_tokens"] == [G.chunk, None, 5, 1]
    assert b["foreign_region"]  # read in place, in the writer's region
    assert b["async_contains"] == 3
    assert b["non_blocking"] == [d0, d1, d2]
    assert b["non_blocking_pinned"] == [True] * 3
    assert b["pin"] == [True, False]
    assert b["remove_pinned"] is False
    assert b["unpin"] == [True, False]
    assert b["remove_still_pinned"] is False  # the async lookup's pin still holds it
    assert b["remove"] is True
    assert b["after_remove"] == [False, True]
    assert b["remove_missing"] is False


def _stored_prompt(url: str, chunks: int, seed: int) -> tuple[list[int], list[str]]:
    """A prompt of full chunks stored by one engine (closed after): its tokens and keys."""
    n = chunks * G.chunk
    tokens = E.prompt(n, seed)
    with E.Engine(E.config(url), E.metadata()) as a:
        a.engine.store(tokens, kvcaches=E.kv_caches(n, seed=seed), slot_mapping=torch.arange(n))
        W._wait_for(lambda: not a.backend.put_tasks, "puts finished")
        keys = E.key_strings(a.engine, tokens)
    assert len(keys) == chunks
    return tokens, keys


def test_a_pinned_lookup_over_a_gap_pins_only_what_lookup_unpin_lets_go(maru_server_factory):
    """LMCache's pinned lookup counts the leading hits and `lookup_unpin` unpins just those:
    the chunks after a missing one must not be pinned (before, they were, for the engine's
    whole life, again at every lookup: never evicted nor deleted, the pool filling up)."""
    server = maru_server_factory(pool_size="64M")
    tokens, keys = _stored_prompt(server.url, 4, 13)
    with MaruHandler(server_url=server.url, pool_size="4M") as h:
        assert h.batch_delete([keys[1]]) == [True]  # the gap
        with E.Engine(E.config(server.url), E.metadata()) as b:
            iid = b.backend._handler.instance_id
            for lookup_id in ("req-1", "req-2"):
                assert b.engine.lookup(tokens, lookup_id=lookup_id, pin=True) == G.chunk
            assert h.stats()["instances"][iid]["pins"] == 2  # keys[0], once per lookup
            assert h.batch_delete([keys[0]]) == [False]  # held while the lookups are on
            b.engine.lookup_unpin("req-1")
            b.engine.lookup_unpin("req-2")
            assert h.stats()["instances"][iid]["pins"] == 0
            # B still open: every chunk can go (before the fix: keys[2:] stayed pinned)
            assert h.batch_delete([keys[0], keys[2], keys[3]]) == [True] * 3


def test_an_unpin_after_the_instance_lost_its_pins_is_a_warning(maru_server_factory, caplog):
    """A pin is what keeps a zero-copy view's bytes in place; an instance that is reaped (or
    disconnected) loses its pins. LMCache's `lookup_unpin` ignores the results: Maru logs it."""
    server = maru_server_factory(pool_size="64M")
    tokens, keys = _stored_prompt(server.url, 2, 17)
    with E.Engine(E.config(server.url), E.metadata()) as b:
        handler = b.backend._handler
        assert b.engine.lookup(tokens, lookup_id="req-1", pin=True) == 2 * G.chunk
        handler._request(MsgType.DISCONNECT, {}).result()  # its end, as the server's reaping
        with caplog.at_level(logging.WARNING, logger="maru.client.handler"):
            b.engine.lookup_unpin("req-1")
        warned = [r for r in caplog.records if "found no pin of ours" in r.getMessage()]
        # (LMCache's storage manager unpins key by key: one warning each)
        assert [r.levelno for r in warned] == [logging.WARNING] * 2
        assert all("unpin of 1 of 1 keys" in r.getMessage() for r in warned)
    with MaruHandler(server_url=server.url, pool_size="4M") as h:
        assert h.batch_delete(keys) == [True, True]


def test_a_store_that_could_not_be_sent_gives_its_chunks_back(maru_server_factory):
    """The shipped backend hands each memory object's chunks to the store (`create_store_handle`)
    and, when `batch_store` reports a key failed, only drops its reference: Maru must give the
    chunks back itself. A registration that never reached the server (down for a moment) kept
    them reserved for the instance's whole life: it resumes with the same regions after the
    restart, and each failed chunk was lost to it (before: 4 of 4 here)."""
    server = maru_server_factory(pool_size="64M")
    cfg = E.config(server.url)
    cfg.extra_config["maru_timeout_ms"] = 1000  # (the failed send is this long)
    n = 4 * G.chunk
    with E.Engine(cfg, E.metadata()) as built:
        engine, backend = built.engine, built.backend
        handler = backend._handler
        first = E.prompt(n, 21)
        engine.store(first, kvcaches=E.kv_caches(n, seed=21), slot_mapping=torch.arange(n))
        W._wait_for(lambda: not backend.put_tasks, "puts finished")
        gc.collect()
        free = handler.free_chunks()
        instance = handler.instance_id

        server.halt()  # (SIGTERM: pool and state kept)
        tokens, caches = E.prompt(n, 22), E.kv_caches(n, seed=22)
        engine.store(tokens, kvcaches=caches, slot_mapping=torch.arange(n))
        W._wait_for(lambda: not backend.put_tasks, "failed puts finished", 30)
        gc.collect()
        assert handler.free_chunks() == free  # the 4 reservations came back

        server.start(server.port)
        W._wait_for(handler.healthcheck, "server back", 30)
        assert handler.instance_id == instance  # the same instance, with the same regions
        assert handler.free_chunks() == free
        assert engine.lookup(tokens) == 0  # nothing of the failed store is a hit
        engine.store(tokens, kvcaches=caches, slot_mapping=torch.arange(n))
        W._wait_for(lambda: engine.lookup(tokens) == n, "stored again")
        gc.collect()
        assert handler.free_chunks() == free - 4
        out = E.kv_caches(n)
        mask = engine.retrieve(tokens, kvcaches=out, slot_mapping=torch.arange(n))
        assert int(mask.sum()) == n
        assert E.same_bits(E.gathered(out, torch.arange(n)), E.gathered(caches, torch.arange(n)))


# -- the adapter on its own, in this process ------------------------------------------------------


def _adapter(h: MaruHandler) -> CxlMemoryAdapter:
    meta = E.metadata()
    return CxlMemoryAdapter(
        handler=h,
        shapes=meta.get_shapes(),
        dtypes=meta.get_dtypes(),
        fmt=E.FMT,
        chunk_size=h.get_chunk_size(),
    )


def _shapes(tokens: int):
    return E.metadata().get_shapes(tokens), E.metadata().get_dtypes()


def test_memory_objects_are_views_of_pool_pages(maru_server):
    with MaruHandler(
        server_url=maru_server.url, pool_size="4M", chunk_size_bytes=G.chunk_bytes
    ) as h:
        adapter = _adapter(h)
        full = adapter.allocate(*_shapes(G.chunk), E.FMT)
        part = adapter.allocate(*_shapes(5), E.FMT)
        assert full.get_size() == G.chunk_bytes and part.get_size() == 5 * G.token_bytes
        assert part.get_num_tokens() == 5 and full.get_num_tokens() == G.chunk
        region, page = CxlMemoryAdapter.decode_address(part.meta.address)
        assert region in h.owned_region_ids()
        part.tensor.fill_(1.5)  # written through the tensor, seen in the shared mapping
        view = h.get_buffer_view(region, page * G.chunk_bytes, part.get_size())
        assert bytes(view) == part.tensor.contiguous().view(torch.uint8).numpy().tobytes()
        assert torch.frombuffer(view, dtype=torch.uint8).data_ptr() == part.tensor.data_ptr()
        # published with its true size; read back as a view of the same bytes
        assert h.store("k-part", adapter.create_store_handle(part))
        info = h.retrieve("k-part")
        back = adapter.get_by_location(info.region_id, info.page_index, info.length, G.token_bytes)
        assert back.get_num_tokens() == 5 and back.tensor.data_ptr() == part.tensor.data_ptr()
        assert torch.equal(back.tensor, part.tensor)
        adapter.close()
        assert adapter.allocate(*_shapes(G.chunk), E.FMT) is None


def test_pool_full_allocate_returns_none_and_keeps_nothing(maru_server_factory):
    server = maru_server_factory(pool_size="8M")
    with MaruHandler(server_url=server.url, pool_size="4M", chunk_size_bytes=G.chunk_bytes) as h:
        adapter = _adapter(h)
        held = []
        for _ in range((8 << 20) // G.chunk_bytes + 1):
            obj = adapter.allocate(*_shapes(G.chunk), E.FMT)
            if obj is None:
                break
            held.append(obj)
        else:
            pytest.fail("a pool of 8 MiB never ran out")
        assert held
        free = h.free_chunks()
        assert adapter.batched_allocate(*_shapes(G.chunk), 4, E.FMT) is None
        assert h.free_chunks() == free  # a batch that does not fit keeps nothing
        held.pop().ref_count_down()  # the last reference: its chunk comes back
        assert h.free_chunks() == free + 1
        assert adapter.allocate(*_shapes(G.chunk), E.FMT) is not None


def test_reservation_chunks_change_hands_once(maru_server):
    with MaruHandler(
        server_url=maru_server.url, pool_size="4M", chunk_size_bytes=G.chunk_bytes
    ) as h:
        adapter = _adapter(h)
        assert h.free_chunks() == 0  # no region before the first allocation takes one
        objs = adapter.batched_allocate(*_shapes(G.chunk), 3, E.FMT)
        free = h.free_chunks() + 3  # the first region's chunks
        dropped, stored, duplicate = objs
        dropped.ref_count_down()  # never published: back to the free list, object invalid
        assert h.free_chunks() == free - 2 and not dropped.is_valid()
        adapter.free(dropped)  # a second free is a no-op
        assert h.free_chunks() == free - 2
        assert h.store("k", adapter.create_store_handle(stored))
        with pytest.raises(ValueError):
            adapter.create_store_handle(stored)  # the same chunks under a second key: never
        stored.ref_count_down()
        del stored
        gc.collect()
        assert h.free_chunks() == free - 2  # published: the store owns the chunk now
        assert h.store("k", adapter.create_store_handle(duplicate))  # first writer won
        assert h.free_chunks() == free - 1  # ...and the duplicate's chunk came back, once
        duplicate.ref_count_down()
        del duplicate
        gc.collect()
        assert h.free_chunks() == free - 1
        info = h.retrieve("k")
        view = adapter.get_by_location(info.region_id, info.page_index, info.length, G.token_bytes)
        with pytest.raises(ValueError):
            adapter.create_store_handle(view)  # a view of a stored value is not a reservation


def test_get_by_location_misses_rather_than_other_bytes(maru_server):
    with MaruHandler(
        server_url=maru_server.url, pool_size="4M", chunk_size_bytes=G.chunk_bytes
    ) as h:
        adapter = _adapter(h)
        assert h.store("first", b"x" * G.token_bytes)  # takes the instance's first region
        region = h.owned_region_ids()[0]
        pages = h.get_region_page_count(region)
        tb = G.token_bytes
        assert adapter.get_by_location(region, 0, 3 * tb, tb) is not None
        assert adapter.get_by_location(region, 0, 3 * tb + 2, tb) is None  # not whole tokens
        assert adapter.get_by_location(region, 0, G.chunk_bytes + tb, tb) is None  # > a chunk
        assert adapter.get_by_location(region, 0, 0, tb) is None
        assert adapter.get_by_location(region, pages, tb, tb) is None  # past the region
        assert adapter.get_by_location(10**6, 0, tb, tb) is None  # not mapped here


def test_engine_store_with_the_pool_full_stores_a_prefix(maru_server_factory):
    server = maru_server_factory(pool_size="8M")
    n = (8 << 20) // G.chunk_bytes * G.chunk + 3 * G.chunk  # more chunks than the pool holds
    with E.Engine(E.config(server.url, pool_bytes=4 << 20), E.metadata()) as built:
        tokens = E.prompt(n, 11)
        caches = E.kv_caches(n, seed=11)
        built.engine.store(tokens, kvcaches=caches, slot_mapping=torch.arange(n))
        W._wait_for(lambda: not built.backend.put_tasks, "puts finished")
        stored = built.engine.lookup(tokens)
        assert 0 < stored < n and stored % G.chunk == 0
        out = E.kv_caches(n)
        mask = built.engine.retrieve(tokens, kvcaches=out, slot_mapping=torch.arange(n))
        assert int(mask.sum()) == stored
        assert E.same_bits(
            E.gathered(out, torch.arange(stored)), E.gathered(caches, torch.arange(stored))
        )


def test_a_shape_without_the_token_dimension_is_a_clear_value_error():
    """Not a bare IndexError from deep inside: the shape and the format are named."""
    h = MaruHandler(server_url="tcp://127.0.0.1:1", auto_connect=False)
    try:
        with pytest.raises(ValueError, match=r"shape \[\(2, 8\)\] has no token dimension 2 of"):
            CxlMemoryAdapter(
                handler=h,
                shapes=[torch.Size([2, 8])],
                dtypes=[torch.bfloat16],
                fmt=E.FMT,
                chunk_size=4096,
            )
    finally:
        h.close()


def test_an_adapter_over_a_closed_handler_allocates_nothing_and_raises_nothing(maru_server):
    """The handler raises "Not connected" once closed (as the original's does); the adapter
    keeps its promise to LMCache: no room is None, never an exception."""
    h = MaruHandler(server_url=maru_server.url, pool_size="4M", chunk_size_bytes=G.chunk_bytes)
    adapter = _adapter(h)
    assert adapter.allocate(*_shapes(G.chunk), E.FMT) is not None
    h.close()
    assert adapter.allocate(*_shapes(G.chunk), E.FMT) is None
    assert adapter.batched_allocate(*_shapes(G.chunk), 3, E.FMT) is None
