"""Red-team tests of `maru_vllm.MaruKVConnector` under EAGLE-style speculative decoding.

An EAGLE (EAGLE3, MTP) drafter's attention layers share the target's KV cache groups, so a
block's value holds their KV too, and the drafter builds a position's KV from the *next*
token (vLLM 0.33's `SpeculativeConfig.needs_eagle_block_drop`). The KV at the last position
of a hit's last block therefore depends on a token that the block's hash does not cover:
vLLM's own prefix cache drops that block from every hit (`use_eagle_block_drop`), as its
Mooncake store connector does. These tests prove the connector does the same with Maru's
hits (a hit is never bytes that depend on what its key does not name), and that the draft
model's weights are part of what a key names (two instances with other drafters of the same
shape never read each other's draft KV).

vLLM's real scheduler-side connector and block hasher run in a spawned process against a
real maru-server (tests/vllm_cpu); the speculative config is a stand-in object with the two
things the connector reads from it.
"""

from __future__ import annotations

from typing import Any

import pytest

from vllm_cpu import fixtures

from .workers import run_processes

pytestmark = pytest.mark.vllm
fixtures.require()

from sglang_cpu.tiny_model import build_tiny_model  # noqa: E402
from vllm_cpu import workers as W  # noqa: E402

model_dir = fixtures.model_dir  # (the shared fixtures: a tiny model, vLLM's environment)
vllm_env = fixtures.vllm_env

DEADLINE = 50
BLOCK = 16


class _Speculative:
    """A stand-in `SpeculativeConfig`: an EAGLE-style method (or not) and its drafter."""

    def __init__(self, drop: bool, draft: Any):
        self.drop, self.draft_model_config, self.method = drop, draft, "eagle"

    def use_eagle_block_drop(self) -> bool:
        return self.drop


def _matches(model_dir: str, url: str, draft: str, readers: list[tuple[bool, str]]) -> dict:
    """Instance A (an EAGLE-style drafter of weights `draft`) computes and saves prompt 0 (5
    full blocks and 3 tokens); then for each (drop, drafter) of `readers`, a scheduler-side
    connector of that speculative config says how many tokens of prompt 0 Maru holds for it."""
    W._vllm_on_path()
    from vllm.config import ModelConfig

    from vllm_cpu.engine import vllm_config
    from vllm_cpu.matching import saved_then_matched

    def spec(drop: bool, weights: str) -> _Speculative:
        return _Speculative(drop, ModelConfig(model=weights, dtype="float16", seed=0))

    def writer(config: Any) -> None:
        # (vLLM's scheduler itself runs without the drafter: the connectors are made anew
        # with it)
        config.speculative_config = spec(True, draft)

    def reader(drop: bool, weights: str) -> Any:
        config = vllm_config(model_dir, url)
        config.speculative_config = spec(drop, weights)
        return config

    return saved_then_matched(model_dir, url, writer, (reader(d, w) for d, w in readers))


def test_an_eagle_drafter_never_takes_the_last_block_of_a_hit(
    maru_server_factory, model_dir, vllm_env
):
    """A (with an EAGLE-style drafter) saves prompt 0's 5 full blocks. A reader of the same
    drafter that keeps the volatile block (`disable_eagle_block_drop`) matches all 5; one
    that drops it, as vLLM does by default, matches 4: the 5th block's last position holds
    draft KV built from token 80, which its key does not cover, and vLLM recomputes it (its
    own prefix cache drops that block the same way). Mutation: without the drop in
    `get_num_new_matched_tokens`, the dropping reader matches all 5."""
    server = maru_server_factory(pool_size="256M")
    readers = [(False, model_dir), (True, model_dir)]
    (r,) = run_processes([(_matches, (model_dir, server.url, model_dir, readers))], DEADLINE)
    assert r["saved"] == W.BLOCKS
    assert r["matched"] == [W.BLOCKS * BLOCK, (W.BLOCKS - 1) * BLOCK]


def test_a_reader_with_another_drafter_never_hits_its_blocks(
    maru_server_factory, model_dir, vllm_env, tmp_path
):
    """A's values hold its drafter's KV (the draft layers are in the target's KV cache
    groups). A reader of the same target but a drafter of other weights (same shapes, so the
    same value size) must find none of A's blocks: their draft KV is not what it computes.
    Mutation: without the drafter in `kv_namespace`, it matches all of A's blocks (4, the
    last dropped) and loads A's draft KV."""
    server = maru_server_factory(pool_size="256M")
    other = str(build_tiny_model(tmp_path / "other", seed=1))  # same shapes, other weights
    readers = [(True, model_dir), (True, other)]
    (r,) = run_processes([(_matches, (model_dir, server.url, model_dir, readers))], DEADLINE)
    assert r["saved"] == W.BLOCKS
    assert r["matched"] == [(W.BLOCKS - 1) * BLOCK, 0]
