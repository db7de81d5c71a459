"""P2P KV sharing through MaruCacheLinker between two real SGLang servers on CPU.

One real `maru-server` and two `python -m sglang.launch_server` processes (tiny random Qwen2
built locally) with SGLang's direct L3 interface, no HiCache host tier:
``--enable-unified-cache-external-linker --unified-cache-external-linker-backend dynamic
--unified-cache-external-linker-config '{"linker": "MaruCacheLinker", "linker_module_path":
"maru_sglang.linker", "linker_extra_config": {...}}'``.

For each prompt, instance 1 computes it (no cache anywhere: the run without the cache) and its
linker offloads the pages straight from its device KV pool; instance 2, which never saw the
prompt, must take every reusable page from Maru (SGLang reports the linker's hits as ``host``
tokens), load them with one leased lookup and a layer-wise copy (its log says ``linker load:
N pages from Maru``), and generate exactly instance 1's tokens. Afterwards maru-server's
counters and instance 2's linker counters (logged when it closes) must show those pages.

Same flow as test_sglang_p2p.py (`sglang_cpu.p2p.run_p2p`, with `linker=True`). No CPU shim
beyond the ones HiCache needs: the linker path runs on SGLang 0.5.23's CPU build as is.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

_TESTS = Path(__file__).resolve().parents[1]
if str(_TESTS) not in sys.path:
    sys.path.insert(0, str(_TESTS))

import sglang_cpu  # noqa: E402

sglang_cpu.apply()
pytest.importorskip("sglang")

from sglang_cpu import p2p  # noqa: E402
from sglang_cpu.tiny_model import build_tiny_model, make_prompt  # noqa: E402

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(600)]

PAGE = p2p.PAGE_SIZE
PROMPTS = [(200, 21), (101, 22), (600, 23)]  # whole pages, a partial page, > 128 pages


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"))


def test_linker_flags():
    config = p2p.linker_config("tcp://127.0.0.1:1", pool_size="256M")
    assert config == {
        "linker": "MaruCacheLinker",
        "linker_module_path": "maru_sglang.linker",
        "linker_extra_config": {"maru_server_url": "tcp://127.0.0.1:1", "maru_pool_size": "256M"},
    }
    args = p2p.linker_args(config)
    assert args[:4] == [
        "--enable-unified-cache-external-linker",
        "--unified-cache-external-linker-backend", "dynamic",
        "--unified-cache-external-linker-config",
    ]  # fmt: skip


def _closing_counters(log: str) -> dict:
    """The linker's counters, logged once when the server shuts it down."""
    marker = "MaruCacheLinker closing: "
    line = next(line for line in reversed(log.splitlines()) if marker in line)
    return ast.literal_eval(line.split(marker, 1)[1])


@pytest.mark.slow
def test_second_instance_loads_first_instances_kv_through_the_linker(
    tiny_model, maru_server, tmp_path
):
    before = p2p.l3_stats(maru_server.url)["counters"]
    prompts = [make_prompt(tokens, seed=seed) for tokens, seed in PROMPTS]
    run = p2p.run_p2p(
        tiny_model, maru_server.url, prompts, log_dir=tmp_path, say=print, linker=True
    )
    tail = run.log_paths[1].read_text(errors="replace")[-4000:]

    assert [o.tokens for o in run.outcomes] == [t for t, _ in PROMPTS]
    for o in run.outcomes:
        assert o.first["meta_info"]["cached_tokens"] == 0, o.first["meta_info"]
        assert o.l3_keys_after >= o.l3_keys_before + o.tokens // PAGE - 1
        meta = o.second["meta_info"]
        details = meta["cached_tokens_details"]
        assert details is not None, tail
        assert details["device"] == 0 and not details.get("storage")
        assert details["host"] == o.expected_storage == p2p.expected_storage_hits(o.tokens)
        assert meta["cached_tokens"] == o.expected_storage
        assert o.hits_logged, (o.hits_lines, tail)
        assert o.second["output_ids"] == o.first["output_ids"]
        assert o.second["text"] == o.first["text"]

    # The servers are stopped now: instance 2's linker logged its counters when it closed.
    loaded = sum(p2p.expected_storage_hits(t) // PAGE for t, _ in PROMPTS)
    two = _closing_counters(run.log_paths[1].read_text(errors="replace"))
    assert two["loaded_pages"] >= loaded and two["load_failures"] == 0, two
    one = _closing_counters(run.log_paths[0].read_text(errors="replace"))
    assert one["offloaded_pages"] >= sum(t // PAGE - 1 for t, _ in PROMPTS), one
    # maru-server saw instance 2's leased lookups of those pages.
    after = p2p.l3_stats(maru_server.url)["counters"]
    assert after["hits"] - before["hits"] >= loaded
