"""Issue 43, a CXL pod, with real SGLang: two SGLang CPU servers, one per host, one pool.

The pod is `pod_child.pod_hosts` (hosts A and B, each its own network and mount namespace with
a private /dev/shm, joined by a veth pair; the pool in a neutral tmpfs that A sees as a
directory and B as one bind-mounted file at another path; `maru-server --curve` on A).
SGLang server 1 runs on A, server 2 on B with its HTTP port on B's veth address; server 2's
`--hicache-storage-backend-extra-config` carries `maru_server_url` (tcp://A's veth address),
`maru_pool_path` (B's path of the pool) and `maru_server_public_key`. For each prompt, server
1 computes it (nothing cached: the run without Maru) and writes its pages through; once
maru-server's key count is stable, server 2, which never saw the prompt, must report every
reusable page as a storage hit, log ``batch_get_v1 result: N/N hits``, and generate exactly
server 1's tokens: the pages it read in place through its own mapping are the bytes host A
wrote. maru-server's STATS (per-instance `host`) must place server 1's instance on A and
server 2's on B's veth address.

The flow runs in `sglang_pod_child.py` (the pod in a child with a tmpfs of its own, the
driver inside host A) and reports back one JSON line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

_TESTS = Path(__file__).resolve().parents[1]
if str(_TESTS) not in sys.path:
    sys.path.insert(0, str(_TESTS))

import sglang_cpu  # noqa: E402

sglang_cpu.require()

from integration.pod_child import CLIENT_IP, SERVER_IP  # noqa: E402
from integration.test_pool_path import hosts_missing  # noqa: E402
from integration.tmpfs import run_on_tmpfs  # noqa: E402
from sglang_cpu import p2p  # noqa: E402
from sglang_cpu.tiny_model import build_tiny_model  # noqa: E402

CHILD = Path(__file__).with_name("sglang_pod_child.py")

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(bool(hosts_missing()), reason=hosts_missing() or "-"),
]


def run_pod(tmp_path: Path, model: Path) -> dict:
    """What `sglang_pod_child.py` saw (its driver's report, or its error)."""
    workdir, logs = tmp_path / "work", tmp_path / "logs"
    workdir.mkdir()
    args = (str(workdir), str(model), str(logs))
    done = run_on_tmpfs(tmp_path, "size=512M", CHILD, *args, timeout=570)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert "error" not in seen, f"{seen['error']}\n{seen['stdout']}"
    return seen


def test_second_hosts_server_reuses_first_hosts_kv_through_the_pool(tmp_path):
    seen = run_pod(tmp_path, build_tiny_model(tmp_path / "tiny-qwen2"))
    print(f"startup: {seen['startup_seconds']}; requests by host: {seen['host_requests']}")
    assert seen["b_extra_config"]["maru_server_url"] == seen["url"]
    assert seen["b_extra_config"]["maru_pool_path"].endswith("/b-cxl0")
    assert [o["tokens"] for o in seen["outcomes"]] == [200, 600]
    for o in seen["outcomes"]:
        assert o["first_cached"] == 0, o  # server 1 computed it all (no Maru hits)
        assert o["keys_written"] >= o["tokens"] // p2p.PAGE_SIZE - 1, o
        # Server 2 on host B never saw the prompt: N/N of the reusable prefix from the pool.
        details = o["second_details"]
        assert details is not None and details["storage_backend"] == "MaruStorage", o
        assert o["storage"] == o["expected"] == p2p.expected_storage_hits(o["tokens"]), o
        assert details["device"] == 0 and details["host"] == 0, o
        assert o["hits_logged"], o
        # ... read in place on host B: exactly host A's tokens.
        assert o["second_output"] == o["first_output"], o
    # maru-server places server 1's instance on host A (its address there, or "local" on
    # its Unix socket) and server 2's on B's veth address.
    on_a, on_b = seen["hosts"]
    assert on_a and set(on_a) <= {SERVER_IP, "local"}, seen["instances"]
    assert on_b and set(on_b) == {CLIENT_IP}, seen["instances"]
