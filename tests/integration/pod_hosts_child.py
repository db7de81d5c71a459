"""Run by `test_pod_hosts.py`: a host of a CXL pod fails (issue 43, "Hosts fail").

`pod_hosts_child.py NEUTRAL WORKDIR CASE HOLD [LATE]` runs (through `tmpfs.run_on_tmpfs`) the
pod of `pod_child.pod_hosts` (hosts A and B, `maru-server --curve` on A, a short heartbeat
timeout, `--reap-hold HOLD`) and one case, and prints one JSON line: what it saw, for the test
to judge. Host A runs a writer and a reader, host B one client (`pod_child.Agent`s):

- `killed`: every process of host B is SIGKILLed while its client holds a region with values;
- `cut`: host B's end of the veth pair is set down while its client lives (holding a run of
  chunks it reserved), then up again; LATE says how B writes while cut off: `fill` (that run,
  written in place) or `store` (a value a round all through a cut that outlasts the hold,
  and a batch at the end).

`pod_hosts_child.py NEUTRAL WORKDIR index COHERENCE SLOTS` (issue 43, "Reads without a request
from every host"): `maru-server --coherence COHERENCE --index-slots SLOTS`; writers on both
hosts, then readers on both read every value with `MaruHandler.read` (the server's request
counters, per operation and per host, taken around host B's reads); then the pool is
recreated behind the pod's back (the server SIGKILLed, started again with `--no-restore`: a
new pool file, which host B's bind mount does not see) and host A stores new values under the
same keys, which host B reads.

`pod_hosts_child.py NEUTRAL WORKDIR server_down COHERENCE` (issue 43, "the server's host
failing"): with the in-pool index, host A (the server's) fails: the server and A's writer
SIGKILLed, A's veth down. Host B's reader reads A's and B's values through the index, B's
writer tries to store; then A comes back and the server restarts, restoring from its journal,
and B reads and stores again.

Every value is `make_value(key)`, read back and judged by its bytes (right, missing, wrong).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from pod_child import CLIENT_IP, Agent, Pod, kill_host, pod_hosts, sh

HEARTBEAT_S = 2  # --heartbeat-timeout
POOL = "16M"  # the server's pool: host A's writer (up to 16M) fills it
BOUND_S = 60.0  # the longest a poll below waits: a bound for the run to stop, not a threshold
ROUND = 16  # values host A's writer stores per round
WINDOW = 4 * ROUND  # the latest values host A's reader reads each round (under the lease quota)


def server_args(hold: str) -> list[str]:
    """A short heartbeat timeout, and no eviction by watermark: a writer fills its regions
    and then asks for another, which a full pool finds only in a lost host's region."""
    return [
        *("--heartbeat-timeout", str(HEARTBEAT_S), "--reap-hold", hold),
        *("--eviction-high-watermark", "1", "--eviction-low-watermark", "0.9"),
    ]


def wait_for(what: str, predicate: Callable[[], Any]) -> Any:
    deadline = time.monotonic() + BOUND_S
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {BOUND_S} s")
        time.sleep(0.1)
    return value


def overlaps(regions: list[list], owners: set[str], spans: list[list]) -> list[list]:
    """The regions of `owners` that overlap any of `spans` ([path, offset, length])."""
    return [
        r
        for r in regions
        if r[0] in owners
        and any(r[1] == p and r[2] < o + n and o < r[2] + r[3] for p, o, n in spans)
    ]


class HostA:
    """Host A's writer and reader: every round the writer stores ROUND new values and the
    reader reads all of them so far, and host B's, by their bytes."""

    def __init__(self, pod: Pod):
        url, key = pod.server.url, pod.key
        self.writer = Agent(pod.a.pid, url, key, pool_size=POOL)
        self.reader = Agent(pod.a.pid, url, key, pool_size="2M")
        self.written = 0  # values a/0 .. a/written-1 were stored (or tried)
        self.stored = 0
        self.a_reads = [0, 0, 0]  # right, missing, wrong: all rounds together
        self.fresh = [0, 0, 0]  # ... of the values stored in the round just before
        self.b_reads = [0, 0, 0]

    def round(self, b_keys: int = 0, n: int = ROUND) -> None:
        self.stored += self.writer.ok("store", "a", self.written, n)
        add(self.fresh, self.reader.ok("read", "a", self.written, n))
        self.written += n
        first = max(0, self.written - WINDOW)
        add(self.a_reads, self.reader.ok("read", "a", first, self.written - first))
        if b_keys:
            add(self.b_reads, self.reader.ok("read", "b", 0, b_keys))

    def trickle_until(self, what: str, done: Callable[[], object], b_keys: int) -> None:
        """Rounds of one value until `done()`: A writes and reads on while it waits, without
        filling the pool before the fill that may need a lost host's range (a writer refused
        a region before that fill makes room by evicting its own keys, and asks no more)."""
        wait_for(what, lambda: self.round(b_keys, 1) or done())

    def audit(self) -> None:
        """Read every value stored so far (window by window), as a round reads its last."""
        for first in range(0, self.written, WINDOW):
            n = min(WINDOW, self.written - first)
            add(self.a_reads, self.reader.ok("read", "a", first, n))

    def stats(self) -> dict:
        return self.reader.ok("stats")

    def regions(self) -> list[list]:
        return self.reader.ok("regions")

    def report(self) -> dict:
        """The counts so far (copies)."""
        return {
            "a_stored": self.stored,
            "a_written": self.written,
            "a_reads": list(self.a_reads),
            "fresh": list(self.fresh),
            "b_reads": list(self.b_reads),
        }

    def close(self) -> None:
        self.writer.close()
        self.reader.close()


def add(total: list[int], counts: list[int]) -> None:
    for i, n in enumerate(counts):
        total[i] += n


def spans_of(regions: list[list], owner: str) -> list[list]:
    return [r[1:] for r in regions if r[0] == owner]


def killed(neutral: Path, workdir: Path, hold: str) -> dict:
    """Host B stores, then every process of it is SIGKILLed; host A goes on through B's reap,
    fills the pool during the hold, and goes on until the hold has ended, and after."""
    out: dict[str, Any] = {}
    with pod_hosts(neutral, workdir, server_args(hold), pool_size=POOL) as pod:
        a = HostA(pod)
        b = Agent(pod.b.pid, pod.server.url, pod.key, pod.b_pool, pool_size="4M")
        netns = -1
        try:
            out["b_stored"] = b.ok("store", "b", 0, 24)
            a.round(24)
            spans = spans_of(a.regions(), b.instance)
            out["b_regions"] = len(spans)
            netns, out["b_killed"] = kill_host(pod.b.pid)
            began = time.monotonic()
            a.trickle_until("B reaped", lambda: b.instance not in a.stats()["instances"], 24)
            out["reaped_s"] = round(time.monotonic() - began, 1)  # (told, not judged)
            stats = a.stats()
            out["held_at_reap"] = stats["orphaned"]["held"]
            out["b_after_reap"] = a.reader.ok("read", "b", 0, 24)
            owners = {a.writer.instance, a.reader.instance}
            during: list[list] = []
            began = time.monotonic()
            for _ in range(16):  # 16 rounds of 16 values: 16 MiB, the whole pool
                a.round(24)
                during += overlaps(a.regions(), owners, spans)
            out["fill_s"] = round(time.monotonic() - began, 1)  # (told, not judged)
            out["overlap_during_hold"] = during
            out["held_after_fill"] = a.stats()["orphaned"]["held"]
            out["during_hold"] = a.report()
            a.trickle_until("the hold ended", lambda: not a.stats()["orphaned"]["held"], 24)
            for _ in range(16):
                a.round(24)
            a.audit()
            out["end"] = a.report()
        finally:
            b.proc.kill()
            a.close()
            if netns >= 0:
                os.close(netns)
    return out


def cut(neutral: Path, workdir: Path, hold: str, late: str = "fill") -> dict:
    """Host B stores (and, `late` "fill", reserves a run of chunks); its veth is set down. Its
    client's steps fail or miss within its timeout; host A goes on through B's reap and fills
    the pool (`late` "store": only once the hold has ended: the cut outlasts it). Then B, still
    cut off, writes late: "fill" writes its reserved run in place (what nothing can fence) and
    seals it, "store" stores new values. Once the link is back B reconnects (as a new
    instance), stores, and reads A's values."""
    out: dict[str, Any] = {}
    with pod_hosts(neutral, workdir, server_args(hold), pool_size=POOL) as pod:
        a = HostA(pod)
        b = Agent(
            *(pod.b.pid, pod.server.url, pod.key, pod.b_pool),
            pool_size="4M",
            timeout_ms=1000,
            regions="one",  # (64 chunks: its engine writes on in the cut)
        )
        try:
            out["b_stored"] = b.ok("store", "b", 0, 16)
            out["b_reserved"] = b.ok("alloc", 8)  # (unsealed: its region is never parked)
            a.round(16)
            out["b_reads_a"] = b.ok("read", "a", 0, a.written)
            spans = spans_of(a.regions(), b.instance)
            out["b_regions"] = len(spans)
            sh(pod.b.pid, "ip link set pod-b down")
            began = time.monotonic()
            out["b_cut_store"] = b.ask("store", "cut", 0, 4)
            out["b_cut_read"] = b.ask("read", "a", 0, a.written)
            out["b_cut_s"] = round(time.monotonic() - began, 1)  # (told, not judged)
            a.trickle_until("B reaped", lambda: b.instance not in a.stats()["instances"], 16)
            out["held_at_reap"] = a.stats()["orphaned"]["held"]
            late_stores: list[dict] = []
            if late == "store":  # B's engine goes on storing, a value a round
                a.trickle_until(
                    "the hold ended",
                    lambda: (
                        late_stores.append(b.ask("store", "late", len(late_stores), 1))
                        or not a.stats()["orphaned"]["held"]
                    ),
                    16,
                )
            owners = {a.writer.instance, a.reader.instance}
            overlap: list[list] = []
            for _ in range(16):  # 16 MiB, the whole pool
                a.round(16)
                overlap += overlaps(a.regions(), owners, spans)
                if late == "store":
                    late_stores.append(b.ask("store", "late", len(late_stores), 1))
            out["overlap"] = overlap
            began = time.monotonic()
            if late == "fill":  # in place, into its old region
                out["b_late"] = [b.ask("fill", "late")]
            else:  # a batch, after A's fill
                out["b_late"] = [*late_stores, b.ask("store", "late", len(late_stores), 8)]
            out["b_late_s"] = round(time.monotonic() - began, 1)  # (told, not judged)
            a.audit()
            out["held_after_late"] = a.stats()["orphaned"]["held"]
            out["during_cut"] = a.report()
            sh(pod.b.pid, "ip link set pod-b up")
            out["b_back_store"] = b.ask("store", "back", 0, 8)
            out["b_instance_changed"] = b.ok("whoami") != b.instance
            a.round(16)  # (values stored since B is back: no room made for B evicted them)
            out["b_back_reads_a"] = b.ok("read", "a", a.written - ROUND, ROUND)
            out["a_reads_b_back"] = a.reader.ok("read", "back", 0, 8)
            a.audit()
            out["end"] = a.report()
        finally:
            b.close()
            a.close()
    return out


def requests_of(stats: dict) -> tuple[dict, dict]:
    """(requests per operation, of host B per operation) from a STATS reply."""
    ops = {name: op["count"] for name, op in stats["operations"].items()}
    return ops, dict(stats["host_requests"].get(CLIENT_IP, {}))


def delta(after: dict, before: dict) -> dict:
    return {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}


def sigkill_server(pod: Pod) -> None:
    """SIGKILL the maru-server process itself (under `nsenter` and `timeout`)."""
    assert pod.server.proc is not None
    sigkill_under_timeout(pod.server.proc)


def sigkill_under_timeout(proc: Any) -> None:
    """SIGKILL the process `proc`'s `timeout` runs (`nsenter` execs `timeout`, which forks
    it), then wait for the `timeout` to end."""
    pid = proc.pid
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        os.kill(int(child), 9)
    proc.wait(30)


def index(neutral: Path, workdir: Path, coherence: str, slots: str) -> dict:
    """Writers and readers on both hosts through the in-pool index; then the pool recreated
    behind the pod's back (see the module)."""
    out: dict[str, Any] = {}
    args = ["--coherence", coherence, "--index-slots", slots]
    with pod_hosts(neutral, workdir, args) as pod:
        url, key = pod.server.url, pod.key
        agents = [Agent(pod.a.pid, url, key), Agent(pod.b.pid, url, key, pod.b_pool)]
        try:
            a_writer, b_writer = agents
            out["stored"] = [a_writer.ok("store", "a", 0, 32), b_writer.ok("store", "b", 0, 32)]
            agents += [Agent(pod.a.pid, url, key), Agent(pod.b.pid, url, key, pod.b_pool)]
            a_reader, b_reader = agents[2:]
            out["local"] = [a_reader.ok("local"), b_reader.ok("local")]
            before = requests_of(b_reader.ok("stats"))
            out["b_reads"] = [
                b_reader.ok("copy", "a", 0, 32, ""),
                b_reader.ok("copy", "b", 0, 32, ""),
            ]
            after = requests_of(b_reader.ok("stats"))
            out["ops_during_b_reads"] = delta(after[0], before[0])
            out["b_requests_during_b_reads"] = delta(after[1], before[1])
            out["a_reads"] = [
                a_reader.ok("copy", "b", 0, 32, ""),
                a_reader.ok("copy", "a", 0, 32, ""),
            ]
            for agent in (a_writer, b_writer, a_reader):
                agent.close()
            sigkill_server(pod)
            pod.server.start(pod.server.port, once_args=["--no-restore"])
            a_again = Agent(pod.a.pid, url, key)
            agents.append(a_again)
            out["a_restored"] = a_again.ok("store_as", "a", 0, 32, "#2")
            out["a_reads_new"] = a_again.ok("copy", "a", 0, 32, "#2")
            out["b_reads_new"] = b_reader.ask("copy", "a", 0, 32, "#2")  # (refused, or counts)
        finally:
            for agent in agents:
                agent.close()
    return out


def server_down(neutral: Path, workdir: Path, coherence: str) -> dict:
    """The server's host fails (see the module): host B keeps reading what the in-pool index
    proves, stores nothing, and reads and stores again once the server is back."""
    out: dict[str, Any] = {"wrong": 0}
    args = ["--coherence", coherence, "--index-slots", "auto", "--heartbeat-timeout", "30"]
    with pod_hosts(neutral, workdir, args) as pod:
        url, key = pod.server.url, pod.key
        a_writer = Agent(pod.a.pid, url, key)
        b_writer = Agent(pod.b.pid, url, key, pod.b_pool, timeout_ms=2000)
        b_reader = Agent(pod.b.pid, url, key, pod.b_pool, timeout_ms=2000)
        agents = [a_writer, b_writer, b_reader]

        def b_reads(tag: str = "") -> list[list[int]]:
            counts = [b_reader.ok("copy", p, 0, 32, tag) for p in ("a", "b")]
            out["wrong"] += sum(c[2] for c in counts)
            return counts

        try:
            out["stored"] = [a_writer.ok("store", "a", 0, 32), b_writer.ok("store", "b", 0, 32)]
            out["local"] = b_reader.ok("local")
            out["before"] = b_reads()
            # Host A fails: its server and its writer SIGKILLed, its end of the veth down.
            sigkill_server(pod)
            sigkill_under_timeout(a_writer.proc)
            sh(pod.a.pid, "ip link set pod-a down")
            out["down_reads"] = b_reads()
            out["down_store"] = b_writer.ask("store", "c", 0, 8)  # (refused: no server)
            out["down_reads_after_store"] = b_reads()
            # Host A comes back: the server restores its registry from the journal.
            sh(pod.a.pid, "ip link set pod-a up")
            pod.server.start(pod.server.port)
            deadline, healed = time.monotonic() + BOUND_S, None
            while time.monotonic() < deadline:
                reply = b_reader.ask("copy", "a", 0, 32, "")
                if "ok" in reply:
                    out["wrong"] += reply["ok"][2]
                    if reply["ok"][0] == 32:
                        healed = b_reads()
                        break
                time.sleep(0.2)
            out["restored_reads"] = healed
            stored = 0
            while time.monotonic() < deadline and stored < 8:
                reply = b_writer.ask("store", "c", 0, 8)
                stored = reply.get("ok", 0)
                if stored < 8:
                    time.sleep(0.2)
            out["stored_again"] = stored
            out["read_again"] = b_reader.ok("copy", "c", 0, 8, "")
            out["wrong"] += out["read_again"][2]
        finally:
            for agent in agents:
                agent.close()
    return out


if __name__ == "__main__":
    import json

    case = {"killed": killed, "cut": cut, "index": index, "server_down": server_down}[sys.argv[3]]
    print(json.dumps(case(Path(sys.argv[1]), Path(sys.argv[2]), *sys.argv[4:])))
