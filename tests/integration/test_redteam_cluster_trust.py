"""Red team of the cluster tier: a pull whose transfer Mooncake reported failed must never
have its pages reused while that transfer may still land, even when the pull's length was
guessed (the tier's fast path: one round trip, its length the last value's).

A guessed pull that fails is probed, because Mooncake refuses buffers of another length than
the object's with a negative code and no transfer (measured on the CPU wheel 0.3.13: a larger
buffer -800 TRANSFER_FAIL at submit, a smaller one -600). But -800 is also what a transfer
that failed on the way returns (measured: a holder stopped mid-transfer, -800 after the TCP
progress timeout). Before the fix, such a pull was answered [LENGTH, the guessed length] (the
object was found with that very length) or [ABSENT, 0] (the object dropped meanwhile), and
its pages went back at once: the next pull landed in them, was proven and registered, and the
first transfer's late write (`Lingering`'s threat: Mooncake's wait gives up without
cancelling) then turned that registered value into another key's bytes: a wrong hit.

The real `ClusterTier`, `Registry` and sidecar process run here, as in
tests/unit/test_cluster_faults.py; Mooncake's client inside the sidecar is a stand-in whose
failed get lands its bytes later, when the test says so (the late write real Mooncake's
doubted transfers may make: it cannot be brought about on demand over TCP)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from maru.common.checksum import checksums
from maru.common.protocol import RegisterStatus
from unit import test_cluster_faults as faults
from unit.test_cluster_faults import VALUE, Node, stopped, value
from unit.test_eviction_leases import consistent

# The stand-in of tests/unit/test_cluster_faults.py, with a probe that reports each object's
# length (as the master's metadata does), and a get hook "late [drop]": every get of the call
# fails with -800 (TRANSFER_FAIL), the sidecar stops itself (SIGSTOP) before it answers, and
# the objects' bytes are written into the get's buffers once the file "land" appears (then
# "landed"); with "drop", the objects are gone from the cluster after the failed get.
LATE_MOONCAKE = (
    faults.FAKE_MOONCAKE.replace(
        """    def batch_get_replica_desc(self, names):
        return {}
""",
        """    def batch_get_replica_desc(self, names):
        found = {}
        for name in names:
            if _file(name).exists():
                found[name] = [_Replica(_file(name).stat().st_size)]
        return found
""",
    ).replace(
        """        action, codes = _hook("get"), []
""",
        """        action, codes = _hook("get"), []
        if action[:1] == ["late"]:
            return _late(names, buffers, sizes, "drop" in action)
""",
    )
    + """

import threading, time


class _Replica:
    def __init__(self, size):
        self.size = size

    def is_memory_replica(self):
        return True

    def get_memory_descriptor(self):
        desc = type("D", (), {})()
        desc.buffer_descriptor = type("B", (), {"size": self.size})()
        return desc


def _late(names, buffers, sizes, drop):
    writes = []
    for name, places, lengths in zip(names, buffers, sizes):
        data = _file(name).read_bytes()
        at = 0
        for address, length in zip(places, lengths):
            writes.append((address, data[at : at + length]))
            at += length
        if drop:
            _file(name).unlink()

    def land():
        deadline = time.monotonic() + 60
        while not (DIR / "land").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        for address, data in writes:
            ctypes.memmove(address, data, len(data))
        (DIR / "landed").write_text("")

    threading.Thread(target=land, daemon=True).start()
    os.kill(os.getpid(), signal.SIGSTOP)
    return [-800] * len(names)
"""
)


@pytest.fixture
def node(tmp_path, monkeypatch):
    monkeypatch.setattr(faults, "FAKE_MOONCAKE", LATE_MOONCAKE)
    n = Node(tmp_path, monkeypatch)
    try:
        yield n
    finally:
        n.close()


@pytest.mark.parametrize("object_after", ["found with the guessed length", "dropped"])
def test_a_guessed_pull_whose_transfer_failed_keeps_its_pages_from_the_next_pull(
    node, object_after
):
    """Node 2 pulls "far" at the guessed length (the object's); Mooncake answers -800, the
    object still listed with that length (or dropped meanwhile), while a local writer stores
    "far" here. The next pull ("near") must not land in the failed pull's pages, and once the
    failed transfer lands late, every registered key still holds its own bytes: "near" the
    bytes published under "near", "far" the local writer's. Before the fix (mutation: the
    sidecar answers a guessed pull's failed get [LENGTH, length] or [ABSENT, 0] from the probe
    alone, and the tier releases such pages at once): "near" landed in those pages, was
    registered, and read "far"'s cluster bytes after the late write."""
    tier, reg = node.tier, node.reg
    far_cluster, far_local, near = value(11), value(12), value(13)
    node.put_object("far", far_cluster)
    node.put_object("near", near)
    node.hook("get", "late", *(["drop"] if object_after == "dropped" else []))
    tier.guess = VALUE
    assert tier.want(["far"]) == 1
    ((_, failing),) = tier.batches.items()
    pid = tier.proc.pid
    assert node.until(lambda: stopped(pid), 30)
    rid = reg.request_region("A", 16 << 20).region_id  # a local writer stores "far" meanwhile
    node.write("far", far_local, rid, 0)
    os.kill(pid, signal.SIGCONT)
    assert node.until(lambda: not tier.pulling and not tier.batches)
    assert node.read("far") == far_local  # (the local write won: nothing pulled again)
    assert tier.want(["near"]) == 1
    ((_, later),) = tier.batches.items()
    assert node.until(lambda: not tier.pulling and not tier.batches)
    assert node.read("near") == near
    (node.objects / "land").write_text("")  # the failed transfer lands now
    deadline = time.monotonic() + 30
    while not (node.objects / "landed").exists():
        assert time.monotonic() < deadline, "the late write never ran"
        time.sleep(0.01)
    assert node.read("near") == near, "a wrong hit: near's pages took far's late bytes"
    assert later.places != failing.places, "the next pull landed in a failed pull's pages"
    assert node.read("far") == far_local
    assert [b.places for b in tier.lingering] == [failing.places]  # (doubted: DOUBT_S)
    assert tier.counts["pull_failures"] == 1 and tier.counts["pulled"] == 1
    (maru64,) = checksums([memoryview(near)]).tolist()
    status = reg.register("A", ["near"], [rid], [VALUE], [VALUE], [maru64])
    assert status == [RegisterStatus.EXISTS]  # (near stays the pulled one)
    consistent(reg)
