"""`maru_vllm.MaruKVConnector` trusts no block id it is handed: an id outside vLLM's KV cache
(which vLLM's block pool never gives, but a bad one would make a load write outside the KV
cache, or a save store other memory under a block's key: a wrong page, a hit for every
instance) fails that request's load (its blocks reported to vLLM as load errors) or skips its
save, cleanly. vLLM 0.33's real classes on CPU (`tests/vllm_cpu`), a real `maru-server`.

vLLM lives in build/vllm-site (scripts/install_vllm_cpu.sh); skipped without it.
"""

from __future__ import annotations

import pytest

from . import test_vllm_connector as base  # (skips this module too without vLLM)
from .workers import run_processes

pytestmark = pytest.mark.vllm
W = base.W
model_dir = base.model_dir  # (its fixtures: a tiny model, vLLM's environment)
vllm_env = base.vllm_env


@pytest.mark.parametrize("bad", [-1, 128, 1 << 40], ids=["negative", "num_blocks", "far"])
def test_a_block_id_outside_the_kv_cache_fails_the_load_and_skips_the_save(
    maru_server_factory, model_dir, vllm_env, bad
):
    """A load and a save whose block ids hold one outside the KV cache (128 blocks). The load
    copies nothing anywhere (not even into its valid blocks' neighbours) and reports every
    block of the request as a load error (vLLM recomputes them); the save stores none of its
    keys. Neither the read nor the write is ever given an address outside the KV cache's
    blocks. Before: both were (the load's destination and the save's source for the bad id:
    base + id * stride), and the save stored the other blocks' values."""
    server = maru_server_factory(pool_size="256M")
    (out,) = run_processes([(W.bad_block_ids, (model_dir, server.url, bad))], base.DEADLINE)
    assert out["valid_load_errors"] == []  # (the control: the same load, valid ids)
    assert out["outside"] == {"read": 0, "put": 0}
    assert out["bad_load_errors"] == sorted(out["with_bad"])
    assert out["fresh_stored"] == [False] * W.BLOCKS
    assert out["stats"]["save_failed"] == W.BLOCKS and out["stats"]["save_blocks"] == 0
    assert out["stats"]["load_errors"] == W.BLOCKS
    assert out["match"] == [True] * W.BLOCKS  # the request's own blocks untouched


def _fenced_blocks() -> list[int]:
    """`_allocated_blocks` of a step that only zeroes block 3 and copies block 1 into 7."""
    W._vllm_on_path()
    from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

    from maru_vllm.connector import _allocated_blocks

    out = SchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens={},
        total_num_scheduled_tokens=0,
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        finished_req_ids=set(),
        free_encoder_mm_hashes=[],
    )
    out.new_block_ids_to_zero = [3]
    out.kv_cache_block_copies = [KVCacheBlockCopy(src_block_id=1, dst_block_id=7)]
    return sorted(_allocated_blocks(out, []))


def test_blocks_the_worker_zeroes_or_copies_into_wait_for_the_saves_reading_them(vllm_env):
    """vLLM's worker writes blocks before the forward besides the requests' own: it zeroes
    fresh blocks of groups no load writes (`new_block_ids_to_zero`: SSM and mixed models)
    and applies copy-on-write copies (`kv_cache_block_copies`), after the connector's
    `handle_preemptions`. A save still reading such a block (freed by a preemption, given
    again) would store zeros or another request's bytes under its key: both are in the
    blocks the fence waits for (before: neither)."""
    (out,) = run_processes([(_fenced_blocks, ())], base.DEADLINE)
    assert out == [3, 7]
