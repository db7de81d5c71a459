"""What one instance's saved blocks are to readers of other configs (runs in a spawned
process, as `vllm_cpu.workers` does): the red-team tests' check that a reader whose KV
differs never hits a writer's blocks."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any

from vllm_cpu import workers as W


def saved_then_matched(
    model_dir: str, url: str, writer: Callable[[Any], None], readers: Iterable[Any]
) -> dict:
    """Instance A computes and saves prompt 0 (5 full blocks and 3 tokens) with its
    connectors made anew from a copy of its config that `writer` sets (vLLM's scheduler
    itself runs with the plain config); then, for each `VllmConfig` of `readers` (taken one at
    a time, after A's save), a scheduler-side connector says how many tokens of prompt 0
    Maru holds for it: `{"saved": A's saved blocks, "matched": [tokens of each reader]}`."""
    W._vllm_on_path()
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from vllm_cpu.engine import MiniEngine, kv_cache_config

    engine = MiniEngine(model_dir, url)
    config = copy.copy(engine.config)
    writer(config)
    for conn, role in (
        (engine.scheduler.connector, KVConnectorRole.SCHEDULER),
        (engine.worker, KVConnectorRole.WORKER),
    ):
        conn.shutdown()
        conn.__init__(config, role, engine.kv_config)
    engine.worker.register_kv_caches(engine.kv)
    try:
        req = engine.add(W.prompt(0))
        engine.run({req})
        request = engine.request(W.prompt(0))
        out = []
        for reader in readers:
            conn = KVConnectorFactory.create_connector(
                reader, KVConnectorRole.SCHEDULER, kv_cache_config(128)
            )
            try:
                out.append(conn.get_num_new_matched_tokens(request, 0)[0])
            finally:
                conn.shutdown()
        return {"saved": sum(s["save_blocks"] for s in engine.stats), "matched": out}
    finally:
        engine.close()
