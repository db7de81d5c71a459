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

import contextlib
import grp
import io
import logging
import os
import shutil
import socket
import stat
import threading

import pytest
import zmq

from maru import MaruHandler, MaruNotConnected
from maru.client.cli import main as client_main
from maru.common import protocol
from maru.common.protocol import ErrorCode, MsgType, RegisterStatus, unix_address
from maru.server.state_dir import secure_state_dir

from .workers import SPAWN, run_processes

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


def become_nobody(groups: list[int]) -> None:
    """This process becomes uid 65534 with `groups` (as supplementary groups)."""
    "localhost".encode("idna")  # loaded now: root's interpreter files are not 65534's to read
    os.setgroups(groups)
    os.setgid(NOBODY)
    os.setuid(NOBODY)


def local_intruder(port: int, pool: str, groups: list[int], frames: list[bytes]) -> dict:
    """Another user (uid 65534, `groups`): finds the server's abstract socket in
    /proc/net/unix, as anyone can, sends `frames` there and returns the replies it got
    ([request id, ok, code, error]) and whether it could open the pool file."""
    become_nobody(groups)
    try:
        os.close(os.open(pool, os.O_RDWR))
        can_map = True
    except PermissionError:
        can_map = False
    with open("/proc/net/unix") as f:
        names = [line.split()[-1] for line in f if len(line.split()) >= 8]
    address = next(n for n in names if n.startswith(f"@maru:tcp://127.0.0.1:{port}:"))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)  # a bound: the server answers or closes at once
    sock.connect(unix_address(address))
    replies: list[list] = []
    reader = protocol.StreamReader()
    # the server may have refused and closed already: then what it sent is still there
    with contextlib.suppress(OSError):
        sock.sendall(b"".join(protocol.stream_prefix(f) + f for f in frames))
    with contextlib.suppress(OSError):  # reset by the server: closed with our requests unread
        while len(replies) < len(frames):
            data = sock.recv(1 << 16)
            if not data:
                break
            reader.feed(data)
            for frame in reader.frames():
                header, body = protocol.decode(frame)
                replies.append([header.request_id, body["ok"], body.get("code"), body.get("error")])
    sock.close()
    return {"uid": os.getuid(), "can_map": can_map, "replies": replies}


def nobody_client(url: str, server_key: str, client_key: str, values: dict) -> dict:
    """A Maru client of uid 65534 that can map the pool (its file made 0666 by the test): it
    stores and reads `values`, over TCP once the server refuses its local socket."""
    become_nobody([])
    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    logging.getLogger("maru.client.rpc").addHandler(Keep(logging.WARNING))
    with MaruHandler(
        server_url=url,
        pool_size="4M",
        chunk_size_bytes="64K",
        server_public_key=server_key,
        curve_client_key=client_key,
    ) as h:
        stored = h.batch_store(list(values), list(values.values()))
        read = [bytes(i.view) if i else None for i in h.batch_retrieve(list(values))]
    return {"stored": stored, "read": read, "warnings": messages}


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run the intruder as another user")
@pytest.mark.skipif(not zmq.has("curve"), reason="this libzmq has no CURVE")
def test_another_user_on_the_local_socket_is_refused_unless_listed(maru_server_factory, tmp_path):
    """Issue 40, case 4: with --curve --curve-clients, a process of another user that cannot
    open the pool found the abstract socket in /proc/net/unix and deleted every key
    (DELETE_PREFIX): 16 of 16 (before this, here too: every key gone). Now the local socket
    serves only the processes that may map the pool (the server's user, root,
    --pool-group's members, --local-uids): anyone else gets one NOT_AUTHORIZED reply and the
    connection is closed unread. A client so refused goes on over TCP."""
    keys_dir, allowed = tmp_path / "keys", tmp_path / "allowed"
    keys_dir.mkdir()
    allowed.mkdir()
    assert client_main(["curve-keypair", str(keys_dir / "c")], out=io.StringIO()) == 0
    shutil.copy(keys_dir / "c.pub", allowed / "c.pub")
    client_key = (keys_dir / "c.key").read_text().strip()
    server = maru_server_factory(
        pool_size="64M", extra_args=["--curve", "--curve-clients", str(allowed)]
    )
    server_key = (server.state_dir / "curve.pub").read_text().strip()
    values = {f"k{i}": os.urandom(10_000 + i) for i in range(16)}
    doomed = {f"goneA{i}": os.urandom(3000) for i in range(4)}
    doomed |= {f"goneB{i}": os.urandom(3000) for i in range(4)}

    def handler() -> MaruHandler:
        return MaruHandler(
            server_url=server.url,
            pool_size="4M",
            chunk_size_bytes="64K",
            server_public_key=server_key,
            curve_client_key=client_key,
        )

    def read_back(keys) -> list[bytes | None]:
        with handler() as h:
            return [bytes(i.view) if i else None for i in h.batch_retrieve(list(keys))]

    def intrude(groups: list[int], frames: list[bytes]) -> dict:
        args = (server.port, server.pool_path, groups, frames)
        return run_processes([(local_intruder, args)], timeout=60)[0]

    with handler() as h:
        assert all(h.batch_store(list(values), list(values.values())))
        assert all(h.batch_store(list(doomed), list(doomed.values())))
        assert h.stats()["local_connections"] >= 1  # root's client is served there
    wipe = [
        protocol.encode(MsgType.DELETE_PREFIX, 1, {"all": True}),
        protocol.encode(MsgType.DELETE_PREFIX, 2, {"prefix": ""}),
        protocol.encode(MsgType.LOOKUP_KV, 3, {"keys": list(values)}),
    ]
    got = intrude([], wipe)
    assert got["uid"] == NOBODY and not got["can_map"]
    intact = [a == b for a, b in zip(read_back(values), values.values())]
    print(f"\nintruder's replies: {got['replies']}; {sum(intact)} of 16 values intact")
    assert intact == [True] * 16  # before: 0 of 16 (DELETE_PREFIX all: ok)
    assert read_back(doomed) == list(doomed.values())
    assert len(got["replies"]) == 1, got  # the refusal, and nothing of its requests
    request_id, ok, code, error = got["replies"][0]
    assert (request_id, ok, code) == (0, False, ErrorCode.NOT_AUTHORIZED)
    assert f"uid {NOBODY} may not use" in error and f"--local-uids {NOBODY}" in error
    assert "refused a connection of pid" in server.read_log()

    # a user that can map the pool by other means (its file made 0666 here) but is not
    # listed: its client is refused the local socket and goes on over TCP
    os.chmod(server.pool_path, 0o666)
    mine = {f"nobody{i}": os.urandom(5000 + i) for i in range(4)}
    args = (server.url, server_key, client_key, mine)
    out = run_processes([(nobody_client, args)], timeout=120)[0]
    assert out["stored"] == [True] * 4 and out["read"] == list(mine.values())
    assert any("refuses this process (uid 65534)" in m for m in out["warnings"]), out
    assert read_back(mine) == list(mine.values())
    os.chmod(server.pool_path, 0o600)  # (a server refuses to start on a pool all may write)

    # listed with --local-uids, the same process is served
    server.restart(once_args=["--local-uids", f"root,{NOBODY}"])
    got = intrude([], [protocol.encode(MsgType.DELETE_PREFIX, 1, {"prefix": "goneA"})])
    assert [r[:3] for r in got["replies"]] == [[1, True, None]], got
    # a member of --pool-group is served too (it may map the pool)
    users = grp.getgrnam("users").gr_gid
    server.restart(once_args=["--pool-group", "users"])
    got = intrude([users], [protocol.encode(MsgType.DELETE_PREFIX, 1, {"prefix": "goneB"})])
    assert got["can_map"] and [r[:3] for r in got["replies"]] == [[1, True, None]], got
    assert read_back(doomed) == [None] * 8  # their deletes were served
    assert read_back(values) == list(values.values())
    assert read_back(mine) == list(mine.values())


def tcp_intruder(url: str, pool: str, key: str, length: int) -> dict:
    """Another user (uid 65534), which cannot read the pool, on the server's TCP port (no
    --curve: anyone may reach it): it handshakes, asks for a region with no pool proof and with
    proofs it can make up, and registers `key` in any region it gets (its fresh bytes, which
    it never wrote). Returns the uid, whether it could open the pool, the region replies
    ([ok, code, error]) and the registration's result (None: it had no region)."""
    from maru.common.poolmark import pool_proof

    become_nobody([])
    try:
        os.close(os.open(pool, os.O_RDONLY))
        can_read = True
    except PermissionError:
        can_read = False
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)  # a bound: the server answers at once
    sock.connect(url)

    def ask(msg_type: MsgType, body: dict) -> dict:
        sock.send(protocol.encode(msg_type, 1, body))
        return protocol.decode(sock.recv())[1]

    hello = ask(MsgType.HANDSHAKE, {"name": "intruder", "pid": os.getpid()})
    session, iid = hello["session"], hello["iid"]
    regions, registered = [], None
    for proof in (None, "0" * 32, pool_proof(bytes(16), iid), pool_proof(b"\xff" * 16, iid)):
        body = {"session": session, "size": 2 << 20}
        if proof is not None:
            body["pool_proof"] = proof
        reply = ask(MsgType.REQUEST_REGION, body)
        regions.append([reply["ok"], reply.get("code"), reply.get("error")])
        if reply["ok"] and registered is None:
            rid, token = reply["region"][0], reply["region"][4]
            registered = ask(
                MsgType.REGISTER_KV,
                {
                    "session": session,
                    "keys": [key],
                    "region_ids": protocol.pack_int64([rid]),
                    "offsets": protocol.pack_int64([0]),
                    "lengths": protocol.pack_int64([length]),
                    "tokens": [[rid, token]],
                },
            ).get("results")
    sock.close()
    ctx.term()
    return {"uid": os.getuid(), "can_read": can_read, "regions": regions, "registered": registered}


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run the intruder as another user")
def test_another_user_on_tcp_cannot_take_a_region_nor_register_a_key(maru_server_factory):
    """Without --curve, anyone who reaches the TCP port can talk to the server. A process of
    another user, which cannot read the pool, took a region and registered a key before its
    writer did (first writer wins): every instance then read that key as a hit with the
    region's zeros (before: its REQUEST_REGION was served and the writer's bytes never read).
    A region is now only for an instance that proves it reads the pool: an HMAC of its id
    keyed by the pool key in the pool's mark, which never crosses a socket."""
    server = maru_server_factory(pool_size="64M")
    value = os.urandom(100_000)
    args = (server.url, server.pool_path, "victim", len(value))
    got = run_processes([(tcp_intruder, args)], timeout=60)[0]
    assert got["uid"] == NOBODY and not got["can_read"]
    assert got["registered"] is None, got  # before: [REGISTERED], the key its own
    assert [r[:2] for r in got["regions"]] == [[False, ErrorCode.NOT_AUTHORIZED]] * 4, got
    assert "proven it reads the pool" in got["regions"][0][2]
    assert "without proving it reads the pool" in server.read_log()
    with MaruHandler(server_url=server.url, pool_size="4M", chunk_size_bytes="64K") as writer:
        assert writer.store("victim", value)
    with MaruHandler(server_url=server.url, pool_size="4M", chunk_size_bytes="64K") as reader:
        info = reader.retrieve("victim")
        assert info is not None and bytes(info.view) == value  # before: 100,000 zeros

    # a proof of the server's previous start (its pool key then) is no proof after a restart
    with MaruHandler(server_url=server.url, pool_size="4M", chunk_size_bytes="64K") as h:
        assert h.store("before-restart", b"x" * 1000)
        server.restart()
        assert h.store("after-restart", b"y" * 1000)  # (its handshake again: a new proof)
        info = h.retrieve("after-restart")
        assert info is not None and bytes(info.view) == b"y" * 1000


def test_a_process_on_the_servers_tcp_port_that_cannot_prove_the_pool_key_gets_nothing(
    maru_server_factory,
):
    """While the server is down, any process may take its TCP port (without --curve nothing
    authenticates the server). One that had handshaken with the real server knows every public
    field of its reply (the pool's path, mark, generation, epoch): a client believed it, then
    sent it its writes and read its locations as hits (any bytes of the pool, another key's).
    Now the server proves at HANDSHAKE that it holds the pool key in the mark (an HMAC of the
    client's fresh nonce), which the squatter cannot: the client refuses it before anything."""
    server = maru_server_factory(pool_size="64M")
    with MaruHandler(server_url=server.url, pool_size="4M", chunk_size_bytes="64K") as h:
        assert h.store("kept", b"k" * 5000)
    learn = zmq.Context.instance().socket(zmq.DEALER)
    learn.setsockopt(zmq.LINGER, 0)
    learn.setsockopt(zmq.RCVTIMEO, 10_000)
    learn.connect(server.url)
    learn.send(protocol.encode(MsgType.HANDSHAKE, 1, {"name": "spy", "pid": 1, "nonce": "n0"}))
    seen = protocol.decode(learn.recv())[1]  # (its mark, and the proof of the nonce "n0")
    learn.close()
    assert seen["pool"]["mark"]["proof"]
    server.halt()  # (its pool and state stay: the mark the squatter names is the pool's)

    squatter = zmq.Context.instance().socket(zmq.ROUTER)
    squatter.setsockopt(zmq.LINGER, 0)
    squatter.bind(f"tcp://127.0.0.1:{server.port}")
    asked: list[int] = []
    stop = threading.Event()

    def serve() -> None:  # every HANDSHAKE answered with the real server's reply, replayed
        while not stop.is_set():
            if not squatter.poll(50):
                continue
            route, frame = squatter.recv_multipart()
            header, _ = protocol.decode(frame)
            asked.append(header.msg_type)
            reply = dict(seen) if header.msg_type == MsgType.HANDSHAKE else {"ok": True}
            out = protocol.encode(header.msg_type, header.request_id, reply, reply=True)
            squatter.send_multipart([route, out])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        h = MaruHandler(server_url=server.url, pool_size="4M", chunk_size_bytes="64K")
        try:
            assert not h.connected  # before: connected, its writes and lookups served by it
            assert "cannot prove it holds the key" in str(h.connect_error)
            with pytest.raises(MaruNotConnected):
                h.store("sent", b"s" * 5000)
        finally:
            h.close()
    finally:
        stop.set()
        thread.join(10)
        squatter.close()
    assert set(asked) <= {MsgType.HANDSHAKE, MsgType.DISCONNECT}, asked
    server.start(server.port)
    with MaruHandler(server_url=server.url, pool_size="4M", chunk_size_bytes="64K") as h:
        info = h.retrieve("kept")
        assert info is not None and bytes(info.view) == b"k" * 5000
