"""P7, the pool: a hit never comes from a recreated, truncated, over-committed or shared pool.

Real `maru-server` processes and real handlers. Values carry a checksum bound to their key
(`make_value`), and keys name their writer, so a read of another key's bytes, of a reused page
or of zeros is counted as wrong bytes.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from conftest import MaruServerProcess, tmpfs_mounted  # tests/conftest.py (on sys.path)
from maru import MaruHandler

from .test_crash_safety import KiB, handler, intact, make_value, sigkill_server, wait_until


def store(h: MaruHandler, keys: list[str], size: int = 60 * KiB) -> None:
    assert h.batch_store(keys, [make_value(k, size) for k in keys]) == [True] * len(keys)


def read_counts(reader: MaruHandler, keys: list[str]) -> tuple[int, int, int]:
    """(right bytes, misses, wrong bytes) of `keys` read by `reader` under leases."""
    right = missing = wrong = 0
    with reader.leased(keys) as infos:
        for key, info in zip(keys, infos):
            if info is None:
                missing += 1
            elif intact(key, info.view):
                right += 1
            else:
                wrong += 1
    return right, missing, wrong


def store_until_stored(h: MaruHandler, key: str) -> None:
    """The first store after the server forgot `h` fails (RegionsLost); the next one works."""
    stored = False
    for _ in range(3):
        stored = h.store(key, make_value(key, 60 * KiB))
        if stored:
            break
    assert stored


@pytest.mark.parametrize("how", ["pool-deleted", "no-restore"])
def test_long_lived_clients_never_read_a_recreated_pools_bytes_as_a_hit(
    maru_server_factory, tmp_path, how
):
    """Before P7, region ids restarted at 1 with the same tokens on a recreated pool: reader C
    kept its mapping of A's old region 1 (an equal handle) and read A's new keys from the
    deleted file; with the file kept (--no-restore), writer W wrote into the chunks it still
    held, which the server had handed to B. Every client here lives through the restart."""
    server = maru_server_factory(tmp_path / "srv", pool_size="64M")
    a = handler(server.url, pool_size="4M", timeout_ms=1000)
    w = handler(server.url, pool_size="4M", timeout_ms=1000)
    c = handler(server.url, pool_size="2M", timeout_ms=1000)
    a_keys = [f"A/old-{i}" for i in range(24)]
    w_keys = [f"W/old-{i}" for i in range(24)]
    store(a, a_keys)
    store(w, w_keys)
    assert w.batch_delete(w_keys) == [True] * 24  # W's first chunks are free (to W) again
    assert read_counts(c, a_keys) == (24, 0, 0)  # C maps A's region
    generation = c.stats()["pool"]["generation"]
    assert len(generation) == 16
    old_ids = a.owned_region_ids() + w.owned_region_ids() + c.owned_region_ids()

    sigkill_server(server)
    if how == "pool-deleted":
        os.unlink(server.pool_path)  # an operator, or a reboot clearing /dev/shm
        server.start(server.port)
    else:
        server.start(server.port, once_args=["--no-restore"])
    a_new = [f"A/new-{i}" for i in range(8)]
    for key in a_new:
        store_until_stored(a, key)
    b = handler(server.url, pool_size="4M")
    b_keys = [f"B/new-{i}" for i in range(24)]
    store(b, b_keys)
    store_until_stored(w, "W/again")  # its first try writes into the chunks it still held
    assert b.stats()["pool"]["generation"] not in ("", generation)
    new_ids = a.owned_region_ids() + b.owned_region_ids() + w.owned_region_ids()
    assert min(new_ids) > max(old_ids)  # region ids went on upward

    everything = a_keys + a_new + b_keys + ["W/again"]
    for reader in (a, b, c, w):
        right, missing, wrong = read_counts(reader, everything)
        assert wrong == 0
        assert (right, missing) == (len(everything) - len(a_keys), len(a_keys))
    for h in (a, b, c, w):
        h.close()


@pytest.mark.parametrize("keep", [1 << 20, 0])
def test_a_pool_truncated_while_the_server_was_down_serves_no_restored_key(
    maru_server_factory, tmp_path, keep
):
    server = maru_server_factory(tmp_path / "srv", pool_size="64M")
    writer = handler(server.url, pool_size="8M")
    keys = [f"trunc-{i}" for i in range(40)]
    store(writer, keys)
    writer.close()  # (this process must not touch a mapping of the truncated file)
    sigkill_server(server)
    capacity = 64 << 20
    os.truncate(server.pool_path, keep)  # (the keys lie in the first 8 MiB)
    server.restart()
    log = server.read_log()
    assert f"is {keep} bytes, shorter than its capacity {capacity}" in log
    reader = handler(server.url)
    assert read_counts(reader, keys) == (0, len(keys), 0)  # never a hit on zeros
    assert reader.stats()["keys"] == 0
    store(reader, ["fresh"])
    assert read_counts(reader, ["fresh"]) == (1, 0, 0)
    reader.close()


@pytest.mark.parametrize("how", ["truncated", "deleted"])
def test_a_pool_lost_while_running_stops_the_server_and_a_restart_starts_fresh(
    maru_server_factory, tmp_path, how
):
    server = maru_server_factory(tmp_path / "srv", pool_size="64M")
    writer = handler(server.url, pool_size="8M")
    keys = [f"live-{i}" for i in range(40)]
    store(writer, keys)
    writer.close()
    if how == "truncated":
        os.truncate(server.pool_path, 16 << 20)
    else:
        os.unlink(server.pool_path)
    proc = server.proc
    assert wait_until(lambda: proc.poll() is not None, 15), "the server did not react"
    assert proc.returncode == 3
    log = server.read_log()
    assert "CRITICAL" in log and "while serving" in log
    assert ("shrank to" if how == "truncated" else "was deleted") in log
    server.restart()
    reader = handler(server.url)
    assert read_counts(reader, keys) == (0, len(keys), 0)
    store(reader, ["after"])
    assert read_counts(reader, ["after"]) == (1, 0, 0)
    reader.close()


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 4 MiB tmpfs (needs root); unmounted after the test."""
    with tmpfs_mounted(tmp_path / "small", "4m") as mnt:
        yield mnt


def test_a_pool_larger_than_its_tmpfs_refuses_to_start(small_tmpfs, tmp_path):
    pool = small_tmpfs / "x.pool"
    big = MaruServerProcess(tmp_path / "big", pool_size="64M", pool=str(pool))
    with pytest.raises(RuntimeError) as refused:
        big.start()
    message = [line for line in str(refused.value).splitlines() if "cannot start" in line]
    assert message == [
        f"maru-server: cannot start: pool {pool} needs 64.0 MiB but {small_tmpfs} has 4.0 MiB "
        "free; use a smaller --pool-size or free space there (--preallocate then reserves the "
        "whole pool at start, so nothing else can take it later)"
    ]
    assert not pool.exists()  # nothing left behind
    fits = MaruServerProcess(
        tmp_path / "fits", pool_size="2M", pool=str(pool), extra_args=["--preallocate"]
    )
    try:
        fits.start()
        assert os.stat(pool).st_blocks * 512 >= 2 << 20  # the whole pool is allocated
        with MaruHandler(server_url=fits.url, pool_size="2M") as h:
            store(h, ["small"], 100 * KiB)
            assert read_counts(h, ["small"]) == (1, 0, 0)
    finally:
        fits.stop()


@pytest.mark.parametrize("kind", ["shm", "fsdax"])
def test_a_second_server_cannot_open_a_pool_in_use(maru_server_factory, tmp_path, kind):
    path = f"/dev/shm/maru-test-{uuid.uuid4().hex}.pool" if kind == "shm" else f"{tmp_path}/fsdax/"
    first = maru_server_factory(tmp_path / "first", pool_size="64M", pool=path)
    writer = handler(first.url, pool_size="4M")
    store(writer, ["first/0"])
    second = MaruServerProcess(tmp_path / "second", pool_size="64M", pool=path)
    with pytest.raises(RuntimeError) as refused:
        second.start()
    shown = path.rstrip("/")
    expected = f"maru-server: cannot start: pool {shown} is in use by another maru-server"
    if kind == "fsdax":
        expected += f" (pid {first.pid})"
    assert expected + "\n" in str(refused.value)
    assert Path(path).exists()  # (the refused server removed nothing)
    assert first.alive()
    store(writer, ["first/1"])
    assert read_counts(writer, ["first/0", "first/1"]) == (2, 0, 0)
    writer.close()


@pytest.mark.parametrize("kind", ["shm", "fsdax"])
def test_a_server_never_serves_the_bytes_another_server_wrote_into_its_pool_since(
    maru_server_factory, tmp_path, kind
):
    """Issue 40, case 1. Server 1 (state A) stores 16 values and is SIGKILLed; server 2
    (state B, the same --pool) stores 48 others in the same places and stops; server 1 starts
    again on A. Before, server 2 adopted the pool it had no record of, and server 1's record
    still matched the file: 16 hits, all of them server 2's bytes. Now the pool's mark says
    which state served it last: server 2 starts it fresh, server 1 finds the mark not its
    own and starts empty. A reader, and the writer that outlived the restarts, read each key
    as a miss or its own bytes."""
    path = f"/dev/shm/maru-test-{uuid.uuid4().hex}.pool" if kind == "shm" else f"{tmp_path}/fsdax/"
    size = 60 * KiB
    first = maru_server_factory(tmp_path / "A", pool_size="64M", pool=path)
    writer = handler(first.url, pool_size="4M", timeout_ms=1000)
    keys = [f"one/{i}" for i in range(16)]
    store(writer, keys, size)
    assert read_counts(writer, keys) == (16, 0, 0)
    first_places = {(r.path, r.offset) for r in writer.list_allocations()}
    sigkill_server(first)

    second = maru_server_factory(tmp_path / "B", pool_size="64M", pool=path)
    other = handler(second.url, pool_size="4M")
    others = [f"two/{i}" for i in range(48)]
    store(other, others, size)
    assert first_places <= {(r.path, r.offset) for r in other.list_allocations()}  # overlap
    other.close()
    assert second.halt() == 0
    theirs = {make_value(k, size) for k in others}

    first.start(first.port)
    reader = handler(first.url)
    for client in (reader, writer):
        right = missing = foreign = 0
        with client.leased(keys) as infos:
            for key, info in zip(keys, infos):
                if info is None:
                    missing += 1
                    continue
                got = bytes(info.view)
                foreign += got in theirs
                right += got == make_value(key, size)
        assert foreign == 0  # never server 2's bytes
        assert right + missing == len(keys)  # each key: a miss or its own bytes
    why = {"shm": "pool changed since", "fsdax": "was served by another maru-server"}[kind]
    assert why in first.read_log()  # (server 2 made the shm pool a new file)
    store(reader, ["one/after"], size)
    assert read_counts(reader, ["one/after"]) == (1, 0, 0)
    for h in (reader, writer):
        h.close()


def test_a_seal_reaches_only_the_region_its_bytes_were_written_in(maru_server_factory, tmp_path):
    """A writer reserves a run in region 1 of server 1 and writes it; server 1 is SIGKILLed
    and server 2 (its own state, the same --pool and port) starts, its region ids from 1
    again. The writer's next store re-handshakes and gets server 2's region 1; then the old
    run is sealed. Before, REGISTER_KV named only the region id, and server 2 registered the
    two keys in its own region 1, over bytes the writer never wrote there: hits with another
    key's bytes. Now the seal names each region's token as granted, and server 2 rejects it."""
    path = f"/dev/shm/maru-test-{uuid.uuid4().hex}.pool"
    chunk = 64 * KiB
    first = maru_server_factory(tmp_path / "A", pool_size="64M", pool=path)
    writer = MaruHandler(
        server_url=first.url, pool_size="8M", chunk_size_bytes=chunk, timeout_ms=1500
    )
    run = writer.alloc(chunk, 2)
    run.buf[:] = b"\x07" * (2 * chunk)
    assert run.region_id == 1
    sigkill_server(first)
    second = MaruServerProcess(tmp_path / "B", pool_size="64M", pool=path).start(first.port)
    try:
        assert writer.store("filler", b"\x09" * chunk)  # (re-handshake: server 2's region 1)
        assert 1 in writer.owned_region_ids()
        assert writer.seal(["ka", "kb"], run).wait() == [False, False]
        reader = MaruHandler(server_url=second.url, pool_size="8M", chunk_size_bytes=chunk)
        assert reader.batch_exists(["ka", "kb"]) == [False, False]
        with reader.leased(["filler"]) as infos:
            assert bytes(infos[0].view) == b"\x09" * chunk
        reader.close()
        writer.close()
    finally:
        second.stop()


@pytest.mark.parametrize(
    "how", ["restart", "damaged-mark", "another-size", "another-state", "empty-file"]
)
def test_a_maru_pool_from_an_earlier_run_is_still_reused(maru_server_factory, tmp_path, how):
    """What the server checks before it touches an existing pool file (it must be a Maru pool
    of this user's: a mark, the file its state recorded, or empty) takes nothing from a real
    one: a restart restores its keys; a pool whose mark is damaged (its state recorded the
    file), one of another --pool-size (--no-restore), one another state served, and an empty
    file made beforehand are each started fresh, never refused."""
    path = f"/dev/shm/maru-test-{uuid.uuid4().hex}.pool"
    if how == "empty-file":
        Path(path).touch(mode=0o600)
    first = maru_server_factory(tmp_path / "A", pool_size="64M", pool=path)
    writer = handler(first.url, pool_size="4M")
    keys = [f"kept/{i}" for i in range(8)]
    store(writer, keys)
    writer.close()
    first.halt()
    once: list[str] = []
    if how == "damaged-mark":
        with open(path, "r+b") as f:
            f.seek(64 << 20)  # (the mark's page, past the capacity)
            assert f.read(8) == b"MARUPOOL"
            f.seek(64 << 20)
            f.write(b"\xff" * 16)
    elif how == "another-size":
        first.pool_size, once = "32M", ["--no-restore"]
    if how == "another-state":
        server = maru_server_factory(tmp_path / "B", pool_size="64M", pool=path)
    else:
        server = first.start(first.port, once_args=once)
    assert "cannot start" not in server.read_log()
    reader = handler(server.url)
    expect = (8, 0, 0) if how in ("restart", "empty-file") else (0, 8, 0)
    assert read_counts(reader, keys) == expect  # restored, or started fresh: never wrong
    store(reader, ["after"])
    assert read_counts(reader, ["after"]) == (1, 0, 0)
    reader.close()
