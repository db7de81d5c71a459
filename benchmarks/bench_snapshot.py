"""Server benchmark: how long a snapshot holds maru-server's loop, by the registry's size.

    .venv/bin/python benchmarks/bench_snapshot.py                 # 10^5 and 10^6 keys, ~1 min
    .venv/bin/python benchmarks/bench_snapshot.py --keys 200000   # one size

Every request of every instance waits while the loop writes a snapshot (`Housekeeping.
snapshot`, when the journal passes its threshold). A `MaruService` built as maru-server builds
it (bench_server's `Server`: a real pool and journal, here on /dev/shm, so no disk's fsync is
in the figures) holds N keys of one page each; each round times one snapshot the way the
server writes it (the keys' rows packed in C: `persistence.snapshot_packed`) and, as the
baseline in the same run, one from the rows list built in Python (`persistence.snapshot`, the
way it was written before 2026-12-06). Wall and this thread's CPU time, medians of the rounds.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_server import Server, batch_keys
from maru.common import protocol
from maru.common.protocol import MsgType
from maru.server import persistence

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


def measure(n: int, rounds: int) -> dict[str, tuple[float, float, int]]:
    """Per way: (median wall s, median CPU s, the snapshot's bytes)."""
    work = Path(tempfile.mkdtemp(prefix="maru-bench-snap-", dir="/dev/shm"))
    server = filled(work, n)
    ways = {"rows list (before)": persistence.snapshot, "packed in C": persistence.snapshot_packed}
    samples: dict[str, list[tuple[float, float]]] = {w: [] for w in ways}
    sizes: dict[str, int] = {}
    try:
        for _ in range(rounds):
            for way, build in ways.items():
                t0, c0 = time.perf_counter(), time.thread_time()
                server.journal.write_snapshot(build(server.registry))
                samples[way].append((time.perf_counter() - t0, time.thread_time() - c0))
                sizes[way] = server.journal.snapshot_size
    finally:
        server.close()
        shutil.rmtree(work, ignore_errors=True)
    return {
        way: (
            statistics.median(w for w, _ in got),
            statistics.median(c for _, c in got),
            sizes[way],
        )
        for way, got in samples.items()
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, action="append", help="registry sizes (10^5, 10^6)")
    ap.add_argument("--rounds", type=int, default=3, help="snapshots of each way (3)")
    args = ap.parse_args()
    print("| keys | snapshot | loop held, s (wall) | CPU, s | bytes |")
    print("|---:|---|---:|---:|---:|")
    for n in args.keys or [100_000, 1_000_000]:
        for way, (wall, cpu, size) in measure(n, args.rounds).items():
            print(f"| {n:,} | {way} | {wall:.3f} | {cpu:.3f} | {size:,} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
