"""No group member kills `maru-server` through the local index's shared files (docs/architecture.md,
"The local index"). With `--pool-group` the table's `.use` file is 0660 and the pool file (the
in-pool table's home, `--index-slots`) is mapped read-write by the group: a member may truncate
either under the server. The server's next store into that mapping used to die of SIGBUS, for
every instance on the node. Now its writes run under the fault guard: a fault turns the index
off for this server life (retired first, so that no reader proves a copy from it), one ERROR
says why, and the registry goes on over requests. Every read, before and after, is the bytes
stored under its key or a miss.
"""

from __future__ import annotations

import contextlib
import glob
import grp
import os
import re
import signal
import subprocess
import threading
import time
from typing import Any

import pytest

from maru import MaruAdmin
from maru.common.shmindex import USE_SUFFIX

from .test_local_index import handler, read, value

KEYS = 48  # per batch: about half of them have their slot in a `.use` file cut to half


def own_group() -> list[str]:
    """`--pool-group` with this user's own group (the server may chown to it): the files get
    the modes a real group deployment has (the `.use` file 0660)."""
    try:
        return ["--pool-group", grp.getgrgid(os.getgid()).gr_name]
    except KeyError:
        return []


def alive(server: Any) -> bool:
    """The server process is there (its pid answers) and has not exited (a short wait: a
    client may see the socket close before the exit can be reaped)."""
    if server.proc is None:
        return False
    with contextlib.suppress(subprocess.TimeoutExpired):
        server.proc.wait(0.3)
    if not server.alive():
        return False
    try:
        os.kill(server.pid, 0)
    except ProcessLookupError:
        return False
    return True


def death(server: Any) -> str:
    rc = server.proc.poll() if server.proc is not None else None
    name = signal.Signals(-rc).name if rc is not None and rc < 0 else rc
    return f"maru-server exited ({name}):\n{server.read_log()[-3000:]}"


def errors(server: Any) -> list[str]:
    return [line for line in server.read_log().splitlines() if " ERROR " in line]


def check(got: list, keys: list[str], version: int = 0) -> int:
    """Every hit is its key's bytes (`value(key, version)`), else the test fails; the hits."""
    for key, data in zip(keys, got):
        assert data is None or data == value(key, version), f"{key}: not the bytes stored"
    return sum(data is not None for data in got)


class Reads(threading.Thread):
    """Reads `keys` through the index (or the request path) in a loop until stopped, checking
    each hit's bytes: the test fails if one is wrong."""

    def __init__(self, url: str, keys: list[str]):
        super().__init__(daemon=True)
        self.url, self.keys, self.done, self.rounds, self.failure = url, keys, False, 0, None

    def run(self) -> None:
        try:
            with handler(self.url) as h:
                while not self.done:
                    check(read(h, self.keys)[0], self.keys)
                    self.rounds += 1
        except BaseException as exc:  # (reported by `stop`)
            self.failure = exc

    def stop(self) -> None:
        self.done = True
        self.join(60)
        assert not self.is_alive(), "the reader hung"
        if self.failure is not None:
            raise self.failure


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cut", ["zero", "half"])
def test_a_use_file_truncated_under_the_server_turns_the_index_off_not_the_server(
    maru_server_factory, cut
):
    """Before: the first store or delete after the truncation wrote a use byte past the end of
    the file and the server died of SIGBUS."""
    server = maru_server_factory(extra_args=own_group())
    first = [f"a{i}" for i in range(KEYS)]
    with handler(server.url) as h:
        assert h.reads_locally
        assert h.batch_store(first, [value(k) for k in first]) == [True] * KEYS
        got, local = read(h, first)
        assert local and check(got, first) == KEYS
        (use,) = glob.glob(server.pool_path + ".index.*" + USE_SUFFIX)
        # (another client reads the keys kept: a read the server answers leases them, and a
        # leased key is not deleted)
        gone, kept = first[: KEYS // 2], first[KEYS // 2 :]
        reads = Reads(server.url, kept)
        reads.start()
        while reads.rounds < 2 and reads.is_alive():
            time.sleep(0.01)

        try:
            os.truncate(use, 0 if cut == "zero" else os.stat(use).st_size // 2)
            # A delete (the table's remove), its pages reused by new keys (publish), reads of both.
            deleted = h.batch_delete(gone)
            assert alive(server), death(server)
            assert deleted == [True] * len(gone)
            second = [f"b{i}" for i in range(KEYS)]
            stored = h.batch_store(second, [value(k, 1) for k in second])
            assert alive(server), death(server)
            assert stored == [True] * KEYS
            assert read(h, gone)[0] == [None] * len(gone)  # removed: never a hit, index or not
            assert check(read(h, kept)[0], kept) == len(kept)
            assert check(read(h, second)[0], second, 1) == KEYS
        finally:
            reads.done = True  # (a failure above: the reader ends too)
        reads.stop()

    # The registry goes on over requests: a new client gets no table, stores and reads.
    assert alive(server), death(server)
    third = [f"c{i}" for i in range(KEYS)]
    with handler(server.url) as h:
        assert not h.reads_locally
        assert h.batch_store(third, [value(k, 2) for k in third]) == [True] * KEYS
        assert check(read(h, third)[0], third, 2) == KEYS
        assert check(read(h, second)[0], second, 1) == KEYS
        assert read(h, gone)[0] == [None] * len(gone)
    with MaruAdmin(server.url) as admin:
        assert admin.stats()["local_index"]["path"] is None  # (off: no table)
    assert not glob.glob(server.pool_path + ".index.*"), "the table's files stay after it is off"
    logged = errors(server)
    assert len(logged) == 1, logged
    assert use in logged[0] and "truncated" in logged[0] and "requests" in logged[0]
    assert alive(server), death(server)
    assert server.stop() == 0


def area_offset(url: str) -> int:
    """Where the in-pool table lies in the pool file (`maru status`'s local index path)."""
    with MaruAdmin(url) as admin:
        path = admin.stats()["local_index"]["path"]
    return int(re.search(r" at offset (\d+)$", path).group(1))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cut", ["table", "use"])
def test_a_pool_truncated_past_the_in_pool_table_stops_the_server_cleanly(maru_server_factory, cut):
    """The in-pool table (`--index-slots`) lies past the pool's mark: a pool file cut there
    (`table`: from the table's header on; `use`: its use bytes alone) loses no region, but a
    shrunk pool is a lost pool: the server stops within its check interval, exit status 3.
    Before: the store just after the cut, or the retire at that stop, wrote into the gone pages
    and the server died of SIGBUS instead. Reads before the stop are the bytes or misses."""
    server = maru_server_factory(extra_args=[*own_group(), "--index-slots", "1024"])
    first = [f"a{i}" for i in range(KEYS)]
    with handler(server.url) as h:
        assert h.reads_locally
        assert h.batch_store(first, [value(k) for k in first]) == [True] * KEYS
        assert check(read(h, first)[0], first) == KEYS
        offset = area_offset(server.url)
        size = os.stat(server.pool_path).st_size
        os.truncate(server.pool_path, offset if cut == "table" else size - 4096)
        second = [f"b{i}" for i in range(KEYS)]
        outcomes = h.batch_store(second, [value(k, 1) for k in second])  # (before the check)
        assert len(outcomes) == KEYS
        check(read(h, first)[0], first)
        deadline = time.monotonic() + 30
        while server.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
    rc = server.proc.poll()
    assert rc is not None, "the server did not notice its pool shrank"
    assert rc == 3, death(server)  # (the pool's loss, not a signal)
    log = server.read_log()
    assert "shrank" in log
    assert len(errors(server)) <= 1, errors(server)
