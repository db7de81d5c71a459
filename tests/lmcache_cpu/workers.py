"""What the LMCache tests run in separate processes (spawned: a fresh interpreter, its own
LMCache engine, its own MaruHandler and mapping of the pool). Each returns a plain dict.

The chunk keys of a prompt come from LMCache's token database, which (without vLLM installed)
hashes with Python's `hash`: the tests set PYTHONHASHSEED before spawning, so that both
processes derive the same keys, as a deployment must."""

from __future__ import annotations

import asyncio
import gc
import hashlib
import time
import uuid
from typing import Any

from lmcache_cpu import engine as E

DEADLINE_S = 20.0


def _wait_for(fn, what: str, timeout: float = DEADLINE_S):
    end = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > end:
            raise TimeoutError(f"{what}: not within {timeout} s")
        time.sleep(0.02)


def _async_lookup(client, tokens: list[int], lookup_id: str) -> int:
    """Poll as vLLM's scheduler does through LMCache's connector: `lookup_cache` first (-1:
    never asked, so ask with `lookup`; None: in flight), until it gives the hit tokens."""
    end = time.monotonic() + DEADLINE_S
    while time.monotonic() < end:
        hit = client.lookup_cache(lookup_id)
        if hit == -1:
            client.lookup(tokens, lookup_id)
        elif hit is not None:
            return hit
        time.sleep(0.01)
    raise TimeoutError(f"async lookup {lookup_id}: no answer within {DEADLINE_S} s")


def _digest(tensor) -> str:
    return hashlib.sha1(tensor.contiguous().view(-1).view(E.torch.uint8).numpy()).hexdigest()


def _chunk_digests(caches, slots, n_tokens: int, chunk: int) -> list[str]:
    full = E.gathered(caches, slots)
    return [_digest(full[:, :, s : min(s + chunk, n_tokens)]) for s in range(0, n_tokens, chunk)]


def store_prompt(url: str, n_tokens: int, seed: int, slots: int) -> dict:
    """Process A: `engine.store` a prompt's KV (random, from `seed`) through the shipped
    MaruBackend; wait until its own `engine.lookup` sees every chunk (the puts are async)."""
    tokens = E.prompt(n_tokens, seed)
    caches = E.kv_caches(slots, seed=seed)
    slot_map = E.slot_mapping(n_tokens, slots, seed)
    with E.Engine(E.config(url), E.metadata()) as built:
        engine, backend = built.engine, built.backend
        engine.store(tokens, kvcaches=caches, slot_mapping=slot_map)
        _wait_for(lambda: engine.lookup(tokens) == n_tokens, "stored prompt visible")
        _wait_for(lambda: not backend.put_tasks, "puts finished")
        return {
            "keys": E.key_strings(engine, tokens),
            "digests": _chunk_digests(caches, slot_map, n_tokens, E.GEOMETRY.chunk),
            "instance": backend._handler.instance_id,
        }


def retrieve_prompt(url: str, n_tokens: int, seed: int, slots: int, async_loading: bool) -> dict:
    """Process B: `engine.lookup` then `engine.retrieve` the prompt into its own (zeroed) paged
    cache at other slots, and compare with the KV process A stored, byte for byte. With
    `async_loading`, the lookup goes through LMCache's real async lookup client (scheduler
    side) and server (worker side), which prefetch under pins; then another instance tries to
    delete the prompt's keys before and after this engine closes."""
    from maru import MaruHandler

    chunk = E.GEOMETRY.chunk
    tokens = E.prompt(n_tokens, seed)
    expected = E.gathered(E.kv_caches(slots, seed=seed), E.slot_mapping(n_tokens, slots, seed))
    caches = E.kv_caches(slots)  # zeros
    slot_map = E.slot_mapping(n_tokens, slots, seed + 1000)
    out: dict[str, Any] = {}
    with E.Engine(E.config(url, async_loading=async_loading), E.metadata()) as built:
        engine = built.engine
        keys = E.key_strings(engine, tokens)
        kwargs: dict[str, Any] = {"kvcaches": caches, "slot_mapping": slot_map}
        if async_loading:
            lookup_id = f"req-{uuid.uuid4().hex[:8]}"
            out["lookup"] = _async_lookup(built.lookup_client(), tokens, lookup_id)
            kwargs["req_id"] = lookup_id
        else:
            out["lookup"] = engine.lookup(tokens)
        mask = engine.retrieve(tokens, **kwargs)
        got = E.gathered(caches, slot_map)
        out["retrieved"] = int(mask.sum())
        out["chunks_same"] = [
            E.same_bits(got[:, :, s : s + chunk], expected[:, :, s : s + chunk])
            for s in range(0, n_tokens, chunk)
        ]
        out["nonzero"] = bool(got.view(E.torch.int16).any())
        out["keys"] = keys
        if async_loading:
            with MaruHandler(server_url=url, pool_size="4M") as other:
                out["delete_while_open"] = other.batch_delete(keys)
                built.close()  # closes MaruBackend, whose handler ends the instance
                out["delete_after_close"] = other.batch_delete(keys)
    return out


# -- the backend's own methods, across two processes -------------------------------------------


def _keys(n: int, salt: int):
    import torch
    from lmcache.utils import CacheEngineKey

    return [CacheEngineKey("maru-tiny", 1, 0, salt * 1000 + i, torch.bfloat16) for i in range(n)]


def _fill(obj, seed: int) -> str:
    """Random bytes into a memory object's tensor (in the shared pool); their digest."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    tensor = obj.tensor
    tensor.copy_(torch.randn(tensor.shape, generator=gen).to(tensor.dtype))
    return _digest(tensor)


def backend_puts(url: str, salt: int) -> dict:
    """`submit_put_task` (one key) and `batched_submit_put_task` (full and partial chunks),
    each future waited, the callbacks counted; then a second put of key 0 with other bytes."""
    g = E.GEOMETRY
    meta = E.metadata()
    with E.Engine(E.config(url), meta) as built:
        backend = built.backend
        keys = _keys(4, salt)
        tokens = [g.chunk, g.chunk, 5, 1]  # full, full, partial, one token
        objs = [backend.allocate(meta.get_shapes(t), meta.get_dtypes(), E.FMT) for t in tokens]
        digests = [_fill(obj, salt * 100 + i) for i, obj in enumerate(objs)]
        done: list[str] = []
        backend.submit_put_task(keys[0], objs[0], on_complete_callback=done.append).result(10)
        futures = backend.batched_submit_put_task(
            keys[1:], objs[1:], on_complete_callback=done.append
        )
        for future in futures:
            future.result(10)
        free_before = backend._handler.free_chunks()
        again = backend.allocate(meta.get_shapes(g.chunk), meta.get_dtypes(), E.FMT)
        _fill(again, 999)
        dup_done: list[str] = []
        backend.submit_put_task(keys[0], again, on_complete_callback=dup_done.append).result(10)
        dup_chunks_back = backend._handler.free_chunks() == free_before
        # the duplicate's chunk is free again: whoever takes it next, dropping the duplicate's
        # object (LMCache still counts a reference on it) must not free it a second time
        taker = backend.allocate(meta.get_shapes(g.chunk), meta.get_dtypes(), E.FMT)
        del again
        gc.collect()
        return {
            "done": [str(k) for k in done],
            "keys": [str(k) for k in keys],
            "dup_done": len(dup_done),
            "digests": digests,
            "sizes": [obj.get_size() for obj in objs],
            "dup_chunks_back": dup_chunks_back,
            "no_double_free": taker is not None
            and backend._handler.free_chunks() == free_before - 1,
            "put_tasks_left": len(backend.put_tasks),
        }


def backend_gets(url: str, salt: int) -> dict:
    """Another process's MaruBackend: contains / batched_contains / get_blocking /
    batched_get_blocking / batched_async_contains / batched_get_non_blocking / pin / unpin /
    batched_unpin / remove, on the keys `backend_puts` stored (plus a missing one)."""
    from maru_lmcache import CxlMemoryAdapter

    with E.Engine(E.config(url), E.metadata()) as built:
        backend = built.backend
        k0, k1, k2, k3 = _keys(4, salt)
        missing = _keys(1, salt + 1)[0]

        def on_loop(coro):
            return asyncio.run_coroutine_threadsafe(coro, backend.loop).result(10)

        out: dict[str, Any] = {
            "contains": [backend.contains(k0), backend.contains(missing)],
            "batched_contains": backend.batched_contains([k0, k1, missing, k2]),
            "batched_contains_all": backend.batched_contains([k0, k1, k2, k3]),
        }
        one = backend.get_blocking(k0)
        out["get_blocking"] = [_digest(one.tensor), list(one.get_shape()), one.get_ref_count()]
        out["get_blocking_missing"] = backend.get_blocking(missing) is None
        many = backend.batched_get_blocking([k0, missing, k2, k3])
        out["batched_get_blocking"] = [None if m is None else _digest(m.tensor) for m in many]
        out["batched_tokens"] = [None if m is None else m.get_num_tokens() for m in many]
        region, _ = CxlMemoryAdapter.decode_address(one.meta.address)
        out["foreign_region"] = region not in backend._handler.owned_region_ids()
        out["async_contains"] = on_loop(
            backend.batched_async_contains("lookup-1", [k0, k1, k2, missing, k3], pin=True)
        )
        got = on_loop(backend.batched_get_non_blocking("lookup-1", [k0, k1, k2, missing, k3]))
        out["non_blocking"] = [_digest(m.tensor) for m in got]
        out["non_blocking_pinned"] = [m.is_pinned for m in got]
        # server-side pins: k0..k2 hold one each from batched_async_contains(pin=True)
        out["pin"] = [backend.pin(k1), backend.pin(missing)]
        out["remove_pinned"] = backend.remove(k1)
        out["unpin"] = [backend.unpin(k1), backend.unpin(missing)]
        out["remove_still_pinned"] = backend.remove(k1)
        backend.batched_unpin([k0, k1, k2])
        out["remove"] = backend.remove(k1)
        out["after_remove"] = [backend.contains(k1), backend.get_blocking(k1) is None]
        out["remove_missing"] = backend.remove(missing)
        return out


# -- a writer that removes its prompt and reuses its pages while another engine reads it -------


def _run_into(fn, out_q, args: tuple) -> None:
    """Run `fn(*args)` (in a spawned process) and put its dict, or {"error": traceback}."""
    import traceback

    try:
        result = fn(*args)
    except BaseException:
        result = {"error": traceback.format_exc()}
    out_q.put(result)


def remove_and_reuse_when_told(url: str, n_tokens: int, seed: int, stored, go, done) -> dict:
    """Store a prompt (slots 0..n), set `stored`; on `go`, `remove` every chunk key (LMCache's
    `remove`), then reserve every chunk this instance can get and fill it with 0x7f bytes (a
    page the removes freed is written over), and set `done`. Returns the removes' results and
    how many chunks were written over."""
    import torch

    g = E.GEOMETRY
    tokens = E.prompt(n_tokens, seed)
    with E.Engine(E.config(url), E.metadata()) as built:
        engine, backend = built.engine, built.backend
        engine.store(
            tokens, kvcaches=E.kv_caches(n_tokens, seed=seed), slot_mapping=torch.arange(n_tokens)
        )
        _wait_for(lambda: not backend.put_tasks, "puts finished")
        keys = [key for _, _, key in engine.token_database.process_tokens(tokens)]
        stored.set()
        if not go.wait(DEADLINE_S * 3):
            raise TimeoutError("never told to remove")
        removed = [backend.remove(key) for key in keys]
        meta = E.metadata()
        held = []
        while (
            obj := backend.allocate(meta.get_shapes(g.chunk), meta.get_dtypes(), E.FMT)
        ) is not None:
            obj.tensor.view(torch.uint8).fill_(0x7F)
            held.append(obj)
        done.set()
        return {"removed": removed, "overwritten": len(held)}
