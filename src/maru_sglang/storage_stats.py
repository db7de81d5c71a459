"""`MaruStorage`'s statistics: cumulative counters per pool, and SGLang's `StorageMetrics`
(drained on each `get_stats()`). SGLang's backup and prefetch threads call the storage at once:
a data call only appends its record to a deque (`calls`: no lock on the data path); the
records are folded in under one lock when read or when `FOLD_EVERY` wait. A record keeps a
`Tally` per batch, not the batch (see `Tally`).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from maru_sglang.pools import Batch, PoolIO

# Counted per pool (the seconds per call: one call serves several pools).
COUNTERS = (
    "hits",
    "misses",
    "bytes_read",
    "bytes_written",
    "pages_written",
    # hits taken as misses: bytes unlike their checksum, or a local entry changed in the copy
    "checksum_mismatches",
    # pages a write reported stored whose registration then failed (write-behind): misses
    "late_write_failures",
)


FOLD_EVERY = 256


class Tally(NamedTuple):
    """What a call's record keeps of one pool's share (`Batch`, its results filled in): the
    pool, its pages, and those that moved (a read's hits, a write's pages stored). Not the
    batch itself: a record waits up to FOLD_EVERY calls, and a batch holds its caller's keys,
    its host pointers and its results. Kept, each call's batches grew Python's heap into memory
    never touched (page faults in the calling thread, every call) until a fold freed them."""

    pool: PoolIO
    pages: int
    moved: int

    @classmethod
    def of(cls, batch: Batch) -> Tally:
        return cls(batch.pool, len(batch.keys), batch.results.count(True))


class StorageStats:
    """The counters of one `MaruStorage`; `enable_metrics` (SGLang's
    `enable_storage_metrics`) also keeps the per-call samples of `StorageMetrics`."""

    def __init__(self, enable_metrics: bool) -> None:
        self.enable_metrics = enable_metrics
        self._lock = threading.Lock()
        # (a `Tally` per batch, the call's seconds, whether it read: `record`)
        self.calls: deque[tuple[list[Tally], float, bool]] = deque()
        self._pools: dict[str, dict[str, int]] = {}
        self._seconds = {"get_seconds": 0.0, "set_seconds": 0.0}
        self._reset_metrics()

    def _pool(self, pool: str) -> dict[str, int]:
        """`pool`'s counters, created at first use (the caller holds the lock)."""
        return self._pools.setdefault(pool, dict.fromkeys(COUNTERS, 0))

    def count(self, pool: str, **deltas: int) -> None:
        """Add `deltas` (names of `COUNTERS`) to `pool`'s counters."""
        with self._lock:
            counters = self._pool(pool)
            for name, delta in deltas.items():
                counters[name] += delta

    def record(self, batches: Sequence[Batch], elapsed: float, reading: bool) -> None:
        """One data call of `batches` (their `results` filled in) that took `elapsed` s: its
        record appended (no lock), and every record folded in if FOLD_EVERY wait."""
        calls = self.calls
        calls.append(([Tally.of(batch) for batch in batches], elapsed, reading))
        if len(calls) >= FOLD_EVERY:
            self.fold()

    def fold(self) -> None:
        """Account every call record waiting in `calls`."""
        calls = self.calls
        with self._lock:
            while calls:
                self._account(*calls.popleft())

    def _account(self, tallies: list[Tally], elapsed: float, reading: bool) -> None:
        """Count one call's record (the caller holds the lock)."""
        moved = in_call = 0
        for pool, n, ok in tallies:
            nbytes = ok * pool.page_bytes
            counters = self._pool(pool.name)
            in_call += n
            if reading:
                counters["hits"] += ok
                counters["misses"] += n - ok
                counters["bytes_read"] += nbytes
            else:
                counters["pages_written"] += ok
                counters["bytes_written"] += nbytes
            moved += nbytes
        self._seconds["get_seconds" if reading else "set_seconds"] += elapsed
        if self.enable_metrics:
            if reading:
                pages, rates = self._prefetch_pgs, self._prefetch_bw
            else:
                pages, rates = self._backup_pgs, self._backup_bw
            pages.append(in_call)
            rates.append(moved / max(elapsed, 1e-9) / 1e9)

    def _reset_metrics(self) -> None:
        self._prefetch_pgs: list[int] = []
        self._backup_pgs: list[int] = []
        self._prefetch_bw: list[float] = []
        self._backup_bw: list[float] = []

    @property
    def counters(self) -> dict[str, Any]:
        """Cumulative counters over every pool, and per pool under `pools`."""
        self.fold()
        with self._lock:
            pools = {name: dict(c) for name, c in self._pools.items()}
            seconds = dict(self._seconds)
        totals = {key: sum(c[key] for c in pools.values()) for key in COUNTERS}
        return {**totals, **seconds, "pools": pools}

    def get_stats(self) -> Any:
        """SGLang's StorageMetrics with the counters attached as `.maru`; the counters alone
        (a dict) where this SGLang has no StorageMetrics."""
        counters = self.counters
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except ImportError:  # another SGLang moved it
            return counters
        with self._lock:
            metrics = StorageMetrics()
            metrics.prefetch_pgs.extend(self._prefetch_pgs)
            metrics.backup_pgs.extend(self._backup_pgs)
            metrics.prefetch_bandwidth.extend(self._prefetch_bw)
            metrics.backup_bandwidth.extend(self._backup_bw)
            self._reset_metrics()
        metrics.maru = counters
        return metrics
