"""Each of the sidecar's results bound to the job it answers. The server registers pulled keys,
and releases published keys' holds, from the sidecar's replies: a result applied to another
job than its own (results reordered, another batch's results under this batch's id, a stale
reply again) would register a key at pages holding no value of it, with another value's
maru64 (with readers' checksums off, the default: a wrong hit), or release a hold while the
sidecar still reads the value's pages. Such a reply is a broken channel: applied in no part,
the sidecar started again, the batch's pages and holds kept until it is gone.

The replies here are the real `Sidecar`'s answers to what the real `ClusterTier` sent (read
from its end of the channel, Mooncake's client stood in for by `FakeStore`), then mangled as
a bug would and sent back over the channel for the tier's loop (`serve`) to apply; the last
test runs the real sidecar process for a publish and a pull end to end."""

from __future__ import annotations

import ctypes
import json
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import zmq

from maru.common.checksum import checksums
from maru.common.protocol import DeleteStatus, RegisterStatus
from maru.server.cluster import tier as tier_module
from maru.server.cluster.link import Link
from maru.server.cluster.proof import encode_trailer, object_name
from maru.server.cluster.sidecar import NOT_FOUND, PoolMaps, Sidecar
from maru.server.cluster.tier import ClusterTier

from .registry_calls import locate
from .test_cluster_faults import Node
from .test_cluster_tier import SGLANG_FILE, FakeSidecar
from .test_cluster_trust import sidecar_reads
from .test_eviction_leases import MiB, consistent, make_registry

VALUE = 64 << 10


class FakeStore:
    """Mooncake's zero-copy calls on objects kept in a dict (a get copies an object's bytes
    into the buffers it is given, a put reads them); a name it lacks is OBJECT_NOT_FOUND."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}

    def register_buffer(self, address: int, length: int) -> int:
        return 0

    def unregister_buffer(self, address: int) -> int:
        return 0

    def batch_get_replica_desc(self, names: list[str]) -> dict:
        return {}

    def batch_get_into_multi_buffers(self, names, buffers, sizes) -> list[int]:
        codes = []
        for name, places, lengths in zip(names, buffers, sizes):
            data = self.objects.get(name)
            if data is None:
                codes.append(NOT_FOUND)
                continue
            at = 0
            for address, length in zip(places, lengths):
                ctypes.memmove(address, data[at : at + length], max(min(length, len(data) - at), 0))
                at += length
            codes.append(len(data))
        return codes

    def batch_put_from_multi_buffers(self, names, buffers, sizes) -> list[int]:
        for name, places, lengths in zip(names, buffers, sizes):
            self.objects[name] = b"".join(ctypes.string_at(a, n) for a, n in zip(places, lengths))
        return [0] * len(names)


class Channel:
    """The tier, its loop (`deliver`), and the sidecar's end of its channel, answered by a real
    `Sidecar` (no process, no socket of its own: `answer` only)."""

    def __init__(self, tier: ClusterTier, end: Link):
        self.tier, self.end, self.poller = tier, end, zmq.Poller()
        tier.attach(self.poller)
        self.store = FakeStore()
        sidecar = object.__new__(Sidecar)
        sidecar.store, sidecar.helper, sidecar.trailers = self.store, None, None
        sidecar.maps = PoolMaps(self.store.register_buffer, 0)
        self.sidecar = sidecar

    def put(self, key: str, value: bytes) -> None:
        """`value` in the cluster under `key`, with its trailer (as a peer's tier publishes)."""
        name = object_name(self.tier.config.tenant_id, key)
        (maru64,) = checksums([memoryview(value)]).tolist()
        self.store.objects[name] = value + encode_trailer(name, len(value), maru64)

    def sent(self) -> list[dict[str, Any]]:
        """The batches the tier sent since the last call, as the sidecar reads them."""
        return sidecar_reads(self.tier.link, self.end)

    def answer(self, message: dict[str, Any]) -> dict[str, Any]:
        """The sidecar's reply to `message` (its work done: pulled pages written)."""
        reply = self.sidecar.answer(message)
        assert reply is not None and reply["error"] is None, reply
        return reply

    def deliver(self, reply: dict[str, Any]) -> None:
        """Send `reply` on the sidecar's end; one turn of the server's loop applies it."""
        assert self.end.send(reply)
        self.tier.serve(dict(self.poller.poll(5000)), self.poller)

    def read(self, key: str) -> bytes | None:
        """The bytes registered under `key`, read from the pool's file (None: a miss)."""
        (hit,), _ = locate(self.tier.registry, [key])
        if hit is None:
            return None
        region_id, offset, length = hit
        region = self.tier.registry.regions[region_id]
        with open(region.path, "rb") as f:
            f.seek(region.offset + offset)
            return f.read(length)

    def restarted(self) -> None:
        """Housekeeping finds the channel broken: the sidecar is started again, and the
        batches it had are failed (their pages and holds released: it is gone)."""
        self.tier.housekeeping(self.poller, time.monotonic() + tier_module.RESTART_S + 1)
        assert self.tier.counts["sidecar_starts"] == 2 and not self.tier.batches

    def close(self) -> None:
        for mm, _, _ in self.sidecar.maps.maps.values():
            mm.close()
        self.end.close()


@pytest.fixture
def channel(tmp_path, monkeypatch) -> Iterator[Channel]:
    monkeypatch.setattr(tier_module.subprocess, "Popen", FakeSidecar)
    config = tmp_path / "mooncake.json"
    config.write_text(json.dumps(SGLANG_FILE))
    tier = ClusterTier(make_registry(tmp_path, pool_mib=64, high=1.0, low=1.0), str(config))
    tier.link, theirs = Link.pair()
    tier._apply({"op": "state", "connected": True, "error": None})
    c = Channel(tier, Link(theirs, blocking=True))
    try:
        yield c
    finally:
        tier.close()
        c.close()


def value(seed: int) -> bytes:
    return np.random.default_rng(seed).bytes(VALUE)


def broken(c: Channel, *batches: dict[str, Any]) -> None:
    """The reply was a broken channel: the link closed, `batches` kept (their pages and holds)
    until the sidecar is gone."""
    assert c.tier.link.closed, "a reply answering other jobs was applied"
    assert all(b["batch"] in c.tier.batches for b in batches)


def test_results_reordered_within_a_pull_batch_register_nothing(channel):
    """A pull of K1 (in the cluster) and K2 (not), its two results swapped: K2 would be
    registered, as proven with K1's maru64, at its own pages, which nothing wrote (a hit on a
    key the cluster does not hold). Nothing is registered; the channel is broken."""
    c = channel
    c.put("K1", value(1))
    c.tier.guess = VALUE
    assert c.tier.want(["K1", "K2"]) == 2
    (batch,) = c.sent()
    reply = c.answer(batch)
    reply["results"].reverse()
    c.deliver(reply)
    assert c.read("K2") is None, "K2 registered with K1's result"
    assert c.read("K1") is None
    broken(c, batch)
    c.restarted()
    consistent(c.tier.registry)


def test_another_batchs_results_under_this_batchs_id_register_nothing(channel):
    """Two pulls in flight, A (KA) and B (KB); the sidecar has done B only, and its results
    come back under A's id. KA would be registered at A's pages, not written yet (Mooncake
    may be writing them still), as proven with KB's maru64. Nothing is registered."""
    c = channel
    c.put("KA", value(2))
    c.put("KB", value(3))
    c.tier.guess = VALUE
    assert c.tier.want(["KA"]) == 1 and c.tier.want(["KB"]) == 1
    a, b = c.sent()
    reply = c.answer(b)
    reply["batch"] = a["batch"]
    c.deliver(reply)
    assert c.read("KA") is None, "KA registered with KB's result"
    assert c.read("KB") is None
    broken(c, a, b)
    c.restarted()
    consistent(c.tier.registry)


def test_a_stale_reply_under_the_next_batchs_id_registers_nothing(channel):
    """K1's pull answered and registered; K2's pull in flight; K1's reply comes again under
    K2's batch id (a stale reply). K2 would be registered at its unwritten pages with K1's
    maru64. K2 is not registered; K1 stays registered with its bytes."""
    c = channel
    v1 = value(4)
    c.put("K1", v1)
    c.put("K2", value(5))
    c.tier.guess = VALUE
    assert c.tier.want(["K1"]) == 1
    (first,) = c.sent()
    answered = c.answer(first)
    c.deliver(answered)
    assert c.read("K1") == v1 and not c.tier.link.closed  # (a bound reply is applied)
    assert c.tier.want(["K2"]) == 1
    (second,) = c.sent()
    c.deliver({**answered, "batch": second["batch"]})
    assert c.read("K2") is None, "K2 registered with K1's stale result"
    assert c.read("K1") == v1
    broken(c, second)
    c.restarted()
    consistent(c.tier.registry)


def test_another_publishs_results_never_release_this_publishs_holds(channel):
    """Two publishes in flight, A (WA) and B (WB), each value held (a delete is PINNED) until
    its reply: the sidecar may still read its pages. B's reply under A's id would release
    WA's hold while the sidecar has not read WA yet: a delete then frees its pages for another
    value, which the sidecar would publish under WA (with no writer checksum to refuse it: a
    wrong hit on every other node). The holds stay until the sidecar is gone."""
    c = channel
    reg = c.tier.registry
    rid = reg.request_region("A", 16 * MiB).region_id
    for n, key in enumerate(("WA", "WB")):
        statuses = reg.register("A", [key], [rid], [n * VALUE], [VALUE])
        assert statuses == [RegisterStatus.REGISTERED]
        c.tier.sealed([key], statuses, RegisterStatus.REGISTERED)
    a, b = c.sent()
    reply = c.answer(b)
    reply["batch"] = a["batch"]
    c.deliver(reply)
    assert reg.delete(["WA"]) == [DeleteStatus.PINNED], "WA's hold released by B's reply"
    assert reg.delete(["WB"]) == [DeleteStatus.PINNED]
    broken(c, a, b)
    c.restarted()
    assert reg.delete(["WA", "WB"]) == [DeleteStatus.DELETED] * 2
    consistent(reg)


def test_a_real_sidecar_publishes_and_pulls_back_with_bound_replies(tmp_path, monkeypatch):
    """The real sidecar process (Mooncake's client stood in for): a value written here is
    published (its hold released by the reply), deleted here, and pulled back with another
    node's value and a key the cluster lacks, in one batch: both registered with their bytes,
    the third a miss; the same sidecar throughout (no reply taken for a broken channel)."""
    node = Node(tmp_path, monkeypatch)
    tier, reg = node.tier, node.tier.registry
    try:
        pid = tier.proc.pid
        rid = reg.request_region("A", 16 * MiB).region_id
        mine, theirs = value(6), value(7)
        node.write("W", mine, rid, 0)
        tier.sealed(["W"], [RegisterStatus.REGISTERED], RegisterStatus.REGISTERED)
        assert node.until(lambda: tier.counts["published"] == 1 and not tier.batches)
        assert node.published("W")[:VALUE] == mine
        assert reg.delete(["W"]) == [DeleteStatus.DELETED]  # (its hold released)
        node.put_object("R", theirs)
        tier.guess = VALUE
        assert tier.want(["W", "R", "gone"]) == 3
        assert node.until(lambda: not tier.pulling)
        assert node.read("W") == mine and node.read("R") == theirs and node.read("gone") is None
        assert tier.counts["pulled"] == 2 and tier.counts["pull_misses"] == 1
        assert tier.proc.pid == pid and tier.counts["sidecar_starts"] == 1
        assert not tier.link.closed
        consistent(reg)
    finally:
        node.close()
