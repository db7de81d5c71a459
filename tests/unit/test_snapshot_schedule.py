"""When the server writes a snapshot: when the journal has grown past `--snapshot-mb` (a floor)
and past the last snapshot's size. A snapshot costs what the registry holds, so a fixed size
would make a large registry snapshot as often as a small one; this way the snapshots' bytes stay
about the journal's, and a restart replays at most about a snapshot's worth of journal."""

from __future__ import annotations

import pytest

from maru.server import persistence
from maru.server.housekeeping import Housekeeping
from maru.server.journal import SNAPSHOT_NAME, Journal
from maru.server.pool import ShmPool
from maru.server.registry import Registry
from maru.server.token import TokenSigner

from .registry_calls import register

MiB = 1 << 20
SIGNER = TokenSigner(b"q" * 32)
FLOOR = 2048  # --snapshot-mb, in bytes


class Node:
    """A journal, a registry on it and its housekeeping, as `maru-server` builds them."""

    def __init__(self, tmp_path, floor: int = FLOOR):
        self.tmp_path = tmp_path
        self.journal = Journal(tmp_path / "state", fsync_interval=0.0, snapshot_bytes=floor)
        snapshot, records = self.journal.load()
        self.reg = Registry(ShmPool(str(tmp_path / "pool"), 64 * MiB), SIGNER, journal=self.journal)
        persistence.restore(self.reg, snapshot, records)
        self.hk = Housekeeping(self.reg, self.journal, 3600.0, False, lambda reason: None)
        self.next = 0

    def add(self, n: int) -> list[str]:
        if "A" not in self.reg.instances:
            self.reg.instances.handshake("A", 1)
            self.rid = self.reg.request_region("A", 32 * MiB).region_id
        keys = [f"key-{self.next + i:08d}" for i in range(n)]
        offsets = [(self.next + i) % 8000 * 4096 for i in range(n)]
        register(self.reg, "A", [[k, self.rid, o, 4096] for k, o in zip(keys, offsets)])
        self.next += n
        return keys

    def snapshot_file_size(self) -> int:
        return (self.tmp_path / "state" / SNAPSHOT_NAME).stat().st_size


def test_a_snapshot_smaller_than_the_floor_leaves_the_floor(tmp_path):
    node = Node(tmp_path)
    node.journal.write_snapshot(persistence.snapshot_packed(node.reg))
    assert 0 < node.journal.snapshot_size < FLOOR
    assert node.journal.snapshot_threshold == FLOOR
    while not node.journal.needs_snapshot:
        node.add(1)
    assert FLOOR <= node.journal._size < FLOOR + 200  # (one record of one key past it)
    node.journal.close()


def test_a_large_snapshot_raises_the_threshold_to_its_size(tmp_path):
    node = Node(tmp_path)
    node.add(1000)  # a snapshot of about 25 KB: ten times the floor
    node.journal.write_snapshot(persistence.snapshot_packed(node.reg))
    size = node.journal.snapshot_size
    assert size == node.snapshot_file_size() and size > 10 * FLOOR
    assert node.journal.snapshot_threshold == size
    while not node.journal.needs_snapshot:
        assert node.journal._size < size  # not at the floor: at the snapshot's size
        node.add(5)
    assert size <= node.journal._size < size + 1000
    node.journal.close()

    # a restart reads the snapshot's size from its file: the same threshold
    again = Node(tmp_path)
    assert again.journal.snapshot_size == size and again.journal.snapshot_threshold == size
    again.journal.close()


@pytest.mark.parametrize("error", ["sync_error", "write_error"])
def test_a_failed_fsync_or_write_still_asks_for_a_snapshot_at_once(tmp_path, error):
    node = Node(tmp_path)
    node.add(1000)
    node.journal.write_snapshot(persistence.snapshot_packed(node.reg))
    assert not node.journal.needs_snapshot
    setattr(node.journal, error, OSError(5, "EIO"))
    assert node.journal.needs_snapshot  # whatever the journal's size
    node.journal.write_snapshot(persistence.snapshot_packed(node.reg))
    assert not node.journal.needs_snapshot
    node.journal.close()


def test_churn_snapshots_once_per_journal_of_the_snapshots_size(tmp_path):
    """A full registry under churn (each new key evicts an old one, as a full pool does): the
    housekeeping writes a snapshot only when the journal has reached the size of the last one,
    so the snapshots' bytes stay under the journal's, where a fixed floor would have written
    one every FLOOR bytes: about ten times as many."""
    node = Node(tmp_path)
    node.add(1000)
    node.hk.run()
    node.journal.wait_snapshot()  # (the write is in the background: one at a time)
    assert node.journal.generation == 1  # the journal (about 25 KB) passed the floor
    sizes, journaled, written, journal_total = [node.journal.snapshot_size], 0, 0, 0
    live = list(node.reg.keys)
    for _ in range(150):
        before, generation = node.journal._size, node.journal.generation
        threshold = node.journal.snapshot_threshold
        new = node.add(20)
        node.reg.delete(live[:20])
        live = live[20:] + new
        journaled += node.journal._size - before
        node.hk.run()
        node.journal.wait_snapshot()
        if node.journal.generation != generation:
            assert journaled >= threshold >= sizes[-1] > FLOOR
            written += node.journal.snapshot_size
            journal_total += journaled
            sizes.append(node.journal.snapshot_size)
            journaled = 0
        else:
            assert journaled < threshold
    snapshots = len(sizes) - 1
    assert 2 <= snapshots <= 150 * 20 * 80 // (10 * FLOOR)  # (80: a key's K and D bytes)
    assert written <= 1.05 * journal_total  # a snapshot's bytes per journal byte: about 1
    assert max(sizes) < 2 * min(sizes)  # the registry kept its size
    node.journal.close()
