"""Which clients' processes still run: is a silent instance dead, or only paused?

A writer writes into its region's chunks without asking the server, so giving a silent
writer's region to another instance is safe only once the writer is dead: a paused one (SIGSTOP,
a long GC pause, swapping) would resume into the new owner's pages, a wrong hit for their
readers. Silence cannot tell paused from dead; the kernel can. A Unix-socket client's peer pidfd
(`maru.common.peer.peer_pidfd`) follows that very process, never a later holder of its pid, and
polls readable once it has exited: a watched instance keeps everything however long it is
silent, and is reaped as soon as its process exits. An unwatched one (TCP, any instance after a
server restart until it speaks on the Unix socket) is judged by its silence, its regions held
back after a reap (`InstanceTable.reap`).

A process is told from another by its pidfd's inode where pidfds have one of their own (pidfs,
Linux 6.9: one per process, never reused), else by its pid. So a client in another pid
namespace (another container of the server's pod, whose pid reads 0 here) is watched too where
the kernel gives its pidfd and names it by inode; with neither it is unwatched.
"""

from __future__ import annotations

import logging
import os
import select
import socket
from collections.abc import Callable
from typing import NamedTuple

from maru.common.peer import peer_pidfd

log = logging.getLogger(__name__)


def _pidfs() -> bool:
    """Whether pidfds are files of their own (pidfs): before Linux 6.9 every pidfd is the one
    anonymous inode that an epoll descriptor is too."""
    try:
        pidfd = os.pidfd_open(os.getpid())
    except (OSError, AttributeError):
        return False
    try:
        with select.epoll() as other:
            return os.fstat(pidfd).st_ino != os.fstat(other.fileno()).st_ino
    finally:
        os.close(pidfd)


PIDFS = _pidfs()


class Holder(NamedTuple):
    """The process that holds an instance: its pid as this pid namespace numbers it (0: one
    it cannot see), a pidfd of it (owned), and what tells it from every other process."""

    pid: int
    pidfd: int
    identity: int


def _holder(pid: int, pidfd: int) -> Holder | None:
    """The process of `pidfd` (now owned), named by its pidfd's inode (pidfs), else by its
    pid; None (the pidfd closed) where neither names it apart (pid 0 without pidfs)."""
    if PIDFS:
        return Holder(pid, pidfd, os.fstat(pidfd).st_ino)
    if pid > 0:
        return Holder(pid, pidfd, pid)
    os.close(pidfd)
    return None


def identify(sock: socket.socket) -> Holder | None:
    """The peer process of `sock` (a Unix connection) with a pidfd of it, or None when the
    kernel cannot name it apart from others (no pidfd; pid 0 without pidfs)."""
    peer = peer_pidfd(sock)
    return _holder(*peer) if peer is not None else None


class ProcessWatch:
    """Per instance, the one process that holds its credential: the first that spoke for it
    on the Unix socket."""

    def __init__(self) -> None:
        self._holders: dict[str, Holder] = {}  # instance id -> its process

    def claim(
        self,
        instance_id: str,
        sock: socket.socket,
        admit: Callable[[Holder], None] | None = None,
    ) -> str | None:
        """Speak for `instance_id` as the peer process of `sock` (a Unix connection): None if
        that process holds the instance or, the first to claim it, now does; else why not.
        A credential is one process's: another presenting it (a child forked after connecting,
        a stranger given a copy) would write into pages its holder is handed next, or return
        its regions. An exited holder holds on until the reap: its pid may be reused.
        `admit`: called with a first claimant before it is watched; what it raises refuses it
        (nothing watched)."""
        held = self._holders.get(instance_id)
        peer = identify(sock)
        if held is None:
            if peer is not None:  # else: the kernel cannot name it (judged by its silence)
                try:
                    if admit is not None:
                        admit(peer)
                except BaseException:
                    os.close(peer.pidfd)
                    raise
                self.watch(instance_id, peer)
            return None
        if peer is not None:
            os.close(peer.pidfd)
            if peer.identity == held.identity and not _exited(held.pidfd):
                return None
        return f"process {_named(peer)} is not the process {_named(held)} that holds it"

    def watch(self, instance_id: str, holder: Holder) -> None:
        """`holder` (its pidfd now owned here) holds `instance_id`."""
        self.forget(instance_id)
        self._holders[instance_id] = holder
        log.debug("instance %s: watching its process %s", instance_id, _named(holder))

    def holder(self, instance_id: str) -> int | None:
        """What tells the process holding `instance_id` from others (`Holder.identity`), if
        one claimed it: equal for the instances of one process."""
        held = self._holders.get(instance_id)
        return held.identity if held is not None else None

    def held_by(self, identity: int) -> int:
        """How many instances the process of `identity` holds."""
        return sum(1 for held in self._holders.values() if held.identity == identity)

    def add(self, instance_id: str, pid: int, pidfd: int) -> None:
        """Watch `pidfd` (now owned) as `instance_id`'s process, `pid`: `claim` without a
        socket."""
        held = _holder(pid, pidfd)
        if held is not None:
            self.watch(instance_id, held)

    def pids(self, instance_id: str) -> list[int]:
        """The watched process of an instance, if it had not exited when last looked at, by
        its pid here (0: a process in a pid namespace this one cannot see)."""
        held = self._holders.get(instance_id)
        return [held.pid] if held is not None else []

    def exited(self) -> list[str]:
        """The instances whose watched process has exited (one poll, no wait); now unwatched."""
        if not self._holders:
            return []
        poller = select.poll()
        for held in self._holders.values():
            poller.register(held.pidfd, select.POLLIN)
        gone = {fd for fd, _ in poller.poll(0)}
        out = [iid for iid, held in self._holders.items() if held.pidfd in gone]
        for instance_id in out:
            os.close(self._holders.pop(instance_id).pidfd)
        return out

    def forget(self, instance_id: str) -> None:
        held = self._holders.pop(instance_id, None)
        if held is not None:
            os.close(held.pidfd)

    def close(self) -> None:
        for instance_id in list(self._holders):
            self.forget(instance_id)


def process_name(pid: int) -> str:
    """A process for a message: its pid, or where it is when this pid namespace has none."""
    return str(pid) if pid > 0 else "(in another pid namespace)"


def _named(process: Holder | None) -> str:
    return process_name(process.pid) if process is not None else "(unnamed)"


def _exited(pidfd: int) -> bool:
    """Whether the process of `pidfd` has exited (a pidfd polls readable then)."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))
