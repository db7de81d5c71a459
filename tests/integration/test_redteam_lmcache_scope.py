"""Red team of the LMCache key scope (`CxlMemoryAdapter` scopes its handler's keys by the KV
layout, `MaruHandler.set_key_scope`): against a real `maru-server` and LMCache's real engine
and shipped `MaruBackend` (the GPU connector is the CPU stand-in, tests/lmcache_cpu/engine.py).

* an engine whose memory objects' layout is no longer the one its backend was made with
  (LMCache's V3 connector sets the KV layer groups up lazily, after the backend) stores nothing:
  its chunks would lie in the other layout's scope and be read in it;
* MLA and non-MLA engines of one model name and equal chunk bytes miss each other's chunks,
  while an MLA engine's other worker (`remote_enable_mla_worker_id_as0`) reads worker 0's;
* every get, lookup, pin, unpin and remove of the backend names the scoped key: a value under
  the bare LMCache name (an earlier Maru's, a foreign writer's) is never read, pinned or
  removed by it;
* a key that fits unscoped but not scoped is refused cleanly: no hit, its chunks back.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

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


keep_start_method = E.keep_start_method  # autouse (tests/lmcache_cpu/engine.py)


def _retrieve(built: E.Engine, tokens: list[int], geometry: E.Geometry) -> tuple[int, list]:
    n = len(tokens)
    out = E.kv_caches(n, geometry=geometry)
    mask = built.engine.retrieve(tokens, kvcaches=out, slot_mapping=torch.arange(n))
    return int(mask.sum()), out


# -- a layout that changed after the backend was made ------------------------------------------


def _layer_groups(kind: str):
    """A `KVLayerGroupsManager` built as LMCache's V3 GPU connector builds it, from the KV
    cache tensors, at its first transfer (vLLM's layout [2, blocks, heads, block, head size]).
    "two-groups": layers 0-1 and 2-3 of 4 x 128 in blocks of other sizes, two kernel groups
    of [2, 2, T, 128]; "other-shape": one group of 2 layers x 256 (equal chunk bytes)."""
    from lmcache.v1.gpu_connector.gpu_connectors import (
        EngineType,
        normalize_and_discover_per_layer_formats,
    )
    from lmcache.v1.kv_layer_groups import KVLayerGroupsManager

    if kind == "two-groups":
        caches = [torch.zeros(2, 8, 4, 16 if i < 2 else 8, 32, dtype=G.dtype) for i in range(4)]
    else:
        caches = [torch.zeros(2, 8, 8, 16, 32, dtype=G.dtype) for _ in range(2)]
    caches, formats = normalize_and_discover_per_layer_formats(caches, [], EngineType.VLLM, {})
    return KVLayerGroupsManager(caches, engine_kv_formats=formats)


class _GroupsConnector(E.CpuKVConnector):
    """`CpuKVConnector` writing each kernel group's layers into its own tensor of the memory
    object (`get_tensor(group)`), as LMCache's V3 connector lays a multi-group chunk out."""

    def __init__(self, groups: list[list[int]], geometry: E.Geometry):
        super().__init__(geometry)
        self.groups = groups

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs) -> None:
        caches, slots = kwargs["kvcaches"], kwargs["slot_mapping"]
        for obj, start, end in zip(memory_objs, starts, ends):
            for g, layers in enumerate(self.groups):
                tensor = obj.get_tensor(g)
                for j, layer in enumerate(layers):
                    tensor[:, j] = caches[layer][:, slots[start:end]]


@pytest.mark.parametrize("kind", ["two-groups", "other-shape"])
def test_an_engine_whose_layout_changed_after_its_backend_was_made_stores_nothing(
    maru_server, kind: str
):
    """The backend's scope names the layout of LMCache's metadata when it was made; LMCache's
    V3 GPU connector sets `kv_layer_groups_manager` at its first transfer, after which the
    engine allocates chunks of the groups' shapes. Such a chunk, stored in the old layout's
    scope, would be read by every engine of that layout as its own. The adapter refuses to
    allocate a layout other than its scope's: the store keeps nothing and raises nothing, and
    an engine of the metadata's layout misses. Mutation (no layout check in
    `CxlMemoryAdapter.batched_allocate`): "two-groups" raises RuntimeError out of
    `engine.store` (MaruBackend's put views a multi-group object as one tensor),
    "other-shape" stores all 32 tokens (the writer's lookup finds them; a 4 x 128 reader
    then retrieves all 32, bytes laid out as 2 x 256)."""
    four = E.Geometry(layers=4)  # the metadata's layout: 4 layers x 128
    n = 2 * four.chunk
    tokens = E.prompt(n, 61)
    if kind == "two-groups":
        writes, connector = four, _GroupsConnector([[0, 1], [2, 3]], four)
    else:
        writes = E.Geometry(layers=2, heads=8)  # the caches': 2 layers x 256
        connector = E.CpuKVConnector(writes)
    assert writes.chunk_bytes == four.chunk_bytes
    with E.Engine(E.config(maru_server.url, geometry=four), E.metadata(four), connector) as w:
        w.engine.metadata.kv_layer_groups_manager = _layer_groups(kind)  # (V3's first transfer)
        assert E.scope(four) == w.backend._handler.key_scope
        assert w.engine.metadata.get_shapes() != E.metadata(four).get_shapes()
        w.engine.store(
            tokens, kvcaches=E.kv_caches(n, geometry=writes, seed=61), slot_mapping=torch.arange(n)
        )
        W._wait_for(lambda: not w.backend.put_tasks, "puts finished")
        assert w.engine.lookup(tokens) == 0
    with E.Engine(
        E.config(maru_server.url, geometry=four), E.metadata(four), E.CpuKVConnector(four)
    ) as r:
        assert r.engine.lookup(tokens) == 0
        got, out = _retrieve(r, tokens, four)
        assert got == 0
        assert not E.gathered(out, torch.arange(n)).view(torch.int16).any()
        # an engine of the metadata's layout still stores and reads its own chunks
        r.engine.store(
            tokens, kvcaches=E.kv_caches(n, geometry=four, seed=62), slot_mapping=torch.arange(n)
        )
        W._wait_for(lambda: not r.backend.put_tasks, "puts finished")
        got, out = _retrieve(r, tokens, four)
        assert got == n
        expected = E.gathered(E.kv_caches(n, geometry=four, seed=62), torch.arange(n))
        assert E.same_bits(E.gathered(out, torch.arange(n)), expected)


# -- MLA and non-MLA engines of one model name ----------------------------------------------


def test_mla_and_non_mla_engines_of_equal_chunk_bytes_miss_and_mla_workers_share(maru_server):
    """Three engines of `maru-tiny`, world size 2: an MLA worker 0 (4 layers x one 128-wide
    latent) stores a prompt; the MLA worker 1 (LMCache's `remote_enable_mla_worker_id_as0`,
    the default with MLA, reads worker 0's keys) reads every token with its bytes; a non-MLA
    worker 0 of equal chunk bytes (2 layers x K/V x 128), which LMCache gives the very keys,
    misses. Mutation: no `set_key_scope` in the adapter (the non-MLA engine's lookup finds
    the whole prompt and its retrieve copies the latent bytes as K/V)."""
    mla = E.Geometry(layers=4, heads=1, head_size=128, mla=True)
    kv = E.Geometry(layers=2)
    assert mla.chunk_bytes == kv.chunk_bytes and E.scope(mla) != E.scope(kv)
    n = 2 * G.chunk
    tokens = E.prompt(n, 71)
    extra = {"save_only_first_rank": False}  # (each rank stores: no broadcast in one process)
    url = maru_server.url

    def engine(geometry: E.Geometry, worker: int) -> E.Engine:
        meta = E.metadata(geometry, world_size=2, worker_id=worker)
        cfg = E.config(url, geometry=geometry, extra_config=extra)
        return E.Engine(cfg, meta, E.CpuKVConnector(geometry))

    with engine(mla, 0) as w:
        w.engine.store(
            tokens, kvcaches=E.kv_caches(n, geometry=mla, seed=71), slot_mapping=torch.arange(n)
        )
        W._wait_for(lambda: not w.backend.put_tasks, "puts finished")
        written = [k.to_string() for _, _, k in w.engine.token_database.process_tokens(tokens)]
        assert w.engine.lookup(tokens) == n
    with engine(kv, 0) as other:
        names = [k.to_string() for _, _, k in other.engine.token_database.process_tokens(tokens)]
        assert names == written  # LMCache's keys name no layout
        assert other.engine.lookup(tokens) == 0
        got, out = _retrieve(other, tokens, kv)
        assert got == 0 and not E.gathered(out, torch.arange(n)).view(torch.int16).any()
    with engine(mla, 1) as peer:
        assert peer.backend._mla_worker_id_as0_mode
        got, out = _retrieve(peer, tokens, mla)
        assert got == n
        expected = E.gathered(E.kv_caches(n, geometry=mla, seed=71), torch.arange(n))
        assert E.same_bits(E.gathered(out, torch.arange(n)), expected)


# -- every verb of the backend names the scoped key ---------------------------------------------


def _key(i: int) -> CacheEngineKey:
    return CacheEngineKey("maru-tiny", 1, 0, 7000 + i, torch.bfloat16)


def test_no_backend_verb_reads_pins_or_removes_the_bare_lmcache_name(maru_server):
    """A plain handler (no scope) stores chunk-sized values under the bare LMCache names of
    two keys, on the backend's chunk grid (an earlier Maru's chunks, or another program's):
    every get, lookup and pin of the backend misses them, its removes leave them, and its
    pins and unpins act on the scoped name only. Mutation: any one of `batch_retrieve`,
    `batch_exists`, `batch_pin`, `batch_unpin`, `batch_delete` without `_in_scope` (e.g.
    `get_blocking` returns the bare name's bytes, `remove` deletes them, or the backend's pin
    stays on the scoped name after its unpin)."""
    with (
        E.Engine(E.config(maru_server.url), E.metadata()) as built,
        MaruHandler(
            server_url=maru_server.url, pool_size="4M", chunk_size_bytes=G.chunk_bytes
        ) as plain,
    ):
        backend = built.backend
        k0, k1 = _key(0), _key(1)
        bare = [k0.to_string(), k1.to_string()]
        scoped = [name + E.scope() for name in bare]
        assert plain.batch_store(bare, [b"\x5a" * G.chunk_bytes] * 2) == [True, True]

        def on_loop(coro):
            return asyncio.run_coroutine_threadsafe(coro, backend.loop).result(10)

        assert [backend.contains(k0), backend.contains(k0, pin=True)] == [False, False]
        assert backend.batched_contains([k0, k1]) == 0
        assert backend.batched_contains([k0, k1], pin=True) == 0
        assert on_loop(backend.batched_async_contains("red-1", [k0, k1], pin=True)) == 0
        assert on_loop(backend.batched_get_non_blocking("red-1", [k0, k1])) == []
        assert backend.get_blocking(k0) is None
        assert backend.batched_get_blocking([k0, k1]) == [None, None]
        assert backend.pin(k1) is False
        assert backend.unpin(k1) is False
        backend.batched_unpin([k0, k1])
        assert backend.remove(k0) is False
        assert backend.batched_remove([k0, k1]) == 0
        assert plain.batch_exists(bare) == [True, True]  # still there, never pinned by it

        # the backend's own value under k0: its pins are on the scoped name alone
        obj = backend.allocate(E.metadata().get_shapes(), E.metadata().get_dtypes(), E.FMT)
        obj.tensor.fill_(1.5)
        want = obj.tensor.contiguous().view(torch.uint8).numpy().tobytes()
        backend.submit_put_task(k0, obj).result(10)
        got = backend.get_blocking(k0)
        assert got is not None and got.tensor.view(torch.uint8).numpy().tobytes() == want
        assert backend.batched_contains([k0, k1], pin=True) == 1
        assert plain.delete(scoped[0]) is False  # pinned by the backend
        assert plain.delete(bare[0]) is True  # the bare name was never pinned
        backend.batched_unpin([k0])
        assert backend.batched_remove([k0, k1]) == 1  # the scoped k0 only
        assert plain.batch_exists([scoped[0], bare[1]]) == [False, True]
        assert plain.delete(bare[1]) is True


# -- keys near the length limit ---------------------------------------------------------------


def test_a_key_that_fits_only_unscoped_is_refused_cleanly(maru_server, caplog):
    """A `CacheEngineKey` whose name is within Maru's 1024 bytes but not with the scope
    after it (a very long model name): the put registers nothing and gives its chunk back,
    with a WARNING, every get and lookup is a miss, nothing raises."""
    with E.Engine(E.config(maru_server.url), E.metadata()) as built:
        backend = built.backend
        scope = backend._handler.key_scope
        probe = CacheEngineKey("m", 1, 0, 1, torch.bfloat16).to_string()
        model = "m" * (1024 - len(probe) + 1 - len(scope) // 2)
        key = CacheEngineKey(model, 1, 0, 1, torch.bfloat16)
        assert len(key.to_string()) <= 1024 < len(key.to_string() + scope)
        meta = E.metadata()
        obj = backend.allocate(meta.get_shapes(), meta.get_dtypes(), E.FMT)
        free = backend._handler.free_chunks()
        done: list[CacheEngineKey] = []
        for future in backend.batched_submit_put_task(
            [key], [obj], on_complete_callback=done.append
        ):
            future.result(10)
        assert done == []
        assert backend._handler.free_chunks() == free + 1  # its chunk came back
        assert "longer than 1024" in caplog.text
        assert backend.get_blocking(key) is None
        assert backend.batched_get_blocking([key]) == [None]
        assert backend.contains(key) is False and backend.batched_contains([key], pin=True) == 0
        assert backend.remove(key) is False
