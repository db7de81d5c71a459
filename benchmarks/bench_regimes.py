"""Regimes benchmark: set and get where a serving instance lives, not only warm.

    .venv/bin/python benchmarks/bench_regimes.py --quick   # well under a minute
    .venv/bin/python benchmarks/bench_regimes.py           # about a minute
    .venv/bin/python benchmarks/bench_regimes.py --before A.json --after B.json  # one table
    .venv/bin/python benchmarks/bench_regimes.py --pool-dir /mnt/huge  # a huge-page tmpfs
    .venv/bin/python benchmarks/bench_regimes.py --compare-ready  # room readied ahead off / on

`bench_hicache.py` measures Maru warm: pages the process touched already, room in the pool.
A server's instance spends its life elsewhere, and this measures it there, through
`MaruStorage` built by SGLang's real backend factory on SGLang's real MHA host pool (on CPU,
through tests/sglang_cpu; bench_hicache's `Instance` builds both), in calls of 16 MiB back to
back, at 64 KiB and 1 MiB pages:

1. **full**: `batch_set_v1` of new keys once the instance's `maru_pool_size` (16 calls,
   `--full-calls`) is full (its share written first, so that every write needs room);
2. **never-touched / touched**: `batch_set_v1` by a new process into pages it never touched
   (its `maru_pool_size` not reached: no eviction), then, the keys deleted, the same writes
   into the pages it has touched now; the ratio of the two. The writer connects with
   `maru_ready_at_connect` and is up `--up-s` before its first write (printed); another new
   process writes at once after connect (the worst case);
3. **first / second read**: a new process (forked from this one before any Maru object
   exists: it inherits no mapping) connects, is up `--up-s` as the writer was, and its first
   `batch_get_v1` of the writer's keys against its second of the same keys; the ratio of the
   two. Likewise a process that connected before the writer took its regions (it learns of
   them from the local index) and, the worst case, one that reads at once after connect.
   Every page read is checked: a stamp per page and call (a page of another key is caught)
   and the CRC of the last call.

Beside them, in the same processes, the streaming copy of the same bytes between the host pool
and a warm /dev/shm mapping (`maru.common.memcopy.copy_values` with streaming stores: the
`stream` method of bench_hicache), set and get. Each round runs on a fresh `maru-server` (a
pool file nobody touched); figures are medians over rounds, ratios medians of per-round ratios.
Before and after the rounds it runs `probe_idle_memory.idle_verdict` (no Maru: is memory left
idle for a second written slower on this host today?) and prints its line above the table.
Prints the regimes' table with issue 42's targets and PASS/MISS, and writes CSV, JSON,
Markdown and a PNG (matplotlib) under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import resource
import statistics
import struct
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import bench_hicache as H  # (same dir; puts tests/ on sys.path for sglang_cpu)
from probe_idle_memory import idle_verdict
from report import finish, rows_csv

MiB = H.MiB
CALL_BYTES = 16 * MiB  # one batch_set_v1 / batch_get_v1 call
CASES = {"64 KiB": H.CASES[0], "1 MiB": H.CASES[1]}  # mha-64K, mha-1M
SERVER_POOL = "1G"
# The full instance's maru_pool_size, in calls (256 MiB; `--full-calls`): a call is 1/16 of it,
# as a serving instance's write batches are a small part of its share, so the next write's room
# is evicted while this one copies (`maru.client.supply.AHEAD_SHARE`). With `--full-calls 4` a
# call is a quarter of it, too much to keep free ahead: every write waits for its own eviction.
FULL_CALLS = 16
READER_POOL = CALL_BYTES  # the reader writes nothing: one call's room is plenty
# How long the never-touched writer and the readers are up before their first write or read
# (`--up-s`): a serving instance connects at start-up, seconds before its first write or read;
# with `maru_ready_at_connect` it takes its share then and populates it in the background
# (`RegionSupply.ready`), and its reads find the pool's regions mapped and populated (`eager_map`).
# The worst cases, a write or a read at once after connect, are measured too ("at once").
UP_S = 1.0
# The new processes that write (the never-touched writer, "at once") connect with
# `maru_ready_at_connect` true. False (`--compare-ready`'s "before" half): not, and
# `RegionSupply.ready` does nothing (no room taken or populated ahead of writes, as before).
READY = True
WRITERS = ("writer", "at once")

# The targets: (summary key, goal per page size, what the goal is a share of).
TARGETS = (
    ("full_vs_stream", {"64 KiB": 0.75, "1 MiB": 0.85}, "of the copy"),
    ("never_vs_touched", {"64 KiB": 0.50, "1 MiB": 0.50}, "of touched"),
    ("first_vs_second", {"64 KiB": 0.60, "1 MiB": 0.60}, "of the second"),
)


@dataclass(frozen=True)
class Plan:
    rounds: int  # fresh servers (and processes) per page size
    calls: int  # 16 MiB calls per timed block
    full_calls: int = FULL_CALLS  # the full instance's maru_pool_size, in calls
    up_s: float = UP_S  # the never-touched writer's time up before its first write

    @classmethod
    def make(cls, quick: bool, full_calls: int = FULL_CALLS, up_s: float = UP_S) -> Plan:
        return cls(1, 4, full_calls, up_s) if quick else cls(5, 12, full_calls, up_s)

    @property
    def fresh_pool(self) -> int:
        """The writer's maru_pool_size: twice what it writes, so that its cap is never reached."""
        return 2 * self.calls * CALL_BYTES


def _minflt() -> int:
    """Minor page faults of this process so far (all its threads: the copy threads too)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class Side(H.Instance):
    """One process of a round: SGLang's host pool holding one call's pages and one MaruStorage
    on it from SGLang's dynamic backend factory (with `maru_pool_size` `pool_size`, everything
    else at its default), and the warm /dev/shm mapping of the stream copy."""

    def __init__(self, url: str, case: H.Case, pages: int, pool_size: int, role: str):
        self.pool_size = pool_size
        super().__init__(url, case, pages, "", role)

    def _setup(self, url, case, file_dir, role, is_mla, page_sizes, ab) -> None:
        """Instance's hook: the one MaruStorage, timed (its connect maps what `eager_map`
        maps), and the stream copy's warm mapping."""
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

        import sglang_cpu.host_pools as hp
        from maru import MaruConfig
        from sglang_cpu.p2p import maru_extra_config

        extra = maru_extra_config(url, pool_size=str(self.pool_size), maru_timeout_ms="60000")
        if hasattr(MaruConfig, "ready_at_connect"):  # (a `--label before` tree may predate it)
            extra["maru_ready_at_connect"] = str(READY and role in WRITERS).lower()
        config = hp.storage_config(model=f"regimes/{case.name}", is_mla=is_mla, extra=extra)
        self.wipe()  # (the host pool's pages touched before connect: "at once" writes them)
        t0 = time.perf_counter()
        store = StorageBackendFactory.create_backend("dynamic", config, self.pool)
        if not READY:
            store.handler._supply.ready = lambda nbytes: None  # (the baseline: see READY)
        store.register_mem_pool_host(self.pool)
        self.connect_s = time.perf_counter() - t0
        self.connected_at = time.monotonic()
        self.stores = {"maru": store}
        self.maru = store
        self.buf = np.empty(self.total, np.uint8)  # (Instance.fill keeps a copy there)
        self.shm, self.shm_addr = H.warm_shm(self.total)
        self.role = role

    def connect_seconds(self) -> float:
        return self.connect_s

    def up_at_least(self, seconds: float) -> float:
        """Wait until this instance has been connected `seconds`; returns how long it was."""
        time.sleep(max(0.0, self.connected_at + seconds - time.monotonic()))
        return time.monotonic() - self.connected_at

    def _stamp(self, tag: str, call: int, p: int) -> bytes:
        return struct.pack("<II", zlib.crc32(f"{tag}/{call}".encode()), p)

    def _write_stamps(self, tag: str, call: int) -> None:
        """The first 8 bytes of every page say which call and page it is (untimed)."""
        for p in range(self.pages):
            ctypes.memmove(self.ptrs[p * self.parts], self._stamp(tag, call, p), 8)

    def _stamps_ok(self, tag: str, call: int) -> int:
        return sum(
            ctypes.string_at(self.ptrs[p * self.parts], 8) == self._stamp(tag, call, p)
            for p in range(self.pages)
        )

    def timed(self, op: str, tag: str, calls: int) -> dict[str, Any]:
        """`calls` calls of `op` ("maru_set", "maru_get", "stream_set", "stream_get") of this
        host pool's pages, back to back, keys of `tag` (a set stamps its pages first, a get
        checks the stamps after: both outside the timed calls; the stream copy moves the same
        bytes, unstamped). Returns the seconds, the pages moved (by a get: with the right
        stamp) and the minor faults meanwhile."""
        backend, direction = op.split("_")
        store = self.maru
        idx = self.idx
        seconds, ok = 0.0, 0
        faults = _minflt()
        for c in range(calls):
            keys = [H.page_key(f"{tag}/c{c}", i) for i in range(self.pages)]
            if backend == "maru" and direction == "set":
                self._write_stamps(tag, c)
            t0 = time.perf_counter()
            if backend == "stream":
                done = self._copy(self.shm_addr, direction == "get", 0, self.pages, True)
            elif direction == "set":
                done = sum(store.batch_set_v1(keys, idx))
            else:
                done = sum(store.batch_get_v1(keys, idx))
            seconds += time.perf_counter() - t0
            if backend == "maru" and direction == "get":
                done = min(done, self._stamps_ok(tag, c))
            ok += done
        if backend == "maru" and direction == "set":
            t0 = time.perf_counter()  # write-behind: charged to the block
            store.confirm_writes()
            seconds += time.perf_counter() - t0
        return {"seconds": seconds, "ok": ok, "faults": _minflt() - faults}

    def present(self, tag: str, calls: int) -> int:
        """How many of the pages `calls` calls of `tag` stored are still there."""
        found = 0
        for c in range(calls):
            keys = self.stored_keys(f"{tag}/c{c}", self.pages)
            found += sum(self.maru.handler.batch_exists(keys))
        return found

    def delete(self, tag: str, calls: int) -> int:
        return sum(self.maru_delete(f"{tag}/c{c}") for c in range(calls))


def gbps(block: dict[str, Any], calls: int) -> float:
    return calls * CALL_BYTES / block["seconds"] / 1e9


def per_mib(block: dict[str, Any], calls: int) -> float:
    """Minor faults per MiB moved."""
    return block["faults"] / (calls * CALL_BYTES / MiB)


def bench_round(case: H.Case, plan: Plan) -> dict[str, float]:
    """One round of the three regimes for one page size on a fresh server: the writer's
    never-touched and touched sets (regime 2), a new process's reads of them (regime 3; and,
    not judged, those of a process that connected before the writer took any region), then
    a full instance (regime 1)."""
    pages = pages_of(case)
    n = plan.calls
    out: dict[str, float] = {}
    with H.maru_server(SERVER_POOL) as url:
        workers = [H.Worker(Side, url, case, pages, plan.fresh_pool, "writer")]
        try:
            writer = workers[0]
            workers.append(H.Worker(Side, url, case, pages, READER_POOL, "reader"))
            writer.call("fill", 1)
            writer.call("timed", "stream_set", "warm", 2)
            stream = [writer.call("timed", "stream_set", "copy", n)]
            out["never_up_s"] = writer.call("up_at_least", plan.up_s)
            never = writer.call("timed", "maru_set", "data", n)
            assert never["ok"] == n * pages, f"{case.name}: never-touched set stored {never}"
            writer.call("delete", "data", n)
            touched = writer.call("timed", "maru_set", "data", n)
            assert touched["ok"] == n * pages, f"{case.name}: touched set stored {touched}"
            stream.append(writer.call("timed", "stream_set", "copy", n))
            out["stream_set"] = statistics.median(gbps(b, n) for b in stream)
            out["never_set"], out["touched_set"] = gbps(never, n), gbps(touched, n)
            out["never_vs_touched"] = out["never_set"] / out["touched_set"]
            out["never_faults_per_mib"] = per_mib(never, n)
            out["touched_faults_per_mib"] = per_mib(touched, n)
            crcs = writer.call("crcs")  # (the last call's pages, stamps and all)
            workers.append(H.Worker(Side, url, case, pages, READER_POOL, "reader"))  # new
            out.update(bench_reads(workers[2], case, n, crcs, "", plan.up_s))
            out.update(bench_reads(workers[1], case, n, crcs, "early_", plan.up_s))
            workers.append(H.Worker(Side, url, case, pages, READER_POOL, "reader"))  # new
            out.update(bench_reads(workers[-1], case, n, crcs, "now_", 0.0))
            # the worst case: a new process writes at once after connect (nothing ready yet)
            workers.append(H.Worker(Side, url, case, pages, plan.fresh_pool, "at once"))
            now = workers[-1].call("timed", "maru_set", "now", n)
            assert now["ok"] == n * pages, f"{case.name}: the at-once set stored {now}"
            out["now_set"] = gbps(now, n)
            out["now_vs_touched"] = out["now_set"] / out["touched_set"]
        finally:
            for worker in workers:
                worker.close()
        out.update(bench_full(url, case, plan, pages))
    return out


def bench_reads(
    reader: H.Worker, case: H.Case, n: int, crcs: list[int], prefix: str, up_s: float
) -> dict:
    """Regime 3 in `reader`, a process that never read these keys, up at least `up_s` since
    its connect: its first `batch_get_v1` of the writer's `n` calls, then its second, between
    two blocks of the stream copy (get); the pages read checked against the writer's CRCs."""
    out = {f"{prefix}connect_ms": reader.call("connect_seconds") * 1e3}
    out[f"{prefix}up_s"] = reader.call("up_at_least", up_s) if up_s else 0.0
    reader.call("wipe")  # (its host pool is warm, as a server's pinned pool is)
    reader.call("timed", "stream_get", "warm", 1)
    stream = [reader.call("timed", "stream_get", "copy", n)]
    first = reader.call("timed", "maru_get", "data", n)
    second = reader.call("timed", "maru_get", "data", n)
    for what, block in (("first", first), ("second", second)):
        assert block["ok"] == n * pages_of(case), f"{case.name}: {prefix}{what} read: {block}"
    got = reader.call("crcs")
    bad = sum(a != b for a, b in zip(got, crcs))
    assert not bad, f"{case.name}: {bad} pages read differ from those written"
    stream.append(reader.call("timed", "stream_get", "copy", n))
    out[f"{prefix}stream_get"] = statistics.median(gbps(b, n) for b in stream)
    out[f"{prefix}first_get"], out[f"{prefix}second_get"] = gbps(first, n), gbps(second, n)
    out[f"{prefix}first_vs_second"] = gbps(first, n) / gbps(second, n)
    out[f"{prefix}first_faults_per_mib"] = per_mib(first, n)
    out[f"{prefix}second_faults_per_mib"] = per_mib(second, n)
    return out


def pages_of(case: H.Case) -> int:
    """Pages of one 16 MiB call."""
    return CALL_BYTES // case.page_bytes


def bench_full(url: str, case: H.Case, plan: Plan, pages: int) -> dict[str, float]:
    """Regime 1: an instance whose maru_pool_size is full writes new keys, against the stream
    copy in the same process, in blocks alternating (which goes first alternates too)."""
    n = plan.calls
    full_calls = plan.full_calls
    full = H.Worker(Side, url, case, pages, full_calls * CALL_BYTES, "full")
    try:
        full.call("fill", 2)
        full.call("timed", "stream_set", "warm", 2)
        share = full.call("timed", "maru_set", "share", full_calls + 1)  # (untimed: room used)
        assert share["ok"] > 0, f"{case.name}: filling the share stored nothing"
        sec = {"maru": 0.0, "stream": 0.0}
        stored = 0
        for i in range(2):
            for b in ("stream", "maru") if i == 0 else ("maru", "stream"):
                block = full.call("timed", f"{b}_set", f"full{i}", n)
                sec[b] += block["seconds"]
                if b == "maru":
                    stored += block["ok"]
        assert stored == 2 * n * pages, f"{case.name}: the full instance stored {stored}"
        # the regime is what it says: its share was full, so its writes made room
        kept = full.call("present", "share", full_calls + 1) + full.call("present", "full0", n)
        kept += full.call("present", "full1", n)
        assert kept <= full_calls * pages, f"{case.name}: {kept} pages kept, nothing evicted?"
    finally:
        full.close()
    maru, stream = (2 * n * CALL_BYTES / sec[b] / 1e9 for b in ("maru", "stream"))
    return {"full_set": maru, "full_stream_set": stream, "full_vs_stream": maru / stream}


# -- report -----------------------------------------------------------------------------------


def summarize(rounds: list[dict[str, float]]) -> dict[str, float]:
    """Medians over rounds of every figure (a ratio: the median of the per-round ratios)."""
    return {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}


def evaluate(summary: dict[str, dict[str, float]]) -> list[tuple[str, str, float, float, bool]]:
    """(target key, page size, measured, goal, met) for each target and page size measured."""
    return [
        (key, size, summary[size][key], goals[size], summary[size][key] >= goals[size])
        for key, goals, _ in TARGETS
        for size in CASES
        if size in summary
    ]


ROWS = (  # (label, figure's key, `cell`'s share: the % beside GB/s, or None)
    ("streaming copy (`copy_values`, streaming stores), set", "stream_set", None),
    ("streaming copy, get", "stream_get", None),
    (
        "`batch_set_v1`, the instance's `maru_pool_size` full (every write needs room)",
        "full_set",
        "full_vs_stream",
    ),
    (
        "`batch_set_v1` into pages this process never touched (cap not reached)",
        "never_set",
        "never_set/stream_set",
    ),
    ("`batch_set_v1` into pages it touched", "touched_set", "touched_set/stream_set"),
    ("never-touched / touched", "never_vs_touched", None),
    ("the writer's time up before its first never-touched write, s", "never_up_s", None),
    (
        "`batch_set_v1` by a new process at once after connect (the worst case)",
        "now_set",
        "now_set/stream_set",
    ),
    ("at once / touched", "now_vs_touched", None),
    (
        "a new process's first `batch_get_v1` of another's pages",
        "first_get",
        "first_get/stream_get",
    ),
    ("its second read of the same keys", "second_get", "second_get/stream_get"),
    ("first / second", "first_vs_second", None),
    (
        "first / second, the reader connected before the writer took its regions",
        "early_first_vs_second",
        None,
    ),
    ("the reader's time up before its first read, s", "up_s", None),
    (
        "first / second, a reader at once after connect (the worst case)",
        "now_first_vs_second",
        None,
    ),
    ("the new process's connect (MaruStorage from the factory), ms", "connect_ms", None),
    (
        "minor faults per MiB: never-touched set / touched set / first get / second get",
        "faults",
        None,
    ),
)
FAULTS = ("never", "touched", "first", "second")


# The rows that carry a target: the row's key -> the target's key (TARGETS).
JUDGED = {
    "full_set": "full_vs_stream",
    "never_vs_touched": "never_vs_touched",
    "first_vs_second": "first_vs_second",
}


def cell(s: dict[str, float], key: str, share: str | None) -> str:
    """One figure as the table shows it: GB/s (and % of the copy), a ratio, ms or faults.
    `share`: a ratio's key, or "a/b" (the ratio of two figures)."""
    if key == "faults":
        return " / ".join(f"{s[f'{f}_faults_per_mib']:.0f}" for f in FAULTS)
    if key not in s:  # (a run of an older version of this benchmark: --before / --after)
        return "-"
    if key.endswith("_ms"):
        return f"{s[key]:.0f}"
    if key.endswith("_s"):
        return f"{s[key]:.2f}"
    if "_vs_" in key:
        return f"{s[key]:.2f}"
    if share is None:
        return f"{s[key]:.1f} GB/s"
    num, _, den = share.partition("/")
    ratio = s[num] / s[den] if den else s[num]
    return f"{s[key]:.1f} GB/s ({ratio:.0%})"


def goal_text(target: str) -> str:
    """A target's goal as the table shows it (one figure if every page size has the same)."""
    for key, goals, what in TARGETS:
        if key == target:
            shown = (f"{g:.0%}" if key == "full_vs_stream" else f"{g:.2f}" for g in goals.values())
            return f">= {' / '.join(dict.fromkeys(shown))} {what}"
    raise KeyError(target)


def render(summary: dict[str, dict[str, float]]) -> list[str]:
    """The regimes' table: a column per page size measured, the target and the verdicts."""
    sizes = [s for s in CASES if s in summary]
    verdicts = {(key, size): ok for key, size, _v, _g, ok in evaluate(summary)}
    lines = [
        f"| regime | {' | '.join(sizes)} | target | result |",
        f"|---|{'---:|' * len(sizes)}---|---|",
    ]
    for label, key, share in ROWS:
        cells = [cell(summary[size], key, share) for size in sizes]
        target, result = "", ""
        if key in JUDGED:
            target = goal_text(JUDGED[key])
            result = " / ".join("PASS" if verdicts[(JUDGED[key], s)] else "MISS" for s in sizes)
        lines.append(f"| {label} | {' | '.join(cells)} | {target} | {result} |")
    return lines


def render_compare(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]):
    """Two trees' tables in one (docs/performance.md's): before and after per page size, the
    target, and the verdicts before -> after."""
    sizes = [s for s in CASES if s in before and s in after]
    judged = {
        side: {(key, size): ok for key, size, _v, _g, ok in evaluate(summary)}
        for side, summary in (("before", before), ("after", after))
    }
    heads = [f"{size} {side}" for size in sizes for side in ("before", "after")]
    lines = [
        f"| regime | {' | '.join(heads)} | target | result |",
        f"|---|{'---:|' * len(heads)}---|---|",
    ]

    def verdict(side: str, target: str, size: str) -> str:
        return "PASS" if judged[side][(target, size)] else "MISS"

    for label, key, share in ROWS:
        cells = [cell(side[size], key, share) for size in sizes for side in (before, after)]
        target, result = "", ""
        if key in JUDGED:
            target = goal_text(JUDGED[key])
            result = " / ".join(
                f"{verdict('before', JUDGED[key], s)} -> {verdict('after', JUDGED[key], s)}"
                for s in sizes
            )
        lines.append(f"| {label} | {' | '.join(cells)} | {target} | {result} |")
    return lines


def load_summaries(paths: list[str]) -> dict[str, dict[str, float]]:
    """Several runs' JSON files -> per page size, the median of their summaries."""
    runs = [json.loads(Path(p).read_text())["summary"] for p in paths]
    sizes = [s for s in CASES if all(s in run for run in runs)]
    return {size: summarize([run[size] for run in runs]) for size in sizes}


def plot(path: Path, summary: dict[str, dict[str, float]]) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    sizes = [s for s in CASES if s in summary]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    bars = (
        "stream_set",
        "full_set",
        "never_set",
        "touched_set",
        "stream_get",
        "first_get",
        "second_get",
    )
    width = 0.9 / len(bars)
    for k, key in enumerate(bars):
        xs = [i + (k - (len(bars) - 1) / 2) * width for i in range(len(sizes))]
        left.bar(xs, [summary[s][key] for s in sizes], width, label=key)
    left.set_xticks(range(len(sizes)), sizes)
    left.set_ylabel("GB/s (16 MiB calls, median of rounds)")
    left.set_title("Set and get by regime")
    left.legend(fontsize=7)
    keys = [key for key, _, _ in TARGETS]
    for k, size in enumerate(sizes):
        xs = [i + (k - 0.5) * 0.4 for i in range(len(keys))]
        right.bar(xs, [summary[size][key] for key in keys], 0.4, label=size)
        for x, (_, goals, _) in zip(xs, TARGETS):
            right.plot([x - 0.2, x + 0.2], [goals[size]] * 2, "k--", linewidth=1)
    right.set_xticks(range(len(keys)), keys)
    right.set_ylabel("ratio (dashes: the target)")
    right.set_title("The targets")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one round, 4 calls a block")
    ap.add_argument("--out", default=str(H.ROOT / "benchmarks" / "results"), help="results dir")
    ap.add_argument("--sizes", default=",".join(CASES), help="page sizes: 64 KiB, 1 MiB")
    ap.add_argument("--label", default="", help="added to the result file names")
    ap.add_argument(
        "--full-calls",
        type=int,
        default=FULL_CALLS,
        help="the full instance's maru_pool_size, in 16 MiB calls (at least 2)",
    )
    ap.add_argument(
        "--pool-dir",
        default=H.SHM_DIR,
        help="a tmpfs for the pools and the stream copy's mapping (one mounted with "
        "huge=within_size: 2 MiB pages, docs/operations.md)",
    )
    ap.add_argument(
        "--before",
        nargs="+",
        metavar="JSON",
        help="with --after: no run; "
        "print the before / after table of these runs' JSON files (medians)",
    )
    ap.add_argument("--after", nargs="+", metavar="JSON")
    ap.add_argument(
        "--up-s",
        type=float,
        default=UP_S,
        help="seconds the never-touched writer and the readers are up before their first "
        "write or read",
    )
    ap.add_argument(
        "--compare-ready",
        action="store_true",
        help="each round twice, room taken and populated ahead of writes "
        "(RegionSupply.ready) off and on, which first alternating; one before / after table",
    )
    args = ap.parse_args()
    if args.before or args.after:
        if not (args.before and args.after):
            ap.error("--before and --after go together")
        before, after = load_summaries(args.before), load_summaries(args.after)
        print("\n".join(render_compare(before, after)))
        return 0
    sizes = [s.strip() for s in args.sizes.split(",")]
    if unknown := sorted(set(sizes) - set(CASES)):
        ap.error(f"--sizes: unknown {', '.join(unknown)} (known: {', '.join(CASES)})")
    H.SHM_DIR = args.pool_dir  # (bench_hicache's: its servers and shm mappings use it)
    if args.full_calls < 2:
        ap.error("--full-calls: at least 2")
    plan = Plan.make(args.quick, args.full_calls, args.up_s)
    global READY
    t_start = time.monotonic()
    import sglang_cpu

    sglang_cpu.apply()  # before SGLang is imported
    H.preload_sglang()
    machine = H.machine_info()
    host_before = idle_verdict()  # (the host's state, beside the run's figures)
    rounds: dict[str, list[dict[str, float]]] = {s: [] for s in sizes}
    off: dict[str, list[dict[str, float]]] = {s: [] for s in sizes}  # (--compare-ready)
    for r in range(plan.rounds):  # page sizes alternate: both see the same machine state
        for size in sizes:
            for READY in (r % 2 == 1, r % 2 == 0) if args.compare_ready else (True,):
                (rounds if READY else off)[size].append(bench_round(CASES[size], plan))
            READY = True
            print(f"round {r + 1}/{plan.rounds}, {size}: done", file=sys.stderr)
    host_after = idle_verdict()
    summary = {size: summarize(rs) for size, rs in rounds.items()}
    compared: list[str] = []
    if args.compare_ready:
        before = {size: summarize(rs) for size, rs in off.items()}
        compared = ["", "Before (ready off) / after (ready on), the same run:", ""]
        compared += render_compare(before, summary)
    cmd = " ".join([Path(sys.executable).name, "benchmarks/bench_regimes.py", *sys.argv[1:]])
    import maru

    text = "\n".join(
        [
            f"Regimes: {cmd}; {plan.rounds} round(s), {plan.calls} calls of 16 MiB "
            f"per timed block; the full instance's share {plan.full_calls} calls; "
            f"maru from {Path(maru.__file__).parent}",
            f"{machine['cpu']}, {machine['cores']} cores, kernel {machine['kernel']}; pools in "
            f"{machine['pool_dir']} (huge={machine['huge']})",
            f"before the rounds, {host_before}",
            f"after the rounds, {host_after}",
            "",
            *render(summary),
            *compared,
        ]
    )
    targets = evaluate(summary)
    doc = {
        "machine": machine,
        "idle_memory_probe": [host_before, host_after],
        "plan": {"rounds": plan.rounds, "calls": plan.calls, "call_bytes": CALL_BYTES},
        "maru": str(Path(maru.__file__).parent),
        "summary": summary,
        "rounds": rounds,
        "rounds_ready_off": off,
        "targets": [
            {"target": k, "pages": s, "measured": v, "goal": g, "met": ok}
            for k, s, v, g, ok in targets
        ],
    }
    flat = [
        {"pages": size, "metric": k, "value": v}
        for size, s in summary.items()
        for k, v in s.items()
    ]
    finish(
        "regimes",
        args.out,
        text,
        doc,
        machine,
        t_start,
        write_csv=rows_csv(flat),
        plot=lambda path: plot(path, summary),
        quick=args.quick,
        label=args.label,
    )
    print(f"{sum(ok for *_, ok in targets)} of {len(targets)} targets met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
