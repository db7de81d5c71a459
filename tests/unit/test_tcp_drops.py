"""The TCP port notices a closed connection by itself (ZeroMQ's socket monitor, polled by the
server loop), with no other connection coming to wake it: an instance whose last connection
closed shows as dropped, one that still has another does not, and its next message over a new
connection shows it connected again. A real ROUTER and real DEALERs over TCP; the server's
loop in a thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from maru.common import protocol
from maru.common.protocol import MsgType
from maru.server.service import MaruService

from .service_calls import make_service

BOUND = 30.0  # seconds a poll may take: a bound for the test to stop, not a threshold


@pytest.fixture
def served(tmp_path) -> Iterator[MaruService]:
    svc = make_service(tmp_path)
    loop = threading.Thread(target=svc.serve_forever, kwargs={"poll_ms": 50}, daemon=True)
    loop.start()
    try:
        yield svc
    finally:
        svc.stop()
        loop.join(10)
        svc.close()


def connect(svc: MaruService) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(BOUND * 1000))
    sock.connect(svc.endpoint)
    return sock


def ask(sock: zmq.Socket, msg_type: int, body: dict[str, Any]) -> dict[str, Any]:
    sock.send(protocol.encode(msg_type, 1, body))
    _, reply = protocol.decode(sock.recv())
    assert reply["ok"], reply
    return reply


def poll(predicate, bound: float = BOUND) -> bool:
    deadline = time.monotonic() + bound
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_the_last_closed_connection_shows_its_instance_dropped_until_it_speaks(served):
    svc = served
    first, second = connect(svc), connect(svc)
    hello = ask(first, MsgType.HANDSHAKE, {"name": "A", "pid": 1})
    iid, session = hello["iid"], hello["session"]
    ask(second, MsgType.HEARTBEAT, {"session": session})  # a second thread's connection
    instances = svc.registry.instances
    assert poll(lambda: len(instances[iid].routes) == 2)

    first.close()
    assert poll(lambda: len(instances[iid].routes) == 1)  # seen closed, by itself
    assert not instances[iid].dropped  # another connection of it is open

    second.close()
    assert poll(lambda: instances[iid].dropped)
    assert svc.stats()["instances"][iid]["dropped"]
    assert iid in instances  # shown gone, not reaped: that waits for the heartbeat timeout

    again = connect(svc)  # ZeroMQ's reconnect after a blip: a new connection
    try:
        ask(again, MsgType.HEARTBEAT, {"session": session})
        assert not svc.stats()["instances"][iid]["dropped"]
        assert len(instances[iid].routes) == 1
    finally:
        again.close()
