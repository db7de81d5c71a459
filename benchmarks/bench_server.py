"""Server benchmark: what one request of a 128-key batch costs `maru-server`, in process.

    .venv/bin/python benchmarks/bench_server.py            # ~30 s
    .venv/bin/python benchmarks/bench_server.py --quick    # a few seconds
    .venv/bin/python benchmarks/bench_server.py --batch 256  # keys per request

The server is one thread that serves every instance of a node: its cost per request bounds the
registrations a node makes per second, and on a small machine it takes CPU from the clients'
copies. Two `MaruService`s built as `maru-server` builds them (the registry, a journal in a
temporary state directory, the local index published) answer frames through `handle_frame`,
as the server's loop does, without a socket:

- `register` / `delete`: REGISTER_KV of 128 new 64 KiB pages (SGLang's batch, keys as long as
  its page hashes), then DELETE_KV of them;
- `register, full pool`: REGISTER_KV into a pool held past its high watermark, so that every
  few requests an eviction round (the CLOCK walk, the journal, the local index, the owners'
  notices) runs inside the request: a cache's usual state;
- `register, fresh server`: the first REGISTER_KV a server answers (a new pool, journal and
  local index, one every tenth round): what a server pays cold;
- `wire`: the baseline, in the same run: decoding each kind's request frame and encoding a
  reply of its form (msgpack: what any server of this protocol pays).

Requests of the kinds alternate. Prints median and mean microseconds per request and per key,
and each kind's ratio to the wire. Compare builds by running it under each one's PYTHONPATH.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from maru.client.poolpath import prove
from maru.common import protocol
from maru.common.protocol import MsgType
from maru.server import persistence
from maru.server.journal import Journal
from maru.server.localindex import open_local_index
from maru.server.pool import ShmPool
from maru.server.registry import Registry
from maru.server.service import MaruService
from maru.server.token import TokenSigner

KiB, MiB = 1 << 10, 1 << 20
PAGE = 64 * KiB
BATCH = 128


class Server:
    """A `MaruService` with a journal and the local index, and one instance of its own, with
    one region of `region_bytes` (half the pool unless given)."""

    def __init__(self, work: Path, pool_bytes: int, region_bytes: int = 0):
        self.journal = Journal(work / "state", fsync_interval=0.1)
        self.pool = ShmPool(str(work / "pool"), pool_bytes)
        self.registry = Registry(self.pool, TokenSigner(os.urandom(32)), journal=self.journal)
        snapshot, records = self.journal.load()
        persistence.restore(self.registry, snapshot, records)
        self.journal.write_snapshot(persistence.snapshot(self.registry))
        open_local_index(self.pool, self.registry)
        self.service = MaruService(
            self.registry, "tcp://127.0.0.1:0", journal=self.journal, local_socket="none"
        )
        self.session = ""
        reply = self.call(MsgType.HANDSHAKE, {"name": "bench", "pid": os.getpid()})
        self.session = reply["session"]
        proof = prove(reply["pool"], None, reply["iid"]).proof  # (as a client proves the pool)
        ask = {"size": region_bytes or pool_bytes // 2, "pool_proof": proof}
        region = self.call(MsgType.REQUEST_REGION, ask)["region"]
        self.region_id, self.region_bytes = region[0], region[3]
        self.next_page = 0

    def frame(self, msg_type: int, body: dict[str, Any]) -> bytes:
        return protocol.encode(msg_type, 1, {**body, "session": self.session})

    def call(self, msg_type: int, body: dict[str, Any]) -> dict[str, Any]:
        _, reply = protocol.decode(self.service.handle_frame(self.frame(msg_type, body)))
        if not reply.get("ok"):
            raise RuntimeError(f"{MsgType(msg_type).name}: {reply}")
        return reply

    def register_frame(self, keys: list[str]) -> bytes:
        """REGISTER_KV of `keys` at the next pages of the region, round robin."""
        pages = self.region_bytes // PAGE
        first = self.next_page % (pages - len(keys))
        self.next_page = first + len(keys)
        body = {
            "keys": keys,
            "region_ids": protocol.pack_int64([self.region_id] * len(keys)),
            "offsets": protocol.pack_int64([(first + i) * PAGE for i in range(len(keys))]),
            "lengths": protocol.pack_int64([PAGE] * len(keys)),
        }
        return self.frame(MsgType.REGISTER_KV, body)

    def close(self) -> None:
        self.service.close()
        if self.registry.local_index is not None:
            self.registry.local_index.close()
        self.journal.close()
        self.pool.close()


def batch_keys(tag: str, n: int) -> list[str]:
    """SGLang's page keys: a namespace and a hex SHA-256."""
    return [f"ns:{hashlib.sha256(f'{tag}/{i}'.encode()).hexdigest()}" for i in range(n)]


def timed(service: MaruService, frame: bytes) -> tuple[float, float, bytes]:
    """(wall seconds, this thread's CPU seconds, the reply): the CPU time is what a loaded
    machine's preemption does not inflate."""
    t0, c0 = time.perf_counter(), time.thread_time()
    out = service.handle_frame(frame)
    return time.perf_counter() - t0, time.thread_time() - c0, out


def wire_cost(frame: bytes, reply: bytes) -> float:
    """Decoding `frame` and encoding `reply` again: the msgpack any server pays."""
    t0 = time.perf_counter()
    protocol.decode(frame)
    header, body = protocol.decode(reply)
    protocol.encode(header.msg_type, header.request_id, body, reply=True)
    return time.perf_counter() - t0


def fresh_register(work: Path, batch: int) -> tuple[float, float]:
    """The first REGISTER_KV of `batch` keys a new server answers: (wall, CPU) seconds."""
    server = Server(work, 1 << 30)
    try:
        frame = server.register_frame(batch_keys(f"c{work.name}", batch))
        took, cpu, _ = timed(server.service, frame)
    finally:
        server.close()
        shutil.rmtree(work, ignore_errors=True)
    return took, cpu


def run(
    rounds: int,
    work: Path,
    batch: int = BATCH,
    fresh: bool = False,
    cpu: dict[str, list[float]] | None = None,
) -> dict[str, list[float]]:
    """Samples per kind; with `fresh`, `register, fresh server` every tenth round too; `cpu`
    (when given) gets the server thread's CPU time of each request kind's samples."""
    plain = Server(work / "plain", 1 << 30)
    # a pool of 24 batches' worth of pages, all of it the instance's region (a region's keys
    # hold no more bytes than it has): past the high watermark after about 23 requests
    full = Server(work / "full", 24 * batch * PAGE, region_bytes=24 * batch * PAGE)
    kinds = ["register", "delete", "register, full pool", "wire: register", "wire: delete"]
    if fresh:
        kinds.insert(3, "register, fresh server")
    times: dict[str, list[float]] = {k: [] for k in kinds}
    try:
        for r in range(-rounds // 10, rounds):  # the first tenth warms up
            keys = batch_keys(f"p{r}", batch)
            reg = plain.register_frame(keys)
            took_reg, cpu_reg, reply = timed(plain.service, reg)
            wire_reg = wire_cost(reg, reply)
            dele = plain.frame(MsgType.DELETE_KV, {"keys": keys})
            took_del, cpu_del, reply = timed(plain.service, dele)
            wire_del = wire_cost(dele, reply)
            frame = full.register_frame(batch_keys(f"f{r}", batch))
            took_full, cpu_full, _ = timed(full.service, frame)
            samples = {
                "register": (took_reg, cpu_reg),
                "delete": (took_del, cpu_del),
                "register, full pool": (took_full, cpu_full),
                "wire: register": (wire_reg, None),
                "wire: delete": (wire_del, None),
            }
            if fresh and r >= 0 and r % 10 == 0:
                samples["register, fresh server"] = fresh_register(work / f"c{r}", batch)
            if r < 0:
                continue
            for kind, (took, cpu_took) in samples.items():
                times[kind].append(took)
                if cpu is not None and cpu_took is not None:
                    cpu.setdefault(kind, []).append(cpu_took)
        evicted = full.registry.counters["evictions"]
        if not evicted:
            raise RuntimeError("the full pool never evicted: the benchmark measured nothing")
        times["_evictions_per_request"] = [evicted / (rounds + rounds // 10) / batch]
    finally:
        plain.close()
        full.close()
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a few seconds: fewer requests")
    ap.add_argument("--rounds", type=int, default=0, help="requests of each kind")
    ap.add_argument("--state-dir", default="", help="where the journals go (default /dev/shm)")
    ap.add_argument("--batch", type=int, default=BATCH, help=f"keys per request ({BATCH})")
    args = ap.parse_args()
    rounds = args.rounds or (300 if args.quick else 3000)
    base = args.state_dir or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
    work = Path(tempfile.mkdtemp(prefix="maru-bench-server-", dir=base))
    cpu: dict[str, list[float]] = {}
    try:
        times = run(rounds, work, args.batch, fresh=True, cpu=cpu)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    per_evict = times.pop("_evictions_per_request")[0]
    wire = {
        "register": statistics.median(times["wire: register"]),
        "delete": statistics.median(times["wire: delete"]),
    }
    batch = args.batch
    print(f"maru-server in process, {batch}-key batches of 64 KiB pages, {rounds} requests each")
    print(f"({platform.processor() or platform.machine()}, Python {platform.python_version()})")
    print()
    print(
        f"| {'request':22} | {'median us':>9} | {'mean us':>8} | {'us/key':>6} | {'/wire':>5} "
        f"| {'cpu p10 us/key':>14} |"
    )
    print(f"|{'-' * 24}|{'-' * 10}:|{'-' * 9}:|{'-' * 7}:|{'-' * 6}:|{'-' * 15}:|")
    for name, samples in times.items():
        med, mean = statistics.median(samples), statistics.mean(samples)
        kind = "delete" if "delete" in name else "register"
        ratio = "" if name.startswith("wire") else f"{med / wire[kind]:5.1f}"
        cpu_p10 = ""
        if name in cpu:
            cpu_p10 = f"{sorted(cpu[name])[len(cpu[name]) // 10] * 1e6 / batch:.3f}"
        print(
            f"| {name:22} | {med * 1e6:9.1f} | {mean * 1e6:8.1f} | {med * 1e6 / batch:6.2f} "
            f"| {ratio:>5} | {cpu_p10:>14} |"
        )
    print()
    print(
        f"full pool: {per_evict:.2f} keys evicted per key registered; its mean counts the "
        "requests that ran an eviction round. /wire: median over the wire's median. cpu p10: "
        "the server thread's CPU time (time.thread_time), 10th percentile: on a loaded machine "
        "the figure to compare builds by."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
