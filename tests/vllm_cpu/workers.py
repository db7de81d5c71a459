"""What the vLLM connector tests run in separate processes: each a `MiniEngine` (vLLM's real
scheduler and connector classes on CPU) with its own MaruHandler. vLLM is imported only here,
inside the functions, so the pytest process itself never imports it."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

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
) -> dict:
    """Instance B runs the same prompts: the full blocks come from Maru, only the tail is
    computed. With `evict` = i, block i of the first prompt is deleted after the scheduler
    matched it and before the worker loads it (what an eviction in between does); with
    `corrupt` = i, one byte of its value is flipped in the pool file instead."""
    _vllm_on_path()
    from integration.workers import flip_byte
    from maru import MaruHandler
    from vllm_cpu.engine import MiniEngine

    engine = MiniEngine(model_dir, url, **extra)
    evicted: list[bool] = []

    def before_load(meta) -> None:
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
            "load_errors": sorted(engine.load_errors),
            "first_blocks": engine.block_ids[first][:BLOCKS],
            "evicted": evicted,
            "loads": sum(s["loads"] for s in engine.stats),
            "loaded_blocks": sum(s["load_blocks"] for s in engine.stats),
            "hits_by_source": engine.hits_by_source,
        }
    finally:
        engine.close()


def matched_across_ranks(model_dir: str, url: str) -> dict:
    """The scheduler side of a TP 2 instance: a prompt's blocks count as stored only where
    every rank's shard is. Rank 0's five blocks are stored, rank 1's first three; then rank
    1's last two too. Returns what `get_num_new_matched_tokens` said each time."""
    _vllm_on_path()
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from maru import MaruHandler
    from vllm_cpu.engine import BLOCK, MiniEngine, kv_cache_config, vllm_config

    config = vllm_config(model_dir, url)
    config.parallel_config.tensor_parallel_size = 2
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
            for rank, blocks in ((0, range(BLOCKS)), (1, range(3)), (1, range(3, BLOCKS))):
                keys = connector._keys([hashes[b] for b in blocks], 0, rank)
                assert all(h.batch_store(keys, [b"x"] * len(keys)))
                if rank == 1:
                    said.append(connector.get_num_new_matched_tokens(request, 0)[0])
            said.append(connector.get_num_new_matched_tokens(request, BLOCK)[0])
        return {"said": said, "block": BLOCK, "tp": connector._tp_size}
    finally:
        if engine is not None:
            engine.close()
        connector.shutdown()  # (closes its handler)
