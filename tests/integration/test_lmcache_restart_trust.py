"""LMCache's real engine and shipped `MaruBackend` across `maru-server` restarts: a hit is the
bytes stored under its key, or a miss, never another chunk's bytes; nothing the engine still
holds (a zero-copy view from `get_blocking`, an allocated object not yet put, a pinned lookup,
an async prefetch) reads or writes pages handed to someone else since.

The engine lives in this process (LMCache's `LMCacheEngineBuilder`, Maru its only backend, the
CPU stand-in for the GPU connector: tests/lmcache_cpu/engine.py) and keeps running while the
server is SIGKILLed and started again with the same arguments: restored from its
state dir, or with `--no-restore` (a new pool generation, every key gone). Another instance
(a plain `MaruHandler`, the same chunk size) writes after the restart, so that reused pages
hold someone else's bytes. Every retrieved chunk is compared byte for byte with what was
stored under its key; chunks not retrieved must be left untouched.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import uuid
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

G = E.GEOMETRY
N = 4 * G.chunk + 5  # four full chunks and a partial one
BACK_S = 30.0  # how long the engine's handler may take to be served again after a restart


keep_start_method = E.keep_start_method  # autouse (tests/lmcache_cpu/engine.py)


# -- helpers --------------------------------------------------------------------------------------


def _served_again(handler: MaruHandler) -> None:
    W._wait_for(handler.healthcheck, "the engine's handler served again", BACK_S)


def _store(built: E.Engine, n: int, seed: int) -> tuple[list[int], torch.Tensor]:
    """`engine.store` a prompt of `n` tokens (its KV random from `seed`), puts waited for;
    (tokens, the KV as [2, layers, n, hidden]: what each chunk must read back as)."""
    tokens, caches = E.prompt(n, seed), E.kv_caches(n, seed=seed)
    built.engine.store(tokens, kvcaches=caches, slot_mapping=torch.arange(n))
    W._wait_for(lambda: not built.backend.put_tasks, "puts finished", BACK_S)
    return tokens, E.gathered(caches, torch.arange(n))


def _chunks(n: int) -> list[tuple[int, int]]:
    return [(s, min(s + G.chunk, n)) for s in range(0, n, G.chunk)]


def _retrieve(built: E.Engine, tokens: list[int], expected: torch.Tensor) -> tuple[int, list]:
    """`engine.retrieve` into a zeroed paged cache: (chunks retrieved, chunks wrong). A chunk
    is wrong if retrieved in part, retrieved with bytes other than its own, or not retrieved
    yet written to."""
    n = len(tokens)
    out = E.kv_caches(n)
    mask = built.engine.retrieve(tokens, kvcaches=out, slot_mapping=torch.arange(n))
    got = E.gathered(out, torch.arange(n))
    hits, wrong = 0, []
    for c, (s, e) in enumerate(_chunks(n)):
        part = mask[s:e]
        if part.all():
            hits += 1
            if not E.same_bits(got[:, :, s:e], expected[:, :, s:e]):
                wrong.append(c)
        elif part.any() or got[:, :, s:e].view(torch.int16).any():
            wrong.append(c)
    return hits, wrong


def _chunk_bytes(expected: torch.Tensor, s: int, e: int) -> bytes:
    """A chunk's bytes as LMCache stores them (KV_2LTD: [2, layers, tokens, hidden])."""
    return expected[:, :, s:e].contiguous().view(torch.uint8).numpy().tobytes()


def _obj_bytes(obj: Any) -> bytes:
    return obj.tensor.contiguous().view(torch.uint8).numpy().tobytes()


def _key(salt: int, i: int) -> CacheEngineKey:
    return CacheEngineKey("maru-tiny", 1, 0, salt * 1000 + i, torch.bfloat16)


def _fill(obj: Any, seed: int) -> bytes:
    """Random bytes written into a memory object (in the pool); the bytes."""
    gen = torch.Generator().manual_seed(seed)
    obj.tensor.copy_(torch.randn(obj.tensor.shape, generator=gen).to(obj.tensor.dtype))
    return _obj_bytes(obj)


def _full_chunk_obj(built: E.Engine) -> Any:
    obj = built.backend.allocate(built.metadata.get_shapes(G.chunk), built.metadata.get_dtypes())
    assert obj is not None
    return obj


def _other_writer(url: str, count: int, salt: str) -> tuple[MaruHandler, dict[str, bytes]]:
    """Another instance that stores `count` full-chunk values (random bytes) in pages of its
    own: after a restart these are the pages the engine's old ones may have become."""
    h = MaruHandler(
        server_url=url, pool_size="16M", chunk_size_bytes=G.chunk_bytes, timeout_ms=10_000
    )
    values = {f"w-{salt}-{i}": os.urandom(G.chunk_bytes) for i in range(count)}
    assert h.batch_store(list(values), list(values.values())) == [True] * count
    return h, values


def _wrong_values(h: MaruHandler, values: dict[str, bytes]) -> list[str]:
    """The keys of `values` read back (by `h`) as other bytes; a miss is not wrong."""
    infos = h.batch_retrieve(list(values))
    return [k for (k, v), i in zip(values.items(), infos) if i is not None and bytes(i.view) != v]


def _stored_chunks_wrong(h: MaruHandler, keys: list[str], expected: torch.Tensor) -> list[int]:
    """Chunks of a prompt that `h` (another instance, its own mapping) reads as other bytes."""
    infos = h.batch_retrieve(keys)
    return [
        c
        for c, ((s, e), info) in enumerate(zip(_chunks(expected.shape[2]), infos))
        if info is not None and bytes(info.view) != _chunk_bytes(expected, s, e)
    ]


# -- 1. SIGKILL, restored from the journal --------------------------------------------------------


def test_a_restored_restart_under_a_running_engine_serves_its_own_bytes(maru_server_factory):
    """The engine stored a prompt, holds a view of its first chunk (`get_blocking`) and an
    allocated object it filled but has not put; the server is SIGKILLed and restored. The
    engine's later retrieves read every chunk's own bytes; the object put after the restart
    is registered over its own bytes; the engine's further stores reuse none of the restored
    keys' pages (its own free chunks only), and another instance writing meanwhile disturbs
    neither."""
    server = maru_server_factory(pool_size="32M")
    with E.Engine(E.config(server.url, pool_bytes=8 << 20), E.metadata()) as built:
        backend, handler = built.backend, built.backend._handler
        tokens, expected = _store(built, N, 1)
        keys = E.key_strings(built.engine, tokens)
        lmc_keys = [key for _, _, key in built.engine.token_database.process_tokens(tokens)]
        held = backend.get_blocking(lmc_keys[0])
        assert _obj_bytes(held) == _chunk_bytes(expected, 0, G.chunk)
        unsealed = _full_chunk_obj(built)
        unsealed_bytes = _fill(unsealed, 99)
        instance = handler.instance_id
        assert built.engine.lookup(tokens, lookup_id="req-pinned", pin=True) == N

        server.kill_and_start()
        _served_again(handler)
        assert handler.instance_id == instance  # resumed, with its regions

        assert _retrieve(built, tokens, expected) == (len(keys), [])
        done: list = []
        put = backend.submit_put_task(_key(5, 0), unsealed, on_complete_callback=done.append)
        put.result(BACK_S)
        assert done == [_key(5, 0)]  # stored after the restart...
        with MaruHandler(server_url=server.url, pool_size="4M") as reader:
            info = reader.retrieve(_key(5, 0).to_string() + E.scope())
            assert info is not None and bytes(info.view) == unsealed_bytes  # ...its own bytes
            assert _stored_chunks_wrong(reader, keys, expected) == []
            # the pinned lookup's pins were restored: nobody deletes the keys under it
            assert reader.batch_delete(keys) == [False] * len(keys)
            built.engine.lookup_unpin("req-pinned")

            other, values = _other_writer(server.url, 64, "restored")
            try:
                later = [_store(built, N, seed) for seed in range(10, 16)]
                for t, x in [(tokens, expected), *later]:
                    assert _retrieve(built, t, x) == (len(keys), [])
                    assert _stored_chunks_wrong(reader, E.key_strings(built.engine, t), x) == []
                assert _wrong_values(reader, values) == []
                # the view LMCache held across the restart still reads its chunk's bytes
                assert _obj_bytes(held) == _chunk_bytes(expected, 0, G.chunk)
            finally:
                other.close()
        assert not backend.put_tasks


# -- 2. --no-restore: a new pool generation under the running engine -----------------------------


def test_a_new_pool_generation_makes_every_old_key_a_miss_and_old_objects_harmless(
    maru_server_factory,
):
    """The engine stored a prompt, took a pinned lookup of it, holds a view of a chunk and
    allocated objects (one, and a batch of three) it filled but has not put; the server is
    SIGKILLed and started with `--no-restore`, and another instance fills pages of the new
    pool. Every old key is a miss (lookup, contains, retrieve; nothing written into the paged
    cache); writing into the old objects and putting them never registers a key over pages
    they do not own (each put fails, or its key reads the object's own bytes), and the other
    instance's values are untouched; the old view still reads its old chunk (the old file),
    never the new pool's bytes; `lookup_unpin` of the old lookup raises nothing. Stored
    again, the prompt reads back whole."""
    server = maru_server_factory(pool_size="32M")
    with E.Engine(E.config(server.url, pool_bytes=8 << 20), E.metadata()) as built:
        engine, backend, handler = built.engine, built.backend, built.backend._handler
        tokens, expected = _store(built, N, 2)
        keys = E.key_strings(engine, tokens)
        lmc_keys = [key for _, _, key in engine.token_database.process_tokens(tokens)]
        assert engine.lookup(tokens, lookup_id="req-old", pin=True) == N
        held = backend.get_blocking(lmc_keys[1])
        one = _full_chunk_obj(built)
        _fill(one, 3)
        batch = backend.batched_allocate(
            built.metadata.get_shapes(G.chunk), built.metadata.get_dtypes(), 3
        )
        assert batch is not None
        for i, obj in enumerate(batch):
            _fill(obj, 4 + i)

        server.kill_and_start(no_restore=True)
        # the other instance first: it takes the new pool's first pages, where the engine's
        # old region lay in the file before
        other, values = _other_writer(server.url, 256, "new")
        try:
            assert engine.lookup(tokens) == 0
            _served_again(handler)
            assert [backend.contains(k) for k in lmc_keys] == [False] * len(lmc_keys)
            assert _retrieve(built, tokens, expected) == (0, [])

            # the objects allocated before the restart: written again now, then put
            one_bytes = _fill(one, 30)
            batch_bytes = [_fill(obj, 40 + i) for i, obj in enumerate(batch)]
            done: list = []
            backend.submit_put_task(_key(6, 0), one, on_complete_callback=done.append).result(
                BACK_S
            )
            for future in backend.batched_submit_put_task(
                [_key(6, i) for i in (1, 2, 3)], batch, on_complete_callback=done.append
            ):
                future.result(BACK_S)
            with MaruHandler(server_url=server.url, pool_size="4M") as reader:
                put_infos = reader.batch_retrieve(
                    [_key(6, i).to_string() + E.scope() for i in range(4)]
                )
                for info, own, key in zip(put_infos, [one_bytes, *batch_bytes], range(4)):
                    # a miss, or its own bytes (never zeros nor another value's)
                    assert info is None or bytes(info.view) == own, f"key {key}"
                    assert (info is not None) == (_key(6, key) in done)
                assert _wrong_values(reader, values) == []
                assert _stored_chunks_wrong(reader, keys, expected) == []
                assert [reader.exists(k) for k in keys] == [False] * len(keys)
            # the view held across the restart reads the old file's chunk, not the new pool
            assert _obj_bytes(held) == _chunk_bytes(expected, G.chunk, 2 * G.chunk)
            engine.lookup_unpin("req-old")

            # stored again in the new generation: whole, and nobody else's pages
            again, _ = _store(built, N, 2)
            assert again == tokens
            assert _retrieve(built, tokens, expected) == (len(keys), [])
            with MaruHandler(server_url=server.url, pool_size="4M") as reader:
                assert _stored_chunks_wrong(reader, keys, expected) == []
                assert _wrong_values(reader, values) == []
                assert all(reader.batch_exists(list(values)))
        finally:
            other.close()
        assert not backend.put_tasks


@pytest.mark.parametrize("no_restore", [False, True], ids=["restored", "no_restore"])
def test_an_async_prefetch_held_across_a_restart_is_not_another_chunk(
    maru_server_factory, no_restore
):
    """LMCache's async loading: the scheduler's lookup makes the worker pin the prompt's keys
    on the server and prefetch its chunks (views of the pool), held until `retrieve`. The
    server is SIGKILLed and started again in between, and another instance writes in the pool.
    Restored, the pins are too: the other instance cannot delete the keys under the held
    views. Either way the retrieve writes into the paged cache only the prompt's own bytes
    (with `--no-restore`, read from the old file) or nothing."""
    server = maru_server_factory(pool_size="32M")
    cfg = E.config(server.url, pool_bytes=8 << 20, async_loading=True)
    with E.Engine(cfg, E.metadata()) as built:
        tokens, expected = _store(built, N, 3)
        keys = E.key_strings(built.engine, tokens)
        lookup_id = f"req-{uuid.uuid4().hex[:8]}"
        assert W._async_lookup(built.lookup_client(), tokens, lookup_id) == N

        server.kill_and_start(no_restore)
        other, values = _other_writer(server.url, 256, "prefetch")
        try:
            deleted = other.batch_delete(keys)
            assert deleted == [False] * len(keys)  # pinned (restored), or gone already
            n = len(tokens)
            out = E.kv_caches(n)
            mask = built.engine.retrieve(
                tokens, kvcaches=out, slot_mapping=torch.arange(n), req_id=lookup_id
            )
            got = E.gathered(out, torch.arange(n))
            for s, e in _chunks(n):
                if mask[s:e].all():
                    assert E.same_bits(got[:, :, s:e], expected[:, :, s:e]), (s, e)
                else:
                    assert not mask[s:e].any() and not got[:, :, s:e].view(torch.int16).any()
            _served_again(built.backend._handler)
            assert built.engine.lookup(tokens) == (0 if no_restore else N)
            with MaruHandler(server_url=server.url, pool_size="4M") as reader:
                assert _wrong_values(reader, values) == []
                assert _stored_chunks_wrong(reader, keys, expected) == []
        finally:
            other.close()


# -- 3. the engine's stores racing the restart --------------------------------------------------


@pytest.mark.parametrize("no_restore", [False, True], ids=["restored", "no_restore"])
def test_engine_stores_racing_a_restart_register_only_their_own_bytes(
    maru_server_factory, no_restore
):
    """A thread stores prompt after prompt through the engine (allocate, gather into the pool,
    async put) while the server is SIGKILLed and started again, and another instance writes in
    the pool after the restart. Afterwards every chunk the engine retrieves, and every chunk
    another instance reads under the prompt's keys, is the prompt's own bytes; with
    `--no-restore` the prompts stored before the kill are misses; the engine raised nothing."""
    server = maru_server_factory(pool_size="32M")
    cfg = E.config(server.url, pool_bytes=8 << 20)
    cfg.extra_config["maru_timeout_ms"] = 2000  # (a put sent to the dead server fails this fast)
    stop, errors = threading.Event(), []
    stored: list[tuple[list[int], torch.Tensor]] = []
    with E.Engine(cfg, E.metadata()) as built:

        def keep_storing() -> None:
            seed = 100
            try:
                while not stop.is_set() and seed < 400:
                    n = 2 * G.chunk + 3
                    tokens, caches = E.prompt(n, seed), E.kv_caches(n, seed=seed)
                    built.engine.store(tokens, kvcaches=caches, slot_mapping=torch.arange(n))
                    stored.append((tokens, E.gathered(caches, torch.arange(n))))
                    seed += 1
                    time.sleep(0.01)
            except BaseException as exc:  # (reported by the test)
                errors.append(exc)

        writer = threading.Thread(target=keep_storing, daemon=True)
        writer.start()
        W._wait_for(lambda: len(stored) >= 5, "stores before the kill")
        before = len(stored)
        server.kill_and_start(no_restore)
        other, values = _other_writer(server.url, 128, "race")
        try:
            after = len(stored)  # (the ones between: made while the server was down)
            W._wait_for(lambda: len(stored) >= after + 15, "stores after the restart", BACK_S)
            stop.set()
            writer.join(BACK_S)
            assert not writer.is_alive() and errors == []
            W._wait_for(lambda: not built.backend.put_tasks, "puts finished", BACK_S)
            _served_again(built.backend._handler)

            with MaruHandler(server_url=server.url, pool_size="4M") as reader:
                for i, (tokens, expected) in enumerate(stored):
                    hits, wrong = _retrieve(built, tokens, expected)
                    assert wrong == [], f"prompt {i}: chunks {wrong} are not its bytes"
                    keys = E.key_strings(built.engine, tokens)
                    assert _stored_chunks_wrong(reader, keys, expected) == [], f"prompt {i}"
                    if no_restore and i < before:
                        assert hits == 0, f"prompt {i} of the old generation is a hit"
                assert _wrong_values(reader, values) == []
                # (the stores made while the server was down, or before the engine's handler
                # learnt of the new generation, may all have failed: one more, now, may not)
                tokens, expected = _store(built, N, 500)
                assert _retrieve(built, tokens, expected) == (len(_chunks(N)), [])
                keys = E.key_strings(built.engine, tokens)
                assert _stored_chunks_wrong(reader, keys, expected) == []
        finally:
            stop.set()
            other.close()


# -- 4. nothing of the backend's own turns a server miss into a hit -----------------------------


def test_no_state_kept_in_the_backend_turns_a_new_generations_miss_into_a_hit(
    maru_server_factory,
):
    """MaruBackend keeps one set of its own (`put_tasks`, keys being put) and LMCache's engine a
    lookup pin per lookup id; the handler a local index of the server's. After a new pool
    generation the backend's contains / batched_contains / get_blocking /
    batched_get_blocking / batched_async_contains / batched_get_non_blocking all answer
    from the new server: misses, and no memory object."""
    server = maru_server_factory(pool_size="32M")
    with E.Engine(E.config(server.url, pool_bytes=8 << 20), E.metadata()) as built:
        backend = built.backend
        tokens, _ = _store(built, N, 4)
        lmc_keys = [key for _, _, key in built.engine.token_database.process_tokens(tokens)]
        assert backend.batched_contains(lmc_keys) == len(lmc_keys)

        server.kill_and_start(no_restore=True)
        other, _ = _other_writer(server.url, 64, "state")
        try:
            import asyncio

            def on_loop(coro: Any) -> Any:
                return asyncio.run_coroutine_threadsafe(coro, backend.loop).result(BACK_S)

            assert backend.batched_contains(lmc_keys) == 0
            _served_again(backend._handler)
            assert backend.put_tasks == set()
            assert [backend.contains(k) for k in lmc_keys] == [False] * len(lmc_keys)
            assert backend.contains(lmc_keys[0], pin=True) is False
            assert backend.get_blocking(lmc_keys[0]) is None
            assert backend.batched_get_blocking(lmc_keys) == [None] * len(lmc_keys)
            assert on_loop(backend.batched_async_contains("l-1", lmc_keys, pin=True)) == 0
            assert on_loop(backend.batched_get_non_blocking("l-1", lmc_keys)) == []
            assert built.engine.lookup(tokens, lookup_id="req-new", pin=True) == 0
            built.engine.lookup_unpin("req-new")
        finally:
            other.close()
