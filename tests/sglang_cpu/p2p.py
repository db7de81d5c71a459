"""Maru as SGLang's L3 across real servers on CPU: the pieces shared by the P2P test
(tests/e2e/test_sglang_p2p.py), the CPU example (examples/sglang/cpu_p2p) and the TTFT
benchmark (benchmarks/bench_sglang_ttft.py).

* :func:`maru_server` -- a ``maru-server`` subprocess on 127.0.0.1 with a free port and its own
  /dev/shm pool (removed afterwards).
* :func:`maru_extra_config` / :func:`hicache_args` -- the server flags, with our backend loaded
  exactly as the documented contract JSON.
* :func:`start_servers` -- several ``sglang.launch_server`` processes (sequentially or at once).
* :func:`wait_l3_stable` -- poll maru-server's key count until write-through has settled.
* :func:`stream_ttft` -- streaming ``/generate``; time to the first chunk and the final response.
* :func:`share_prompt` -- one prompt on one server, then (its pages in L3) on the other.
* :func:`run_p2p` -- the whole P2P flow: two servers, a prompt on one, then on the other.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from .server import SGLangServer, generate, start_server, stop_server

PAGE_SIZE = 4
# An idle SGLang scheduler busy-polls one core (measured: 1.0 CPU-second per second); with two
# cores and two servers, the idle one halves what the busy one gets. `--sleep-on-idle` makes the
# idle scheduler wait in zmq poll (0.02 CPU-s/s), waking on the next request.
IDLE_ARGS = ["--sleep-on-idle"]
MARU_READY_TIMEOUT = 15.0
# The contract: how SGLang's dynamic backend factory finds MaruStorage (docs/sglang.md).
MARU_BACKEND = {
    "backend_name": "maru",
    "module_path": "maru_sglang.maru_storage",
    "class_name": "MaruStorage",
    "interface_v1": 1,
}


def maru_extra_config(
    url: str, *, pool_size: str = "256M", prefetch_threshold: int = 4, **more
) -> dict:
    """``--hicache-storage-backend-extra-config`` for MaruStorage (``maru_*`` keys in ``more``)."""
    return {
        **MARU_BACKEND,
        "maru_server_url": url,
        "maru_pool_size": pool_size,
        "prefetch_threshold": prefetch_threshold,
        **more,
    }


def hicache_args(backend: str = "dynamic", extra: dict | None = None) -> list[str]:
    """HiCache flags for a CPU server: ``direct`` io, ``page_first_direct`` layout, an L3
    backend (``dynamic`` + ``extra`` for Maru; ``file`` for SGLang's built-in one)."""
    args = [
        "--enable-hierarchical-cache",
        "--hicache-io-backend",
        "direct",
        "--hicache-mem-layout",
        "page_first_direct",
        "--hicache-storage-backend",
        backend,
    ]
    if extra is not None:
        args += ["--hicache-storage-backend-extra-config", json.dumps(extra)]
    return args


# How SGLang's dynamic linker factory finds MaruCacheLinker (docs/sglang.md).
MARU_LINKER = {"linker": "MaruCacheLinker", "linker_module_path": "maru_sglang.linker"}


def linker_config(url: str, *, pool_size: str = "256M", **more) -> dict:
    """``--unified-cache-external-linker-config`` for MaruCacheLinker (``maru_*`` keys in
    ``more``)."""
    return {
        **MARU_LINKER,
        "linker_extra_config": {"maru_server_url": url, "maru_pool_size": pool_size, **more},
    }


def linker_args(config: dict) -> list[str]:
    """Server flags that link the device KV pool straight to Maru (no host tier)."""
    return [
        "--enable-unified-cache-external-linker",
        "--unified-cache-external-linker-backend",
        "dynamic",
        "--unified-cache-external-linker-config",
        json.dumps(config),
    ]


def maru_server_command(python: str = sys.executable) -> list[str]:
    beside = Path(python).parent / "maru-server"
    if beside.exists():
        return [str(beside)]
    found = shutil.which("maru-server")
    return [found] if found else [python, "-m", "maru.server"]


@contextlib.contextmanager
def maru_server(
    pool_size: str = "1G",
    *,
    python: str = sys.executable,
    log_level: str = "WARNING",
    extra_args: Sequence[str] = (),
    command: Sequence[str] | None = None,
    pool_dir: str = "/dev/shm",
) -> Iterator[str]:
    """Run ``maru-server`` on 127.0.0.1 (free port, private pool in `pool_dir`, state dir) and
    yield its URL; SIGTERM (then SIGKILL) on exit, and the pool file is removed. The tests, the
    CPU example and every benchmark start their servers here. `extra_args`: more flags;
    `command`: what to run instead of `maru_server_command(python)` (e.g. ``python -m
    maru.server``, so that ``PYTHONPATH`` picks which code runs)."""
    work = Path(tempfile.mkdtemp(prefix="maru-server-"))
    pool = Path(pool_dir) / f"maru-p2p-{uuid.uuid4().hex}.pool"
    ready = work / "ready"
    log = open(work / "maru-server.log", "wb")  # noqa: SIM115 - closed below
    cmd = [
        *(command or maru_server_command(python)),
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--pool",
        str(pool),
        "--pool-size",
        pool_size,
        "--state-dir",
        str(work / "state"),
        "--ready-file",
        str(ready),
        "--log-level",
        log_level,
        *extra_args,
    ]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + MARU_READY_TIMEOUT
        while not (ready.exists() and ready.read_text().strip().startswith("tcp://")):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    "maru-server did not start:\n"
                    + (work / "maru-server.log").read_text(errors="replace")[-3000:]
                )
            time.sleep(0.05)
        yield ready.read_text().strip()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        log.close()
        pool.unlink(missing_ok=True)
        shutil.rmtree(work, ignore_errors=True)


def _observer(url: str, server_public_key: str | None = None):
    """A handler that only asks for statistics: not connected, so it takes no region of the
    pool (a connected handler maps a region of its own, which a full pool cannot give).
    `server_public_key`: for a ``maru-server --curve`` (a pod's server)."""
    from maru import MaruHandler

    return MaruHandler(
        server_url=url, server_public_key=server_public_key, auto_connect=False, timeout_ms=5000
    )


def l3_stats(url: str, *, server_public_key: str | None = None) -> dict:
    """maru-server's statistics (``keys``, ``counters``, ``instances``, ``pool``, ...)."""
    h = _observer(url, server_public_key)
    try:
        return h.stats()
    finally:
        h.close()


def l3_keys(url: str, *, server_public_key: str | None = None) -> int:
    """Number of keys maru-server holds (all namespaces)."""
    return int(l3_stats(url, server_public_key=server_public_key)["keys"])


def wait_l3_stable(
    url: str,
    minimum: int,
    *,
    timeout: float = 30.0,
    settle: float = 1.0,
    poll: float = 0.1,
    server_public_key: str | None = None,
) -> int:
    """Write-through is asynchronous: poll maru-server until it holds at least ``minimum`` keys
    and the count has not changed for ``settle`` seconds. Returns the last count seen."""
    h = _observer(url, server_public_key)
    try:
        deadline = time.monotonic() + timeout
        last, since = -1, time.monotonic()
        while time.monotonic() < deadline:
            count = int(h.stats()["keys"])
            if count != last:
                last, since = count, time.monotonic()
            elif count >= minimum and time.monotonic() - since >= settle:
                break
            time.sleep(poll)
        return last
    finally:
        h.close()


def start_servers(
    model_path: str | Path,
    arg_lists: Sequence[Sequence[str]],
    *,
    concurrent: bool = False,
    log_dir: str | Path | None = None,
    sleep_on_idle: bool = True,
    **kwargs,
) -> list[SGLangServer]:
    """Start one server per entry of ``arg_lists`` (extra args each; plus :data:`IDLE_ARGS`
    unless ``sleep_on_idle`` is false). All or none: if one fails, the others are stopped and
    the error is raised. ``kwargs`` go to ``start_server``."""
    extra = IDLE_ARGS if sleep_on_idle else []

    if log_dir is not None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)

    def one(i: int, args: Sequence[str]) -> SGLangServer:
        log = None if log_dir is None else Path(log_dir) / f"sglang-{i + 1}.log"
        return start_server(model_path, extra_args=[*args, *extra], log_path=log, **kwargs)

    started: list[SGLangServer] = []
    try:
        if concurrent:
            with ThreadPoolExecutor(len(arg_lists)) as pool:
                futures = [pool.submit(one, i, a) for i, a in enumerate(arg_lists)]
                errors = []
                for f in futures:
                    try:
                        started.append(f.result())
                    except BaseException as e:  # re-raised below
                        errors.append(e)
                if errors:
                    raise errors[0]
        else:
            for i, args in enumerate(arg_lists):
                started.append(one(i, args))
    except BaseException:
        stop_servers(started)
        raise
    return started


def stop_servers(servers: Sequence[SGLangServer]) -> None:
    """Stop all servers at once (each SGLang drains for a few seconds after SIGTERM)."""
    if not servers:
        return
    with ThreadPoolExecutor(len(servers)) as pool:
        for f in [pool.submit(stop_server, s) for s in servers]:
            f.result()


def stream_ttft(
    base_url: str,
    *,
    text: str | None = None,
    input_ids: list[int] | None = None,
    max_new_tokens: int = 2,
    timeout: float = 300.0,
) -> tuple[float, dict]:
    """Streaming ``POST /generate`` (greedy). Returns (seconds until the first streamed chunk,
    the last chunk = the whole response with ``output_ids`` and ``meta_info``)."""
    payload: dict = {
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0},
        "stream": True,
    }
    if input_ids is not None:
        payload["input_ids"] = input_ids
    else:
        payload["text"] = text
    host, port = base_url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    body = json.dumps(payload).encode()
    try:
        t0 = time.perf_counter()
        conn.request("POST", "/generate", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"/generate returned {resp.status}: {resp.read()[:2000]!r}")
        ttft = None
        last: dict | None = None
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if ttft is None:
                ttft = time.perf_counter() - t0
            if data == b"[DONE]":
                break
            last = json.loads(data)
    finally:
        conn.close()
    if ttft is None or last is None:
        raise RuntimeError("/generate streamed nothing")
    return ttft, last


def storage_hits(response: dict, *, linker: bool = False) -> int:
    """Prompt tokens the server reported as loaded from L3 storage. A server on an external
    linker has no host tier and reports what the linker loaded as ``host`` hits (SGLang 0.5.23:
    the linker's match sets ``host_hit_length``)."""
    details = response["meta_info"].get("cached_tokens_details") or {}
    return int(details.get("host" if linker else "storage") or 0)


def expected_storage_hits(prompt_tokens: int, page_size: int = PAGE_SIZE) -> int:
    """Prompt tokens an instance can take from L3: SGLang matches at most the first
    ``prompt_tokens - 1`` tokens (the last one is always computed) in whole pages; for a prompt
    of whole pages that is every page but the last."""
    return max(0, (prompt_tokens - 1) // page_size * page_size)


def storage_batches(tokens: int, page_size: int = PAGE_SIZE, batch: int = 128) -> list[int]:
    """Pages per storage call when SGLang loads `tokens` tokens (it batches 128 pages)."""
    pages = tokens // page_size
    return [batch] * (pages // batch) + ([pages % batch] if pages % batch else [])


# ---------------------------------------------------------------------------------------------
# The whole P2P flow (the P2P test and examples/sglang/cpu_p2p run exactly this)
# ---------------------------------------------------------------------------------------------
@dataclass
class PromptOutcome:
    tokens: int
    first: dict  # instance 1's /generate response (computed, nothing cached)
    second: dict  # instance 2's response to the same prompt
    l3_keys_before: int
    l3_keys_after: int  # once instance 1's write-through had settled
    expected_storage: int
    hits_lines: list[str]  # `batch_get_v1 result: N/N hits`, one per batch, in instance 2's log
    hits_logged: bool
    linker: bool = False  # the servers ran MaruCacheLinker, not HiCache + MaruStorage

    @property
    def storage(self) -> int:
        return storage_hits(self.second, linker=self.linker)

    @property
    def same_output(self) -> bool:
        return self.second["output_ids"] == self.first["output_ids"]


@dataclass
class P2PRun:
    startup_seconds: list[float]
    log_paths: list[Path]
    outcomes: list[PromptOutcome] = field(default_factory=list)


def run_p2p(
    model_path: str | Path,
    maru_url: str,
    prompts: Sequence[str],
    *,
    log_dir: str | Path,
    max_new_tokens: int = 8,
    pool_size: str = "256M",
    say: Callable[[str], None] = lambda _msg: None,
    tp_size: int = 1,
    linker: bool = False,
) -> P2PRun:
    """Two SGLang servers with MaruStorage (the contract JSON) on one maru-server; for each
    prompt: instance 1 computes it, its pages reach L3, instance 2 gets the same prompt.

    `linker`: the servers link their device KV pools to Maru with MaruCacheLinker instead (no
    host tier); instance 2's log then says ``linker load: N pages from Maru``.

    `tp_size` > 1: each server runs that many TP ranks on CPU (gloo), rank i's OpenMP
    threads bound to CPU i modulo the CPUs this process may use (SGLang refuses more ranks
    than NUMA nodes otherwise); every rank is a MaruStorage of its own and writes its shard."""
    if linker:
        extra = linker_config(maru_url, pool_size=pool_size)
        args = linker_args(extra)
    else:
        extra = maru_extra_config(maru_url, pool_size=pool_size, prefetch_threshold=PAGE_SIZE)
        args = hicache_args("dynamic", extra)
    say(f"extra config: {json.dumps(extra)}")
    env = None
    if tp_size > 1:
        args += ["--tp-size", str(tp_size)]
        cpus = sorted(os.sched_getaffinity(0))
        env = {
            "SGLANG_CPU_OMP_THREADS_BIND": "|".join(
                str(cpus[i % len(cpus)]) for i in range(tp_size)
            )
        }
    t0 = time.monotonic()
    servers = start_servers(model_path, [args, args], log_dir=log_dir, page_size=PAGE_SIZE, env=env)
    run = P2PRun([s.startup_seconds for s in servers], [s.log_path for s in servers])
    say(
        f"two SGLang instances up in {time.monotonic() - t0:.0f} s: {servers[0].base_url}, "
        f"{servers[1].base_url}"
    )
    first, second = servers
    try:
        for prompt in prompts:
            run.outcomes.append(
                share_prompt(
                    first,
                    second,
                    maru_url,
                    prompt,
                    max_new_tokens=max_new_tokens,
                    say=say,
                    tp_size=tp_size,
                    linker=linker,
                )
            )
    finally:
        stop_servers(servers)
    return run


def share_prompt(
    first: SGLangServer,
    second: SGLangServer,
    maru_url: str,
    prompt: str,
    *,
    max_new_tokens: int = 8,
    say: Callable[[str], None] = lambda _msg: None,
    tp_size: int = 1,
    linker: bool = False,
    server_public_key: str | None = None,
) -> PromptOutcome:
    """One prompt of the P2P flow: `first` computes it, its pages reach L3 (maru-server's key
    count settles), then `second`, which never saw it, gets the same prompt. Shared by
    :func:`run_p2p` and the pod test (servers on two simulated hosts; `server_public_key`
    for its ``maru-server --curve``)."""
    before = l3_keys(maru_url, server_public_key=server_public_key)
    one = generate(first.base_url, prompt, max_new_tokens=max_new_tokens)
    tokens = one["meta_info"]["prompt_tokens"]
    say(
        f"instance 1: {tokens}-token prompt computed, cached_tokens_details="
        f"{one['meta_info'].get('cached_tokens_details')}"
    )
    after = wait_l3_stable(
        maru_url,
        before + tp_size * (tokens // PAGE_SIZE - 1),
        server_public_key=server_public_key,
    )
    say(f"maru-server holds {after} keys ({after - before} new: written through)")
    two = generate(second.base_url, prompt, max_new_tokens=max_new_tokens)
    expected = expected_storage_hits(tokens)
    if linker:  # one load of every page (no 128-page storage batches)
        lines = [f"linker load: {expected // PAGE_SIZE} pages from Maru"]
    else:
        lines = [f"batch_get_v1 result: {n}/{n} hits" for n in storage_batches(expected)]
    logged = all(line in second.log_path.read_text(errors="replace") for line in lines)
    outcome = PromptOutcome(tokens, one, two, before, after, expected, lines, logged, linker)
    say(f"instance 2: cached_tokens_details={two['meta_info'].get('cached_tokens_details')}")
    say(
        f"instance 2: {outcome.storage} of {tokens} prompt tokens from Maru "
        f"(expected {expected}); log shows {lines}: {logged}; "
        f"same output as instance 1: {outcome.same_output}"
    )
    return outcome
