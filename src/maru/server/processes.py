"""Which clients' processes still run: is a silent instance dead, or only paused? (issue 13, P4)

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
"""

from __future__ import annotations

import logging
import os
import select
import socket

from maru.common.peer import peer_pidfd

log = logging.getLogger(__name__)


class ProcessWatch:
    """Per instance, the pidfds of the processes that spoke for it on the Unix socket."""

    def __init__(self) -> None:
        self._pidfds: dict[str, dict[int, int]] = {}  # instance id -> pid -> pidfd

    def watch(self, instance_id: str, sock: socket.socket) -> int | None:
        """Watch the process at the other end of `sock` (a Unix connection on which a request
        of `instance_id` came); returns its pid, or None if the kernel cannot name it."""
        peer = peer_pidfd(sock)
        if peer is None:
            return None
        pid, pidfd = peer
        fds = self._pidfds.setdefault(instance_id, {})
        if pid in fds:
            os.close(pidfd)
        else:
            fds[pid] = pidfd
            log.debug("instance %s: watching its process %d", instance_id, pid)
        return pid

    def add(self, instance_id: str, pid: int, pidfd: int) -> None:
        """Watch `pidfd` (owned from now on) for `instance_id`: `watch` without a socket."""
        self._pidfds.setdefault(instance_id, {})[pid] = pidfd

    def pids(self, instance_id: str) -> list[int]:
        """The watched processes of an instance that had not exited when last looked at."""
        return sorted(self._pidfds.get(instance_id, ()))

    def exited(self) -> list[str]:
        """The instances whose watched processes have all exited (one poll, no waiting). A
        process seen to exit is no longer watched; its instance's other processes still are."""
        if not self._pidfds:
            return []
        poller = select.poll()
        for fds in self._pidfds.values():
            for pidfd in fds.values():
                poller.register(pidfd, select.POLLIN)
        gone = {fd for fd, _ in poller.poll(0)}
        if not gone:
            return []
        out = []
        for instance_id, fds in list(self._pidfds.items()):
            for pid, pidfd in list(fds.items()):
                if pidfd in gone:
                    os.close(pidfd)
                    del fds[pid]
            if not fds:
                del self._pidfds[instance_id]
                out.append(instance_id)
        return out

    def forget(self, instance_id: str) -> None:
        for pidfd in self._pidfds.pop(instance_id, {}).values():
            os.close(pidfd)

    def close(self) -> None:
        for instance_id in list(self._pidfds):
            self.forget(instance_id)
