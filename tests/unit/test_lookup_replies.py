"""How `MaruHandler` reads a leased lookup's reply: the packed form (bytes of int64 columns),
the list forms of older servers, and malformed replies, which are misses and never an
exception in the middle of SGLang's prefetch."""

from __future__ import annotations

from array import array

import pytest

from maru import MaruHandler
from maru.client.rpc import PendingReply

REGION = 4096 * 4


@pytest.fixture
def handler(tmp_path):
    region_file = tmp_path / "region"
    region_file.write_bytes(b"\0" * REGION)
    h = MaruHandler(server_url="tcp://127.0.0.1:1", auto_connect=False)
    yield h
    h.close()


def region_fields(tmp_path) -> list:
    """Region 3 as the server names it: id, path, offset, length, token, owner."""
    return [3, str(tmp_path / "region"), 0, REGION, "token", "someone-else"]


def outcome(h: MaruHandler, n: int, body: dict):
    pending = PendingReply(None, 1, 5)  # type: ignore[arg-type]
    pending.body = {"ok": True, **body}
    return h._lookup_addresses([f"k{i}" for i in range(n)], pending)


def packed(*columns: list[int]) -> tuple[bytes, ...]:
    return tuple(array("q", c).tobytes() for c in columns)


def test_packed_and_list_replies_give_the_same_addresses(handler, tmp_path):
    ids, offsets, lengths = [3, 0, 3], [4096, 0, 8192], [100, 0, 200]
    forms = {
        "packed": dict(zip(("region_ids", "offsets", "lengths"), packed(ids, offsets, lengths))),
        "lists": {"region_ids": ids, "offsets": offsets, "lengths": lengths},
        "entries": {"locations": [[3, 4096, 100], None, [3, 8192, 200]]},
    }
    seen = []
    for body in forms.values():
        addresses, got_lengths, lease = outcome(
            handler, 3, {**body, "regions": [region_fields(tmp_path)], "lease_id": 9}
        )
        assert lease == 9 and got_lengths.tolist() == lengths
        base = handler._mapper.get(3).address
        assert addresses.tolist() == [base + 4096, 0, base + 8192]
        seen.append(addresses.tolist())
    assert seen[0] == seen[1] == seen[2]


@pytest.mark.parametrize(
    "body",
    [
        {"region_ids": b"\x01" * 12, "offsets": b"", "lengths": b""},  # not whole int64s
        dict(zip(("region_ids", "offsets", "lengths"), packed([3], [0], [1]))),  # 1 for 2 keys
        {"region_ids": [3, 3], "offsets": ["x", 0], "lengths": [1, 1]},
        {"nothing": True},
    ],
    ids=["ragged-bytes", "too-few", "not-ints", "no-columns"],
)
def test_a_malformed_reply_is_all_misses(handler, body):
    addresses, lengths, _ = outcome(handler, 2, {**body, "regions": []})
    assert addresses.tolist() == [0, 0] and lengths.tolist() == [0, 0]
