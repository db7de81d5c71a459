"""Server benchmark: how long a snapshot holds maru-server's loop, by the registry's size.

    .venv/bin/python benchmarks/bench_snapshot.py                 # 10^5 and 10^6 keys, ~1 min
    .venv/bin/python benchmarks/bench_snapshot.py --keys 200000   # one size
    .venv/bin/python benchmarks/bench_snapshot.py --state-on /var/tmp   # a disk's fsyncs too

Every request of every instance waits while the loop works on a snapshot (`Housekeeping.
snapshot`, when the journal passes its threshold). A `MaruService` built as maru-server builds
it (bench_server's `Server`: a real pool and journal, here on /dev/shm unless `--state-on` puts
the state dir on another file system, so by default no disk's fsync is in the figures) holds N
keys of one page each; each round times one snapshot each way. The server's way now: the keys'
rows packed in C (`persistence.snapshot_packed`), then `Journal.start_snapshot`: the loop
fsyncs the journal and switches to the next one, a thread writes the file; "on disk" is when
that thread is done. As baselines in the same run, the ways before: the same packed state
written on the loop (`Journal.write_snapshot`, the previous way), and the rows list built in
Python and written on the loop (`persistence.snapshot`, the first way, until 2026-12-06).
Wall and the loop thread's CPU time, medians of the rounds.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_server import Server, batch_keys
from maru.common import protocol
from maru.common.protocol import MsgType
from maru.server import persistence
from maru.server.journal import Journal
from maru.server.registry import Registry

PAGE = 4096
BATCH = 4096


def filled(work: Path, n: int) -> Server:
    """A server whose one instance registered `n` keys, a page each, in one region."""
    server = Server(work, 2 * n * PAGE, region_bytes=n * PAGE)
    for start in range(0, n, BATCH):
        count = min(BATCH, n - start)
        body = {
            "keys": batch_keys(f"k{start}", count),
            "region_ids": protocol.pack_int64([server.region_id] * count),
            "offsets": protocol.pack_int64([(start + i) * PAGE for i in range(count)]),
            "lengths": protocol.pack_int64([PAGE] * count),
        }
        server.service.handle_frame(server.frame(MsgType.REGISTER_KV, body))
    return server


Way = Callable[[Journal, Registry], None]


def on_loop(build: Callable[[Registry], dict[str, Any]]) -> Way:
    def way(journal: Journal, registry: Registry) -> None:
        journal.write_snapshot(build(registry))

    return way


def in_background(journal: Journal, registry: Registry) -> None:
    assert journal.start_snapshot(persistence.snapshot_packed(registry))


WAYS: dict[str, Way] = {
    "rows list, on the loop (first way)": on_loop(persistence.snapshot),
    "packed in C, on the loop (previous way)": on_loop(persistence.snapshot_packed),
    "packed in C, written in the background (now)": in_background,
}


def measure(n: int, rounds: int, state_on: Path | None = None) -> dict[str, tuple[float, ...]]:
    """Per way: (median loop held s, median loop CPU s, median s until on disk, bytes)."""
    work = Path(tempfile.mkdtemp(prefix="maru-bench-snap-", dir="/dev/shm"))
    if state_on is not None:  # (the journal makes its state dir: here, a link to elsewhere)
        state = Path(tempfile.mkdtemp(prefix="maru-bench-snap-state-", dir=state_on))
        (work / "state").symlink_to(state)
    server = filled(work, n)
    samples: dict[str, list[tuple[float, float, float]]] = {w: [] for w in WAYS}
    sizes: dict[str, int] = {}
    try:
        for _ in range(rounds):
            for name, way in WAYS.items():
                t0, c0 = time.perf_counter(), time.thread_time()
                way(server.journal, server.registry)
                held, cpu = time.perf_counter() - t0, time.thread_time() - c0
                server.journal.wait_snapshot()
                samples[name].append((held, cpu, time.perf_counter() - t0))
                assert server.journal.snapshot_errors == 0
                sizes[name] = server.journal.snapshot_size
    finally:
        server.close()
        shutil.rmtree(work, ignore_errors=True)
        if state_on is not None:
            shutil.rmtree(state, ignore_errors=True)
    return {
        name: (*(statistics.median(s[i] for s in got) for i in range(3)), sizes[name])
        for name, got in samples.items()
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, action="append", help="registry sizes (10^5, 10^6)")
    ap.add_argument("--rounds", type=int, default=3, help="snapshots of each way (3)")
    ap.add_argument(
        "--state-on", type=Path, help="the state dir under this directory (default: /dev/shm)"
    )
    args = ap.parse_args()
    print(f"state dir on {args.state_on or '/dev/shm'}")
    print("| keys | snapshot | loop held, s (wall) | loop CPU, s | on disk after, s | bytes |")
    print("|---:|---|---:|---:|---:|---:|")
    for n in args.keys or [100_000, 1_000_000]:
        for way, (held, cpu, landed, size) in measure(n, args.rounds, args.state_on).items():
            print(f"| {n:,} | {way} | {held:.3f} | {cpu:.3f} | {landed:.3f} | {size:,} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
