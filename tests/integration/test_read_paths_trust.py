"""The read verbs' request path alike for `MaruHandler.read` and `read_many`, against a real
`maru-server`: in software coherence a hit whose pages fault when `read_many` invalidates them
is a miss its copy never reads (the other hits stay hits); an error between the leased lookup
and the copy releases the lease; a server that does not answer gives misses. With
`maru_checksums`, a copy that outlived its lease while its page was rewritten is a miss counted
as a lease that ended, not as a checksum mismatch (no page was corrupt)."""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from maru import MaruHandler
from maru.client import coherence
from maru.client.requests import Lookup
from maru.client.rpc import PendingReply
from maru.common.memcopy import copy_values
from maru.common.protocol import MsgType

from .test_reads_trust import WAIT_S, A, B, _owner, _stopped, _until
from .workers import SPAWN

log = logging.getLogger(__name__)


def _rows(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """n destination rows of len(A) bytes, their (n, 1) pointers and the one part's size."""
    rows = np.zeros((n, len(A)), np.uint8)
    buffers = np.array([[rows[i].ctypes.data] for i in range(n)], np.int64)
    return rows, buffers, np.array([len(A)], np.int64)


@pytest.mark.parametrize("local_index", [False, True], ids=["request", "local-index"])
def test_a_hit_whose_lines_fault_when_invalidated_is_a_miss_never_copied(
    maru_server_factory, tmp_path, local_index
):
    """Software coherence, an fsdax pool (a file per region). "k" and "k2" lie in two
    owners' regions, both mapped by the reader; k's region file is then cut to nothing, so
    its pages fault. `read_many` invalidates its hits' lines before the caller's copy (which
    need not be a guarded copy loop: a device's DMA, a pool's own API): k's invalidation
    faults. k must be a miss its copy is never given (source 0), k2 a hit, the lease released.
    Before: the fault was ignored, the copy was given k's address, faulted, and every key of
    the segment was a miss (a copy that does not guard its reads would have died of SIGBUS)."""
    pool = str(tmp_path / "fsdax") + "/"
    server = maru_server_factory(pool_size="64M", extra_args=["--coherence", "software"], pool=pool)
    owner = _owner(server.url)
    other = MaruHandler(
        server_url=server.url, pool_size="2M", chunk_size_bytes="1M", auto_expand=False
    )
    assert other.store("k2", B)
    reader = MaruHandler(server_url=server.url, pool_size="2M", local_index=local_index)
    try:
        assert reader.coherence == "software" and reader.reads_locally == local_index
        (region_id,) = owner.owned_region_ids()
        assert reader._mapper.get(region_id) is not None  # mapped at connect (`eager_map`)
        assert reader._mapper.wait_populated(WAIT_S)
        os.truncate(Path(pool) / f"region-{region_id}.mem", 0)  # k's pages fault from now on
        rows, buffers, sizes = _rows(2)
        given: list[list[int]] = []

        def copy(sources: np.ndarray) -> np.ndarray | None:
            given.append(sources.tolist())
            return copy_values(sources, buffers, sizes, to_values=False)

        proven, mismatched = reader.read_many(["k", "k2"], [(2, len(A), copy)])
        assert given and given[0][0] == 0 and given[0][1] != 0  # k never given to the copy
        assert proven.tolist() == [False, True]
        assert mismatched.tolist() == [False, False]
        assert bytes(rows[1]) == B
        assert reader.stats()["leases"] == 0
    finally:
        reader.close()
        other.close()
        owner.close()


def test_an_error_between_the_lookup_and_the_copy_releases_the_lease(
    maru_server_factory, monkeypatch
):
    """Software coherence: `read_many` invalidates its hits' lines once its leased lookup is
    answered. An unexpected error there (a bug, an interrupt) goes to the caller as
    `read`'s do, with the lease released. Before: it was outside the code that releases on
    an error, and the lease stayed held (its key undeletable) until --lease-timeout."""
    server = maru_server_factory(pool_size="64M", extra_args=["--coherence", "software"])
    owner = _owner(server.url)
    reader = MaruHandler(server_url=server.url, pool_size="2M", local_index=False)
    try:
        assert reader.coherence == "software"

        def broken(*args: Any) -> None:
            raise RuntimeError("a bug in the flush")

        monkeypatch.setattr(coherence, "_c_flush_ranges", broken)
        _, buffers, sizes = _rows(1)

        def copy(sources: np.ndarray) -> None:
            copy_values(sources, buffers, sizes, to_values=False)

        with pytest.raises(RuntimeError, match="a bug in the flush"):
            reader.read_many(["k"], [(1, len(A), copy)])
        assert reader.stats()["leases"] == 0  # (before: 1, held by the lookup)
        assert owner.delete("k")  # nothing holds it
    finally:
        reader.close()
        owner.close()


def test_a_server_that_does_not_answer_gives_misses_not_an_exception(maru_server_factory):
    """Software coherence, the request path: the server stopped (SIGSTOP) past the reader's
    `timeout_ms` when it looks up. `read_many` and `read` both give misses (the lookup's
    failure is logged), never an exception into the caller's load."""
    server = maru_server_factory(pool_size="64M", extra_args=["--coherence", "software"])
    owner = _owner(server.url)
    reader = MaruHandler(server_url=server.url, pool_size="2M", local_index=False, timeout_ms=300)
    rows, buffers, sizes = _rows(1)

    def copy(sources: np.ndarray) -> None:
        copy_values(sources, buffers, sizes, to_values=False)

    try:
        assert reader.coherence == "software"
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            proven, mismatched = reader.read_many(["k"], [(1, len(A), copy)])
            assert proven.tolist() == [False] and mismatched.tolist() == [False]
            assert reader.read(["k"], buffers, sizes, length=len(A)) == [False]
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        assert reader.read(["k"], buffers, sizes, length=len(A)) == [True]  # (it answers again)
        assert bytes(rows[0]) == A
    finally:
        reader.close()
        owner.close()


@pytest.mark.parametrize("lease_id", ["x", [1], {"a": 1}], ids=["string", "list", "dict"])
def test_a_malformed_lease_id_is_a_miss_not_an_exception(lease_id):
    """A LOOKUP_KV reply whose `lease_id` is not an integer is malformed like any other
    field: misses, logged. Before: `int(...)` raised out of `wait()`, hence out of `read`."""
    h = MaruHandler(server_url="tcp://127.0.0.1:1", auto_connect=False)
    try:
        lookup = Lookup(h._s, ["k"], lease=True, send=False)
        pending = PendingReply(None, 1, MsgType.LOOKUP_KV, {})  # type: ignore[arg-type]
        one = np.array([1], np.int64).tobytes()
        pending.body = {
            "ok": True,
            "lease_id": lease_id,
            **{name: one for name in ("region_ids", "offsets", "lengths", "maru64")},
            "regions": [],
        }
        lookup._pending = pending
        addresses, lengths = lookup.wait()
        assert addresses.tolist() == [0] and lengths.tolist() == [0]
        assert lookup.lease_id == 0
    finally:
        h.close()


def paused_checked_reader(url: str, keys: list[str], local_index: bool, out: Any) -> None:
    """A reader process with `maru_checksums`: `read_many(keys)` whose copy stops this process
    (SIGSTOP) once the lookup was answered; the parent resumes it. Puts (proven, mismatched,
    checksum_mismatches, leases_ended, whether each copy holds B) on `out`."""
    reader = MaruHandler(server_url=url, pool_size="2M", checksums=True, local_index=local_index)
    try:
        n = len(keys)
        rows, buffers, sizes = _rows(n)

        def copy(sources: np.ndarray) -> np.ndarray | None:
            os.kill(os.getpid(), signal.SIGSTOP)  # paused here, mid-read, by ourselves
            return copy_values(sources, buffers, sizes, to_values=False, hashed=True)

        proven, mismatched = reader.read_many(keys, [(n, len(A), copy)])
        out.put(
            (
                proven.tolist(),
                mismatched.tolist(),
                reader.checksum_mismatches,
                getattr(reader, "leases_ended", None),
                [bytes(r) == B for r in rows],
            )
        )
    finally:
        reader.close()


@pytest.mark.parametrize("local_index", [False, True], ids=["request", "local-index"])
def test_a_checked_copy_that_outlived_its_lease_is_not_counted_a_checksum_mismatch(
    maru_server_factory, local_index
):
    """With `maru_checksums`, a reader stopped in its copy past --lease-timeout while k is
    deleted and stored again in its chunk with other bytes. Resumed, its copy holds the new
    bytes, unlike k's checksum of the lookup: a miss, as before. But nothing was corrupt: the
    lease ended (the local index: the entry changed), so it is not reported as a mismatch
    (`checksum_mismatches`, the `mismatched` SGLang counts) and the request path counts it in
    `leases_ended`. Before: counted and logged at ERROR as 2 checksum mismatches."""
    server = maru_server_factory(pool_size="64M", extra_args=["--lease-timeout", "0.3"])
    owner = _owner(server.url, checksums=True)
    out = SPAWN.Queue()
    reader = SPAWN.Process(
        target=paused_checked_reader, args=(server.url, ["k", "k"], local_index, out)
    )
    reader.start()
    try:
        _until(lambda: _stopped(reader.pid), "the reader stops itself in its copy")
        _until(lambda: owner.stats()["leases"] == 0, "its lease ends")
        assert owner.delete("k")
        assert owner.store("k", B)  # k again, in k's old chunk, with other bytes
        os.kill(reader.pid, signal.SIGCONT)
        proven, mismatched, mismatches, ended, holds_b = out.get(timeout=WAIT_S)
    finally:
        os.kill(reader.pid, signal.SIGCONT)
        reader.join(WAIT_S)
    assert holds_b == [True, True]  # the page really changed under the copy
    assert proven == [False, False]
    assert mismatched == [False, False]
    assert mismatches == 0
    if not local_index:  # (the local index has no lease: it counts the entry changed)
        assert ended == 2
    assert reader.exitcode == 0
    owner.close()
