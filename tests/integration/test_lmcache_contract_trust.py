"""The first rule on LMCache's path: a hit through LMCache 0.5.6's shipped `MaruBackend` is the
bytes written under that key, or it is a miss, whatever a caller following its contract does.

What these tests prove, each against a real `maru-server` and LMCache's real engine or backend
(the one stand-in is the GPU connector, tests/lmcache_cpu/engine.py):

* a prompt pinned by an engine's lookup (vLLM's flow: `lookup(pin=True)`, `retrieve`,
  `lookup_unpin`) keeps its bytes while another process's engine `remove`s its keys and writes
  over every page it can get, until the retrieve has copied them;
* two lookups pinning one prompt hold it until both have let go (pins are counted);
* engines with other chunk sizes (tokens) share short prompts' keys: every hit is the bytes
  written, a value off the reader's chunk grid a miss; engines of one model name but other
  KV layouts (layers, KV width) miss each other's chunks;
* one key twice in one batched put keeps its first value and gives the second's chunk back
  once; one memory object under two keys in one batch is stored under neither;
* a value longer than one chunk is a miss for every get, never its first chunk;
* with the server gone, lookups and gets are misses and a put fails without registering.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.lmcache
TESTS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TESTS))

pytest.importorskip("lmcache")

import torch  # noqa: E402
from lmcache.utils import CacheEngineKey  # noqa: E402

from lmcache_cpu import engine as E  # noqa: E402
from lmcache_cpu import workers as W  # noqa: E402
from maru import MaruHandler  # noqa: E402

from .workers import SPAWN  # noqa: E402

G = E.GEOMETRY
DEADLINE = 120.0


keep_start_method = E.keep_start_method  # autouse (tests/lmcache_cpu/engine.py)


@pytest.fixture
def same_hash_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Spawned engines derive the same chunk keys (LMCache hashes with Python's hash())."""
    monkeypatch.setenv("PYTHONHASHSEED", "0")


class _HookedConnector(E.CpuKVConnector):
    """`CpuKVConnector` that calls `before_copy()` just before copying memory objects into
    the paged cache: the moment another instance's change would show in what is copied."""

    def __init__(self, before_copy: Callable[[], None], geometry: E.Geometry = G):
        super().__init__(geometry)
        self.before_copy = before_copy

    def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kwargs: Any) -> None:
        self.before_copy()
        super().batched_to_gpu(memory_objs, starts, ends, **kwargs)


def _key(i: int, salt: int = 1) -> CacheEngineKey:
    return CacheEngineKey("maru-tiny", 1, 0, salt * 1000 + i, torch.bfloat16)


def _full(backend: Any) -> Any:
    meta = E.metadata()
    return backend.allocate(meta.get_shapes(G.chunk), meta.get_dtypes(), E.FMT)


def _bytes(obj: Any) -> bytes:
    return obj.tensor.contiguous().view(torch.uint8).numpy().tobytes()


# -- pins against another process's removes and page reuse ------------------------------------


def test_a_pinned_retrieve_keeps_its_bytes_while_the_writer_removes_and_reuses_pages(
    maru_server_factory, same_hash_seed
):
    """vLLM's flow: the worker's lookup pins the prompt; between that and the copy in
    `retrieve`, the writer (another process) removes every chunk key and writes 0x7f over every
    chunk it can reserve. The removes are refused and the copy is the prompt's bytes."""
    server = maru_server_factory(pool_size="64M")
    n = 3 * G.chunk
    stored, go, done = SPAWN.Event(), SPAWN.Event(), SPAWN.Event()
    out_q = SPAWN.Queue()
    writer = SPAWN.Process(
        target=W._run_into,
        args=(W.remove_and_reuse_when_told, out_q, (server.url, n, 21, stored, go, done)),
        daemon=True,
    )
    writer.start()
    try:
        assert stored.wait(DEADLINE), "the writer never stored its prompt"

        def let_the_writer_go() -> None:
            go.set()
            assert done.wait(DEADLINE), "the writer never finished"

        tokens = E.prompt(n, 21)
        with E.Engine(E.config(server.url), E.metadata(), _HookedConnector(let_the_writer_go)) as b:
            assert b.engine.lookup(tokens, lookup_id="req-1", pin=True) == n
            out = E.kv_caches(n)
            mask = b.engine.retrieve(
                tokens, kvcaches=out, slot_mapping=torch.arange(n), req_id="req-1"
            )
            b.engine.lookup_unpin("req-1")
            result = out_q.get(timeout=DEADLINE)
        assert "error" not in result, result.get("error")
        assert result["removed"] == [False] * 3  # pinned: LMCache's remove is refused
        assert result["overwritten"] > 0
        assert int(mask.sum()) == n
        expected = E.gathered(E.kv_caches(n, seed=21), torch.arange(n))
        assert E.same_bits(E.gathered(out, torch.arange(n)), expected)
    finally:
        writer.join(DEADLINE)
        if writer.is_alive():
            writer.kill()
            writer.join(5)


def test_two_lookups_pinning_one_prompt_hold_it_until_both_let_go(maru_server):
    """Two requests sharing a prompt pin it twice from one engine: the first `lookup_unpin`
    leaves it pinned for the second (a remove by another instance is refused until both)."""
    n = 2 * G.chunk
    tokens = E.prompt(n, 5)
    with E.Engine(E.config(maru_server.url), E.metadata()) as built:
        built.engine.store(tokens, kvcaches=E.kv_caches(n, seed=5), slot_mapping=torch.arange(n))
        W._wait_for(lambda: not built.backend.put_tasks, "puts finished")
        keys = E.key_strings(built.engine, tokens)
        assert built.engine.lookup(tokens, lookup_id="a", pin=True) == n
        assert built.engine.lookup(tokens, lookup_id="b", pin=True) == n
        with MaruHandler(server_url=maru_server.url, pool_size="4M") as other:
            built.engine.lookup_unpin("a")
            assert other.batch_delete(keys) == [False, False]  # "b" still holds them
            built.engine.lookup_unpin("b")
            assert other.batch_delete(keys) == [True, True]


# -- engines of other chunk sizes sharing keys --------------------------------------------------


@pytest.mark.parametrize(("writer_chunk", "reader_chunk"), [(16, 32), (32, 16)])
def test_engines_of_other_chunk_sizes_read_the_bytes_written_or_miss(
    maru_server_factory, writer_chunk: int, reader_chunk: int
):
    """A prompt of 16 tokens has one key whatever the chunk size (LMCache's hash does not
    include it): a full chunk for one engine, a partial one for the other, whose Maru chunk
    (allocation unit) differs. Every hit is the writer's bytes; values off the reader's
    grid are misses (never a neighbour's bytes)."""
    server = maru_server_factory(pool_size="64M")
    wg = E.Geometry(chunk=writer_chunk)
    rg = E.Geometry(chunk=reader_chunk)
    prompts = [(E.prompt(16, 300 + i), 300 + i) for i in range(6)]
    with E.Engine(E.config(server.url, geometry=wg), E.metadata(wg), E.CpuKVConnector(wg)) as w:
        for tokens, seed in prompts:
            caches = E.kv_caches(16, geometry=wg, seed=seed)
            w.engine.store(tokens, kvcaches=caches, slot_mapping=torch.arange(16))
        W._wait_for(lambda: not w.backend.put_tasks, "puts finished")
        written = [E.key_strings(w.engine, tokens) for tokens, _ in prompts]
    hits = 0
    with E.Engine(E.config(server.url, geometry=rg), E.metadata(rg), E.CpuKVConnector(rg)) as r:
        for (tokens, seed), keys in zip(prompts, written):
            assert E.key_strings(r.engine, tokens) == keys  # the same key for both
            out = E.kv_caches(16, geometry=rg)
            mask = r.engine.retrieve(tokens, kvcaches=out, slot_mapping=torch.arange(16))
            got = int(mask.sum())
            assert got in (0, 16)
            if got:
                hits += 1
                expected = E.gathered(E.kv_caches(16, geometry=rg, seed=seed), torch.arange(16))
                assert E.same_bits(E.gathered(out, torch.arange(16)), expected), seed
    assert hits > 0


@pytest.mark.parametrize(
    "reader",
    [E.Geometry(layers=4, heads=2), E.Geometry(layers=1, heads=8)],
    ids=["more-layers-narrower", "fewer-layers-wider"],
)
def test_engines_of_one_model_name_and_other_layouts_miss_each_others_chunks(
    maru_server, reader: E.Geometry
):
    """Two engines serve one model name (`maru-tiny`) with other KV layouts of the same chunk
    bytes: LMCache gives both the same keys (its key names no layout). The handler's key
    scope (`CxlMemoryAdapter`'s layout digest) keeps them apart: the reader's lookup and
    retrieve find nothing (mutation: no `set_key_scope` in the adapter, both hit the
    writer's bytes laid out as another model's), while an engine of the writer's layout
    still reads every chunk."""
    assert reader.chunk_bytes == G.chunk_bytes  # the lengths alone cannot tell them apart
    n = 2 * G.chunk
    tokens = E.prompt(n, 41)
    with E.Engine(E.config(maru_server.url), E.metadata()) as w:
        w.engine.store(tokens, kvcaches=E.kv_caches(n, seed=41), slot_mapping=torch.arange(n))
        W._wait_for(lambda: not w.backend.put_tasks, "puts finished")
        written = [k.to_string() for _, _, k in w.engine.token_database.process_tokens(tokens)]
    meta = E.metadata(reader)
    with E.Engine(E.config(maru_server.url, geometry=reader), meta, E.CpuKVConnector(reader)) as r:
        names = [k.to_string() for _, _, k in r.engine.token_database.process_tokens(tokens)]
        assert names == written  # one key for both layouts
        out = E.kv_caches(n, geometry=reader)
        assert r.engine.lookup(tokens) == 0
        assert int(r.engine.retrieve(tokens, kvcaches=out, slot_mapping=torch.arange(n)).sum()) == 0
        assert not E.gathered(out, torch.arange(n)).view(torch.int16).any()
    with E.Engine(E.config(maru_server.url), E.metadata()) as again:
        out = E.kv_caches(n)
        assert (
            int(again.engine.retrieve(tokens, kvcaches=out, slot_mapping=torch.arange(n)).sum())
            == n
        )
        expected = E.gathered(E.kv_caches(n, seed=41), torch.arange(n))
        assert E.same_bits(E.gathered(out, torch.arange(n)), expected)


# -- puts that name one key or one object twice ---------------------------------------------------


def test_one_key_twice_in_a_batched_put_keeps_the_first_value(maru_server):
    with E.Engine(E.config(maru_server.url), E.metadata()) as built:
        backend = built.backend
        first, second = _full(backend), _full(backend)
        first.tensor.fill_(1.0)
        second.tensor.fill_(2.0)
        want = _bytes(first)
        free = backend._handler.free_chunks()
        done: list[CacheEngineKey] = []
        for future in backend.batched_submit_put_task(
            [_key(0), _key(0)], [first, second], on_complete_callback=done.append
        ):
            future.result(10)
        assert done == [_key(0), _key(0)]  # both "stored": the key is there (first value)
        assert backend._handler.free_chunks() == free + 1  # the second's chunk, back once
        reuse = _full(backend)  # takes the chunk given back: writing it changes no key
        reuse.tensor.fill_(3.0)
        assert _bytes(backend.get_blocking(_key(0))) == want
        del second
        gc.collect()
        assert backend._handler.free_chunks() == free  # (not freed a second time)


def test_one_object_under_two_keys_in_one_batch_is_stored_under_neither(maru_server):
    """The same chunks under two keys would alias: the batch fails (LMCache logs it) and
    neither key is a hit."""
    with E.Engine(E.config(maru_server.url), E.metadata()) as built:
        backend = built.backend
        obj = _full(backend)
        obj.tensor.fill_(4.0)
        futures = backend.batched_submit_put_task([_key(1), _key(2)], [obj, obj])
        with pytest.raises(ValueError, match="not an unpublished reservation"):
            for future in futures:
                future.result(10)
        assert backend.batched_contains([_key(1)]) == 0
        assert backend.batched_contains([_key(2)]) == 0
        assert backend.batched_get_blocking([_key(1), _key(2)]) == [None, None]


# -- sizes ---------------------------------------------------------------------------------------


def test_a_value_longer_than_a_chunk_is_a_miss_for_every_get(maru_server):
    """Stored through the backend (two chunks of tokens in one object), it exists, but every
    get is a miss: never its first chunk's bytes as a chunk."""
    meta = E.metadata()
    with E.Engine(E.config(maru_server.url), meta) as built:
        backend = built.backend
        big = backend.allocate(meta.get_shapes(2 * G.chunk), meta.get_dtypes(), E.FMT)
        assert big is not None and big.get_size() == 2 * G.chunk_bytes
        big.tensor.fill_(5.0)
        backend.submit_put_task(_key(3), big).result(10)
        assert backend.contains(_key(3))
        assert backend.get_blocking(_key(3)) is None
        assert backend.batched_get_blocking([_key(3)]) == [None]

        async def non_blocking() -> list:
            return await backend.batched_get_non_blocking("big", [_key(3)])

        got = asyncio.run_coroutine_threadsafe(non_blocking(), backend.loop).result(10)
        assert got == []
        for shape_tokens in (0, -1):  # nothing to reserve: None, not an exception
            assert backend.allocate(meta.get_shapes(shape_tokens), meta.get_dtypes()) is None


# -- the server gone ----------------------------------------------------------------------------


def test_with_the_server_gone_gets_are_misses_and_a_put_registers_nothing(maru_server_factory):
    server = maru_server_factory(pool_size="64M")
    cfg = E.config(server.url)
    cfg.extra_config["maru_timeout_ms"] = 1000
    with E.Engine(cfg, E.metadata()) as built:
        backend = built.backend
        kept = _full(backend)
        kept.tensor.fill_(6.0)
        backend.submit_put_task(_key(4), kept).result(10)
        pending = _full(backend)
        pending.tensor.fill_(7.0)
        server.halt()  # (its pool and state kept: the next start restores them)
        assert backend.get_blocking(_key(4)) is None
        assert backend.batched_get_blocking([_key(4)]) == [None]
        assert backend.batched_contains([_key(4)], pin=True) == 0
        future = backend.submit_put_task(_key(5), pending)
        with contextlib.suppress(Exception):  # (LMCache logs it; nothing is registered)
            future.result(30)
        assert not backend.put_tasks
        server.start()
        W._wait_for(lambda: backend.contains(_key(4)), "the server back")
        assert not backend.contains(_key(5))
        assert backend.get_blocking(_key(5)) is None
        got = backend.get_blocking(_key(4))
        assert got is not None and bool((got.tensor == 6.0).all())
