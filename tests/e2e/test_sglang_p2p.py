"""P2P KV sharing through Maru between two real SGLang servers on CPU.

One real `maru-server` and two `python -m sglang.launch_server` processes (tiny random Qwen2
built locally, HiCache with `direct` io and `page_first_direct`), each loading MaruStorage
exactly as the documented contract JSON (`--hicache-storage-backend dynamic` +
`--hicache-storage-backend-extra-config '{"backend_name": "maru", ...}'`).

For each prompt: instance 1 computes it (no cache anywhere) and writes its pages through to
Maru; once maru-server's key count is stable, instance 2, which never saw the prompt, gets it
and must report the prefix as storage hits -- every whole page of the prompt that SGLang may
reuse, i.e. ``(prompt_tokens - 1) // page * page`` -- load them with `batch_get_v1` (its log
says ``batch_get_v1 result: N/N hits``), and generate exactly instance 1's tokens.

The flow is `sglang_cpu.p2p.run_p2p`, which examples/sglang/cpu_p2p/run.sh runs too: this
test is CI's run of that example (servers started one after the other: on 2 cores starting
both at once took as long, ~50 s for the pair).
"""

from __future__ import annotations

import json

import pytest

import sglang_cpu

sglang_cpu.require()

from sglang_cpu import p2p  # noqa: E402
from sglang_cpu.tiny_model import build_tiny_model, make_prompt  # noqa: E402

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(600)]

PAGE = p2p.PAGE_SIZE
# A prompt of whole pages, one that ends inside a page, and one over SGLang's 128-page storage
# batch (two batch_get_v1 calls).
PROMPTS = [(200, 11), (101, 12), (600, 13)]  # (tokens, seed)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"))


def test_contract_config():
    extra = p2p.maru_extra_config("tcp://127.0.0.1:1", pool_size="256M", prefetch_threshold=4)
    assert extra == {
        "backend_name": "maru",
        "module_path": "maru_sglang.maru_storage",
        "class_name": "MaruStorage",
        "interface_v1": 1,
        "maru_server_url": "tcp://127.0.0.1:1",
        "maru_pool_size": "256M",
        "prefetch_threshold": 4,
    }
    args = p2p.hicache_args("dynamic", extra)
    assert args[:8] == [
        "--enable-hierarchical-cache",
        "--hicache-io-backend", "direct",
        "--hicache-mem-layout", "page_first_direct",
        "--hicache-storage-backend", "dynamic",
        "--hicache-storage-backend-extra-config",
    ]  # fmt: skip
    assert json.loads(args[8]) == extra and len(args) == 9
    assert p2p.expected_storage_hits(200) == 196 and p2p.expected_storage_hits(101) == 100
    assert p2p.storage_batches(596) == [128, 21]


@pytest.mark.slow
def test_second_instance_reuses_first_instances_kv(tiny_model, maru_server, tmp_path):
    prompts = [make_prompt(tokens, seed=seed) for tokens, seed in PROMPTS]
    run = p2p.run_p2p(tiny_model, maru_server.url, prompts, log_dir=tmp_path, say=print)
    print(f"startup: {', '.join(f'{s:.1f} s' for s in run.startup_seconds)}")
    tail = run.log_paths[1].read_text(errors="replace")[-4000:]

    assert [o.tokens for o in run.outcomes] == [t for t, _ in PROMPTS]
    for o in run.outcomes:
        # Instance 1 computed everything; its pages were written through to Maru.
        assert o.first["meta_info"]["cached_tokens"] == 0, o.first["meta_info"]
        assert o.l3_keys_after >= o.l3_keys_before + o.tokens // PAGE - 1
        # Instance 2 never saw the prompt: the reusable prefix came from Maru.
        meta = o.second["meta_info"]
        details = meta["cached_tokens_details"]
        assert details is not None, tail
        assert details["storage_backend"] == "MaruStorage"
        assert details["storage"] == o.expected_storage == p2p.expected_storage_hits(o.tokens)
        assert details["device"] == 0 and details["host"] == 0
        assert meta["cached_tokens"] == o.expected_storage
        assert o.hits_logged, (o.hits_lines, tail)
        # ... and it produced exactly instance 1's tokens.
        assert o.second["output_ids"] == o.first["output_ids"]
        assert o.second["text"] == o.first["text"]

    # The pages outlive both instances, and maru-server counted instance 2's hits.
    stats = p2p.l3_stats(maru_server.url)
    assert stats["keys"] >= sum(t // PAGE - 1 for t, _ in PROMPTS)
    loaded = sum(p2p.expected_storage_hits(t, PAGE) // PAGE for t, _ in PROMPTS)
    assert stats["counters"]["hits"] >= loaded
