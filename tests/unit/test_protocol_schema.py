"""docs/protocol.md is the code's message table, rendered; and every message type has one."""

from __future__ import annotations

from pathlib import Path

from maru.common.protocol import MESSAGES, MsgType, render_schema

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


def test_every_message_type_has_one_request_and_one_reply_form():
    assert set(MESSAGES) == set(MsgType)


def test_docs_protocol_md_matches_the_code():
    assert DOC.read_text() == render_schema(), (
        "docs/protocol.md is stale: run `python -m maru.common.protocol > docs/protocol.md`"
    )
