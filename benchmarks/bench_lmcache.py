"""LMCache benchmark (issue 16): LMCache's real engine through the shipped MaruBackend, beside
LMCache's own local CPU backend, in one run.

    .venv/bin/python benchmarks/bench_lmcache.py --quick     # ~15 s: 1024, 2000 tokens
    .venv/bin/python benchmarks/bench_lmcache.py             # ~1 min: 1024, 4000, 8192 tokens

Needs LMCache 0.5.6 (scripts/install_lmcache_cpu.sh). Everything is LMCache's own
(`LMCacheEngineBuilder`, token database, storage manager, `MaruBackend` / `LocalCPUBackend`)
except the GPU connector: LMCache's are CUDA kernels, so the engines use the tests' CPU
STAND-IN (`tests/lmcache_cpu/engine.py: CpuKVConnector`, one gather / scatter per layer and
K/V between a paged KV cache in vLLM's layout and LMCache's memory objects). Its time is
measured inside every call and shown apart: on a GPU it is a device copy.

KV geometry: Llama-3-8B (32 layers, 8 KV heads x 128, bf16: 128 KiB per token), LMCache chunk
256 tokens (32 MiB, one Maru chunk each). Per prompt length, in every repetition (the first a
warm-up whose bytes are checked chunk by chunk with CRC32, not counted):

- maru: process A's engine (`maru_path` the only backend) `engine.store`s the prompt, timed
  until the backend's put tasks are done (the chunks are registered, visible to others);
  process B's engine `engine.retrieve`s it (**cross-process**: B reads A's pages in place);
  A retrieves it too (same process, like for like with local_cpu); A clears it.
- local_cpu: process C's engine (`local_cpu: true`, no other backend) stores, retrieves (it
  cannot be cross-process) and clears the same prompt.
- Baselines in C, same bytes: `memcpy` (one memmove per layer and K/V of the prompt's
  contiguous rows, between the KV cache and a warm private buffer, single thread) and
  `connector` (the stand-in alone, into / out of a warm private buffer, without LMCache).

Then per-chunk latency: the same calls with a one-chunk prompt (256 tokens), many times,
median and p99. `outside connector` columns are the call's time minus the stand-in's, per
chunk: what LMCache and its backend add (allocation, keys, metadata RPCs, Python).

Every process runs torch with one thread (like the memcpy baseline). Keys agree between
processes because the workers are forked from one parent (LMCache hashes with Python's hash()
without vLLM; a deployment sets PYTHONHASHSEED). Prints a table and writes
`benchmarks/results/lmcache-<time>[-quick].{md,csv,json}`.
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import os
import signal
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import bench_hicache as H  # Worker, Progress, maru_server, machine_info, med, pct (same dir)
from report import finish

ROOT = H.ROOT
MiB = H.MiB
CHUNK = 256  # LMCache chunk_size, tokens
LAYERS, KV_HEADS, HEAD_DIM = 32, 8, 128  # Llama-3-8B
MODEL = "Llama-3-8B (32 layers, 8 KV heads x 128, bf16), chunk 256 tokens"
TOKEN_BYTES = 2 * LAYERS * KV_HEADS * HEAD_DIM * 2
SEED = 11

STORE_METHODS = ["memcpy", "connector", "local_cpu", "maru"]
RETRIEVE_METHODS = ["memcpy", "connector", "local_cpu", "maru", "maru x-proc"]


def _geometry():
    from lmcache_cpu import engine as E

    return E.Geometry(layers=LAYERS, heads=KV_HEADS, head_size=HEAD_DIM, chunk=CHUNK)


def _timed_connector(geometry):
    """The tests' CPU stand-in, counting the seconds spent in it (`spent`, reset by reader)."""
    from lmcache_cpu.engine import CpuKVConnector

    class TimedConnector(CpuKVConnector):
        spent = 0.0

        def batched_from_gpu(self, memory_objs, starts, ends, **kwargs: Any) -> None:
            t0 = time.perf_counter()
            super().batched_from_gpu(memory_objs, starts, ends, **kwargs)
            self.spent += time.perf_counter() - t0

        def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kwargs: Any) -> None:
            t0 = time.perf_counter()
            super().batched_to_gpu(memory_objs, starts, ends, **kwargs)
            self.spent += time.perf_counter() - t0

    return TimedConnector(geometry)


class Side:
    """One process: an LMCache engine (`kind` "maru" or "local_cpu") over the stand-in
    connector, a paged KV cache to store from (`source`) and one to retrieve into."""

    def __init__(self, kind: str, url: str, max_tokens: int, source: bool, baselines: bool):
        import torch

        torch.set_num_threads(1)
        from lmcache.v1.config import LMCacheEngineConfig

        from lmcache_cpu import engine as E

        self.E, self.torch, self.kind = E, torch, kind
        self.g = g = _geometry()
        self.slots = max_tokens
        self.src = E.kv_caches(self.slots, g, seed=SEED) if source else None
        self.dst = E.kv_caches(self.slots, g)
        for cache in self.dst:  # fault the destination in: every method writes warm memory
            cache.fill_(1)
        max_bytes = max_tokens * g.token_bytes
        if kind == "maru":
            cfg = E.config(url, pool_bytes=max_bytes + 2 * g.chunk_bytes, geometry=g)
        else:
            cfg = LMCacheEngineConfig.from_defaults(
                chunk_size=g.chunk,
                local_cpu=True,
                max_local_cpu_size=(max_bytes + 2 * g.chunk_bytes) / 1024**3,
                save_unfull_chunk=True,
            )
        self.connector = _timed_connector(g)
        self.built = E.Engine(cfg, E.metadata(g), self.connector)
        self.engine = self.built.engine
        self.pool = None
        if baselines:  # a warm private buffer: the baselines' memory objects
            self.pool = torch.ones(max_bytes, dtype=torch.uint8)

    # -- the engine ------------------------------------------------------------------------

    def _slots(self, n: int, where: str):
        return self.E.slot_mapping(n, self.slots, SEED + (0 if where == "store" else 1))

    def _crcs(self, caches, slots, n: int) -> list[int]:
        out = []
        for s in range(0, n, CHUNK):
            part = self.E.gathered(caches, slots[s : min(s + CHUNK, n)])
            out.append(zlib.crc32(part.view(self.torch.int16).numpy()))
        return out

    def store(self, n: int, check: bool) -> dict:
        tokens, slots = self.E.prompt(n, SEED), self._slots(n, "store")
        self.connector.spent = 0.0
        t0 = time.perf_counter()
        self.engine.store(tokens, kvcaches=self.src, slot_mapping=slots)
        if self.kind == "maru":  # registered: visible to other instances from here on
            backend = self.built.backend
            while backend.put_tasks:
                time.sleep(20e-6)
        t = time.perf_counter() - t0
        stored = self.engine.lookup(tokens)
        if stored != n:
            raise RuntimeError(f"{self.kind}: stored {stored} of {n} tokens")
        return {
            "t": t,
            "conn": self.connector.spent,
            "crcs": self._crcs(self.src, slots, n) if check else None,
        }

    def retrieve(self, n: int, check: bool) -> dict:
        tokens, slots = self.E.prompt(n, SEED), self._slots(n, "retrieve")
        self.connector.spent = 0.0
        t0 = time.perf_counter()
        mask = self.engine.retrieve(tokens, kvcaches=self.dst, slot_mapping=slots)
        t = time.perf_counter() - t0
        got = int(mask.sum())
        if got != n:
            raise RuntimeError(f"{self.kind}: retrieved {got} of {n} tokens")
        return {
            "t": t,
            "conn": self.connector.spent,
            "crcs": self._crcs(self.dst, slots, n) if check else None,
        }

    def clear(self, n: int) -> int:
        return self.engine.clear(self.E.prompt(n, SEED))

    # -- the baselines (same bytes, no LMCache) ---------------------------------------------

    def _objs(self, n: int) -> list:
        """Memory objects over the private pool: what LocalCPUBackend would hand out."""
        from lmcache.v1.memory_management import MemoryObjMetadata, TensorMemoryObj

        objs, meta = [], self.E.metadata(self.g)
        for s in range(0, n, CHUNK):
            t = min(CHUNK, n - s)
            shape = meta.get_shapes(t)[0]
            raw = self.pool[s * self.g.token_bytes : (s + t) * self.g.token_bytes]
            md = MemoryObjMetadata(
                shape=shape,
                dtype=self.g.dtype,
                address=0,
                phy_size=raw.numel(),
                ref_count=1,
                fmt=self.E.FMT,
            )
            objs.append(TensorMemoryObj(raw, md, None))
        return objs

    def connector_only(self, n: int, op: str) -> dict:
        slots = self._slots(n, op)
        objs = self._objs(n)
        starts = list(range(0, n, CHUNK))
        ends = [min(s + CHUNK, n) for s in starts]
        t0 = time.perf_counter()
        if op == "store":
            self.connector.batched_from_gpu(
                objs, starts, ends, kvcaches=self.src, slot_mapping=slots
            )
        else:
            self.connector.batched_to_gpu(objs, starts, ends, kvcaches=self.dst, slot_mapping=slots)
        t = time.perf_counter() - t0
        return {"t": t, "conn": t, "crcs": None}

    def memcpy(self, n: int, op: str) -> dict:
        """The prompt's bytes in large contiguous pieces (tokens [0, n) of each layer's K and
        V), one memmove each, between the KV cache and the private pool."""
        row = self.g.hidden * self.g.dtype.itemsize
        piece = n * row
        pool = self.pool.data_ptr()
        caches = self.src if op == "store" else self.dst
        pairs = []
        for layer, cache in enumerate(caches):
            for kv in (0, 1):
                mem = pool + (2 * layer + kv) * piece
                part = cache[kv].data_ptr()
                pairs.append((mem, part) if op == "store" else (part, mem))
        t0 = time.perf_counter()
        for dst, src in pairs:
            ctypes.memmove(dst, src, piece)
        t = time.perf_counter() - t0
        return {"t": t, "conn": 0.0, "crcs": None}

    def close(self) -> None:
        self.built.close()


# -- one measurement ----------------------------------------------------------------------------


def measure(a, b, c, n: int, reps: int, prog, what: str) -> dict[str, list[dict]]:
    """`reps` counted repetitions (after a checked warm-up) of every method on an n-token
    prompt; {"op/method": [per-repetition result]}."""
    out: dict[str, list[dict]] = {}
    for rep in range(reps + 1):
        check = rep == 0
        got = {
            "store/maru": a.call("store", n, check),
            "retrieve/maru x-proc": b.call("retrieve", n, check),
            "retrieve/maru": a.call("retrieve", n, check),
        }
        a.call("clear", n)
        got["store/memcpy"] = c.call("memcpy", n, "store")
        got["store/connector"] = c.call("connector_only", n, "store")
        got["store/local_cpu"] = c.call("store", n, check)
        got["retrieve/memcpy"] = c.call("memcpy", n, "retrieve")
        got["retrieve/connector"] = c.call("connector_only", n, "retrieve")
        got["retrieve/local_cpu"] = c.call("retrieve", n, check)
        c.call("clear", n)
        if check:
            want = got["store/maru"]["crcs"]
            for name in ("retrieve/maru x-proc", "retrieve/maru", "retrieve/local_cpu"):
                if got[name]["crcs"] != want:
                    raise RuntimeError(f"{name}: retrieved bytes differ from the stored ones")
            if got["store/local_cpu"]["crcs"] != want:
                raise RuntimeError("local_cpu stored other bytes than maru")
            prog.step(f"{what}: warm-up checked")
            continue
        for name, r in got.items():
            out.setdefault(name, []).append(r)
        prog.step(what)
    return out


def summarize(n: int, res: dict[str, list[dict]]) -> list[dict]:
    nbytes = n * TOKEN_BYTES
    chunks = -(-n // CHUNK)
    rows = []
    for op, methods in (("store", STORE_METHODS), ("retrieve", RETRIEVE_METHODS)):
        base = [r["t"] for r in res[f"{op}/memcpy"]]
        local = [r["t"] for r in res[f"{op}/local_cpu"]]
        for m in methods:
            ts = [r["t"] for r in res[f"{op}/{m}"]]
            outside = [(r["t"] - r["conn"]) / chunks for r in res[f"{op}/{m}"]]
            gb = [nbytes / t / 1e9 for t in ts]
            rows.append(
                {
                    "tokens": n,
                    "chunks": chunks,
                    "mib": nbytes / MiB,
                    "op": op,
                    "method": m,
                    "gbps": H.med(gb),
                    "gbps_min": min(gb),
                    "gbps_max": max(gb),
                    "vs_memcpy": H.med([x / t for x, t in zip(base, ts)]),
                    "vs_local": H.med([x / t for x, t in zip(local, ts)]),
                    "chunk_med_ms": H.med(ts) / chunks * 1e3,
                    "chunk_p99_ms": H.pct(ts, 0.99) / chunks * 1e3,
                    "outside_us": H.med(outside) * 1e6,
                }
            )
    return rows


# -- report -------------------------------------------------------------------------------------


def _outside(row: dict) -> str:
    return "-" if row["method"] == "memcpy" else f"{row['outside_us']:.0f}"


def summary_table(rows: list[dict], lat_rows: list[dict]) -> list[str]:
    """The compact form docs/performance.md keeps: GB/s per method, then the one-chunk
    latency of the two engines (median / p99 ms)."""
    cols = RETRIEVE_METHODS
    out = [
        "| prompt | op | " + " | ".join(f"{m} GB/s" for m in cols) + " | maru / local_cpu |",
        "|---|---|" + "---:|" * (len(cols) + 1),
    ]
    by = {(r["tokens"], r["op"], r["method"]): r for r in [*rows, *lat_rows]}
    for n in dict.fromkeys(r["tokens"] for r in [*rows, *lat_rows]):
        for op in ("store", "retrieve"):
            cells = [f"{by[n, op, m]['gbps']:.2f}" if (n, op, m) in by else "" for m in cols]
            ratio = by[n, op, "maru"]["vs_local"]
            label = f"{n} tokens" if n != CHUNK else f"{n} tokens (one chunk)"
            out.append(f"| {label} | {op} | " + " | ".join(cells) + f" | {ratio:.0%} |")
    out += [
        "",
        "| one chunk | local_cpu ms (med / p99) | maru | maru x-proc |",
        "|---|---:|---:|---:|",
    ]
    for op in ("store", "retrieve"):
        cells = [
            f"{by[CHUNK, op, m]['chunk_med_ms']:.2f} / {by[CHUNK, op, m]['chunk_p99_ms']:.2f}"
            if (CHUNK, op, m) in by
            else ""
            for m in ("local_cpu", "maru", "maru x-proc")
        ]
        out.append(f"| {op} | " + " | ".join(cells) + " |")
    return out


def render(machine: dict, cmd: str, reps: int, lat_reps: int, rows, lat_rows) -> str:
    m = machine
    lines = [
        f"machine: {m['cpu']}, {m['cores']} cores, {m['mem_gib']} GiB, Linux {m['kernel']}; "
        f"Python {m['python']}, torch {m['torch']} (1 thread per process), LMCache "
        f"{m['lmcache']}; 1-min load at start {m['load_before']:.2f}",
        f"command: {cmd}",
        f"KV: {MODEL} = {TOKEN_BYTES // 1024} KiB per token, {CHUNK * TOKEN_BYTES // MiB} MiB "
        f"per chunk; median of {reps} repetitions after a checked warm-up",
        "GPU connector: the tests' CPU STAND-IN (tests/lmcache_cpu CpuKVConnector), "
        "everything else LMCache's real engine",
        "",
        *summary_table(rows, lat_rows),
        "",
        "| prompt | op | method | GB/s | min-max | /memcpy | /local_cpu | per chunk ms "
        "| outside connector us/chunk |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['tokens']} tok ({r['mib']:.0f} MiB) | {r['op']} | {r['method']} | "
            f"{r['gbps']:.2f} | {r['gbps_min']:.1f}-{r['gbps_max']:.1f} | "
            f"{r['vs_memcpy']:.0%} | {r['vs_local']:.0%} | {r['chunk_med_ms']:.2f} | "
            f"{_outside(r)} |"
        )
    lines += [
        "",
        f"Per-chunk latency (a one-chunk prompt, {CHUNK} tokens = "
        f"{CHUNK * TOKEN_BYTES // MiB} MiB per call; {lat_reps} calls):",
        "| op | method | median ms | p99 ms | outside connector us (median) |",
        "|---|---|---:|---:|---:|",
    ]
    for r in lat_rows:
        lines.append(
            f"| {r['op']} | {r['method']} | {r['chunk_med_ms']:.2f} | {r['chunk_p99_ms']:.2f} | "
            f"{_outside(r)} |"
        )
    lines += [
        "",
        "maru: LMCache + MaruBackend (store: until the chunks are registered with maru-server;",
        "retrieve in the same process); maru x-proc: retrieved by another process's engine",
        "(reads the writer's pages in place); local_cpu: LMCache + LocalCPUBackend, same process;",
        "memcpy: the same bytes in contiguous pieces, one memmove each, KV cache <-> warm private",
        "buffer; connector: the CPU stand-in alone (gather/scatter) into/out of a private buffer.",
        "/memcpy, /local_cpu: median over repetitions of the time ratio in the same repetition.",
        "outside connector: (call time - stand-in connector time) / chunks.",
    ]
    return "\n".join(lines)


def write_csv(path: Path, rows: list[dict], lat_rows: list[dict]) -> None:
    keys = list(rows[0])
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["section", *keys])
        w.writeheader()
        for section, rs in (("throughput", rows), ("chunk_latency", lat_rows)):
            for r in rs:
                w.writerow({"section": section, **r})


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def _deadline(_signum, _frame) -> None:
    raise TimeoutError("benchmark deadline reached (--deadline-s)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1024 and 2000 tokens, fewer reps")
    ap.add_argument("--tokens", help="prompt lengths, comma-separated (default by mode)")
    ap.add_argument("--reps", type=int, help="counted repetitions per prompt length")
    ap.add_argument("--lat-reps", type=int, help="one-chunk calls for the per-chunk latency")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="results dir")
    ap.add_argument("--wait-load", type=float, default=0, help="wait until the 1-min load < this")
    ap.add_argument("--deadline-s", type=int, default=900, help="give up after this long")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args()
    default_tokens = "1024,2000" if args.quick else "1024,4000,8192"
    try:
        prompts = [int(x) for x in (args.tokens or default_tokens).split(",")]
    except ValueError:
        ap.error(f"--tokens: comma-separated integers, not {args.tokens!r}")
    reps = args.reps or (3 if args.quick else 5)
    lat_reps = args.lat_reps or (20 if args.quick else 60)
    if min(prompts) < 1 or reps < 1 or lat_reps < 1:
        ap.error("--tokens, --reps and --lat-reps must be positive")
    max_tokens = max(prompts)
    max_bytes = max_tokens * TOKEN_BYTES
    # A: 2 KV caches; B: 1; C: 2, LMCache's CPU buffer and the baselines' pool; the shm pool
    need = 8 * max_bytes + (2 << 30)
    if _mem_available() < need:
        print(
            f"not enough memory: {max_tokens} tokens need about {need / 2**30:.1f} GiB "
            f"available, {_mem_available() / 2**30:.1f} GiB are (try smaller --tokens)",
            file=sys.stderr,
        )
        return 2
    if args.wait_load:
        H.wait_for_quiet(args.wait_load, 1200)
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
    signal.signal(signal.SIGALRM, _deadline)
    signal.alarm(args.deadline_s)

    t_start = time.monotonic()
    machine = H.machine_info()
    from importlib.metadata import version

    machine["lmcache"] = version("lmcache")
    prog = H.Progress(len(prompts) * (reps + 1) + lat_reps + 2, enabled=not args.no_progress)
    workers: list[H.Worker] = []
    try:
        with H.maru_server(f"{(max_bytes >> 20) + 512}M") as url:
            try:  # the engines close (DISCONNECT) before the server stops
                # A writes, B reads A's pages, C is local_cpu and the baselines
                a = H.Worker(Side, "maru", url, max_tokens, True, False)
                workers.append(a)
                b = H.Worker(Side, "maru", url, max_tokens, False, False)
                workers.append(b)
                c = H.Worker(Side, "local_cpu", url, max_tokens, True, True)
                workers.append(c)
                for w in workers:
                    w.recv()  # built
                prog.step("engines built")
                rows = []
                for n in prompts:
                    rows += summarize(n, measure(a, b, c, n, reps, prog, f"{n} tokens"))
                lat = measure(a, b, c, CHUNK, lat_reps, prog, "one chunk")
                lat_rows = summarize(CHUNK, lat)
            finally:
                for w in workers:
                    w.close()
    except (TimeoutError, RuntimeError) as exc:  # the deadline, a worker's failure or check
        print(f"bench_lmcache: {exc}", file=sys.stderr)
        return 1
    finally:
        prog.close()
        signal.alarm(0)
    cmd = " ".join([Path(sys.executable).name, "benchmarks/bench_lmcache.py", *sys.argv[1:]])
    text = render(machine, cmd, reps, lat_reps, rows, lat_rows)
    finish(
        "lmcache",
        args.out,
        text,
        {"machine": machine, "rows": rows, "chunk_latency": lat_rows},
        machine,
        t_start,
        write_csv=lambda path: write_csv(path, rows, lat_rows),
        quick=args.quick,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
