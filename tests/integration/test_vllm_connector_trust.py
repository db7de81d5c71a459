"""`maru_vllm.MaruKVConnector` where vLLM's scheduler and the connector's transfers cross:
a request finished while its load still copies, and what the workers are told about which
blocks they may copy into. vLLM 0.33's real scheduler, requests and KV cache on CPU
(`tests/vllm_cpu/engine.MiniEngine`), one process per engine, against a real `maru-server`.

vLLM lives in build/vllm-site (scripts/install_vllm_cpu.sh); skipped without it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

from .workers import run_processes

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
VLLM_SITE = ROOT / "build" / "vllm-site"
sys.path.insert(0, str(TESTS))

if not (VLLM_SITE / "vllm").is_dir():
    pytest.skip("vLLM not installed (scripts/install_vllm_cpu.sh)", allow_module_level=True)

from sglang_cpu.tiny_model import build_tiny_model  # noqa: E402
from vllm_cpu import workers as W  # noqa: E402

DEADLINE = 240


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """A tiny local model: vLLM's ModelConfig reads its config (no downloads)."""
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny")))


@pytest.fixture
def vllm_env(monkeypatch):
    """The spawned processes import vLLM from build/vllm-site, with the torchvision shim
    (tests/vllm_cpu/sitecustomize.py), as tests/integration/test_vllm_connector.py's."""
    paths = [str(TESTS / "vllm_cpu"), str(VLLM_SITE)]
    old = [p for p in os.environ.get("PYTHONPATH", "").split(":") if p]
    monkeypatch.setenv("PYTHONPATH", ":".join(paths + old))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


# -- what the spawned processes run ----------------------------------------------------------


def _aborted_while_loading(model_dir: str, url: str, hold_s: float) -> dict:
    """Request R computes 4 of its prompt's blocks (chunked prefill) and saves them; vLLM's
    `reset_prefix_cache(reset_running_requests=True)` preempts R and empties the local prefix
    cache, so R's next schedule matches its own saved blocks in Maru: an async load, held
    `hold_s` on the load pool's one thread. R is aborted while that load waits. What the
    scheduler did with R's blocks meanwhile, and whether any step raised."""
    W._vllm_on_path()
    import time

    from vllm.v1.request import RequestStatus

    from vllm_cpu.engine import BLOCK, MiniEngine

    engine = MiniEngine(
        model_dir, url, max_num_batched_tokens=2 * BLOCK, maru_load_threads=1, num_blocks=32
    )
    pool = engine.scheduler.kv_cache_manager.block_pool
    out: dict[str, Any] = {"raised": None}
    try:
        r = engine.add(W.prompt(0), max_tokens=4)
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


# -- the tests ---------------------------------------------------------------------------------


def test_a_request_aborted_while_its_load_copies_keeps_its_blocks_until_the_load_ends(
    maru_server_factory, model_dir, vllm_env
):
    """A request that saved blocks, was preempted and then matched its own blocks in Maru is
    aborted while that load is still copying. vLLM holds its blocks until the load is
    reported done; the connector must report the request once, when both its saves and its
    load are done: not as saved before the load ends (vLLM frees the blocks the load is
    writing, and hands them to other requests), and not a second time (vLLM's scheduler
    asserts the request is still there: the engine core dies)."""
    server = maru_server_factory(pool_size="256M")
    job = (_aborted_while_loading, (model_dir, server.url, 2.0))
    (r,) = run_processes([job], DEADLINE)
    assert r["loading"], r  # the scenario happened as meant
    assert r["raised"] is None, r
    assert not r["freed_while_loading"], str(r)
    assert r["requests_left"] == 0 and r["free_blocks"] == r["total_blocks"], r
