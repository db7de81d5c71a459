"""Who is at the other end of a Unix socket, as the kernel says (not as the peer claims).

Both sides use it: the server to watch its clients' processes (`maru.server.processes`), the
client to make sure the socket it reached is the server's.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)  # Linux 6.5; not named by Python 3.11
SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux 4.13; not named by Python 3.11
_GROUPS_BYTES = 1024  # the most getsockopt reads in Python: 256 groups


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process that made the connection (for a listening socket's
    client: when it connected; for a client: the server's when it listened). The pid is 0
    when that process is in a pid namespace this one cannot see."""
    return _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))


def peer_groups(sock: socket.socket) -> tuple[int, ...]:
    """The supplementary groups of the process that made the connection, as the kernel took
    them at connect time; () when they cannot be had (a kernel before 4.13, more than 256)."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, _GROUPS_BYTES)
    except OSError:
        return ()
    return struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) // 4 * 4])


def peer_pidfd(sock: socket.socket) -> tuple[int, int] | None:
    """(pid, pidfd) of the peer process, or None when it cannot be had (a kernel before 5.3;
    before 6.5, a process in another pid namespace). The caller closes the pidfd. The pid is 0
    for a process in a pid namespace this one cannot see (another container of a pod), which
    SO_PEERPIDFD still names.

    SO_PEERPIDFD (Linux 6.5) names the very process that connected, even if it has exited and
    its pid was reused since; before 6.5, `pidfd_open` of SO_PEERCRED's pid can, in that rare
    case, name the newcomer instead."""
    pid = peer_credentials(sock)[0]
    with contextlib.suppress(OSError):
        return pid, sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
    if pid <= 0:
        return None
    try:
        return pid, os.pidfd_open(pid)
    except (OSError, AttributeError):
        return None
