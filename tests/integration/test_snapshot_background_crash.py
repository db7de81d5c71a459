"""`maru-server` killed with SIGKILL while it snapshots in the background, restarted on the same
--state-dir and pool: every store it acknowledged is back with its bytes, and no delete it
acknowledged comes back. A tiny --snapshot-mb keeps the snapshots coming; the server's loop
only switches appends to the next journal and a thread writes the snapshot, so at a kill the
state dir may hold a snapshot and a chain of journals after it, which a restart replays in
order (`maru.server.journal`). Where the snapshot cannot be written at all (its temporary
file's path taken by a directory) the chain grows over several journals until the kill: the
keys and deletes only its later journals hold come back only if the restart replays them all."""

from __future__ import annotations

import random
import re

from maru import MaruHandler

from .test_crash_safety import handler, make_value, verify_all, wait_until

KiB = 1 << 10
SNAPSHOT_ARGS = ["--snapshot-mb", "0.01", "--heartbeat-timeout", "30", "--lease-timeout", "60"]
FAILED = re.compile(r"background snapshot generation (\d+) in .* failed")


class Ledger:
    """What the server acknowledged: keys stored (not deleted since) and keys deleted. Keys are
    never used twice, so an unacknowledged call (the server was down) leaves nothing to assert:
    its keys are in neither set."""

    def __init__(self, seed: int):
        self.stored: list[str] = []
        self.deleted: list[str] = []
        self.rng = random.Random(seed)
        self.next = 0

    def store(self, writer: MaruHandler, n: int) -> None:
        keys = [f"bg-{self.next + i}" for i in range(n)]
        self.next += n
        values = [make_value(k, self.rng.randrange(1 * KiB, 8 * KiB)) for k in keys]
        try:
            ok = writer.batch_store(keys, values)
        except Exception:  # (the server restarting: nothing acknowledged)
            return
        self.stored += [k for k, stored in zip(keys, ok) if stored]

    def delete(self, writer: MaruHandler, n: int) -> None:
        keys = self.rng.sample(self.stored, min(n, len(self.stored)))
        try:
            ok = writer.batch_delete(keys)
        except Exception:
            return
        gone = {k for k, deleted in zip(keys, ok) if deleted}
        self.stored = [k for k in self.stored if k not in gone]
        self.deleted += sorted(gone)  # (a delete not acknowledged may have happened: not listed)

    def work(self, writer: MaruHandler, batches: int) -> None:
        for b in range(batches):
            self.store(writer, 8)
            if b % 3 == 2:
                self.delete(writer, 5)

    def check(self, url: str) -> None:
        reader = handler(url, pool_size="64M")
        try:
            assert verify_all(reader, self.stored) == (len(self.stored), 0, 0)
            back = [k for k, found in zip(self.deleted, reader.batch_exists(self.deleted)) if found]
            assert back == [], f"{len(back)} deleted keys came back: {back[:5]}"
        finally:
            reader.close()


POOL = "2G"  # (sparse) a writer takes a region twice the last one's after each restart


def writer_for(url: str) -> MaruHandler:
    return handler(url, pool_size=POOL, timeout_ms=2000)  # the whole pool: nothing evicted


def newest_journal(server) -> int:
    return max(int(p.stem.split("-")[1]) for p in server.state_dir.glob("journal-*.log"))


def test_sigkill_during_background_snapshots_keeps_every_acknowledged_change(
    maru_server_factory, tmp_path
):
    """Killed at several points of a stream of stores and deletes: as soon as the loop has
    switched to a new journal (the snapshot then being written, or just written), or a few
    replies later."""
    server = maru_server_factory(tmp_path / "srv", pool_size=POOL, extra_args=SNAPSHOT_ARGS)
    ledger = Ledger(seed=7)
    writer = writer_for(server.url)
    try:
        unlanded = 0
        for round_, extra in enumerate([0, 2, 0, 1, 0, 5]):
            generation = newest_journal(server)

            def switched(generation: int = generation) -> bool:
                ledger.work(writer, 1)
                return newest_journal(server) > generation

            assert wait_until(switched, 60, interval=0.0)
            ledger.work(writer, extra)
            newest = newest_journal(server)
            landed = f"snapshot generation {newest} written" in server.read_log()
            server.kill_and_start()
            unlanded += not landed  # (killed before its snapshot was written: the chain's case)
            ledger.check(server.url)
            journals = sorted(p.name for p in server.state_dir.glob("journal-*.log"))
            assert len(journals) == 1, (round_, journals)  # the start-up's snapshot collapsed it
        assert ledger.stored and ledger.deleted
        print(f"\n6 kills, {unlanded} before the background snapshot had landed")
    finally:
        writer.close()


def test_a_chain_of_journals_left_by_failed_snapshots_is_replayed_whole(
    maru_server_factory, tmp_path
):
    """The snapshot's temporary file cannot be created (a directory is in its way): each
    background write fails, the server goes on in the next journal, and the chain grows (the
    housekeeping retries after 1 s, then 2 s). Killed with three journals or more after the
    last snapshot, restarted once the way is clear: the stores and deletes of every journal of
    the chain are back. (Replaying the snapshot's own journal only would lose the later stores
    and bring the later deletes back.)"""
    server = maru_server_factory(tmp_path / "srv", pool_size=POOL, extra_args=SNAPSHOT_ARGS)
    ledger = Ledger(seed=11)
    writer = writer_for(server.url)
    blocker = server.state_dir / "snapshot.msgpack.tmp"
    try:
        ledger.work(writer, 30)
        blocker.mkdir()
        before = len(ledger.stored)

        def chain_of_three() -> bool:
            ledger.work(writer, 3)
            return len(list(server.state_dir.glob("journal-*.log"))) >= 3

        assert wait_until(chain_of_three, 60, interval=0.0)
        ledger.work(writer, 12)  # stores and deletes in the chain's last journal
        failed = [int(g) for g in FAILED.findall(server.read_log())]
        assert len(failed) >= 2

        server.proc.kill()
        assert server.proc.wait(10) < 0
        server.halt()
        journals = sorted(int(p.stem.split("-")[1]) for p in server.state_dir.glob("journal-*.log"))
        assert len(journals) >= 3 and journals == list(range(journals[0], journals[-1] + 1))
        assert ledger.stored[before:] and ledger.deleted  # changes the later journals hold
        blocker.rmdir()

        server.start(server.port)
        ledger.check(server.url)
        journals_after = list(server.state_dir.glob("journal-*.log"))
        assert len(journals_after) == 1  # the start-up's snapshot holds the chain now
    finally:
        writer.close()
