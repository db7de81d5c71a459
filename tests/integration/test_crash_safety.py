"""Crash safety with real processes and SIGKILL.

- A client killed in the middle of a batch store is reaped after --heartbeat-timeout: its pins
  and leases are released, its regions become owner-less, its keys stay readable, its regions
  are freed once no key points into them, and no batch is half-registered.
- A writer killed between writing bytes and registering them leaves no key and no page.
- `maru-server` killed with SIGKILL and restarted on the same --state-dir and pool: every key
  registered before the kill is back with the same bytes, and handlers that were connected
  carry on (a call may fail while the server is down). A recreated pool (the memory is gone)
  is detected and the registry starts empty instead of pointing into the wrong memory.

Values carry a checksum bound to their key: the first 16 bytes are blake2b(key + rest).
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from maru import MaruHandler

from .workers import SPAWN

KiB, MiB = 1 << 10, 1 << 20
TAG = 16  # checksum bytes at the front of every value
REAP_ARGS = ["--heartbeat-timeout", "1.5", "--lease-timeout", "60"]
# where nobody should be reaped: a little more slack for a busy machine
LIVE_ARGS = ["--heartbeat-timeout", "2", "--lease-timeout", "60"]


# -- values -------------------------------------------------------------------------------------


def make_value(key: str, size: int) -> bytes:
    """`size` bytes: a key-seeded pattern, prefixed by blake2b(key + pattern)."""
    seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    words = -(-(size - TAG) // 8)
    body = (np.arange(words, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15 | 1)) ^ np.uint64(seed)
    rest = body.tobytes()[: size - TAG]
    return hashlib.blake2b(key.encode() + rest, digest_size=TAG).digest() + rest


def intact(key: str, buf: Any) -> bool:
    view = memoryview(buf)
    if view.nbytes <= TAG:
        return False
    h = hashlib.blake2b(key.encode(), digest_size=TAG)
    h.update(view[TAG:])
    return h.digest() == bytes(view[:TAG])


def wait_until(predicate: Callable[[], Any], timeout: float, interval: float = 0.05) -> Any:
    """Poll until `predicate()` is truthy (returned) or `timeout` passes (returns the last
    falsy value). A bound, not a performance threshold."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def handler(url: str, **kw: Any) -> MaruHandler:
    kw.setdefault("pool_size", "2M")
    kw.setdefault("chunk_size_bytes", 64 * KiB)
    kw.setdefault("timeout_ms", 2000)
    h = MaruHandler(server_url=url, **kw)
    assert h.connected
    return h


def verify_all(reader: MaruHandler, keys: list[str]) -> tuple[int, int, int]:
    """(present and intact, missing, corrupt), read under leases."""
    good = missing = bad = 0
    for start in range(0, len(keys), 64):
        chunk = keys[start : start + 64]
        with reader.leased(chunk) as infos:
            for key, info in zip(chunk, infos):
                if info is None:
                    missing += 1
                elif intact(key, info.view):
                    good += 1
                else:
                    bad += 1
    return good, missing, bad


def batch_keys(prefix: str, batch: int, n: int) -> list[str]:
    return [f"{prefix}-{batch}-{j}" for j in range(n)]


def batch_sizes(prefix: str, batch: int, n: int, lo: int, hi: int) -> list[int]:
    rng = random.Random(f"{prefix}/{batch}")
    return [rng.randrange(lo, hi) for _ in range(n)]


# -- child processes (spawned: a fresh interpreter, its own handler and mappings) ----------------


def batch_writer(url: str, prefix: str, per_batch: int, info_q: Any, progress: Any) -> None:
    """Store batches forever (bounded); pin batch 0, hold a read lease on batch 1, and count
    completed batches in `progress` (-1 if a store ever fails). Waits to be killed."""
    h = handler(url, pool_size="256M")  # up to the whole pool: no eviction before the kill
    info_q.put(h.instance_id)
    lease_cm = None
    for b in range(400):
        keys = batch_keys(prefix, b, per_batch)
        sizes = batch_sizes(prefix, b, per_batch, 4 * KiB, 256 * KiB)
        ok = h.batch_store(keys, [make_value(k, s) for k, s in zip(keys, sizes)])
        if not all(ok):
            progress.value = -1
            break
        if b == 0:
            assert h.batch_pin(keys) == [True] * per_batch
        if b == 1:
            lease_cm = h.leased(keys)
            assert all(i is not None for i in lease_cm.__enter__())  # held until we die
        progress.value = b + 1
    time.sleep(600)
    del lease_cm


def write_without_register(url: str, keys: list[str], info_q: Any) -> None:
    """Allocate pages and write values, then report and wait to be killed before
    registering anything."""
    h = handler(url, pool_size="8M")
    handles = []
    for key in keys:
        value = make_value(key, 100 * KiB)
        a = h.alloc(len(value))
        assert a is not None
        a.buf[: len(value)] = value
        handles.append(a)
    info_q.put((h.instance_id, h.owned_region_ids()))
    time.sleep(600)


def streaming_writer(url: str, prefix: str, per_batch: int, out_q: Any, stop: Any) -> None:
    """Store batches until `stop`; report (batch, results) for each. Failures are expected
    while the server is down; nothing is retried, the stream just goes on."""
    h = handler(url, pool_size="256M", timeout_ms=500)  # the whole pool: nothing evicted
    try:
        for b in range(2000):
            if stop.is_set():
                break
            keys = batch_keys(prefix, b, per_batch)
            sizes = batch_sizes(prefix, b, per_batch, 1 * KiB, 64 * KiB)
            out_q.put((b, h.batch_store(keys, [make_value(k, s) for k, s in zip(keys, sizes)])))
            time.sleep(0.002)
    finally:
        out_q.put(None)
        h.close()


def kill_and_reap(proc: Any, observer: MaruHandler, iid: str, timeout: float = 30) -> float:
    """SIGKILL a child and wait until the server has reaped its instance; returns seconds."""
    os.kill(proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    proc.join(10)
    assert proc.exitcode == -signal.SIGKILL
    reaped = wait_until(lambda: iid not in observer.stats()["instances"], timeout)
    assert reaped, f"instance {iid} not reaped within {timeout} s"
    return time.monotonic() - killed


# -- client crashes ------------------------------------------------------------------------------


def test_sigkill_client_mid_batch_store(maru_server_factory, tmp_path):
    server = maru_server_factory(tmp_path / "srv", pool_size="256M", extra_args=REAP_ARGS)
    observer = handler(server.url)
    used_before = observer.stats()["pool"]["used"]
    per_batch = 12
    info_q, progress = SPAWN.Queue(), SPAWN.Value("i", 0, lock=False)
    child = SPAWN.Process(
        target=batch_writer, args=(server.url, "mid", per_batch, info_q, progress), daemon=True
    )
    child.start()
    try:
        iid = info_q.get(timeout=30)
        assert wait_until(lambda: progress.value >= 6 or progress.value < 0, 60)
        assert progress.value > 0, "the writer's stores failed before the kill"
        time.sleep(random.uniform(0, 0.03))  # land somewhere inside a later batch
        stats = observer.stats()
        assert stats["instances"][iid]["pins"] == per_batch
        assert stats["leases"] == 1
        child_regions = {
            h.region_id for h in observer.list_allocations(all_instances=True) if h.owner == iid
        }
        assert child_regions
        reap_seconds = kill_and_reap(child, observer, iid)
    finally:
        if child.is_alive():
            child.kill()
    done = progress.value  # batches 0..done-1 returned; batch `done` was in flight (or not)
    stats = observer.stats()
    assert stats["counters"]["instances_reaped"] >= 1
    assert stats["leases"] == 0  # the child's lease went with it (--lease-timeout is 60 s)

    # every completed batch is readable, byte for byte
    completed = [k for b in range(done) for k in batch_keys("mid", b, per_batch)]
    assert verify_all(observer, completed) == (len(completed), 0, 0)
    # the batch in flight is all or nothing; later batches never existed
    in_flight = batch_keys("mid", done, per_batch)
    present = observer.batch_exists(in_flight)
    assert all(present) or not any(present), present
    if all(present):
        assert verify_all(observer, in_flight) == (per_batch, 0, 0)
        completed += in_flight
    later = [k for b in range(done + 1, done + 4) for k in batch_keys("mid", b, per_batch)]
    assert not any(observer.batch_exists(later))

    # the regions its keys live in are owner-less now but still there; any region of the
    # child without a key (e.g. one it had just taken) was freed at once
    holding = {info.region_id for info in observer.batch_retrieve(completed)}
    listed = {h.region_id: h for h in observer.list_allocations(all_instances=True)}
    assert holding and holding <= set(listed)
    assert all(listed[r].owner == iid for r in holding)
    assert set(listed) & child_regions == holding & child_regions
    # pins and leases were released: every key can be deleted (batch 0 was pinned,
    # batch 1 leased)
    assert observer.batch_delete(completed) == [True] * len(completed)
    # no key points into the child's regions any more: they are freed, nothing leaked
    listed = {h.region_id for h in observer.list_allocations(all_instances=True)}
    assert not child_regions & listed
    assert observer.stats()["pool"]["used"] == used_before
    observer.close()
    print(f"\nreaped {reap_seconds:.2f} s after SIGKILL (timeout 1.5 s); {done} batches done")


def test_writer_killed_between_write_and_register(maru_server_factory, tmp_path):
    server = maru_server_factory(tmp_path / "srv", pool_size="64M", extra_args=REAP_ARGS)
    observer = handler(server.url)
    before = observer.stats()
    keys = [f"unregistered-{i}" for i in range(6)]
    info_q = SPAWN.Queue()
    child = SPAWN.Process(
        target=write_without_register, args=(server.url, keys, info_q), daemon=True
    )
    child.start()
    try:
        iid, region_ids = info_q.get(timeout=30)
        during = observer.stats()
        assert during["pool"]["used"] > before["pool"]["used"]  # the writer holds a region
        assert observer.batch_exists(keys) == [False] * len(keys)  # written is not visible
        kill_and_reap(child, observer, iid)
    finally:
        if child.is_alive():
            child.kill()
    after = observer.stats()
    assert observer.batch_exists(keys) == [False] * len(keys)
    assert after["keys"] == before["keys"]
    listed = {h.region_id for h in observer.list_allocations(all_instances=True)}
    assert not set(region_ids) & listed
    assert after["pool"]["used"] == before["pool"]["used"]
    assert after["counters"]["regions_freed"] >= before["counters"]["regions_freed"] + 1
    # the freed space is usable again by anyone
    assert observer.store("after", make_value("after", 300 * KiB))
    observer.close()


def test_idle_and_read_only_clients_are_not_reaped(maru_server_factory, tmp_path):
    """Heartbeats (and lookups) keep an instance alive; only silence gets it reaped."""
    server = maru_server_factory(tmp_path / "srv", pool_size="64M", extra_args=LIVE_ARGS)
    idle = handler(server.url)
    reader = handler(server.url)
    assert idle.store("idle-key", make_value("idle-key", 10 * KiB))
    reader.pin("idle-key")
    deadline = time.monotonic() + 5.0  # well past the 2 s heartbeat timeout
    while time.monotonic() < deadline:
        assert reader.exists("idle-key")
        time.sleep(0.2)
    stats = reader.stats()
    assert {idle.instance_id, reader.instance_id} <= set(stats["instances"])
    assert stats["counters"]["instances_reaped"] == 0
    assert stats["instances"][reader.instance_id]["pins"] == 1
    assert idle.store("idle-key-2", make_value("idle-key-2", 10 * KiB))  # still a writer
    idle.close()
    reader.close()


def test_a_frozen_server_does_not_reap_live_clients_when_it_resumes(maru_server_factory, tmp_path):
    """SIGSTOP the server for longer than the heartbeat timeout (a paused VM or container, a
    debugger): on SIGCONT it must read the heartbeats queued meanwhile before it judges who
    is silent, or every live client loses its pins and regions."""
    server = maru_server_factory(tmp_path / "srv", pool_size="64M", extra_args=LIVE_ARGS)
    client = handler(server.url, timeout_ms=1000)
    assert client.store("frozen", make_value("frozen", 10 * KiB))
    assert client.pin("frozen")
    os.kill(server.pid, signal.SIGSTOP)
    try:
        time.sleep(5.0)  # > 2 s heartbeat timeout; the client keeps heart-beating
    finally:
        os.kill(server.pid, signal.SIGCONT)
    assert retry(lambda: client.exists("frozen"))[0]
    time.sleep(0.5)
    stats = client.stats()
    assert client.instance_id in stats["instances"]
    assert stats["counters"]["instances_reaped"] == 0
    assert stats["instances"][client.instance_id]["pins"] == 1
    client.close()


# -- server crashes ------------------------------------------------------------------------------


def sigkill_server(server) -> None:
    server.proc.kill()
    assert server.proc.wait(10) == -signal.SIGKILL


def retry(fn: Callable[[], Any], attempts: int = 5) -> tuple[Any, int]:
    """Call until truthy; returns (result, attempts used)."""
    for i in range(1, attempts + 1):
        result = fn()
        if result:
            return result, i
    return result, attempts


def test_sigkill_server_restart_keeps_every_key(maru_server_factory, tmp_path):
    server = maru_server_factory(
        tmp_path / "srv", pool_size="256M", extra_args=["--heartbeat-timeout", "3"]
    )
    writer = handler(server.url, pool_size="256M", timeout_ms=1000)  # the whole pool
    keys = [f"persist-{i}" for i in range(240)]
    sizes = batch_sizes("persist", 0, len(keys), 1 * KiB, 512 * KiB)
    for start in range(0, len(keys), 16):
        chunk = keys[start : start + 16]
        values = [make_value(k, s) for k, s in zip(chunk, sizes[start : start + 16])]
        assert writer.batch_store(chunk, values) == [True] * len(chunk)
    deleted = keys[::12]
    assert writer.batch_delete(deleted) == [True] * len(deleted)
    kept = [k for k in keys if k not in set(deleted)]
    before = writer.stats()
    regions_before = sorted(writer.owned_region_ids())

    sigkill_server(server)
    assert writer.batch_retrieve(kept[:1]) == [None]  # the server is down: the call fails
    server.restart()
    assert "restored" in server.read_log()

    reader = handler(server.url)
    assert verify_all(reader, kept) == (len(kept), 0, 0)
    assert reader.batch_exists(deleted) == [False] * len(deleted)  # deletions persisted too
    after = reader.stats()
    assert after["keys"] == before["keys"] == len(kept)
    assert after["live_bytes"] == before["live_bytes"]
    assert after["epoch"] != before["epoch"]

    # the handler from before the kill carries on: same regions, reads and writes work
    found, attempts = retry(lambda: writer.exists(kept[0]))
    assert found and attempts <= 3
    info = writer.retrieve(kept[-1])
    assert info is not None and intact(kept[-1], info.view)
    assert writer.store("post-restart", make_value("post-restart", 200 * KiB))
    assert sorted(writer.owned_region_ids()) == regions_before
    # it stays alive past the heartbeat timeout (it was restored as an instance and keeps
    # heart-beating), so its regions are not reaped away
    time.sleep(4.0)
    stats = reader.stats()
    assert writer.instance_id in stats["instances"]
    assert stats["counters"]["instances_reaped"] == 0
    assert writer.store("post-restart-2", make_value("post-restart-2", 200 * KiB))
    assert verify_all(reader, ["post-restart", "post-restart-2"]) == (2, 0, 0)
    print(f"\nrestart: {len(kept)} keys back intact; old handler's first call: attempt {attempts}")
    writer.close()
    reader.close()


def test_sigkill_server_under_load_loses_no_acknowledged_key(maru_server_factory, tmp_path):
    # tiny --snapshot-mb: snapshots and journal generations rotate while the writer runs
    server = maru_server_factory(
        tmp_path / "srv", pool_size="256M", extra_args=["--snapshot-mb", "0.01"]
    )
    out_q, stop = SPAWN.Queue(), SPAWN.Event()
    per_batch = 8
    child = SPAWN.Process(
        target=streaming_writer, args=(server.url, "load", per_batch, out_q, stop), daemon=True
    )
    child.start()
    results: dict[int, list[bool]] = {}
    try:

        def drain(until: Callable[[], bool], timeout: float) -> bool:
            deadline = time.monotonic() + timeout
            while not until():
                if time.monotonic() > deadline:
                    return False
                item = out_q.get(timeout=max(0.1, deadline - time.monotonic()))
                if item is None:
                    return until()
                results[item[0]] = item[1]
            return True

        assert drain(lambda: len(results) >= 15, 60)
        assert wait_until(lambda: server.read_log().count("snapshot generation") >= 3, 30)
        sigkill_server(server)
        time.sleep(0.5)  # the writer keeps calling a dead server meanwhile
        server.restart()

        def recovered() -> bool:
            """15 good batches after the last failed one (the failures are the outage)."""
            failed = [b for b, ok in results.items() if not all(ok)]
            return (
                bool(failed) and sum(all(ok) for b, ok in results.items() if b > failed[-1]) >= 15
            )

        assert drain(recovered, 60), "the writer did not recover after the restart"
        stop.set()
        drain(lambda: False, 30)  # collect the rest until the child's end marker
    finally:
        stop.set()
        child.join(30)
        if child.is_alive():
            child.kill()
    acked = [b for b, ok in results.items() if all(ok)]
    failed = [b for b, ok in results.items() if not all(ok)]
    assert failed, "no call failed: the kill did not land while the writer was working"
    reader = handler(server.url)
    acked_keys = [k for b in acked for k in batch_keys("load", b, per_batch)]
    assert verify_all(reader, acked_keys) == (len(acked_keys), 0, 0)
    # in a batch that failed, a key reported stored is there; one reported failed may be
    # there too (its reply was lost); whatever is there is intact
    registered_anyway = 0
    for b in failed:
        keys = batch_keys("load", b, per_batch)
        present = reader.batch_exists(keys)
        assert all(p for p, ok in zip(present, results[b]) if ok), (b, present, results[b])
        assert verify_all(reader, keys)[2] == 0
        registered_anyway += sum(p and not ok for p, ok in zip(present, results[b]))
    reader.close()
    print(
        f"\n{len(results)} batches, {len(acked)} acknowledged and all retrievable; "
        f"{len(failed)} failed around the kill: {failed} ({registered_anyway} keys reported "
        "failed were registered all the same)"
    )


def test_restart_on_a_recreated_pool_starts_empty(maru_server_factory, tmp_path):
    """The pool memory is gone (here: the /dev/shm file was recreated, as after a reboot).
    Persisted locations would point into zeroed memory: the server starts empty instead,
    and a connected handler re-attaches and writes its values again."""
    server = maru_server_factory(tmp_path / "srv", pool_size="64M")
    writer = handler(server.url, pool_size="8M", timeout_ms=1000)
    assert writer.batch_store(["lost-0", "lost-1"], [make_value("lost-0", 5000)] * 2)
    sigkill_server(server)
    os.unlink(server.pool_path)  # a lost device: its bytes are gone
    server.restart()
    assert "pool changed" in server.read_log()
    reader = handler(server.url)
    assert reader.batch_exists(["lost-0", "lost-1"]) == [False, False]
    assert reader.stats()["keys"] == 0
    value = make_value("again", 50 * KiB)
    stored, _ = retry(lambda: writer.store("again", value))
    assert stored
    info = reader.retrieve("again")
    assert info is not None and intact("again", info.view)
    writer.close()
    reader.close()


def test_restart_ignores_a_torn_journal_tail(maru_server_factory, tmp_path):
    """The server was killed in the middle of writing a journal record: the half record (here
    one that would register a key) is detected by its checksum/length, dropped and never
    replayed; everything before it is restored."""
    from maru.server.journal import _frame

    server = maru_server_factory(tmp_path / "srv", pool_size="64M")
    writer = handler(server.url, pool_size="8M")
    keys = [f"torn-ok-{i}" for i in range(20)]
    assert writer.batch_store(keys, [make_value(k, 20 * KiB) for k in keys]) == [True] * 20
    region_id = writer.owned_region_ids()[0]
    sigkill_server(server)
    (journal,) = server.state_dir.glob("journal-*.log")
    size = journal.stat().st_size
    record = _frame(["K", [["torn-ghost", region_id, 7 * MiB, 10]]])
    with open(journal, "ab") as f:
        f.write(record[: len(record) - 3])  # torn: the last bytes never made it
    server.restart()
    assert f"ignoring {len(record) - 3} damaged bytes" in server.read_log()
    reader = handler(server.url)
    assert verify_all(reader, keys) == (len(keys), 0, 0)
    assert not reader.exists("torn-ghost")
    assert reader.stats()["keys"] == len(keys)
    # (the restored state was compacted into a new snapshot; the torn bytes are gone)
    assert all(p.stat().st_size <= size for p in server.state_dir.glob("journal-*.log"))
    writer.close()
    reader.close()


def _chunk_reuse_history(server) -> tuple[MaruHandler, list[str]]:
    """24 keys, then 8 more (the writer's 2 MiB region is full), delete the first 8 and store 8
    new ones in their chunks. Returns the writer and every key named."""
    writer = handler(server.url, pool_size="2M")
    old, mid, new = ([f"{p}-{i}" for i in range(n)] for p, n in (("k", 24), ("m", 8), ("n", 8)))
    assert writer.batch_store(old, [make_value(k, 64 * KiB) for k in old]) == [True] * 24
    assert writer.batch_store(mid, [make_value(k, 64 * KiB) for k in mid]) == [True] * 8
    assert writer.batch_delete(old[:8]) == [True] * 8
    assert writer.batch_store(new, [make_value(k, 64 * KiB) for k in new]) == [True] * 8
    return writer, old + mid + new


def _frames(data: bytes) -> list[tuple[int, int, Any]]:
    """(offset, payload length, record) of each frame of an intact journal."""
    import msgpack

    from maru.server.journal import FRAME

    out, pos = [], 0
    while pos < len(data):
        length, _ = FRAME.unpack_from(data, pos)
        payload = data[pos + FRAME.size : pos + FRAME.size + length]
        out.append((pos, length, msgpack.unpackb(payload, raw=False, strict_map_key=False)))
        pos += FRAME.size + length
    return out


@pytest.mark.parametrize("where", ["payload", "length"])
def test_journal_damage_in_the_middle_refuses_to_restore(maru_server_factory, tmp_path, where):
    """One damaged record in the middle of the journal (one byte of its payload, or its length
    field, so that the next record cannot be found by length) with intact records after it:
    those records (here the deletes of 8 keys and the registration of 8 others in their chunks)
    would be lost, and replaying the records before the damage would bring the deleted keys
    back over the new keys' bytes (before: 24 hits, 8 of them another key's bytes). The server
    refuses to start, names the damage and leaves the journal as it is; `--no-restore` starts
    empty, and no key reads another's bytes."""
    server = maru_server_factory(tmp_path / "srv", pool_size="64M", extra_args=LIVE_ARGS)
    writer, keys = _chunk_reuse_history(server)
    sigkill_server(server)
    (journal,) = server.state_dir.glob("journal-*.log")
    data = bytearray(journal.read_bytes())
    frames = _frames(bytes(data))
    assert [r[0] for _, _, r in frames].count("D") == 1  # the deletes come after the damage
    pos, length, _ = next(f for f in frames if f[2][0] == "K" and f[2][1][0] == "m-0")
    if where == "payload":
        data[pos + 8 + length // 2] ^= 0xFF
    else:
        data[pos : pos + 4] = (0x7FFFFFFF).to_bytes(4, "big")
    journal.write_bytes(bytes(data))
    try:
        server.start(server.port)
    except RuntimeError as exc:
        assert "exited with 1" in str(exc)
    else:
        reader = handler(server.url)
        good, _, wrong = verify_all(reader, keys)
        reader.close()
        writer.close()
        pytest.fail(f"restored the journal up to its damage: {good} hits, {wrong} wrong")
    log = server.read_log()
    assert f"journal {journal} is damaged in its middle" in log
    assert f"byte {pos} of {len(data)}" in log and "--no-restore" in log
    assert "ERROR" in log  # logged, not only printed
    assert journal.read_bytes() == bytes(data)  # left as it was: nothing truncated
    server.start(server.port, once_args=["--no-restore"])
    reader = handler(server.url)
    assert verify_all(reader, keys) == (0, len(keys), 0)
    reader.close()
    writer.close()


def test_a_torn_tail_after_deletes_and_reuse_is_still_replayed(maru_server_factory, tmp_path):
    """The same history, the last record torn (a crash in the middle of its append, nothing
    after it): the records before it are replayed as always, the deleted keys stay deleted,
    and no key reads another's bytes."""
    server = maru_server_factory(tmp_path / "srv", pool_size="64M", extra_args=LIVE_ARGS)
    writer, keys = _chunk_reuse_history(server)
    sigkill_server(server)
    (journal,) = server.state_dir.glob("journal-*.log")
    data = journal.read_bytes()
    pos, length, record = _frames(data)[-1]
    assert record[0] == "K" and record[1][0] == "n-0"  # the new keys' registration
    journal.write_bytes(data[: pos + 8 + length // 2])
    server.start(server.port)
    assert f"ignoring {8 + length // 2} damaged bytes at its tail" in server.read_log()
    reader = handler(server.url)
    old, mid, new = keys[:24], keys[24:32], keys[32:]
    assert verify_all(reader, old[8:] + mid) == (24, 0, 0)
    assert verify_all(reader, old[:8] + new) == (0, 16, 0)  # deleted; torn
    reader.close()
    writer.close()
