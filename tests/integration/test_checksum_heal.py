"""A corrupt entry heals: a reader (`maru_checksums`) whose copy of a hit is unlike its writer's
checksum while its lease held tells the server (CORRUPT_KV), which drops that very entry, so
that a writer can store the key again (the first writer wins: else every reader missed it for
good). Never a newer value (a key deleted and stored again since), never on a mismatch after
the lease ended (a rewrite, not corruption). Real servers, writers and readers in processes
of their own, the fault made in the pool file itself."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from maru import MaruAdmin, MaruHandler
from maru.common.checksum import checksums

from .workers import SPAWN, _run, digest, flip_byte, run_processes, store_keys

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: pool_places
from pool_places import places

KiB = 1 << 10
SIZE = 60 * KiB + 3  # not a page multiple
KEYS = [f"heal-{i}" for i in range(6)]
VICTIM = 2
SEED = 900
DEADLINE_S = 20.0


def write(url: str, keys: list[str]) -> list[str]:
    """Store `keys` (their values from SEED) with checksums, in a writer process of its own
    that then closes: its keys stay readable. Returns their digests."""
    sizes = [SIZE] * len(keys)
    seed = SEED + KEYS.index(keys[0])
    kw = {"pool_size": "16M", "checksums": True}
    (result,) = run_processes([(store_keys, (url, keys, sizes, seed, 8, kw))], 120)
    assert result["ok"] == [True] * len(keys), result
    return result["digests"]


def read_keys(url: str, keys: list[str], way: str) -> dict[str, Any]:
    """A reader process: one copying read of `keys` with checksums, by the request path (a
    leased lookup, its copies checked, `local_index` off) or `MaruHandler.read` on the local
    index. Per key its bytes' digest or None, its mismatches, whether the index answered."""
    h = MaruHandler(
        server_url=url,
        pool_size="4M",
        checksums=True,
        local_index=way == "index",
        timeout_ms=10_000,
    )
    try:
        if way == "index":
            out = np.zeros((len(keys), SIZE), np.uint8)
            rows = (out.ctypes.data + np.arange(len(keys), dtype=np.int64) * SIZE)[:, None]
            assert h._index is not None
            fallbacks = h._index.fallbacks
            ok = h.read(keys, rows, np.array([SIZE], np.int64), length=SIZE)
            local = h._index.fallbacks == fallbacks  # (no lookup was asked)
            data = [bytes(out[i]) if hit else None for i, hit in enumerate(ok)]
        else:
            with h.lookup(keys, lease=True) as found:
                copies = [bytes(i.view) if i else None for i in found.infos()]
                bad = found.corrupt()
                held = found.release(confirm=True)
            data = [None if (b or not held) else c for c, b in zip(copies, bad)]
            local = False
        return {
            "digests": [digest(d) if d is not None else None for d in data],
            "mismatches": h.checksum_mismatches,
            "local": local,
        }
    finally:
        h.close()


def read_late(url: str, key: str, lease: bool, queue: Any, go: Any) -> dict[str, Any]:
    """A reader process that copies `key`, says so on `queue`, and checks its copy only once
    `go` is set (the parent changes things meanwhile); then a request that the server answers
    after any report of the check (same connection, in order)."""
    h = MaruHandler(server_url=url, pool_size="4M", checksums=True, local_index=False)
    try:
        found = h.lookup([key], lease=lease)
        addresses, lengths = found.wait()  # (not `infos()`, which checks at once)
        assert lengths[0] == SIZE
        copy = ctypes.string_at(int(addresses[0]), SIZE)
        queue.put("copied")
        assert go.wait(DEADLINE_S)
        # Leased: the bytes checked in the pool now (as a view's reader checks them);
        # else its copy, made before the parent's changes
        sums = None if lease else np.array(checksums([memoryview(copy)]), np.int64)
        bad = found.corrupt(sums)
        held = found.release(confirm=True)
        h.batch_exists([key])  # (a request after the report, if any: answered after it was served)
        return {"bad": bool(bad[0]), "held": held, "mismatches": h.checksum_mismatches}
    finally:
        h.close()


@contextlib.contextmanager
def late_reader(url: str, key: str, lease: bool) -> Iterator[tuple[int, dict[str, Any]]]:
    """`read_late` in a process of its own, once it has copied `key`: the block runs (given
    the reader's pid and a dict), then the reader checks its copy, and its result fills the
    dict. The process is joined (killed if it outstays) whatever happens."""
    queue, go, out = SPAWN.Queue(), SPAWN.Event(), SPAWN.Queue()
    proc = SPAWN.Process(target=_run, args=(read_late, out, 0, (url, key, lease, queue, go)))
    proc.start()
    result: dict[str, Any] = {}
    try:
        assert queue.get(timeout=60) == "copied"
        yield proc.pid, result
        go.set()
        result.update(out.get(timeout=60)[1])
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def counters(url: str) -> tuple[int, int]:
    """The server's (corrupt_dropped, CORRUPT_KV requests served)."""
    stats = MaruAdmin(url).stats()
    reports = stats["operations"].get("corrupt_kv", {}).get("count", 0)
    return stats["counters"]["corrupt_dropped"], reports


def expired(url: str) -> bool:
    return MaruAdmin(url).stats()["counters"]["leases_expired"] >= 1


def wait_for(what: str, check: Any) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not check():
        assert time.monotonic() < deadline, f"not within {DEADLINE_S} s: {what}"
        time.sleep(0.05)


@pytest.mark.parametrize("way", ["requests", "index"])
def test_a_corrupt_entry_is_dropped_and_stored_again(maru_server, way):
    url = maru_server.url
    digests = write(url, KEYS)
    key = KEYS[VICTIM]
    with MaruHandler(server_url=url, pool_size="4M") as plain:
        flip_byte(plain, key, at=SIZE - 1)
        (result,) = run_processes([(read_keys, (url, KEYS, way))], 120)
        assert result["local"] == (way == "index")
        expected = [None if i == VICTIM else d for i, d in enumerate(digests)]
        assert (result["digests"], result["mismatches"]) == (expected, 1)
        # The reader's report (not waited for) drops the entry: gone from the server
        wait_for("the corrupt key dropped", lambda: not plain.batch_exists([key])[0])
        assert plain.batch_exists(KEYS) == [i != VICTIM for i in range(len(KEYS))]
    assert counters(url) == (1, 1)
    assert f"key {key!r} dropped: " in maru_server.read_log()
    # A writer that recomputes the value stores it again; readers get it byte for byte
    assert write(url, [key]) == [digests[VICTIM]]
    (result,) = run_processes([(read_keys, (url, KEYS, way))], 120)
    assert (result["digests"], result["mismatches"]) == (digests, 0)
    assert counters(url) == (1, 1)


def test_a_key_stored_again_before_the_report_is_kept(maru_server):
    """The reader's lookup found the corrupt entry; before it reports, the key is deleted and
    stored again elsewhere with the right bytes: the report must not drop the new entry."""
    url = maru_server.url
    digests = write(url, KEYS)
    key = KEYS[VICTIM]
    with MaruHandler(server_url=url, pool_size="4M") as plain:
        (old,) = places(plain, [key])
        flip_byte(plain, key, at=7)
        with late_reader(url, key, lease=False) as (_, result):
            assert plain.batch_delete([key]) == [True]
            assert write(url, [key]) == [digests[VICTIM]]
            (new,) = places(plain, [key])
            assert new is not None and new != old  # another place
        assert result == {"bad": True, "held": True, "mismatches": 1}  # reported
        assert counters(url) == (0, 1)  # ... and the new entry kept
        (info,) = plain.batch_retrieve([key])
        assert info is not None and digest(info.view) == digests[VICTIM]
    (result,) = run_processes([(read_keys, (url, KEYS, "requests"))], 120)
    assert (result["digests"], result["mismatches"]) == (digests, 0)


def test_a_mismatch_after_the_lease_ended_is_not_reported(maru_server_factory, tmp_path):
    """A reader stopped past --lease-timeout: the page may have been rewritten since, so a
    mismatch then is a miss, not corruption, and nothing is reported (the key stays)."""
    server = maru_server_factory(tmp_path / "srv", extra_args=["--lease-timeout", "1"])
    url = server.url
    digests = write(url, KEYS)
    key = KEYS[VICTIM]
    with MaruHandler(server_url=url, pool_size="4M") as plain:
        with late_reader(url, key, lease=True) as (pid, result):
            os.kill(pid, signal.SIGSTOP)  # a stopped reader...
            try:
                wait_for("the reader's lease expired", lambda: expired(url))
                flip_byte(plain, key, at=11)  # ... whose page is rewritten once its lease ends
            finally:
                os.kill(pid, signal.SIGCONT)
        assert result == {"bad": True, "held": False, "mismatches": 0}
        assert counters(url) == (0, 0)  # nothing reported
        assert plain.batch_exists([key]) == [True]
    assert digests
