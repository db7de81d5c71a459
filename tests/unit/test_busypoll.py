"""`maru.client._busypoll.recv_spin`: how an RPC client waits for a reply on the Unix socket before
it falls back to sleeping in poll()."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from maru.client import _busypoll

recv_spin = _busypoll.recv_spin

MS = 1_000_000  # ns


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    a.setblocking(False)
    yield a, b
    a.close()
    b.close()


def test_returns_what_has_arrived(pair):
    a, b = pair
    b.sendall(b"reply")
    assert recv_spin(a.fileno(), 1 << 16, 10 * MS) == b"reply"


def test_returns_data_that_arrives_during_the_spin(pair):
    a, b = pair
    threading.Timer(0.02, b.sendall, args=(b"late",)).start()
    assert recv_spin(a.fileno(), 1 << 16, 2000 * MS) == b"late"


def test_returns_none_when_nothing_comes_within_the_spin(pair):
    a, _ = pair
    assert recv_spin(a.fileno(), 1 << 16, 0) is None
    assert recv_spin(a.fileno(), 1 << 16, 5 * MS) is None


def test_reads_at_most_size_bytes(pair):
    a, b = pair
    b.sendall(b"x" * 100)
    assert recv_spin(a.fileno(), 40, 0) == b"x" * 40
    assert recv_spin(a.fileno(), 1 << 16, 0) == b"x" * 60


def test_a_closed_peer_gives_empty_bytes(pair):
    a, b = pair
    b.close()
    assert recv_spin(a.fileno(), 1 << 16, 10 * MS) == b""


def test_a_bad_descriptor_raises_oserror_and_bad_sizes_valueerror(pair):
    with pytest.raises(OSError):
        recv_spin(-1, 1 << 16, 0)
    with pytest.raises(ValueError, match="positive"):
        recv_spin(pair[0].fileno(), 0, 0)


def test_the_spin_runs_without_the_gil(pair):
    """SGLang's scheduler thread shares the GIL with the storage threads that wait for replies:
    a spin that held it would stall the scheduler for the whole spin."""
    a, _ = pair
    counts = [0]
    stop = threading.Event()

    def count() -> None:
        while not stop.is_set():
            counts[0] += 1

    counter = threading.Thread(target=count)
    counter.start()
    try:
        time.sleep(0.01)
        before = counts[0]
        assert recv_spin(a.fileno(), 1 << 16, 200 * MS) is None  # 0.2 s of spinning
        during = counts[0] - before
    finally:
        stop.set()
        counter.join()
    # With the GIL held, the counter would get no turn in 0.2 s (the switch interval is 5 ms,
    # and only a thread that asks for the GIL makes the holder drop it).
    assert during > 1000
