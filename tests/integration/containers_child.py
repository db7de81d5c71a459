"""Run by `test_containers.py` inside a "container" (a pid and a mount namespace of its own,
entered with `nsenter`), so that the process the server sees is really in another pid
namespace than the server's.

`containers_child.py server CAP PIDFS ARGS...`: `maru-server ARGS...` with at most CAP
instances per process on the local socket (`maru.server.instances.MAX_PER_PROCESS`, which the
command line does not set), so that a test can reach the cap with a handful of handlers;
PIDFS `off`: processes told apart by pid alone, as on kernels before 6.9 (else: the kernel's).

`containers_child.py agent URL POOL_PATH POOL_SIZE`: one client kept connected, told what to
do by a JSON line on stdin (`[op, *args]`, one of `OPS`) and answering each with one JSON line
(`{"ok": ...}`, or `{"error": ...}` for a `MaruError`): `pod_child.AGENT_OPS` (store, read,
alloc, fill, stats, ...) and a few more (its pid as its namespace sees it, how it reaches the
server, more handlers of its own, its instance's session credential, a raw request with any
credential on a connection of its own to the local socket).
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TESTS.parent), str(TESTS)]  # (tests.integration, and conftest as pytest has it)

from tests.integration.pod_child import AGENT_OPS, keys_of, serve  # noqa: E402
from tests.integration.test_crash_safety import make_value  # noqa: E402

from maru import MaruHandler  # noqa: E402
from maru.common import protocol  # noqa: E402
from maru.common.errors import MaruError  # noqa: E402
from maru.common.protocol import MsgType  # noqa: E402

VALUE = 60_000  # (pod_child's: one 64 KiB chunk a value)


def handler(url: str, pool_path: str, pool_size: str) -> MaruHandler:
    return MaruHandler(
        server_url=url,
        pool_path=None if pool_path == "-" else pool_path,
        pool_size=pool_size,
        chunk_size_bytes="64K",
        timeout_ms=5000,
        auto_expand=False,  # (one region of pool_size: `alloc` reserves all of it)
    )


def transport(h: MaruHandler) -> dict[str, Any]:
    """How this handler reaches the server: the Unix socket the handshake named and whether
    this thread's connection to it is open (else its requests go over TCP)."""
    channels = getattr(h._rpc._local, "channels", None)
    local = channels.local if channels is not None else None
    return {
        "local_address": h._rpc.local_address,
        "local_connected": local is not None and local.sock is not None,
    }


def present(address: str, session: str, keys: list[str]) -> list:
    """EXISTS for `keys` with the credential `session`, sent raw (as a copy of another
    process's credential would be: a handler refuses to be used after a fork) on a connection
    of this process's own to the local socket `address`: [ok, code, error, results]."""
    frame = protocol.encode(MsgType.EXISTS, 1, {"session": session, "keys": keys})
    reader = protocol.StreamReader()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)  # a bound: the server answers at once
        sock.connect(protocol.unix_address(address))
        sock.sendall(protocol.stream_prefix(frame) + frame)
        while True:
            data = sock.recv(1 << 16)
            if not data:
                raise ConnectionError("the server closed the connection unanswered")
            reader.feed(data)
            for reply in reader.frames():
                _, body = protocol.decode(reply)
                return [body["ok"], body.get("code"), body.get("error"), body.get("results")]


def more_handlers(url: str, pool_path: str, extra: list[MaruHandler], n: int, tag: str) -> list:
    """Open `n` more handlers in this process, each storing one value (a request on the local
    socket, where the server counts the process's instances): per handler [its instance id,
    stored, why not (or "")]. They stay open until the agent ends."""
    out = []
    for i in range(n):
        h = handler(url, pool_path, "1M")
        extra.append(h)
        if not h.connected:
            out.append([None, False, f"connect: {h.connect_error}"])
            continue
        key = f"{tag}/{i}"
        try:
            out.append([h.instance_id, bool(h.store(key, make_value(key, VALUE))), ""])
        except MaruError as exc:
            out.append([h.instance_id, False, f"{type(exc).__name__}: {exc}"])
    return out


def agent(url: str, pool_path: str, pool_size: str) -> None:
    h = handler(url, pool_path, pool_size)
    extra: list[MaruHandler] = []
    ops = {
        **AGENT_OPS,
        "pid": lambda h, _: os.getpid(),
        "connected": lambda h, _: [h.connected, str(h.connect_error or "")],
        "transport": lambda h, _: transport(h),
        "session": lambda h, _: h._rpc.session,
        "present": lambda h, _, address, session, keys: present(address, session, keys),
        "handlers": lambda h, _, n, tag: more_handlers(url, pool_path, extra, n, tag),
        "keys": lambda h, _, prefix, start, n: keys_of(prefix, start, n),
    }
    try:
        serve(h, ops)
    finally:
        for e in extra:
            e.close()
        h.close()


def server(cap: str, pidfs: str, args: list[str]) -> int:
    import maru.server.instances
    import maru.server.processes
    from maru.server.cli import main

    maru.server.instances.MAX_PER_PROCESS = int(cap)
    if pidfs == "off":  # as on a kernel before 6.9: a process it cannot see goes unwatched
        maru.server.processes.PIDFS = False
    return main(args)


if __name__ == "__main__":
    if sys.argv[1] == "server":
        sys.exit(server(sys.argv[2], sys.argv[3], sys.argv[4:]))
    agent(*sys.argv[2:5])
