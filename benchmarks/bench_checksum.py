"""Page-checksum speed (issue 13, P8): the hash `maru_checksums` uses, and what it costs.

    .venv/bin/python benchmarks/bench_checksum.py [--extra-path DIR]

1. Hashes pages of 64 KiB and 1 MiB straight from a /dev/shm mapping (no copy): maru64 (Maru's
   own, `maru.common.checksum`; each C loop this CPU runs, all pages of a pass in one call, as
   the data path calls it) beside the maintained hashes that import here for reference:
   xxhash's xxh3_64 and xxh64, `crc32c`, `google-crc32c`, and zlib.crc32. Two cases per size:
   hot (the same page again and again: in this core's cache) and cold (a pool of pages larger
   than the last-level cache, each hashed once per pass). maru64 must run above the cold
   column (memory bandwidth) on one core.
2. What the data path pays: the copy loop alone (`copy_many`, streaming stores, pages from a
   private buffer into the mapping: a store) against the same copy with the hash fused in
   (`copy_many_hashed`), for pages of one part and pages of 61 parts of 18 KiB (an MLA page:
   DeepSeek-V3's 61 layers, page 16), alternating in each pass. Timed in the copying thread's
   CPU time (the loop is one thread that never waits), so that other processes on a shared
   machine move the figures less than they move wall time.

Prints GB/s, the median of --reps passes. `--extra-path` is put on sys.path first (for packages
installed with `pip install --target`, to compare without touching the venv).
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
from functools import partial

import numpy as np

from maru.common import memcopy


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


def maru64_rows(view: memoryview, size: int, reps: int) -> None:
    """maru64 hot and cold, with each C loop this CPU runs (one call per pass)."""
    from maru.common._memcopy import copy_many_hashed, hash_impl

    base = np.frombuffer(view, np.uint8).ctypes.data
    for page in (64 << 10, 1 << 20):
        hot = np.full(max(1, (64 << 20) // page), base, np.int64)
        cold = base + np.arange(0, size, page, dtype=np.int64)
        for impl in ("scalar", "avx2", "avx512"):
            try:
                before = hash_impl(impl)
            except ValueError:
                continue
            rates = []
            for addresses in (hot, cold):
                sizes = np.full(len(addresses), page, np.int64)
                times = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    copy_many_hashed(None, addresses, sizes, 1)
                    times.append(time.perf_counter() - t0)
                rates.append(len(addresses) * page / statistics.median(times) / 1e9)
            hash_impl(before)
            label = f"maru64 ({impl})"
            print(f"{label:28} {page >> 10:>6}Ki {rates[0]:9.2f} {rates[1]:10.2f}")


def fused_rows(pool: memoryview, reps: int) -> None:
    """The copy loop alone against the copy with maru64 fused in, into the mapping."""
    size = pool.nbytes
    src = np.random.default_rng(1).integers(0, 256, size, np.uint8)
    dst = np.frombuffer(pool, np.uint8).ctypes.data
    print()
    print(f"{'store copy (streaming)':28} {'copy GB/s':>10} {'+maru64 GB/s':>13} {'cost':>6}")
    for label, parts, part in (
        ("64 KiB pages", 1, 64 << 10),
        ("1 MiB pages", 1, 1 << 20),
        ("MLA pages, 61 x 18 KiB", 61, 18432),
    ):
        page = parts * part
        pages = size // page
        starts = np.arange(pages, dtype=np.int64) * page
        offsets = np.arange(parts, dtype=np.int64) * part
        sources = src.ctypes.data + starts[:, None] + offsets
        targets = dst + starts[:, None] + offsets

        plain = partial(memcopy.copy_many, targets, sources, [part] * parts)
        hashed = partial(memcopy.copy_many_hashed, targets, sources, [part] * parts)
        times: dict[str, list[float]] = {"plain": [], "hashed": []}
        for _ in range(reps):
            for name, fn in (("plain", plain), ("hashed", hashed)):
                t0 = time.thread_time()
                fn()
                times[name].append(time.thread_time() - t0)
        a, b = (pages * page / statistics.median(times[n]) / 1e9 for n in ("plain", "hashed"))
        print(f"{label:28} {a:10.2f} {b:13.2f} {1 - b / a:6.0%}")


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
            maru64_rows(view, size, args.reps)
            fused_rows(memoryview(mm), args.reps)
            view.release()
    finally:
        os.close(fd)
        os.unlink(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
