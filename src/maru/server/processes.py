"""Which clients' processes still run: is a silent instance dead, or only paused?

A writer reserves chunks of its own region and writes into them without asking the server.
If the server took the region from a silent writer and gave it to another instance, the
writer could resume (after SIGSTOP, a long GC pause, swapping) and write into the new owner's
pages: a wrong hit for every reader of them. Silence alone cannot tell a paused process from
a dead one; the kernel can.

A client on the server's Unix socket is a process the kernel names: the connection's peer
pidfd (`maru.common.peer.peer_pidfd`) follows that very process, never one that later gets
its pid, and polls readable once it has exited. So an instance whose process is watched is
judged by it: alive (running, stopped, paused), it keeps everything however long it is
silent; exited, it is reaped at once. An instance without a watched process (TCP clients, a
client in another pid namespace, every instance after a server restart until it speaks on the
Unix socket again) is judged by its silence, and its regions are held back after a reap
(`InstanceTable.reap`).

The same pidfd makes a credential one process's (`ProcessWatch.claim`,
`MaruService.handle_frame`).
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
        """Speak for `instance_id` as the process at the other end of `sock` (a Unix
        connection a request of the instance came on): None if that process holds the
        instance, or now does (the first to claim it, watched from now on); else why not.

        A credential lives in one process: another process presenting it (a child forked
        after connecting, a copy handed to a stranger) would write into the pages its
        holder hands out next, or return the holder's regions. Checked once per connection
        and instance: a connection is its connecting process's. A holder that has exited
        holds on until the instance is reaped: its pid may already be another process's."""
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
        """Watch `pidfd` (owned from now on) as `instance_id`'s process: `claim` without a
        socket."""
        self.forget(instance_id)
        self._holders[instance_id] = (pid, pidfd)

    def pids(self, instance_id: str) -> list[int]:
        """The watched process of an instance, if it had not exited when last looked at."""
        held = self._holders.get(instance_id)
        return [held[0]] if held is not None else []

    def exited(self) -> list[str]:
        """The instances whose watched processes have exited (one poll, no waiting). A
        process seen to exit is no longer watched."""
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
