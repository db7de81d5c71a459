"""The cluster tier on Mooncake Store (`maru-server --cluster mooncake`), with real
processes: nodes in network and mount namespaces of their own (`cluster_child.py`), a real
`mooncake_master`, real maru-servers and clients, bytes checked as read back."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from maru.client.supply import AHEAD_WRITES
from maru.server.cluster.mooncake import MooncakeMissing, load_mooncake, master_binary

from .test_pool_path import hosts_missing

CLUSTER_CHILD = Path(__file__).with_name("cluster_child.py")


def mooncake_missing() -> str:
    """Why Mooncake Store cannot run here (scripts/install_mooncake_cpu.sh installs it), or ""."""
    try:
        load_mooncake()
        master_binary()
    except MooncakeMissing as exc:
        return str(exc)
    return ""


def cannot_run() -> str:
    return hosts_missing() or mooncake_missing()


pytestmark = pytest.mark.skipif(bool(cannot_run()), reason=cannot_run() or "-")


def run_nodes(tmp_path: Path, scenario: str = "proofs") -> dict:
    workdir = tmp_path / "work"
    workdir.mkdir()
    cmd = [sys.executable, str(CLUSTER_CHILD), str(workdir), scenario]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_values_written_on_one_node_are_read_on_another_every_byte_proven(tmp_path):
    """Two nodes, each its own maru-server, pool and tier, one Mooncake master.

    Node 1's tier publishes every value sealed in its pool straight from the pool's pages: a
    plain Mooncake client on node 2 reads each back with every byte as written and a proof
    for its name stating its length and maru64. A value whose pages no longer match its
    writer's checksum (a byte flipped in the pool before the tier read it) is refused: not
    published, counted; while the tier's sidecar is stopped, node 1 serves its own values.
    Node 1's sidecar SIGKILLed is started again, and what lay in its dead Mooncake segment
    is never a wrong hit on node 2.

    A client on node 2 reads node 1's values through its own server (leased lookups): every
    miss is pulled into node 2's pool, proven, registered, and read with every byte equal;
    the second read finds them in place (nothing pulled again). Objects in Mooncake whose
    trailer does not hold (bytes unlike the maru64 it states, another name's trailer, none)
    are refused at pull: misses, counted, never registered; objects of the tier's first
    format (a value and a proof object beside it) are misses. (Without the proof check at
    pull, the flipped value reads as wrong bytes on node 2.)"""
    nodes = run_nodes(tmp_path)
    assert [n["connected"] for n in nodes["connected"]] == [True, True], nodes
    assert nodes["write"] == {"stored": 24}, nodes
    published = nodes["published"]
    assert (published["published"], published["published_bytes"]) == (24, 24 * 60_000), nodes
    assert published["publish_drops"] == published["publish_failures"] == 0, nodes
    assert nodes["read"] == {"right": 24, "missing": 0, "wrong": 0}, nodes
    assert nodes["write_flipped"] == {"stored": 1}, nodes
    # While the sidecar is stopped, node 1 still stores and serves its own values; the new
    # value waits, held, in the tier's batch.
    assert nodes["own_while_stopped"] == {"right": 24, "missing": 0, "wrong": 0}, nodes
    assert nodes["queued_while_stopped"]["in_flight"] == 1, nodes
    assert nodes["refused"]["publish_refused"] == 1, nodes
    assert nodes["refused"]["published"] == 24, nodes
    assert nodes["read_flipped"] == {"right": 0, "missing": 1, "wrong": 0}, nodes

    assert nodes["forge"] == {"codes": [0, 0, 0, 0, 0]}, nodes
    assert nodes["node2_first"] == {"right": 24, "missing": 0, "wrong": 0}, nodes
    assert nodes["node2_bad"] == {"right": 0, "missing": 1, "wrong": 0}, nodes
    assert nodes["node2_forged"] == {"right": 0, "missing": 4, "wrong": 0}, nodes
    pulled = nodes["node2_stats"]
    assert (pulled["pulled"], pulled["pulled_bytes"]) == (24, 24 * 60_000), nodes
    # bad/0 was never published, forged/3 is in the tier's first format (a value and a
    # proof beside it, under that format's names): not in the cluster for this tier, misses;
    # forged/0's bytes (one flipped in Mooncake) are not those its trailer states, forged/1's
    # trailer is another name's, forged/2 has none: refused, counted.
    assert (pulled["pull_misses"], pulled["proof_failures"]) == (2, 3), nodes
    # Node 2's readers were woken when their pulls landed: their EXISTS kept by the server
    # (`maru.server.cluster.waits`), not asked again every few ms.
    assert pulled["exists_kept"] >= 1, nodes
    assert nodes["node2_again"] == {"right": 24, "missing": 0, "wrong": 0}, nodes
    assert nodes["node2_stats_again"]["pulled"] == 24, nodes
    # Every lookup path pulls what it misses: a copying lookup (MaruStorage's v2 read,
    # `lookup(for_copy=True)`) and a pin (LMCache's pinned lookup) read node 1's values.
    assert nodes["w"] == [{"stored": 4}] * 2, nodes
    assert nodes["node2_copy_read"] == {"right": 4, "missing": 0, "wrong": 0}, nodes
    assert nodes["node2_pin_read"] == {"pinned": 4, "right": 4, "missing": 0, "wrong": 0}, nodes

    # Node 1's sidecar SIGKILLed (with it, the Mooncake segment holding node 1's values):
    # the server starts it again; the values that lay in the dead segment (Mooncake's
    # master still lists them for a while, and serves other bytes for them: a plain client
    # read such wrong bytes here) are never a wrong hit on node 2.
    assert nodes["v2"] == {"stored": 8} and nodes["v2_published"]["published"] == 40, nodes
    assert nodes["restarted"]["sidecar_starts"] == 2, nodes
    assert nodes["reconnected"]["connected"] is True, nodes
    dead = nodes["node2_dead_segment"]
    assert dead["wrong"] == 0 and dead["right"] + dead["missing"] == 8, nodes


def test_the_pools_serve_their_own_keys_through_the_clusters_faults_and_reconnect(tmp_path):
    """The master SIGKILLed then restarted, node 2's link cut then restored, node 2's
    sidecar stopped then continued: no wrong byte anywhere; each pool stores and serves its
    own keys throughout; the cluster's keys are misses while it is away (a pull that misses
    the budget is a miss); each tier notices (`connected` false, with the reason) and
    reconnects by itself, then publishes and pulls again."""
    nodes = run_nodes(tmp_path, "faults")
    right = lambda n: {"right": n, "missing": 0, "wrong": 0}  # noqa: E731
    missing = lambda n: {"right": 0, "missing": n, "wrong": 0}  # noqa: E731
    assert [n["connected"] for n in nodes["connected"]] == [True, True], nodes
    assert nodes["a"] == {"stored": 8, "published": 8}, nodes

    # The master gone: local service goes on, cluster lookups miss, the tiers notice.
    assert nodes["down_own1"] == right(8), nodes
    assert nodes["down_write1"] == {"stored": 4} and nodes["down_read1"] == right(4), nodes
    assert nodes["down_cluster2"] == missing(8), nodes
    for node in ("down_state1", "down_state2"):
        assert nodes[node]["connected"] is False, nodes
        assert "master" in nodes[node]["error"], nodes
    assert nodes["down_write2"] == {"stored": 4} and nodes["down_read2"] == right(4), nodes
    assert nodes["down_cluster2_again"] == missing(8), nodes
    # Back (empty): both reconnect; node 1's new values are read on node 2; the old ones,
    # gone with the master's state, are misses.
    assert nodes["up_state1"]["connected"] is nodes["up_state2"]["connected"] is True, nodes
    assert nodes["b"] == {"stored": 8, "published": 8}, nodes
    assert nodes["up_read2"] == right(8), nodes
    assert nodes["up_old2"] == missing(8), nodes

    # Node 2's link cut: its own keys served, new ones stored, the cluster's missed.
    assert nodes["c"] == {"stored": 4, "published": 4}, nodes
    assert nodes["cut_own2"] == right(8), nodes
    assert nodes["cut_write2"] == {"stored": 4} and nodes["cut_read2"] == right(4), nodes
    assert nodes["cut_cluster2"] == missing(4), nodes
    assert nodes["cut_state2"]["connected"] is False, nodes
    # The link back: reconnected, pulls again (c may have lain in node 2's own segment,
    # which its reconnect may drop: a miss then, never a wrong byte).
    assert nodes["relinked_state2"]["connected"] is True, nodes
    assert nodes["d"] == {"stored": 4, "published": 4}, nodes
    assert nodes["relinked_read2"] == right(4), nodes
    assert nodes["relinked_c2"]["wrong"] == 0, nodes

    # Node 2's sidecar stopped: the pulls miss the budget (misses), its own keys are
    # served; continued: the values are pulled and read.
    assert nodes["e"] == {"stored": 4, "published": 4}, nodes
    assert nodes["stopped_read2"] == missing(4), nodes
    assert nodes["stopped_again2"] == missing(4), nodes
    assert nodes["stopped_own2"] == right(8), nodes
    assert nodes["continued_read2"] == right(4), nodes
    assert nodes["node1"]["proof_failures"] == nodes["node2"]["proof_failures"] == 0, nodes


def test_keys_evicted_from_a_pool_are_spilled_to_the_cluster_and_pulled_back(tmp_path):
    """`--cluster-publish spill` on node 1: nothing is published as it is written; a key is
    published when a watermark round evicts it from node 1's pool (held, registered, until
    published: the bytes published are the bytes written), then dropped. Node 2 reads every
    evicted key, every byte as written, and misses those node 1 still holds (the cluster has
    them not); node 1 reads its evicted keys again, pulled back from the cluster."""
    nodes = run_nodes(tmp_path, "spill")
    assert [n["connected"] for n in nodes["connected"]] == [True, True], nodes
    spilled = nodes["write"]["published"]
    assert nodes["write"]["stored"] == 250 and 16 <= spilled < 250, nodes
    assert nodes["spilled"]["publish_drops"] == nodes["spilled"]["publish_failures"] == 0, nodes
    # The pool keeps its low watermark (10% of 64 MiB): a key being spilled counts as
    # evicted already, so later stores do not evict more for it.
    assert 250 - spilled >= int(0.1 * (64 << 20)) // 60_000, nodes
    assert nodes["node2"] == {"right": spilled, "missing": 250 - spilled, "wrong": 0}, nodes
    assert nodes["node1_back"] == {"right": 16, "missing": 0, "wrong": 0}, nodes
    assert nodes["node1_stats"]["pulled"] == 16, nodes


def test_keys_an_instance_evicts_for_its_own_room_are_spilled_to_the_cluster(tmp_path):
    """`--cluster-publish spill` on node 1, whose pool stays below its watermark: an
    instance's `maru_pool_size` share overflows, so what evicts is the instance asking room
    for its next writes (`EVICT_FOR` ahead), not a watermark round. Those victims are held
    and published before they are dropped, as a watermark round's are: node 2 reads every
    one, every byte as written. Only the room of the one write that found the share full
    and waited for it goes unpublished (counted as drops); node 2 misses those and the keys
    node 1 still holds. Each round ahead evicts one call's room (the room held for the
    instance counts as on its way, not evicted again)."""
    nodes = run_nodes(tmp_path, "spill_share")
    assert [n["connected"] for n in nodes["connected"]] == [True, True], nodes
    write, tier, batch = nodes["write"], nodes["node1"], 8  # (`cluster_child.SHARE_BATCH`)
    evicted = write["counters"]["evictions"]
    assert write["stored"] == 250 and write["kept"] + evicted == 250, nodes
    assert evicted >= 100, nodes  # (8M of 64 KiB chunks hold at most 128 of the 250)
    # the first full write: its own room now, the next writes' held (two rounds); then one
    # call's room a round
    first = (1 + AHEAD_WRITES) * batch
    assert write["counters"]["eviction_rounds"] == 2 + (evicted - first) // batch, nodes
    assert tier["publish_drops"] == batch and tier["publish_failures"] == 0, nodes
    assert tier["published"] == evicted - batch, nodes
    missing = write["kept"] + batch
    assert nodes["node2"] == {"right": evicted - batch, "missing": missing, "wrong": 0}, nodes


def test_pulled_values_do_not_keep_a_nodes_writers_from_storing(tmp_path):
    """Node 2 pulls node 1's values until they fill its pool, then a new instance on node 2
    writes: every value is stored and read back. The tier's instance, over its fair share,
    gives regions back when the writer finds the pool full (before, it never did, and the
    writer's region requests stayed refused)."""
    nodes = run_nodes(tmp_path, "crowded")
    assert [n["connected"] for n in nodes["connected"]] == [True, True], nodes
    n, own = 480, 96  # (`cluster_child.CROWD_N`, `OWN_N`)
    assert nodes["write"]["stored"] == n and nodes["write"]["published"] == n, nodes
    assert nodes["pulled"] == {"right": n, "missing": 0, "wrong": 0}, nodes
    assert nodes["node2_full"]["pulled"] == n, nodes
    assert nodes["own"] == {"stored": own}, nodes
    assert nodes["own_read"] == {"right": own, "missing": 0, "wrong": 0}, nodes


def test_an_fsdax_pool_s_tier_lets_go_of_the_region_files_the_server_freed(tmp_path):
    """Node 1's pool an fsdax directory (a file per region). Its values are published from
    their region's file and read on node 2, every byte right. Once their keys are deleted,
    the server frees the region and unlinks its file; the tier's sidecar, which mapped and
    registered that file with Mooncake, lets go of it within a few of its checks (a mapping
    would keep the file's blocks allocated on the pool's filesystem for the sidecar's life).
    Values written after that, in a new region file, are published and read right."""
    nodes = run_nodes(tmp_path, "fsdax")
    assert [n["connected"] for n in nodes["connected"]] == [True, True], nodes
    assert nodes["first"] == {"stored": 24, "published": 24}, nodes
    assert nodes["first_read2"] == {"right": 24, "missing": 0, "wrong": 0}, nodes
    assert nodes["mapped_before"] == ["/dev/shm/maru-fsdax/region-1.mem"], nodes
    assert nodes["clear"] == {"deleted": 24, "kept": 0}, nodes
    assert nodes["mapped_later"] == [], nodes  # (before: [".../region-1.mem (deleted)"])
    assert nodes["second"] == {"stored": 24, "published": 24}, nodes
    assert nodes["second_read2"] == {"right": 24, "missing": 0, "wrong": 0}, nodes


@pytest.mark.lmcache
def test_lmcache_backend_on_node_2_reads_a_chunk_stored_through_it_on_node_1(tmp_path):
    """LMCache's shipped MaruBackend, unmodified, on two nodes (each its own maru-server,
    pool and tier): node 1's engine stores a prompt (three full chunks and a partial one);
    node 2's engine, whose pool never held them, finds the whole prompt through LMCache's
    async lookup (pinned: `batch_pin` pulls what the pool misses) and retrieves every chunk
    into its own paged cache, byte for byte what node 1 stored."""
    pytest.importorskip("lmcache")
    nodes = run_nodes(tmp_path, "lmcache")
    assert [n["connected"] for n in nodes["connected"]] == [True, True], nodes
    stored, retrieved = nodes["store"], nodes["retrieve"]
    assert "failed" not in stored and "failed" not in retrieved, nodes
    assert len(stored["keys"]) == 4 and nodes["published"]["published"] >= 4, nodes
    assert retrieved["keys"] == stored["keys"], nodes
    assert retrieved["lookup"] == retrieved["retrieved"] == nodes["prompt"], nodes
    assert retrieved["chunks_same"] == [True] * 4 and retrieved["nonzero"], nodes
    assert nodes["node2"]["pulled"] == 4 and nodes["node2"]["proof_failures"] == 0, nodes
