"""`maru_vllm.MaruKVConnector`, the first rule under vLLM's scheduling: what a key holds in
Maru, and what a block vLLM takes as computed holds, is the KV computed for that key's
tokens, whatever vLLM does in between: a synchronous load failing while the same step
computes over it, a request preempted and resumed on other block ids, two instances saving
the same blocks at once.

vLLM 0.33's real scheduler and worker connector (`tests/vllm_cpu`, spawned processes), a
real `maru-server`. Every block is compared byte for byte with the KV the stand-in model
computes for its tokens (`_true_value`): in the engine's KV cache, and under its key in Maru.
The stand-in model's KV depends only on (layer, position, token); `_context_forward` makes a
layer's KV depend on its context too, as a real model's does: a token computed over a block
that does not hold its own KV gets other KV.

vLLM lives in build/vllm-site (scripts/install_vllm_cpu.sh); skipped without it.
"""

from __future__ import annotations

from typing import Any

import pytest

from maru import MaruAdmin

from . import test_vllm_connector as base  # (skips this module too without vLLM)
from .workers import run_processes

pytestmark = pytest.mark.vllm
W = base.W
BLOCK = base.BLOCK
model_dir = base.model_dir  # (its fixtures: a tiny model, vLLM's environment)
vllm_env = base.vllm_env
DEADLINE = 180
OUT = 7  # the stand-in model's every sampled token (`MiniEngine._sampled`)


# -- in the spawned processes -----------------------------------------------------------------


def _true_value(engine: Any, tokens: list[int], b: int) -> bytes:
    """Block `b`'s value (group 0) as the KV computed for `tokens` gives it: each layer's
    `[N, H, C]` (the LBNHC value order), layer after layer."""
    import torch

    from vllm_cpu.engine import kv_value

    positions = torch.arange(b * BLOCK, (b + 1) * BLOCK)
    ids = torch.tensor(tokens)[positions]
    parts = []
    for layer, name in enumerate(engine.layers, engine.first_layer):
        view = engine.kv[name]
        shape = (view.shape[1], view.shape[3])
        value = kv_value(layer, positions, ids, shape, view.dtype, engine.cache_dtype)
        parts.append(value.contiguous().view(torch.uint8).numpy().tobytes())
    return b"".join(parts)


def _holds(engine: Any, req: str, tokens: list[int], n: int) -> list[bool]:
    """Whether each of the request's first `n` blocks in the engine's KV cache holds it."""
    blocks = engine.block_ids[req][:n]
    return [
        W._value_bytes(engine, blk) == _true_value(engine, tokens, b)
        for b, blk in enumerate(blocks)
    ]


def _in_maru(engine: Any, url: str, tokens: list[int], n: int) -> dict[str, list]:
    """Under the keys of `tokens`' first `n` blocks: which exist, which hold other bytes
    than the KV computed for them."""
    from maru import MaruHandler

    prefix = engine.scheduler.connector._prefix(0, (0, 0, 0))
    keys = [prefix + h.hex() for h in engine.request(tokens).block_hashes[:n]]
    with MaruHandler(server_url=url, pool_size="2M", chunk_size_bytes=4096) as h:
        infos = h.batch_retrieve(keys)
        wrong = [
            b
            for b, info in enumerate(infos)
            if info is not None and bytes(info.view) != _true_value(engine, tokens, b)
        ]
        return {"exists": [i is not None for i in infos], "wrong": wrong}


def _context_forward(engine: Any) -> None:
    """The stand-in model, made to depend on context: once the step has written its KV, a
    request whose positions before its scheduled ones do not all hold their own KV gets
    other KV (the token's id plus one) in its second layer for the scheduled ones."""
    import torch

    from vllm_cpu.engine import kv_value

    real = engine.forward

    def at(req: str, name: str, positions: torch.Tensor) -> tuple:
        ids = engine.group_blocks[req][engine.layer_group[name]]
        return torch.tensor(ids)[positions // BLOCK], positions % BLOCK

    def value(req: str, layer: int, name: str, positions: torch.Tensor, shift: int):
        view = engine.kv[name]
        tokens = torch.tensor(engine.scheduler.requests[req].all_token_ids)[positions] + shift
        shape = (view.shape[1], view.shape[3])
        return kv_value(layer, positions, tokens, shape, view.dtype, engine.cache_dtype)

    def forward(out: Any) -> None:
        real(out)
        for req, n in out.num_scheduled_tokens.items():
            start = engine.scheduler.requests[req].num_computed_tokens - n
            context = torch.arange(start)
            ok = True
            for layer, name in enumerate(engine.layers, engine.first_layer):
                blocks, offsets = at(req, name, context)
                got = engine.kv[name][blocks, :, offsets].view(torch.uint8)
                ok &= torch.equal(got, value(req, layer, name, context, 0).view(torch.uint8))
            if not ok:
                name = engine.layers[1]
                mine = torch.arange(start, start + n)
                blocks, offsets = at(req, name, mine)
                engine.kv[name][blocks, :, offsets] = value(req, 1, name, mine, 1)
                engine.poisoned.add(req)

    engine.poisoned = set()
    engine.forward = forward


def failed_sync_load(model_dir: str, url: str) -> dict:
    """A stores prompt 0 (5 blocks). B (synchronous loads) runs R, prompt 0's 5 blocks and 3
    more, and Q, the same 5 blocks and 3 others; B's scheduler matches R's 5 blocks in Maru,
    and Q, scheduled in the same step, takes them as its local prefix hit. Block 2's key is
    deleted before B's worker loads: the step's forward computes R's and Q's blocks 5..7
    over blocks 2..4 that do not hold their KV (`_context_forward`)."""
    W._vllm_on_path()
    from maru import MaruHandler
    from vllm_cpu.engine import MiniEngine

    base_tokens = W.prompt(0)[: W.BLOCKS * BLOCK]
    r_tokens = base_tokens + [70_000 + t for t in range(3 * BLOCK + W.TAIL)]
    q_tokens = base_tokens + [80_000 + t for t in range(3 * BLOCK + W.TAIL)]
    a = MiniEngine(model_dir, url)
    try:
        a.run({a.add(W.prompt(0))})
    finally:
        a.close()
    b = MiniEngine(model_dir, url, maru_async_load=False)
    _context_forward(b)
    seen: dict[str, Any] = {}

    def before_load(meta: Any) -> None:
        if meta.loads and "deleted" not in seen:
            with MaruHandler(server_url=url, pool_size="2M", chunk_size_bytes=4096) as h:
                seen["deleted"] = h.batch_delete([meta.loads[0].keys[0][2]])

    try:
        r, q = b.add(r_tokens), b.add(q_tokens)
        b.run({r, q}, before_load=before_load)
        n = len(r_tokens) // BLOCK
        return {
            **seen,
            "poisoned": sorted(b.poisoned),
            "r": r,
            "q": q,
            "r_errors": sorted(b.load_errors & set(b.block_ids[r])),
            "r_blocks": b.block_ids[r][:n],
            "shared": b.block_ids[q][: W.BLOCKS] == b.block_ids[r][: W.BLOCKS],
            "q_computed": sorted(b.computed[q]),
            "r_holds": _holds(b, r, r_tokens, n),
            "q_holds": _holds(b, q, q_tokens, n),
            "r_maru": _in_maru(b, url, r_tokens, n),
            "q_maru": _in_maru(b, url, q_tokens, n),
        }
    finally:
        b.close()


def _until(engine: Any, done: Any, what: str, steps: int = 400) -> None:
    """Step `engine` until `done()` (a bounded number of steps, idling on empty ones)."""
    import time

    for _ in range(steps):
        if done():
            return
        if not engine.step().num_scheduled_tokens:
            time.sleep(0.005)
    raise TimeoutError(f"{what}: not within {steps} steps")


def preempted_and_resumed(model_dir: str, url: str) -> dict:
    """A stores prompt 0. In B (17 blocks, priority policy) R runs prompt 0 (its 5 blocks
    loaded from Maru) and decodes; S (higher priority) takes every block left, and when R
    needs one more vLLM preempts R and frees its blocks; T (highest) takes them and writes
    its own KV there (the local prefix cache's copies of R's blocks are gone). R resumes on
    other block ids: its prefix loaded from Maru again, its output blocks computed and saved
    from the new ids."""
    W._vllm_on_path()
    from vllm_cpu.engine import MiniEngine

    a = MiniEngine(model_dir, url)
    try:
        a.run({a.add(W.prompt(0))})
    finally:
        a.close()
    b = MiniEngine(model_dir, url, num_blocks=18, policy="priority", max_num_batched_tokens=96)
    out: dict[str, Any] = {"preempted": False}
    try:
        r = b.add(W.prompt(0), max_tokens=40, priority=2)
        _until(b, lambda: r in b.block_ids and b.computed[r], "R loaded")
        s = b.add([50_000 + t for t in range(10 * BLOCK)], max_tokens=40, priority=1)
        for _ in range(60):
            if r in (b.step().preempted_req_ids or ()):
                out["preempted"] = True
                break
        before = list(b.block_ids[r])
        t = b.add([60_000 + t for t in range(5 * BLOCK)], max_tokens=1, priority=0)
        b.step()
        out["taken_by_t"] = sorted(set(before) & set(b.block_ids.get(t, ())))
        _until(b, lambda: r in b.finished, "R finished", 2000)
        r_tokens = W.prompt(0) + [OUT] * 40
        n = (len(r_tokens) - 1) // BLOCK  # (the last token's KV is never computed)
        out["moved"] = b.block_ids[r][:n] != before[:n]
        out["r_holds"] = _holds(b, r, r_tokens, n)  # (as R finished: its blocks not reused)
        b.run({r, s, t})
        out["loads"] = sum(st["loads"] for st in b.stats)
        out["r_maru"] = _in_maru(b, url, r_tokens, n)
        for name, tokens, count in (("s", b.tokens[s], 40), ("t", b.tokens[t], 1)):
            full = tokens + [OUT] * count
            out[f"{name}_maru"] = _in_maru(b, url, full, (len(full) - 1) // BLOCK)
        out["n"] = n
        return out
    finally:
        b.close()


def _tails(i: int) -> list[int]:
    """Prompt i of `save_at_once`: 2.5 blocks every one shares, then its own tokens (5 full
    blocks and 3 tokens in all): block 2 holds both."""
    shared = [40_000 + t for t in range(2 * BLOCK + BLOCK // 2)]
    return shared + [90_000 * (i + 1) + t for t in range(W.BLOCKS * BLOCK + W.TAIL - len(shared))]


def save_prompts(model_dir: str, url: str, which: list[int]) -> dict:
    """An instance computes `_tails(i)` for each i in `which` (at once) and saves them."""
    W._vllm_on_path()
    from vllm_cpu.engine import MiniEngine

    engine = MiniEngine(model_dir, url)
    try:
        engine.run({engine.add(_tails(i)) for i in which})
        return {"saved": sum(s["save_blocks"] for s in engine.stats)}
    finally:
        engine.close()


def load_prompts(model_dir: str, url: str, which: list[int]) -> dict:
    """A fresh instance runs each `_tails(i)` in turn, its own prefix cache emptied before
    each: what it loaded, computed and holds, and what Maru holds under the prompt's keys."""
    W._vllm_on_path()
    from vllm_cpu.engine import MiniEngine

    engine = MiniEngine(model_dir, url)
    out: dict[str, Any] = {}
    try:
        for i in which:
            engine.scheduler.reset_prefix_cache()
            before = sum(s["load_blocks"] for s in engine.stats)
            req = engine.add(_tails(i))
            engine.run({req})
            out[i] = {
                "loaded": sum(s["load_blocks"] for s in engine.stats) - before,
                "computed": sorted(engine.computed[req]),
                "holds": _holds(engine, req, _tails(i), W.BLOCKS),
                "maru": _in_maru(engine, url, _tails(i), W.BLOCKS),
            }
        return out
    finally:
        engine.close()


# -- the tests ---------------------------------------------------------------------------------


def test_a_failed_synchronous_load_stores_nothing_its_step_computed_over_it(
    maru_server_factory, model_dir, vllm_env
):
    """B's synchronous load of R's 5 blocks fails from block 2 (its key deleted after the
    match), and the same step's forward computes R's blocks 5..7, and Q's (which shares R's
    5 blocks as a local prefix hit), over blocks 2..4 that do not hold their KV. vLLM drops
    that work and recomputes both. None of it may be stored: under every key of R and Q in
    Maru is their KV or nothing, and R's blocks 2..7 are saved again once recomputed.
    Before the fix, the step's saves stored the blocks 5..7 computed over the failed ones,
    and the saves after the recompute found the keys taken (a key keeps its first value):
    every instance then loaded R's and Q's blocks 5..7 as hits of wrong KV."""
    server = maru_server_factory(pool_size="256M")
    (r,) = run_processes([(failed_sync_load, (model_dir, server.url))], DEADLINE)
    n = len(r["r_blocks"])
    # the scenario happened as meant: R's load failed from block 2, Q shared R's blocks,
    # and the step computed both over the failed blocks
    assert r["deleted"] == [True] and r["r_errors"] == sorted(r["r_blocks"][2 : W.BLOCKS]), r
    assert r["shared"] and r["q_computed"] == list(range(W.BLOCKS * BLOCK, n * BLOCK + W.TAIL))
    assert r["poisoned"] == sorted([r["r"], r["q"]]), r
    assert r["r_holds"] == [True] * n and r["q_holds"] == [True] * n  # recomputed by vLLM
    assert r["r_maru"] == {"exists": [True] * n, "wrong": []}, r["r_maru"]
    assert r["q_maru"]["wrong"] == [], r["q_maru"]


def test_a_request_preempted_and_resumed_on_other_blocks_holds_and_saves_its_own_kv(
    maru_server_factory, model_dir, vllm_env
):
    """R's prefix is loaded from Maru; R is preempted mid-decode, its blocks handed to T,
    which writes its own KV there; R resumes on other block ids (loading its prefix again).
    Every block R ends with holds R's KV, and under each of R's keys (its prompt's and the
    blocks of its output, saved before and after the preemption) is R's KV; S's and T's
    keys hold theirs. (A connector that kept R's old block ids after the resume would save
    R's later blocks from T's, or load into blocks R no longer has.)"""
    server = maru_server_factory(pool_size="256M")
    (r,) = run_processes([(preempted_and_resumed, (model_dir, server.url))], DEADLINE)
    n = r["n"]
    assert r["preempted"] and r["taken_by_t"] and r["moved"], r  # as meant
    assert r["loads"] >= 2, r  # R's prefix loaded before and after its preemption
    assert r["r_holds"] == [True] * n, r
    assert r["r_maru"] == {"exists": [True] * n, "wrong": []}, r
    for name in ("s", "t"):
        assert r[f"{name}_maru"]["wrong"] == [], r


def test_two_instances_saving_one_prefix_at_once_leave_each_key_its_own_kv(
    maru_server_factory, model_dir, vllm_env
):
    """Two instances, at once, compute and save prompts that share 2.5 blocks and differ
    from the middle of block 2 on: each saves the shared blocks 0 and 1 (the same keys,
    written concurrently), and its own blocks 2..4; one also runs the other's prompt. A
    third instance then loads each prompt whole, byte for byte, and a prompt of the same
    2.5 blocks with a tail never stored hits blocks 0 and 1 only: the block its tail shares
    with the others (and every one after) is computed, never another prompt's. (A key naming
    less than its block's tokens, e.g. the chain up to the block before, would serve prompt
    1's block 2 for prompt 0's.)"""
    server = maru_server_factory(pool_size="256M")
    jobs = [
        (save_prompts, (model_dir, server.url, [0])),
        (save_prompts, (model_dir, server.url, [1, 0])),
    ]
    a, b = run_processes(jobs, DEADLINE)
    # each of the 8 keys once on the server (a key both wrote at once counts in both `saved`:
    # the second write finds it stored, how often depends on the two processes' timing)
    assert W.BLOCKS + 3 <= a["saved"] + b["saved"] <= 2 * W.BLOCKS + 3, (a, b)
    with MaruAdmin(server.url) as admin:
        assert admin.stats()["keys"] == W.BLOCKS + 3, (a, b)
    (c,) = run_processes([(load_prompts, (model_dir, server.url, [0, 1, 2]))], DEADLINE)
    whole = list(range(W.BLOCKS * BLOCK, W.BLOCKS * BLOCK + W.TAIL))
    for i in (0, 1):
        assert c[i]["loaded"] == W.BLOCKS and c[i]["computed"] == whole, c[i]
        assert c[i]["holds"] == [True] * W.BLOCKS, c[i]
        assert c[i]["maru"] == {"exists": [True] * W.BLOCKS, "wrong": []}, c[i]
    assert c[2]["loaded"] == 2 and c[2]["computed"] == list(range(2 * BLOCK, whole[-1] + 1))
    assert c[2]["holds"] == [True] * W.BLOCKS and c[2]["maru"]["wrong"] == [], c[2]
