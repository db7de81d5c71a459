"""Reaping judges a client by its process where the server can watch it, and holds back the
regions of one reaped for silence where it cannot (issue 13, P4): a writer that was only
paused must never find its pages handed to someone else. Real child processes (SIGSTOP,
SIGKILL) behind real pidfds; the integration test is `integration/test_paused_writer.py`."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from maru.common.peer import peer_credentials
from maru.common.protocol import ErrorCode, ProtocolError, RegisterStatus
from maru.server import persistence
from maru.server.journal import Journal
from maru.server.pool import ShmPool
from maru.server.processes import ProcessWatch
from maru.server.registry import Registry
from maru.server.token import TokenSigner

from .registry_calls import register

MiB = 1 << 20
SIGNER = TokenSigner(b"p" * 32)
HOLD = 60.0


def open_registry(tmp_path, journal: Journal | None = None) -> Registry:
    pool = ShmPool(str(tmp_path / "pool"), 4 * MiB)
    reg = Registry(pool, SIGNER, journal=journal, reap_hold=HOLD)
    if journal is not None:
        persistence.restore(reg, *journal.load())
    return reg


@pytest.fixture
def child():
    """A real process to watch: `sleep`, killed after the test."""
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    proc.kill()
    proc.wait(5)


def test_a_watched_process_is_reaped_when_it_exits_never_while_it_is_stopped(tmp_path, child):
    reg = open_registry(tmp_path)
    reg.instances.handshake("A", child.pid)
    region = reg.request_region("A", 4 * MiB)  # the whole pool
    reg.instances.processes.add("A", child.pid, os.pidfd_open(child.pid))
    os.kill(child.pid, signal.SIGSTOP)
    now = time.monotonic()
    reg.instances["A"].last_seen = now - 1000  # silent for far longer than the timeout
    assert reg.instances.reap(10.0, now) == []
    assert reg.stats()["instances"]["A"]["watched_pids"] == [child.pid]
    assert region.region_id in reg.regions and not reg.regions[region.region_id].returned

    child.kill()
    child.wait(5)
    reg.instances["A"].last_seen = time.monotonic()  # not silent: it exited
    assert reg.instances.reap(10.0) == ["A"]
    # a process that exited cannot write: its empty region goes back at once, unheld
    assert region.region_id not in reg.regions and reg.pool.used == 0
    assert reg.instances.processes.pids("A") == []


def test_an_unwatched_silent_instance_is_reaped_and_its_regions_held(tmp_path):
    reg = open_registry(tmp_path)
    reg.instances.handshake("A", 1)  # a TCP client: no process to watch
    reg.instances.handshake("B", 2)
    region = reg.request_region("A", 4 * MiB)
    assert register(reg, "A", [["a", region.region_id, 0, 1000]]) == [RegisterStatus.REGISTERED]
    now = time.monotonic()
    reg.instances["A"].last_seen = now - 1000
    assert reg.instances.reap(10.0, now) == ["A"]
    held = reg.regions[region.region_id]
    assert held.returned and held.held_until > now
    assert reg.stats()["orphaned"]["held"] == 1

    # B cannot have A's pages, and the key in them is not evicted in the attempt
    with pytest.raises(ProtocolError) as exc:
        reg.request_region("B", 2 * MiB)
    assert exc.value.code == ErrorCode.POOL_FULL
    assert "a" in reg.keys
    reg.delete(["a"])  # its last key goes: still held
    assert region.region_id in reg.regions
    reg.regions.end_holds(now + HOLD / 2)
    assert region.region_id in reg.regions
    reg.regions.end_holds(held.held_until)  # the hold ends: freed, and B gets the pages
    assert region.region_id not in reg.regions and not reg.regions.held
    assert reg.request_region("B", 2 * MiB).offset == region.offset


@pytest.mark.parametrize("snapshot_first", [False, True])
def test_a_hold_outlives_a_server_restart(tmp_path, snapshot_first):
    journal = Journal(tmp_path / "state", fsync_interval=0.0)
    reg = open_registry(tmp_path, journal)
    reg.instances.handshake("A", 1)
    region = reg.request_region("A", 4 * MiB)
    reg.instances["A"].last_seen -= 1000
    assert reg.instances.reap(10.0) == ["A"]
    if snapshot_first:
        journal.write_snapshot(persistence.snapshot(reg))
    journal.close()

    journal = Journal(tmp_path / "state", fsync_interval=0.0)
    reg = open_registry(tmp_path, journal)
    restored = reg.regions[region.region_id]
    assert restored.returned
    assert HOLD - 5 < restored.held_until - time.monotonic() <= HOLD
    reg.instances.handshake("B", 2)
    with pytest.raises(ProtocolError):
        reg.request_region("B", 2 * MiB)
    journal.close()


def test_a_credential_is_held_by_the_first_process_that_speaks_for_it(tmp_path):
    """Issue 40, case 2: the first process on the Unix socket holds the instance; another
    live process is refused, and so is the holder's pid once it exited (until the reap)."""
    path = str(tmp_path / "s")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(4)
    listener.settimeout(10)
    code = f"import socket as s, time; c = s.socket(s.AF_UNIX); c.connect({path!r}); time.sleep(60)"
    procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(2)]
    watch = ProcessWatch()
    try:
        conns = {}
        for _ in procs:
            conn = listener.accept()[0]
            conns[peer_credentials(conn)[0]] = conn
        first, second = (conns[p.pid] for p in procs)
        assert watch.claim("A", first) is None  # the first to speak for it holds it
        assert watch.pids("A") == [procs[0].pid]
        assert f"not the process {procs[0].pid}" in watch.claim("A", second)
        assert watch.claim("A", first) is None  # its holder, again
        assert watch.claim("B", second) is None  # another instance: its own holder
        procs[0].kill()
        procs[0].wait(5)
        assert watch.claim("A", first) is not None  # exited: holds on until reaped
        assert watch.exited() == ["A"]
    finally:
        watch.close()
        listener.close()
        for proc in procs:
            proc.kill()
            proc.wait(5)


def test_a_region_freed_before_its_journaled_hold_ended_is_replayed_freed(tmp_path):
    """A hold is journaled as its wall-clock end; its end is judged by the monotonic clock. A
    wall clock that stepped back (an NTP correction) left the "T" record's end in the future
    when the region was freed and its pages granted again: the replay kept the region held,
    its "F" ignored, and the next grant's "R" at the same offset stopped the server from
    starting (ValueError). The "F" record says it was freed: it is, whatever the hold said."""
    journal = Journal(tmp_path / "state", fsync_interval=0.0)
    reg = open_registry(tmp_path, journal)
    reg.instances.handshake("A", 1)
    reg.instances.handshake("B", 2)
    region = reg.request_region("A", 4 * MiB)
    reg.instances["A"].last_seen -= 1000
    assert reg.instances.reap(10.0) == ["A"]
    reg.regions.end_holds(reg.regions[region.region_id].held_until)  # (wall clock: not yet)
    again = reg.request_region("B", 4 * MiB)
    assert again.offset == region.offset
    journal.close()

    journal = Journal(tmp_path / "state", fsync_interval=0.0)
    reg = open_registry(tmp_path, journal)  # before: ValueError, the server refused to start
    assert region.region_id not in reg.regions and not reg.regions.held
    assert reg.regions[again.region_id].offset == region.offset
    journal.close()
