"""Promise P2 (docs/reliability.md) when the state dir fills up and is freed again: a real
`maru-server`, a client that stores and deletes with known bytes, the journal's file system
running full, the space freed, the server SIGKILLed and restarted on the same state dir and
pool (issue 13, scenario 1).

- every store acknowledged (True) is back with exactly its bytes;
- every delete acknowledged (True) stays deleted;
- a store that was refused may be there or not, but if it is, with exactly its bytes;
- while the journal cannot be written, stores are refused (not acknowledged), reads go on,
  and once space is freed the server accepts changes again by itself.

The fault is real. "tmpfs": the state dir is a 2 MiB tmpfs (needs root to mount), nearly filled
with a filler file. "fsize": the server's RLIMIT_FSIZE (`prlimit`) caps the size of its files,
which `maru-server` answers with EFBIG (it ignores SIGXFSZ). A mode that cannot be set up here
is skipped with the reason.
"""

from __future__ import annotations

import os
import random
import resource
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from .test_crash_safety import handler, make_value, sigkill_server, wait_until

KiB, MiB = 1 << 10, 1 << 20
PER_BATCH = 16
SLACK = 24 * KiB  # room left in the state dir (or above the journal's size) when filled
MAX_BATCHES_TO_FILL = 400  # bounds the loop that waits for the first refusal
BATCHES_WHILE_FULL = 25  # "keep trying a while"
RECOVERY_TIMEOUT_S = 30.0  # bound on the wait for stores to be accepted again


class TmpfsFault:
    """A small tmpfs as the state dir, filled up by a filler file; freed by removing it."""

    snapshots_fail = True  # no room for a snapshot either: refused until the filler goes

    def __init__(self, state_dir: Path):
        self.state_dir = state_dir
        self.filler = state_dir / "filler"

    @contextmanager
    def mounted(self) -> Iterator[TmpfsFault]:
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root")
        self.state_dir.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(self.state_dir)],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        try:
            yield self
        finally:
            subprocess.run(["umount", "-l", str(self.state_dir)], check=False)

    def attach(self, server) -> None:
        pass

    def fill(self) -> None:
        st = os.statvfs(self.state_dir)
        free = st.f_bavail * st.f_frsize
        with open(self.filler, "wb") as f:
            f.write(b"\0" * max(0, free - SLACK))

    def free(self) -> None:
        self.filler.unlink()


class FsizeFault:
    """The server's own file size limit: its journal cannot grow past it (EFBIG)."""

    snapshots_fail = False  # a snapshot (live keys only) fits: it starts a fresh journal

    def __init__(self, state_dir: Path):
        self.state_dir = state_dir
        self.pid = 0

    @contextmanager
    def mounted(self) -> Iterator[FsizeFault]:
        if not hasattr(resource, "prlimit"):
            pytest.skip("resource.prlimit is not available")
        yield self

    def attach(self, server) -> None:
        self.pid = server.pid

    def fill(self) -> None:
        journal = max(self.state_dir.glob("journal-*.log"), key=lambda p: p.stat().st_mtime)
        hard = resource.prlimit(self.pid, resource.RLIMIT_FSIZE)[1]
        try:
            resource.prlimit(
                self.pid, resource.RLIMIT_FSIZE, (journal.stat().st_size + SLACK, hard)
            )
        except PermissionError as exc:
            pytest.skip(f"cannot limit the server's file size: {exc}")

    def free(self) -> None:
        hard = resource.prlimit(self.pid, resource.RLIMIT_FSIZE)[1]
        resource.prlimit(self.pid, resource.RLIMIT_FSIZE, (hard, hard))


class Workload:
    """Stores batches of keys with known bytes, deletes some of them, and remembers what the
    server acknowledged."""

    def __init__(self, client):
        self.client = client
        self.sizes: dict[str, int] = {}  # every key whose store was attempted
        self.stored: set[str] = set()  # acknowledged stores
        self.deleted: set[str] = set()  # acknowledged deletes
        self.refused_stores = 0
        self.refused_deletes = 0
        self.batch = 0
        self.rng = random.Random(13)

    def step(self) -> bool:
        """One batch stored, then a quarter of an earlier acknowledged batch deleted; whether
        the store was acknowledged."""
        keys = [f"full-{self.batch}-{j}" for j in range(PER_BATCH)]
        self.batch += 1
        sizes = [self.rng.randrange(512, 4 * KiB) for _ in keys]
        self.sizes.update(zip(keys, sizes))
        results = self.client.batch_store(keys, [make_value(k, s) for k, s in zip(keys, sizes)])
        assert len(set(results)) == 1, results  # a batch is one request: all or nothing
        if results[0]:
            self.stored.update(keys)
        else:
            self.refused_stores += 1
        victims = sorted(self.stored - self.deleted)[:4]
        for key, ok in zip(victims, self.client.batch_delete(victims)):
            if ok:
                self.deleted.add(key)
            else:
                self.refused_deletes += 1
        return results[0]


def check(reader, work: Workload) -> dict[str, int]:
    """Read every key ever stored with a fresh handler and count what breaks the promise."""
    counts = dict(ok=0, lost=0, resurrected=0, wrong_bytes=0, unacked_present=0)
    keys = sorted(work.sizes)
    for start in range(0, len(keys), 64):
        chunk = keys[start : start + 64]
        with reader.leased(chunk) as infos:
            for key, info in zip(chunk, infos):
                if info is not None and bytes(info.view) != make_value(key, work.sizes[key]):
                    counts["wrong_bytes"] += 1
                elif key in work.deleted:
                    counts["resurrected" if info is not None else "ok"] += 1
                elif key in work.stored:
                    counts["lost" if info is None else "ok"] += 1
                elif info is not None:
                    counts["unacked_present"] += 1
    return counts


@pytest.mark.parametrize("fault_kind", [TmpfsFault, FsizeFault], ids=["tmpfs", "fsize"])
def test_state_dir_full_then_freed_loses_nothing(maru_server_factory, tmp_path, fault_kind):
    workdir = tmp_path / "srv"
    fault = fault_kind(workdir / "state")  # the server's --state-dir (conftest)
    with fault.mounted():
        server = maru_server_factory(
            workdir, pool_size="128M", extra_args=["--heartbeat-timeout", "10"]
        )
        fault.attach(server)
        client = handler(server.url, pool_size="32M", chunk_size_bytes=4 * KiB)
        work = Workload(client)
        for _ in range(10):
            assert work.step()
        fault.fill()

        # until the journal runs full: stores refused (not acknowledged), reads go on
        while work.refused_stores == 0 and work.batch < MAX_BATCHES_TO_FILL:
            work.step()
        assert work.refused_stores > 0, "the state dir never ran full"
        stats = client.stats()
        writable_seen = [stats["journal_writable"]]
        for _ in range(BATCHES_WHILE_FULL):
            work.step()
            writable_seen.append(client.stats()["journal_writable"])
        if fault.snapshots_fail:
            assert not any(writable_seen), writable_seen
        assert client.stats()["counters"]["journal_write_errors"] >= 1
        some = sorted(work.stored - work.deleted)[:8]
        assert client.batch_exists(some) == [True] * len(some)  # reads went on

        # space freed: the server takes changes again by itself
        fault.free()
        assert wait_until(work.step, RECOVERY_TIMEOUT_S, interval=0.2), "stores stay refused"
        assert client.stats()["journal_writable"] is True
        for _ in range(10):
            assert work.step()
        client.close()

        sigkill_server(server)
        server.restart()
        reader = handler(server.url, pool_size="4M", chunk_size_bytes=4 * KiB)
        counts = check(reader, work)
        reader.close()
    assert counts["lost"] == 0, counts
    assert counts["resurrected"] == 0, counts
    assert counts["wrong_bytes"] == 0, counts
    assert counts["ok"] == len(work.stored), counts
    print(
        f"\n{fault_kind.__name__}: {len(work.stored)} stores and {len(work.deleted)} deletes "
        f"acknowledged, {work.refused_stores} store batches and {work.refused_deletes} deletes "
        f"refused; after SIGKILL: {counts}"
    )
