"""The read verb's proof (`MaruHandler.read_many`: leased lookup, copy, proof, release) against
a real `maru-server`: a copy that outlived its lease while its page was rewritten is a miss,
whether the reader was paused (SIGSTOP, a real process) or the server forgot the lease; a
region freed before the reader first maps it is a miss, not an exception; the server's lease
table keeps nothing of ended leases beyond a bound."""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from maru import MaruHandler
from maru.common.memcopy import copy_values
from maru.server.holds import LeaseTable

from .workers import SPAWN

log = logging.getLogger(__name__)

A, B = b"A" * 100_000, b"B" * 100_000  # k's bytes, and the bytes written where k was
WAIT_S = 30.0


def _stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (state T in /proc)."""
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] in ("T", "t")


def _until(condition: Any, what: str) -> None:
    """Wait (bounded) until `condition()` holds."""
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"not within {WAIT_S} s: {what}"
        time.sleep(0.02)


def _owner(url: str, **kw: Any) -> MaruHandler:
    """An owner with "k" (A) and a filler in a 2 MiB region of 1 MiB chunks: after k is
    deleted, the next value it stores goes where k was."""
    owner = MaruHandler(
        server_url=url, pool_size="2M", chunk_size_bytes="1M", auto_expand=False, **kw
    )
    assert owner.batch_store(["k", "filler"], [A, b"f" * 100]) == [True, True]
    return owner


def paused_reader(url: str, keys: list[str], checksums: bool, local_index: bool, out) -> None:
    """A reader process: `read_many(keys)` whose copy stops this process (SIGSTOP) once the
    lookup was answered, before a byte is copied; the parent resumes it. Puts (proven,
    whether each key's copy holds A, whether each holds B) on `out`."""
    reader = MaruHandler(
        server_url=url, pool_size="2M", checksums=checksums, local_index=local_index
    )
    try:
        n = len(keys)
        rows = np.zeros((n, len(A)), np.uint8)
        buffers = np.array([[rows[i].ctypes.data] for i in range(n)], np.int64)
        sizes = np.array([len(A)], np.int64)

        def copy(sources: np.ndarray) -> np.ndarray | None:
            os.kill(os.getpid(), signal.SIGSTOP)  # paused here, mid-read, by ourselves
            return copy_values(sources, buffers, sizes, to_values=False, hashed=checksums)

        proven, _ = reader.read_many(keys, [(n, len(A), copy)])
        out.put((proven.tolist(), [bytes(r) == A for r in rows], [bytes(r) == B for r in rows]))
    finally:
        reader.close()


@pytest.mark.parametrize("local_index", [False, True], ids=["request", "local-index"])
@pytest.mark.parametrize("checksums", [False, True], ids=["plain", "checksums"])
def test_a_reader_stopped_past_its_lease_while_the_page_is_rewritten_gets_misses(
    maru_server_factory, checksums, local_index
):
    """A reader process stopped (SIGSTOP) between its lookup and its copy, past
    --lease-timeout; meanwhile k is deleted and its chunk written with other bytes (the same
    key, registered again where it was: the ABA case). Resumed, it copies the new bytes:
    every key of its batch (k twice) must be a miss. The fault is real: the copy holds B."""
    server = maru_server_factory(pool_size="64M", extra_args=["--lease-timeout", "0.3"])
    owner = _owner(server.url, checksums=checksums)
    out = SPAWN.Queue()
    reader = SPAWN.Process(
        target=paused_reader, args=(server.url, ["k", "k"], checksums, local_index, out)
    )
    reader.start()
    try:
        _until(lambda: _stopped(reader.pid), "the reader stops itself in its copy")
        _until(lambda: owner.stats()["leases"] == 0, "its lease ends")
        assert owner.delete("k")  # no lease protects it any more
        assert owner.store("k", B)  # k again, in k's old chunk, with other bytes
        os.kill(reader.pid, signal.SIGCONT)
        proven, holds_a, holds_b = out.get(timeout=WAIT_S)
    finally:
        os.kill(reader.pid, signal.SIGCONT)
        reader.join(WAIT_S)
    assert holds_b == [True, True] and holds_a == [False, False]  # the page really changed
    assert proven == [False, False]
    assert reader.exitcode == 0
    owner.close()


def test_a_region_freed_before_the_reader_first_maps_it_is_a_miss_not_an_error(
    maru_server_factory, tmp_path
):
    """An fsdax pool (a file per region). The reader's leased lookup is answered, then the
    reader stalls past --lease-timeout before it reads the reply; meanwhile k's owner goes
    (its region is given back) and its keys are deleted, so the region is freed and its file
    removed. The reader, which never mapped that region, then maps it to copy: before, the
    read raised FileNotFoundError (out of `read_many`, into the caller's load); now k is a
    miss and the lease is released."""
    pool = str(tmp_path / "fsdax") + "/"
    server = maru_server_factory(pool_size="64M", extra_args=["--lease-timeout", "0.3"], pool=pool)
    owner = _owner(server.url)
    (region_id,) = owner.owned_region_ids()
    reader = MaruHandler(server_url=server.url, pool_size="2M", eager_map=False, local_index=False)
    rows = np.zeros((1, len(A)), np.uint8)
    buffers = np.array([[rows[0].ctypes.data]], np.int64)
    sizes = np.array([len(A)], np.int64)
    region_file = Path(pool) / f"region-{region_id}.mem"

    def segments() -> list[tuple[int, int, Any]]:
        """Run once the lookup is sent, before its reply is read: the stall."""
        _until(lambda: reader.stats()["leases"] == 0, "the reader's lease ends")
        owner.close()  # its region goes back, with k in it
        assert reader.batch_delete(["k", "filler"]) == [True, True]  # its keys: it is freed
        _until(lambda: not region_file.exists(), "the region's file is removed")

        def copy(sources: np.ndarray) -> None:
            copy_values(sources, buffers, sizes, to_values=False)

        return [(1, len(A), copy)]

    proven, mismatched = reader.read_many(["k", "absent"], segments)
    assert proven.tolist() == [False, False]
    assert mismatched.tolist() == [False, False]
    assert reader.stats()["leases"] == 0  # (released, not left to expire)
    reader.close()


def test_the_lease_table_keeps_nothing_of_ended_leases_beyond_a_bound():
    """Each lease pushes its expiry on a heap; a lease released early used to stay there
    until its expiry time, so the heap held every lease of the last --lease-timeout (up to
    a day) whatever was live: about 100 bytes each, gigabytes for a busy reader. Now it is
    compacted: its size stays within a bound of the live leases."""
    table = LeaseTable({}, 3600.0, {"releases_refused": 0, "leases_expired": 0})
    for _ in range(20_000):
        lease_id = table.add([], None)
        assert table.release([lease_id], None) == 1
    keep = [table.add([], None) for _ in range(10)]
    assert len(table) == 10
    assert len(table._expiry) < 2 * len(table) + 2048  # (before: 20,010, one per lease taken)
    assert table.expire(time.monotonic() + 7200) == 10  # the live ones still expire
    assert not table and keep
