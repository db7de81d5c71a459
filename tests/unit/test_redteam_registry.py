"""Red-team attacks on the server's bookkeeping that the other tests do not make, in-process on a
real pool file and a real journal: what they prove is that none of them turns a key into a hit on
bytes that are not its value.

- A CORRUPT_KV drop, the chunk it frees reused for another key, late and forged reports of the
  dropped and the new values, then a restart (with a background snapshot that never landed, as
  after a SIGKILL mid-snapshot): the dropped key does not come back over the reused chunk, and
  the values stored since keep their places and checksums.
- The lifecycle fuzz's world (`test_registry_lifecycle_fuzz`, every invariant after every step)
  walked with attacks of its own added: stale, forged and repeated CORRUPT_KV reports, prefix
  deletes and `maru clear`, keys named twice in one delete, lease or register batch, and
  background snapshots that never land before a restart.
"""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path

import pytest

from maru.common.protocol import DeleteStatus, RegisterStatus, freed_notices
from maru.server import persistence
from maru.server.journal import Journal, JournalWriteError
from maru.server.pool import ShmPool
from maru.server.registry import Registry, clear_all, delete_prefix, drop_corrupt
from maru.server.token import TokenSigner

from . import test_registry_lifecycle_fuzz as lifecycle
from .registry_calls import locate

MiB = 1 << 20
PAGE = 4096
SIGNER = TokenSigner(b"r" * 32)
DELETED, NOT_FOUND = DeleteStatus.DELETED, DeleteStatus.NOT_FOUND


class Server:
    """A registry over a state dir and a pool file; `restart()` opens them again, as a
    maru-server killed and started again does (its journal's writes were in the kernel)."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.journal: Journal | None = None
        self.reg = self.restart()

    def restart(self) -> Registry:
        if self.journal is not None:
            self.journal.close()
        self.journal = Journal(self.tmp / "state", fsync_interval=0.0)
        snapshot, records = self.journal.load()
        reg = Registry(ShmPool(str(self.tmp / "pool"), 16 * MiB), SIGNER, journal=self.journal)
        persistence.restore(reg, snapshot, records)
        self.reg = reg
        return reg

    def close(self) -> None:
        if self.journal is not None:
            self.journal.close()


def places(reg: Registry) -> dict[str, tuple[int, int, int, int]]:
    return {k: (e.region_id, e.offset, e.length, e.checksum) for k, e in reg.keys.items()}


def test_a_corrupt_drop_survives_a_restart_and_late_reports_never_drop_a_newer_value(tmp_path):
    """Mutation caught: `drop_corrupt` removing its keys without journaling the drop (say, by
    `registry.keys.remove_many` and the counters rather than `Registry._drop_keys`): the restart
    brings "k" back at the chunk its writer was told was free, now holding "new"'s bytes."""
    server = Server(tmp_path)
    try:
        reg = server.reg
        reg.instances.handshake("W", 1)
        reg.instances.handshake("R", 2)
        rid = reg.request_region("W", 2 * MiB).region_id
        assert reg.register("W", ["k", "j"], [rid, rid], [0, PAGE], [100, 100], [77, 78]) == [0, 0]
        reg.instances["W"].freed.clear()
        read = (rid, 0, 100, 77)
        # R found "k" unlike its checksum; a forged report (another checksum) changes nothing
        assert drop_corrupt(reg, ["k"], [(rid, 0, 100, 1)], "R") == [NOT_FOUND]
        assert drop_corrupt(reg, ["k", "k"], [read, read], "R") == [DELETED, NOT_FOUND]
        # W is told its chunk is free, once, and reuses it for another key (other bytes)
        assert freed_notices(bytes(reg.instances["W"].freed)) == [[rid, 0, 100]]
        reg.instances["W"].freed.clear()
        assert reg.register("W", ["new"], [rid], [0], [100], [88]) == [RegisterStatus.REGISTERED]
        # "k" stored again elsewhere; late copies of R's report, and one naming "new"'s place
        # under "k", drop nothing
        assert reg.register("W", ["k"], [rid], [2 * PAGE], [100], [99]) == [0]
        assert drop_corrupt(reg, ["k"], [read], "R") == [NOT_FOUND]
        assert drop_corrupt(reg, ["k"], [(rid, 0, 100, 88)], "R") == [NOT_FOUND]
        live = places(reg)
        assert live == {
            "j": (rid, PAGE, 100, 78),
            "new": (rid, 0, 100, 88),
            "k": (rid, 2 * PAGE, 100, 99),
        }

        # A background snapshot that never lands (SIGKILL before its rename), then a restart:
        # the old snapshot and both journals of the chain are replayed.
        server.journal._land = lambda *args: None  # type: ignore[method-assign]
        assert server.journal.start_snapshot(persistence.snapshot_packed(reg))
        assert reg.delete(["j"]) == [DELETED]
        del live["j"]
        reg = server.restart()
        assert places(reg) == live
        located, _ = locate(reg, ["k", "new", "j"])
        assert located == [[rid, 2 * PAGE, 100], [rid, 0, 100], None]
        # the late report once more, after the restart: still the newer value's place, kept
        assert drop_corrupt(reg, ["k"], [read], "R") == [NOT_FOUND]
        assert drop_corrupt(reg, ["k"], [(rid, 2 * PAGE, 100, 99)], "R") == [DELETED]
        reg = server.restart()  # and a compacted restart serves the same
        server.journal.write_snapshot(persistence.snapshot(reg))
        reg = server.restart()
        assert places(reg) == {"new": (rid, 0, 100, 88)}
    finally:
        server.close()


# -- the lifecycle fuzz, with attacks added -----------------------------------------------------


def corrupt(w: lifecycle.World, client: lifecycle.Client) -> None:
    """CORRUPT_KV of up to 3 keys: the place read, a stale one (another offset), a forged one
    (another checksum); now and then the whole report twice in one batch."""
    if not w.reg.keys or w.refused():
        return
    keys = w.rnd.sample(sorted(w.reg.keys), min(3, len(w.reg.keys)))
    read = []
    for key in keys:
        e = w.reg.keys[key]
        offset, checksum = e.offset, e.checksum
        roll = w.rnd.random()
        if roll < 0.25:
            offset += lifecycle.CHUNK
        elif roll < 0.5:
            checksum += 1
        read.append((e.region_id, offset, e.length, checksum))
    if w.rnd.random() < 0.3:
        keys, read = keys * 2, read * 2
    drop_corrupt(w.reg, keys, read, client.iid)


def prefix(w: lifecycle.World, client: lifecycle.Client) -> None:
    """DELETE_PREFIX of a prefix, or of every key (`maru clear`): held keys stay."""
    if not w.refused():
        if w.rnd.random() < 0.15:
            clear_all(w.reg)
        else:
            delete_prefix(w.reg, w.rnd.choice(["k", "k1", "k2", "x"]))


def repeated_delete(w: lifecycle.World, client: lifecycle.Client) -> None:
    """DELETE_KV naming one key three times and a missing one."""
    if w.reg.keys and not w.refused():
        key = w.rnd.choice(sorted(w.reg.keys))
        w.reg.delete([key, key, "missing", key])


def repeated_lease(w: lifecycle.World, client: lifecycle.Client) -> None:
    """LOOKUP_KV with a lease naming one key twice."""
    if w.reg.keys:
        key = w.rnd.choice(sorted(w.reg.keys))
        lease_id = lifecycle.lease(w.reg, [key, key], client.iid)
        if lease_id:
            e = w.reg.keys[key]
            w.leases[lease_id] = {key: (e.region_id, e.offset, e.length)}


def repeated_write(w: lifecycle.World, client: lifecycle.Client) -> None:
    """REGISTER_KV of one new name at two free chunks: the second is EXISTS, its chunk free."""
    if w.refused():
        return
    w.take_reply(client)
    spaces = [
        (r, m) for r, m in sorted(client.regions.items()) if not m.parked and len(m.free) >= 2
    ]
    if not spaces:
        return
    region_id, space = w.rnd.choice(spaces)
    chunks = w.rnd.sample(sorted(space.free), 2)
    space.free.difference_update(chunks)
    name = f"k{len(w.names)}"
    w.names.append(name)
    rows = [[name, region_id, c * lifecycle.CHUNK, lifecycle.CHUNK] for c in chunks]
    statuses = [RegisterStatus.REJECTED] * 2
    try:
        statuses = lifecycle.register(w.reg, client.iid, rows)
    finally:
        for chunk, status in zip(chunks, statuses):
            if status != RegisterStatus.REGISTERED:
                space.free.add(chunk)
    assert statuses[1] != RegisterStatus.REGISTERED, statuses


def unlanded_snapshot_restart(w: lifecycle.World, client: lifecycle.Client) -> None:
    """A background snapshot whose write never lands (SIGKILL mid-snapshot), then a restart."""
    if w.refused():
        return
    w.journal._land = lambda *args: None  # type: ignore[method-assign]
    w.journal.start_snapshot(persistence.snapshot_packed(w.reg))
    lifecycle.restart(w, client)


STEPS = [
    *lifecycle.STEPS,
    (corrupt, 4),
    (prefix, 1),
    (repeated_delete, 1),
    (repeated_lease, 1),
    (repeated_write, 2),
    (unlanded_snapshot_restart, 1),
]


@pytest.mark.parametrize("seed", range(4))
def test_attacks_on_the_bookkeeping_keep_every_invariant(seed: int) -> None:
    """Mutation caught: `drop_corrupt` dropping a leased key (`deletable` reading `entry.pins`
    rather than `entry.busy`): `leases_keep_keys_in_place` fails."""
    kinds, weights = zip(*STEPS)
    clock = lifecycle.Clock()
    with tempfile.TemporaryDirectory() as tmp, lifecycle.server_clock(clock):
        w = lifecycle.World(seed, Path(tmp), clock)
        try:
            for n in range(400):
                step = w.rnd.choices(kinds, weights)[0]
                live = w.live()
                client = w.rnd.choice(live) if live else None
                if client is None:
                    step = lifecycle.handshake
                w.history.append(f"{n}: {step.__name__} {client.iid if client else ''}")
                with (
                    contextlib.suppress(lifecycle.ProtocolError, JournalWriteError),
                    lifecycle.named(w, n, step.__name__),
                ):
                    step(w, client)
                for c in w.live():
                    if w.reg.signer.session(c.iid) not in w.reg.instances.sessions:
                        w.handshake_again(c)
                if w.refused() and w.rnd.random() < 0.5:
                    lifecycle.snapshot(w, None)
                for invariant in lifecycle.INVARIANTS:
                    with lifecycle.named(w, n, invariant.__name__):
                        invariant(w)
        finally:
            w.close()
