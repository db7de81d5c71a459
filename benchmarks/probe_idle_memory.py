"""Probe: does this host slow down memory left idle for a second? (No Maru in it.)

    .venv/bin/python benchmarks/probe_idle_memory.py          # about 15 s
    .venv/bin/python benchmarks/probe_idle_memory.py --mib 512 --sleeps 0 1 4

Issue 42's never-touched and first-read regimes time the first touch of pool pages. On some
days this VM's host takes back guest memory that sat idle: pages populated, even pages just
written, are then written at a fifth of their speed after a second of quiet, with no page
fault in the guest (benchmarks/results/history.md, 2026-12-07). On such a day those regimes
measure the host, and nothing a client readies ahead survives the idle second. Run this first.

It maps a `/dev/shm` file, populates it (`MADV_POPULATE_WRITE` where the kernel has it, else a
write of every page), then for each sleep writes the whole mapping twice, sleeping before
each write, and prints the speeds. `idle_verdict` is what `bench_regimes.py` prints beside its
table: the 1 s speed against the 0 s one.
"""

from __future__ import annotations

import argparse
import mmap
import os
import tempfile
import time

import numpy as np

# (Linux's value; Python 3.11's mmap does not name it. Not imported from maru: the probe has no
# Maru in it, and bench_regimes.py runs it beside an older checkout's maru for a baseline.)
MADV_POPULATE_WRITE = 23

# Idle memory written slower than this share of busy memory: the host takes it back. (Runs
# with the probe at 0.69 missed the never-touched and first-read targets: 0.45-0.55.)
SLOW = 0.8


def write_speeds(mib: int = 256, sleeps: tuple[float, ...] = (0.0, 1.0, 4.0)) -> dict:
    """Per sleep: (GB/s of the first write after it, GB/s of the same pages written again
    after the same sleep)."""
    size = mib << 20
    fd, path = tempfile.mkstemp(prefix="maru-probe-", dir="/dev/shm")
    try:
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size)
        try:
            try:
                mm.madvise(MADV_POPULATE_WRITE)
            except OSError:  # (an older kernel: touch every page instead)
                mm[::4096] = b"\1" * (size // 4096)
            view = np.frombuffer(mm, dtype=np.uint8)
            out = {}
            for n, sleep in enumerate(sleeps):
                speeds = []
                for again in range(2):
                    time.sleep(sleep)
                    start = time.perf_counter()
                    view[:] = (2 * n + again) & 0xFF
                    speeds.append(size / (time.perf_counter() - start) / 1e9)
                out[sleep] = (speeds[0], speeds[1])
            del view
        finally:
            mm.close()
    finally:
        os.close(fd)
        os.unlink(path)
    return out


def idle_verdict(mib: int = 128) -> str:
    """One line: how fast memory idle for 1 s is written against memory written at once."""
    speeds = write_speeds(mib, (0.0, 1.0))
    busy, idle = speeds[0.0][0], speeds[1.0][0]
    ratio = idle / busy
    state = (
        "SLOW: this host slows memory left idle; the never-touched and first-read regimes "
        "measure it, not Maru"
        if ratio < SLOW
        else "ok"
    )
    return (
        f"idle-memory probe: {busy:.1f} GB/s at once, {idle:.1f} GB/s after 1 s idle "
        f"({ratio:.2f}): {state}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="mapping size (default 256)")
    parser.add_argument(
        "--sleeps", type=float, nargs="+", default=[0.0, 1.0, 4.0], help="seconds idle"
    )
    args = parser.parse_args()
    speeds = write_speeds(args.mib, tuple(args.sleeps))
    print(f"| sleep before each write | first write | the same pages again |  ({args.mib} MiB)")
    print("|---|---:|---:|")
    for sleep, (first, again) in speeds.items():
        print(f"| {sleep:g} s | {first:.1f} GB/s | {again:.1f} GB/s |")
    busy = speeds[min(speeds)][0]
    for sleep, (first, _) in speeds.items():
        if sleep > 0 and first / busy < SLOW:
            print(f"idle {sleep:g} s: written at {first / busy:.2f} of the busy speed: SLOW")


if __name__ == "__main__":
    main()
