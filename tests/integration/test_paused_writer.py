"""Scenario 4 of issue 13 (P4): a writer paused past its heartbeat timeout (SIGSTOP here; a long
GC pause or an overloaded host in production) must not resume and write into pages that were
handed to another instance meanwhile. Real server, real processes, real SIGSTOP/SIGCONT.

The writer A reserves every chunk of its region, is stopped, and once resumed writes all of
them and seals. Meanwhile an innocent instance B fills its own region and asks for more. The
issue measured 16 of 100 of B's values wrong: A was reaped, its region given to B, and A's
resumed writes landed in B's pages.

- On the local socket the server watches A's process (a pidfd): stopped is alive, so A is not
  reaped, B gets no region of A's, and A's batch is accepted when it resumes.
- Over TCP the server cannot watch A: A is reaped, but its region is held (`--reap-hold`),
  so B gets none of A's pages either; A's resumed batch is refused.
- With `--reap-hold 0` (the behaviour before) B's values in A's old pages read wrong: the
  fault is real, and the test would see it.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from maru import MaruHandler

from .workers import SPAWN, digest, make_value

VALUE = 60_000  # one 64 KiB chunk each
CHUNKS = 64  # a 4 MiB region


def paused_writer(url: str, local_socket: bool, beats: bool, ready, go, out) -> None:
    """A: reserve every chunk of our region, wait (stopped by the parent meanwhile), then write
    them all and seal. Puts (instance id, seal results) on `out`. Without `beats` its
    heartbeat thread is stopped first: resumed, that thread learns the region is gone and
    fences its mapping, and when it did so before the writes, the case without a hold saw no
    fault (1 run in 10 here); the fence is the client's second line, the hold the server's."""
    h = MaruHandler(
        server_url=url,
        pool_size="4M",
        chunk_size_bytes="64K",
        auto_expand=False,
        local_socket=local_socket,
        timeout_ms=10_000,
    )
    try:
        run = h.alloc(VALUE, CHUNKS)
        assert run is not None
        if not beats:
            h._heartbeat.stop(10)  # (private: the test's fault, a fence that comes too late)
        ready.set()
        go.wait(60)
        for part in run.split():
            part.buf[:VALUE] = b"A" * VALUE
        results = h.seal([f"a/{i}" for i in range(CHUNKS)], run, VALUE).wait()
        out.put((h.instance_id, results))
    finally:
        h.close()


def store_twice_a_region(b: MaruHandler) -> dict[str, str]:
    """B stores twice a region's worth, every store acknowledged: the second half needs the
    paused writer's pages, or B's own evicted. Each key's digest."""
    stored: dict[str, str] = {}
    for n in range(0, 2 * CHUNKS, 16):
        keys = [f"b/{i}" for i in range(n, n + 16)]
        values = [make_value(1000 + i, VALUE) for i in range(n, n + 16)]
        for key, value, ok in zip(keys, values, b.batch_store(keys, values)):
            if ok:
                stored[key] = digest(value)
    assert len(stored) == 2 * CHUNKS
    return stored


def instances(h: MaruHandler) -> dict:
    return h.stats()["instances"]


@pytest.mark.parametrize(
    "case", ["local socket", "tcp", "tcp without a hold (before)"], ids=["local", "tcp", "before"]
)
def test_a_paused_writer_never_writes_into_another_instances_pages(maru_server_factory, case):
    hold = "0" if case.startswith("tcp without") else "60"
    server = maru_server_factory(
        pool_size="8M", extra_args=["--heartbeat-timeout", "1", "--reap-hold", hold]
    )
    ready, go, out = SPAWN.Event(), SPAWN.Event(), SPAWN.Queue()
    local = case == "local socket"
    beats = not case.startswith("tcp without")
    a = SPAWN.Process(target=paused_writer, args=(server.url, local, beats, ready, go, out))
    a.start()
    b = MaruHandler(
        server_url=server.url, pool_size="4M", chunk_size_bytes="64K", timeout_ms=10_000
    )
    try:
        assert ready.wait(60)
        (a_iid,) = set(instances(b)) - {b.instance_id}
        os.kill(a.pid, signal.SIGSTOP)
        if case == "local socket":
            time.sleep(3.0)  # three heartbeat timeouts
            assert a_iid in instances(b)  # stopped is not dead
            assert instances(b)[a_iid]["watched_pids"] == [a.pid]
        else:
            deadline = time.monotonic() + 30
            while a_iid in instances(b) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert a_iid not in instances(b)  # reaped for its silence

        stored = store_twice_a_region(b)

        os.kill(a.pid, signal.SIGCONT)
        go.set()
        a_iid_after, a_results = out.get(timeout=60)
        a.join(30)
        assert a.exitcode == 0

        keys = list(stored)
        infos = b.batch_retrieve(keys)
        read = {k: digest(bytes(i.view)) for k, i in zip(keys, infos) if i is not None}
        wrong = sum(read[k] != stored[k] for k in read)
        print(f"\n{case}: {len(read)} of B's values read back, {wrong} wrong")
        if case.startswith("tcp without"):
            assert wrong > 0  # A wrote into B's pages: what the hold prevents
            return
        assert wrong == 0 and len(read) >= CHUNKS
        if case == "local socket":  # A kept its instance and its region: its batch counts
            assert a_iid_after == a_iid and all(a_results)
            a_infos = b.batch_retrieve([f"a/{i}" for i in range(CHUNKS)])
            assert all(i is not None and bytes(i.view) == b"A" * VALUE for i in a_infos)
        else:  # reaped: its region is not its own any more
            assert not any(a_results)
            assert b.stats()["orphaned"]["held"] == 1
    finally:
        if a.is_alive():
            os.kill(a.pid, signal.SIGCONT)
            a.kill()
        a.join(10)
        b.close()
