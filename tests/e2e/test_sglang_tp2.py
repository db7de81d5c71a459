"""TP = 2 through Maru with two real SGLang servers on CPU (issue 14).

SGLang 0.5.23 runs tensor parallelism on CPU over gloo once each rank has its own CPUs
(`SGLANG_CPU_OMP_THREADS_BIND`, one CPU per rank here; without it the scheduler refuses more
ranks than NUMA nodes, `numa_utils.init_threads_binding`). Each server then runs two
scheduler processes, each with its own MaruStorage (its own Maru instance, `/tp<rank>`), and
each rank writes and reads its own shard of every KV page (2 KV heads: one per rank).

Instance 1 computes a prompt; both ranks' pages reach Maru (twice the pages of TP = 1);
instance 2, which never saw it, must report the prefix as storage hits (every rank loaded its
shard: SGLang takes the minimum over ranks) and generate exactly instance 1's tokens.
"""

from __future__ import annotations

import pytest

import sglang_cpu

sglang_cpu.require()

from sglang_cpu import p2p  # noqa: E402
from sglang_cpu.tiny_model import build_tiny_model, make_prompt  # noqa: E402

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(300)]

PAGE = p2p.PAGE_SIZE
TOKENS = 200


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.mark.slow
def test_tp2_second_instance_reuses_every_ranks_shard(tiny_model, maru_server, tmp_path):
    prompt = make_prompt(TOKENS, seed=21)
    run = p2p.run_p2p(tiny_model, maru_server.url, [prompt], log_dir=tmp_path, say=print, tp_size=2)
    (o,) = run.outcomes
    tail = run.log_paths[1].read_text(errors="replace")[-4000:]
    assert o.first["meta_info"]["cached_tokens"] == 0, o.first["meta_info"]
    # Both ranks wrote their shard of every page: twice the keys of one rank.
    assert o.l3_keys_after - o.l3_keys_before >= 2 * (o.tokens // PAGE - 1)
    details = o.second["meta_info"]["cached_tokens_details"]
    assert details is not None, tail
    assert details["storage_backend"] == "MaruStorage"
    assert details["storage"] == p2p.expected_storage_hits(o.tokens), tail
    assert o.hits_logged, (o.hits_lines, tail)
    assert o.second["output_ids"] == o.first["output_ids"]
    assert o.second["text"] == o.first["text"]
    # Each rank of each server was its own Maru instance, and rank 1 of instance 2 read too.
    log = run.log_paths[1].read_text(errors="replace")
    assert "TP1" in log and log.count("batch_get_v1 result:") >= 2, tail
