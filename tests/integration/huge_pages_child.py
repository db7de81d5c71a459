"""Run by `test_huge_pages.py` inside a private mount namespace whose `DIR` is a fresh tmpfs:
`huge_pages_child.py DIR POOL_SIZE N`. Start `maru-server` with its pool there, store N values
of 256 KiB and read them back from this process, and print (JSON) whether the local index was
used, how much of each mapping the kernel maps with 2 MiB pages in the server and in this
client, and how many values read back as stored."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

from maru import MaruAdmin, MaruHandler

KiB, MiB = 1 << 10, 1 << 20


def pmd_mapped_kib(pid: int | str, path_part: str) -> int:
    """KiB of the mappings whose file name contains `path_part` that are mapped in 2 MiB
    pages (smaps: ShmemPmdMapped / FilePmdMapped)."""
    total, inside = 0, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5 and not fields[0].endswith(":"):
            inside = len(fields) >= 6 and path_part in fields[5]
        elif inside and fields and fields[0] in ("ShmemPmdMapped:", "FilePmdMapped:"):
            total += int(fields[1])
    return total


def value(i: int, size: int) -> bytes:
    return (hashlib.sha256(str(i).encode()).digest() * (size // 32))[:size]


def main(directory: str, pool_size: str, n: int) -> None:
    root = Path(directory)
    ready = root / "ready"
    flags = {
        "--host": "127.0.0.1",
        "--port": "0",
        "--pool": str(root / "maru.pool"),
        "--pool-size": pool_size,
        "--state-dir": str(root / "state"),
        "--ready-file": str(ready),
    }
    server = subprocess.Popen(
        [sys.executable, "-m", "maru.server", *(x for flag in flags.items() for x in flag)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while not (ready.exists() and ready.read_text().startswith("tcp://")):
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("maru-server did not start")
            time.sleep(0.02)
        url = ready.read_text().strip()
        size = 256 * KiB  # n of them: 32 fill whole 2 MiB extents of the pool
        with MaruHandler(server_url=url, pool_size=pool_size, chunk_size_bytes=size) as h:
            keys = [f"k{i}" for i in range(n)]
            stored = h.batch_store(keys, [value(i, size) for i in range(n)])
            infos = h.batch_retrieve(keys)
            right = [x is not None and bytes(x.view) == value(i, size) for i, x in enumerate(infos)]
            result = {
                "local_index": h._index is not None,
                "stored": sum(stored),
                "right": sum(right),
                "server_index_kib": pmd_mapped_kib(server.pid, ".index"),
                "client_index_kib": pmd_mapped_kib("self", ".index"),
                "client_pool_kib": pmd_mapped_kib("self", "maru.pool"),
            }
        stats = MaruAdmin(url).stats()
        index = stats["local_index"] or {}
        result["huge"] = [stats["pool"]["huge"], index.get("huge")]
        print(json.dumps(result))
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(10)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
