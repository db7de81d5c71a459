"""Issue 13, P6: per-instance quotas, so that one client cannot starve the others. Past its
quota of region bytes an instance's region request is refused (QUOTA_EXCEEDED, logged) and
the client makes room among its own keys instead; past its quota of leases a leased lookup is
refused and reads as misses. Never a crash, never a side effect of the refused request."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading

from conftest import maru_server_command  # tests/conftest.py
from maru import MaruHandler
from maru.common.errors import MaruError

from .workers import (
    SPAWN,
    KiB,
    MiB,
    digest,
    flood_leases,
    keep_writing,
    make_value,
    many_handlers_store,
    run_processes,
    store_keys,
    write_behind,
    write_under_a_lease_flood,
)


def handler(url: str, **kw) -> MaruHandler:
    h = MaruHandler(server_url=url, chunk_size_bytes="1M", timeout_ms=5000, **kw)
    assert h.connected
    return h


def test_an_instance_past_its_region_quota_stores_within_it_and_starves_no_one(
    maru_server_factory,
):
    server = maru_server_factory(pool_size="64M", extra_args=["--quota-region-bytes", "8M"])
    greedy = handler(server.url, pool_size="64M")  # would take the whole pool
    values = [bytes([i]) * (MiB - 100) for i in range(24)]  # 3x its quota
    ok = [greedy.store(f"greedy/{i}", v) for i, v in enumerate(values)]
    assert ok == [True] * len(values)  # its own older keys made room
    stats = greedy.stats()
    assert stats["instances"][greedy.instance_id]["region_bytes"] <= 8 * MiB
    with greedy.leased([f"greedy/{i}" for i in range(24)]) as infos:  # the latest are intact
        found = [(i, bytes(info.view)) for i, info in enumerate(infos) if info is not None]
    assert found and all(data == values[i] for i, data in found)
    assert max(i for i, _ in found) == 23
    assert "bytes of regions: its quota is 8388608 refused" in server.read_log()

    # the rest of the pool is still there, for another process (a quota is a process's)
    sizes = [MiB - 100] * 8
    (other,) = run_processes(
        [(store_keys, (server.url, [f"other/{i}" for i in range(8)], sizes, 0, 8, {}))], 120
    )
    assert other["ok"] == [True] * 8
    assert server.alive()
    greedy.close()


def test_a_region_quota_counts_a_process_not_each_of_its_handlers(maru_server_factory):
    """One process with six handlers (instances) at an 8 MiB quota: before, each instance
    had its own quota and the process took far more than 8 MiB (the attack suite saw 40 MiB);
    now the quota counts the regions of every instance the process holds together. Its
    handlers store within it (each making room among its own keys; one that holds nothing
    while the process is at its quota is refused), and every acknowledged value reads back as
    written or, evicted for room, as a miss: never another's bytes."""
    server = maru_server_factory(pool_size="64M", extra_args=["--quota-region-bytes", "8M"])
    (result,) = run_processes([(many_handlers_store, (server.url, 6, 6, MiB - 100))], 180)
    assert sum(result["held"]) <= 8 * MiB, result["held"]
    assert result["acked"] > 0 and "ok" in result["reads"] and "wrong" not in result["reads"]
    assert "(process " in server.read_log()  # the refusal names the process


def test_a_leased_lookup_past_the_lease_quota_is_a_miss_and_frees_up(maru_server_factory):
    server = maru_server_factory(pool_size="64M", extra_args=["--quota-leases", "3"])
    writer = handler(server.url, pool_size="8M")
    assert writer.batch_store(["k"], [b"v" * 1000]) == [True]
    reader = handler(server.url, pool_size="2M")
    held = [reader.lookup(["k"], lease=True) for _ in range(3)]
    assert all(lk.infos()[0] is not None and lk.lease_id for lk in held)
    refused = reader.lookup(["k"], lease=True)
    assert refused.infos() == [None] and refused.lease_id == 0  # a miss, not an exception
    assert refused.release(confirm=True)  # (nothing was read)
    assert reader.exists("k")  # the instance carries on
    assert "3 leases: its quota is 3 refused" in server.read_log()
    assert reader.stats()["leases"] == 3  # the refused lookup took nothing
    held[0].release()
    again = reader.lookup(["k"], lease=True)
    assert bytes(again.infos()[0].view) == b"v" * 1000 and again.release(confirm=True)
    for lk in held[1:]:
        lk.release()
    writer.close()
    reader.close()


def test_a_bad_quota_flag_is_one_line_and_exit_2(tmp_path):
    for value in ("0%", "150%", "lots", "-1M"):
        proc = subprocess.run(
            [*maru_server_command(), "--quota-region-bytes", value, "--pool-size", "64M"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert proc.returncode == 2, (value, proc.stderr)
        assert "--quota-region-bytes" in proc.stderr and "Traceback" not in proc.stderr


def test_a_new_client_gets_its_fair_share_of_a_pool_one_busy_writer_filled(maru_server_factory):
    """Issue 40, case 8: one instance without a quota, writing without pause, holds the whole
    pool; a client that connects then must still store. It is owed a fair share (the pool
    over the live instances): the writer, over its share, is asked to give regions back
    (only ones it holds no unsealed value in) and does at once. Judged by bytes: every value
    of the newcomer read back, and the writer's latest ones too. Before: every store of the
    newcomer failed (POOL_FULL, nothing of its own to evict)."""
    server = maru_server_factory(pool_size="64M")
    filled, stop = SPAWN.Event(), SPAWN.Event()
    kw = {"pool_size": "64M", "chunk_size_bytes": "1M"}
    job = (keep_writing, (server.url, "greedy", MiB - 100, 128 * MiB, kw, filled, stop))
    out: list[dict] = []
    writer = threading.Thread(target=lambda: out.extend(run_processes([job], timeout=240)))
    writer.start()
    try:
        assert filled.wait(120), "the writer did not fill the pool"
        newcomer = handler(server.url, pool_size="16M")
        values = [make_value(1000 + i, MiB - 100) for i in range(12)]
        ok = [newcomer.store(f"new/{i}", v) for i, v in enumerate(values)]
        with newcomer.leased([f"new/{i}" for i in range(12)]) as infos:
            read = [None if i is None else digest(i.view) for i in infos]
        newcomer.close()
    finally:
        stop.set()
        writer.join(240)
    assert ok == [True] * 12
    assert read == [digest(v) for v in values]  # every byte back
    (greedy,) = out
    assert greedy["hits"] == 8 and greedy["wrong"] == 0
    assert "asked" in server.read_log() and server.alive()


def hog_the_pool(url: str, values: int, ready, go) -> dict:
    """Store `values` values of about 1 MiB under a `pool_size` of as many MiB, then wait
    for `go`."""
    h = handler(url, pool_size=f"{values}M")
    try:
        ok = [h.store(f"hog/{i}", make_value(i, MiB - 100)) for i in range(values)]
        ready.set()
        go.wait(120)
        return {"ok": ok}
    finally:
        h.close()


def test_a_writer_owed_room_by_a_stopped_instance_makes_room_among_its_own_keys(
    maru_server_factory,
):
    """An instance over its fair share is stopped (SIGSTOP: a GC pause, an overloaded host)
    and never gives back what it is asked. A writer below its share that already holds keys
    waits out POOL_RECLAIMING, then makes room among its own keys: every store succeeds and
    its latest values read back. Before, every store that needed more room failed after the
    wait."""
    # (ticks every 20 s: the hog parks nothing, so no region of its can be taken back)
    server = maru_server_factory(pool_size="16M", extra_args=["--heartbeat-timeout", "60"])
    ready, go = SPAWN.Event(), SPAWN.Event()
    # (the hog holds 12 of the pool's 16 MiB, twice its share, and the writer takes the rest)
    proc = SPAWN.Process(target=hog_the_pool, args=(server.url, 12, ready, go), daemon=True)
    proc.start()
    try:
        assert ready.wait(60), "the hog did not store its values"
        writer = handler(server.url, pool_size="8M")
        values = [make_value(500 + i, MiB - 100) for i in range(8)]
        first = [writer.store(f"w/{i}", v) for i, v in enumerate(values[:2])]
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            later = [writer.store(f"w/{i}", v) for i, v in enumerate(values[2:], 2)]
            with writer.leased(["w/6", "w/7"]) as infos:
                read = [None if i is None else digest(i.view) for i in infos]
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        writer.close()
    finally:
        go.set()
        proc.join(60)
    assert first == [True, True]
    assert later == [True] * 6  # before: those past its first regions False (POOL_RECLAIMING)
    assert read == [digest(v) for v in values[6:]]
    assert "asked" in server.read_log() and server.alive()


def test_readers_do_not_shrink_a_writers_fair_share_below_one_region(maru_server_factory):
    """An 8 MiB pool (four 2 MiB regions), five readers (instances that hold no region) and
    two writers that filled it (two regions each, writing behind without pause, deleting
    some recent keys); then two more writers start. Each is owed a share of the pool, and
    four writers fit (a region each): the two over theirs must give one back. Before, the
    share was the pool over every live instance, readers included (8 MiB / 9, under one
    region), so no writer was ever below it, nobody was asked, and the two late writers
    stored nothing (the stress run: 2 of 1,616 values)."""
    server = maru_server_factory(pool_size="8M")
    readers = [handler(server.url, pool_size="2M") for _ in range(5)]
    kw = {"pool_size": "4M", "chunk_size_bytes": "16K"}
    filled, stop = [SPAWN.Event(), SPAWN.Event()], SPAWN.Event()
    early_jobs = [
        (write_behind, (server.url, f"early{i}", kw, 0, 4 * MiB, filled[i], stop)) for i in range(2)
    ]
    early: list[dict] = []
    thread = threading.Thread(target=lambda: early.extend(run_processes(early_jobs, 240)))
    thread.start()
    try:
        assert all(f.wait(120) for f in filled), "the first writers did not fill the pool"
        late = run_processes(
            [(write_behind, (server.url, f"late{i}", kw, 200)) for i in range(2)], 180
        )
    finally:
        stop.set()
        thread.join(240)
    for reader in readers:
        assert reader.batch_retrieve(["late0/0"]) is not None  # (they live, and read)
        reader.close()
    assert len(early) == 2
    for result in early + late:
        assert result["wrong"] == 0, result
    for result in late:  # before: 0 of 1,600 each
        assert result["stored"] >= result["tried"] // 2, late
    assert all(result["stored"] > 0 for result in early), early
    assert "asked" in server.read_log() and server.alive()


def test_a_lease_flood_does_not_fail_another_writers_stores(maru_server_factory):
    """Issue 40, case 8: a client that leases every key every 0.5 s (and never releases)
    while another writes on a full pool. Leases are bounded per instance by bytes
    (--quota-lease-bytes, default 50% of the pool), so the writer can always evict among
    its own keys: its stores succeed and read back right. Before: every key was held, the
    writer's EVICT_FOR freed nothing, and nearly all its stores failed (the issue: 98%)."""
    server = maru_server_factory(pool_size="64M")
    progress = SPAWN.Value("i", 0)
    filled, flooded, done = SPAWN.Event(), SPAWN.Event(), SPAWN.Event()
    size, count = 256 * KiB, 128
    writer_args = (server.url, size, 64 * MiB, count, progress, filled, flooded, done)
    jobs = [
        (write_under_a_lease_flood, writer_args),
        (flood_leases, (server.url, 32, progress, filled, flooded, done)),
    ]
    writer, flooder = run_processes(jobs, timeout=240)
    assert flooder["most_leased"] > 0  # the flood was real
    assert writer["failed"] <= count // 32, writer  # before: nearly all of them
    assert writer["wrong"] == 0 and writer["hits"] >= count - writer["failed"] - count // 4
    assert "bytes under leases" in server.read_log() and server.alive()


def test_a_region_whose_give_back_failed_is_never_written_again_as_empty(maru_server_factory):
    """Asked for its fair share back, a writer drops a region holding its keys, and the
    RETURN_REGION fails (the server stopped, then SIGKILLed). The restarted server restores
    the region as the writer's, with its keys. Before: the writer's re-handshake adopted it
    with every chunk free, its next writes went over those keys' bytes, and every old key
    read as a hit with a new key's bytes. Now the region stays aside (returned again at the
    next heartbeat) and every key reads its own bytes."""
    server = maru_server_factory(pool_size="64M", extra_args=["--heartbeat-timeout", "30"])
    x = MaruHandler(
        server_url=server.url, pool_size="8M", chunk_size_bytes=64 * KiB, timeout_ms=1000
    )
    old = [f"old/{i}" for i in range(8)]
    assert x.batch_store(old, [make_value(i, 64 * KiB) for i in range(8)]) == [True] * 8
    x._supply.shed(1 << 40)  # (what a reply's `shed` asks)
    os.kill(server.proc.pid, signal.SIGSTOP)
    with contextlib.suppress(MaruError):  # (the heartbeat after it finds none either)
        x._supply.tick({})  # gives up the region; its RETURN_REGION finds no server
    assert x.owned_region_ids() == []
    os.kill(server.proc.pid, signal.SIGKILL)
    os.kill(server.proc.pid, signal.SIGCONT)
    server.proc.wait()
    server.proc = None
    server.start(server.port)
    new = [f"new/{i}" for i in range(8)]
    assert x.batch_store(new, [make_value(100 + i, 64 * KiB) for i in range(8)]) == [True] * 8
    reader = handler(server.url)
    with reader.leased(old + new) as infos:
        got = [None if i is None else digest(i.view) for i in infos]
    want = [digest(make_value(i, 64 * KiB)) for i in range(8)]
    want += [digest(make_value(100 + i, 64 * KiB)) for i in range(8)]
    assert got == want
    x._supply.tick({})  # the region aside is returned now
    assert x._supply._unreturned == {}
    reader.close()
    x.close()
