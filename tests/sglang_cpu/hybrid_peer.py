"""One SGLang "instance" of a hybrid model for the cross-process v2 tests (run as a subprocess).

    python hybrid_peer.py writer|reader <maru_url> <seed> [<tp_rank> <tp_size>]

For each kind of `hybrid_pools.KINDS` it builds the real host pools, creates `MaruStorage`
through SGLang's real dynamic backend factory, registers the pools as `HybridCacheController`
does, and as the writer fills `PAGES` KV pages and their sidecar pages and stores them the way
the controller's backup does (`batch_set_v1` for KV, `batch_set_v2` for the sidecars: a Mamba
state at two node ends, an SWA window, an indexer page per KV page). As the reader it asks
`batch_exists_v2` and loads everything into *other* host slots with `batch_get_v1` /
`batch_get_v2`, then compares bytes. Prints one JSON line with the outcome per kind.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import sglang_cpu

sglang_cpu.apply()

import torch  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from sglang_cpu.host_pools import storage_config  # noqa: E402
from sglang_cpu.hybrid_pools import (  # noqa: E402
    KINDS,
    fill_bytes,
    make_hybrid,
    random_pages,
    read_bytes,
    register,
    slots,
    transfer,
)
from sglang_cpu.p2p import MARU_BACKEND  # noqa: E402

PAGES = 6


def backend_for(url: str, hybrid, tp_rank: int, tp_size: int):
    extra = {**MARU_BACKEND, "maru_server_url": url, "maru_pool_size": "64M"}
    cfg = storage_config(is_mla=hybrid.is_mla, extra=extra, tp_rank=tp_rank, tp_size=tp_size)
    backend = StorageBackendFactory.create_backend("dynamic", cfg, hybrid.kv)
    register(backend, hybrid)
    return backend


def sidecar_plan(sidecar, keys: list[str], first_slot: int):
    """(keys, host indices) of each store the controller's backup makes for this sidecar:
    an indexer page per KV page (the KV pages' slots); a trailing state at the end of the
    half prefix and at the end of the whole one."""
    pool, n = sidecar.pool, len(keys)
    if sidecar.from_kv:
        return [(keys, None)]
    plans = []
    for end in (n // 2, n):
        window = keys[max(0, end - sidecar.window) : end]
        plans.append((window, slots(pool, first_slot, len(window))))
        first_slot += len(window)
    return plans


def main() -> None:
    role, url, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    tp_rank, tp_size = (int(sys.argv[4]), int(sys.argv[5])) if len(sys.argv) > 5 else (0, 1)
    out = {}
    for n_kind, kind in enumerate(KINDS):
        hybrid = make_hybrid(kind)
        backend = backend_for(url, hybrid, tp_rank, tp_size)
        keys = [f"{seed:x}-{kind}-{i}" for i in range(PAGES)]
        kv_pages = random_pages(hybrid.kv, PAGES, seed * 100 + n_kind)
        first_page = 1 if role == "writer" else 7  # the reader loads into other slots
        kv_idx = slots(hybrid.kv, first_page, PAGES)
        outcome: dict = {}
        if role == "writer":
            fill_bytes(hybrid.kv, kv_idx, kv_pages)
            outcome["kv"] = sum(backend.batch_set_v1(keys, kv_idx))
        else:
            probes = [transfer(s, [""] * s.window, None) for s in hybrid.sidecars]
            result = backend.batch_exists_v2(keys, probes)
            outcome["exists"] = {
                "kv_hit_pages": result.kv_hit_pages,
                "restorable": result.restorable_prefix_pages,
                "pool_hits": {str(k): v for k, v in result.extra_pool_hit_pages.items()},
            }
            loaded = backend.batch_get_v1(keys, kv_idx)
            same = [
                torch.equal(a, b) for a, b in zip(read_bytes(hybrid.kv, kv_idx, PAGES), kv_pages)
            ]
            outcome["kv"] = {"loaded": sum(loaded), "identical": sum(same)}
        for n_side, sidecar in enumerate(hybrid.sidecars):
            stored = loaded_n = identical = 0
            pool_seed = seed * 100 + 10 * (n_side + 1) + n_kind
            first_slot = 2 if role == "writer" else 11
            for n_plan, (plan_keys, idx) in enumerate(sidecar_plan(sidecar, keys, first_slot)):
                idx = kv_idx if idx is None else idx
                pages = random_pages(sidecar.pool, len(plan_keys), pool_seed + 1000 * n_plan)
                t = transfer(sidecar, plan_keys, idx)
                if role == "writer":
                    fill_bytes(sidecar.pool, idx, pages)
                    stored += sum(backend.batch_set_v2([t])[sidecar.name])
                else:
                    loaded_n += sum(backend.batch_get_v2([t])[sidecar.name])
                    got = read_bytes(sidecar.pool, idx, len(plan_keys))
                    identical += sum(torch.equal(a, b) for a, b in zip(got, pages))
            if role == "writer":
                outcome[sidecar.name] = stored
            else:
                outcome[sidecar.name] = {"loaded": loaded_n, "identical": identical}
        outcome["pool_stats"] = {
            name: {k: c[k] for k in ("pages_written", "hits")}
            for name, c in backend.get_stats().maru["pools"].items()
        }
        out[kind] = outcome
        backend.close()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
