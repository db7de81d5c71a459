"""`ClientAllowlist` logs each refusal once per key and reason (and list version)."""

from __future__ import annotations

import logging

import zmq

from maru.common.curve import ClientAllowlist


def test_a_key_refused_at_connect_is_still_logged_when_refused_as_removed(tmp_path, caplog):
    """A client refused at a reconnect ("not in") and on its open connection ("removed from")
    is logged for both: one reason's entry must not hide the other's (it did, and the
    operator never saw that the open connection was cut)."""
    listed = zmq.curve_keypair()[0].decode()
    (tmp_path / "a.pub").write_text(listed + "\n")
    allowlist = ClientAllowlist(tmp_path)
    other = zmq.curve_keypair()[0].decode()
    with caplog.at_level(logging.WARNING, logger="maru.common.curve"):
        assert allowlist.callback("global", other.encode()) is False
        assert allowlist.callback("global", other.encode()) is False  # (once)
        assert allowlist.revoked(other) is not None
        assert allowlist.revoked(listed) is None
    lines = [r.getMessage() for r in caplog.records]
    assert sum(f"key {other}: not in" in m for m in lines) == 1, lines
    assert sum(f"key {other}: removed from" in m for m in lines) == 1, lines
