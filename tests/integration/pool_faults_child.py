"""Run by `test_pool_faults.py`: `pool_faults_child.py MODE ...` (or `DIR MODE ...` on a
tmpfs), one inference process that
meets a fault in the pool, printing (JSON) what its stores and reads returned and whether
every hit was the bytes stored. Its death by a signal is what the test looks for first.

- `truncate URL POOL LOCAL`: store values, read them in a loop on another thread, truncate
  the pool file under the reads (`LOCAL` 1: reads through the local index, 0: requests).
- `DIR small WORKDIR` / `DIR fill WORKDIR`: `DIR` is a fresh tmpfs (`tmpfs.run_on_tmpfs`);
  start `maru-server` with its pool there (its state in `WORKDIR`, elsewhere). `small`: a
  32 MiB pool on a 40 MiB tmpfs, filled by this writer. `fill`: a 16 MiB pool on a 64 MiB
  tmpfs, filled by another file after some stores; then more stores.
- `close URL`: copy values out through a lookup's addresses on one thread (each copy in a
  `copying()` block) while another closes the handler."""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # (tests.conftest)

from tests.conftest import start_maru_server
from tests.integration.workers import make_value

from maru import MaruHandler
from maru.common.memcopy import CopyFaultError, copy_values

KiB, MiB = 1 << 10, 1 << 20


def read_back(h: MaruHandler, keys: list[str], size: int, seed: int) -> tuple[int, int]:
    """(hits, hits whose bytes are not the ones stored) of `h.read` of `keys`."""
    out = np.zeros((len(keys), size), np.uint8)
    buffers = out.ctypes.data + np.arange(len(keys), dtype=np.int64)[:, None] * size
    got = h.read(keys, buffers, np.array([size], np.int64), length=size)
    wrong = sum(
        hit and out[i].tobytes() != bytes(make_value(seed + i, size)) for i, hit in enumerate(got)
    )
    return sum(got), wrong


def truncate(url: str, pool: str, local: str) -> dict:
    size, n = 1 * MiB, 16
    keys = [f"t{i}" for i in range(n)]
    with MaruHandler(server_url=url, chunk_size_bytes=size, local_index=local == "1") as h:
        stored = h.batch_store(keys, [make_value(i, size) for i in range(n)])
        reading, truncated = threading.Event(), threading.Event()
        report = {"stored": sum(stored), "local": h.reads_locally, "wrong": 0, "after": []}
        report["coherence"] = h.coherence
        report["in_pool"] = h._index is not None and h._index.path is None  # (--index-slots)

        def reader() -> None:
            while True:
                after = truncated.is_set()
                hits, wrong = read_back(h, keys, size, 0)
                report["wrong"] += wrong
                reading.set()
                if after:
                    report["after"].append(hits)
                    if len(report["after"]) >= 5:
                        return

        thread = threading.Thread(target=reader)
        thread.start()
        reading.wait(60)
        os.truncate(pool, 0)  # (the server notices within its check interval: too late)
        truncated.set()
        thread.join(120)
    return report


def fill(path: Path) -> int:
    """Write `path` until its filesystem has no room left; the bytes written."""
    written = 0
    try:
        with open(path, "wb", buffering=0) as f:
            while True:
                written += f.write(b"\xff" * (64 * KiB))
    except OSError:  # (ENOSPC: full)
        return written


def on_tmpfs(mode: str, directory: str, workdir: str) -> dict:
    root = Path(directory)
    pool_size = "32M" if mode == "small" else "16M"
    server = start_maru_server(Path(workdir), pool_size, pool=str(root / "maru.pool"))
    try:
        size = 256 * KiB
        with MaruHandler(server_url=server.url, chunk_size_bytes=size) as h:
            report: dict = {"local_index": h.reads_locally, "stored": [], "hits": 0, "wrong": 0}
            first = 0
            for batch in range(16):
                if mode == "fill" and batch == 1:  # another file takes the rest of the tmpfs
                    report["filled"] = fill(root / "filler")
                keys = [f"v{first + i}" for i in range(8)]
                values = [make_value(first + i, size) for i in range(8)]
                report["stored"] += h.batch_store(keys, values)
                first += 8
            for at in range(0, first, 8):
                hits, wrong = read_back(h, [f"v{i}" for i in range(at, at + 8)], size, at)
                report["hits"] += hits
                report["wrong"] += wrong
        return report
    finally:
        server.stop()


def close_under_copy(url: str) -> dict:
    size, n = 4 * MiB, 8
    keys = [f"c{i}" for i in range(n)]
    h = MaruHandler(server_url=url, chunk_size_bytes=size)
    assert h.batch_store(keys, [make_value(i, size) for i in range(n)]) == [True] * n
    found = h.lookup(keys)
    starts, _ = found.wait()
    out = np.zeros((n, size), np.uint8)
    buffers = out.ctypes.data + np.arange(n, dtype=np.int64)[:, None] * size
    expected = np.stack([np.frombuffer(make_value(i, size), np.uint8) for i in range(n)])
    copying, closing = threading.Event(), threading.Event()
    report = {"copies": 0, "faulted": 0, "wrong": 0}

    def copier() -> None:  # a lookup's addresses, copied again and again
        while report["copies"] < 2000:
            with h.copying():
                began_open = not closing.is_set()
                try:
                    copy_values(starts, buffers, [size], to_values=False, threads=2)
                except CopyFaultError:  # (after close: the mapping is gone)
                    report["faulted"] += 1
                    return
            report["copies"] += 1
            if began_open:  # (after close the addresses may be another mapping's)
                report["wrong"] += int(not np.array_equal(out, expected))
            copying.set()

    thread = threading.Thread(target=copier)
    thread.start()
    copying.wait(60)
    closing.set()
    h.close()
    thread.join(120)
    return report


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "truncate":
        result = truncate(*args)
    elif mode == "close":
        result = close_under_copy(*args)
    else:  # DIR MODE WORKDIR
        result = on_tmpfs(args[0], mode, args[1])
    print(json.dumps(result), flush=True)
