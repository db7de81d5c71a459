"""Issue 44, a cluster tier on Mooncake Store, with real SGLang: two SGLang CPU servers on two
nodes, each on its own node's maru-server (its own pool, its own tier), one Mooncake master.

The nodes are `cluster_child.cluster` (each its own network and mount namespace with a
private /dev/shm, joined by a veth pair). Server 1 on node 1 computes a prompt (nothing
cached: the run without Maru) and writes its pages through to node 1's pool, whose tier
publishes them to Mooncake. Server 2 on node 2, which never saw the prompt and whose pool
never held it, must report every reusable page as a storage hit, log ``batch_get_v1 result:
N/N hits`` for each storage batch, and generate exactly server 1's tokens (greedy): the pages
node 2's tier pulled into its pool, proven, are the bytes node 1 wrote. Node 2's tier counts
the pulls; neither tier refuses a proof.

The flow runs in `sglang_cluster_child.py` and reports back one JSON line; it also reports
both requests' times to first token (the recompute on node 1, the cross-node hit on node 2),
printed, not asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

_TESTS = Path(__file__).resolve().parents[1]
if str(_TESTS) not in sys.path:
    sys.path.insert(0, str(_TESTS))

import sglang_cpu  # noqa: E402

sglang_cpu.require()

from integration.test_cluster_tier import cannot_run  # noqa: E402
from sglang_cpu import p2p  # noqa: E402
from sglang_cpu.tiny_model import build_tiny_model  # noqa: E402

CHILD = Path(__file__).with_name("sglang_cluster_child.py")

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(bool(cannot_run()), reason=cannot_run() or "-"),
]


def test_second_nodes_server_reuses_first_nodes_kv_through_the_cluster_tier(tmp_path):
    workdir, logs = tmp_path / "work", tmp_path / "logs"
    workdir.mkdir()
    model = build_tiny_model(tmp_path / "tiny-qwen2")
    cmd = [sys.executable, str(CHILD), str(workdir), str(model), str(logs)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=570)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert "error" not in seen, f"{seen['error']}\n{seen['stdout']}"
    print(
        f"startup: {seen['startup_seconds']}; TTFT recompute on node 1 "
        f"{seen['ttft_recompute_s']} s, cluster hit on node 2 {seen['ttft_cluster_hit_s']} s, "
        f"local hit on node 2 {seen['ttft_local_hit_s']} s"
    )
    assert seen["connected"] == [True, True], seen
    assert seen["tokens"] == 600 and seen["first_cached"] == 0, seen  # server 1 computed it
    pages = seen["tokens"] // p2p.PAGE_SIZE - 1
    assert seen["keys_written"] >= pages and seen["published"] >= seen["keys_written"], seen
    # Server 2 on node 2 never saw the prompt: N/N of the reusable prefix through the tier.
    details = seen["second_details"]
    assert details is not None and details["storage_backend"] == "MaruStorage", seen
    assert seen["storage"] == seen["expected"] == p2p.expected_storage_hits(600), seen
    assert details["device"] == 0 and details["host"] == 0, seen
    assert seen["hits_logged"], seen
    # ... pulled into node 2's pool, proven, and read: exactly server 1's tokens.
    assert seen["second_output"] == seen["first_output"], seen
    # Again on node 2, its caches flushed: from its own pool now, the same tokens.
    assert seen["local_storage"] == seen["expected"], seen
    assert seen["local_output"] == seen["first_output"], seen
    tier1, tier2 = seen["tiers"]
    assert "failed" not in tier1 and "failed" not in tier2, seen
    assert tier2["pulled"] >= seen["expected"] // p2p.PAGE_SIZE, seen
    assert tier1["proof_failures"] == tier2["proof_failures"] == 0, seen
    assert tier1["publish_refused"] == 0, seen
