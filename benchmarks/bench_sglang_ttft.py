"""TTFT of a real SGLang server on CPU with Maru as HiCache L3 and through MaruCacheLinker, beside
SGLang's `file` backend.

    python benchmarks/bench_sglang_ttft.py               # ~10-15 min on 2 cores
    python benchmarks/bench_sglang_ttft.py --quick       # 500 tokens, 2 repetitions (~5 min)

Needs SGLang for CPU (`make install`). The model is a random Qwen2 built locally (hidden 512,
8 layers, 8 heads, 2 KV heads, intermediate 1408, bf16); SGLang runs with `--page-size 4` (and
`--sleep-on-idle`, so the idle servers leave the two cores to the one being measured). Backends:

  maru    HiCache (host tier, `direct` io, `page_first_direct`, `prefetch_threshold` 4) with
          MaruStorage as L3: device -> host pool -> Maru, two copies each way;
  linker  no host tier: `--enable-unified-cache-external-linker` with MaruCacheLinker, the
          device KV pool straight to Maru, one copy each way, loads layer by layer;
  file    HiCache as for maru, with SGLang's built-in `file` L3 in a /dev/shm directory.

For each prompt length N (default 500 and 2000 tokens) and repetition, with a new random prompt
each time, streaming `/generate` with `max_new_tokens` 2, time to the first streamed chunk:

  a  cold: nothing cached anywhere;
  b  the same prompt again: from the device cache;
  c  right after `POST /flush_cache` (device and host tiers dropped): loaded from L3;
     (b and c are taken twice, back to back);
  d  (maru and linker) the same prompt on a second instance that never saw it: a P2P hit on
     pages the first instance wrote.

a/c is the speed-up an L3 hit gives; c - b (the median of the back-to-back differences) is what
L3 costs over a device hit (a device hit is not free on CPU: torch_native attention recomputes
over the whole sequence). Every c and d is checked: storage hits must be the prompt's reusable
pages and the tokens those of a.

Targets checked: Maru's L3 cost (c - b) at most half the `file` backend's; a P2P hit (d) as
fast as a local L3 hit (c), i.e. within 15% or 20 ms. Printed beside them: the linker's L3 cost
against HiCache + MaruStorage's (no target: what one copy instead of two buys here).

All servers run at once (maru-server + two instances each for maru and linker + one `file`
instance writing to a directory in /dev/shm); the measurements rotate between backends; a
warm-up round of every kind comes first and is not counted; figures are medians. On a shared
machine, a group during which other processes used more than 10% of the CPUs is measured again
(new prompt, at most 3 tries). Results: a table on stdout, benchmarks/results/sglang_ttft.csv
(every sample), sglang_ttft_summary.csv and sglang_ttft.png (if matplotlib is installed).
"""

from __future__ import annotations

import argparse
import csv
import functools
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import sglang_cpu  # noqa: E402

sglang_cpu.apply()

from sglang_cpu import p2p  # noqa: E402
from sglang_cpu.server import flush_cache  # noqa: E402
from sglang_cpu.tiny_model import build_tiny_model  # noqa: E402

PAGE = 4
MODEL = dict(hidden=512, layers=8, heads=8, kv_heads=2, intermediate=1408, dtype="bfloat16")
MAX_TOTAL_TOKENS = 16384
SHM = "/dev/shm"
RESULTS = ROOT / "benchmarks" / "results"
P2P_TOLERANCE = (0.15, 0.020)  # relative, absolute (s)


@dataclass
class Series:
    """TTFT samples (seconds) per (backend, N, kind)."""

    samples: dict[tuple[str, int, str], list[float]] = field(default_factory=dict)
    rows: list[dict] = field(default_factory=list)
    busy: int = 0  # groups kept although other jobs disturbed every try
    retried: int = 0  # groups measured again because other jobs used the CPUs

    def add(self, backend: str, n: int, rep: int, kind: str, ttft: float, hits: int) -> None:
        self.samples.setdefault((backend, n, kind), []).append(ttft)
        self.rows.append(
            dict(backend=backend, tokens=n, rep=rep, kind=kind, ttft_s=ttft, storage_hits=hits)
        )

    def median(self, backend: str, n: int, kind: str) -> float | None:
        values = self.samples.get((backend, n, kind))
        return statistics.median(values) if values else None


class Prompts:
    """Random prompts of exactly N tokens, never repeated within a run."""

    def __init__(self, vocab_size: int, seed: int = 0):
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)

    def new(self, n: int) -> list[int]:
        return [self.rng.randrange(1, self.vocab_size) for _ in range(n)]


def _model_vocab(model_dir: Path) -> int:
    """Ids the tokenizer knows (the model's embedding is padded past them)."""
    import json

    vocab = json.loads((model_dir / "tokenizer.json").read_text())["model"]["vocab"]
    return len(vocab)


def _check(what: str, response: dict, n: int, reference: dict, linker: bool) -> int:
    hits = p2p.storage_hits(response, linker=linker)
    expected = p2p.expected_storage_hits(n, PAGE)
    if hits != expected:
        raise RuntimeError(f"{what}: {hits} storage hits for {n} tokens, expected {expected}")
    if response["output_ids"] != reference["output_ids"]:
        raise RuntimeError(f"{what}: output differs from the cold run")
    return hits


def _file_count(directory: Path) -> int:
    return sum(1 for _ in directory.iterdir())


def _wait_stable(count, minimum: int, timeout: float = 60.0, settle: float = 1.0) -> int:
    deadline = time.monotonic() + timeout
    last, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        c = count()
        if c != last:
            last, since = c, time.monotonic()
        elif c >= minimum and time.monotonic() - since >= settle:
            break
        time.sleep(0.1)
    return last


@dataclass
class Target:
    """One backend under test: the instance that computes and writes, an optional second
    instance for P2P hits, and how to count what its L3 holds."""

    name: str
    first: str
    second: str | None
    l3_count: object  # () -> int
    linker: bool = False  # SGLang reports the linker's loads as `host` hits


class CpuWatch:
    """Tells whether other jobs used the CPUs while we timed a request.

    /proc/stat gives all CPU time spent; our own processes (this one, maru-server, and the
    SGLang servers' process groups) are subtracted; what is left was someone else's. A request
    during which others took more than `limit` of the machine is measured again."""

    def __init__(self, limit: float):
        self.limit = limit
        self.pgids = {os.getpgrp()}
        self.hz = os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _machine_busy() -> int:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        return sum(fields[:8]) - fields[3] - fields[4]  # all but idle and iowait

    def _ours(self) -> int:
        total = 0
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                stat = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(stat[2]) in self.pgids:  # field 5: process group
                total += int(stat[11]) + int(stat[12])  # utime + stime
        return total

    def snapshot(self) -> tuple[int, int, float]:
        return self._machine_busy(), self._ours(), time.monotonic()

    def others(self, before, after) -> float:
        """Fraction of the whole machine used by other processes between two snapshots.
        (Exited processes' time is lost from `ours`, which can only overstate the others.)"""
        machine = after[0] - before[0]
        ours = after[1] - before[1]
        span = max(after[2] - before[2], 1e-3) * self.hz * (os.cpu_count() or 1)
        return max(0, machine - ours) / span

    def wait_quiet(self, max_wait: float) -> None:
        """Wait (bounded) until others leave the CPUs alone for half a second."""
        deadline = time.monotonic() + max_wait
        while time.monotonic() < deadline:
            before = self.snapshot()
            time.sleep(0.5)
            if self.others(before, self.snapshot()) <= self.limit:
                return


def timed(watch: CpuWatch, url: str, ids: list[int]) -> tuple[float, dict, float]:
    before = watch.snapshot()
    ttft, response = p2p.stream_ttft(url, input_ids=ids)
    return ttft, response, watch.others(before, watch.snapshot())


def measure_group(t: Target, n: int, prompts: Prompts, watch: CpuWatch) -> dict:
    """For one new prompt of `n` tokens: a; then twice b and c back to back (so each L3 cost
    c - b is a difference of two neighbouring requests); then d on the second instance."""
    ids = prompts.new(n)
    before = t.l3_count()
    out: dict = {k: [] for k in ("a", "b", "c", "d", "l3")}
    others = []

    def timed_check(kind: str, url: str, reference: dict | None):
        ttft, response, o = timed(watch, url, ids)
        others.append(o)
        what = f"{t.name} {kind} N={n}"
        hits = 0 if reference is None else _check(what, response, n, reference, t.linker)
        out[kind].append((ttft, hits))
        return ttft, response

    watch.wait_quiet(5.0)
    _, ra = timed_check("a", t.first, None)
    if p2p.storage_hits(ra, linker=t.linker) or ra["meta_info"]["cached_tokens"]:
        raise RuntimeError(f"cold run was not cold: {ra['meta_info']}")
    _wait_stable(t.l3_count, before + n // PAGE - 1)
    for _ in range(2):
        watch.wait_quiet(5.0)
        tb, _ = timed_check("b", t.first, None)  # still (or again) in the device cache
        flush_cache(t.first)
        tc, _ = timed_check("c", t.first, ra)
        out["l3"].append((tc - tb, 0))
    if t.second is not None:
        watch.wait_quiet(5.0)
        timed_check("d", t.second, ra)
    out["others"] = max(others)
    return out


def measure_one(
    t: Target, n: int, rep: int, prompts: Prompts, series: Series, watch: CpuWatch, tries: int
) -> None:
    """One group, measured again (new prompt) while other jobs disturbed it, `tries` at most."""
    for _ in range(tries):
        got = measure_group(t, n, prompts, watch)
        disturbed = got["others"] > watch.limit and rep > 0  # warm-ups: never again
        label = "warm-up" if rep == 0 else f"rep {rep}"
        times = "  ".join(
            f"{k}=" + "/".join(f"{v:.3f}" for v, _ in got[k]) for k in "abcd" if got[k]
        )
        note = f"  (others used {got['others']:.0%} of the CPUs: again)" if disturbed else ""
        print(f"  {t.name:5s} N={n:5d} {label:8s} {times}{note}", flush=True)
        if not disturbed:
            break
        series.retried += 1
    else:
        series.busy += 1
    if rep == 0:
        return
    for kind in ("a", "b", "c", "d", "l3"):
        for value, hits in got[kind]:
            series.add(t.name, n, rep, kind, value, hits)


def run(model: Path, backends, sizes, reps, prompts, series, log_dir: Path, watch, tries) -> None:
    """All servers up at once (idle ones sleep), then every measurement interleaved across
    backends, alternating which goes first, so background load hits them alike."""
    storage = Path(tempfile.mkdtemp(prefix=f"sglang-file-l3-{uuid.uuid4().hex[:8]}-", dir=SHM))
    try:
        with p2p.maru_server("2G") as url:
            arg_lists, names = [], []
            if "maru" in backends:
                maru = p2p.hicache_args("dynamic", p2p.maru_extra_config(url, pool_size="256M"))
                arg_lists += [maru, maru]
                names += ["maru instance 1", "maru instance 2"]
            if "linker" in backends:
                linker = p2p.linker_args(p2p.linker_config(url, pool_size="256M"))
                arg_lists += [linker, linker]
                names += ["linker instance 1", "linker instance 2"]
            if "file" in backends:
                arg_lists.append(p2p.hicache_args("file", {"prefetch_threshold": 4}))
                names.append("file instance")
            servers = p2p.start_servers(
                model,
                arg_lists,
                log_dir=log_dir,
                env={"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(storage)},
                page_size=PAGE,
                max_total_tokens=MAX_TOTAL_TOKENS,
            )
            try:
                watch.pgids.update(srv.pid for srv in servers)  # own sessions = process groups
                for name, srv in zip(names, servers):
                    print(f"{name} up in {srv.startup_seconds:.1f} s at {srv.base_url}")
                targets, i = [], 0
                count = functools.partial(p2p.l3_keys, url)
                for name in ("maru", "linker"):
                    if name in backends:
                        first, second = servers[i].base_url, servers[i + 1].base_url
                        targets.append(Target(name, first, second, count, name == "linker"))
                        i += 2
                if "file" in backends:
                    count = functools.partial(_file_count, storage)
                    targets.append(Target("file", servers[i].base_url, None, count))
                for rep in range(reps + 1):
                    for n in sizes:
                        shift = rep % len(targets)  # who goes first rotates
                        for t in targets[shift:] + targets[:shift]:
                            measure_one(t, n, rep, prompts, series, watch, tries)
            finally:
                p2p.stop_servers(servers)
    finally:
        shutil.rmtree(storage, ignore_errors=True)


def summarize(series: Series, sizes: list[int], backends: list[str]) -> list[dict]:
    rows = []
    for backend in backends:
        for n in sizes:
            a, b, c, d, l3 = (series.median(backend, n, k) for k in ("a", "b", "c", "d", "l3"))
            if a is None:
                continue
            rows.append(
                dict(
                    backend=backend,
                    tokens=n,
                    a=a,
                    b=b,
                    c=c,
                    d=d,
                    a_over_c=a / c,
                    c_minus_b=l3,
                    reps=len(series.samples[(backend, n, "a")]),
                )
            )
    return rows


def report(summary: list[dict], sizes: list[int]) -> list[str]:
    lines = [
        "| L3 backend | N | a cold | b device | c L3 | a/c | c - b | d P2P |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in summary:
        d = "" if r["d"] is None else f"{r['d']:.3f}"
        lines.append(
            f"| {r['backend']} | {r['tokens']} | {r['a']:.3f} | {r['b']:.3f} | {r['c']:.3f} | "
            f"{r['a_over_c']:.1f} | {r['c_minus_b']:.3f} | {d} |"
        )
    by = {(r["backend"], r["tokens"]): r for r in summary}
    lines.append("")
    for n in sizes:
        m, f, k = by.get(("maru", n)), by.get(("file", n)), by.get(("linker", n))
        if m and f:
            ok = m["c_minus_b"] <= 0.5 * f["c_minus_b"]
            lines.append(
                f"N={n}: Maru's L3 cost (c-b) {m['c_minus_b'] * 1000:.0f} ms vs file "
                f"{f['c_minus_b'] * 1000:.0f} ms: at most half: {'PASS' if ok else 'FAIL'}"
            )
        if k and m:
            lines.append(
                f"N={n}: linker's L3 cost (c-b) {k['c_minus_b'] * 1000:.0f} ms vs HiCache + "
                f"MaruStorage {m['c_minus_b'] * 1000:.0f} ms"
            )
        for r in (m, k):
            if r and r["d"] is not None:
                rel, abs_ = P2P_TOLERANCE
                ok = r["d"] <= max(r["c"] * (1 + rel), r["c"] + abs_)
                lines.append(
                    f"N={n}: {r['backend']}: P2P hit on instance 2 (d) {r['d']:.3f} s vs local "
                    f"L3 hit (c) {r['c']:.3f} s: as fast: {'PASS' if ok else 'FAIL'}"
                )
    return lines


def save(series: Series, summary: list[dict], sizes: list[int]) -> list[Path]:
    RESULTS.mkdir(parents=True, exist_ok=True)
    written = []
    raw = RESULTS / "sglang_ttft.csv"
    with raw.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(series.rows[0]))
        w.writeheader()
        w.writerows(series.rows)
    written.append(raw)
    summ = RESULTS / "sglang_ttft_summary.csv"
    with summ.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(summary[0]))
        w.writeheader()
        w.writerows(summary)
    written.append(summ)
    png = plot(summary, sizes)
    if png is not None:
        written.append(png)
    return written


def plot(summary: list[dict], sizes: list[int]) -> Path | None:
    """Bar chart of the medians per prompt length (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install matplotlib)")
        return None
    fig, axes = plt.subplots(1, len(sizes), figsize=(5 * len(sizes), 4), squeeze=False)
    kinds = [("a", "cold"), ("b", "device hit"), ("c", "L3 hit"), ("d", "P2P L3 hit")]
    for ax, n in zip(axes[0], sizes):
        rows = [r for r in summary if r["tokens"] == n]
        width = 0.8 / len(rows)
        for i, r in enumerate(rows):
            xs = [k + (i - (len(rows) - 1) / 2) * width for k in range(len(kinds))]
            ys = [r[k] or 0.0 for k, _ in kinds]
            bars = ax.bar(xs, ys, width, label=r["backend"])
            ax.bar_label(bars, fmt="%.2f", fontsize=7)
        ax.set_xticks(range(len(kinds)), [label for _, label in kinds])
        ax.set_title(f"TTFT, {n}-token prompt (median)")
        ax.set_ylabel("seconds")
        ax.set_ylim(bottom=0)
        ax.legend()
    fig.tight_layout()
    png = RESULTS / "sglang_ttft.png"
    fig.savefig(png, dpi=110)
    return png


def replot() -> None:
    """Redraw the PNG from the last run's summary CSV."""
    with (RESULTS / "sglang_ttft_summary.csv").open() as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        r["tokens"] = int(r["tokens"])
        for k in "abcd":
            r[k] = float(r[k]) if r[k] else None
    sizes = sorted({r["tokens"] for r in rows})
    print(f"wrote {plot(rows, sizes)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[500, 2000])
    ap.add_argument("--reps", type=int, default=5, help="measured repetitions (after a warm-up)")
    ap.add_argument(
        "--backends",
        nargs="+",
        default=["maru", "linker", "file"],
        choices=["maru", "linker", "file"],
    )
    ap.add_argument("--quick", action="store_true", help="500 tokens, 2 repetitions")
    ap.add_argument("--keep-logs", action="store_true", help="keep the SGLang server logs")
    ap.add_argument(
        "--others-limit",
        type=float,
        default=0.10,
        help="measure a group again if other processes used more than this fraction of the "
        "CPUs during one of its requests (a shared machine)",
    )
    ap.add_argument("--tries", type=int, default=3, help="at most this many tries per group")
    ap.add_argument("--replot", action="store_true", help="only redraw the PNG from the CSV")
    args = ap.parse_args(argv)
    if args.replot:
        replot()
        return 0
    if args.quick:
        args.sizes, args.reps = [500], 2
    if max(args.sizes) + 16 > MAX_TOTAL_TOKENS // 4:
        ap.error(f"sizes up to {MAX_TOTAL_TOKENS // 4 - 16} tokens")

    t0 = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="bench-sglang-ttft-"))
    load = os.getloadavg()[0]
    print(
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"load {load:.2f}; sizes {args.sizes}, {args.reps} reps, backends {args.backends}"
    )
    series = Series()
    try:
        model = build_tiny_model(
            work / "model", max_position=max(4096, max(args.sizes) + 64), **MODEL
        )
        prompts = Prompts(_model_vocab(model))
        watch = CpuWatch(args.others_limit)
        logs = work / "logs"
        run(model, args.backends, args.sizes, args.reps, prompts, series, logs, watch, args.tries)
    finally:
        if args.keep_logs:
            print(f"logs kept in {work / 'logs'}")
            shutil.rmtree(work / "model", ignore_errors=True)
        else:
            shutil.rmtree(work, ignore_errors=True)

    summary = summarize(series, args.sizes, args.backends)
    print()
    print("TTFT, seconds (medians); a cold, b device cache, c L3 after /flush_cache, d P2P")
    for line in report(summary, args.sizes):
        print(line)
    for path in save(series, summary, args.sizes):
        print(f"wrote {path.relative_to(ROOT)}")
    total = sum(len(v) for (_, _, k), v in series.samples.items() if k == "a")
    print(
        f"{series.retried} groups measured again because other jobs used the CPUs; "
        f"{series.busy} of {total} kept although disturbed every try"
    )
    print(f"total {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
