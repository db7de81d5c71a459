"""Scenario 7 of issue 13 (P5): another local user takes the server's abstract Unix socket name
while the server restarts. The issue measured: the impostor had the name 0.87 s after the kill,
the real server only logged "Address already in use", and connected clients sent it their
stores and read its bytes as hits.

Now clients use the local socket only if its peer (SO_PEERCRED) runs as the server's user, as
the server's handshake said, and the server, finding its name taken, logs an ERROR naming the
squatter and listens under a new name. Real server, real impostor process running as another
user (uid 65534, via setuid in a spawned child: needs root). Also: the state dir is 0700 and
its files 0600."""

from __future__ import annotations

import logging
import os
import socket
import stat

import pytest

from maru import MaruHandler
from maru.common import protocol
from maru.common.protocol import MsgType, RegisterStatus, unix_address
from maru.server.cli import secure_state_dir

from .workers import SPAWN

NOBODY = 65534


def impostor(address: str, bound, stop, out) -> None:
    """Another user's process squatting `address`: it answers every REGISTER_KV with "all
    registered" (a store that would be lost) and anything else with an error. Puts
    (frames received, stores it acknowledged, its uid) on `out` when told to stop."""
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(unix_address(address))
    listener.listen(16)
    listener.settimeout(0.05)
    bound.set()
    frames = acked = 0
    conns: list[tuple[socket.socket, protocol.StreamReader]] = []
    while not stop.is_set():
        try:
            sock, _ = listener.accept()
            sock.settimeout(0.01)
            conns.append((sock, protocol.StreamReader()))
        except TimeoutError:
            pass
        for sock, reader in conns:
            try:
                data = sock.recv(1 << 16)
            except (TimeoutError, OSError):
                continue
            reader.feed(data)
            for frame in reader.frames():
                frames += 1
                header, body = protocol.decode(frame)
                if header.msg_type == MsgType.REGISTER_KV:
                    reply = {"ok": True, "results": [RegisterStatus.REGISTERED] * len(body["keys"])}
                    acked += len(body["keys"])
                else:
                    reply = {"ok": False, "code": 4, "error": "impostor"}
                out_frame = protocol.encode(header.msg_type, header.request_id, reply, reply=True)
                sock.sendall(protocol.stream_prefix(out_frame) + out_frame)
    out.put((frames, acked, os.getuid()))


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run the impostor as another user")
def test_an_impostor_on_the_local_socket_gets_nothing(maru_server_factory, caplog):
    server = maru_server_factory(pool_size="64M")
    values = {f"k{i}": os.urandom(10_000 + i) for i in range(16)}
    c = MaruHandler(server_url=server.url, pool_size="4M", chunk_size_bytes="64K")
    bound, stop, out = SPAWN.Event(), SPAWN.Event(), SPAWN.Queue()
    squatter = None
    try:
        keys = list(values)
        assert all(c.batch_store(keys[:8], [values[k] for k in keys[:8]]))
        stats = c.stats()
        address = stats["local_socket"]
        assert address.startswith("@maru:") and stats["local_connections"] >= 1

        server.proc.kill()  # SIGKILL: the name is free; the impostor takes it
        server.proc.wait(10)
        squatter = SPAWN.Process(target=impostor, args=(address, bound, stop, out))
        squatter.start()
        assert bound.wait(30)
        server.restart()
        assert "another process squats maru-server's name" in server.read_log()

        with caplog.at_level(logging.ERROR, logger="maru.client.rpc"):
            assert all(c.batch_store(keys[8:], [values[k] for k in keys[8:]]))
            infos = c.batch_retrieve(keys)
        assert [bytes(i.view) if i else None for i in infos] == list(values.values())
        assert any("impersonating maru-server" in r.getMessage() for r in caplog.records)
        stats = c.stats()
        moved = stats["local_socket"]
        assert moved != address and moved.startswith(address + ":")
        assert stats["local_connections"] >= 1  # c found the server's new name
        d = MaruHandler(server_url=server.url, pool_size="4M", chunk_size_bytes="64K")
        infos = d.batch_retrieve(keys)
        assert [bytes(i.view) if i else None for i in infos] == list(values.values())
        d.close()
    finally:
        c.close()
        stop.set()
        if squatter is not None:
            frames, acked, uid = out.get(timeout=30)
            squatter.join(10)
    print(f"\nimpostor (uid {uid}): {frames} frames received, {acked} stores acknowledged")
    assert uid == NOBODY and frames == 0 and acked == 0


def test_the_state_dir_is_private(maru_server_factory, tmp_path):
    """0700 for the state dir, 0600 for its files; an existing dir made with a loose umask is
    tightened at start."""
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    (loose / "secret.key").write_bytes(b"s" * 32)
    os.chmod(loose / "secret.key", 0o644)
    secure_state_dir(loose)
    assert stat.S_IMODE(loose.stat().st_mode) == 0o700
    assert stat.S_IMODE((loose / "secret.key").stat().st_mode) == 0o600

    server = maru_server_factory(pool_size="64M")
    with MaruHandler(server_url=server.url, pool_size="4M") as h:
        assert h.store("k", b"v" * 100)
    server.restart()  # a snapshot and an identity written again
    state = server.state_dir
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    files = [p for p in state.iterdir() if p.is_file()]
    assert {p.name for p in files} >= {"secret.key", "pool-identity.json", "snapshot.msgpack"}
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in files} == {p.name: 0o600 for p in files}
