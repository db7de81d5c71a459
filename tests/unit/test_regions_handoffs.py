"""Region hand-offs: a region (or its pages) goes to a new owner only once no earlier owner
may write into it (docs/reliability.md, "Paused writers", "Client crashes")."""

from __future__ import annotations

import errno
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from maru.common.protocol import ErrorCode, MsgType
from maru.server.journal import JournalWriteError
from maru.server.pool import ShmPool
from maru.server.registry import Registry
from maru.server.token import TokenSigner

from .service_calls import call, make_service, ok

MiB = 1 << 20


class FailingJournal:
    """A journal sink whose next record for which `fail` says so cannot be written (a full
    state dir), once."""

    def __init__(self) -> None:
        self.records: list[Any] = []
        self.fail: Callable[[list[Any]], bool] | None = None

    def append(self, record: list[Any]) -> None:
        if self.fail is not None and self.fail(record):
            self.fail = None
            raise JournalWriteError(Path("/nonexistent"), OSError(errno.ENOSPC, "full"))
        self.records.append(record)


def test_a_half_reaped_writer_must_handshake_before_it_writes_on(tmp_path):
    """A TCP writer with two regions falls silent and is reaped; the state dir fills up after
    the first region's "T": that region is released (held, then freed and handed out), the
    other stays, and so does the instance. When it resumes it must learn which region is no
    longer its own before it writes on: its credential is void until it handshakes, and the
    handshake lists only the region it kept. Before, its next request was served as if
    nothing happened, its client kept writing in the released region, and once the hold
    ended that region went to B: B's keys were served over A's bytes."""
    journal = FailingJournal()
    pool = ShmPool(str(tmp_path / "pool"), 8 * MiB)
    reg = Registry(pool, TokenSigner(b"h" * 32), journal=journal, reap_hold=60.0)
    svc = make_service(tmp_path, registry=reg)
    for iid in ("A", "B"):
        ok(svc, MsgType.HANDSHAKE, {"iid": iid, "pid": 1})
    r1, r2 = (
        ok(svc, MsgType.REQUEST_REGION, {"iid": "A", "size": 2 * MiB})["region"][0]
        for _ in range(2)
    )
    ok(svc, MsgType.REQUEST_REGION, {"iid": "B", "size": 4 * MiB})
    reg.instances["A"].last_seen -= 100  # silent (stopped) past the heartbeat timeout
    journal.fail = lambda record: record[0] == "T" and record[1] == r2
    assert reg.instances.reap(10.0) == []  # half done: r1 released and held, r2 still A's
    assert reg.regions[r1].returned and r2 in reg.instances["A"].regions

    reply = call(svc, MsgType.HEARTBEAT, {"iid": "A"})  # A resumes
    assert not reply["ok"] and reply["code"] == ErrorCode.UNKNOWN_INSTANCE  # before: ok
    again = ok(svc, MsgType.HANDSHAKE, {"iid": "A", "pid": 1})
    assert again["iid"] == "A" and [h[0] for h in again["regions"]] == [r2]  # r1 dropped
    offset = reg.regions[r1].offset
    reg.regions.end_holds(time.monotonic() + 61)  # the hold ends: r1 goes back to the pool
    handle = reg.request_region("B", 2 * MiB)
    assert handle.offset == offset  # what A was told, before B got it
