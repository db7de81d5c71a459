"""Run by `test_sglang_cluster.py`: two real SGLang CPU servers on two nodes of a cluster.

`sglang_cluster_child.py WORKDIR MODEL LOG_DIR` makes the nodes with
`cluster_child.cluster` (node 1 and node 2: each its own network and mount namespace with a
private /dev/shm, a veth pair, a `maru-server --cluster mooncake` with its own pool on each,
one `mooncake_master` on node 1), then runs this script's `drive` mode inside node 1 (the
veth addresses exist only in the nodes) and prints its one JSON line, with both tiers'
statistics read afterwards.

`drive` starts SGLang server 1 on node 1 (MaruStorage on node 1's maru-server) and server 2
on node 2 (on node 2's), each through `nsenter` into its node (`sglang_pod_child.python_on`:
what SGLang needs inside a namespace is told there). After a warm-up request on each, server
1 computes the prompt (nothing cached: the run without Maru) and writes its pages through to
node 1's pool, whose tier publishes them; once published, server 2, which never saw the
prompt and whose pool never held it, gets the same prompt: its prefetch pulls the pages
into node 2's pool through the tier. Both requests stream, so their times to first token
are the recompute (server 1) and the cross-node hit (server 2) of the same prompt; server 2
then gets it once more after `/flush_cache`: a hit in its own pool (nothing pulled).

Everything is bounded: the driver and both servers run under `timeout LIFE_S`, and so do
the nodes, the master and the maru-servers (`pod_child.LIFE_S`, raised here).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TESTS.parent), str(TESTS)]

from tests.integration import cluster_child, pod_child  # noqa: E402

from e2e.sglang_pod_child import LIFE_S, python_on  # noqa: E402
from sglang_cpu import p2p  # noqa: E402
from sglang_cpu.server import SGLangServer, flush_cache, free_port, start_server  # noqa: E402
from sglang_cpu.tiny_model import make_prompt  # noqa: E402

PROMPT = (600, 23)  # (tokens, seed): whole pages, over one 128-page storage batch
WARM_UP = (16, 5)  # the first request after a start is an outlier: not the one measured
NEW_TOKENS = 8
POOL_SIZE = "256M"  # each node's pool; its SGLang instance takes regions of MARU_POOL
MARU_POOL = "64M"
# Node 2's lookups wait up to 10 s for their pulls: a bound far above what a pull takes
# (ms), not a threshold the test could miss on a loaded machine. SGLang waits for its
# prefetch (`wait_complete`), so the pages pulled are the pages used.
NODE2_ARGS = ("--cluster-lookup-ms", "10000")
SGLANG_ARGS = ["--hicache-storage-prefetch-policy", "wait_complete", *p2p.IDLE_ARGS]
BUSY = ("queue_depth", "pull_queue_depth", "pulling", "in_flight")


def published(url: str, want: int) -> dict:
    """Node 1's tier once it published `want` values and nothing waits in it."""
    deadline = time.monotonic() + cluster_child.WAIT_S
    while True:
        now = p2p.l3_stats(url)["cluster"]
        done = now["published"] >= want and not any(now[k] for k in BUSY)
        if done or time.monotonic() > deadline:
            return now
        time.sleep(0.2)


def drive(url1: str, url2: str, one: int, two: int, model: str, logs: str) -> dict:
    """Server 1 on node 1, server 2 on node 2, each on its own node's maru-server; the
    prompt on 1, then on 2."""
    log_dir, work = Path(logs), Path(logs) / "bin"
    work.mkdir(parents=True, exist_ok=True)
    servers = []

    def start(pid: int, ip: str, url: str, name: str) -> SGLangServer:
        extra = p2p.maru_extra_config(url, pool_size=MARU_POOL, prefetch_threshold=p2p.PAGE_SIZE)
        return start_server(
            model,
            extra_args=[*p2p.hicache_args("dynamic", extra), *SGLANG_ARGS],
            host=ip,
            port=free_port(cluster_child.NODE1),  # (nothing else listens in node 2)
            python=python_on(pid, work, f"node{name}"),
            log_path=log_dir / f"sglang-{name}.log",
            page_size=p2p.PAGE_SIZE,
        )

    try:
        with ThreadPoolExecutor(2) as pool:  # both start at once (the test's wall time)
            nodes = ((one, cluster_child.NODE1, url1, "1"), (two, cluster_child.NODE2, url2, "2"))
            futures = [pool.submit(start, *node) for node in nodes]
            errors = []
            for future in futures:
                try:
                    servers.append(future.result())
                except Exception as exc:  # (the other one is stopped below, then raised)
                    errors.append(exc)
        if errors:
            raise errors[0]
        first, second = servers
        warm_up = make_prompt(WARM_UP[0], seed=WARM_UP[1])
        for server in servers:
            p2p.stream_ttft(server.base_url, text=warm_up, max_new_tokens=NEW_TOKENS)
        keys_before = p2p.wait_l3_stable(url1, WARM_UP[0] // p2p.PAGE_SIZE - 1)  # (written)
        published_before = published(url1, 0)["published"]
        prompt = make_prompt(PROMPT[0], seed=PROMPT[1])
        recompute_s, computed = p2p.stream_ttft(
            first.base_url, text=prompt, max_new_tokens=NEW_TOKENS
        )
        tokens = computed["meta_info"]["prompt_tokens"]
        keys_after = p2p.wait_l3_stable(url1, keys_before + tokens // p2p.PAGE_SIZE - 1)
        tier1 = published(url1, published_before + keys_after - keys_before)
        hit_s, pulled = p2p.stream_ttft(second.base_url, text=prompt, max_new_tokens=NEW_TOKENS)
        expected = p2p.expected_storage_hits(tokens)
        lines = [f"batch_get_v1 result: {n}/{n} hits" for n in p2p.storage_batches(expected)]
        log2 = second.log_path.read_text(errors="replace")
        # The same prompt on node 2 again, its device and host caches flushed: the pages
        # now in node 2's own pool (a local hit, the cost a cross-node hit compares with).
        flush_cache(second.base_url)
        local_s, local = p2p.stream_ttft(second.base_url, text=prompt, max_new_tokens=NEW_TOKENS)
    finally:
        p2p.stop_servers(servers)
    return {
        "startup_seconds": [s.startup_seconds for s in servers],
        "tokens": tokens,
        "expected": expected,
        "first_cached": computed["meta_info"]["cached_tokens"],
        "first_output": computed["output_ids"],
        "keys_written": keys_after - keys_before,
        "published": tier1["published"] - published_before,
        "second_details": pulled["meta_info"].get("cached_tokens_details"),
        "storage": p2p.storage_hits(pulled),
        "second_output": pulled["output_ids"],
        "hits_lines": lines,
        "hits_logged": all(line in log2 for line in lines),
        "ttft_recompute_s": round(recompute_s, 3),
        "ttft_cluster_hit_s": round(hit_s, 3),
        "ttft_local_hit_s": round(local_s, 3),
        "local_storage": p2p.storage_hits(local),
        "local_output": local["output_ids"],
    }


def nodes(workdir: Path, model: str, logs: str) -> dict:
    """The cluster, `drive` run inside node 1, then both tiers' statistics."""
    pod_child.LIFE_S = cluster_child.LIFE_S = LIFE_S  # (the nodes', master's and servers')
    with cluster_child.cluster(workdir, NODE2_ARGS, pool_size=POOL_SIZE) as c:
        connected = [c.wait(1, "connected", True), c.wait(2, "connected", True)]
        argv = [c.url1, c.url2, str(c.one.pid), str(c.two.pid), model, logs]
        cmd = [
            *("nsenter", "-t", str(c.one.pid), "-n", "-m", "timeout", str(LIFE_S)),
            *(sys.executable, __file__, "drive", *argv),
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=LIFE_S + 10)
        if done.returncode != 0:
            return {"error": done.stderr[-6000:], "stdout": done.stdout[-3000:]}
        seen = json.loads(done.stdout.strip().splitlines()[-1])
        tiers = [c.settled(1), c.settled(2)]
        return {**seen, "connected": [t["connected"] for t in connected], "tiers": tiers}


if __name__ == "__main__":
    if sys.argv[1] == "drive":
        url1, url2, one, two, model, logs = sys.argv[2:8]
        print(json.dumps(drive(url1, url2, int(one), int(two), model, logs)))
    else:
        workdir, model, logs = sys.argv[1:4]
        print(json.dumps(nodes(Path(workdir), model, logs)))
