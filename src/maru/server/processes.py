"""Which clients' processes still run: is a silent instance dead, or only paused?

A writer writes into its region's chunks without asking the server, so giving a silent
writer's region to another instance is safe only once the writer is dead: a paused one (SIGSTOP,
a long GC pause, swapping) would resume into the new owner's pages, a wrong hit for their
readers. Silence cannot tell paused from dead; the kernel can. A Unix-socket client's peer pidfd
(`maru.common.peer.peer_pidfd`) follows that very process, never a later holder of its pid, and
polls readable once it has exited: a watched instance keeps everything however long it is
silent, and is reaped as soon as its process exits. An unwatched one (TCP, another pid
namespace, any instance after a server restart until it speaks on the Unix socket) is judged by
its silence, its regions held back after a reap (`InstanceTable.reap`).
"""

from __future__ import annotations

import logging
import os
import select
import socket

from maru.common.peer import peer_credentials, peer_pidfd

log = logging.getLogger(__name__)


class ProcessWatch:
    """Per instance, the one process that holds its credential: the first that spoke for it
    on the Unix socket (its pid and a pidfd of it)."""

    def __init__(self) -> None:
        self._holders: dict[str, tuple[int, int]] = {}  # instance id -> (pid, pidfd)

    def claim(self, instance_id: str, sock: socket.socket) -> str | None:
        """Speak for `instance_id` as the peer process of `sock` (a Unix connection): None if
        that process holds the instance or, the first to claim it, now does; else why not.
        A credential is one process's: another presenting it (a child forked after connecting,
        a stranger given a copy) would write into pages its holder is handed next, or return
        its regions. An exited holder holds on until the reap: its pid may be reused."""
        held = self._holders.get(instance_id)
        if held is None:
            peer = peer_pidfd(sock)
            if peer is not None:  # else: the kernel cannot name it (judged by its silence)
                self._holders[instance_id] = peer
                log.debug("instance %s: watching its process %d", instance_id, peer[0])
            return None
        pid, pidfd = held
        peer_pid = peer_credentials(sock)[0]
        if peer_pid == pid and not _exited(pidfd):
            return None
        return f"process {peer_pid or '(unnamed)'} is not the process {pid} that holds it"

    def holder(self, instance_id: str) -> int | None:
        """The pid of the process that holds `instance_id`, if one claimed it."""
        held = self._holders.get(instance_id)
        return held[0] if held is not None else None

    def add(self, instance_id: str, pid: int, pidfd: int) -> None:
        """Watch `pidfd` (now owned) as `instance_id`'s process: `claim` without a socket."""
        self.forget(instance_id)
        self._holders[instance_id] = (pid, pidfd)

    def pids(self, instance_id: str) -> list[int]:
        """The watched process of an instance, if it had not exited when last looked at."""
        held = self._holders.get(instance_id)
        return [held[0]] if held is not None else []

    def exited(self) -> list[str]:
        """The instances whose watched process has exited (one poll, no wait); now unwatched."""
        if not self._holders:
            return []
        poller = select.poll()
        for _, pidfd in self._holders.values():
            poller.register(pidfd, select.POLLIN)
        gone = {fd for fd, _ in poller.poll(0)}
        out = [iid for iid, (_, pidfd) in self._holders.items() if pidfd in gone]
        for instance_id in out:
            os.close(self._holders.pop(instance_id)[1])
        return out

    def forget(self, instance_id: str) -> None:
        held = self._holders.pop(instance_id, None)
        if held is not None:
            os.close(held[1])

    def close(self) -> None:
        for instance_id in list(self._holders):
            self.forget(instance_id)


def _exited(pidfd: int) -> bool:
    """Whether the process of `pidfd` has exited (a pidfd polls readable then)."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))
