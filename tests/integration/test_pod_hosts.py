"""Issue 43, a CXL pod, "Hosts fail": a host of the pod dies (all its processes SIGKILLed) or is
cut off (its veth set down); the other host's instances go on with 0 wrong bytes, and the lost
host's regions are kept from everyone for `--reap-hold` after its instance is reaped, because
the server cannot fence a writer on another host: the hold, and the writer's own fence (no
write into the pool once the server has not answered for two heartbeat intervals), keep its
late writes out of other instances' values.

The pod is `pod_child.pod_hosts` (each host its own network and mount namespace, the pool in a
neutral tmpfs, a veth pair, `maru-server --curve` on host A); `pod_hosts_child.py` runs a case
and reports what it saw; every value is judged by its bytes (`make_value` binds it to its key).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from .test_crash_safety import handler, make_value, wait_until
from .test_pool_path import digest, hosts_missing
from .test_pool_trust import read_counts, store
from .tmpfs import run_on_tmpfs

CHILD = Path(__file__).with_name("pod_hosts_child.py")
pods = pytest.mark.skipif(bool(hosts_missing()), reason=hosts_missing() or "-")


def run_case(tmp_path: Path, case: str, hold: int, *args: str) -> dict:
    """What `pod_hosts_child.py` saw of `case` with `--reap-hold hold`."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    argv = (str(workdir), case, str(hold), *args)
    done = run_on_tmpfs(tmp_path, "size=256M", CHILD, *argv, timeout=hold + 200)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def kept_going(counts: dict) -> None:
    """Host A stored every value it tried and read each back right just after; no read of its
    values, nor of B's, was ever wrong."""
    assert counts["a_stored"] == counts["a_written"] > 0, counts
    assert counts["fresh"] == [counts["a_written"], 0, 0], counts
    assert counts["a_reads"][2] == 0 and counts["b_reads"][2] == 0, counts


@pods
@pytest.mark.parametrize("hold", [20, 0], ids=["held", "no hold (the range goes to A)"])
def test_a_host_killed_is_reaped_and_its_regions_held_until_the_hold_ends(tmp_path, hold):
    """Host B's client stores 24 values, then every process of host B is SIGKILLed. Host A's
    writer and reader go on through B's reap (`--heartbeat-timeout 2`); B's region is held
    (`--reap-hold 20`) and its values still read right; A fills the whole pool during the hold
    and gets no region over B's; A goes on until the hold ends (the run waits for it) and
    after, reading B's values right or as misses, never wrong. With `--reap-hold 0` the same
    fill takes B's range: the fill needs it, and the hold is what kept it from A."""
    seen = run_case(tmp_path, "killed", hold)
    assert seen["b_stored"] == 24 and seen["b_regions"] >= 1, seen
    assert seen["b_killed"] >= 3, seen  # B's `sleep`, its client's `timeout` and the client
    assert seen["b_after_reap"] == [24, 0, 0], seen  # A reads B's values in place
    kept_going(seen["during_hold"])
    kept_going(seen["end"])
    if hold == 0:
        assert seen["held_at_reap"] == 0 and seen["overlap_during_hold"], seen
        return
    assert seen["held_at_reap"] == seen["b_regions"], seen
    assert seen["held_after_fill"] == seen["b_regions"], seen  # (the fill ran within the hold)
    assert seen["overlap_during_hold"] == [], seen


CUT_CASES = {  # id: (--reap-hold, how B writes late)
    "held": (60, "fill"),
    "no hold (the fault)": (0, "fill"),
    "cut past the hold": (3, "store"),
}


@pods
@pytest.mark.parametrize("case", list(CUT_CASES))
def test_a_host_cut_off_cannot_write_into_other_instances_values(tmp_path, case):
    """Host B's client stores 16 values (and reserves 8 chunks); B's veth goes down. Its store
    and read fail within its timeout (no hang); it is reaped. Host A fills the pool and B,
    still cut off, writes late, and every late store or seal of B's is refused.

    - held: A gets none of B's range during the hold; B writes its 8 reserved chunks in place
      (what nothing can fence) into its held region: A reads 0 wrong bytes. The link back up,
      B reconnects as a new instance, stores, and reads A's latest values right; A reads B's.
    - no hold (`--reap-hold 0`): A gets B's range and B's in-place writes land in A's values:
      wrong bytes, which the hold prevents; the test sees them.
    - cut past the hold (`--reap-hold 3`): B's engine stores a value every round all through
      the cut, which outlasts the hold; A gets B's old range. B's client, unanswered for two
      heartbeat intervals, writes nothing into its old regions (`RpcClient.answers`):
      A reads 0 wrong bytes (without that fence: 18 values wrong in each of two runs)."""
    hold, late = CUT_CASES[case]
    seen = run_case(tmp_path, "cut", hold, late)
    assert seen["b_stored"] == 16 and seen["b_reserved"] and seen["b_reads_a"] == [16, 0, 0]
    assert seen["b_cut_store"] == {"ok": 0}, seen  # refused, within its timeout
    cut_read = seen["b_cut_read"]
    assert "error" in cut_read or cut_read["ok"][2] == 0, seen  # an error or misses
    assert seen["b_late"] and all(r == {"ok": 0} for r in seen["b_late"]), seen  # refused
    if hold == 0:  # what the hold prevents: B's late writes in A's values
        assert seen["held_at_reap"] == 0 and seen["overlap"], seen
        assert seen["during_cut"]["a_reads"][2] > 0, seen
        return
    assert seen["held_at_reap"] == seen["b_regions"] >= 1, seen
    if late == "fill":  # the hold still on: none of B's range was A's
        assert seen["held_after_late"] == seen["b_regions"], seen
        assert seen["overlap"] == [], seen
    else:  # the hold over: A got B's old range (B's late stores could have hit A's values)
        assert seen["held_after_late"] == 0 and seen["overlap"], seen
    kept_going(seen["during_cut"])
    assert seen["b_back_store"] == {"ok": 8}, seen
    assert seen["b_instance_changed"], seen  # reaped: it came back as a new instance
    assert seen["b_back_reads_a"] == [16, 0, 0], seen
    assert seen["a_reads_b_back"] == [8, 0, 0], seen
    kept_going(seen["end"])


def run_pod_case(tmp_path: Path, case: str, *args: str) -> dict:
    """What `pod_hosts_child.py` saw of `case` (`index`, `server_down`) run with `args`."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    argv = (str(workdir), case, *args)
    done = run_on_tmpfs(tmp_path, "size=256M", CHILD, *argv, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


QUIET = {"stats", "heartbeat"}  # what host B's reader may send while it reads: its stats calls


@pods
@pytest.mark.parametrize("coherence", ["hardware", "software"])
def test_every_host_reads_through_the_in_pool_index_without_a_request(tmp_path, coherence):
    """`maru-server --index-slots auto` (the key index inside the pool): writers on hosts A
    and B store 32 values each; a reader on each host reads all 64 by their bytes with
    `MaruHandler.read`, and host B's reads send the server no request: its counters, per
    operation and per host, show no LOOKUP_KV or EXISTS (nothing but the reader's own STATS
    calls) around them. Software coherence: the same. Then the pool is recreated behind the
    pod's back (the server SIGKILLed and started with `--no-restore`: a new pool file, which
    host B's bind mount does not see; the restarted server retired the old file's table
    first): host A stores new values under the same keys and reads them; host B is refused
    or misses, and never reads the old life's bytes as hits (they count as wrong here)."""
    seen = run_pod_case(tmp_path, "index", coherence, "auto")
    assert seen["stored"] == [32, 32], seen
    assert seen["local"] == [True, True], seen  # both readers read through the index
    assert seen["b_reads"] == [[32, 0, 0], [32, 0, 0]], seen  # A's values, then its own
    assert seen["a_reads"] == [[32, 0, 0], [32, 0, 0]], seen  # B's values, then its own
    assert not set(seen["ops_during_b_reads"]) - QUIET, seen  # no lookup_kv, no exists
    assert not set(seen["b_requests_during_b_reads"]) - QUIET, seen
    assert seen["a_restored"] == 32 and seen["a_reads_new"] == [32, 0, 0], seen
    b_new = seen["b_reads_new"]
    assert "refused" in b_new.get("error", "") or b_new["ok"] == [0, 32, 0], seen


@pods
@pytest.mark.parametrize("coherence", ["hardware", "software"])
def test_the_servers_host_failing_stops_writes_and_the_index_keeps_serving(tmp_path, coherence):
    """The server's host fails (maru-server and host A's writer SIGKILLed, A's veth down):
    host B's reader goes on reading A's and B's values through the in-pool index, every byte
    right (the server died without retiring the table: what it proves stays true, since no
    chunk can be reused without the server); B's writer stores nothing. Host A comes back and
    the server restarts on the same pool, restoring from its journal: B reads every value
    again and stores new ones, read right. No read is ever wrong."""
    seen = run_pod_case(tmp_path, "server_down", coherence)
    assert seen["stored"] == [32, 32] and seen["local"] is True, seen
    assert seen["before"] == [[32, 0, 0], [32, 0, 0]], seen
    assert seen["down_reads"] == [[32, 0, 0], [32, 0, 0]], seen  # the index, no server
    assert seen["down_store"].get("ok", 0) == 0, seen  # no write without the server
    assert seen["down_reads_after_store"] == [[32, 0, 0], [32, 0, 0]], seen
    assert seen["restored_reads"] == [[32, 0, 0], [32, 0, 0]], seen  # from the journal
    assert seen["stored_again"] == 8 and seen["read_again"] == [8, 0, 0], seen
    assert seen["wrong"] == 0, seen


@pods
def test_without_the_in_pool_index_the_other_host_reads_through_requests(tmp_path):
    """The same pod with `--index-slots 0` (the index in host A's /dev/shm, as before): host
    B's reads are right by their bytes, and each batch is a LOOKUP_KV from host B: what the
    test above counts is there to be seen."""
    seen = run_pod_case(tmp_path, "index", "hardware", "0")
    assert not seen["local"][1], seen  # (host B: no index it can map)
    assert seen["b_reads"] == [[32, 0, 0], [32, 0, 0]], seen
    assert seen["b_requests_during_b_reads"].get("lookup_kv", 0) >= 2, seen
    assert seen["ops_during_b_reads"].get("lookup_kv", 0) >= 2, seen


def test_a_writer_its_server_stopped_answering_writes_nothing_into_the_pool(
    maru_server_factory, tmp_path
):
    """The writer's own fence (`RpcClient.answers`), on any machine: a TCP client whose
    server has not answered for two heartbeat intervals (the server stopped, as a cut network
    looks from the client) stores nothing and reserves nothing, and not a byte of the pool
    changes; once the server answers again it stores, and every value reads by its bytes.
    (Before the fence the store copied its values into the pool and only its registration
    failed.)"""
    server = maru_server_factory(
        tmp_path / "srv", pool_size="64M", extra_args=["--heartbeat-timeout", "3"]
    )
    h = handler(server.url, pool_size="4M", timeout_ms=500, local_socket=False)
    before = [f"fence/{i}" for i in range(4)]
    store(h, before)
    late = [f"fence/late/{i}" for i in range(4)]
    os.kill(server.pid, signal.SIGSTOP)
    try:
        silent = lambda: time.monotonic() - h._rpc.last_reply > 2 * h._heartbeat.interval  # noqa: E731
        assert wait_until(silent, 60)
        pool = digest(server.pool_path)
        assert h.batch_store(late, [make_value(k, 60_000) for k in late]) == [False] * 4
        assert digest(server.pool_path) == pool  # nothing written
        assert h.alloc(60_000) is None
    finally:
        os.kill(server.pid, signal.SIGCONT)
    store(h, late)
    assert read_counts(h, before + late) == (8, 0, 0)
    h.close()
