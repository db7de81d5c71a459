"""Issue 13, scenario 6: a reader whose lease ended before its copy finished must not take
what it copied as a hit. Real server, real page reuse: the key is deleted and its page
written again by its owner while the reader's lease has expired."""

from __future__ import annotations

import time

import pytest

from maru import LeaseExpired, MaruHandler


def test_a_lease_that_ended_mid_copy_is_reported_and_the_page_reuse_is_real(maru_server_factory):
    server = maru_server_factory(extra_args=["--lease-timeout", "0.3"])
    owner, reader, a, b = _owner_and_reader(server.url)

    # Within its lease, a read is confirmed.
    quick = reader.lookup(["k"], lease=True)
    assert bytes(quick.infos()[0].view) == a
    assert quick.release(confirm=True) is True

    # The reader stalls past --lease-timeout between its lookup and its copy.
    slow = reader.lookup(["k"], lease=True)
    view = slow.infos()[0].view
    deadline = time.monotonic() + 10
    while reader.stats()["leases"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert owner.delete("k")  # no lease protects it any more
    assert owner.store("k2", b)  # the owner's only free chunk is k's: reused
    copied = bytes(view)
    assert copied == b  # the fault is real: without a check, B's bytes would pass as k's
    confirmed = slow.release(confirm=True)
    wrong_hits = int(confirmed and copied != a)
    assert (confirmed, wrong_hits) == (False, 0)
    owner.close()
    reader.close()


def test_a_reader_that_outlived_a_server_restart_reads_under_a_real_lease(maru_server_factory):
    """Found by the soak (benchmarks/soak.py): after a server restart a reader that only looks
    keys up (and heart-beats) was never asked to handshake again; its lookups were anonymous,
    took no lease, and `release(confirm=True)` said True for a copy of pages that were
    rewritten meanwhile. Now a request with a session the server does not know is answered
    UNKNOWN_INSTANCE (the client handshakes again and resends), and a leased lookup whose
    hits came without a lease is never confirmed."""
    server = maru_server_factory(pool_size="64M")
    owner = MaruHandler(
        server_url=server.url, pool_size="2M", chunk_size_bytes="1M", auto_expand=False
    )
    reader = MaruHandler(server_url=server.url, pool_size="2M")
    a, b = b"A" * 100_000, b"B" * 100_000
    assert owner.batch_store(["k", "filler"], [a, b"f" * 100]) == [True, True]
    with reader.leased(["k"]) as infos:  # maps the owner's region
        assert bytes(infos[0].view) == a

    server.proc.kill()
    server.proc.wait(10)
    server.restart()
    assert owner.exists("k")  # the owner is back (its first request handshook again)

    lookup = reader.lookup(["k"], lease=True)
    view = lookup.infos()[0].view
    assert lookup.lease_id != 0  # a real lease, taken by the reader's instance
    assert owner.stats()["leases"] == 1
    assert not owner.delete("k")  # the lease protects the key: its page cannot be reused
    owner.store("k2", b)  # (before: k was deleted and this took its page)
    copied = bytes(view)
    assert lookup.release(confirm=True) is True
    assert copied == a
    owner.close()
    reader.close()


def _stall_past_the_lease(reader: MaruHandler) -> None:
    """Wait (bounded) until the server has ended the reader's leases."""
    deadline = time.monotonic() + 10
    while reader.stats()["leases"] and time.monotonic() < deadline:
        time.sleep(0.05)


def _owner_and_reader(url: str) -> tuple[MaruHandler, MaruHandler, bytes, bytes]:
    """An owner with one chunk free after storing "k" (value a) and a filler, so that the
    next value it stores after deleting "k" goes where "k" was; a reader; a and b."""
    owner = MaruHandler(server_url=url, pool_size="2M", chunk_size_bytes="1M", auto_expand=False)
    reader = MaruHandler(server_url=url, pool_size="2M")
    a, b = b"A" * 100_000, b"B" * 100_000
    assert owner.batch_store(["k", "filler"], [a, b"f" * 100]) == [True, True]
    return owner, reader, a, b


def test_leased_proves_its_lease_or_raises_naming_the_keys(maru_server_factory):
    """Issue 40, case 3: `leased()` hands out views; leaving the block confirms the lease. A
    block that outlived its lease, while the owner deleted the key and wrote its page again,
    raises `LeaseExpired` naming the hit (the bytes it read there are the new value's, as
    the test shows); within the lease the block ends normally. Before: no error."""
    server = maru_server_factory(extra_args=["--lease-timeout", "0.3"])
    owner, reader, a, b = _owner_and_reader(server.url)

    with reader.leased(["k", "absent"]) as infos:  # within the lease: proven, no error
        within = bytes(infos[0].view)
    assert within == a and infos[1] is None

    with pytest.raises(LeaseExpired) as ended, reader.leased(["absent", "k"]) as infos:
        view = infos[1].view
        _stall_past_the_lease(reader)
        assert owner.delete("k")  # no lease protects it any more
        assert owner.store("k2", b)  # the owner's only free chunk is k's: reused
        copied = bytes(view)
    assert copied == b  # the fault is real: these bytes are not k's
    assert ended.value.keys == ["k"] and "'k'" in str(ended.value)

    # an exception in the block passes through, the lease released
    with pytest.raises(KeyError), reader.leased(["filler"]):
        raise KeyError("mine")
    assert reader.stats()["leases"] == 0
    owner.close()
    reader.close()


def test_leased_across_a_server_restart_raises_naming_the_keys(maru_server_factory):
    """The same when the server restarted (and forgot the lease) while the block held it."""
    server = maru_server_factory(pool_size="64M")
    owner, reader, a, b = _owner_and_reader(server.url)
    with pytest.raises(LeaseExpired) as ended, reader.leased(["k"]) as infos:
        view = infos[0].view
        assert bytes(view) == a
        server.proc.kill()
        server.proc.wait(10)
        server.restart()
        assert owner.delete("k")  # the restarted server knows no lease on it
        assert owner.store("k2", b)
        copied = bytes(view)
    assert copied == b and ended.value.keys == ["k"]
    owner.close()
    reader.close()
