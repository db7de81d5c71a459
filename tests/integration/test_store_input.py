"""Bad store input gets a False, one WARNING naming the key and the reason, and a count in
`refused_stores`, never silence; a value larger than the whole pool says so; a store over an
existing key reports True (first writer wins) and `store_outcomes` tells it from a new one."""

from __future__ import annotations

import logging

import pytest

from maru import MaruHandler
from maru.client.handler import StoreOutcome
from maru.client.requests import BYTES_LIKE
from maru.common.protocol import MAX_KEY_BYTES


@pytest.fixture
def handler(maru_server):
    h = MaruHandler(server_url=maru_server.url, pool_size="4M", chunk_size_bytes="64K")
    yield h
    h.close()


def store_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_single_key_given_as_the_batch_is_refused_not_split(handler):
    """`batch_delete("abc")` deleted keys "a" and "b" (a str is a sequence of characters):
    a str or bytes where a batch of keys is expected is a TypeError, and nothing happens."""
    assert handler.batch_store(["a", "b"], [b"1", b"2"]) == [True, True]
    for call in (
        lambda: handler.batch_delete("ab"),
        lambda: handler.batch_exists("ab"),
        lambda: handler.batch_retrieve("ab"),
        lambda: handler.batch_pin("ab"),
        lambda: handler.batch_unpin(b"ab"),
        lambda: handler.batch_store("ab", [b"x", b"y"]),
    ):
        with pytest.raises(TypeError, match="a sequence of keys, not one"):
            call()
    assert handler.batch_exists(["a", "b"]) == [True, True]
    assert [bytes(i.view) for i in handler.batch_retrieve(["a", "b"])] == [b"1", b"2"]


def test_stats_of_a_closed_handler_says_it_is_closed(maru_server):
    from maru.common.errors import MaruNotConnected

    h = MaruHandler(server_url=maru_server.url, pool_size="4M")
    assert h.stats()["keys"] >= 0
    h.close()
    with pytest.raises(MaruNotConnected, match="closed"):
        h.stats()


@pytest.mark.parametrize(
    ("key", "value", "reason", "said"),
    [
        ("k" * (MAX_KEY_BYTES + 1), b"v", "key_too_long", "key longer than 1024 bytes"),
        ("", b"v", "empty_key", "a key must not be empty"),
        (b"", b"v", "empty_key", "a key must not be empty"),
        (42, b"v", "key_type", "a key must be str or bytes, got int"),
        (("a", 1), b"v", "key_type", "a key must be str or bytes, got tuple"),
        ("empty-value", b"", "empty_value", "an empty value cannot be stored"),
        # a value that is not bytes-like is refused like a bad key (it raised TypeError or a
        # ValueError about keyword arguments before)
        ("str-value", "a string", "value_type", f"a value must be bytes-like ({BYTES_LIKE})"),
        ("none-value", None, "value_type", f"a value must be bytes-like ({BYTES_LIKE})"),
        ("int-value", 12345, "value_type", f"a value must be bytes-like ({BYTES_LIKE})"),
    ],
)
def test_a_bad_store_is_false_logged_with_key_and_reason_and_counted(
    handler, caplog, key, value, reason, said
):
    with caplog.at_level(logging.WARNING, logger="maru"):
        assert handler.store(key, value) is False
    (line,) = store_warnings(caplog)
    assert f"store of key {repr(key)[:80]}" in line and line.endswith(f"refused: {said}")
    assert handler.refused_stores == {reason: 1}
    assert handler.stats()["keys"] == 0  # nothing reached the registry


def test_in_a_batch_only_the_bad_ones_fail_with_one_line(handler, caplog):
    keys = ["good-0", "", "good-1", b""]
    with caplog.at_level(logging.WARNING, logger="maru"):
        assert handler.batch_store(keys, [b"a" * 100] * 4) == [True, False, True, False]
    (line,) = store_warnings(caplog)
    assert "store of key '' refused: a key must not be empty (and 1 more in the batch)" in line
    assert handler.refused_stores == {"empty_key": 2}
    assert handler.batch_exists(["good-0", "good-1"]) == [True, True]


def test_sealing_a_bad_key_is_said_and_rejected_by_the_server(handler, caplog):
    run = handler.alloc(100, 2)
    run.buf[:] = b"x" * len(run.buf)
    with caplog.at_level(logging.WARNING, logger="maru"):
        sealing = handler.seal(["sealed", ""], run)
        assert sealing.wait() == [True, False]  # the server refuses an empty key too
    assert sealing.outcomes() == [StoreOutcome.STORED, StoreOutcome.FAILED]
    assert any("store of key '' refused" in line for line in store_warnings(caplog))
    assert handler.refused_stores == {"empty_key": 1}


def test_a_value_larger_than_the_pool_says_so(handler, caplog):
    capacity = handler.stats()["pool"]["capacity"]
    with caplog.at_level(logging.WARNING, logger="maru"):
        assert handler.store("huge", bytes(capacity + 1)) is False
    lines = store_warnings(caplog)
    assert len(lines) == 1, lines
    assert "a value of 1.0 GiB is larger than the whole pool (1.0 GiB): not stored" in lines[0]
    assert "pinned" not in lines[0]  # not the "no room" message
    assert handler.refused_stores == {"larger_than_pool": 1}


def test_a_store_over_an_existing_key_keeps_the_first_value(handler):
    assert handler.store("h", b"first") is True
    assert handler.store("h", b"second") is True  # seed-compatible: True for both
    assert bytes(handler.retrieve("h").view) == b"first"
    outcomes = handler.store_outcomes(["h", "new", ""], [b"third", b"n", b"x"])
    assert outcomes == [StoreOutcome.EXISTED, StoreOutcome.STORED, StoreOutcome.FAILED]
    assert bytes(handler.retrieve("h").view) == b"first"
    run = handler.alloc(10, 2)
    run.buf[:] = b"y" * len(run.buf)
    assert handler.seal(["h", "new-2"], run).outcomes() == [
        StoreOutcome.EXISTED,
        StoreOutcome.STORED,
    ]


def test_in_a_batch_a_value_that_is_not_bytes_fails_alone(handler, caplog):
    with caplog.at_level(logging.WARNING, logger="maru"):
        assert handler.batch_store(["b0", "b1", "b2"], [b"zero", "one", b"two"]) == [
            True,
            False,
            True,
        ]
    (line,) = store_warnings(caplog)
    assert "store of key 'b1' refused: a value must be bytes-like" in line
    assert handler.refused_stores == {"value_type": 1}
    assert [bytes(i.view) for i in handler.batch_retrieve(["b0", "b2"])] == [b"zero", b"two"]
