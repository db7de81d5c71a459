"""The soak of issue 13, shortened (`benchmarks/soak.py` runs it for 2 minutes): three writers
(one on TCP), two readers and a durable writer on a pool they overfill many times, while the
server is SIGKILLed and restarted or SIGSTOPped past the heartbeat timeout, writers are
SIGKILLed or SIGSTOPped past it, and readers are SIGKILLed or SIGSTOPped past their lease;
and writers fork children that try their parent's handler, and another server takes the pool
in turn (its own state dir; the first must serve none of its bytes as its keys).
Every read is checked against the checksum in its value; keys that cannot be evicted (pinned
as soon as they are acknowledged) are read back after every server restart. Marked `slow`
(about a minute); `-s` shows the table."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import soak

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_soak_serves_no_wrong_byte_and_loses_no_acknowledged_key(tmp_path):
    r = soak.run_soak(tmp_path, duration=35, fault_every=1.5)
    print("\n" + soak.table(r))
    assert (r["wrong"], r["wrong_bytes"]) == (0, 0)
    assert r["lost"] == 0
    assert r["crashed"] == []
    # a child forked after connecting never stores as its parent (issue 40)
    assert (r["fork_wrote"], r["fork_failed"]) == (0, 0)
    assert r["forks"] >= 1 and r["fork_refused"] == r["forks"] and r["fork_acked"] > 0
    # ... and the soak did what it says: every fault, constant eviction, reads, durable checks
    assert all(n >= 1 for n in r["faults"].values()), r["faults"]
    assert r["faults"]["server_kill"] >= 3
    assert r["bytes"] > 5 * r["pool_bytes"] and r["evictions"] > 0
    assert r["hits"] > 0 and r["misses"] > 0
    assert r["checked"] >= r["durable_acked"] > 0
