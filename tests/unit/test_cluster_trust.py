"""The cluster tier's channel and supervision under a spill round larger than one batch, through
the real `ClusterTier`, `Registry` and `Link` (only the sidecar process stands in: `Popen`
replaced, its end of the channel read here as the sidecar reads it). A spill round may evict
any number of values; what the tier sends for them must stay readable by its sidecar, a
sidecar working through them in order must not be taken for a stalled one, and what is
dropped unpublished is counted once."""

from __future__ import annotations

import json
import socket
import time

import pytest
import zmq

from maru.common import protocol
from maru.common.protocol import RegisterStatus
from maru.server.cluster import tier as tier_module
from maru.server.cluster.link import Link
from maru.server.cluster.proof import PUBLISHED
from maru.server.cluster.tier import BATCH_KEYS, STALL_S, ClusterTier
from maru.server.pool import ShmPool
from maru.server.registry import Registry
from maru.server.token import TokenSigner

from .test_cluster_tier import SGLANG_FILE, FakeSidecar

VALUE = 4096
VICTIMS = 600  # values one spill round evicts: many batches' worth


@pytest.fixture
def spill_tier(tmp_path, monkeypatch):
    """A spill-mode tier on a 16 MiB pool, connected over a real socketpair; yields the tier
    and the sidecar's end (blocking, as the sidecar holds it)."""
    monkeypatch.setattr(tier_module.subprocess, "Popen", FakeSidecar)
    config = tmp_path / "mooncake.json"
    config.write_text(json.dumps(SGLANG_FILE))
    pool = ShmPool(str(tmp_path / "pool"), 16 << 20)
    reg = Registry(pool, TokenSigner(b"e" * 32), high_watermark=1.0, low_watermark=1.0)
    reg.instances.handshake("A", 1)
    tier = ClusterTier(reg, str(config), publish="spill")
    tier.link.close()
    tier.link, theirs = Link.pair()
    sidecar_end = Link(theirs, blocking=True)
    tier._apply({"op": "state", "connected": True, "error": None})
    try:
        yield tier, sidecar_end
    finally:
        tier.close()
        sidecar_end.close()


def fill(tier: ClusterTier, n: int) -> list[str]:
    """n values of VALUE bytes registered by instance A, with long keys (as adapters' are)."""
    reg = tier.registry
    rid = reg.request_region("A", n * VALUE).region_id
    keys = [f"model-{'m' * 150}:rank0:{i:08d}" for i in range(n)]
    statuses = reg.register(
        "A", keys, [rid] * n, [i * VALUE for i in range(n)], [VALUE] * n, [i + 1 for i in range(n)]
    )
    assert statuses == [RegisterStatus.REGISTERED] * n
    return keys


def sidecar_reads(ours: Link, end: Link) -> list[dict]:
    """Every message the server's end sent, read on the sidecar's end as the sidecar reads
    them (the server's outbox flushed as the socket takes it)."""
    messages: list[dict] = []
    deadline = time.monotonic() + 30
    while not end.closed and time.monotonic() < deadline:
        ours.flush()
        try:
            ready = end.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            if not ours.outbox:
                return messages
            continue
        if not ready:
            break
        messages += end.receive()
    return messages


def test_a_large_spill_round_reaches_the_sidecar_in_batches_it_can_read(spill_tier, monkeypatch):
    """A spill round's victims go to the sidecar in batches of at most BATCH_KEYS, each frame
    within what the sidecar's reader takes. Before: one batch of every victim, a frame that
    grows with the round; past MAX_FRAME_BYTES (64 MiB: ~200,000 victims with long keys) the
    sidecar's reader gives up on the channel, the sidecar stops, and the round's victims are
    released unpublished, again at every round. (MAX_FRAME_BYTES scaled down here.)"""
    tier, end = spill_tier
    monkeypatch.setattr(protocol, "MAX_FRAME_BYTES", 64 << 10)  # (the reader's limit, scaled)
    keys = fill(tier, VICTIMS)
    tier.registry.eviction.evict(VICTIMS * VALUE, spill=True)
    messages = sidecar_reads(tier.link, end)
    assert not end.closed, "the sidecar's reader gave up on the channel"
    jobs = [job[0] for m in messages if m["op"] == "publish" for job in m["jobs"]]
    assert len(jobs) == VICTIMS
    assert all(len(m["jobs"]) <= BATCH_KEYS for m in messages)
    # every victim held (registered, busy) until published, then dropped
    assert all(tier.registry.keys[k].busy for k in keys)
    for m in messages:
        results = [PUBLISHED] * len(m["jobs"])
        tier._apply({"op": "publish-done", "batch": m["batch"], "results": results, "error": None})
    assert tier.counts["published"] == VICTIMS and tier.counts["publish_drops"] == 0
    assert not any(k in tier.registry.keys for k in keys)
    assert tier.registry.eviction.spilling == 0


def test_a_sidecar_working_through_its_batches_in_order_is_not_taken_as_stalled(spill_tier):
    """The sidecar answers batches in order: a batch waits behind those sent before it. One
    that answered a moment ago and works on its next batch is not stalled, however long ago
    that batch was sent; one that has answered nothing for STALL_S is. Before: every batch
    counted from its sending, so a large round (many batches sent at once) got the sidecar
    killed mid-round while it was making progress."""
    tier, _ = spill_tier
    tier.publish_mode = "write-through"  # (its publishes: IN_FLIGHT batches sent at once)
    keys = fill(tier, VICTIMS)
    tier.sealed(keys, [RegisterStatus.REGISTERED] * VICTIMS, RegisterStatus.REGISTERED)
    assert len(tier.batches) > 1
    now = time.monotonic()
    for batch in tier.batches.values():
        batch.sent = now - STALL_S - 5  # (all sent at once, a while ago)
    first = min(tier.batches)
    results = [PUBLISHED] * len(tier.batches[first].keys)
    tier._apply({"op": "publish-done", "batch": first, "results": results, "error": None})
    poller = zmq.Poller()
    tier.started = now - STALL_S  # (started long ago: a restart would not wait for RESTART_S)
    tier.housekeeping(poller, time.monotonic())
    assert tier.counts["sidecar_starts"] == 1, "a sidecar making progress was restarted"
    tier.housekeeping(poller, time.monotonic() + STALL_S + 1)  # nothing more answered
    assert tier.counts["sidecar_starts"] == 2


def test_spill_victims_the_sidecar_cannot_take_are_counted_once(spill_tier):
    """Victims of a round the sidecar's channel refuses are dropped unpublished and counted
    once in `publish_drops`. Before: counted twice (by the refused send, then by the round)."""
    tier, end = spill_tier
    keys = fill(tier, 10)
    end.close()  # (the sidecar gone: the channel breaks at the next send)
    tier.link.closed = True
    tier.registry.eviction.evict(10 * VALUE, spill=True)
    assert not any(k in tier.registry.keys for k in keys)
    assert tier.counts["publish_drops"] == 10
