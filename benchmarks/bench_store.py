"""Store benchmark: MaruHandler batch_store / batch_retrieve throughput beside plain memcpy.

    python benchmarks/bench_store.py            # ~30 s on 2 cores
    python benchmarks/bench_store.py --quick    # a few seconds
    python benchmarks/bench_store.py --server-url tcp://127.0.0.1:5555   # an existing server

Starts its own `maru-server` (1 GiB pool in /dev/shm, removed afterwards) unless given a URL.
For each value size (64 KiB, 1 MiB, 4 MiB) it moves the same bytes four ways, in this run:

- memcpy:         memoryview slice assignment of each value into a warm private buffer;
- memcpy to shm:  the same, into a warm MAP_SHARED mapping of a /dev/shm file (the kind of
                  memory the pool is), to separate the cost of the memory from Maru's own;
- batch_store:    one writer handler copies each value into its shared pages and registers the
                  batch with one RPC (keys are deleted between repetitions, so pages are warm);
- batch_retrieve: a second handler (its own read-only mapping) looks the batch up with one
                  RPC and copies every value out into a warm private buffer, which is what a
                  consumer does with the bytes.

Then it times batch lookups of 128 keys (`batch_retrieve` without touching the bytes) and
reports microseconds per key. Figures are medians over repetitions.

Read validation (issue 13, P4): the check every guarded read makes, measured apart. A read as
`MaruStorage.batch_get_v1` does it (a leased lookup, one C copy of every value into a private
buffer, then `release(confirm=True)`: one more round trip that tells whether the lease held
for the whole copy, so that pages reused meanwhile are never taken for hits), against the same
read with the confirmation bypassed (the release sent without waiting: in this benchmark
only), alternating, for batches of 1 and 128 values. The pool generation and region tokens
are checked when a region is mapped and at each handshake, not per read: nothing to measure
per batch. Checksums (`maru_checksums`) are measured in bench_hicache.py.
"""

from __future__ import annotations

import argparse
import mmap
import os
import platform
import statistics
import sys
import time
import uuid
from pathlib import Path

import numpy as np

from maru import MaruHandler
from maru.common.memcopy import copy_many

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from sglang_cpu.p2p import maru_server

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
SIZES = [64 * KiB, 1 * MiB, 4 * MiB]


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def bench_size(writer, reader, size: int, total: int, batch_bytes: int, reps: int, tag: str):
    count = max(1, total // size)
    per_batch = max(1, min(count, batch_bytes // size))
    nbytes = count * size
    src = np.random.default_rng(size).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    dst[:] = 1  # fault the destination in: every mode copies into warm memory
    src_v, dst_v = memoryview(src), memoryview(dst)
    shm_path = f"/dev/shm/maru-bench-memcpy-{uuid.uuid4().hex}"
    fd = os.open(shm_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        shm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
        os.unlink(shm_path)  # the mapping keeps the memory until it is closed
    shm_v = memoryview(shm)
    shm_v[:] = dst_v  # fault it in
    values = [src_v[i * size : (i + 1) * size] for i in range(count)]
    keys = [f"bench/{tag}/{size}/{i}" for i in range(count)]
    batches = [range(s, min(s + per_batch, count)) for s in range(0, count, per_batch)]

    memcpy_s, shm_s, store_s, retrieve_s = [], [], [], []
    for rep in range(reps + 1):  # the first round warms pages and mappings; not counted
        t0 = time.perf_counter()
        for i in range(count):
            dst_v[i * size : (i + 1) * size] = values[i]
        t1 = time.perf_counter()
        for i in range(count):
            shm_v[i * size : (i + 1) * size] = values[i]
        t1b = time.perf_counter()
        for b in batches:
            ok = writer.batch_store([keys[i] for i in b], [values[i] for i in b])
            if not all(ok):
                raise RuntimeError(f"batch_store failed for {size}-byte values")
        t2 = time.perf_counter()
        for b in batches:
            infos = reader.batch_retrieve([keys[i] for i in b])
            for i, info in zip(b, infos):
                dst_v[i * size : (i + 1) * size] = info.view
        t3 = time.perf_counter()
        if rep == 0 and bytes(dst_v[-size:]) != bytes(values[-1]):
            raise RuntimeError("retrieved bytes differ")
        del infos
        if rep:
            memcpy_s.append(t1 - t0)
            shm_s.append(t1b - t1)
            store_s.append(t2 - t1b)
            retrieve_s.append(t3 - t2)
        for b in batches:
            writer.batch_delete([keys[i] for i in b])
    shm_v.release()
    shm.close()
    return {
        "size": size,
        "count": count,
        "batch": per_batch,
        "memcpy": gbps(nbytes, statistics.median(memcpy_s)),
        "memcpy_shm": gbps(nbytes, statistics.median(shm_s)),
        "store": gbps(nbytes, statistics.median(store_s)),
        "retrieve": gbps(nbytes, statistics.median(retrieve_s)),
    }


def bench_lookup(writer, reader, batch: int, rounds: int) -> dict:
    keys = [f"bench/lookup/{i}" for i in range(batch)]
    assert all(writer.batch_store(keys, [b"x" * 4096] * batch))
    misses = [f"bench/missing/{i}" for i in range(batch)]
    out = {}
    for name, ks in (("hit", keys), ("miss", misses)):
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            infos = reader.batch_retrieve(ks)
            times.append(time.perf_counter() - t0)
        assert (infos[0] is not None) == (name == "hit")
        out[name] = statistics.median(times) / batch * 1e6
    writer.batch_delete(keys)
    return out


def bench_validation(writer, reader, size: int, batch: int, rounds: int) -> dict:
    """Median microseconds of a guarded read of `batch` values of `size` bytes, with the
    lease confirmed after the copy (as MaruStorage reads) and with it bypassed."""
    keys = [f"bench/validate/{size}/{batch}/{i}" for i in range(batch)]
    assert all(writer.batch_store(keys, [bytes([i % 251]) * size for i in range(batch)]))
    dst = np.ones(batch * size, np.uint8)  # warm
    targets = dst.ctypes.data + np.arange(batch, dtype=np.int64) * size
    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(rounds + 1):
        for confirm in (True, False) if r % 2 else (False, True):  # alternate the order
            t0 = time.perf_counter()
            lookup = reader.lookup(keys, lease=True)
            addresses, lengths = lookup.wait()
            copy_many(targets, addresses, size)
            held = lookup.release(confirm=confirm)
            t = time.perf_counter() - t0
            if not (held and (lengths == size).all()):
                raise RuntimeError("a guarded read of stored keys missed")
            if r:
                times[confirm].append(t)
    if dst[-1] != (batch - 1) % 251:
        raise RuntimeError("read bytes differ")
    writer.batch_delete(keys)
    confirmed, bypassed = (statistics.median(times[c]) * 1e6 for c in (True, False))
    return {"size": size, "batch": batch, "confirmed": confirmed, "bypassed": bypassed}


def size_label(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="less data and fewer repetitions")
    ap.add_argument("--server-url", help="use a running maru-server instead of starting one")
    ap.add_argument("--chunk", default="64K", help="handler page size (default: 64K)")
    args = ap.parse_args()
    total = 64 * MiB if args.quick else 256 * MiB
    reps = 3 if args.quick else 9
    rounds = 50 if args.quick else 300

    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"{_cpu_model()}; Python {platform.python_version()}, numpy {np.__version__}"
    )
    print(
        f"data per size: {total // MiB} MiB, batches of up to 16 MiB, median of {reps} runs, "
        f"handler page size {args.chunk}"
    )

    def run(url: str) -> None:
        common = {"server_url": url, "chunk_size_bytes": args.chunk, "timeout_ms": 30_000}
        with (
            # one region for all of it, taken by the first store (as before regions grew)
            MaruHandler(
                pool_size=total + 32 * MiB, expand_size=total + 32 * MiB, **common
            ) as writer,
            MaruHandler(pool_size="2M", **common) as reader,
        ):
            rows = [bench_size(writer, reader, size, total, 16 * MiB, reps, "t") for size in SIZES]
            lookup = bench_lookup(writer, reader, 128, rounds)
            checks = [  # (128 values of 1 MiB are more than --quick's pool: fewer there)
                bench_validation(writer, reader, size, batch, rounds)
                for size in (64 * KiB, 1 * MiB)
                for batch in (1, min(128, total // 2 // size))
            ]
        print()
        print(
            f"{'value size':>10} {'values':>7} {'batch':>6} {'memcpy GB/s':>12} "
            f"{'memcpy->shm GB/s':>17} {'batch_store GB/s':>17} {'batch_retrieve GB/s':>20}"
            f" {'store/memcpy':>12} {'retrieve/memcpy':>15}"
        )
        for r in rows:
            print(
                f"{size_label(r['size']):>10} {r['count']:>7} {r['batch']:>6} "
                f"{r['memcpy']:>12.2f} {r['memcpy_shm']:>17.2f} {r['store']:>17.2f} "
                f"{r['retrieve']:>20.2f} {r['store'] / r['memcpy']:>12.0%}"
                f" {r['retrieve'] / r['memcpy']:>15.0%}"
            )
        print()
        print(
            f"batch lookup of 128 keys (batch_retrieve, no copy), median of {rounds}: "
            f"{lookup['hit']:.2f} us/key (hits), {lookup['miss']:.2f} us/key (misses)"
        )
        print()
        print(f"read validation (leased lookup + copy + release), median of {rounds} each:")
        print(
            f"{'value size':>10} {'batch':>6} {'confirmed us':>13} {'bypassed us':>12} "
            f"{'cost us':>8} {'cost':>6}"
        )
        for c in checks:
            cost = c["confirmed"] - c["bypassed"]
            print(
                f"{size_label(c['size']):>10} {c['batch']:>6} {c['confirmed']:>13.1f} "
                f"{c['bypassed']:>12.1f} {cost:>8.1f} {cost / c['bypassed']:>6.1%}"
            )

    if args.server_url:
        run(args.server_url)
    else:
        with maru_server("1G") as url:
            run(url)
    return 0


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


if __name__ == "__main__":
    sys.exit(main())
