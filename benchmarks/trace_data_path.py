"""How far one warm `MaruStorage.batch_set_v1` / `batch_get_v1` wanders through `src/`: the
Python files of `src/` it enters, how often it switches from one file to another, and the
functions of `src/` it calls, traced with `sys.setprofile` (a real maru-server, SGLang's real
MHA host pool on CPU through the shims in tests/sglang_cpu).

    python benchmarks/trace_data_path.py              # 64 pages of 64 KiB each way
    python benchmarks/trace_data_path.py --pages 16 --files

A switch is a call or a return that moves from a frame of one file of `src/` to a frame of
another (frames outside `src/`, numpy's or torch's, are skipped: a call through them counts
once, from the file that made it to the file it reached). The first calls of each kind are
untimed warm-ups; the traced call is the next one, with the same geometry.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SRC = str(ROOT / "src") + "/"
sys.path.insert(0, str(ROOT / "tests"))


def trace(fn: Callable[[], Any]) -> dict[str, Any]:
    """Run `fn` under a profile hook; the files of `src/` entered (in order), the switches
    between them and the functions of `src/` called."""
    files: list[str] = []
    functions: set[str] = set()
    route: list[str] = []  # where each switch went: file.function
    switches = 0
    last: str | None = None

    def hook(frame: Any, event: str, _arg: Any) -> None:
        nonlocal switches, last
        if event not in ("call", "return"):
            return
        path = frame.f_code.co_filename
        if not path.startswith(SRC):
            return
        name = path[len(SRC) :]
        if event == "call":
            functions.add(f"{name}:{frame.f_code.co_name}")
            if name not in files:
                files.append(name)
            here, function = name, frame.f_code.co_name
        else:  # returning to the caller: the caller's file is where we are next
            back = frame.f_back
            while back is not None and not back.f_code.co_filename.startswith(SRC):
                back = back.f_back
            here = back.f_code.co_filename[len(SRC) :] if back is not None else name
            function = back.f_code.co_name if back is not None else "?"
        if last is not None and here != last:
            switches += 1
            route.append(f"{Path(here).stem}.{function}")
        elif last is None:
            route.append(f"{Path(here).stem}.{function}")
        last = here

    sys.setprofile(hook)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return {"files": files, "switches": switches, "functions": len(functions), "path": route}


def run(pages: int, page_kib: int) -> dict[str, Any]:
    import sglang_cpu

    sglang_cpu.apply()
    import sglang_cpu.host_pools as hp
    from conftest import start_maru_server
    from maru_sglang.maru_storage import KV_POOL_NAME, MaruStorage
    from sglang_cpu.p2p import MARU_BACKEND

    workdir = Path(tempfile.mkdtemp(prefix="maru-trace-"))
    server = start_maru_server(workdir, pool_size="1G")
    try:
        # 64 KiB pages: 16 tokens x 2 layers x K and V x 8 heads x 64 dims x 2 bytes
        g = hp.Geometry(page_size=16 * page_kib // 64, layers=2, heads=8, head_dim=64)
        pool = hp.make_host_pool(g)
        extra = {**MARU_BACKEND, "maru_server_url": server.url, "maru_pool_size": "512M"}
        storage = MaruStorage(hp.storage_config(extra=extra), {})
        storage.register_mem_pool_host(pool)
        assert storage.pools[KV_POOL_NAME].page_bytes == page_kib * 1024, "geometry"
        indices = hp.page_indices(0, pages, g.page_size)
        hp.fill(pool, indices, hp.expected_pages(pool, pages, seed=3))
        for warm in range(3):
            storage.batch_set_v1([f"warm{warm}-{i}" for i in range(pages)], indices)
            storage.batch_get_v1([f"warm{warm}-{i}" for i in range(pages)], indices)
        storage.confirm_writes()
        keys = [f"traced-{i}" for i in range(pages)]
        result: dict[str, Any] = {}
        result["batch_set_v1"] = trace(lambda: storage.batch_set_v1(keys, indices))
        storage.confirm_writes()
        result["batch_get_v1"] = trace(lambda: storage.batch_get_v1(keys, indices))
        storage.close()
        return result
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pages", type=int, default=64)
    p.add_argument("--page-kib", type=int, default=64, help="KiB per page (a multiple of 64)")
    p.add_argument("--files", action="store_true", help="list the files in the order entered")
    p.add_argument("--path", action="store_true", help="list every switch (file.function)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    result = run(a.pages, a.page_kib)
    if a.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"| call ({a.pages} pages of {a.page_kib} KiB) | files of src/ | switches | functions |")
    print("|---|---:|---:|---:|")
    for name, r in result.items():
        print(f"| {name} | {len(r['files'])} | {r['switches']} | {r['functions']} |")
    if a.files:
        for name, r in result.items():
            print(f"\n{name}: " + " > ".join(r["files"]))
    if a.path:
        for name, r in result.items():
            print(f"\n{name}: " + " > ".join(r["path"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
