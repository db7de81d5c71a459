"""What the server does between requests, on its one thread: expire read leases, end region
holds, reap instances, check the pool file, snapshot the journal, freeze the heap."""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from maru.common.throttle import Throttle
from maru.server import persistence
from maru.server.journal import Journal
from maru.server.registry import Registry

log = logging.getLogger("maru.server.service")

SNAPSHOT_RETRY_S = 1.0  # while a snapshot is needed and failing, try again this often
# after background writes failed in a row: SNAPSHOT_RETRY_S doubled per failure, up to this
# (each try packs the registry on the loop and starts one more journal of the chain)
SNAPSHOT_BACKGROUND_RETRY_MAX_S = 60.0


def freeze_heap(full: bool = False) -> None:
    """Collect the young generations (all with `full`), then `gc.freeze` every tracked object
    so that no collection walks the registry (docs/operations.md, "Memory and the garbage
    collector"). Frozen cycles are never collected: the registry makes none, and the collection
    before each freeze takes the rest."""
    gc.collect() if full else gc.collect(1)
    gc.freeze()


@dataclass
class Housekeeping:
    """The between-requests work of one `MaruService` (`run`)."""

    registry: Registry
    journal: Journal | None
    heartbeat_timeout: float
    gc_freeze: bool
    on_pool_lost: Callable[[str], None]
    next_reap: float = 0.0
    next_pool_check: float = 0.0
    next_snapshot: float = 0.0  # after a failed snapshot: not before this time
    # after a failed background write: none that only shortens the chain before this time
    next_background: float = 0.0
    background_failures: int = 0  # background writes failed in a row
    snapshot_errors_seen: int = 0  # the journal's `snapshot_errors` as of the last turn
    # failed snapshots, retried every second, logged once a minute
    _snapshot_log: Throttle = field(default_factory=lambda: Throttle(60.0))

    def run(self, now: float | None = None) -> None:
        """While the journal cannot be written, reaping waits (it journals "X" and "T" records)
        and the snapshot, the way back, is retried every SNAPSHOT_RETRY_S."""
        now = time.monotonic() if now is None else now
        self.registry.leases.expire(now)
        self.registry.regions.end_holds(now)
        journal = self.journal
        if now >= self.next_reap and (journal is None or journal.writable):
            self.registry.instances.reap(self.heartbeat_timeout, now)
            self.next_reap = now + min(1.0, self.heartbeat_timeout / 4)
        if now >= self.next_pool_check:
            self.next_pool_check = now + 1.0
            self.check_pool()
        if journal is not None:
            self.note_background(journal, now)
            due = now >= self.next_snapshot and (journal.recovering or now >= self.next_background)
            if due and journal.needs_snapshot:
                self.snapshot(journal, now)  # its time is forgiven by the loop's next turn
        if self.gc_freeze:
            freeze_heap()  # what this turn left behind: keys registered, regions, leases

    def note_background(self, journal: Journal, now: float) -> None:
        """Note the background writes that failed since the last turn (the journal logged and
        counted them) and back off: a later snapshot retries, every SNAPSHOT_RETRY_S doubled per
        failure in a row up to SNAPSHOT_BACKGROUND_RETRY_MAX_S, as such a snapshot only shortens
        the chain a restart replays. A recovery (`Journal.recovering`) does not wait on it."""
        failed = journal.snapshot_errors - self.snapshot_errors_seen
        if failed:
            self.snapshot_errors_seen = journal.snapshot_errors
            self.background_failures += failed
            doublings = min(self.background_failures - 1, 16)
            delay = min(SNAPSHOT_BACKGROUND_RETRY_MAX_S, SNAPSHOT_RETRY_S * 2**doublings)
            self.next_background = now + delay
        elif self.background_failures and journal.snapshot_error is None:
            self.background_failures = 0  # one landed

    def snapshot(self, journal: Journal, now: float) -> None:
        """Pack the registry and hand the write to the journal's writer thread (on this loop
        when a recovery needs it: `Journal.start_snapshot`); a failure here (the state dir is
        full) is logged and retried later."""
        try:
            journal.start_snapshot(persistence.snapshot_packed(self.registry))
        except OSError as exc:
            self.next_snapshot = now + SNAPSHOT_RETRY_S
            held = self._snapshot_log.allow("snapshot")
            if held is not None:
                log.error(
                    "cannot write a snapshot in %s: %s; %s; retrying every %g s%s",
                    journal.state_dir,
                    exc,
                    "changes are refused until it succeeds"
                    if not journal.writable
                    else "the journal goes on",
                    SNAPSHOT_RETRY_S,
                    self._snapshot_log.note(held),
                )

    def check_pool(self) -> None:
        """The pool file deleted, replaced or shrunk under the server: its keys point at bytes
        that are gone. Stop before the next request, so no stale location is handed out;
        `maru-server` then exits with status 3 and marks its saved state unusable."""
        pool = self.registry.pool
        reason = pool.changed()
        if reason is None:
            return
        log.critical(
            "pool %s %s while serving: its bytes are gone; its %d keys will never be served "
            "again; stopping",
            pool.path,
            reason,
            len(self.registry.keys),
        )
        self.on_pool_lost(reason)
