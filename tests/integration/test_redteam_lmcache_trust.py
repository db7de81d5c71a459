"""Red-team: LMCache 0.5.6's shipped `MaruBackend` when the pins a lookup took are lost
before its chunks are read.

LMCache relies on the pins of its lookups (vLLM's `lookup(pin=True)` before `retrieve`, the
async lookup server's `batched_async_contains(pin=True)` before its prefetch) to keep the
zero-copy views its gets return in place until it has copied them. An instance that is
reaped (a reader over TCP silent past --heartbeat-timeout) or restarted without its state
loses its pins; its handler then handshakes again, as a new instance, transparently. A get
made after that, for a key the caller pinned under the lost instance, returned a view of
the pool as if it were still pinned: another instance's `remove` succeeded and its next
writes reused the page before LMCache copied it, a wrong hit. Now such a key is a miss
until the caller unpins it (or pins it again under the new instance).

What these tests prove, against a real `maru-server`, LMCache's real engine and backend (the
GPU connector the CPU stand-in of tests/lmcache_cpu/engine.py), the writer in another
process:

* vLLM's flow: the lookup pins the prompt, the instance is ended (as a reap ends it: the
  server's DISCONNECT of its session), then `retrieve`: the writer removes every key and
  writes over every page it can reserve just before the copy; the retrieve copies only the
  prompt's bytes or nothing (before the fix: every chunk retrieved, with the writer's 0x7f);
* LMCache's async loading: the instance ends between the prefetch's pins and its gets; the
  chunks it hands to `retrieve` are the prompt's bytes or none (before: the writer's).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.lmcache
TESTS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TESTS))

pytest.importorskip("lmcache")

import torch  # noqa: E402

from lmcache_cpu import engine as E  # noqa: E402
from lmcache_cpu import workers as W  # noqa: E402
from maru.common.protocol import MsgType  # noqa: E402

from .test_lmcache_contract_trust import (  # noqa: E402  (their fixtures apply here too)
    _HookedConnector,
    keep_start_method,  # noqa: F401
    same_hash_seed,  # noqa: F401
)
from .workers import SPAWN  # noqa: E402

G = E.GEOMETRY
DEADLINE = 60.0


def _end_instance(handler: Any) -> None:
    """End the handler's instance on the server as reaping does (its pins and leases go);
    the handler's next request handshakes again, as a new instance."""
    handler._request(MsgType.DISCONNECT, {}).result()


class _Writer:
    """Another process's engine that stores the prompt (seed), and on `go` removes its keys
    and writes 0x7f over every chunk it can reserve (tests/lmcache_cpu/workers.py)."""

    def __init__(self, url: str, n: int, seed: int):
        self.stored, self.go, self.done = SPAWN.Event(), SPAWN.Event(), SPAWN.Event()
        self.out = SPAWN.Queue()
        args = (url, n, seed, self.stored, self.go, self.done)
        self.proc = SPAWN.Process(
            target=W._run_into, args=(W.remove_and_reuse_when_told, self.out, args), daemon=True
        )
        self.proc.start()
        assert self.stored.wait(DEADLINE), "the writer never stored its prompt"

    def remove_and_reuse(self) -> None:
        self.go.set()
        assert self.done.wait(DEADLINE), "the writer never finished"

    def result(self) -> dict:
        result = self.out.get(timeout=DEADLINE)
        assert "error" not in result, result.get("error")
        return result

    def close(self) -> None:
        self.go.set()
        self.proc.join(DEADLINE)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


def _only_own_bytes(out: list, mask: torch.Tensor, n: int, seed: int) -> int:
    """Chunks the retrieve reported must hold the prompt's bytes; the others nothing. Returns
    how many tokens it reported."""
    got = E.gathered(out, torch.arange(n))
    expected = E.gathered(E.kv_caches(n, seed=seed), torch.arange(n))
    for s in range(0, n, G.chunk):
        e = min(s + G.chunk, n)
        if mask[s:e].all():
            assert E.same_bits(got[:, :, s:e], expected[:, :, s:e]), f"chunk {s}:{e} not its own"
        else:
            assert not mask[s:e].any()
            assert not got[:, :, s:e].view(torch.int16).any(), f"chunk {s}:{e} written"
    return int(mask.sum())


@pytest.mark.usefixtures("same_hash_seed")
def test_a_retrieve_after_the_lookups_pins_were_lost_reads_its_bytes_or_misses(maru_server_factory):
    """vLLM's flow (`lookup(pin=True)`, `retrieve`, `lookup_unpin`) with the instance ended
    between the lookup and the retrieve. The retrieve's get handshakes again (a new instance,
    no pins) and must not hand out views of keys whose pins are gone: the writer removes
    them (now allowed) and reuses their pages just before the copy."""
    server = maru_server_factory(pool_size="64M")
    n, seed = 3 * G.chunk, 41
    writer = _Writer(server.url, n, seed)
    try:
        tokens = E.prompt(n, seed)
        connector = _HookedConnector(writer.remove_and_reuse)
        with E.Engine(E.config(server.url), E.metadata(), connector) as b:
            assert b.engine.lookup(tokens, lookup_id="req-1", pin=True) == n
            _end_instance(b.backend._handler)
            out = E.kv_caches(n)
            mask = b.engine.retrieve(
                tokens, kvcaches=out, slot_mapping=torch.arange(n), req_id="req-1"
            )
            if not mask.any():  # (no copy: the writer is let go here)
                writer.remove_and_reuse()
            b.engine.lookup_unpin("req-1")
            result = writer.result()
        assert result["removed"] == [True] * 3  # the pins were gone: nothing held the keys
        assert result["overwritten"] > 0
        _only_own_bytes(out, mask, n, seed)
    finally:
        writer.close()


@pytest.mark.usefixtures("same_hash_seed")
def test_an_async_prefetch_whose_pins_were_lost_hands_out_no_other_bytes(maru_server_factory):
    """LMCache's async loading: the lookup server pins the prompt
    (`batched_async_contains(pin=True)`), then gets its chunks (`batched_get_non_blocking`)
    and holds them until `retrieve`. The instance ends between the pins and the gets; the
    writer then removes the keys and reuses their pages while the prefetch holds its
    chunks. The retrieve writes the prompt's own bytes or nothing."""
    server = maru_server_factory(pool_size="64M")
    n, seed = 3 * G.chunk, 43
    writer = _Writer(server.url, n, seed)
    try:
        tokens = E.prompt(n, seed)
        cfg = E.config(server.url, async_loading=True)
        with E.Engine(cfg, E.metadata()) as b:
            backend = b.backend
            contains = backend.batched_async_contains

            async def pinned_then_ended(lookup_id: str, keys: list, pin: bool = False) -> int:
                hits = await contains(lookup_id, keys, pin)
                _end_instance(backend._handler)  # (as a reap here would)
                return hits

            backend.batched_async_contains = pinned_then_ended
            hit = W._async_lookup(b.lookup_client(), tokens, "req-1")
            writer.remove_and_reuse()
            out = E.kv_caches(n)
            mask = b.engine.retrieve(
                tokens, kvcaches=out, slot_mapping=torch.arange(n), req_id="req-1"
            )
            result = writer.result()
        assert result["removed"] == [True] * 3
        assert result["overwritten"] > 0
        assert _only_own_bytes(out, mask, n, seed) <= hit
    finally:
        writer.close()
