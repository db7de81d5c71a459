"""`maru-server` keeps the registry out of the cyclic GC's reach (`gc.freeze`): at start-up
after restoring it, and after every loop turn (`MaruService.housekeeping`), so that no
collection walks 10^6 registry entries on the server's only thread.

The C key entries (`maru.server._keyindex.KeyEntry`) are not GC-tracked at all; the freezing tests
run with the tests' pure-Python model of the key index (`keyindex_model.py`), whose entries are:
they stand for what else the registry keeps."""

from __future__ import annotations

import gc

import pytest

from maru.common import protocol
from maru.common.protocol import MsgType
from maru.server import cli
from maru.server.journal import Journal
from maru.server.pool import ShmPool
from maru.server.registry import Registry
from maru.server.service import MaruService
from maru.server.state_dir import pool_generation
from maru.server.token import TokenSigner

from .keyindex_model import PyKeyEntry, use_python_key_index
from .registry_calls import register
from .service_calls import register_body

MiB = 1 << 20


@pytest.fixture(autouse=True)
def unfreeze(monkeypatch):
    """Freezing is process-wide: give the test process its GC back afterwards. And use the
    pure-Python key entries, which the GC tracks."""
    use_python_key_index(monkeypatch)
    gc.unfreeze()
    yield
    gc.unfreeze()


def young_key_entries(reg: Registry) -> int:
    """How many of `reg`'s entries a collection would scan (frozen ones are not listed)."""
    scanned = {id(o) for o in gc.get_objects() if type(o) is PyKeyEntry}
    return sum(id(entry) in scanned for entry in reg.keys.values())


def register_frame(svc: MaruService, rid: int, first: int, count: int) -> None:
    rows = [[f"k{first + i}", rid, (first + i) * 4096, 64] for i in range(count)]
    body = register_body("w", rows)
    body["session"] = svc.registry.instances.open_session(body.pop("iid"))
    _, reply = protocol.decode(svc.handle_frame(protocol.encode(MsgType.REGISTER_KV, 1, body)))
    assert reply["results"] == [0] * count


def test_server_start_up_freezes_the_restored_registry(tmp_path, monkeypatch):
    state_dir, pool_path = tmp_path / "state", tmp_path / "pool"
    state_dir.mkdir()
    pool = ShmPool(str(pool_path), 32 * MiB)
    # the pool's identity and mark, as maru-server records them (else nothing is restored)
    pool_generation(state_dir, pool)
    journal = Journal(state_dir)
    journal.load()
    reg = Registry(pool, TokenSigner(b"g" * 32), journal=journal)
    reg.instances.handshake("w", 1)
    region = reg.request_region("w", 16 * MiB)
    # (a page a value, as a writer places them: the region holds 4096)
    register(reg, "w", [[f"k{i}", region.region_id, i * 4096, 64] for i in range(4000)])
    journal.close()
    del reg, region, pool

    seen = {}

    def serve_forever(self, poll_ms=200):
        gc.collect()  # anything not frozen would now be in the generations a collection scans
        seen["keys"] = len(self.registry.keys)
        seen["young"] = young_key_entries(self.registry)
        seen["frozen"] = gc.get_freeze_count()

    monkeypatch.setattr(MaruService, "serve_forever", serve_forever)
    monkeypatch.setattr(cli, "configure_logging", lambda *a: None)
    monkeypatch.setattr(cli.signal, "signal", lambda *a: None)
    argv = ["--port", "0", "--pool", str(pool_path), "--pool-size", "32M"]
    argv += ["--state-dir", str(state_dir), "--local-socket", "none"]
    assert cli.main(argv) == 0
    assert seen["keys"] == 4000  # restored
    assert seen["young"] == 0  # ...and every entry frozen
    assert seen["frozen"] >= 4000


def test_housekeeping_freezes_what_each_turn_registered(tmp_path):
    reg = Registry(ShmPool(str(tmp_path / "pool"), 32 * MiB), TokenSigner(b"g" * 32))
    svc = MaruService(reg, "tcp://127.0.0.1:0", local_socket="none", gc_freeze=True)
    try:
        reg.instances.handshake("w", 1)
        rid = reg.request_region("w", 16 * MiB).region_id
        for turn in range(3):
            register_frame(svc, rid, turn * 1000, 1000)
            assert young_key_entries(reg) == 1000  # this turn's keys, not yet frozen
            svc.housekeeping()
            # every entry, this turn's and the earlier ones', out of the collector's reach (the
            # freeze count is no measure: a frozen object that dies leaves the frozen set)
            assert young_key_entries(reg) == 0
            assert len(reg.keys) == 1000 * (turn + 1)
    finally:
        svc.close()


def test_without_gc_freeze_the_service_leaves_the_gc_alone(tmp_path):
    reg = Registry(ShmPool(str(tmp_path / "pool"), 32 * MiB), TokenSigner(b"g" * 32))
    svc = MaruService(reg, "tcp://127.0.0.1:0", local_socket="none")
    try:
        reg.instances.handshake("w", 1)
        register_frame(svc, reg.request_region("w", 16 * MiB).region_id, 0, 100)
        svc.housekeeping()
        assert gc.get_freeze_count() == 0
        assert young_key_entries(reg) == 100
    finally:
        svc.close()


def test_c_key_entries_are_not_tracked_by_the_gc():
    from maru.server import _keyindex as c

    entry = c.KeyEntry(1, 4096, 64)
    assert not gc.is_tracked(entry)  # no collection ever scans 10^6 of them
    assert (entry.region_id, entry.offset, entry.length, entry.pins, entry.leases) == (
        1,
        4096,
        64,
        0,
        0,
    )
