"""Soak (issue 13): several writers and readers on a pool small enough that eviction never stops,
while the server and the clients are killed (SIGKILL) and paused (SIGSTOP past their timeouts).

    python benchmarks/soak.py                   # 120 s of faults, about 2.5 min in all
    python benchmarks/soak.py --duration 30     # shorter
    python benchmarks/soak.py --writers 4 --readers 3 --pool-size 128M

Prints a table of counts; exits 1 if any read was wrong or any acknowledged key was lost.
`tests/integration/test_soak.py` runs a shorter one (marked `slow`) and asserts both are 0.

Processes (all spawned, each with its own handler and mappings):

- writers store batches of unique keys (16 KiB to 384 KiB values, 64 KiB chunks) as fast as
  they can; writer 0 speaks TCP only (the server cannot watch its process: a pause past
  `--heartbeat-timeout` gets it reaped, its regions held), the others the local socket.
  Together they can hold more than the pool (`--writer-pool` each), so the pool is always
  full: stores go on through `EVICT_FOR`, watermark eviction and orphan reclaim.
- readers look random earlier keys up under a read lease, copy them, confirm the lease
  (`Lookup.release(confirm=True)`) and check the copy against the checksum in the value
  (blake2b of the key and the rest of the value, in its first 16 bytes). A confirmed copy
  that fails the check is a **wrong read** (its differing bytes are the wrong bytes); a copy
  whose lease had ended (the reader was paused, the server restarted) is taken as a miss.
  Two thirds of the reads go the SGLang backends' way instead, through the local index with
  no lease, each hit checked after its copy: a lookup and its copy, or `MaruHandler.read`.
- the durable writer stores small values and pins each acknowledged batch at once; after a
  server restart that followed the acknowledgement it reads every such key back (under a
  lease, checksum checked), and only then unpins it.
- the controller (this process) injects the faults in a fixed cycle, respawns what it
  killed, and pins one key of each writer's latest batch now and then (a sample), read back
  after the next restart, like the durable writer's.
- a writer told to fork (issue 40) forks after a batch, as a worker pool started after the
  backend would: the child's first store through the inherited handler must raise
  `MaruForkedError` (a store that went through would have written as its parent, into the
  chunks the parent takes next, which the readers' checks would catch); then the child
  connects a handler of its own, stores a batch and reads it back.
- another server in turn (`--no-other-server` leaves it out): the server is SIGKILLed, a
  second `maru-server` with its own state dir starts on the same pool file, stores values
  (into the same places) and stops, and the first starts again on its state. It must never
  serve the second one's bytes as its keys': its keys are gone (the pool is not the one its
  state describes, so it starts it fresh) and every read of them is a miss.

**Evicted or lost?** Under constant eviction an acknowledged key that is gone may simply have
been evicted, so loss is measured on keys that cannot be evicted: pinned keys (the server
never evicts nor deletes them, and pins are journaled). An **acknowledged key lost** is a
durable-writer key that was acknowledged but was gone when it was pinned (no server fault in
between, three tries), or a pinned key (durable or sampled) that was missing or wrong when it
was read back after a server SIGKILL + restart, with no server fault during the read. A key
acknowledged before another server took the pool in turn is **dropped**, not lost, when it is
gone afterwards (the pool's bytes are no longer the ones it names); wrong, it is still wrong. The
run ends with one more SIGKILL + restart, after which every pinned key is read back.

A call that fails while the server is down or stopped is not a verdict: every check is
retried until it ran while no server fault was under way (the controller counts them).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import logging
import os
import random
import signal
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from maru import MaruForkedError, MaruHandler

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from conftest import MaruServerProcess  # noqa: E402 - the tests' server wrapper (restartable)
from integration.workers import SPAWN  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
TAG = 16  # blake2b(key + rest) at the front of every value
BATCH = 8  # values per writer batch
DURABLE_BATCH = 4
CHUNK = 64 * KiB
DURABLE_CHUNK = 16 * KiB
MAX_GENERATIONS = 64  # respawns per writer slot (key names carry the generation)
READ_BATCH = 8
HEARTBEAT_S, LEASE_S, REAP_HOLD_S = 2.0, 2.0, 5.0

# board flags (FOREIGN_AT: RESTARTS after the last time another server had the pool;
# FORK: 1 + the writer slot told to fork, 0 none)
STOP, PHASE, SERVER_OK, FAULTS, RESTARTS, FOREIGN_AT, FORK = range(7)
RUN, DURABLE_STOP, VERIFY = range(3)  # durable writer's phases
# per-process counters (one row per writer slot, durable writer, reader slot)
COUNTERS = (
    *("ready", "acked", "failed", "bytes", "reads", "hits", "misses", "unconfirmed"),
    *("wrong", "wrong_bytes", "checked", "lost", "gone_before_pin", "dropped"),
    *("forks", "fork_refused", "fork_wrote", "fork_acked", "fork_failed"),
)
C = {name: i for i, name in enumerate(COUNTERS)}


class Board:
    """What the processes share: plain shared memory without locks (a process killed while
    holding a lock would stop everyone). Each counter row is written by one process at a time."""

    def __init__(self, writers: int, readers: int):
        self.writers, self.readers = writers, readers
        self.flags = SPAWN.RawArray(ctypes.c_int64, 8)
        self.progress = SPAWN.RawArray(ctypes.c_int64, (writers + 1) * MAX_GENERATIONS)
        self.generation = SPAWN.RawArray(ctypes.c_int64, writers + 1)
        self.counts = SPAWN.RawArray(ctypes.c_int64, (writers + 1 + readers) * len(COUNTERS))

    def add(self, row: int, name: str, n: int = 1) -> None:
        self.counts[row * len(COUNTERS) + C[name]] += n

    def get(self, row: int, name: str) -> int:
        return self.counts[row * len(COUNTERS) + C[name]]

    def total(self, name: str) -> int:
        rows = range(len(self.counts) // len(COUNTERS))
        return sum(self.get(r, name) for r in rows)

    @property
    def durable_row(self) -> int:
        return self.writers  # also its progress slot

    def reader_row(self, i: int) -> int:
        return self.writers + 1 + i


# -- values ---------------------------------------------------------------------------------------


def key_of(slot: int, gen: int, i: int) -> str:
    return f"soak/{slot}/{gen}/{i}"


def _seed(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


def size_of(key: str, durable: bool) -> int:
    lo, hi = (1 * KiB, DURABLE_CHUNK) if durable else (16 * KiB, 384 * KiB)
    return lo + _seed(key) % (hi - lo + 1)


def make_value(key: str, durable: bool = False) -> bytes:
    size = size_of(key, durable)
    words = -(-(size - TAG) // 8)
    body = np.arange(words, dtype=np.uint64) * np.uint64(_seed(key) | 1)
    rest = body.tobytes()[: size - TAG]
    return hashlib.blake2b(key.encode() + rest, digest_size=TAG).digest() + rest


def intact(key: str, data: bytes, durable: bool = False) -> bool:
    if len(data) != size_of(key, durable):
        return False
    h = hashlib.blake2b(key.encode(), digest_size=TAG)
    h.update(memoryview(data)[TAG:])
    return h.digest() == data[:TAG]


def wrong_bytes(key: str, data: bytes, durable: bool = False) -> int:
    """Bytes of `data` that differ from the value stored under `key` (a length difference
    counts in full)."""
    want = make_value(key, durable)
    n = min(len(want), len(data))
    a, b = np.frombuffer(want, np.uint8, n), np.frombuffer(data, np.uint8, n)
    return int(np.count_nonzero(a != b)) + abs(len(want) - len(data))


# -- checks that are never fooled by a server fault -----------------------------------------------


def settled(
    board: Board, fn: Callable[[list[str]], list[bool]], keys: list[str], tries: int = 3
) -> list[str]:
    """The keys for which `fn(keys)` (a bool per key) said False in `tries` calls made while no
    server fault was under way; a call during a fault does not count and is made again. A
    verdict needs the server's answer, not a timeout or a refused connection."""
    left, clean = list(keys), 0
    while left and clean < tries:
        while not board.flags[SERVER_OK]:
            time.sleep(0.05)
        before = board.flags[FAULTS]
        results = fn(left)
        if board.flags[FAULTS] == before and board.flags[SERVER_OK]:
            clean += 1
        left = [k for k, ok in zip(left, results) if not ok]
        if left:
            time.sleep(0.05)
    return left


def read_back(h: MaruHandler, keys: list[str], durable: bool) -> tuple[list[bool], dict]:
    """Read `keys` under a lease, confirm it, check every copy. A bool per key (a confirmed,
    intact hit) and, per failed key, "missing", "unconfirmed" or the wrong byte count."""
    lookup = h.lookup(keys, lease=True)
    infos = lookup.infos()
    copies = [None if info is None else bytes(info.view) for info in infos]
    confirmed = lookup.release(confirm=True)
    ok, why = [], {}
    for key, data, info in zip(keys, copies, infos):
        if data is None:
            why[key] = "missing"
        elif not confirmed:
            why[key] = "unconfirmed"
        elif not intact(key, data, durable):
            why[key] = wrong_bytes(key, data, durable)
            _record_wrong(h, key, data, info, durable)
        ok.append(key not in why)
    return ok, why


def split_key(key: str) -> tuple[str, str]:
    """`key` as a prefix and the rest, cut where its CRC says: the SGLang backend passes its
    pool's namespace as `prefix=`, and the local index hashes and compares the two parts
    where they lie, so the soak's local reads cut keys anywhere ("": no prefix)."""
    cut = zlib.crc32(key.encode()) % (len(key) + 1)
    return key[:cut], key[cut:]


def read_copied(h: MaruHandler, keys: list[str], durable: bool) -> tuple[list[bool], dict]:
    """`read_back` as the SGLang backend reads: copy the hits out of the locations a lookup for
    copying gives (on this node the local index answers it, no request and no lease), then
    take as misses what `corrupt()` names after the copy ("unconfirmed"). Each key goes as
    a prefix and the rest (`split_key`)."""
    prefixes, rests = zip(*map(split_key, keys)) if keys else ((), ())
    with h.lookup(list(rests), lease=True, for_copy=True, prefix=list(prefixes)) as found:
        copies = [
            ctypes.string_at(int(a), int(n)) if a else None
            for a, n in zip(found.addresses, found.lengths)
        ]
        changed = found.corrupt().tolist()
        confirmed = found.release(confirm=True)
        infos = found.infos()
    ok, why = [], {}
    for key, data, bad, info in zip(keys, copies, changed, infos):
        if data is None:
            why[key] = "missing"
        elif bad or not confirmed:
            why[key] = "unconfirmed"
        elif not intact(key, data, durable):
            why[key] = wrong_bytes(key, data, durable)
            if info is not None:
                _record_wrong(h, key, data, info, durable)
        ok.append(key not in why)
    return ok, why


def read_into(h: MaruHandler, keys: list[str], durable: bool) -> tuple[list[bool], dict]:
    """`read_back` through `MaruHandler.read` (SGLang's v1 reads: on this node probe, copy and
    check in one C call), key by key (a read takes one length; these values differ), as a
    prefix and the rest (`split_key`): each value into a host buffer of its size; a key not
    proven is "unconfirmed" if its bytes were copied, else "missing"."""
    ok, why = [], {}
    for key in keys:
        size = size_of(key, durable)
        out = np.zeros(size, np.uint8)
        index = h._index
        stale = index.stale if index is not None else 0
        prefix, rest = split_key(key)
        proven = h.read(
            [rest],
            np.array([[out.ctypes.data]], np.int64),
            np.array([size]),
            length=size,
            prefix=prefix,
        )
        if not proven[0]:
            changed = index is not None and index.stale > stale
            why[key] = "unconfirmed" if changed else "missing"
        elif not intact(key, out.tobytes(), durable):
            why[key] = wrong_bytes(key, out.tobytes(), durable)
        ok.append(key not in why)
    return ok, why


def _record_wrong(h: MaruHandler, key: str, data: bytes, info: Any, durable: bool) -> None:
    """One line per wrong read in the soak's directory, for whoever has to find out why:
    the pattern step of the bytes found names the key that wrote them (see `whose`)."""
    words = np.frombuffer(data[TAG : TAG + 16].ljust(16, b"\0"), np.uint64).tolist()
    line = (
        f"{time.time():.3f} pid {os.getpid()} {h.instance_id} read {key}: {len(data)} bytes "
        f"(want {size_of(key, durable)}), region {info.region_id} offset {info.offset}, "
        f"step {words[1] - words[0]:#x} (want {_seed(key) | 1:#x})\n"
    )
    with open(Path(os.environ.get(LOG_DIR, ".")) / "wrong-reads.log", "a") as f:
        f.write(line)


LOG_DIR = "MARU_SOAK_DIR"  # environment: the soak's directory (inherited by its processes)


def dropped(board: Board, restarts: int) -> bool:
    """Whether a key acknowledged after `restarts` server restarts was in the pool before
    another server took it in turn: gone since, it is dropped, not lost."""
    return restarts < board.flags[FOREIGN_AT]


def check_pinned(
    h: MaruHandler, board: Board, row: int, pinned: dict[str, int], durable: bool
) -> None:
    """Read pinned keys back (after a server restart; `pinned`: key -> restarts when it was
    acknowledged): count them, count the missing ones as lost (dropped if another server had
    the pool since) and the wrong ones as wrong reads; then unpin them."""
    keys = list(pinned)
    last: dict = {}

    def attempt(batch: list[str]) -> list[bool]:
        ok, why = read_back(h, batch, durable)
        last.update(why)
        return ok

    for start in range(0, len(keys), 64):
        part = keys[start : start + 64]
        failed = settled(board, attempt, part)
        board.add(row, "checked", len(part))
        for key in failed:
            if isinstance(last[key], int):
                board.add(row, "wrong")
                board.add(row, "wrong_bytes", last[key])
            else:
                board.add(row, "dropped" if dropped(board, pinned[key]) else "lost")
        settled(board, h.batch_unpin, part, tries=1)


# -- worker processes -----------------------------------------------------------------------------


def _connect(url: str, board: Board, **kw: Any) -> MaruHandler | None:
    """A handler, retried while the server is down; None if told to stop first."""
    logging.getLogger("maru").setLevel(logging.ERROR)  # failed calls during faults are expected
    while not board.flags[STOP]:
        h = MaruHandler(server_url=url, timeout_ms=2000, **kw)
        if h.connected:
            return h
        h.close()
        time.sleep(0.2)
    return None


def writer(url: str, slot: int, gen: int, tcp: bool, pool_size: str, board: Board) -> None:
    h = _connect(url, board, pool_size=pool_size, chunk_size_bytes=CHUNK, local_socket=not tcp)
    if h is None:
        return
    board.add(slot, "ready")
    progress = slot * MAX_GENERATIONS + gen
    children: list[int] = []
    i = 0
    while not board.flags[STOP]:
        keys = [key_of(slot, gen, i + j) for j in range(BATCH)]
        values = [make_value(k) for k in keys]
        ok = h.batch_store(keys, values)
        i += BATCH
        board.progress[progress] = i
        acked = sum(ok)
        board.add(slot, "acked", acked)
        board.add(slot, "failed", BATCH - acked)
        board.add(slot, "bytes", sum(len(v) for v, o in zip(values, ok) if o))
        if board.flags[FORK] == slot + 1:
            board.flags[FORK] = 0
            children.append(fork_child(h, url, slot, gen, tcp, board))
        children = [pid for pid in children if not reaped(pid, slot, board)]
    h.close()
    deadline = time.monotonic() + 30
    while children and time.monotonic() < deadline:
        children = [pid for pid in children if not reaped(pid, slot, board)]
        time.sleep(0.05)


FORK_CHILD_S = 30  # a forked child that has not finished by then is killed (SIGALRM): failed


def fork_child(h: MaruHandler, url: str, slot: int, gen: int, tcp: bool, board: Board) -> int:
    """Fork this writer (its handler connected, its heartbeat and copier threads running) as
    a worker pool started after the backend would; the child's pid. The child tries the
    inherited handler once (it must refuse: `MaruForkedError`), closes it (which must send
    nothing: the parent's instance goes on), then stores a batch with a handler of its own
    and reads it back. It exits 0 unless something in it raised."""
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        signal.alarm(FORK_CHILD_S)
        board.add(slot, "forks")
        keys = [f"soak/fork/{slot}/{gen}/{os.getpid()}/{j}" for j in range(BATCH)]
        values = [make_value(k) for k in keys]
        try:
            wrote = sum(h.batch_store(keys, values))
        except MaruForkedError:
            board.add(slot, "fork_refused")
        else:
            board.add(slot, "fork_wrote", max(wrote, 1))
        h.close()
        own = _connect(url, board, pool_size="8M", chunk_size_bytes=CHUNK, local_socket=not tcp)
        if own is not None:
            acked = [k for k, o in zip(keys, own.batch_store(keys, values)) if o]
            board.add(slot, "fork_acked", len(acked))
            _, why = read_back(own, acked, durable=False)
            for reason in why.values():
                if isinstance(reason, int):
                    board.add(slot, "wrong")
                    board.add(slot, "wrong_bytes", reason)
            own.close()
        code = 0
    finally:
        os._exit(code)


def reaped(pid: int, slot: int, board: Board) -> bool:
    """Whether forked child `pid` has exited (counted in `fork_failed` unless it exited 0)."""
    done, status = os.waitpid(pid, os.WNOHANG)
    if done and os.waitstatus_to_exitcode(status) != 0:
        board.add(slot, "fork_failed")
    return bool(done)


def reader(url: str, index: int, seed: int, board: Board) -> None:
    h = _connect(url, board, pool_size="2M", chunk_size_bytes=CHUNK)
    if h is None:
        return
    row = board.reader_row(index)
    board.add(row, "ready")
    rng = random.Random(seed)
    while not board.flags[STOP]:
        slot = rng.randrange(board.writers + 1)
        gen = board.generation[slot]
        if rng.random() < 0.5:  # anywhere in the past: mostly evicted
            gen = rng.randint(0, gen)
        n = board.progress[slot * MAX_GENERATIONS + gen]
        if n == 0:
            time.sleep(0.01)
            continue
        recent = gen == board.generation[slot]  # the latest keys: mostly still there
        first = rng.randrange(max(0, n - 64) if recent else 0, n)
        durable = slot == board.durable_row
        keys = [key_of(slot, gen, i) for i in range(first, min(n, first + READ_BATCH))]
        # two thirds of the reads as the SGLang backends read (the local index, validated
        # after the copy: a lookup and its copy, or `MaruHandler.read`), a third under a lease
        ok, why = rng.choice((read_copied, read_into, read_back))(h, keys, durable)
        board.add(row, "reads", len(keys))
        board.add(row, "hits", sum(ok))
        for reason in why.values():
            if reason == "missing":
                board.add(row, "misses")
            elif reason == "unconfirmed":
                board.add(row, "unconfirmed")
            else:
                board.add(row, "wrong")
                board.add(row, "wrong_bytes", reason)
    h.close()


def durable_writer(url: str, interval: float, board: Board) -> None:
    """Store small batches, pin each acknowledged batch at once, read them back once a server
    restart followed their acknowledgement, then unpin them (see the module docstring)."""
    row = board.durable_row
    h = _connect(url, board, pool_size="32M", chunk_size_bytes=DURABLE_CHUNK)
    if h is None:
        return
    board.add(row, "ready")
    pinned: dict[str, int] = {}  # key -> restarts completed when it was acknowledged
    i = 0
    while board.flags[PHASE] == RUN:
        keys = [key_of(row, 0, i + j) for j in range(DURABLE_BATCH)]
        ok = h.batch_store(keys, [make_value(k, durable=True) for k in keys])
        restarts = board.flags[RESTARTS]  # read after the reply: only later restarts count
        i += DURABLE_BATCH
        board.progress[row * MAX_GENERATIONS] = i
        acked = [k for k, o in zip(keys, ok) if o]
        board.add(row, "acked", len(acked))
        board.add(row, "failed", len(keys) - len(acked))
        gone = set(settled(board, h.batch_pin, acked))
        board.add(row, "gone_before_pin", len(gone))
        board.add(row, "dropped" if dropped(board, restarts) else "lost", len(gone))
        pinned.update((k, restarts) for k in acked if k not in gone)
        due = {k: r for k, r in pinned.items() if r < board.flags[RESTARTS]}
        if due and board.flags[SERVER_OK]:
            check_pinned(h, board, row, due, durable=True)
            for k in due:
                del pinned[k]
        time.sleep(interval)
    board.add(row, "ready")  # stopped writing: the controller restarts the server once more
    while board.flags[PHASE] != VERIFY:
        time.sleep(0.05)
    check_pinned(h, board, row, pinned, durable=True)
    board.add(row, "ready")
    h.close()


# -- the controller ------------------------------------------------------------------------------

CYCLE = (
    "server_kill",
    "writer_kill",
    "writer_fork",
    "writer_stop",
    "reader_kill",
    "server_kill",
    "reader_stop",
    "server_stop",
    "writer_kill",
)
# Another server taking the pool in turn (left out with `--no-other-server`)
WITH_OTHER_SERVER = (*CYCLE[:8], "foreign_server", *CYCLE[8:])
FAULT_NAMES = {
    "server_kill": "server SIGKILL + restart",
    "server_stop": f"server SIGSTOP {HEARTBEAT_S * 1.5:g} s (> heartbeat timeout), SIGCONT",
    "writer_kill": "writer SIGKILL (then a new one)",
    "writer_stop": f"writer SIGSTOP {HEARTBEAT_S * 2:g} s (> heartbeat timeout), SIGCONT",
    "reader_kill": "reader SIGKILL (then a new one)",
    "reader_stop": f"reader SIGSTOP {LEASE_S * 1.5:g} s (> lease timeout), SIGCONT",
    "writer_fork": "writer forks (the child tries its parent's handler, then its own)",
    "foreign_server": "server SIGKILL, another server (own state dir) on the pool, restart",
}
FOREIGN_VALUES, FOREIGN_SIZE = 64, 256 * KiB  # what the other server stores


class Soak:
    def __init__(
        self,
        workdir: Path,
        duration: float,
        writers: int,
        readers: int,
        pool_size: str,
        writer_pool: str,
        fault_every: float,
        seed: int,
        other_server: bool = True,
    ):
        self.duration, self.fault_every = duration, fault_every
        self.cycle = WITH_OTHER_SERVER if other_server else CYCLE
        self.workdir = workdir
        os.environ[LOG_DIR] = str(workdir)  # before any process is spawned
        self.writer_pool = writer_pool
        self.rng = random.Random(seed)
        self.board = Board(writers, readers)
        self.server = MaruServerProcess(
            workdir,
            pool_size=pool_size,
            extra_args=[
                *("--heartbeat-timeout", str(HEARTBEAT_S), "--lease-timeout", str(LEASE_S)),
                *("--reap-hold", str(REAP_HOLD_S), "--snapshot-mb", "1"),
            ],
        )
        self.procs: dict[tuple[str, int], Any] = {}  # (role, index) -> process
        self.stopped: dict[tuple[str, int], float] = {}  # paused -> when to SIGCONT
        self.faults = dict.fromkeys(dict.fromkeys(self.cycle), 0)
        self.crashed: list[str] = []
        self.samples: dict[str, int] = {}  # controller-pinned keys -> restarts when pinned
        self.evictions = 0  # summed over the server's lives, as last seen before each kill
        self.last_stats: dict = {}
        self.h: MaruHandler | None = None

    # -- processes --

    def spawn(self, role: str, index: int) -> None:
        b = self.board
        if role == "writer":
            gen = b.generation[index]
            args = (self.server.url, index, gen, index == 0, self.writer_pool, b)
            target: Callable = writer
        elif role == "reader":
            args, target = (self.server.url, index, self.rng.randrange(1 << 30), b), reader
        else:
            args, target = (self.server.url, 0.1, b), durable_writer
        p = SPAWN.Process(target=target, args=args, daemon=True, name=f"soak-{role}-{index}")
        p.start()
        self.procs[(role, index)] = p

    def kill(self, who: tuple[str, int]) -> None:
        p = self.procs[who]
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
        self.next_generation(who)
        self.spawn(*who)

    def next_generation(self, who: tuple[str, int]) -> None:
        """A new writer writes new keys (the old one's last batch may be half done)."""
        gens = self.board.generation
        if who[0] == "writer" and gens[who[1]] < MAX_GENERATIONS - 1:
            gens[who[1]] += 1

    def check_processes(self) -> None:
        for who, p in list(self.procs.items()):
            if not p.is_alive():
                self.crashed.append(f"{who[0]} {who[1]} exited with {p.exitcode}")
                self.next_generation(who)
                self.spawn(*who)

    def victim(self, role: str) -> tuple[str, int] | None:
        choices = [
            w
            for w in self.procs
            if w[0] == role
            and w not in self.stopped
            and (role != "writer" or self.board.generation[w[1]] < MAX_GENERATIONS - 2)
        ]
        return self.rng.choice(choices) if choices else None

    # -- the server --

    def server_fault(self, begin: bool) -> None:
        self.board.flags[SERVER_OK] = 0 if begin else 1
        self.board.flags[FAULTS] += 1

    def note_stats(self) -> None:
        try:
            assert self.h is not None
            self.last_stats = self.h.stats()
        except Exception:  # a failed call during the run is no verdict: stats are a figure
            pass

    def kill_server(self, meanwhile: Callable[[], None] | None = None) -> None:
        """SIGKILL the server and start it again on its state; `meanwhile` runs while it is
        down (another server taking the pool in turn: keys from before count as dropped)."""
        self.note_stats()
        self.evictions += self.last_stats.get("counters", {}).get("evictions", 0)
        self.last_stats = {}
        self.server_fault(True)
        self.server.proc.kill()
        self.server.proc.wait(10)
        if meanwhile is not None:
            meanwhile()
        self.server.restart()
        self.note("  server restarted")
        self.board.flags[RESTARTS] += 1
        if meanwhile is not None:
            self.board.flags[FOREIGN_AT] = self.board.flags[RESTARTS]
        self.server_fault(False)

    def other_server(self) -> None:
        """Another `maru-server`, with a state dir of its own, on the same pool file: it
        stores values (over the places the first one's keys point to) and stops."""
        n = self.faults["foreign_server"]
        other = MaruServerProcess(
            self.workdir / f"other-server-{n}",
            pool_size=self.server.pool_size,
            pool=self.server.pool_path,
        )
        other.start()
        try:
            with MaruHandler(
                server_url=other.url, pool_size=self.writer_pool, chunk_size_bytes=CHUNK
            ) as h:
                keys = [f"other/{n}/{i}" for i in range(FOREIGN_VALUES)]
                stored = h.batch_store(keys, [bytes([n % 251 + 1]) * FOREIGN_SIZE] * len(keys))
                self.note(f"  the other server stored {sum(stored)} values")
        finally:
            other.halt()

    def stop_server(self, seconds: float) -> None:
        self.server_fault(True)
        os.kill(self.server.pid, signal.SIGSTOP)
        time.sleep(seconds)
        os.kill(self.server.pid, signal.SIGCONT)
        self.server_fault(False)

    # -- faults --

    def note(self, what: str) -> None:
        with open(self.workdir / "faults.log", "a") as f:
            f.write(f"{time.time():.3f} {what}\n")

    def inject(self, fault: str) -> None:
        self.note(fault)
        if fault == "server_kill":
            self.kill_server()
        elif fault == "server_stop":
            self.stop_server(HEARTBEAT_S * 1.5)
        elif fault == "foreign_server":
            self.kill_server(meanwhile=self.other_server)
        elif fault == "writer_fork":
            who = self.victim("writer")
            if who is None:
                return
            self.note(f"  {who} pid {self.procs[who].pid}")
            self.board.flags[FORK] = who[1] + 1
        else:
            role, what = fault.split("_")
            who = self.victim(role)
            if who is None:
                return
            self.note(f"  {who} pid {self.procs[who].pid}")
            if what == "kill":
                self.kill(who)
            else:
                os.kill(self.procs[who].pid, signal.SIGSTOP)
                pause = HEARTBEAT_S * 2 if role == "writer" else LEASE_S * 1.5
                self.stopped[who] = time.monotonic() + pause
        self.faults[fault] += 1

    def resume_due(self, everyone: bool = False) -> None:
        now = time.monotonic()
        for who, until in list(self.stopped.items()):
            if everyone or now >= until:
                os.kill(self.procs[who].pid, signal.SIGCONT)
                del self.stopped[who]
                self.note(f"SIGCONT {who}")

    # -- the controller's sample of pinned keys --

    def sample(self) -> None:
        """Pin the first key of each writer's latest batch (if it is still there)."""
        b = self.board
        keys = []
        for slot in range(b.writers):
            gen = b.generation[slot]
            n = b.progress[slot * MAX_GENERATIONS + gen]
            if n >= BATCH:
                keys.append(key_of(slot, gen, n - BATCH))
        keys = [k for k in keys if k not in self.samples]
        assert self.h is not None
        for key, ok in zip(keys, self.h.batch_pin(keys)):
            if ok:
                self.samples[key] = b.flags[RESTARTS]

    def check_samples(self, everything: bool = False) -> None:
        restarts = self.board.flags[RESTARTS]
        due = {k: r for k, r in self.samples.items() if everything or r < restarts}
        assert self.h is not None
        check_pinned(self.h, self.board, self.board.durable_row, due, durable=False)
        for key in due:
            del self.samples[key]

    # -- the run --

    def run(self) -> dict[str, Any]:
        b = self.board
        self.server.start()
        b.flags[SERVER_OK] = 1
        try:
            self.h = MaruHandler(server_url=self.server.url, pool_size="2M", timeout_ms=5000)
            self.spawn("durable", 0)
            for i in range(b.writers):
                self.spawn("writer", i)
            for i in range(b.readers):
                self.spawn("reader", i)
            deadline = time.monotonic() + 120
            while b.total("ready") < b.writers + b.readers + 1:
                if time.monotonic() > deadline:
                    raise RuntimeError("the soak's processes did not start within 120 s")
                self.check_processes()
                time.sleep(0.1)
            started = time.monotonic()
            next_fault, next_sample, turn = started + self.fault_every, started, 0
            while time.monotonic() < started + self.duration:
                self.resume_due()
                self.check_processes()
                now = time.monotonic()
                if now >= next_sample:
                    self.sample()
                    self.check_samples()
                    self.note_stats()
                    next_sample = now + 1.0
                if now >= next_fault:
                    self.inject(self.cycle[turn % len(self.cycle)])
                    turn += 1
                    next_fault = time.monotonic() + self.fault_every
                time.sleep(0.05)
            ran = time.monotonic() - started
            self.finish()
            return self.result(ran)
        finally:
            self.resume_due(everyone=True)
            for p in self.procs.values():
                if p.is_alive():
                    p.kill()
                p.join(5)
            if self.h is not None:
                self.h.close()
            self.server.stop()

    def finish(self) -> None:
        """Stop the writers and readers, one more server SIGKILL + restart, then every pinned
        key is read back."""
        b = self.board
        b.flags[STOP] = 1
        self.resume_due(everyone=True)
        for who, p in self.procs.items():
            if who[0] != "durable":
                p.join(30)
                if p.is_alive():
                    self.crashed.append(f"{who[0]} {who[1]} did not stop")
        row = b.durable_row
        b.flags[PHASE] = DURABLE_STOP
        deadline = time.monotonic() + 60
        while b.get(row, "ready") < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        self.kill_server()
        self.faults["server_kill"] += 1
        b.flags[PHASE] = VERIFY
        self.check_samples(everything=True)
        durable = self.procs[("durable", 0)]
        durable.join(120)
        if b.get(row, "ready") < 3:
            self.crashed.append("the durable writer did not finish its check")
        self.note_stats()
        self.evictions += self.last_stats.get("counters", {}).get("evictions", 0)

    def result(self, ran: float) -> dict[str, Any]:
        b = self.board
        r: dict[str, Any] = {name: b.total(name) for name in COUNTERS if name != "ready"}
        r["durable_acked"] = b.get(b.durable_row, "acked")
        r["acked"] -= r["durable_acked"]
        r["evictions"] = self.evictions
        r["pool_bytes"] = self.server_pool_bytes()
        r["faults"] = dict(self.faults)
        r["crashed"] = list(self.crashed)
        r["seconds"] = round(ran, 1)
        r["writers"], r["readers"] = b.writers, b.readers
        return r

    def server_pool_bytes(self) -> int:
        return int(self.last_stats.get("pool", {}).get("capacity", 0))


def run_soak(
    workdir: str | Path | None = None,
    duration: float = 120.0,
    writers: int = 3,
    readers: int = 2,
    pool_size: str = "96M",
    writer_pool: str = "48M",
    fault_every: float = 1.5,
    seed: int = 0,
    other_server: bool = True,
) -> dict[str, Any]:
    """Run the soak; returns its counts (see `table`)."""
    workdir = Path(workdir or tempfile.mkdtemp(prefix="maru-soak-"))
    soak = Soak(
        workdir, duration, writers, readers, pool_size, writer_pool, fault_every, seed, other_server
    )
    return soak.run()


def table(r: dict[str, Any]) -> str:
    pool = r["pool_bytes"] or 1
    rows: list[tuple[str, Any]] = [
        ("stores acknowledged (writers)", f"{r['acked']:,} ({r['bytes'] / pool:.1f}x the pool)"),
        ("stores not acknowledged (server down or stopped)", f"{r['failed']:,}"),
        ("durable-writer stores acknowledged (pinned)", f"{r['durable_acked']:,}"),
        ("evictions (at least)", f"{r['evictions']:,}"),
        ("keys read (leased, confirmed, checked)", f"{r['reads']:,}"),
        ("hits", f"{r['hits']:,}"),
        ("misses", f"{r['misses']:,}"),
        ("reads whose lease had ended (taken as misses)", f"{r['unconfirmed']:,}"),
        ("**wrong reads / wrong bytes**", f"**{r['wrong']} / {r['wrong_bytes']}**"),
        ("pinned keys read back after a server restart", f"{r['checked']:,}"),
        ("of them acknowledged, gone before their pin", f"{r['gone_before_pin']}"),
        ("**acknowledged keys lost**", f"**{r['lost']}**"),
        ("pinned keys dropped (another server had the pool since)", f"{r['dropped']:,}"),
        ("forked children (refused their parent's handler)", f"{r['forks']} ({r['fork_refused']})"),
        (
            "**forked children's stores as their parent / children failed**",
            f"**{r['fork_wrote']} / {r['fork_failed']}**",
        ),
        ("forked children's stores with their own handler", f"{r['fork_acked']}"),
    ]
    rows += [(FAULT_NAMES[f], n) for f, n in r["faults"].items()]
    rows.append(("workers that failed", len(r["crashed"])))
    head = (
        f"soak: {r['seconds']} s of faults, pool {pool / MiB:.0f} MiB, {r['writers']} writers "
        f"(1 on TCP), {r['readers']} readers, 1 durable writer\n\n| count | |\n|---|---|\n"
    )
    lines = [f"| {name} | {value} |" for name, value in rows]
    tail = "".join(f"\n{c}" for c in r["crashed"])
    return head + "\n".join(lines) + tail


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=120.0, help="seconds of faults")
    p.add_argument("--writers", type=int, default=3)
    p.add_argument("--readers", type=int, default=2)
    p.add_argument("--pool-size", default="96M")
    p.add_argument("--writer-pool", default="48M", help="pool_size of each writer")
    p.add_argument("--fault-every", type=float, default=1.5, help="seconds between faults")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--no-other-server",
        dest="other_server",
        action="store_false",
        help="leave out another server taking the pool in turn",
    )
    p.add_argument("--workdir", help="server state and log (default: a new temp dir)")
    a = p.parse_args(argv)
    r = run_soak(
        a.workdir,
        a.duration,
        a.writers,
        a.readers,
        a.pool_size,
        a.writer_pool,
        a.fault_every,
        a.seed,
        a.other_server,
    )
    print(table(r))
    failed = r["wrong"] or r["lost"] or r["fork_wrote"] or r["fork_failed"] or r["crashed"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
