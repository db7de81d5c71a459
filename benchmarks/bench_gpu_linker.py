"""The linker on a GPU (issue 17, part 2): a prefix of KV pages loaded from Maru into a real
SGLang device KV pool on CUDA through `MaruCacheLinker` (one copy: the copy kernel, layer by
layer, from the registered shared mapping to HBM), against the host tier's two copies of the
same pages in the same run (`MaruHandler.read` into pinned host memory, what MaruStorage does
for HiCache's host pool, then one DMA of the whole buffer to the device: the host tier's best
case), and one DMA of the same bytes alone (the host link's limit).

    python benchmarks/bench_gpu_linker.py            # a GPU host with SGLang, ~1 min
    python benchmarks/bench_gpu_linker.py --quick    # a few seconds

Geometry: Llama-3-8B at TP 1 by default (32 layers, 8 KV heads of 128, bf16; pages of 64
tokens: 8 MiB a page). The linker's time runs from `load` (one leased lookup) to
`finish_layer_wise_loading` (every layer landed, leases confirmed). Needs CUDA and SGLang:
without them it says so and exits. Starts its own `maru-server`; medians of --reps.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from report import finish, rows_csv  # noqa: E402  (same dir)
from sglang_cpu.p2p import maru_server  # noqa: E402
from sglang_cpu.tiny_model import build_tiny_model  # noqa: E402

DTYPE = torch.bfloat16


class Side:
    """One instance: a device KV pool on the GPU, its allocator, a MaruCacheLinker on it."""

    def __init__(self, args, server_args, url: str, tokens: int, pool: str):
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

        from maru_sglang.linker import MaruCacheLinker

        self.device = MHATokenToKVPool(
            tokens, args.page_size, DTYPE, head_num=args.heads, head_dim=args.head_dim,
            layer_num=args.layers, device="cuda", enable_memory_saver=False, start_layer=0,
            end_layer=args.layers - 1,
        )  # fmt: skip
        self.allocator = PagedTokenToKVPoolAllocator(
            tokens, args.page_size, DTYPE, "cuda", self.device, need_sort=False
        )
        params = CacheInitParams(False, None, self.allocator, args.page_size)
        config = {"maru_server_url": url, "maru_pool_size": pool}
        self.linker = MaruCacheLinker(
            server_args, params, components={ComponentType.FULL}, extra_config=config
        )
        self.device.register_layer_transfer_counter(self.linker.layer_done_counter)


def transfers(keys, slots=None):
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    return [PoolTransfer(name=PoolName.KV, device_indices=slots, keys=list(keys))]


def wait_for(cond, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise SystemExit("timed out waiting for the linker")
        time.sleep(0.001)


def bench_prefix(a: Side, b: Side, args, pages: int, reps: int) -> dict:
    """Seconds (medians) of each path for a prefix of `pages` pages."""
    page = args.page_size
    keys = [f"bench-{pages}-{i:05d}" for i in range(pages)]
    slots = a.allocator.alloc(pages * page)
    for part in (a.device.k_buffer, a.device.v_buffer):
        for buf in part:
            buf[slots] = torch.randn(buf[slots].shape, device="cuda").to(DTYPE)
    assert a.linker.offload(transfers(keys, slots))
    wait_for(lambda: a.linker.num_completed_offloads() >= 1)
    assert a.linker.pop_completed_offload(), "offload failed"
    page_bytes = b.linker.layout.page_bytes
    pinned = torch.empty(pages * page_bytes, dtype=torch.uint8, pin_memory=True)
    staging = torch.empty(pages * page_bytes, dtype=torch.uint8, device="cuda")
    buffers = (pinned.data_ptr() + np.arange(pages, dtype=np.int64) * page_bytes)[:, None]
    times: dict[str, list[float]] = {}

    def linker_load() -> None:
        dest = b.allocator.alloc(pages * page)
        start = time.perf_counter()
        assert b.linker.load("r", transfers(keys, dest))
        index = b.linker.start_layer_wise_loading()
        assert b.linker.finish_layer_wise_loading(index)
        times.setdefault("linker", []).append(time.perf_counter() - start)
        got = b.device.k_buffer[-1][dest[-page:]]
        assert torch.equal(got, a.device.k_buffer[-1][slots[-page:]]), "wrong bytes loaded"
        b.allocator.free(dest)

    def two_copies() -> None:
        start = time.perf_counter()
        ok = b.linker.handler.read(
            keys, buffers, np.array([page_bytes]), length=page_bytes, prefix=b.linker.prefix
        )
        assert all(ok), "host-tier read missed"
        middle = time.perf_counter()
        staging.copy_(pinned, non_blocking=True)
        torch.cuda.synchronize()
        end = time.perf_counter()
        times.setdefault("read", []).append(middle - start)
        times.setdefault("two", []).append(end - start)

    def one_dma() -> None:
        start = time.perf_counter()
        staging.copy_(pinned, non_blocking=True)
        torch.cuda.synchronize()
        times.setdefault("dma", []).append(time.perf_counter() - start)

    for rep in range(reps + 1):
        methods = [linker_load, two_copies, one_dma]
        for method in methods if rep % 2 else methods[::-1]:
            method()  # untimed warm-up round in rep 0 (its times dropped below)
    a.allocator.free(slots)
    return {name: statistics.median(v[1:]) for name, v in times.items()} | {
        "bytes": pages * page_bytes
    }


def render(machine: dict, rows: list[dict], cmd: str) -> str:
    lines = [
        f"machine: {machine['cpu_count']} cores, Linux {machine['kernel']}, torch "
        f"{machine['torch']}, {machine['device']}",
        f"command: {cmd}",
        f"geometry: {machine['geometry']}",
        "",
        "| prefix | MiB | linker ms | GB/s | host tier: read + DMA ms | (read ms) | one DMA ms "
        "(limit) | linker / limit | host tier / linker |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['tokens']} tokens | {r['bytes'] / 2**20:.0f} | {r['linker'] * 1e3:.2f} | "
            f"{r['bytes'] / r['linker'] / 1e9:.1f} | {r['two'] * 1e3:.2f} | "
            f"{r['read'] * 1e3:.2f} | {r['dma'] * 1e3:.2f} | {r['dma'] / r['linker']:.0%} | "
            f"{r['two'] / r['linker']:.2f}x |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="512,4096", help="prefix lengths, comma-separated")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8, help="KV heads")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=64, help="tokens a page")
    ap.add_argument("--reps", type=int, default=7, help="measured rounds")
    ap.add_argument("--quick", action="store_true", help="512 tokens, 3 rounds")
    ap.add_argument("--pool-dir", default="/dev/shm", help="the tmpfs for the pool")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="results dir")
    ap.add_argument("--label", default="", help="added to the result file names")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_gpu_linker: needs a CUDA GPU (torch sees none); nothing measured")
        return 0
    try:
        from sglang.srt import runtime_context
        from sglang.srt.runtime_context import SpawnRanks
        from sglang.srt.server_args import ServerArgs
    except ImportError as exc:
        print(f"bench_gpu_linker: needs SGLang ({exc}); nothing measured")
        return 0
    t_start = time.monotonic()
    prefixes = [int(t) for t in ("512" if args.quick else args.tokens).split(",")]
    reps = 3 if args.quick else args.reps
    pages = [-(-t // args.page_size) for t in prefixes]
    model = build_tiny_model(Path(tempfile.mkdtemp(prefix="maru-bench-model-")))
    server_args = ServerArgs(model_path=str(model), device="cuda", page_size=args.page_size)
    runtime_context.publish(server_args, role="bench", ranks=SpawnRanks(world_rank=0))
    tokens = 2 * max(pages) * args.page_size + args.page_size
    page_bytes = 2 * args.layers * args.page_size * args.heads * args.head_dim * 2
    pool = f"{(3 * max(pages) * page_bytes >> 20) + 256}M"
    rows = []
    with maru_server(pool, pool_dir=args.pool_dir) as url:
        a = Side(args, server_args, url, tokens, pool)
        b = Side(args, server_args, url, tokens, pool)
        try:
            for prefix, n in zip(prefixes, pages):
                rows.append({"tokens": prefix, "pages": n} | bench_prefix(a, b, args, n, reps))
        finally:
            a.linker.close()
            b.linker.close()
    geometry = (
        f"{args.layers} layers, {args.heads} KV heads x {args.head_dim}, bf16, "
        f"{args.page_size}-token pages of {page_bytes >> 10} KiB; pool in {args.pool_dir}"
    )
    machine = {
        "device": torch.cuda.get_device_name(),
        "cpu_count": os.cpu_count(),
        "kernel": platform.release(),
        "torch": torch.__version__,
        "geometry": geometry,
    }
    cmd = " ".join([Path(sys.executable).name, "benchmarks/bench_gpu_linker.py", *sys.argv[1:]])
    text = render(machine, rows, cmd)

    doc = {"machine": machine, "rows": rows}
    finish(
        "gpu-linker", args.out, text, doc, machine, t_start,
        write_csv=rows_csv(rows), quick=args.quick, label=args.label,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
