"""SGLang's own failure injection on a real server on CPU with Maru as L3 (issue 14).

SGLang 0.5.23's `StorageBackendFactory.create_backend` wraps every L3 backend it builds in
`HiCacheStorageFailureInjector` (`sglang/srt/mem_cache/hicache_storage.py`) when
`SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY` (seconds: each storage call first sleeps
uniform(0, value)) or `SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE` (probability: a call is then
skipped and answers as a miss / failed write: `batch_exists` 0, `batch_get_v1` and
`batch_set_v1` all False) is set. Both draw from an unseeded per-thread `random.Random`, so
which calls fail differs run to run; each injection is logged at DEBUG ("Inject delay ...",
"Inject failure in <call>"), which this test switches on for that one logger through SGLang's
own `SGLANG_LOGGING_CONFIG_PATH`.

One real `maru-server` and one `python -m sglang.launch_server` (tiny random Qwen2, HiCache
with `direct` io and `page_first_direct`, MaruStorage loaded by the contract JSON) with both
injections on. The reference is the first, cold run of each prompt: L3 holds none of its pages
then (asserted: nothing cached), i.e. the output of a server without L3. Then, several times,
`/flush_cache` empties the device and host tiers and every prompt runs again, so each run goes
through L3: pages that reached Maru are prefetched (`batch_exists` + `batch_get_v1`, whole or
cut short where a call failed), the rest is computed and backed up again (`batch_set_v1`).

Asserted: every run generates exactly the reference's tokens; injected failures and delays
fired; storage hits still happened (Maru served pages between the failures); no exception or
error from the storage path reached the log (SGLang's controller threads log any exception a
backend raises with `logger.exception`); the server stays healthy. (Tried by hand: a
MaruStorage whose `batch_get_v1` raises now and then still gives the same tokens, as SGLang
recomputes, and fails here only on the traceback in the log.)
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest

import sglang_cpu

sglang_cpu.require()

from sglang_cpu import p2p  # noqa: E402
from sglang_cpu.server import flush_cache, generate, http_request, start_server, stop_server  # noqa: E402
from sglang_cpu.tiny_model import build_tiny_model, make_prompt  # noqa: E402

pytestmark = [pytest.mark.sglang, pytest.mark.slow, pytest.mark.timeout(300)]

RANDOM_DELAY = 0.02  # seconds, upper bound of each call's injected sleep
RANDOM_FAILURE = 0.3  # probability that a call is skipped and fails
# A prompt of whole pages, one ending inside a page, and one over SGLang's 128-page storage
# batch (two calls each way: an injected failure in the second cuts a prefetch short).
PROMPTS = [(120, 61), (101, 62), (600, 63)]  # (tokens, seed)
# Rounds of (flush, every prompt again): at least MIN_ROUNDS, and more until each storage call
# has had an injected failure and some pages were loaded (the failures are random), at most
# MAX_ROUNDS (~2 s each here; P(a call kind never failed) is below 1e-4 by then).
MIN_ROUNDS, MAX_ROUNDS = 3, 16
CALLS = ("batch_exists", "batch_get_v1", "batch_set_v1")  # what MHA with interface_v1 calls
INJECTOR_LOGGER = "sglang.srt.mem_cache.hicache_storage"
# Records of these loggers at ERROR or above mean the storage path failed for real.
STORAGE_LOGGERS = ("maru", "sglang.srt.managers.cache_controller", "sglang.srt.mem_cache")
# What SGLang's storage threads log when a backend call raises (cache_controller.py).
ESCAPED = (
    "Traceback",
    "HiCache storage query failed",
    "HiCache prefetch transfer failed",
    "HiCache backup failed",
)


def _logging_config(path: Path) -> Path:
    """SGLang's logging as usual (INFO), with the level and logger name on each line, and the
    failure injector's logger at DEBUG so that each injection shows."""
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"plain": {"format": "[%(asctime)s %(levelname)s %(name)s] %(message)s"}},
        "handlers": {
            "stderr": {
                "class": "logging.StreamHandler",
                "formatter": "plain",
                "stream": "ext://sys.stderr",
            }
        },
        "root": {"level": "INFO", "handlers": ["stderr"]},
        "loggers": {INJECTOR_LOGGER: {"level": "DEBUG"}},
    }
    path.write_text(json.dumps(config))
    return path


def _injected(log: str) -> Counter:
    """Injected failures per storage call, from the server log."""
    return Counter(re.findall(r"Inject failure in (\w+)", log))


def _covered(server, storage: list[int]) -> bool:
    """Every storage call failed at least once and some run loaded pages from L3."""
    injected = _injected(server.log_path.read_text(errors="replace"))
    return sum(storage) > 0 and all(injected[call] for call in CALLS)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"))


def test_injected_failures_and_delays_change_no_output(tiny_model, maru_server, tmp_path):
    url = maru_server.url
    extra = p2p.maru_extra_config(url, pool_size="128M", maru_instance_id="faults")
    env = {
        "SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY": str(RANDOM_DELAY),
        "SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE": str(RANDOM_FAILURE),
        "SGLANG_LOGGING_CONFIG_PATH": str(_logging_config(tmp_path / "logging.json")),
    }
    server = start_server(
        tiny_model,
        extra_args=[*p2p.hicache_args("dynamic", extra), *p2p.IDLE_ARGS],
        env=env,
        log_path=tmp_path / "sglang.log",
    )
    prompts = [make_prompt(tokens, seed=seed) for tokens, seed in PROMPTS]
    storage: list[int] = []  # tokens loaded from L3, per run after a flush
    backends: set[str | None] = set()  # the backend SGLang names in each response
    try:
        reference = [generate(server.base_url, p, max_new_tokens=8) for p in prompts]
        for ref, (tokens, _) in zip(reference, PROMPTS):
            assert ref["meta_info"]["prompt_tokens"] == tokens
            assert ref["meta_info"]["cached_tokens"] == 0, ref["meta_info"]  # nothing in L3
        rounds = 0
        while rounds < MIN_ROUNDS or (rounds < MAX_ROUNDS and not _covered(server, storage)):
            rounds += 1
            p2p.wait_l3_stable(url, minimum=0)  # let the last round's backups land
            flush_cache(server.base_url)
            for prompt, ref in zip(prompts, reference):
                out = generate(server.base_url, prompt, max_new_tokens=8)
                details = out["meta_info"]["cached_tokens_details"] or {}
                assert details.get("device", 0) == 0 and details.get("host", 0) == 0, details
                storage.append(p2p.storage_hits(out))
                backends.add(details.get("storage_backend"))
                assert out["output_ids"] == ref["output_ids"], (storage, server.log_tail())
                assert out["text"] == ref["text"]
        status, _ = http_request(server.base_url + "/health", timeout=10)
        assert status == 200
        assert server.process.poll() is None
    finally:
        stop_server(server)
    log = server.log_path.read_text(errors="replace")
    injected = _injected(log)
    delays = len(re.findall(r"Inject delay [0-9.e-]+s in \w+", log))
    print(
        f"{rounds} rounds; tokens from L3 per run: {storage}; injected failures: "
        f"{dict(injected)}; injected delays: {delays}"
    )

    assert "HiCache storage test injector enabled" in log
    assert all(injected[call] for call in CALLS) and delays > 0, (dict(injected), log[-4000:])
    assert sum(storage) > 0, log[-4000:]  # Maru still served pages between the failures
    assert all(s % p2p.PAGE_SIZE == 0 for s in storage)
    # The injector wraps MaruStorage: SGLang names the wrapper as the backend of a hit.
    assert backends - {None} == {"HiCacheStorageFailureInjector"}, backends
    for marker in ESCAPED:
        assert marker not in log, log[max(0, log.index(marker) - 2000) :][:6000]
    errors = [
        line
        for line in log.splitlines()
        if (m := re.match(r"\[\S+ \S+ (ERROR|CRITICAL) (\S+)\]", line))
        and m.group(2).startswith(STORAGE_LOGGERS)
    ]
    assert not errors, errors
    # The pages SGLang reported as loaded were hits counted by maru-server.
    assert p2p.l3_stats(url)["counters"]["hits"] >= sum(storage) // p2p.PAGE_SIZE
