"""Device memory <-> Maru's shared pool (issue 17, part 2): pages scattered over a device
buffer (as KV pages are over a device KV pool) copied to and from a Maru region registered with
CUDA, as the linker copies them, against the same copies to and from ordinary pinned host
memory (the path HiCache's host pool takes), and against one DMA of the same bytes in one
piece (the host link's limit, measured in the same run).

    .venv/bin/python benchmarks/bench_gpu_copy.py            # ~30 s on a GPU host
    .venv/bin/python benchmarks/bench_gpu_copy.py --quick    # a few seconds

Two ways to copy a table of pages: **kernel**, the linker's (`maru_sglang.cuda.copy_pieces`:
one launch, the GPU reads or writes the host bytes itself), and **DMA/page**, one
`cudaMemcpyAsync` per page (torch `copy_`). Starts its own `maru-server` (pool in
--pool-dir). On a machine without CUDA (a CPU build of torch, CI) only the DMA/page copies
run, on the CPU (memcpy figures, printed as such, not GPU ones). Methods alternate within
each repetition, each timed round right after an untimed one of its own; GB/s are medians.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from maru import MaruHandler
from maru.common.config import parse_size

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from maru_sglang.cuda import copy_pieces, register_with_cuda  # noqa: E402
from report import finish, rows_csv  # noqa: E402  (same dir)
from sglang_cpu.p2p import maru_server  # noqa: E402

HOSTS = ("shared", "pinned")  # the registered Maru region; ordinary pinned host memory
DIRECTIONS = ("offload", "load")  # device -> host; host -> device
MAX_PAGES = 16384  # per round: DMA/page makes one call per page


def copy_round(method, device_buf, host_buf, size, slots, stride, offload, stream) -> None:
    """Page i of the host bytes ([i * stride, + size)) to or from device slot `slots[i]`."""
    cuda = device_buf.is_cuda
    if method == "kernel":
        dev = device_buf.data_ptr() + slots * size
        host = host_buf.data_ptr() + np.arange(slots.size, dtype=np.int64) * stride
        sizes = np.full(slots.size, size, np.int64)
        (
            copy_pieces(host, dev, sizes, stream)
            if offload
            else copy_pieces(dev, host, sizes, stream)
        )
    elif method == "dma":
        with torch.cuda.stream(stream) if cuda else _nothing():
            for i, slot in enumerate(slots.tolist()):
                dev = device_buf[slot * size : (slot + 1) * size]
                host = host_buf[i * stride : i * stride + size]
                (
                    host.copy_(dev, non_blocking=True)
                    if offload
                    else dev.copy_(host, non_blocking=True)
                )
    else:  # "one": the same bytes in one piece (the link's limit)
        n = slots.size * size
        with torch.cuda.stream(stream) if cuda else _nothing():
            if offload:
                host_buf[:n].copy_(device_buf[:n], non_blocking=True)
            else:
                device_buf[:n].copy_(host_buf[:n], non_blocking=True)
    if cuda:
        stream.synchronize()


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


def bench_size(handler, device: torch.device, size: int, total: int, reps: int) -> dict:
    """GB/s per (method, host, direction) for pages of `size` bytes."""
    count = max(1, min(total // size, MAX_PAGES))
    run = handler.alloc(size, count)
    if run is None:
        raise SystemExit(f"no shared run of {count} x {size} bytes: raise the pool size")
    cuda = device.type == "cuda"
    methods = ("kernel", "dma", "one") if cuda else ("dma", "one")
    stream = torch.cuda.Stream(device) if cuda else None
    try:
        nbytes = run.stride * count
        shared = torch.frombuffer(
            (ctypes.c_uint8 * nbytes).from_address(run.address), dtype=torch.uint8
        )
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
        rng = np.random.default_rng(size)
        slots = rng.permutation(2 * count)[:count].astype(np.int64)  # scattered, as KV pages
        device_buf = torch.randint(0, 255, (2 * count * size,), dtype=torch.uint8, device=device)
        hosts = {"shared": shared, "pinned": pinned}
        rates: dict[tuple[str, str, str], list[float]] = {}
        for rep in range(reps + 1):  # the first round warms up (faults pages in, compiles)
            order = [(m, h) for m in methods for h in HOSTS]
            for method, host in order if rep % 2 else order[::-1]:
                for direction in DIRECTIONS:
                    offload = direction == "offload"
                    args = (device_buf, hosts[host], size, slots, run.stride, offload)
                    # An untimed round first: an idle GPU's clocks are low, and the DMA/page
                    # rounds leave it idle (the linker copies while the GPU computes).
                    copy_round(method, *args, stream)
                    start = time.perf_counter()
                    copy_round(method, *args, stream)
                    seconds = time.perf_counter() - start
                    if rep:
                        rates.setdefault((method, host, direction), []).append(
                            count * size / seconds / 1e9
                        )
        # The bytes made the round trip: device -> shared (offload) -> device (load) -> same.
        copy_round(methods[0], device_buf, shared, size, slots, run.stride, True, stream)
        check = torch.empty(size, dtype=torch.uint8, device=device)
        check.copy_(shared[:size])
        first = int(slots[0])
        want = device_buf[first * size : (first + 1) * size]
        assert torch.equal(check, want), "the shared bytes differ from the device's"
        return {key: statistics.median(v) for key, v in rates.items()}
    finally:
        handler.free(run)


COLUMNS = [  # (row key, header)
    ("kernel/shared", "kernel shared"),
    ("kernel/pinned", "kernel pinned"),
    ("dma/shared", "DMA/page shared"),
    ("dma/pinned", "DMA/page pinned"),
    ("one/shared", "one DMA shared (limit)"),
]


def render(machine: dict, rows: list[dict], cmd: str) -> str:
    cuda = machine["device"].startswith("cuda")
    lines = [
        f"machine: {machine['cpu_count']} cores, Linux {machine['kernel']}, torch "
        f"{machine['torch']}, device {machine['device']}; pool in {machine['pool_dir']}",
        f"command: {cmd}",
        "",
        "shared: a Maru region"
        + (" registered with cudaHostRegister" if cuda else "")
        + "; pinned: "
        + ("torch pinned host memory" if cuda else "private memory (no CUDA)")
        + f"; up to {MAX_PAGES} pages a round, scattered over the device buffer",
    ]
    if not cuda:
        lines.append("NO CUDA DEVICE: CPU copies (memcpy figures), not GPU figures; no kernel")
    cols = [(k, h) for k, h in COLUMNS if k in rows[0]]
    lines += [
        "",
        "| page | direction | " + " | ".join(f"{h} GB/s" for _, h in cols) + " | best / limit |",
        "|---|---|" + "---:|" * (len(cols) + 1),
    ]
    for r in rows:
        best = r.get("kernel/shared", r["dma/shared"])
        cells = " | ".join(f"{r[k]:.2f}" for k, _ in cols)
        lines.append(f"| {r['page']} | {r['direction']} | {cells} | {best / r['one/shared']:.0%} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="2K,16K,64K,1M,4M", help="page sizes, comma-separated")
    ap.add_argument("--total", default="256M", help="bytes per copy round (at most 16384 pages)")
    ap.add_argument("--reps", type=int, default=5, help="measured rounds")
    ap.add_argument("--quick", action="store_true", help="32 MiB rounds, 3 of them")
    ap.add_argument("--pool-dir", default="/dev/shm", help="the tmpfs for the pool")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="results dir")
    ap.add_argument("--label", default="", help="added to the result file names")
    args = ap.parse_args()
    t_start = time.monotonic()
    sizes = [parse_size(s, name="--sizes") for s in args.sizes.split(",")]
    total = parse_size("32M" if args.quick else args.total, name="--total")
    reps = 3 if args.quick else args.reps
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    pool = 2 * total + max(sizes) + (64 << 20)
    rows = []
    with maru_server(f"{pool >> 20}M", pool_dir=args.pool_dir) as url:
        chunk = max(4096, min(sizes))  # a page of less takes a chunk of its own
        config = {"pool_size": f"{pool >> 20}M", "chunk_size_bytes": chunk}
        with MaruHandler(server_url=url, **config) as handler:
            registered = register_with_cuda(handler, device) is not None
            for size in sizes:
                rates = bench_size(handler, device, size, total, reps)
                for direction in DIRECTIONS:
                    row = {"page": f"{size >> 10} KiB", "bytes": size, "direction": direction}
                    for (method, host, d), rate in sorted(rates.items()):
                        if d == direction:
                            row[f"{method}/{host}"] = rate
                    rows.append(row)
    machine = {
        "device": str(device)
        + (f" ({torch.cuda.get_device_name()})" if device.type == "cuda" else ""),
        "registered": registered,
        "cpu_count": os.cpu_count(),
        "kernel": platform.release(),
        "torch": torch.__version__,
        "pool_dir": args.pool_dir,
    }
    cmd = " ".join([Path(sys.executable).name, "benchmarks/bench_gpu_copy.py", *sys.argv[1:]])
    text = render(machine, rows, cmd)

    doc = {"machine": machine, "rows": rows}
    finish(
        "gpu-copy",
        args.out,
        text,
        doc,
        machine,
        t_start,
        write_csv=rows_csv(rows),
        quick=args.quick,
        label=args.label,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
