"""Page-checksum hash speed (issue 13, P8): which hash `maru_checksums` uses, and what it costs.

    .venv/bin/python benchmarks/bench_checksum.py [--extra-path DIR]

Hashes pages of 64 KiB and 1 MiB straight from a /dev/shm mapping (a memoryview of the mmap,
no copy), as the client does, with each candidate that imports here: xxhash's xxh3_64 and
xxh64, `crc32c`, `google-crc32c`, and the standard library's zlib.crc32 (the no-dependency
baseline). Two cases per size: hot (the page was just written: in this core's cache, as for a
writer that hashes right after its copy of a small page) and cold (a pool of pages larger than
the last-level cache, each hashed once per pass: what a reader verifying after its copy sees
for large batches). Prints GB/s, the median of --reps passes. `--extra-path` is put on
sys.path first (for packages installed with `pip install --target`, to compare without
touching the venv).
"""

from __future__ import annotations

import argparse
import importlib
import mmap
import os
import statistics
import sys
import tempfile
import time
import zlib
from collections.abc import Callable

import numpy as np


def candidates() -> dict[str, Callable[[memoryview], int]]:
    found: dict[str, Callable[[memoryview], int]] = {"zlib.crc32 (stdlib)": zlib.crc32}
    for label, module, attr in (
        ("xxhash.xxh3_64", "xxhash", "xxh3_64_intdigest"),
        ("xxhash.xxh64", "xxhash", "xxh64_intdigest"),
        ("crc32c.crc32c", "crc32c", "crc32c"),
        ("google_crc32c.value", "google_crc32c", "value"),
    ):
        try:
            found[label] = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError):
            print(f"({label}: not installed)")
    if "google_crc32c.value" in found:
        import google_crc32c

        if google_crc32c.implementation != "c":
            found["google_crc32c.value (python)"] = found.pop("google_crc32c.value")
    return found


def measure(fn: Callable[[memoryview], int], views: list[memoryview], reps: int) -> float:
    """GB/s of `fn` over every view once per pass; the median pass."""
    nbytes = sum(v.nbytes for v in views)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for v in views:
            fn(v)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--extra-path", default="", help="put this directory on sys.path first")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--cold-mib", type=int, default=512, help="pool bytes for the cold case")
    args = ap.parse_args()
    if args.extra_path:
        sys.path.insert(0, args.extra_path)
    found = candidates()
    size = args.cold_mib << 20
    fd, path = tempfile.mkstemp(dir="/dev/shm", prefix="maru-bench-hash-")
    try:
        os.ftruncate(fd, size)
        with mmap.mmap(fd, size) as mm:
            np.frombuffer(mm, np.uint8)[:] = np.random.default_rng(0).integers(
                0, 256, size, np.uint8
            )
            view = memoryview(mm).toreadonly()  # (google_crc32c takes read-only buffers only)
            print(f"{'hash':28} {'page':>8} {'hot GB/s':>9} {'cold GB/s':>10}")
            for page in (64 << 10, 1 << 20):
                hot = [view[:page]] * max(1, (64 << 20) // page)
                cold = [view[i : i + page] for i in range(0, size, page)]
                for label, fn in found.items():
                    try:
                        fn(hot[0])  # warm
                    except TypeError:  # takes bytes only: hashing a page needs a copy
                        print(f"{label:28} {page >> 10:>6}Ki   (no memoryview: needs a copy)")
                        continue
                    h, c = measure(fn, hot, args.reps), measure(fn, cold, max(3, args.reps // 2))
                    print(f"{label:28} {page >> 10:>6}Ki {h:9.2f} {c:10.2f}")
                del hot, cold
            view.release()
    finally:
        os.close(fd)
        os.unlink(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
