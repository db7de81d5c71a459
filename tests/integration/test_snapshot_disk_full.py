"""Promise P2 (docs/reliability.md) when the background snapshot meets a really full disk: a real
`maru-server` with a tiny --snapshot-mb whose state dir is a small tmpfs, filled by a filler
file, and a client that stores and deletes keys with known bytes.

1. Room for the journal but not for the snapshot: the background writes fail (counted in
   `journal_snapshot_errors`), nothing on disk is removed (the last snapshot stays, byte for
   byte) and the chain of journals grows by one per try; once space is freed a snapshot lands
   by itself and collapses the chain.
2. Killed with SIGKILL while the writes fail, and started again on the full disk: it finds no
   room for its start-up snapshot and serves what it restored from the chain (every
   acknowledged store read back exactly), which stays whole. Killed again and restarted once
   space is freed, with a half-written `snapshot.msgpack.tmp` in the state dir as a kill in the
   middle of a write leaves it: the restart replays the whole chain and leaves no temp file.
3. The disk runs completely full, so appends fail too (`journal_write_errors`): changes are
   refused, reads go on, and once space is freed the server takes changes again by itself.

After each, SIGKILL and a restart: every acknowledged store is back with exactly its bytes,
every acknowledged delete stays deleted, a refused store is absent or exact (`check`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from conftest import MaruServerProcess, tmpfs_mounted  # tests/conftest.py (on sys.path)
from maru import MaruHandler
from maru.server.journal import SNAPSHOT_NAME, read_records

from .test_crash_safety import handler, make_value, sigkill_server, wait_until
from .test_state_dir_full import Workload, check

KiB = 1 << 10
TMPFS_SIZE = "1m"
SNAPSHOT_MB = 0.01  # a snapshot as soon as the journals outgrow the last one
SERVER_ARGS = ["--snapshot-mb", str(SNAPSHOT_MB), "--heartbeat-timeout", "30"]
SNAPSHOT_FLOOR = 96 * KiB  # the registry's snapshot before the disk is filled
BULK = 256  # keys per bulk store while the registry grows
KEY_PAD = "p" * 48  # long names: a larger snapshot per key, fewer keys to store
WAIT_S = 30.0  # bound on every wait for the server (a bound, not a threshold)
MAX_STEPS = 600  # bound on the batches of a phase
NO_ROOM = re.compile(r"background snapshot generation \d+ in .* failed: \[Errno 28\]")
STEPS_BETWEEN_TRIES = 3  # stores and deletes just after a failed try (the next is >= 1 s away)


def generation_of(snapshot: bytes) -> int:
    return int(read_records(snapshot)[0][0]["generation"])


class StateDir:
    """The server's state dir as the test sees it: its snapshot, its journals, a filler file."""

    def __init__(self, path: Path):
        self.path = path
        self.filler = path / "filler"

    def journals(self) -> list[int]:
        return sorted(int(p.stem.split("-")[1]) for p in self.path.glob("journal-*.log"))

    def journal_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.path.glob("journal-*.log"))

    def snapshot(self) -> bytes:
        return (self.path / SNAPSHOT_NAME).read_bytes()

    def snapshot_generation(self) -> int:
        return generation_of(self.snapshot())

    def temp_files(self) -> list[str]:
        return sorted(p.name for p in self.path.glob("*.tmp"))

    def settled(self) -> bool:
        """One journal, its snapshot's, and no write in flight: the last snapshot landed."""
        return self.journals() == [self.snapshot_generation()] and not self.temp_files()

    def chain_is_whole(self) -> bool:
        """The journals run without a gap from the snapshot's generation on."""
        journals = self.journals()
        return journals == list(range(self.snapshot_generation(), journals[-1] + 1))

    def leave_free(self, room: int) -> None:
        """Fill the file system up to `room` bytes free."""
        st = os.statvfs(self.path)
        with open(self.filler, "wb") as f:
            f.write(b"\0" * max(0, st.f_bavail * st.f_frsize - room))

    def free(self) -> None:
        self.filler.unlink()


def snapshot_errors(client: MaruHandler) -> int:
    return client.stats()["counters"]["journal_snapshot_errors"]


def bulk_store(work: Workload, n: int) -> None:
    """`n` keys with long names and small values in one request, recorded in `work`: the
    registry's snapshot grows fast."""
    keys = [f"bulk-{work.batch}-{j}-{KEY_PAD}" for j in range(n)]
    work.batch += 1
    sizes = [work.rng.randrange(64, 512) for _ in keys]
    work.sizes.update(zip(keys, sizes))
    results = work.client.batch_store(keys, [make_value(k, s) for k, s in zip(keys, sizes)])
    assert all(results), "a store was refused before the disk was filled"
    work.stored.update(keys)


@contextmanager
def server_on_tmpfs(factory, tmp_path: Path) -> Iterator[tuple[MaruServerProcess, StateDir]]:
    """A server whose --state-dir is a fresh tmpfs of TMPFS_SIZE (skipped without root)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs as the state dir needs root")
    workdir = tmp_path / "srv"
    workdir.mkdir()
    with tmpfs_mounted(workdir / "state", TMPFS_SIZE) as mnt:  # the server's --state-dir
        server = factory(workdir, pool_size="256M", extra_args=SERVER_ARGS)
        try:
            yield server, StateDir(mnt)
        finally:
            server.stop()  # before the unmount


def grown(server: MaruServerProcess, state: StateDir) -> tuple[MaruHandler, Workload]:
    """A client and its workload, the registry's snapshot past SNAPSHOT_FLOOR and landed."""
    client = handler(server.url, pool_size="64M", chunk_size_bytes=4 * KiB)
    work = Workload(client)
    for _ in range(MAX_STEPS):
        if len(state.snapshot()) >= SNAPSHOT_FLOOR:
            break
        bulk_store(work, BULK)
        work.step()
    assert wait_until(state.settled, WAIT_S), state.journals()
    assert len(state.snapshot()) >= SNAPSHOT_FLOOR
    return client, work


def fill_but_the_journal(
    server: MaruServerProcess, client: MaruHandler, state: StateDir, work: Workload
) -> bytes:
    """Leave free the journal's room up to the next snapshot plus half a snapshot (the next is
    larger: it cannot fit), then store until that snapshot's background write has failed once.
    Returns the snapshot on disk before."""
    before = state.snapshot()
    generation = state.snapshot_generation()
    threshold = max(len(before), int(SNAPSHOT_MB * (1 << 20)))
    state.leave_free(threshold - state.journal_bytes() + len(before) // 2)
    for _ in range(MAX_STEPS):  # until the loop switches to the next journal
        if state.journals()[-1] > generation:
            break
        work.step()
    assert state.journals()[-1] > generation, "no snapshot was started"
    assert wait_until(lambda: snapshot_errors(client) >= 1, WAIT_S), "the write did not fail"
    assert NO_ROOM.search(server.read_log()), "the background write failed, but not for room"
    return before


def fail_again(
    client: MaruHandler, state: StateDir, work: Workload, before: bytes, tries: int
) -> None:
    """Wait for `tries` more failed background writes, storing and deleting right after each
    (the housekeeping's next try is a second or more away: appends find room); after each,
    the chain is as `assert_chain_kept` says."""
    for _ in range(tries):
        errors = snapshot_errors(client)
        for _ in range(STEPS_BETWEEN_TRIES):
            work.step()
        failed = wait_until(lambda e=errors: snapshot_errors(client) > e, WAIT_S)
        assert_chain_kept(client, state, before)
        assert failed, "the housekeeping did not try again"


def assert_chain_kept(client: MaruHandler, state: StateDir, before: bytes) -> None:
    """The failed writes removed nothing: the same snapshot, every journal after it, one
    journal per try (or one more while a try is in flight)."""
    temp_files = state.temp_files()
    errors = snapshot_errors(client)
    journals = state.journals()
    assert state.snapshot() == before
    assert state.chain_is_whole(), journals
    assert errors <= len(journals) - 1 <= errors + 1, (errors, journals)
    if len(journals) - 1 == errors:  # none in flight: each failed write removed its temp file
        assert temp_files == []


def restart_and_check(server: MaruServerProcess, state: StateDir, work: Workload) -> None:
    """SIGKILL (if running), start again on the same state dir and pool, and check P2."""
    if server.alive():
        sigkill_server(server)
    server.halt()  # (dead already: closes its log)
    server.start(server.port)
    reader = handler(server.url, pool_size="4M", chunk_size_bytes=4 * KiB)
    try:
        counts = check(reader, work)
    finally:
        reader.close()
    assert counts["lost"] == counts["resurrected"] == counts["wrong_bytes"] == 0, counts
    assert counts["ok"] == len(work.stored), counts
    assert state.settled(), (state.journals(), state.temp_files())  # the start-up's snapshot
    print(
        f"\n{len(work.stored)} stores and {len(work.deleted)} deletes acknowledged, "
        f"{work.refused_stores} store batches refused; after SIGKILL: {counts}"
    )


def test_background_snapshots_without_room_keep_the_chain_until_space_is_freed(
    maru_server_factory, tmp_path
):
    with server_on_tmpfs(maru_server_factory, tmp_path) as (server, state):
        client, work = grown(server, state)
        before = fill_but_the_journal(server, client, state, work)
        fail_again(client, state, work, before, tries=2)  # (backoff: 1 s, then 2 s)
        acked = len(work.stored)
        for _ in range(STEPS_BETWEEN_TRIES):
            work.step()
        assert len(work.stored) > acked, "appends found no room"

        state.free()  # a snapshot lands by itself (the next try), and collapses the chain
        assert wait_until(state.settled, WAIT_S), state.journals()
        assert state.snapshot_generation() > generation_of(before)
        assert wait_until(work.step, WAIT_S), "stores stay refused"
        for _ in range(5):
            assert work.step()
        client.close()
        restart_and_check(server, state, work)


def test_sigkill_while_background_snapshots_fail_then_restart_with_room(
    maru_server_factory, tmp_path
):
    with server_on_tmpfs(maru_server_factory, tmp_path) as (server, state):
        client, work = grown(server, state)
        before = fill_but_the_journal(server, client, state, work)
        fail_again(client, state, work, before, tries=1)
        for _ in range(STEPS_BETWEEN_TRIES):
            work.step()
        sigkill_server(server)
        client.close()
        server.halt()
        assert state.snapshot() == before and state.chain_is_whole()
        journals = state.journals()
        assert len(journals) >= 3, journals
        left = state.temp_files()

        # a start on the full disk finds no room for its snapshot: it serves what it restored
        # from the chain, which stays whole, and the housekeeping tries again
        server.start(server.port)
        assert "cannot write the start-up snapshot" in server.read_log()
        assert state.snapshot() == before and state.journals() == journals
        reader = handler(server.url, pool_size="4M", chunk_size_bytes=4 * KiB)
        try:
            assert snapshot_errors(reader) >= 1
            counts = check(reader, work)
        finally:
            reader.close()
        assert counts["lost"] == counts["resurrected"] == counts["wrong_bytes"] == 0, counts
        sigkill_server(server)  # (again: before it could snapshot)
        server.halt()

        state.free()
        if not left:  # what a kill in the middle of the write leaves
            (state.path / (SNAPSHOT_NAME + ".tmp")).write_bytes(before[: len(before) // 2])
        restart_and_check(server, state, work)


def test_a_disk_full_for_appends_too_refuses_changes_until_space_is_freed(
    maru_server_factory, tmp_path
):
    with server_on_tmpfs(maru_server_factory, tmp_path) as (server, state):
        client, work = grown(server, state)
        before = fill_but_the_journal(server, client, state, work)
        for _ in range(MAX_STEPS):  # the journal runs full too
            if work.refused_stores:
                break
            work.step()
        assert work.refused_stores, "the journal never ran full"
        for _ in range(10):
            work.step()
        stats = client.stats()
        assert stats["journal_writable"] is False
        assert stats["counters"]["journal_write_errors"] >= 1
        assert "No space left" in stats["journal_error"]
        assert state.snapshot() == before and state.chain_is_whole()
        some = sorted(work.stored - work.deleted)[:8]
        assert client.batch_exists(some) == [True] * len(some)  # reads go on

        state.free()  # the recovery snapshot lands: changes are taken again
        assert wait_until(work.step, WAIT_S), "stores stay refused"
        assert client.stats()["journal_writable"] is True
        assert wait_until(state.settled, WAIT_S), state.journals()
        for _ in range(5):
            assert work.step()
        client.close()
        restart_and_check(server, state, work)
