"""What registering through the server costs a write beside the `stream` copy, and what Maru adds.

    .venv/bin/python benchmarks/write_floor.py --rounds 20 --idle-ms 50   # ~1 min

`bench_hicache.py` times a `batch_set_v1` burst (four 128-page calls at 64 KiB, then the
closing `confirm_writes`) against one thread's streaming copy of the same bytes (`stream`).
This tool splits the distance between the two. Each round, in a seeded random order, after
`--idle-ms` of sleep (the writer's idle while `bench_hicache.py`'s reader works):

- `stream`: the limit, the copy loop into a warm `/dev/shm` mapping;
- `dest`: the same loop into runs reserved through Maru's handler (where Maru's pages go);
- `floor`: `dest` plus each call's REGISTER_KV sent after its copy (made ready before the
  burst: no key check, allocation or location column in the timed part) and the wait for the
  last reply: what registration itself costs, with none of the client's bookkeeping;
- `maru`: `MaruStorage.batch_set_v1` and the closing `confirm_writes`, as the benchmark times it.

`floor` is the write with none of the client's bookkeeping and one copy thread: where Maru
stands beside it says whether the client's Python or the registration (the server's work and
where the kernel runs it) is what a miss is made of. `--pin both` puts this process (the
writer and its copier threads) on the first CPU and the server on the last, `--pin server`
the server only (`taskset`), to show what the scheduler's placement costs. The kernel command
line's scheduler settings are printed with the table.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

import bench_hicache as bh  # noqa: E402
from maru.common import memcopy  # noqa: E402

METHODS = ("stream", "dest", "floor", "maru")


class Floor:
    """One writer `Instance` (a real SGLang host pool, `MaruStorage` through SGLang's factory)
    and the timed bursts of each method over its pages."""

    def __init__(self, url: str, case: bh.Case, idle_ms: float):
        batch, calls = bh.Plan.make(False).pages_for(case.page_bytes)
        self.batch, self.pages = batch, batch * calls
        self.idle_s = idle_ms / 1000
        self.inst = bh.Instance(url, case, self.pages, tempfile.mkdtemp(dir=bh.SHM_DIR), "writer")
        self.inst.fill(1)
        self.store = self.inst.maru
        self.handler, self.pool = self.store.handler, self.store._kv

    def close(self) -> None:
        self.inst.close()

    def burst(self, method: str, tag: str) -> tuple[float, int]:
        """Seconds of one burst of `method` after the idle, and the pages it stored (the
        stream's: all of them)."""
        if method in ("stream", "maru"):
            time.sleep(self.idle_s)
            seconds, ok, *_ = self.inst.run(f"{method}_set", tag, self.batch)
            if method == "maru":
                self.inst.maru_delete(tag, self.pages)
            return sum(seconds), ok if method == "maru" else self.pages
        return self._registered_burst(tag, register=method == "floor")

    def _registered_burst(self, tag: str, register: bool) -> tuple[float, int]:
        """`dest` (register False) or `floor`: the copies into reserved runs, and with
        `register` each call's REGISTER_KV and the last reply."""
        pool, handler, inst, batch = self.pool, self.handler, self.inst, self.batch
        calls = []
        for first in range(0, self.pages, batch):
            keys = pool.keys([bh.page_key(tag, i) for i in range(first, first + batch)])
            host = pool.pointers(inst.idx[first * inst.P : (first + batch) * inst.P], batch)
            run = handler.alloc(pool.page_bytes, batch)
            assert run is not None and host is not None, "the writer's pool is too small"
            starts = run.address + np.arange(batch, dtype=np.int64) * run.stride
            calls.append((starts, host, run, handler.prepare_seal(keys, run, pool.page_bytes)))
        time.sleep(self.idle_s)
        with handler.copying():
            start = time.perf_counter()
            sent = []
            for starts, host, _run, sealing in calls:
                memcopy.copy_values(starts, host, pool.sizes, to_values=True, threads=1)
                if register:
                    sent.append(sealing.send(None))
            stored = sum(sum(sealing.wait()) for sealing in sent)
            seconds = time.perf_counter() - start
        if register:
            inst.maru_delete(tag, self.pages)
        else:
            for _starts, _host, run, _sealing in calls:
                handler.free(run)
        return seconds, stored if register else self.pages


def measure(url: str, case: bh.Case, rounds: int, idle_ms: float) -> dict[str, list[float]]:
    """Per method, the seconds of each timed burst (two rounds of warm-up first)."""
    floor = Floor(url, case, idle_ms)
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    try:
        for r in range(rounds + 2):
            for method in random.Random(r).sample(METHODS, len(METHODS)):
                seconds, stored = floor.burst(method, f"floor/{r}/{method}")
                if stored != floor.pages:
                    raise RuntimeError(f"{method}: {stored} of {floor.pages} pages stored")
                if r >= 2:
                    times[method].append(seconds)
    finally:
        floor.close()
    return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--case", default="mha-64K", help="a bench_hicache.py case")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--idle-ms", type=float, default=50.0, help="sleep before each burst")
    p.add_argument("--pin", choices=("none", "server", "both"), default="none")
    args = p.parse_args()
    case = next((c for c in bh.CASES if c.name == args.case), None)
    if case is None:
        sys.exit(f"write_floor: no case {args.case!r} (one of {[c.name for c in bh.CASES]})")
    import sglang_cpu

    sglang_cpu.apply()  # before SGLang is imported
    bh.preload_sglang()
    server_cpu = None
    if args.pin != "none":
        cpus = bh.split_cpus()  # (the writer's CPU, the server's), as for the key scaling
        if cpus is None:
            sys.exit("write_floor: --pin needs two CPUs and taskset")
        writer_cpu, server_cpu = cpus
        if args.pin == "both":
            os.sched_setaffinity(0, {writer_cpu})
    with bh.maru_server("2G", server_cpu) as url:
        times = measure(url, case, args.rounds, args.idle_ms)
    print(
        f"{case.name}: bursts of {bh.Plan.make(False).pages_for(case.page_bytes)} "
        f"(pages a call, calls), {args.rounds} rounds, {args.idle_ms:g} ms idle before each; "
        f"pinned: {args.pin}; kernel scheduler settings: {bh.scheduler_settings()}"
    )
    print("| method | median us a burst | stream / method |")
    print("|---|---:|---:|")
    for method in METHODS:
        share = statistics.median(s / t for s, t in zip(times["stream"], times[method]))
        print(f"| {method} | {statistics.median(times[method]) * 1e6:.0f} | {share:.1%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
