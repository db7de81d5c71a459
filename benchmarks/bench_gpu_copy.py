"""Device memory <-> Maru's shared pool (issue 17, part 2): copies page by page between a
device buffer and a Maru region registered with CUDA (`cudaHostRegister`, as
`maru_sglang.cuda.register_with_cuda` does for the linker), against the same copies to and
from ordinary pinned host memory, the path HiCache's host pool takes.

    .venv/bin/python benchmarks/bench_gpu_copy.py            # ~20 s on a GPU host
    .venv/bin/python benchmarks/bench_gpu_copy.py --quick    # a few seconds

Starts its own `maru-server` (pool in --pool-dir). On a machine without CUDA (a CPU build of
torch, CI) the same copies run on the CPU: the "device" buffer is private memory, nothing is
registered and the pinned buffer is private memory too, so the figures are memcpy figures,
printed as such, not GPU ones. Methods alternate within each repetition; GB/s are medians.
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from maru import MaruHandler
from maru.common.config import parse_size

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from maru_sglang.cuda import register_with_cuda  # noqa: E402
from report import finish  # noqa: E402  (same dir)
from sglang_cpu.p2p import maru_server  # noqa: E402

METHODS = ("shared", "pinned")  # the registered Maru region; ordinary pinned host memory
DIRECTIONS = ("offload", "load")  # device -> host; host -> device


def page_copies(device_buf, host_buf, size: int, stride: int, count: int, offload: bool):
    """One copy per page, as the linker makes them: page i of the device buffer (pages back
    to back) to or from host bytes [i * stride, i * stride + size)."""
    for i in range(count):
        dev = device_buf[i * size : (i + 1) * size]
        host = host_buf[i * stride : i * stride + size]
        if offload:
            host.copy_(dev, non_blocking=True)
        else:
            dev.copy_(host, non_blocking=True)
    if device_buf.is_cuda:
        torch.cuda.synchronize()


def bench_size(handler, device: torch.device, size: int, total: int, reps: int) -> dict:
    """GB/s per (method, direction) for pages of `size` bytes, `total` bytes a copy round."""
    count = max(1, total // size)
    run = handler.alloc(size, count)
    if run is None:
        raise SystemExit(f"no shared run of {count} x {size} bytes: raise the pool size")
    try:
        nbytes = run.stride * count
        shared = torch.frombuffer(
            (ctypes.c_uint8 * nbytes).from_address(run.address), dtype=torch.uint8
        )
        cuda = device.type == "cuda"
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
        device_buf = torch.randint(0, 255, (count * size,), dtype=torch.uint8, device=device)
        hosts = {"shared": shared, "pinned": pinned}
        rates: dict[tuple[str, str], list[float]] = {}
        for rep in range(reps + 1):  # the first round warms up (faults the pages in)
            for method in METHODS if rep % 2 else METHODS[::-1]:
                for direction in DIRECTIONS:
                    start = time.perf_counter()
                    page_copies(
                        device_buf, hosts[method], size, run.stride, count, direction == "offload"
                    )
                    seconds = time.perf_counter() - start
                    if rep:
                        rates.setdefault((method, direction), []).append(
                            count * size / seconds / 1e9
                        )
        # the bytes made the round trip: device -> shared -> device is the same page
        check = torch.empty(size, dtype=torch.uint8, device=device)
        check.copy_(shared[:size])
        assert torch.equal(check, device_buf[:size]), "the shared bytes differ from the device's"
        return {key: statistics.median(v) for key, v in rates.items()}
    finally:
        handler.free(run)


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
        + ("torch pinned host memory" if cuda else "private memory (no CUDA)"),
    ]
    if not cuda:
        lines.append("NO CUDA DEVICE: CPU copies (memcpy figures), not GPU figures")
    lines += [
        "",
        "| page | direction | shared GB/s | pinned GB/s | shared / pinned |",
        "|---|---|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['page']} | {r['direction']} | {r['shared']:.2f} | {r['pinned']:.2f} | "
            f"{r['shared'] / r['pinned']:.0%} |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="64K,1M,4M", help="page sizes, comma-separated")
    ap.add_argument("--total", default="256M", help="bytes per copy round and method")
    ap.add_argument("--reps", type=int, default=7, help="measured rounds")
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
        config = {"pool_size": f"{pool >> 20}M", "chunk_size_bytes": min(sizes)}
        with MaruHandler(server_url=url, **config) as handler:
            registered = register_with_cuda(handler, device)
            for size in sizes:
                rates = bench_size(handler, device, size, total, reps)
                for direction in DIRECTIONS:
                    row = {"page": f"{size >> 10} KiB", "bytes": size, "direction": direction}
                    rows.append(row | {m: rates[(m, direction)] for m in METHODS})
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

    def write_csv(path: Path) -> None:
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)

    doc = {"machine": machine, "rows": rows}
    finish(
        "gpu-copy",
        args.out,
        text,
        doc,
        machine,
        t_start,
        write_csv=write_csv,
        quick=args.quick,
        label=args.label,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
