"""What the vLLM connector tests run in separate processes: each a `MiniEngine` (vLLM's real
scheduler and connector classes on CPU) with its own MaruHandler. vLLM is imported only here,
inside the functions, so the pytest process itself never imports it."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from pool_places import OTHER, holds_other
from pool_places import places as pool_places

VLLM_SITE = Path(__file__).resolve().parents[2] / "build" / "vllm-site"
BLOCKS = 5
TAIL = 3  # a prompt of 5 full blocks and 3 tokens


def _vllm_on_path() -> None:
    """A spawned process gets its parent's sys.path (without build/vllm-site): add it."""
    if str(VLLM_SITE) not in sys.path:
        sys.path.insert(0, str(VLLM_SITE))


def prompt(i: int) -> list[int]:
    from vllm_cpu.engine import BLOCK

    return [1000 * (i + 1) + t for t in range(BLOCKS * BLOCK + TAIL)]


def store(model_dir: str, url: str, n_prompts: int, extra: dict[str, Any]) -> dict:
    """Instance A computes the prompts (the stand-in forward) and saves their full blocks."""
    _vllm_on_path()
    from vllm_cpu.engine import MiniEngine

    engine = MiniEngine(model_dir, url, **extra)
    try:
        ids = [engine.add(prompt(i)) for i in range(n_prompts)]
        engine.run(set(ids))
        return {
            "connector": type(engine.scheduler.connector).__module__
            + "."
            + type(engine.scheduler.connector).__name__,
            "computed": [len(engine.computed[r]) for r in ids],
            "saved_blocks": sum(s["save_blocks"] for s in engine.stats),
            "save_failed": sum(s["save_failed"] for s in engine.stats),
        }
    finally:
        engine.close()


def load(
    model_dir: str,
    url: str,
    n_prompts: int,
    extra: dict[str, Any],
    evict: int = -1,
    corrupt: int = -1,
    server_gone: bool = False,
) -> dict:
    """Instance B runs the same prompts: the full blocks come from Maru, only the tail is
    computed. With `evict` = i, block i of the first prompt is deleted after the scheduler
    matched it and before the worker loads it (what an eviction in between does); with
    `corrupt` = i, one byte of its value is flipped in the pool file instead; with
    `server_gone`, the worker's reads raise from then on (what a server gone mid-load does
    where no local index answers)."""
    _vllm_on_path()
    from integration.workers import flip_byte
    from maru import MaruHandler
    from maru.common.errors import MaruConnectionError
    from vllm_cpu.engine import MiniEngine

    engine = MiniEngine(model_dir, url, **extra)
    evicted: list[bool] = []

    def gone(*args, **kwargs):
        raise MaruConnectionError("maru-server is gone")

    def before_load(meta) -> None:
        if server_gone and meta.loads:
            engine.worker._handler.read = gone
        if max(evict, corrupt) >= 0 and meta.loads and not evicted:
            with MaruHandler(server_url=url, pool_size="2M", chunk_size_bytes=4096) as h:
                if evict >= 0:
                    evicted.extend(h.batch_delete([meta.loads[0].keys[0][evict]]))
                else:
                    flip_byte(h, meta.loads[0].keys[0][corrupt], at=100)
                    evicted.append(False)

    try:
        ids = [engine.add(prompt(i)) for i in range(n_prompts)]
        engine.run(set(ids), before_load=before_load)
        first = ids[0]
        return {
            "computed": [sorted(engine.computed[r]) for r in ids],
            "match": [engine.blocks_match(r, BLOCKS) for r in ids],
            "diagnosis": [engine.blocks_diagnosis(r, BLOCKS) for r in ids],
            "load_errors": sorted(engine.load_errors),
            "failed_recving": sorted(engine.failed_recving),
            "first_blocks": engine.block_ids[first][:BLOCKS],
            "evicted": evicted,
            "loads": sum(s["loads"] for s in engine.stats),
            "loaded_blocks": sum(s["load_blocks"] for s in engine.stats),
            "hits_by_source": engine.hits_by_source,
        }
    finally:
        engine.close()


def reset_then_run(model_dir: str, url: str) -> dict:
    """One instance computes and saves a prompt, resets its prefix cache with the connector's
    (`reset_prefix_cache(reset_connector=True)`: what vLLM asks after a weight update), runs
    the prompt again, then resets only its own prefix cache and runs it a third time: blocks
    loaded from Maru each time."""
    _vllm_on_path()
    from vllm_cpu.engine import MiniEngine

    engine = MiniEngine(model_dir, url)
    loaded: list[int] = []
    reset: list[bool] = []
    try:
        for reset_connector in (None, True, False):
            if reset_connector is not None:
                reset.append(engine.scheduler.reset_prefix_cache(reset_connector=reset_connector))
            before = sum(s["load_blocks"] for s in engine.stats)
            engine.run({engine.add(prompt(0))})
            loaded.append(sum(s["load_blocks"] for s in engine.stats) - before)
        return {"loaded": loaded, "reset": reset}
    finally:
        engine.close()


def aborted_while_loading(model_dir: str, url: str, hold_s: float) -> dict:
    """Request R computes 4 of its prompt's blocks (chunked prefill) and saves them; vLLM's
    `reset_prefix_cache(reset_running_requests=True)` preempts R and empties the local prefix
    cache, so R's next schedule matches its own saved blocks in Maru: an async load, held
    `hold_s` on the load pool's one thread. R is aborted while that load waits. What the
    scheduler did with R's blocks meanwhile, and whether any step raised."""
    _vllm_on_path()
    import time

    from vllm.v1.request import RequestStatus

    from vllm_cpu.engine import BLOCK, MiniEngine

    engine = MiniEngine(
        model_dir, url, max_num_batched_tokens=2 * BLOCK, maru_load_threads=1, num_blocks=32
    )
    pool = engine.scheduler.kv_cache_manager.block_pool
    out: dict[str, Any] = {"raised": None}
    try:
        r = engine.add(prompt(0), max_tokens=4)
        engine.step()
        engine.step()  # 4 blocks computed, their saves queued
        with engine.worker._lock:
            saving = list(engine.worker._saving)
        for future in saving:
            future.result(timeout=30)
        engine.scheduler.reset_prefix_cache(reset_running_requests=True)
        gate = engine.worker._load_pool.submit(time.sleep, hold_s)  # holds the load thread
        engine.step()  # R matched in Maru: its load queued behind the gate
        request = engine.scheduler.requests[r]
        out["loading"] = request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        mine = {b for ids in engine.scheduler.kv_cache_manager.get_block_ids(r) for b in ids}
        engine.scheduler.finish_requests(r, RequestStatus.FINISHED_ABORTED)
        # steps while the load is still held: R's blocks must stay R's (not free)
        freed_early = False
        try:
            while not gate.done():
                engine.step()
                free = {b.block_id for b in pool.free_block_queue.get_all_free_blocks()}
                freed_early |= bool(mine & free)
                time.sleep(0.01)
            # then until the worker has reported the load too (other requests keep a real
            # engine stepping: the scheduler's having none left does not end it)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                engine.step()
                with engine.worker._lock:
                    pending = engine.worker._recving or engine.worker._finished_reqs
                if not pending and not engine.scheduler.has_requests():
                    break
                time.sleep(0.01)
        except Exception as exc:  # (what vLLM's engine core would die of)
            out["raised"] = f"{type(exc).__name__}: {exc}"
        out["held_blocks"] = len(mine)
        out["freed_while_loading"] = freed_early
        out["gate_held"] = gate.done()
        out["requests_left"] = len(engine.scheduler.requests)
        out["free_blocks"] = pool.get_num_free_blocks()
        out["total_blocks"] = pool.num_gpu_blocks - 1  # (less the null block)
        return out
    finally:
        engine.close()


def matched_across_ranks(model_dir: str, url: str, parallel: str = "tp") -> dict:
    """The scheduler side of a TP 2 (`parallel` "tp") or PP 2 ("pp") instance: a prompt's
    blocks count as stored only where every rank's (stage's) shard is. Rank 0's five blocks
    are stored, the other rank's first three; then its last two too. Returns what
    `get_num_new_matched_tokens` said each time."""
    _vllm_on_path()
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from maru import MaruHandler
    from vllm_cpu.engine import BLOCK, MiniEngine, kv_cache_config, vllm_config

    config = vllm_config(model_dir, url)
    if parallel == "tp":
        config.parallel_config.tensor_parallel_size = 2
        other = (0, 0, 1)  # (PP stage, PCP rank, TP rank)
    else:
        config.parallel_config.pipeline_parallel_size = 2
        other = (1, 0, 0)
    connector = KVConnectorFactory.create_connector(
        config, KVConnectorRole.SCHEDULER, kv_cache_config(64)
    )
    engine = None
    try:
        engine = MiniEngine(model_dir, url)  # (for its Request and block hasher)
        request = engine.scheduler.requests[engine.add(prompt(0))]
        hashes = request.block_hashes[:BLOCKS]
        said = []
        with MaruHandler(server_url=url, pool_size="2M", chunk_size_bytes=4096) as h:
            stores = (((0, 0, 0), range(BLOCKS)), (other, range(3)), (other, range(3, BLOCKS)))
            for rank, blocks in stores:
                keys = [connector._prefix(0, rank) + hashes[b].hex() for b in blocks]
                assert all(h.batch_store(keys, [b"x"] * len(keys)))
                if rank == other:
                    said.append(connector.get_num_new_matched_tokens(request, 0)[0])
            said.append(connector.get_num_new_matched_tokens(request, BLOCK)[0])
        return {"said": said, "block": BLOCK, "ranks": len(connector._ranks())}
    finally:
        if engine is not None:
            engine.close()
        connector.shutdown()  # (closes its handler)


def pp_stage(model_dir: str, url: str, stage: int, init_method: str) -> dict:
    """Pipeline stage `stage` of 2 (vLLM's real process groups, gloo): the worker of instance
    A computes the prompt's KV for this stage's layers and saves it; once both stages have
    (a barrier), instance B's worker of this stage runs the prompt. Each process runs its
    own scheduler: both ask for every stage's keys."""
    _vllm_on_path()
    import torch.distributed as dist
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import (
        get_pp_group,
        init_distributed_environment,
        initialize_model_parallel,
    )

    from vllm_cpu.engine import MiniEngine, vllm_config

    with set_current_vllm_config(vllm_config(model_dir, url, pp=2)):
        init_distributed_environment(
            world_size=2,
            rank=stage,
            distributed_init_method=init_method,
            local_rank=stage,
            backend="gloo",
        )
        initialize_model_parallel(1, 2, backend="gloo")
    out: dict[str, Any] = {"stage": get_pp_group().rank_in_group}
    for name in ("a", "b"):
        engine = MiniEngine(model_dir, url, stage=stage, pp=2)
        try:
            req = engine.add(prompt(0))
            engine.run({req})
            out[name] = {
                "computed": sorted(engine.computed[req]),
                "match": engine.blocks_match(req, BLOCKS),
                "saved_blocks": sum(s["save_blocks"] for s in engine.stats),
                "loaded_blocks": sum(s["load_blocks"] for s in engine.stats),
                "load_errors": sorted(engine.load_errors),
            }
        finally:
            engine.close()
        dist.barrier()  # A's saves of both stages are in before either B starts
    return out


def preempted_save(model_dir: str, url: str, sleep_s: float) -> dict:
    """Request R's blocks are saved while vLLM's scheduler preempts R, and handed to another
    request in a later step (priority policy: R is the lowest). The save pool's one thread is
    held `sleep_s` first, so R's save cannot start before that step's forward writes the
    blocks, unless the connector waits for it. Instance B then loads R's prompt."""
    _vllm_on_path()
    import time

    from vllm_cpu.engine import BLOCK, MiniEngine

    # 17 blocks, 96 tokens a step. R's prompt takes 6; S (higher priority, 160 tokens) is
    # admitted with all the 11 left. Both decode; the first to need a block (R, at token 96)
    # has none: vLLM preempts R, the lowest priority, and frees R's blocks. T (80 tokens,
    # highest priority) then takes them in one step.
    engine = MiniEngine(
        model_dir,
        url,
        num_blocks=18,
        policy="priority",
        max_num_batched_tokens=96,
        maru_save_threads=1,
    )
    try:
        gate = engine.worker._save_pool.submit(time.sleep, sleep_s)  # holds the save thread
        r = engine.add(prompt(0), max_tokens=40, priority=2)
        engine.step()
        saved = set(engine.block_ids[r][:BLOCKS])  # R's full blocks: their save is queued
        s = engine.add([50_000 + t for t in range(10 * BLOCK)], max_tokens=40, priority=1)
        result: dict[str, Any] = {"preempted": False}
        for _ in range(40):
            if r in (engine.step().preempted_req_ids or ()):
                result["preempted"] = True
                break
        t = engine.add([60_000 + t for t in range(5 * BLOCK)], max_tokens=1, priority=0)
        result["save_pending"] = not gate.done()  # R's save has not started yet
        start = time.monotonic()
        engine.step()
        result["step_s"] = time.monotonic() - start
        result["reused"] = sorted(saved & set(engine.block_ids.get(t, ())))
        engine.run({r, s, t})
        result["saved_blocks"] = sum(st["save_blocks"] for st in engine.stats)
        return result
    finally:
        engine.close()


def value_bytes_by_layout() -> dict:
    """A block's value, gathered through the connector's segments of a `[B, H, N, C]` view,
    for every physical layout of the view, every value order and kernel block split: the
    block's logical contents in the value order, whatever the memory's (no copy runs)."""
    _vllm_on_path()
    import ctypes
    import itertools

    import torch
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from maru_vllm.layout import _layer_segments, value_order

    blocks, heads, tokens, content = 5, 3, 16, 8
    checked, wrong = 0, []
    for memory, value in itertools.product(list(KVCacheLayout), repeat=2):
        for ratio in (1, 2, 4):  # kernel blocks per block
            shape = (blocks * ratio, heads, tokens // ratio, content)
            physical = memory.layer_view_order
            raw = torch.randn(*[shape[d] for d in physical], dtype=torch.float16)
            view = raw.permute(*[physical.index(d) for d in range(4)])  # logical [B, H, N, C]
            order = value_order(value)
            segments = _layer_segments(view, blocks, order)
            for b in range(blocks):
                got = b"".join(ctypes.string_at(a + b * st, n) for a, st, n in segments)
                block = view[b * ratio : (b + 1) * ratio]  # [kernel block, H, N, C]
                logical = block.permute(1, 0, 2, 3).reshape(heads, tokens, content)
                want = logical.permute(*[d - 1 for d in order]).contiguous().numpy().tobytes()
                checked += 1
                if got != want:
                    wrong.append((memory.name, value.name, ratio, b))
    return {"checked": checked, "wrong": wrong}


def connector_options(model_dir: str, url: str, extra: dict[str, Any]) -> dict:
    """A worker-side connector made through vLLM's factory with `extra` as its
    `kv_connector_extra_config` keys: whether it loads asynchronously, or its error."""
    _vllm_on_path()
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from vllm_cpu.engine import kv_cache_config, vllm_config

    try:  # (vLLM's VllmConfig already builds a connector's scheduler side: its errors too)
        config = vllm_config(model_dir, url, **extra)
        connector = KVConnectorFactory.create_connector(
            config, KVConnectorRole.WORKER, kv_cache_config(8)
        )
    except Exception as exc:
        return {"refused": f"{type(exc).__name__}: {exc}"}
    try:
        return {"async_load": connector._async_load}
    finally:
        connector.shutdown()


def server_gone(model_dir: str, url: str, server_pid: int) -> dict:
    """A clear error at start where maru-server is not there; where it dies after the
    start (SIGKILL, `server_pid`: the test's own server), a request that arrives is a miss
    and computed, never an error out of vLLM's scheduler (which would end the engine)."""
    _vllm_on_path()
    import os
    import signal
    import socket
    import time

    from vllm_cpu.engine import MiniEngine

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        closed = f"tcp://127.0.0.1:{sock.getsockname()[1]}"
    out: dict[str, Any] = {}
    try:
        MiniEngine(model_dir, closed).close()
        out["start"] = "started"
    except Exception as exc:
        out["start"] = f"{type(exc).__name__}: {exc}"
    engine = MiniEngine(model_dir, url)
    try:
        os.kill(server_pid, signal.SIGKILL)
        req = engine.add(prompt(0))
        start = time.monotonic()
        try:
            engine.run({req})
            out["raised"] = None
        except Exception as exc:
            out["raised"] = f"{type(exc).__name__}: {exc}"
        out["run_s"] = time.monotonic() - start
        out["computed"] = sorted(engine.computed[req])
        out["finished"] = req in engine.finished
        return out
    finally:
        engine.close()


def kv_cache_on_a_device(model_dir: str, url: str) -> dict:
    """A worker connector handed KV caches outside CPU memory. There is no GPU here: vLLM's
    `allocate_kv_cache` on torch's `meta` device stands in for a GPU's (tensors with shapes
    and strides whose addresses are not host memory). What `register_kv_caches` says."""
    _vllm_on_path()
    import torch
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    from vllm_cpu.engine import BLOCK, kv_cache_config, vllm_config

    config = vllm_config(model_dir, url)
    kv_config = kv_cache_config(8)
    connector = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv_config)
    try:
        kv = allocate_kv_cache(kv_config, torch.device("meta"), KVCacheLayout.LBNHC, [BLOCK])
        try:
            connector.register_kv_caches(kv)
            return {"refused": None}
        except Exception as exc:
            return {"refused": f"{type(exc).__name__}: {exc}"}
    finally:
        connector.shutdown()


def sliding_window(model_dir: str, url: str) -> dict:
    """A hybrid model (full attention + a sliding window of 2 blocks, `kv_cache_config`).
    Instance A computes the prompt in chunks of 2 blocks (vLLM frees its window's earlier
    blocks as it goes) and saves it. vLLM's own prefix cache in A: its hit with the window
    group's blocks 0..2 evicted. B loads the prompt (vLLM gives the window group the null
    block, block 0, for blocks 0..2: before the window of a 5-block hit); the null block's
    bytes before and after. Then the window group's values of blocks 0..2 are deleted from
    Maru and C loads the prompt."""
    _vllm_on_path()
    from maru import MaruHandler
    from vllm_cpu.engine import BLOCK, MiniEngine

    hybrid: dict[str, Any] = {"hybrid": True, "window": 2 * BLOCK}
    out: dict[str, Any] = {}
    a = MiniEngine(model_dir, url, max_num_batched_tokens=2 * BLOCK, **hybrid)
    try:
        req = a.add(prompt(0))
        a.run({req})
        out["a_saved"] = sum(s["save_blocks"] for s in a.stats)
        out["a_computed"] = len(a.computed[req])
        a.scheduler.kv_cache_manager.evict_blocks(set(a.group_blocks[req][1][:3]))
        probe = a.request(prompt(0))
        out["vllm_local_hit"] = a.scheduler.kv_cache_manager.get_computed_blocks(probe)[1]
    finally:
        a.close()
    for name in ("b", "c"):
        engine = MiniEngine(model_dir, url, **hybrid)
        try:
            null = {layer: engine.kv[layer][0].clone() for layer in engine.layers}
            req = engine.add(prompt(0))
            engine.run({req})
            out[name] = {
                "null_unchanged": all(torch_equal(engine.kv[n][0], v) for n, v in null.items()),
                "window_blocks": engine.group_blocks[req][1][:BLOCKS],
                "computed": sorted(engine.computed[req]),
                "match": engine.blocks_match(req, BLOCKS),
                "loaded_blocks": sum(s["load_blocks"] for s in engine.stats),
                "load_errors": sorted(engine.load_errors),
                "failed_recving": sorted(engine.failed_recving),
            }
            if name == "b":  # the window group's values before the window: gone
                hashes = engine.request(prompt(0)).block_hashes[:3]
                keys = [engine.scheduler.connector._prefix(1, (0, 0, 0)) + h.hex() for h in hashes]
                with MaruHandler(server_url=url, pool_size="2M", chunk_size_bytes=4096) as h:
                    out["deleted"] = h.batch_delete(keys)
        finally:
            engine.close()
    return out


def torch_equal(x: Any, y: Any) -> bool:
    """Byte for byte (any dtype)."""
    import torch

    return bool(torch.equal(x.view(torch.uint8), y.view(torch.uint8)))


def bad_block_ids(model_dir: str, url: str, bad: int) -> dict:
    """One instance computes and saves a prompt (the real flow). Then its worker connector is
    handed a load and a save as vLLM's scheduler metadata carries them (`Transfer`), their
    block ids valid but one, `bad` (outside the KV cache: -1, or the number of blocks). The
    handler's `read` and `put` are watched: a destination or source that is not a segment of
    one of the KV cache's blocks is counted and not copied (so that the fault, before the
    connector checks, hurts nothing here). What the load reports and the save stores; and a
    load of the same blocks with valid ids only, as a control."""
    _vllm_on_path()
    import numpy as np

    from maru import MaruHandler
    from maru_vllm.connector import Transfer
    from vllm_cpu.engine import MiniEngine

    engine = MiniEngine(model_dir, url)
    try:
        req = engine.add(prompt(0))
        engine.run({req})
        worker = engine.worker
        handler = worker._handler_for()
        layout = worker._layouts[0]
        blocks = engine.kv_config.num_blocks
        # every segment of every block of the KV cache: what a copy may touch
        legit = set(
            (layout.base[None, :] + np.arange(blocks)[:, None] * layout.stride[None, :])
            .ravel()
            .tolist()
        )
        outside = {"read": 0, "put": 0}
        real_read, real_put = handler.read, handler.put

        def foreign(addresses: Any) -> int:
            return sum(a not in legit for a in np.asarray(addresses).ravel().tolist())

        def read(keys, buffers, sizes, *, length, prefix=""):
            count = foreign(buffers)
            if count:
                outside["read"] += count
                return [False] * len(keys)
            return real_read(keys, buffers, sizes, length=length, prefix=prefix)

        def put(puts, *, behind=False):
            count = sum(foreign(p.copy.buffers) for p in puts)
            if count:
                outside["put"] += count
                for p in puts:
                    p.results, p.outcomes = [False] * len(p.keys), None
                return None
            return real_put(puts, behind=behind)

        handler.read, handler.put = read, put
        prefix = engine.scheduler.connector._prefix(0, (0, 0, 0))
        stored = [prefix + h.hex() for h in engine.request(prompt(0)).block_hashes[:BLOCKS]]
        fresh = [prefix + h.hex() for h in engine.request(prompt(1)).block_hashes[:BLOCKS]]
        ids = list(engine.block_ids[req][:BLOCKS])
        with_bad = [*ids[:2], bad, *ids[3:]]
        out: dict[str, Any] = {"ids": ids, "with_bad": with_bad}

        worker._load(Transfer("valid-load", [stored], [ids]))
        out["valid_load_errors"] = sorted(worker.get_block_ids_with_load_errors())
        worker._load(Transfer("bad-load", [stored], [with_bad]))
        out["bad_load_errors"] = sorted(worker.get_block_ids_with_load_errors())
        worker._save(Transfer("bad-save", [fresh], [with_bad]))
        stats = worker.get_kv_connector_stats()
        out["stats"] = stats.reduce() if stats is not None else {}
        out["outside"] = outside
        with MaruHandler(server_url=url, pool_size="2M", chunk_size_bytes=4096) as h:
            out["fresh_stored"] = h.batch_exists(fresh)
        out["match"] = engine.blocks_match(req, BLOCKS)
        return out
    finally:
        engine.close()


# -- across maru-server restarts and evictions (integration/test_vllm_restart_trust.py) --------


class _Server:
    """The test process's hands on its maru-server (a `multiprocessing.connection` to a
    thread there): `restart(no_restore)` SIGKILLs it and starts it again on the same port,
    pool and state dir, and returns once it serves. Any thread of this process may ask."""

    def __init__(self, address: tuple[str, int], authkey: bytes):
        import threading
        from multiprocessing.connection import Client

        self._conn = Client(address, authkey=authkey)
        self._lock = threading.Lock()
        self.restarts = 0

    def restart(self, no_restore: bool) -> None:
        with self._lock:
            self._conn.send(("restart", no_restore))
            answer = self._conn.recv()
            if answer != "ok":
                raise RuntimeError(f"restart failed: {answer}")
            self.restarts += 1

    def close(self) -> None:
        self._conn.close()


def _other_writes(
    url: str, places: list[tuple[str, int] | None], size: int, most: int, salt: str
) -> tuple[list[str], list[bool]]:
    """Another instance stores values of `size` bytes, all `OTHER`, up to `most` of them,
    until every place in `places` holds one (pages rewritten); (the keys it stored, per
    place whether it was rewritten)."""
    from maru import MaruHandler

    value = bytes([OTHER]) * size
    stored: list[str] = []
    tried, batch = 0, 128
    with MaruHandler(
        server_url=url, pool_size="64M", chunk_size_bytes=size, timeout_ms=10_000
    ) as h:
        while tried < most:
            keys = [f"other-{salt}-{tried + i}" for i in range(batch)]
            tried += batch
            stored += [k for k, ok in zip(keys, h.batch_store(keys, [value] * batch)) if ok]
            if all(holds_other(p, size) for p in places if p is not None):
                break
    return stored, [holds_other(p, size) for p in places]


def _value_bytes(engine: Any, block: int) -> bytes:
    """Block `block`'s value as the connector stores it (group 0), from the engine's KV."""
    import ctypes

    layout = engine.worker._layouts[0]
    return b"".join(
        ctypes.string_at(int(base) + block * int(stride), int(n))
        for base, stride, n in zip(layout.base, layout.stride, layout.length)
    )


def _keys_of(engine: Any, tokens: list[int]) -> list[str]:
    """The keys (group 0, rank 0) of a prompt's full blocks."""
    from vllm_cpu.engine import BLOCK

    prefix = engine.scheduler.connector._prefix(0, (0, 0, 0))
    hashes = engine.request(tokens).block_hashes
    return [prefix + h.hex() for h in hashes[: len(tokens) // BLOCK]][:BLOCKS]


def _in_maru(url: str, keys: list[str], want: list[bytes] | None) -> dict[str, list]:
    """What another instance finds under `keys`: which exist, which hold other bytes than
    `want` (their own; None: not compared)."""
    from maru import MaruHandler

    with MaruHandler(server_url=url, pool_size="2M", chunk_size_bytes=4096) as h:
        infos = h.batch_retrieve(keys)
        return {
            "exists": [i is not None for i in infos],
            "wrong": [
                j for j, (i, w) in enumerate(zip(infos, want or [])) if i and bytes(i.view) != w
            ],
        }


def _outcome(engine: Any, req: str, loads_before: int = 0) -> dict[str, Any]:
    """What a request got: its blocks (group 0), which failed to load, which positions the
    stand-in model computed, and whether each block holds its own KV now."""
    blocks = engine.block_ids[req][:BLOCKS]
    return {
        "blocks": blocks,
        "load_errors": sorted(set(blocks) & engine.load_errors),
        "computed": sorted(engine.computed[req]),
        "match": engine.blocks_match(req, BLOCKS),
        "loaded_blocks": sum(s["load_blocks"] for s in engine.stats) - loads_before,
    }


def evicted_between_match_and_load(model_dir: str, url: str, pool_bytes: int, sync: bool) -> dict:
    """A stores prompt 0; B's scheduler matches its 5 blocks; before B's worker loads them,
    blocks 2.. are deleted and another instance stores values (`OTHER` bytes) until the
    server evicts the rest too and every old page holds the other's bytes. Then B's load
    runs. Then B runs prompt 0 again (its own prefix cache reset): the connector must ask
    the server anew (no cached match, no failed-load memory turning a miss into a hit)."""
    _vllm_on_path()
    from maru import MaruHandler
    from vllm_cpu.engine import MiniEngine

    out: dict[str, Any] = {}
    a = MiniEngine(model_dir, url)
    try:
        req = a.add(prompt(0))
        a.run({req})
        out["a_saved"] = sum(s["save_blocks"] for s in a.stats)
    finally:
        a.close()
    b = MiniEngine(model_dir, url, maru_async_load=not sync)
    seen: dict[str, Any] = {}

    def before_load(meta: Any) -> None:
        if not meta.loads or seen:
            return
        keys = meta.loads[0].keys[0]
        with MaruHandler(server_url=url, pool_size="2M", chunk_size_bytes=4096) as h:
            places = pool_places(h, keys)
            seen["deleted"] = h.batch_delete(keys[2:])
        size = b.worker._layouts[0].value_size
        others, seen["rewritten"] = _other_writes(
            url, places, size, 2 * pool_bytes // size, "evict"
        )
        seen["other_stored"] = len(others)
        with MaruHandler(server_url=url, pool_size="2M", chunk_size_bytes=4096) as h:
            seen["still_there"] = h.batch_exists(keys)

    try:
        req = b.add(prompt(0))
        b.run({req}, before_load=before_load)
        out.update(seen)
        out["first"] = _outcome(b, req)
        out["b_saved"] = sum(s["save_blocks"] for s in b.stats)
        out["reads_locally"] = b.worker._handler_for().reads_locally
        want = [_value_bytes(b, blk) for blk in b.block_ids[req][:BLOCKS]]
        out["maru_after"] = _in_maru(url, _keys_of(b, prompt(0)), want)
        b.scheduler.reset_prefix_cache()
        before = sum(s["load_blocks"] for s in b.stats)
        again = b.add(prompt(0))
        b.run({again})
        out["again"] = _outcome(b, again, before)
        return out
    finally:
        b.close()


def restart_under_engine(
    model_dir: str,
    url: str,
    pool_bytes: int,
    address: tuple[str, int],
    authkey: bytes,
    no_restore: bool,
) -> dict:
    """maru-server SIGKILLed and started again (restored, or `no_restore`: a new pool
    generation) while instance B runs, at three points, another instance writing `OTHER`
    bytes right after each restart (the pages old keys lay in, in a new generation):
    1. between B's match of prompt 0 and its worker's load;
    2. during the copy of B's (async) load of prompt 1, after its lookup was answered;
    3. during the copy of B's save of prompt 5, after its chunks were reserved.
    Then what another instance finds under prompt 5's and prompt 2's keys (A's, untouched by
    B), and a fresh instance C running prompts 0, 1, 2 and 5."""
    _vllm_on_path()
    import logging

    import maru.client.handler as client_handler
    import maru_vllm.connector as connector
    from maru import MaruHandler
    from vllm_cpu.engine import MiniEngine

    server = _Server(address, authkey)
    out: dict[str, Any] = {"no_restore": no_restore}
    a = MiniEngine(model_dir, url)
    try:
        reqs = [a.add(prompt(i)) for i in range(3)]
        a.run(set(reqs))
        out["a_saved"] = sum(s["save_blocks"] for s in a.stats)
        old = {i: _keys_of(a, prompt(i)) for i in range(3)}
        with MaruHandler(server_url=url, pool_size="2M", chunk_size_bytes=4096) as h:
            places = {i: pool_places(h, keys) for i, keys in old.items()}
    finally:
        a.close()
    b = MiniEngine(model_dir, url)
    size = b.worker._layouts[0].value_size
    armed = {"match": False, "load": False, "save": False}
    other: dict[str, Any] = {}

    def restart(point: str, where: list, most: int) -> None:
        armed[point] = False
        server.restart(no_restore)
        other[point] = _other_writes(url, where, size, most, point)

    def before_load(meta: Any) -> None:
        if armed["match"] and meta.loads:
            restart("match", places[0], 512)

    real_copy = client_handler.copy_values

    def copy_values(*args: Any, **kwargs: Any) -> Any:
        if armed["load"]:  # (the lookup is answered, its lease taken: the copy begins)
            restart("load", places[1], 512)
        return real_copy(*args, **kwargs)

    real_values_at = connector.values_at

    def values_at(buffers: Any, sizes: Any) -> Any:
        copy = real_values_at(buffers, sizes)

        def copy_in(*args: Any) -> Any:  # (called once the chunks are reserved)
            if armed["save"]:
                restart("save", [], pool_bytes // size // 2)  # (half the pool)
            return copy(*args)

        return copy_in

    said: list[str] = []  # what the handler logged (warnings)

    class Said(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    logging.getLogger("maru").addHandler(Said(logging.WARNING))
    client_handler.copy_values = copy_values
    connector.values_at = values_at
    try:
        armed["match"] = True
        r0 = b.add(prompt(0))
        b.run({r0}, before_load=before_load)
        out["match"] = _outcome(b, r0)
        a = MiniEngine(model_dir, url)  # prompt 1 in this generation (a new one: computed)
        try:
            a.run({a.add(prompt(1))})
        finally:
            a.close()
        armed["load"] = True
        before = sum(s["load_blocks"] for s in b.stats)
        r1 = b.add(prompt(1))
        b.run({r1})
        out["load"] = _outcome(b, r1, before)
        out["load_restarted"] = not armed["load"]
        armed["save"] = True
        del said[:]
        r5 = b.add(prompt(5))
        b.run({r5})
        out["save_log"] = "\n".join(said)
        out["save"] = _outcome(b, r5)
        out["save_restarted"] = not armed["save"]
        out["save_stats"] = {
            k: sum(s[k] for s in b.stats) for k in ("save_blocks", "save_failed", "saves")
        }
        want5 = [_value_bytes(b, blk) for blk in b.block_ids[r5][:BLOCKS]]
        out["maru_5"] = _in_maru(url, _keys_of(b, prompt(5)), want5)
        want1 = [_value_bytes(b, blk) for blk in b.block_ids[r1][:BLOCKS]]
        out["maru_1"] = _in_maru(url, old[1], want1)
        out["maru_2"] = _in_maru(url, old[2], None)
        out["other"] = {k: (len(keys), flags) for k, (keys, flags) in other.items()}
        others = [k for keys, _ in other.values() for k in keys]
        out["others"] = _in_maru(url, others, [bytes([OTHER]) * size] * len(others))
        out["restarts"] = server.restarts
        out["reads_locally"] = b.worker._handler_for().reads_locally
    finally:
        connector.values_at = real_values_at
        client_handler.copy_values = real_copy
        b.close()
        server.close()
    c = MiniEngine(model_dir, url)
    try:
        for i in (0, 1, 2, 5):
            before = sum(s["load_blocks"] for s in c.stats)
            req = c.add(prompt(i))
            c.run({req})
            out[f"c{i}"] = _outcome(c, req, before)
        return out
    finally:
        c.close()
