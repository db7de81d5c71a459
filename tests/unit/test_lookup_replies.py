"""How a `Lookup` reads its reply: packed int64 columns, and malformed replies or locations
outside their region, which are misses and never an exception (or a read past a mapping) in
the middle of SGLang's prefetch."""

from __future__ import annotations

from array import array

import pytest

from maru import MaruHandler
from maru.client.requests import Lookup
from maru.client.rpc import PendingReply
from maru.common.protocol import MsgType

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
    """A Lookup of n keys whose reply is `body` (no server: the reply is put in place)."""
    lookup = Lookup(h._s, [], lease=True)  # sends nothing (the handler's session)
    lookup.n = n
    pending = PendingReply(None, 1, MsgType.LOOKUP_KV, {})  # type: ignore[arg-type]
    pending.body = {"ok": True, **body}
    lookup._pending = pending
    addresses, lengths = lookup.wait()
    return addresses, lengths, lookup.lease_id


# A LOOKUP_KV reply's columns (the writers' maru64 checksums last: 0, stored without one)
COLUMNS = ("region_ids", "offsets", "lengths", "maru64")


def packed(*columns: list[int]) -> tuple[bytes, ...]:
    return tuple(array("q", c).tobytes() for c in columns)


def test_packed_reply_gives_addresses_in_the_mapping(handler, tmp_path):
    ids, offsets, lengths = [3, 0, 3], [4096, 0, 8192], [100, 0, 200]
    body = dict(zip(COLUMNS, packed(ids, offsets, lengths, [0] * 3)))
    addresses, got_lengths, lease = outcome(
        handler, 3, {**body, "regions": [region_fields(tmp_path)], "lease_id": 9}
    )
    assert lease == 9 and got_lengths.tolist() == lengths
    base = handler._mapper.get(3).address
    assert addresses.tolist() == [base + 4096, 0, base + 8192]


def test_a_location_outside_its_region_is_a_miss(handler, tmp_path):
    """The first rule, on the client: a location that does not fit the region it names is
    never read (a malformed or stale reply), whatever the server said."""
    ids, offsets, lengths = [3, 3, 3, 7], [REGION - 100, -4096, 0, 0], [200, 100, 100, 100]
    body = dict(zip(COLUMNS, packed(ids, offsets, lengths, [0] * 4)))
    addresses, got_lengths, _ = outcome(handler, 4, {**body, "regions": [region_fields(tmp_path)]})
    base = handler._mapper.get(3).address
    assert addresses.tolist() == [0, 0, base, 0]  # region 7: no handle in the reply
    assert got_lengths.tolist() == [0, 0, 100, 0]


@pytest.mark.parametrize(
    "body",
    [
        {"region_ids": b"\x01" * 12, "offsets": b"", "lengths": b""},  # not whole int64s
        dict(zip(("region_ids", "offsets", "lengths"), packed([3], [0], [1]))),  # 1 for 2 keys
        {"region_ids": [3, 3], "offsets": [0, 0], "lengths": [1, 1]},  # lists: not v2
        {"nothing": True},
    ],
    ids=["ragged-bytes", "too-few", "lists", "no-columns"],
)
def test_a_malformed_reply_is_all_misses(handler, body):
    addresses, lengths, _ = outcome(handler, 2, {**body, "regions": []})
    assert addresses.tolist() == [0, 0] and lengths.tolist() == [0, 0]
