"""The snapshot's write leaves the server's loop: the loop packs the state, fsyncs the journal and
sends appends to the next generation's journal; a thread writes the snapshot (temporary file,
fsync, rename, directory fsync) and only then removes the journals it covers. At every point a
crash can stop it, the files restore exactly the state acknowledged: a restart replays the
chain (the newest snapshot, then its journal and every later one). A crash is simulated by
abandoning the Journal where the writer stands (its `write_private` held there by a test hook)
and loading a fresh one from the same directory, as a restarted server does."""

from __future__ import annotations

import errno
import os
import re
import threading
import time
from pathlib import Path

import msgpack
import pytest

from maru.server import journal as journal_module
from maru.server import persistence
from maru.server.housekeeping import SNAPSHOT_RETRY_S, Housekeeping
from maru.server.journal import FRAME, SNAPSHOT_NAME, Journal, read_records
from maru.server.pool import ShmPool
from maru.server.registry import Registry
from maru.server.token import TokenSigner

from .registry_calls import register

MiB = 1 << 20
SIGNER = TokenSigner(b"b" * 32)
FLOOR = 2048  # --snapshot-mb, in bytes: a few dozen keys of records pass it
WAIT_S = 10.0  # a bound on every wait of these tests (never a performance threshold)
JOURNAL_FILE = re.compile(r"/journal-\d+\.log$")


def open_registry(state_dir: Path, pool: Path) -> tuple[Registry, Journal]:
    """A journal loaded from `state_dir` and a registry restored from it, as maru-server does."""
    journal = Journal(state_dir, fsync_interval=0.0, snapshot_bytes=FLOOR)
    snapshot, records = journal.load()
    reg = Registry(ShmPool(str(pool), 64 * MiB), SIGNER, journal=journal)
    persistence.restore(reg, snapshot, records)
    return reg, journal


def keys_of(reg: Registry) -> dict[str, tuple[int, int, int]]:
    return {k: (e.region_id, e.offset, e.length) for k, e in reg.keys.items()}


class Node:
    """A journal, a registry on it and its housekeeping; `restarted()` is what a server started
    on the same state dir now (after a crash: nothing of this node is closed) would serve."""

    def __init__(self, tmp_path: Path):
        self.state_dir, self.pool = tmp_path / "state", tmp_path / "pool"
        self.reg, self.journal = open_registry(self.state_dir, self.pool)
        self.hk = Housekeeping(self.reg, self.journal, 3600.0, False, lambda reason: None)
        self.reg.instances.handshake("A", 1)
        self.rid = self.reg.request_region("A", 32 * MiB).region_id
        self.next = 0

    def add(self, n: int, length: int = 100) -> list[str]:
        keys = [f"key-{self.next + i:06d}" for i in range(n)]
        rows = [[k, self.rid, (self.next + i) * 4096, length] for i, k in enumerate(keys)]
        assert register(self.reg, "A", rows) == [0] * n
        self.next += n
        return keys

    def delete(self, keys: list[str]) -> None:
        self.reg.delete(keys)

    def path(self, name: str) -> Path:
        return self.state_dir / name

    def files(self) -> list[str]:
        return sorted(p.name for p in self.state_dir.iterdir())

    def snapshot_generation(self) -> int:
        records, _ = read_records(self.path(SNAPSHOT_NAME).read_bytes())
        return records[0]["generation"]

    def restarted(self) -> dict[str, tuple[int, int, int]]:
        reg, journal = open_registry(self.state_dir, self.pool)
        try:
            return keys_of(reg)
        finally:
            journal.close()

    def history(self) -> None:
        """Generation 1 on disk (a snapshot written on this thread), then changes in its
        journal: registrations, deletes of keys the snapshot holds and of keys the journal
        registered."""
        first = self.add(40)
        self.journal.write_snapshot(persistence.snapshot_packed(self.reg))
        assert self.journal.generation == 1
        later = self.add(60)
        self.delete(first[:5] + later[:5])

    def more_history(self) -> None:
        """Changes after the switch to the next journal: a key deleted before registered again
        elsewhere (its new bytes), deletes of keys of every earlier record."""
        gone = sorted(k for k in self.reg.keys)[:3]
        self.delete(gone)
        rows = [[gone[0], self.rid, (self.next + 500) * 4096, 77]]
        assert register(self.reg, "A", rows) == [0]
        self.add(30)
        self.delete(sorted(self.reg.keys)[-4:])


class Held:
    """Holds the writer thread in `write_private`: `before_rename` (a part of the temporary
    file written) or after it (the real write and rename done), until `release`; then it
    `raises` (the process died there: nothing more reaches the disk) or writes on."""

    def __init__(self, monkeypatch, *, before_rename: bool, raises: bool = True):
        self.reached, self.release = threading.Event(), threading.Event()
        real = journal_module.write_private

        def held(path: Path, data: list[bytes]) -> None:
            if threading.current_thread().name != "maru-snapshot":
                return real(path, data)
            if before_rename:
                whole = b"".join(data)
                path.with_name(path.name + ".tmp").write_bytes(whole[: len(whole) // 2])
            else:
                real(path, data)
            self.reached.set()
            assert self.release.wait(WAIT_S)
            if raises:
                raise OSError(errno.EIO, "the process died here (test)")
            if before_rename:
                real(path, data)

        monkeypatch.setattr(journal_module, "write_private", held)

    def wait(self) -> None:
        assert self.reached.wait(WAIT_S)


def start_in_background(node: Node) -> None:
    assert node.journal.start_snapshot(persistence.snapshot_packed(node.reg))
    assert node.journal.generation == 2


def held_in_flight(node: Node, monkeypatch, **how: bool) -> Held:
    """The node's history, a background snapshot of it held (`Held(**how)`), and more history
    into the next journal meanwhile."""
    node.history()
    held = Held(monkeypatch, **how)
    start_in_background(node)
    held.wait()
    node.more_history()
    return held


# -- crash points ------------------------------------------------------------------------------


def test_crash_before_the_rename_replays_the_snapshot_and_both_journals(tmp_path, monkeypatch):
    node = Node(tmp_path)
    # journal-2 written to while the writer is held
    held = held_in_flight(node, monkeypatch, before_rename=True)
    assert not node.journal.needs_snapshot  # one write at a time
    expected = keys_of(node.reg)
    assert node.files() == ["journal-1.log", "journal-2.log", SNAPSHOT_NAME, SNAPSHOT_NAME + ".tmp"]
    assert node.snapshot_generation() == 1

    assert node.restarted() == expected  # snapshot 1 + journal-1 + journal-2, in order
    held.release.set()
    node.journal.close()


def test_crash_after_the_rename_before_the_old_journal_is_removed(tmp_path, monkeypatch):
    node = Node(tmp_path)
    held = held_in_flight(node, monkeypatch, before_rename=False)
    expected = keys_of(node.reg)
    assert node.files() == ["journal-1.log", "journal-2.log", SNAPSHOT_NAME]
    assert node.snapshot_generation() == 2

    assert node.restarted() == expected  # snapshot 2 + journal-2; journal-1 is covered
    assert node.files() == ["journal-2.log", SNAPSHOT_NAME]  # removed at load
    held.release.set()
    node.journal.close()


def test_a_landed_background_snapshot_collapses_the_chain(tmp_path):
    node = Node(tmp_path)
    node.history()
    start_in_background(node)
    node.more_history()
    node.journal.wait_snapshot()
    assert node.files() == ["journal-2.log", SNAPSHOT_NAME]
    assert node.snapshot_generation() == 2 and node.journal.snapshot_error is None
    assert node.journal.snapshot_size == node.path(SNAPSHOT_NAME).stat().st_size
    expected = keys_of(node.reg)
    node.journal.close()
    assert node.restarted() == expected


def test_a_failed_background_write_loses_nothing_and_a_later_one_collapses_the_chain(tmp_path):
    """The temporary file's path is a directory: every write fails. The old snapshot and
    every journal after it stay, the failures are counted, the housekeeping backs off (1 s,
    then 2 s), and once the write can succeed one snapshot collapses the chain."""
    node = Node(tmp_path)
    node.history()
    before = node.path(SNAPSHOT_NAME).read_bytes()
    tmp = node.path(SNAPSHOT_NAME + ".tmp")
    tmp.mkdir()
    now = time.monotonic()
    while not node.journal.needs_snapshot:
        node.add(20)
    node.hk.run(now)  # starts the write in the background
    assert node.journal.generation == 2
    node.journal.wait_snapshot()
    assert node.journal.snapshot_errors == 1 and isinstance(node.journal.snapshot_error, OSError)
    assert node.path(SNAPSHOT_NAME).read_bytes() == before  # nothing changed on disk
    node.more_history()
    assert node.restarted() == keys_of(node.reg)  # snapshot 1, journal-1, journal-2

    assert node.journal.needs_snapshot  # journal-1 is still to replay: the chain is past it
    node.hk.run(now)  # sees the failure: counted, and the next try waits SNAPSHOT_RETRY_S
    assert node.hk.snapshot_errors_seen == 1
    node.hk.run(now + SNAPSHOT_RETRY_S / 2)
    assert node.journal.generation == 2 and not node.journal.snapshot_in_flight
    node.hk.run(now + SNAPSHOT_RETRY_S)  # tries again: fails again
    node.journal.wait_snapshot()
    assert node.journal.generation == 3 and node.journal.snapshot_errors == 2
    node.add(5)
    seen = now + SNAPSHOT_RETRY_S + 0.01
    node.hk.run(seen)  # sees it: the second failure in a row waits 2 s
    assert node.hk.snapshot_errors_seen == 2
    node.hk.run(seen + 1.5 * SNAPSHOT_RETRY_S)
    assert node.journal.generation == 3
    assert node.files() == [
        "journal-1.log",
        "journal-2.log",
        "journal-3.log",
        SNAPSHOT_NAME,
        SNAPSHOT_NAME + ".tmp",
    ]
    assert node.restarted() == keys_of(node.reg)  # the chain of three journals

    tmp.rmdir()  # room again
    node.hk.run(seen + 2 * SNAPSHOT_RETRY_S)
    node.journal.wait_snapshot()
    assert node.journal.generation == 4 and node.journal.snapshot_error is None
    assert node.files() == ["journal-4.log", SNAPSHOT_NAME]
    assert node.snapshot_generation() == 4 and not node.journal.needs_snapshot
    node.hk.run(seen + 10)
    assert node.hk.background_failures == 0  # the next failure backs off from 1 s again
    expected = keys_of(node.reg)
    node.journal.close()
    assert node.restarted() == expected


def test_a_snapshot_that_would_take_the_journals_room_is_not_written(tmp_path, monkeypatch):
    """The file system holds the snapshot but not the journal's room beside it: the writer
    does not start the file (which would take the last free bytes from the loop's appends),
    fails as a full disk does (ENOSPC, counted, nothing removed), and lands once there is
    room."""
    node = Node(tmp_path)
    node.history()
    node.add(3000)  # a snapshot of many file system blocks
    before = node.path(SNAPSHOT_NAME).read_bytes()
    real = os.statvfs
    free = {"bytes": 1 << 40}

    def statvfs(path):  # (the state dir's file system only: the pool's is left alone)
        st = real(path)
        if Path(path) != node.state_dir:
            return st
        return os.statvfs_result((*st[:4], free["bytes"] // st.f_frsize, *st[5:]))

    monkeypatch.setattr(os, "statvfs", statvfs)
    state = persistence.snapshot_packed(node.reg)
    size = sum(len(c) for c in journal_module._frame_chunks(dict(state, generation=2)))
    free["bytes"] = size + size // 8  # room for the snapshot, not for a quarter more
    assert node.journal.start_snapshot(state)
    node.journal.wait_snapshot()
    error = node.journal.snapshot_error
    assert isinstance(error, OSError) and error.errno == errno.ENOSPC
    assert node.journal.snapshot_errors == 1
    assert node.files() == ["journal-1.log", "journal-2.log", SNAPSHOT_NAME]  # no .tmp begun
    assert node.path(SNAPSHOT_NAME).read_bytes() == before
    node.add(10)
    assert node.restarted() == keys_of(node.reg)

    free["bytes"] = 1 << 40
    assert node.journal.start_snapshot(persistence.snapshot_packed(node.reg))
    node.journal.wait_snapshot()
    assert node.journal.snapshot_error is None and node.files() == ["journal-3.log", SNAPSHOT_NAME]
    expected = keys_of(node.reg)
    node.journal.close()
    assert node.restarted() == expected


# -- damage in the chain -----------------------------------------------------------------------


def chain_of_two(node: Node, monkeypatch, *, appends_after: bool = True) -> None:
    """Snapshot 1, journal-1 and journal-2 on disk (the background write failed)."""
    node.history()

    def fail(path: Path, data: list[bytes]) -> None:
        raise OSError(errno.ENOSPC, "No space left on device (test)")

    with monkeypatch.context() as m:
        m.setattr(journal_module, "write_private", fail)
        start_in_background(node)
        node.journal.wait_snapshot()
    assert node.journal.snapshot_errors == 1
    if appends_after:
        node.more_history()
    node.journal.close()


def last_frame(data: bytes) -> tuple[int, int]:
    """(offset, payload length) of the last frame."""
    pos = last = 0
    while pos < len(data):
        last = pos
        pos += FRAME.size + FRAME.unpack_from(data, pos)[0]
    return last, FRAME.unpack_from(data, last)[0]


def test_damage_in_a_journal_before_the_last_refuses(tmp_path, monkeypatch, caplog):
    node = Node(tmp_path)
    chain_of_two(node, monkeypatch)
    first = node.path("journal-1.log")
    data = bytearray(first.read_bytes())
    pos, length = last_frame(bytes(data))
    data[pos + FRAME.size + length // 2] ^= 0xFF  # its last record: nothing intact after it there
    first.write_bytes(bytes(data))
    before = {p.name: p.read_bytes() for p in node.state_dir.iterdir()}
    with pytest.raises(RuntimeError, match="damaged in its middle"):
        node.restarted()
    assert {p.name: p.read_bytes() for p in node.state_dir.iterdir()} == before
    (error,) = [r.message for r in caplog.records if "damaged" in r.message]
    assert [r.levelname for r in caplog.records if "damaged" in r.message] == ["ERROR"]
    assert f"byte {pos} of {len(data)}" in error and str(node.path("journal-2.log")) in error
    assert "--no-restore" in error


def test_a_torn_tail_in_the_last_journal_is_truncated(tmp_path, monkeypatch):
    node = Node(tmp_path)
    chain_of_two(node, monkeypatch)
    last = node.path("journal-2.log")
    data = last.read_bytes()
    pos, length = last_frame(data)
    torn = msgpack.unpackb(data[pos + FRAME.size :])  # the record the tear loses
    assert torn[0] == "D"
    last.write_bytes(data[: pos + FRAME.size + length - 1])
    expected = keys_of(node.reg)
    # (the torn delete never happened: its keys are back, with their own locations)
    reg, journal = open_registry(node.state_dir, node.pool)
    try:
        assert set(torn[1]) <= set(reg.keys)
        assert {k: v for k, v in keys_of(reg).items() if k not in torn[1]} == expected
        assert journal.damaged_bytes_dropped == FRAME.size + length - 1
        assert last.stat().st_size == pos and journal.generation == 2
    finally:
        journal.close()


def test_a_torn_journal_followed_only_by_an_empty_one_is_a_torn_tail(tmp_path, monkeypatch):
    """No record after the damage anywhere in the chain: a torn tail (the chain's), not
    damage in the middle; appends go on in the chain's last journal."""
    node = Node(tmp_path)
    chain_of_two(node, monkeypatch, appends_after=False)
    first = node.path("journal-1.log")
    data = first.read_bytes()
    pos, _ = last_frame(data)
    first.write_bytes(data[: pos + 3])
    assert node.path("journal-2.log").stat().st_size == 0
    reg, journal = open_registry(node.state_dir, node.pool)
    try:
        assert first.stat().st_size == pos and journal.generation == 2
        register(reg, "A", [["after", node.rid, 4000 * 4096, 10]])
    finally:
        journal.close()
    assert "after" in node.restarted()


def test_a_journal_missing_from_the_chain_refuses(tmp_path, monkeypatch):
    node = Node(tmp_path)
    chain_of_two(node, monkeypatch)
    node.path("journal-1.log").unlink()  # snapshot 1, then journal-2 alone
    with pytest.raises(RuntimeError, match=r"journal-1\.log is missing"):
        node.restarted()
    assert node.files() == ["journal-2.log", SNAPSHOT_NAME]


# -- what stays synchronous, and waits -----------------------------------------------------------


@pytest.mark.parametrize("error", ["sync_error", "write_error"])
def test_a_recovery_snapshot_is_written_on_the_loop(tmp_path, error):
    """After a failed append or fsync no change may be accepted until the state is whole on
    disk: the snapshot is on disk when `start_snapshot` returns, and the errors are cleared."""
    node = Node(tmp_path)
    node.history()
    setattr(node.journal, error, OSError(errno.EIO, "Input/output error (test)"))
    assert not node.journal.writable if error == "write_error" else node.journal.writable
    node.hk.run()
    assert node.journal._writer is None  # no thread was started
    assert node.journal.generation == 2 and node.snapshot_generation() == 2
    assert node.files() == ["journal-2.log", SNAPSHOT_NAME]
    assert node.journal.sync_error is None and node.journal.write_error is None
    node.journal.close()


def test_a_failed_fsync_of_the_old_journal_writes_on_the_loop(tmp_path, monkeypatch):
    node = Node(tmp_path)
    node.history()
    node.journal.fsync_interval = 3600  # the syncer leaves the last records unsynced
    node.add(1)
    real, fail = os.fsync, [True]

    def fsync(fd: int) -> None:
        if fail[0] and JOURNAL_FILE.search(os.readlink(f"/proc/self/fd/{fd}")):
            fail[0] = False
            raise OSError(errno.EIO, "Input/output error (test)")
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    assert not node.journal.start_snapshot(persistence.snapshot_packed(node.reg))
    assert not fail[0] and node.journal.fsync_errors == 1
    assert node.journal._writer is None and node.snapshot_generation() == 2
    assert node.journal.sync_error is None
    expected = keys_of(node.reg)
    node.journal.close()
    assert node.restarted() == expected


def test_close_waits_for_the_write_in_flight(tmp_path, monkeypatch):
    node = Node(tmp_path)
    held = held_in_flight(node, monkeypatch, before_rename=True, raises=False)
    expected = keys_of(node.reg)
    closer = threading.Thread(target=node.journal.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive()  # held with the writer
    held.release.set()
    closer.join(WAIT_S)
    assert not closer.is_alive() and node.journal._fd == -1
    assert node.files() == ["journal-2.log", SNAPSHOT_NAME]  # it landed before the close ended
    assert node.snapshot_generation() == 2
    assert node.restarted() == expected


def test_a_snapshot_on_the_loop_waits_for_the_write_in_flight(tmp_path, monkeypatch):
    node = Node(tmp_path)
    held = held_in_flight(node, monkeypatch, before_rename=True, raises=False)
    assert node.journal.snapshot_in_flight and not node.journal.needs_snapshot
    node.journal.write_error = OSError(errno.EIO, "Input/output error (test)")
    assert not node.journal.needs_snapshot  # the recovery waits for the write in flight
    threading.Timer(0.1, held.release.set).start()
    node.journal.write_snapshot(persistence.snapshot_packed(node.reg))  # waits, then writes
    assert held.release.is_set() and node.journal.generation == 3
    assert node.snapshot_generation() == 3 and node.files() == ["journal-3.log", SNAPSHOT_NAME]
    assert node.journal.writable
    expected = keys_of(node.reg)
    node.journal.close()
    assert node.restarted() == expected


def test_many_background_snapshots_under_changes_lose_nothing(tmp_path):
    """Snapshots back to back (each waits for the one before), changes between them and while
    they are written: every generation lands, and a restart restores the registry."""
    node = Node(tmp_path)
    for round_ in range(60):
        keys = node.add(8)
        node.delete(keys[:2])
        assert node.journal.start_snapshot(persistence.snapshot_packed(node.reg))
        node.add(3)  # while it is written
        assert node.journal.generation == round_ + 1
    expected = keys_of(node.reg)
    node.journal.close()
    assert node.journal.snapshot_errors == 0
    assert node.files() == ["journal-60.log", SNAPSHOT_NAME]
    assert node.restarted() == expected
