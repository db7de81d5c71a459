"""Every lookup path of a handler waits for a cluster tier's pulls, once per call
(`maru.client.cluster.ClusterPulls`): a key the tier holds must be a hit whichever path an
adapter takes (SGLang's `batch_exists` / reads, a copying lookup, LMCache's pinned lookup),
and no call may spend the budget twice. Against a real maru-server with no tier (its EXISTS
answers what is registered, nothing on its way), the handler's budget set as a tier's
HANDSHAKE sets it, and its waits counted. The pulls themselves, across two nodes, are
`test_cluster_tier.py`'s."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from maru import MaruHandler
from maru.client.cluster import ClusterPulls
from maru.common.protocol import Key

SIZE = 4096


class CountedPulls(ClusterPulls):
    """The handler's own pulls, each wait (one per call that misses) recorded."""

    def __init__(self, pulls: ClusterPulls):
        super().__init__(pulls.request, pulls.per_key)
        self.budget_s = 10.0  # (as a tier's `lookup_ms`; nothing here is on its way)
        self.waits: list[list[Key]] = []

    def wait(self, missing: Sequence[Key]) -> list[bool]:
        self.waits.append(list(missing))
        return super().wait(missing)


@pytest.fixture
def handler(maru_server):
    h = MaruHandler(server_url=maru_server.url, pool_size="4M", chunk_size_bytes="64K")
    h._cluster = CountedPulls(h._cluster)
    try:
        yield h
    finally:
        h.close()


def test_every_lookup_path_waits_for_the_tiers_pulls_once_per_call(handler):
    h = handler
    value = np.random.default_rng(7).integers(0, 256, SIZE, np.uint8)
    assert h.batch_store(["here"], [value]) == [True]
    keys = ["here", "gone"]
    rows = np.zeros((2, SIZE), np.uint8)
    buffers = np.array([[rows[0].ctypes.data], [rows[1].ctypes.data]], np.int64)
    seen = {}

    def lookup(for_copy: bool) -> list[bool]:
        with h.lookup(keys, lease=True, for_copy=for_copy) as found:
            return (found.lengths == SIZE).tolist()

    calls = {
        "batch_exists": lambda: h.batch_exists(keys),
        "leading_hits": lambda: h.leading_hits(keys),
        "lookup": lambda: lookup(False),
        "lookup_for_copy": lambda: lookup(True),  # (MaruStorage's v2 path, before the fix: 0)
        "read": lambda: h.read(keys, buffers, np.array([SIZE]), length=SIZE),
        "batch_pin": lambda: h.batch_pin(keys),  # (LMCache's pinned lookup, before: 0)
        "batch_retrieve": lambda: [i is not None for i in h.batch_retrieve(keys)],
    }
    for name, call in calls.items():
        h._cluster.waits.clear()
        waits = h._cluster.waits
        seen[name] = (call(), len(waits), all("gone" in keys for keys in waits))
    hits = {"leading_hits": 1}
    assert seen == {name: (hits.get(name, [True, False]), 1, True) for name in calls}, seen
    assert rows[0].tobytes() == value.tobytes()  # (the read's hit, every byte)
