"""Maru in containers (a Kubernetes pod): maru-server in one container, clients in others, made
with real namespaces. Every container has a pid namespace and a mount namespace of its own (a
fresh /proc) and shares this network namespace, so the server's abstract Unix socket
(`@maru:...`) is reachable from all of them; the pool lies in a shared tmpfs volume that each
client container sees at its own path (`pool_path`), the server's path hidden there. Real
`maru-server` and client processes; values are judged by their bytes.

What the tests prove:

1. A client in a sibling pid namespace connects over the local socket (the server counts its
   requests under host "local", `local_connections`), stores values, and a client in a third
   container and one on the host read them byte for byte, both containers through the local
   index beside the pool file (the server names it at its own path). Without `pool_path` it
   is refused, naming the path.
2. The server tells processes apart by their pidfd's inode where the kernel gives each its own
   (pidfs, Linux 6.9), so it watches a client in a sibling container too (`watched_pids` [0]:
   no pid here) and caps each process's local-socket instances on its own (`MAX_PER_PROCESS`,
   set to 2 here through `containers_child.py server`); by pid alone (before 6.9, forced
   here: `containers_child.py server CAP off`) such a client goes unwatched and uncapped. A
   client in the server's own container is watched and capped either way. Processes are never
   lumped together.
3. The paused-writer promise (docs/reliability.md, P4) for a writer in a sibling container
   SIGSTOPped between reserving and sealing, past `--heartbeat-timeout`, while another instance
   stores twice a region: with pidfs the writer is watched, not reaped, and resumed its seal
   lands and its values read right; by pid alone it is reaped, its region held, and resumed its
   seal is refused (the region held: with no hold the TCP test shows the writer's bytes in
   the other's pages). Either way 0 of the other instance's values read wrong.
4. A client SIGKILLed in a sibling container: with pidfs reaped at once (its pidfd says it
   exited); by pid alone not when its connections close (a paused process's could close too)
   but after `--heartbeat-timeout`. Its keys stay readable by their bytes.
5. An instance's session credential is one process's across pid namespaces too: a copy of a
   sibling-container writer's credential, presented on the local socket by another process
   (in a third container, or in the writer's own) is refused NOT_AUTHORIZED with pidfs, the
   message naming each "(in another pid namespace)", and the writer goes on storing; by pid
   alone the server cannot tell them apart and serves the copy (a documented limitation).

Skipped, with the reason, where root, `unshare` or `nsenter` is missing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import conftest  # tests/conftest.py (on sys.path): its server command is patched per pod
from maru import MaruHandler
from maru.common.protocol import ErrorCode
from maru.server.instances import MAX_PER_PROCESS
from maru.server.processes import PIDFS

from .pod_child import Agent as PodAgent
from .test_paused_writer import CHUNKS, instances, store_twice_a_region
from .test_pool_trust import read_counts
from .workers import digest

CHILD = Path(__file__).with_name("containers_child.py")

# How the server tells processes apart: by their pidfd's inode (pidfs, Linux 6.9), which names
# a process of another pid namespace too, or by pid alone (before 6.9, forced here), where such
# a process goes unwatched.
NAMING = [
    pytest.param(
        True,
        id="pidfs",
        marks=pytest.mark.skipif(not PIDFS, reason="pidfds have no inode of their own here"),
    ),
    pytest.param(False, id="by pid"),
]
LIFE_S = 120  # the longest a container (and all it runs) may outlive the test
WAIT_S = 30.0  # a bound for a run to stop waiting (never a threshold the test judges)
# A container: pid and mount namespaces of its own (a fresh /proc), this network namespace
UNSHARE = [
    *("unshare", "--pid", "--fork", "--kill-child", "--mount-proc"),
    *("--mount", "--propagation", "private"),
]


def containers_missing() -> str:
    """Why this machine cannot make containers (pid and mount namespaces; root), or ""."""
    missing = [tool for tool in ("unshare", "nsenter") if shutil.which(tool) is None]
    if missing:
        return f"no {', '.join(missing)}"
    if os.geteuid() != 0:
        return "not root: cannot make pid and mount namespaces"
    probe = [*UNSHARE, "sh", "-c", "mount -t tmpfs none /mnt"]
    done = subprocess.run(probe, capture_output=True, timeout=30)
    if done.returncode != 0:
        return f"cannot make pid and mount namespaces: {done.stderr.decode().strip()}"
    return ""


MISSING = containers_missing()
pytestmark = pytest.mark.skipif(bool(MISSING), reason=MISSING or "-")


def until(check: Callable[[], bool], bound: float = WAIT_S, step: float = 0.05) -> bool:
    """Wait (at most `bound` seconds) until `check()`; whether it held."""
    deadline = time.monotonic() + bound
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(step)
    return True


def child_of(pid: int) -> int:
    """The one child of process `pid` (the process `unshare --fork` or `nsenter -p` runs)."""
    children: list[str] = []

    def found() -> bool:
        with contextlib.suppress(OSError):
            children[:] = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        return bool(children)

    if not until(found, 10.0, 0.01):
        raise RuntimeError(f"process {pid} started no child within 10 s")
    return int(children[0])


class Container:
    """A container: a pid namespace (its pid 1 a `sleep`, whose end ends everything in it) and
    a mount namespace of its own (private propagation, a fresh /proc, `setup` run in it
    first); this network namespace."""

    def __init__(self, workdir: Path, name: str, setup: str = ""):
        ready = workdir / f"{name}.ready"
        script = f"{setup}\ntouch {ready}\nexec sleep {LIFE_S}"
        self.log = workdir / f"{name}.log"  # (unshare's complaints, the setup's errors)
        with open(self.log, "wb") as log:
            self.unshare = subprocess.Popen([*UNSHARE, "sh", "-ec", script], stderr=log)
        if not until(ready.exists, 10.0, 0.01):
            self.unshare.kill()
            self.unshare.wait(10)
            raise RuntimeError(f"container {name} not made within 10 s: {self.log.read_text()}")
        self.pid = child_of(self.unshare.pid)  # its pid 1, as this namespace sees it

    def enter(self) -> list[str]:
        """The command prefix that runs a process in the container."""
        return ["nsenter", "-t", str(self.pid), "-p", "-m", "--"]

    def close(self) -> None:
        """Kill its pid 1: the kernel kills every process in it; its mounts go with them."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        self.unshare.wait(10)


class Agent(PodAgent):
    """A client process in a container (`containers_child.py agent`); `pid` is its pid as this
    namespace sees it (to stop or kill it), `ask`/`ok` as `pod_child.Agent`'s."""

    def __init__(self, box: Container, url: str, pool_path: str = "-", pool_size: str = "4M"):
        cmd = [*box.enter(), sys.executable, str(CHILD), "agent", url, pool_path, pool_size]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.pid = child_of(self.proc.pid)  # (nsenter forks into the pid namespace)
        self.instance = self.ok("whoami")

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)
        if sig == signal.SIGCONT:  # (nsenter stops itself when its child stops)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)


@dataclass
class Pod:
    """The server's container, two client containers (`writer`: a private /dev/shm;
    `reader`: the server's /dev/shm, as containers of a pod share it), where each sees the
    pool, and the server, which runs in `server_box`."""

    server_box: Container
    writer: Container
    reader: Container
    writer_pool: str
    reader_pool: str
    server: conftest.MaruServerProcess
    watcher: MaruHandler  # a client on the host, kept connected: it asks for STATS

    def host_handler(self, pool_size: str = "4M") -> MaruHandler:
        """A client on the host (the parent pid namespace: the server cannot see it either)."""
        return MaruHandler(
            server_url=self.server.url,
            pool_size=pool_size,
            chunk_size_bytes="64K",
            timeout_ms=10_000,
        )

    def stats(self) -> dict:
        return self.watcher.stats()


def client_container(workdir: Path, name: str, volume: Path, private_shm: bool) -> Container:
    """A client container that sees the volume at its own path (`<name>-volume`), the
    server's path to it empty."""
    view = workdir / f"{name}-volume"
    view.mkdir()
    setup = f"mount --bind {volume} {view}\nmount -t tmpfs hidden {volume}"
    if private_shm:
        setup += "\nmount -t tmpfs shm /dev/shm"
    return Container(workdir, name, setup)


def stop_in_container(server: conftest.MaruServerProcess) -> None:
    """SIGTERM the server itself (not nsenter, which would leave it running), then let the
    fixture's `stop` reap nsenter and remove the pool."""
    if server.proc is not None and server.proc.poll() is None:
        with contextlib.suppress(RuntimeError, ProcessLookupError):
            os.kill(child_of(server.proc.pid), signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.proc.wait(10)
    server.stop()


@contextlib.contextmanager
def pod(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    args: list[str],
    cap: int = MAX_PER_PROCESS,
    pool_size: str = "8M",
    pidfs: bool = True,
) -> Iterator[Pod]:
    """The containers and `maru-server --pool-size POOL_SIZE *args` (at most `cap`
    local-socket instances per process; `pidfs` False: processes told apart by pid alone, as
    before Linux 6.9) in the server's container, its pool in a tmpfs volume; all ended on the
    way out."""
    workdir = tmp_path / "pod"
    workdir.mkdir()
    volume = workdir / "volume"
    with conftest.tmpfs_mounted(volume, "64m"):
        boxes: list[Container] = []
        server = watcher = None
        try:
            boxes.append(Container(workdir, "server"))
            boxes.append(client_container(workdir, "writer", volume, private_shm=True))
            boxes.append(client_container(workdir, "reader", volume, private_shm=False))
            naming = "kernel" if pidfs else "off"
            command = [*boxes[0].enter(), sys.executable, str(CHILD), "server", str(cap), naming]
            monkeypatch.setattr(conftest, "maru_server_command", lambda: command)
            server = conftest.MaruServerProcess(
                workdir / "srv",
                pool_size=pool_size,
                pool=str(volume / "maru.pool"),
                extra_args=args,
            )
            server.start()
            watcher = MaruHandler(server_url=server.url, pool_size="1M", timeout_ms=10_000)
            yield Pod(
                *boxes,
                str(workdir / "writer-volume" / "maru.pool"),
                str(workdir / "reader-volume" / "maru.pool"),
                server,
                watcher,
            )
        finally:
            if watcher is not None:
                watcher.close()
            if server is not None:
                stop_in_container(server)
            for box in boxes:
                box.close()


def close_all(agents: list[Agent]) -> None:
    for agent in agents:
        with contextlib.suppress(ProcessLookupError):
            agent.signal(signal.SIGCONT)
        agent.close()


def test_a_client_in_a_sibling_container_writes_what_others_read_by_its_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pod(tmp_path, monkeypatch, []) as p:
        agents: list[Agent] = []
        try:
            agents.append(w := Agent(p.writer, p.server.url, p.writer_pool))
            assert w.ok("store", "w", 0, 16) == 16
            how = w.ok("transport")
            assert how["local_address"].startswith("@maru:") and how["local_connected"], how
            stats = p.stats()
            mine = stats["instances"][w.instance]
            assert mine["host"] == "local"  # its requests came on the Unix socket
            assert mine["pid"] == w.ok("pid") != w.pid  # (what it reported: its namespace's)
            assert stats["local_connections"] >= 1

            agents.append(r := Agent(p.reader, p.server.url, p.reader_pool))
            assert r.ok("read", "w", 0, 16) == [16, 0, 0]  # a third pid namespace
            # The local index lies beside the pool file: found there through `pool_path` too
            assert w.ok("local") is True and r.ok("local") is True
            with p.host_handler() as h:  # and the host
                assert read_counts(h, [f"w/{i}" for i in range(16)]) == (16, 0, 0)

            # Its own container hides the server's path to the pool: unset, it is refused
            agents.append(lost := Agent(p.writer, p.server.url))
            connected, why = lost.ok("connected")
            assert not connected and "does not exist" in why, why
        finally:
            close_all(agents)


@pytest.mark.parametrize("pidfs", NAMING)
def test_the_server_watches_the_processes_it_can_name_and_caps_each_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pidfs: bool
) -> None:
    cap = 2
    with pod(tmp_path, monkeypatch, [], cap=cap, pool_size="16M", pidfs=pidfs) as p:
        agents: list[Agent] = []
        try:
            # In the server's own container the process is watched, and capped
            agents.append(near := Agent(p.server_box, p.server.url, pool_size="1M"))
            assert near.ok("store", "near", 0, 1) == 1
            got = near.ok("handlers", cap, "near-more")
            watched = p.stats()["instances"]
            assert watched[near.instance]["watched_pids"] == [near.ok("pid")]
            assert got[0][1], got  # its second instance
            assert not got[1][1] and "the most one process may" in got[1][2], got  # its third

            # Two processes of a sibling container (pid 0 here): with pidfs each watched and
            # capped on its own; by pid alone unwatched, none refused. Never lumped together.
            far_ids: set[str] = set()
            for n in range(2):
                agents.append(far := Agent(p.writer, p.server.url, p.writer_pool, "1M"))
                assert far.ok("store", f"far{n}", 0, 1) == 1
                got = far.ok("handlers", cap, f"far{n}-more")
                far_ids |= {far.instance, *(iid for iid, stored, _ in got if stored)}
                if pidfs:
                    assert got[0][1], got  # its second instance
                    assert not got[1][1] and "in another pid namespace" in got[1][2], got
                else:
                    assert all(stored for _, stored, _ in got), got
            assert len(far_ids) == 2 * (cap if pidfs else cap + 1)
            seen = p.stats()["instances"]
            for iid in far_ids:
                assert seen[iid]["watched_pids"] == ([0] if pidfs else [])
                assert seen[iid]["host"] == "local"
        finally:
            close_all(agents)


@pytest.mark.parametrize("pidfs", NAMING)
def test_a_paused_writer_in_another_container_never_writes_into_another_instances_pages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pidfs: bool
) -> None:
    """`test_paused_writer.py`'s run, with the writer A in a sibling container on the local
    socket instead of on TCP. With pidfs the server watches A's process there: stopped, it is
    never reaped and its region stays its own. By pid alone it cannot: A is reaped for its
    silence and its region held (that the hold is what keeps A out of B's pages is shown on
    TCP, the same path: `test_paused_writer.py`'s "before" case)."""
    args = ["--heartbeat-timeout", "1", "--reap-hold", "60"]
    with pod(tmp_path, monkeypatch, args, pidfs=pidfs) as p:
        agents: list[Agent] = []
        b = p.host_handler()
        try:
            agents.append(a := Agent(p.writer, p.server.url, p.writer_pool))
            assert a.ok("alloc", CHUNKS) is True  # every chunk of its region, reserved
            assert a.ok("transport")["local_connected"]
            assert instances(b)[a.instance]["watched_pids"] == ([0] if pidfs else [])
            a.signal(signal.SIGSTOP)
            if pidfs:  # silent past the timeout, alive: not reaped
                alive = f"instance {a.instance} silent for"
                assert until(lambda: alive in p.server.read_log(), step=0.1)
                assert "(in another pid namespace) is alive" in p.server.read_log()
                assert a.instance in instances(b)
            else:
                assert until(lambda: a.instance not in instances(b), step=0.1)  # reaped

            stored = store_twice_a_region(b)  # A's pages, or B's own

            a.signal(signal.SIGCONT)
            sealed = a.ok("fill", "a")  # A writes all its reserved chunks, then seals
            keys = list(stored)
            infos = b.batch_retrieve(keys)
            read = {k: digest(bytes(i.view)) for k, i in zip(keys, infos) if i is not None}
            wrong = sum(read[k] != stored[k] for k in read)
            print(f"\npidfs {pidfs}: {len(read)} of B's values read, {wrong} wrong")
            assert wrong == 0 and len(read) >= CHUNKS // 2
            a_keys = [f"a/{i}" for i in range(CHUNKS)]
            if pidfs:  # its region stayed its own: its seal lands, its values read right
                assert sealed == CHUNKS
                assert read_counts(b, a_keys) == (CHUNKS, 0, 0)
            else:
                assert sealed == 0  # reaped: its region is not its own any more
                assert b.stats()["orphaned"]["held"] == 1
                assert read_counts(b, a_keys) == (0, CHUNKS, 0)
        finally:
            b.close()
            close_all(agents)


@pytest.mark.parametrize("pidfs", NAMING)
def test_a_killed_client_in_another_container_is_reaped_and_its_keys_stay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pidfs: bool
) -> None:
    """With pidfs its exit is seen at once; by pid alone it is reaped after
    `--heartbeat-timeout`, not when its connections close (which a paused process's may
    too)."""
    args = ["--heartbeat-timeout", "2", "--reap-hold", "60"]
    with pod(tmp_path, monkeypatch, args, pidfs=pidfs) as p:
        agents: list[Agent] = []
        try:
            agents.append(w := Agent(p.writer, p.server.url, p.writer_pool))
            assert w.ok("store", "k", 0, 16) == 16
            before = p.stats()
            assert before["instances"][w.instance]["watched_pids"] == ([0] if pidfs else [])
            assert before["instances"][w.instance]["local_connections"] >= 1
            w.signal(signal.SIGKILL)
            w.proc.wait(10)

            if pidfs:
                assert until(lambda: w.instance not in p.stats()["instances"], step=0.1)
                reaped = f"instance {w.instance} reaped: its process exited"
            else:
                # Its connections are closed (the server saw both go), yet it is not reaped
                def gone() -> bool:
                    mine = p.stats()["instances"].get(w.instance)
                    return mine is None or (not mine["local_connections"] and mine["dropped"])

                if not until(gone, step=0.1):
                    mine = p.stats()["instances"][w.instance]
                    raise AssertionError(f"{mine}\n{p.server.read_log()[-3000:]}")
                assert w.instance in p.stats()["instances"]
                assert until(lambda: w.instance not in p.stats()["instances"], step=0.1)
                reaped = f"instance {w.instance} reaped after 2s without a heartbeat"
            log = p.server.read_log()
            assert reaped in log, log[-3000:]

            agents.append(r := Agent(p.reader, p.server.url, p.reader_pool))
            assert r.ok("read", "k", 0, 16) == [16, 0, 0]
            with p.host_handler() as h:
                assert read_counts(h, [f"k/{i}" for i in range(16)]) == (16, 0, 0)
        finally:
            close_all(agents)


@pytest.mark.parametrize("pidfs", NAMING)
def test_a_credential_copied_to_another_process_across_pid_namespaces_is_refused_with_pidfs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pidfs: bool
) -> None:
    """The writer (a sibling container) holds its instance: it spoke for it first on the local
    socket. Another process presents a copy of its session credential there, a raw EXISTS of
    its keys on a connection of its own: a process of a third container, and one of the
    writer's own (the writer's process, asking so, is served). With pidfs each is refused,
    the writer's process watched and its stores served as before. By pid alone (before Linux
    6.9) the writer is unwatched (pid 0 here) and a process of another pid namespace cannot
    be told from it: the copy is served, the keys reported (docs/reliability.md, "What Maru
    does not promise")."""
    with pod(tmp_path, monkeypatch, [], pidfs=pidfs) as p:
        agents: list[Agent] = []
        try:
            agents.append(w := Agent(p.writer, p.server.url, p.writer_pool))
            assert w.ok("store", "w", 0, 4) == 4  # on the local socket: it holds its instance
            how = w.ok("transport")
            assert how["local_connected"], how
            session, keys = w.ok("session"), [f"w/{i}" for i in range(4)]
            assert isinstance(session, str) and session
            watched = [0] if pidfs else []
            assert p.stats()["instances"][w.instance]["watched_pids"] == watched

            # The same raw request from the writer's own process, on a new connection: served
            served = [True, None, None, [True] * 4]  # [ok, code, error, results]
            assert w.ok("present", how["local_address"], session, keys) == served

            agents.append(Agent(p.reader, p.server.url, p.reader_pool))  # a third namespace
            agents.append(Agent(p.writer, p.server.url, p.writer_pool))  # the writer's own
            for other in agents[1:]:
                ok, code, error, results = other.ok("present", how["local_address"], session, keys)
                print(
                    f"\npidfs {pidfs}, the copy presented: ok {ok}, code {code}, {error or results}"
                )
                if pidfs:
                    assert (ok, code, results) == (False, ErrorCode.NOT_AUTHORIZED, None), error
                    assert f"instance {w.instance}'s credential is one process's" in error
                    named = "process (in another pid namespace) is not the process (in another"
                    assert named in error, error
                else:  # served: the server cannot tell the copy's process from the writer's
                    assert [ok, code, error, results] == served

            # The writer goes on as before: its next store is served, its process still its own
            assert w.ok("store", "w", 4, 4) == 4
            assert w.ok("read", "w", 0, 8) == [8, 0, 0]
            assert p.stats()["instances"][w.instance]["watched_pids"] == watched
        finally:
            close_all(agents)
