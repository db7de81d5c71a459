"""An EXISTS that waits for the cluster tier's pulls (`maru.server.cluster.waits`): kept by
`handle_frame` (no reply on its turn), answered on the loop turn its pulls land, with what is
registered then, or at its deadline with what is still on its way; one that does not ask to
wait, or past MAX_WAITING, is answered at once as before. The tier here is a stand-in that
records what is wanted (the real pulls, across two nodes: `integration/test_cluster_tier.py`,
whose node-2 reads are woken this way)."""

from __future__ import annotations

import socket
import threading
import time
import uuid

import pytest
import zmq

from maru.common import protocol
from maru.common.protocol import MsgType, unix_address
from maru.server.cluster import waits
from maru.server.local_socket import LocalSocketServer

from .service_calls import make_service, ok, register_body, wire_body

MiB = 1 << 20


class Tier:
    """What `on_exists` and the loop use of a `ClusterTier`: every wanted key is pulling."""

    lookup_ms = 10_000

    def __init__(self) -> None:
        self.pulling: set[str] = set()

    def want(self, missing: list[str]) -> int:
        self.pulling.update(missing)
        return len(missing)

    def announce(self) -> dict:
        return {"lookup_ms": self.lookup_ms}

    def sealed(self, *args) -> None:
        pass

    def stats(self) -> dict:
        return {"pulling": len(self.pulling)}

    def close(self) -> None:
        pass

    def attach(self, poller) -> None:  # (the loop's parts of a tier: nothing to do here)
        pass

    def serve(self, events, poller) -> None:
        pass

    def housekeeping(self, poller, now) -> None:
        pass


@pytest.fixture
def service(tmp_path):
    svc = make_service(tmp_path, pool_mib=16)
    svc.cluster = Tier()
    sent: list[tuple[bytes, bytes]] = []
    svc.tcp.send_later = lambda route, out: sent.append((route, out))  # (the socket's part)
    svc.sent = sent
    ok(svc, MsgType.HANDSHAKE, {"iid": "A", "pid": 1})
    yield svc
    svc.close()


def ask(svc, keys: list[str], request_id: int, **extra) -> bytes | None:
    body = wire_body(svc, MsgType.EXISTS, {"iid": "A", "keys": keys, "pull": True, **extra})
    return svc.handle_frame(protocol.encode(MsgType.EXISTS, request_id, body), route=b"peer")


def register(svc, key: str) -> None:
    region = ok(svc, MsgType.REQUEST_REGION, {"iid": "A", "size": MiB})["region"]
    ok(svc, MsgType.REGISTER_KV, register_body("A", [[key, region[0], 0, 64]]))


def test_a_kept_exists_is_answered_when_its_pulls_land(service):
    register(service, "have")
    assert ask(service, ["have", "p0", "p1"], 11, wait_ms=5000) is None  # kept
    service.waits.settle(service.cluster.pulling, service.registry.exists)
    assert service.sent == []  # both still on their way
    service.cluster.pulling.discard("p0")  # p0 pulled and registered, p1 still coming
    register(service, "p0")
    service.waits.settle(service.cluster.pulling, service.registry.exists)
    assert service.sent == []
    service.cluster.pulling.clear()  # p1 refused (a proof failure): not registered
    service.waits.settle(service.cluster.pulling, service.registry.exists)
    [(route, frame)] = service.sent
    header, reply = protocol.decode(frame)
    assert (route, header.request_id, header.msg_type) == (b"peer", 11, MsgType.EXISTS)
    assert header.flags & protocol.FLAG_REPLY
    assert (reply["ok"], reply["results"], reply["pulling"]) == (True, [True, True, False], 0)
    assert service.waits.waiting == []
    assert service.stats()["cluster"]["exists_kept"] == 1


def test_a_kept_exists_is_answered_at_its_deadline_with_what_is_still_coming(service):
    assert ask(service, ["p0"], 12, wait_ms=50) is None
    [kept] = service.waits.waiting
    assert kept.deadline <= time.monotonic() + 0.05  # the wait asked, not the tier's budget
    service.waits.settle(service.cluster.pulling, service.registry.exists, kept.deadline)
    [(_, frame)] = service.sent
    _, reply = protocol.decode(frame)
    assert (reply["results"], reply["pulling"]) == ([False], 1)
    assert service.stats()["cluster"]["exists_kept_late"] == 1
    assert service.waits.next_ms(time.monotonic()) is None  # nothing left to wake for


def test_without_wait_or_past_the_limit_an_exists_is_answered_at_once(service, monkeypatch):
    _, reply = protocol.decode(ask(service, ["p0"], 13))  # a client that polls
    assert (reply["results"], reply["pulling"]) == ([False], 1)
    monkeypatch.setattr(waits, "MAX_WAITING", 1)
    assert ask(service, ["p1"], 14, wait_ms=5000) is None
    _, reply = protocol.decode(ask(service, ["p2"], 15, wait_ms=5000))
    assert (reply["results"], reply["pulling"]) == ([False], 1)
    assert len(service.waits.waiting) == 1


BOUND_MS = 30_000  # how long a receive may take: a bound for the test to stop, no threshold


def until(predicate) -> bool:
    """Whether `predicate` held within BOUND_MS (polled)."""
    deadline = time.monotonic() + BOUND_MS / 1000
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_over_tcp_a_kept_reply_comes_when_the_pull_lands_and_a_gone_client_leaks_nothing(
    tmp_path,
):
    """A real ROUTER and DEALERs, the server's loop in a thread: a kept EXISTS does not hold
    up the connection's later requests, and is answered (by its request id) once the pull
    is done; one whose client closed is dropped, and the loop serves on."""
    svc = make_service(tmp_path, pool_mib=16)
    svc.cluster = tier = Tier()
    loop = threading.Thread(target=svc.serve_forever, kwargs={"poll_ms": 20}, daemon=True)
    loop.start()
    socks = []

    def dealer() -> zmq.Socket:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, BOUND_MS)
        sock.connect(svc.endpoint)
        socks.append(sock)
        return sock

    def send(sock: zmq.Socket, request_id: int, msg_type: int, body: dict) -> None:
        sock.send(protocol.encode(msg_type, request_id, body))

    def receive(sock: zmq.Socket) -> tuple[int, dict]:
        header, reply = protocol.decode(sock.recv())
        return header.request_id, reply

    try:
        one = dealer()
        send(one, 1, MsgType.HANDSHAKE, {"name": "A", "pid": 1})
        session = receive(one)[1]["session"]
        exists = {"session": session, "pull": True, "wait_ms": BOUND_MS}
        send(one, 2, MsgType.EXISTS, {**exists, "keys": ["p0"]})
        send(one, 3, MsgType.EXISTS, {"session": session, "keys": ["x"]})
        assert receive(one) == (3, {"ok": True, "results": [False], "pulling": 0})
        assert tier.pulling == {"p0"}  # (wanted by request 2, still kept)
        tier.pulling.clear()  # the pull is done (refused: nothing registered)
        request_id, reply = receive(one)
        assert (request_id, reply["results"], reply["pulling"]) == (2, [False], 0)

        gone = dealer()
        send(gone, 4, MsgType.EXISTS, {**exists, "keys": ["p1"]})
        assert until(lambda: svc.waits.counts["exists_kept"] == 2)
        gone.close()
        tier.pulling.clear()
        assert until(lambda: not svc.waits.waiting)  # answered into the void, forgotten
        send(one, 5, MsgType.EXISTS, {"session": session, "keys": ["x"]})
        assert receive(one)[0] == 5  # the loop serves on
        assert svc.waits.counts == {"exists_kept": 2, "exists_kept_late": 0}
    finally:
        svc.stop()
        loop.join(10)
        for sock in socks:
            sock.close()
        svc.close()


def test_the_local_socket_sends_a_kept_reply_later_and_drops_it_for_a_closed_connection():
    """`LocalSocketServer`: a request whose reply is kept (None) holds up nothing; the reply
    sent later arrives on its connection; after the client closed, sending it is a no-op."""
    server = LocalSocketServer(f"@maru-test-{uuid.uuid4().hex}")
    poller = zmq.Poller()
    server.attach(poller)
    kept: list = []

    def handle(frame: bytes, peer=None) -> bytes | None:
        header = protocol.decode_header(frame)
        if header.request_id == 1:
            kept.append(peer)
            return None
        return protocol.encode(MsgType.EXISTS, header.request_id, {"ok": True}, reply=True)

    def turn() -> None:
        server.serve(dict(poller.poll(BOUND_MS)), handle)

    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.settimeout(BOUND_MS / 1000)
    try:
        client.connect(unix_address(server.address))
        for request_id in (1, 2):
            frame = protocol.encode(MsgType.EXISTS, request_id, {"keys": ["k"]})
            client.sendall(protocol.stream_prefix(frame) + frame)
        assert until(lambda: turn() or len(kept) == 1)
        second = protocol.encode(MsgType.EXISTS, 2, {"ok": True}, reply=True)
        assert client.recv(1 << 16).endswith(second)  # not held up by the kept one
        late = protocol.encode(MsgType.EXISTS, 1, {"ok": True, "results": [True]}, reply=True)
        server.send_later(kept[0], late)
        assert client.recv(1 << 16) == protocol.stream_prefix(late) + late
        client.close()
        assert until(lambda: turn() or not server.connections)  # the server saw it close
        server.send_later(kept[0], late)  # a no-op, no error
    finally:
        client.close()
        server.close()


class Poller:
    """A poller that records each poll's timeout and has a socket ready at the `ready`-th."""

    def __init__(self, ready: int) -> None:
        self.timeouts: list[int] = []
        self.ready = ready

    def poll(self, timeout: int) -> list:
        self.timeouts.append(timeout)
        return [("sock", zmq.POLLIN)] if len(self.timeouts) >= self.ready else []


def test_the_loop_spins_after_a_request_but_not_while_the_tier_pulls(service):
    """Within `--busy-poll-us` of a request the loop polls without sleeping; while the tier
    pulls for a reader it sleeps at once (the sidecar's reply comes next, and needs a CPU)."""
    service.busy_poll_s = 10.0
    spinning = Poller(ready=3)
    assert service._wait_for_requests(spinning, 200, time.perf_counter()) == {"sock": zmq.POLLIN}
    assert spinning.timeouts == [0, 0, 0]
    assert ask(service, ["wanted"], 1, wait_ms=5_000) is None  # (kept: its pull is on its way)
    assert service.cluster.pulling == {"wanted"}
    asleep = Poller(ready=1)
    assert service._wait_for_requests(asleep, 200, time.perf_counter()) == {"sock": zmq.POLLIN}
    assert asleep.timeouts == [200]


def test_a_stop_does_not_start_the_sidecar_again(service, monkeypatch):
    """The loop turn a stop's signal ends looks after no sidecar: one that the same signal
    ended (its process group's) is not started again as the server stops (before: an ERROR,
    "sidecar closed its channel; starting it again", on every clean stop)."""
    looked: list[float] = []
    service.cluster.housekeeping = lambda poller, now: looked.append(now)

    def stopped(poller, poll_ms, served):  # (the signal comes while the loop waits)
        service._stop.set()
        return {}

    monkeypatch.setattr(service, "_wait_for_requests", stopped)
    service.serve_forever(poll_ms=1)
    assert looked == []
