"""A ZMQ peer that closed with requests still queued in the ROUTER: its late requests come
after the monitor reported it gone, and after a new connection took its file descriptor. They
must not make the server take the new, live connection for closed (its waiting replies
forgotten, its instance shown dropped). A real ROUTER (`TcpEndpoint`) and real DEALERs over
TCP; the test turns the loop itself, so the order is the one described."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import time
from typing import Any

import pytest
import zmq

from maru.common import protocol
from maru.common.protocol import MsgType
from maru.server.tcp_socket import TcpEndpoint

BOUND = 20.0  # seconds: a bound for the test to stop, not a threshold
REPLY = 256 << 10  # replies big enough that ZeroMQ keeps some back (`Backlog`)


def _handle(frame: bytes, refused: str | None = None, route: Any = None) -> bytes:
    """An echo of the request id, with a big body."""
    header = protocol.decode_header(frame)
    return protocol.encode(header.msg_type, header.request_id, {"pad": b"x" * REPLY}, reply=True)


def _turn(tcp: TcpEndpoint) -> None:
    """One loop turn, as `MaruService.serve_forever` makes it."""
    poller = zmq.Poller()
    tcp.attach(poller)
    events = dict(poller.poll(50))
    tcp.serve(events, _handle)


def _dealer(endpoint: str, **options: int) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 1000)
    for name, value in options.items():
        sock.setsockopt(getattr(zmq, name), value)
    sock.connect(endpoint)
    return sock


def _until(predicate, tcp: TcpEndpoint | None = None) -> None:
    deadline = time.monotonic() + BOUND
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        if tcp is not None:
            _turn(tcp)
        else:
            time.sleep(0.01)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _frame(request_id: int) -> bytes:
    return protocol.encode(MsgType.HEARTBEAT, request_id, {})


def test_late_requests_of_a_closed_peer_do_not_drop_the_live_one_on_its_descriptor():
    """Before: each late request of the closed peer took the descriptor back (`_learn`: "closed
    without a word"), so the live peer on it was dropped: its waiting replies forgotten (it read
    35 of 40, 5 never came) and its instance shown gone to `maru status`. Run in a process of
    its own: in the test run's process, threads left by earlier tests took the freed descriptor
    first, and the case could not be made (it was skipped in every whole run)."""
    with mp.get_context("spawn").Pool(1) as pool:
        skipped = pool.apply_async(_closed_peer_then_live_peer_on_its_descriptor).get(BOUND * 3)
    if skipped:
        pytest.skip(skipped)


def _closed_peer_then_live_peer_on_its_descriptor() -> str | None:
    """The case, asserted; a reason where it could not be made."""
    dropped: list[bytes] = []
    tcp = TcpEndpoint(zmq.Context.instance(), "tcp://127.0.0.1:0", on_drop=dropped.append)
    try:
        gone = _dealer(tcp.endpoint)
        gone.send(_frame(1))
        _until(lambda: tcp.routes, tcp)  # learned: its descriptor known
        ((fd, gone_route),) = tcp.routes.items()
        gone.recv()
        for n in range(30):  # queued in the ROUTER, never read before it closes
            gone.send(_frame(100 + n))
        time.sleep(0.3)
        gone.close()
        monitor = zmq.Poller()
        monitor.register(tcp.monitor, zmq.POLLIN)
        _until(lambda: monitor.poll(0))  # reported closed (not yet read by the loop)
        _until(lambda: not _is_open(fd))  # and closed (ZeroMQ reports, then closes)

        # a new connection takes the lowest free descriptor: the closed one's
        live = _dealer(tcp.endpoint, RCVHWM=1, RCVBUF=4096)
        for n in range(40):
            live.send(_frame(1 + n))
        # the late requests and the live ones, fair-queued, until the live peer is known on
        # a descriptor and replies wait for it (however loaded the machine), then some more
        _until(lambda: set(tcp.routes.values()) - {gone_route} and tcp.backlog, tcp)
        if tcp.routes.get(fd) in (None, gone_route):  # (another thread of the process took it)
            return "the closed peer's descriptor went to another socket of the process"
        for _ in range(20):
            _turn(tcp)
        live_route = tcp.routes.get(fd)
        assert live_route is not None and live_route not in dropped
        assert len(set(dropped)) == 1  # the closed peer only
        assert tcp.backlog  # replies wait for the live peer (it does not read yet)

        got = []
        live.setsockopt(zmq.RCVTIMEO, 200)
        deadline = time.monotonic() + BOUND
        while len(got) < 40 and time.monotonic() < deadline:
            _turn(tcp)  # the replies that wait go out as the peer reads
            with contextlib.suppress(zmq.Again):
                got.append(protocol.decode_header(live.recv()).request_id)
        assert got == list(range(1, 41))
        assert live_route not in dropped  # never shown gone
        assert tcp.known == {live_route}
        live.close()
    finally:
        tcp.close()
    return None
