"""The server <-> sidecar channel (`maru.server.cluster.link`): whole messages in order, a
server end that never blocks (an outbox, bounded), a peer's exit or a broken stream seen as
the end, a bad message skipped."""

from __future__ import annotations

import socket
import time

import msgpack

from maru.common.protocol import STREAM_LENGTH
from maru.server.cluster import link as link_module
from maru.server.cluster.link import Link


def ends() -> tuple[Link, Link]:
    server, theirs = Link.pair()
    return server, Link(theirs, blocking=True)


def read_all(end: Link, n: int) -> list[dict]:
    """Up to `n` messages, within 10 s."""
    got: list[dict] = []
    deadline = time.monotonic() + 10
    while len(got) < n and not end.closed and time.monotonic() < deadline:
        got += end.receive()
    return got


def test_messages_arrive_whole_and_in_order_both_ways():
    server, sidecar = ends()
    jobs = [["maru2/t/s/key", "/dev/shm/pool", i * 65536, 65536, True] for i in range(64)]
    for batch in range(5):
        assert server.send({"op": "pull", "batch": batch, "jobs": jobs})
    got = read_all(sidecar, 5)
    assert [m["batch"] for m in got] == list(range(5)) and got[4]["jobs"] == jobs
    sidecar.send({"op": "pull-done", "batch": 4, "results": [[0, 7]] * 64, "error": None})
    assert server.receive() == [{"op": "pull-done", "batch": 4, "results": [[0, 7]] * 64,
                                 "error": None}]  # fmt: skip
    assert server.receive() == []  # (nothing more: the server's end does not block)


def test_the_server_end_queues_what_the_socket_does_not_take_and_refuses_past_its_limit(
    monkeypatch,
):
    monkeypatch.setattr(link_module, "OUTBOX_LIMIT", 4 << 20)
    server, sidecar = ends()
    big = {"op": "publish", "batch": 0, "jobs": ["x" * 1000] * 256}  # about 256 KB
    sent = 0
    while server.send(big | {"batch": sent}):  # never blocks: the sidecar reads nothing yet
        sent += 1
        assert sent < 100, "the outbox was never full"
    assert server.outbox and len(server.outbox) > 4 << 20
    assert not server.closed  # (refused, not broken: the loop tries again later)
    got: list[dict] = []
    deadline = time.monotonic() + 10
    while len(got) < sent and time.monotonic() < deadline:
        server.flush()
        got += sidecar.receive()
    assert [m["batch"] for m in got] == list(range(sent)) and not server.outbox


def test_a_peer_that_exits_is_the_end_of_the_channel():
    server, sidecar = ends()
    sidecar.close()
    assert server.receive() == [] and server.closed
    assert server.send({"op": "pull"}) is False
    server2, sidecar2 = ends()
    server2.close()
    assert sidecar2.receive() == [] and sidecar2.closed
    assert sidecar2.send({"op": "state"}) is False


def test_a_message_that_is_not_a_map_is_skipped_and_a_broken_stream_closes(caplog):
    server, theirs = Link.pair()
    raw = theirs
    for payload in (b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"op": "state"})):
        raw.sendall(STREAM_LENGTH.pack(len(payload)) + payload)
    assert read_all(server, 1) == [{"op": "state"}] and not server.closed
    assert "ignored" in caplog.text
    raw.sendall(STREAM_LENGTH.pack(1 << 31) + b"x")  # (a length no frame has)
    assert read_all(server, 1) == [] and server.closed
    raw.close()


def test_the_sidecar_inherits_a_descriptor_it_can_make_its_end_from():
    server, theirs = Link.pair()
    sidecar = Link(socket.socket(fileno=theirs.detach()), blocking=True)
    server.send({"op": "probe", "batch": 1, "jobs": ["a"]})
    assert sidecar.receive() == [{"op": "probe", "batch": 1, "jobs": ["a"]}]


def test_the_loop_watches_the_server_end_for_what_it_needs_and_not_once_closed(monkeypatch):
    """Readable always; writable only while the outbox holds something (else every turn of
    the loop would wake); not at all once closed (a closed end is readable for ever)."""
    import zmq

    monkeypatch.setattr(link_module, "OUTBOX_LIMIT", 1 << 20)
    server, sidecar = ends()
    poller = zmq.Poller()
    server.watch(poller)
    assert dict(poller.sockets) == {server.fd: zmq.POLLIN}
    assert not server.ready(dict(poller.poll(0)))
    while server.send({"op": "publish", "jobs": ["x" * 4096] * 64}):  # (the sidecar reads nothing)
        pass
    server.watch(poller)
    assert dict(poller.sockets) == {server.fd: zmq.POLLIN | zmq.POLLOUT}
    while server.outbox:
        sidecar.receive()
        server.flush()
    server.watch(poller)
    assert dict(poller.sockets) == {server.fd: zmq.POLLIN}
    sidecar.send({"op": "state", "connected": True, "error": None})
    assert server.ready(dict(poller.poll(1000)))
    server.close()
    server.watch(poller)
    assert dict(poller.sockets) == {}


def test_a_sidecar_that_breaks_its_channel_is_started_again(tmp_path, monkeypatch):
    """The tier's side: a channel whose sidecar end closed (its process still running) is
    no longer watched by the loop, and the next housekeeping past RESTART_S starts a fresh
    sidecar on a fresh channel. (The sidecar here is a stand-in process: what is tested is
    the server's supervision, not Mooncake.)"""
    import json
    import os
    import subprocess
    import sys

    import zmq

    from maru.server.cluster import tier as tier_module
    from maru.server.cluster.tier import ClusterTier

    from .test_cluster_tier import SGLANG_FILE
    from .test_eviction_leases import make_registry

    sidecar_ends: list[socket.socket] = []
    real_popen = subprocess.Popen

    def popen(cmd: list[str], **kwargs) -> subprocess.Popen:
        fd = int(cmd[cmd.index("--fd") + 1])
        sidecar_ends.append(socket.socket(fileno=os.dup(fd)))  # (what the sidecar would hold)
        stand_in = [sys.executable, "-c", "import time; time.sleep(60)"]
        return real_popen(stand_in, stdin=subprocess.DEVNULL)

    monkeypatch.setattr(tier_module.subprocess, "Popen", popen)
    config = tmp_path / "mooncake.json"
    config.write_text(json.dumps(SGLANG_FILE))
    tier = ClusterTier(make_registry(tmp_path), str(config))
    poller = zmq.Poller()
    try:
        tier.attach(poller)
        first = tier.link
        assert first is not None and dict(poller.sockets) == {first.fd: zmq.POLLIN}
        sidecar_ends[0].close()  # the sidecar's end of the channel is gone; its process runs
        tier.serve(dict(poller.poll(5000)), poller)  # (its end of stream wakes the loop)
        assert first.closed and dict(poller.sockets) == {}  # not watched: no busy loop
        tier.housekeeping(poller, time.monotonic() + tier_module.RESTART_S + 1)
        assert tier.counts["sidecar_starts"] == 2 and len(sidecar_ends) == 2
        assert tier.link is not None and tier.link is not first and not tier.link.closed
        assert dict(poller.sockets) == {tier.link.fd: zmq.POLLIN}
        Link(sidecar_ends[1], blocking=True).send({"op": "state", "connected": True,
                                                   "error": None})  # fmt: skip
        tier.serve(dict(poller.poll(5000)), poller)
        assert tier.connected
    finally:
        tier.close()
        for end in sidecar_ends:
            end.close()
