"""One SGLang "instance" for the cross-process MaruStorage tests (run as a subprocess).

    python storage_peer.py writer|reader <maru_url> <pages> <seed> [<extra config as JSON>]
    (extra config `"report_coherence": true`: the JSON also says, under "coherence", the
    copies' coherence mode while each backend was open and the cache lines they flushed)
    python storage_peer.py truncated <maru_url> <pages> <seed> <pool file>

For each geometry in GEOMETRIES it builds a real host pool, creates `MaruStorage` through
SGLang's real dynamic backend factory, and as the writer fills pages and calls `batch_set_v1`;
as the reader it calls `batch_exists` and `batch_get_v1` into *other* host indices and compares
with the reproducible expected bytes. Prints one JSON line with the outcome per geometry.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import sglang_cpu

sglang_cpu.apply()

import torch  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from maru.client.coherence import lines_flushed, process_mode  # noqa: E402
from sglang_cpu.host_pools import (  # noqa: E402
    Geometry,
    expected_pages,
    fill,
    make_host_pool,
    page_indices,
    read,
    storage_config,
)
from sglang_cpu.p2p import MARU_BACKEND  # noqa: E402

GEOMETRIES = [
    Geometry(attn="mha", layout="page_first_direct"),
    Geometry(attn="mha", layout="page_first"),
    Geometry(attn="mla", layout="page_first_direct"),
    Geometry(attn="mla", layout="page_first"),
]


def backend_for(url: str, g: Geometry, pool, more: dict | None = None):
    extra = {
        **MARU_BACKEND,
        "maru_server_url": url,
        "maru_pool_size": "64M",
        **(more or {}),
    }
    cfg = storage_config(is_mla=g.attn == "mla", extra=extra)
    backend = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    backend.register_mem_pool_host(pool)
    return backend


def truncated(url: str, pages: int, seed: int, pool_file: str) -> dict:
    """Store a batch, truncate the Maru pool's file under this writer (as an operator's
    mistake or a recreated pool would), store another batch into the same regions: the
    process lives, the pages stored after are False (their copies faulted), and nothing
    read afterwards is a wrong hit."""
    g = GEOMETRIES[0]
    pool = make_host_pool(g)
    backend = backend_for(url, g, pool)
    keys = [f"{seed:x}-before-{i}" for i in range(pages)]
    indices = page_indices(1, pages, g.page_size)
    fill(pool, indices, expected_pages(pool, pages, seed))
    before = sum(backend.batch_set_v1(keys, indices))
    backend.confirm_writes()
    os.truncate(pool_file, 0)
    after_keys = [f"{seed:x}-after-{i}" for i in range(pages)]
    fill(pool, indices, expected_pages(pool, pages, seed + 1))
    after = sum(backend.batch_set_v1(after_keys, indices))
    loaded = backend.batch_get_v1(keys + after_keys, page_indices(1, 2 * pages, g.page_size))
    backend.close()
    return {"before": before, "after": after, "loaded": sum(loaded)}


def main() -> None:
    role, url, pages, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    if role == "truncated":
        print(json.dumps(truncated(url, pages, seed, sys.argv[5])), flush=True)
        return
    more = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}
    report = more.pop("report_coherence", False)
    out = {}
    modes, copies = set(), [0, 0]  # the lines the data path's copies wrote back / invalidated
    for n, g in enumerate(GEOMETRIES):
        pool = make_host_pool(g)
        backend = backend_for(url, g, pool, more)
        modes.add(process_mode())
        before = lines_flushed()
        keys = [f"{seed:x}-page-{i}" for i in range(pages)]
        expected = expected_pages(pool, pages, seed + n)
        if role == "writer":
            indices = page_indices(1, pages, g.page_size)
            fill(pool, indices, expected)
            results = backend.batch_set_v1(keys, indices)
            out[f"{g.attn}/{g.layout}"] = {"stored": sum(results)}
        else:
            indices = page_indices(7, pages, g.page_size)  # other host slots than the writer's
            hits = backend.batch_exists(keys)
            results = backend.batch_get_v1(keys, indices)
            got = read(pool, indices, pages)
            same = sum(
                torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got, expected)
            )
            out[f"{g.attn}/{g.layout}"] = {
                "exists": hits,
                "loaded": sum(results),
                "identical": int(same),
            }
        copies = [c + a - b for c, a, b in zip(copies, lines_flushed(), before)]
        backend.close()  # (writes back the lines of its regions too: a close's, not a copy's)
    if report:
        out["coherence"] = {
            "modes": sorted(modes),
            "written_back": copies[0],
            "invalidated": copies[1],
        }
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
