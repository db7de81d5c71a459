"""The journal's fsync runs on its own thread (the syncer), not on the request thread: it fsyncs
the current journal file within `fsync_interval` of a write and at most that often, never an fd
that a snapshot rotation closed, and `close` flushes what is left. A failed fsync is logged and
makes the server loop write a fresh snapshot."""

from __future__ import annotations

import errno
import itertools
import logging
import os
import re
import threading
import time

import pytest

from maru.server import persistence
from maru.server.journal import Journal
from maru.server.pool import ShmPool
from maru.server.registry import Registry
from maru.server.service import MaruService
from maru.server.token import TokenSigner

from .registry_calls import register

MiB = 1 << 20
SYNCER = "maru-journal-fsync"
JOURNAL_FILE = re.compile(r"/journal-\d+\.log$")


class FsyncSpy:
    """Replaces `os.fsync`: records (time, thread name, file path) per call, then fsyncs."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple[float, str, str]] = []
        self.fail: OSError | None = None
        self._real = os.fsync
        monkeypatch.setattr(os, "fsync", self)

    def __call__(self, fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")  # raises if fd is not open
        self.calls.append((time.monotonic(), threading.current_thread().name, path))
        if self.fail is not None and JOURNAL_FILE.search(path):
            raise self.fail
        self._real(fd)

    def by_syncer(self) -> list[tuple[float, str, str]]:
        return [c for c in self.calls if c[1] == SYNCER]


def wait_for(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def open_registry(state_dir, pool_path, **journal_kw) -> tuple[Registry, Journal]:
    journal = Journal(state_dir, **journal_kw)
    snapshot, records = journal.load()
    reg = Registry(ShmPool(str(pool_path), 64 * MiB), TokenSigner(b"y" * 32), journal=journal)
    persistence.restore(reg, snapshot, records)
    return reg, journal


def test_syncer_fsyncs_within_the_window_and_at_most_that_often(tmp_path, monkeypatch):
    spy = FsyncSpy(monkeypatch)
    interval = 0.05
    journal = Journal(tmp_path, fsync_interval=interval)
    journal.load()
    try:
        time.sleep(3 * interval)
        assert spy.by_syncer() == []  # nothing written: nothing to fsync
        written = time.monotonic()
        journal.append(["X", 1])
        wait_for(lambda: spy.by_syncer())
        when, _, path = spy.by_syncer()[0]
        assert path.endswith("/journal-0.log")
        assert when - written < interval + 0.5  # idle for longer than the window: at once

        # a steady stream of writes for 0.6 s: one fsync per interval, not one per write
        spy.calls.clear()
        end = time.monotonic() + 0.6
        while time.monotonic() < end:
            last_write = time.monotonic()
            journal.append(["X", 2])
            time.sleep(0.001)
        # the last write is covered by an fsync that started after it
        wait_for(lambda: not journal._dirty and spy.by_syncer()[-1][0] >= last_write)
        times = [c[0] for c in spy.by_syncer()]
        assert 4 <= len(times) <= 0.6 / interval + 3, times
        gaps = [b - a for a, b in itertools.pairwise(times)]
        assert min(gaps) >= interval * 0.9, gaps
        assert all(c[1] == SYNCER for c in spy.calls)  # the appending thread never fsyncs
    finally:
        journal.close()


def test_close_flushes_and_joins_the_syncer(tmp_path, monkeypatch):
    spy = FsyncSpy(monkeypatch)
    journal = Journal(tmp_path, fsync_interval=3600)  # the syncer would wait an hour
    journal.load()
    syncer = journal._syncer
    assert syncer is not None and syncer.is_alive()
    journal.append(["X", 1])
    time.sleep(0.05)
    assert spy.calls == []
    journal.close()
    assert not syncer.is_alive()
    assert [(c[1], c[2].rsplit("/", 1)[1]) for c in spy.calls] == [("MainThread", "journal-0.log")]
    assert journal.fsyncs == 1 and journal._fd == -1
    journal.close()  # twice is harmless


def test_rotation_fsyncs_the_old_tail_before_closing_it(tmp_path, monkeypatch):
    spy = FsyncSpy(monkeypatch)
    journal = Journal(tmp_path, fsync_interval=3600)
    journal.load()
    journal.append(["X", 1])
    journal.write_snapshot({"regions": [], "keys": [], "next_region_id": 1})
    names = [c[2].rsplit("/", 1)[1] for c in spy.calls]
    # the old journal's tail, the snapshot, then the directory (new file and rename)
    assert names[0] == "journal-0.log" and names[1] == "snapshot.msgpack.tmp", names
    assert not (tmp_path / "journal-0.log").exists()
    journal.close()


def test_rotation_under_concurrent_fsyncs_loses_no_record(tmp_path, monkeypatch):
    """fsync_interval 0: the syncer fsyncs back to back while the registry writes and snapshots
    rotate the journal 150 times. Every fsync of the syncer is of an open journal file (never a
    closed fd, nor an fd number reused by the snapshot file), and a restart restores every key."""
    spy = FsyncSpy(monkeypatch)
    state_dir, pool = tmp_path / "state", tmp_path / "pool"
    reg, journal = open_registry(state_dir, pool, fsync_interval=0.0)
    reg.instances.handshake("A", 1)
    region = reg.request_region("A", 48 * MiB)  # (a page a value, as a writer places them)
    expected: set[str] = set()
    n = 0
    for rotation in range(150):
        for _ in range(4):
            batch = [f"k{n + i}" for i in range(16)]
            register(
                reg, "A", [[k, region.region_id, (n + i) * 4096, 100] for i, k in enumerate(batch)]
            )
            n += 16
            expected.update(batch)
            time.sleep(0.0002)  # let the syncer in
        gone = sorted(expected)[:8]
        reg.delete(gone)
        expected.difference_update(gone)
        journal.write_snapshot(persistence.snapshot(reg))
        assert journal.generation == rotation + 1
    register(reg, "A", [["tail", region.region_id, n * 4096, 100]])  # only in the journal
    expected.add("tail")
    journal.close()

    assert journal.fsync_errors == 0
    syncer_files = [c[2] for c in spy.by_syncer()]
    assert len(syncer_files) > 50 and all(JOURNAL_FILE.search(p) for p in syncer_files)
    assert len(set(syncer_files)) > 10  # it did fsync many generations, between rotations
    reg, journal = open_registry(state_dir, pool, fsync_interval=0.05)
    try:
        assert set(reg.keys) == expected
    finally:
        journal.close()


def test_a_failed_fsync_is_logged_and_healed_by_a_snapshot(tmp_path, monkeypatch, caplog):
    spy = FsyncSpy(monkeypatch)
    state_dir, pool = tmp_path / "state", tmp_path / "pool"
    reg, journal = open_registry(state_dir, pool, fsync_interval=0.0)
    svc = MaruService(reg, "tcp://127.0.0.1:0", journal=journal, local_socket="none")
    try:
        reg.instances.handshake("A", 1)
        region = reg.request_region("A", 4 * MiB)
        spy.fail = OSError(errno.EIO, "Input/output error")
        with caplog.at_level(logging.ERROR, logger="maru.server.journal"):
            register(reg, "A", [["k1", region.region_id, 0, 10]])
            wait_for(lambda: journal.sync_error is not None)
        assert "journal fsync of" in caplog.text and "Input/output error" in caplog.text
        assert journal.fsync_errors >= 1 and journal.needs_snapshot
        spy.fail = None
        svc.housekeeping()  # the loop's next turn: a fresh snapshot of the whole registry
        assert journal.generation == 1 and journal.sync_error is None
        assert not journal.needs_snapshot
        register(reg, "A", [["k2", region.region_id, 4096, 10]])
    finally:
        svc.close()  # closes the journal
    reg, journal = open_registry(state_dir, pool)
    try:
        assert set(reg.keys) == {"k1", "k2"}
    finally:
        journal.close()


@pytest.mark.parametrize("snapshot", [False, True])
def test_sync_fsyncs_now_on_the_calling_thread(tmp_path, monkeypatch, snapshot):
    spy = FsyncSpy(monkeypatch)
    journal = Journal(tmp_path, fsync_interval=3600)
    journal.load()
    if snapshot:
        journal.write_snapshot({"regions": [], "keys": [], "next_region_id": 1})
    spy.calls.clear()
    assert journal.sync()  # not dirty: nothing to do
    journal.append(["X", 1])
    assert journal.sync()
    assert [c[1] for c in spy.calls] == ["MainThread"]
    assert spy.calls[0][2].endswith(f"/journal-{int(snapshot)}.log")
    journal.close()
    assert len(spy.calls) == 1  # close: nothing left to fsync


def test_close_while_the_syncer_clears_its_wake_does_not_hang(tmp_path):
    """close() between the syncer's wait and its fsync: the syncer clears the wake as it syncs,
    and must not clear the one close() set (it would wait for it forever, and close() for it)."""
    journal = Journal(tmp_path / "state", fsync_interval=0.05)
    journal.load()
    journal._closing.set()  # close()'s half, as the syncer's fsync of this moment sees it
    journal._wake.set()
    journal.sync(clear_wake=True)
    assert journal._wake.is_set()
    journal._closing.clear()
    journal.close()  # (joins the syncer: returns only if it saw the wake)
