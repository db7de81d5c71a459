"""TP = 2 through Maru: a page that one rank cannot load is a miss for every rank.

At TP = 2 each SGLang rank is its own MaruStorage (its own Maru instance, `<id>/tp<rank>`,
its own KV namespace: the TP shard is part of it) and stores and loads its own shard of every
KV page. In the vLLM connector a load failing on ONE rank while the other succeeded let the
other rank compute with KV that did not match. SGLang 0.5.23 reduces both answers across the
ranks with MIN (`HiCacheController._sync_prefetch_hit_query` on `batch_exists`, and
`_reduce_prefetch_ack` on the pages each rank's `batch_get_v1` completed), so a page missing or
unreadable on one rank must end the storage hit on both. These tests prove it with real servers
(two TP = 2 instances of one tiny model, `maru_checksums` on) by damaging only rank 1's copy of
a middle page of a prompt the first instance computed:

* deleted (`MaruAdmin.delete_prefix` of that one key): rank 1's `batch_exists` stops there;
* corrupted in the pool file: both ranks' `batch_exists` say yes, rank 0 loads every page,
  rank 1's load of that page fails its checksum.

The second instance must then report storage hits up to that page only, on both ranks, and
generate exactly the tokens the first instance computed without any cache. What it saves
afterwards must be right too: the pages it wrote back, next to the first instance's, serve a
full hit with the same tokens (two instances' shards of one page: fine). Last, a model of the
same geometry (other weights) writes the same prompt: its pages, rank 1's included, are in other
namespaces and never hits for the first model.
"""

from __future__ import annotations

import os
import random
import re
import sys
import time
from pathlib import Path

import pytest

import sglang_cpu

sglang_cpu.require()

from sglang_cpu import p2p  # noqa: E402
from sglang_cpu.server import flush_cache, generate  # noqa: E402
from sglang_cpu.tiny_model import build_tiny_model  # noqa: E402

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(900)]

PAGE = p2p.PAGE_SIZE
TOKENS = 200  # 50 pages; SGLang stores and matches 49 (the last token is always computed)
STORED = p2p.expected_storage_hits(TOKENS) // PAGE
CUT = 20  # the first page damaged on rank 1 (a middle page)
NEW_TOKENS = 8
TP = 2
WAIT_S = 60.0
_NAMESPACE = re.compile(r"TP(\d+)\] MaruStorage: KV namespace ([0-9a-f]+)")


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def prompt_ids(seed: int) -> list[int]:
    """`TOKENS` token ids of the tiny model's vocabulary (sent as `input_ids`: what SGLang
    hashes into page keys is then known here)."""
    rng = random.Random(seed)
    return [rng.randrange(1, 500) for _ in range(TOKENS)]


def page_hashes(ids: list[int]) -> list[str]:
    """SGLang's storage key of each full page of `ids` (no extra key, no salt)."""
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    hashes = get_storage_hash_str(ids, None, page_size=PAGE)
    assert len(hashes) == len(ids) // PAGE
    return hashes


def tp_env() -> dict[str, str]:
    """Each rank's OpenMP threads on a CPU of their own (as `p2p.run_p2p` does)."""
    cpus = sorted(os.sched_getaffinity(0))
    return {"SGLANG_CPU_OMP_THREADS_BIND": "|".join(str(cpus[i % len(cpus)]) for i in range(TP))}


def server_args(url: str, instance: str) -> list[str]:
    extra = p2p.maru_extra_config(
        url, prefetch_threshold=PAGE, maru_instance_id=instance, maru_checksums=True
    )
    return [*p2p.hicache_args("dynamic", extra), "--tp-size", str(TP)]


def namespaces(server) -> dict[int, str]:
    """Each rank's KV namespace, as its MaruStorage logged it."""
    found = {
        int(r): ns for r, ns in _NAMESPACE.findall(server.log_path.read_text("utf-8", "replace"))
    }
    assert sorted(found) == list(range(TP)), server.log_tail()
    return found


def stored(admin, namespace: str) -> dict[str, str]:
    """Page hash -> writer of every key in `namespace`: the configured name of the Maru
    instance that wrote it (`<maru_instance_id>/tp<rank>`; the server adds `.<16 hex>`)."""
    infos, truncated = admin.keys(prefix=f"{namespace}:", limit=10000)
    assert not truncated
    return {str(i.key).split(":", 1)[1]: i.owner.rsplit(".", 1)[0] for i in infos}


def wait_stored(admin, expect: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
    """Poll until every namespace holds the given hashes with the given owners (write-through
    is asynchronous); returns what it saw last, whether or not it got there."""
    deadline = time.monotonic() + WAIT_S
    while True:
        seen = {ns: stored(admin, ns) for ns in expect}
        done = all(
            seen[ns].get(h) == owner for ns, want in expect.items() for h, owner in want.items()
        )
        if done or time.monotonic() > deadline:
            return seen
        time.sleep(0.2)


def corrupt(url: str, key: str) -> None:
    """Rewrite `key`'s bytes in the pool file (not through Maru: a stray writer, a bad DIMM):
    the high byte of every bf16 value flipped, so the page is wrong KV through and through."""
    from maru import MaruHandler

    h = MaruHandler(server_url=url, pool_size="16M")
    try:
        (info,) = h.batch_retrieve([key])
        assert info is not None, key
        region = h._mapper.get(info.region_id).handle
        data = bytearray(info.view[: info.length])
        for i in range(1, len(data), 2):
            data[i] ^= 0x7F
        fd = os.open(region.path, os.O_RDWR)
        try:
            assert os.pwrite(fd, bytes(data), region.offset + info.offset) == len(data)
        finally:
            os.close(fd)
    finally:
        h.close()


def log_since(server, mark: int) -> str:
    with open(server.log_path, "rb") as f:
        f.seek(mark)
        return f.read().decode("utf-8", "replace")


def log_mark(server) -> int:
    return server.log_path.stat().st_size


def prefetch_lines(text: str, rid: str) -> dict[int, str]:
    """Each rank's `HiCache prefetch ... req=<rid> completed=N ...` line."""
    pattern = re.compile(rf"TP(\d+)\] HiCache prefetch \w+ req={re.escape(rid)} (.*)")
    return {int(r): rest for r, rest in pattern.findall(text)}


def wait_text(server, mark: int, needles: list[str]) -> str:
    """The log since `mark` once it holds every needle (SGLang logs after it answered)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        text = log_since(server, mark)
        if all(n in text for n in needles) or time.monotonic() > deadline:
            return text
        time.sleep(0.2)


# ---------------------------------------------------------------------------------------------
# fixtures: one maru-server, two TP = 2 instances of one model
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="module")
def maru_url():
    with p2p.maru_server("1G") as url:
        yield url


@pytest.fixture(scope="module")
def admin(maru_url):
    from maru.client.admin import MaruAdmin

    with MaruAdmin(maru_url, timeout_ms=5000) as a:
        yield a


@pytest.fixture(scope="module")
def pair(tiny_model, maru_url, tmp_path_factory, monkeypatch_module):
    """Instances A and B: A computes, B reads. Each rank's namespace, from their logs."""
    # (the hashes are computed here with SGLang's own extension, built where the servers build it)
    monkeypatch_module.setenv("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    log_dir = tmp_path_factory.mktemp("tp2-trust")
    servers = p2p.start_servers(
        tiny_model,
        [server_args(maru_url, "trust-a"), server_args(maru_url, "trust-b")],
        log_dir=log_dir,
        page_size=PAGE,
        env=tp_env(),
    )
    try:
        a, b = servers
        ns = namespaces(a)
        assert namespaces(b) == ns  # one model, one geometry: one namespace per rank
        assert ns[0] != ns[1]  # each rank's shard under keys of its own
        yield a, b, ns
    finally:
        p2p.stop_servers(servers)


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def compute_on_a(a, admin, ns, ids) -> tuple[dict, list[str]]:
    """A computes `ids` with nothing cached (the reference: no Maru involved); waits until
    both ranks' shards of every stored page are in Maru, written by A's ranks."""
    ref = generate(a.base_url, input_ids=ids, max_new_tokens=NEW_TOKENS)
    assert ref["meta_info"]["cached_tokens"] == 0, ref["meta_info"]
    hashes = page_hashes(ids)
    want = {ns[r]: {h: f"trust-a/tp{r}" for h in hashes[:STORED]} for r in range(TP)}
    seen = wait_stored(admin, want)
    for r in range(TP):  # (else the damage below would miss its page: the test proves nothing)
        missing = [
            i for i, h in enumerate(hashes[:STORED]) if seen[ns[r]].get(h) != f"trust-a/tp{r}"
        ]
        assert not missing, (r, missing, hashes[:2], list(seen[ns[r]].items())[:3])
    return ref, hashes


# ---------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_page_deleted_on_rank1_only_ends_the_hit_on_both_ranks(pair, admin):
    a, b, ns = pair
    ids = prompt_ids(seed=41)
    ref, hashes = compute_on_a(a, admin, ns, ids)

    # Only rank 1's shard of pages CUT and CUT + 10 goes; rank 0 keeps every page.
    for k in (CUT, CUT + 10):
        assert admin.delete_prefix(f"{ns[1]}:{hashes[k]}")[0] == 1  # (deleted, kept)
    assert all(h in stored(admin, ns[0]) for h in hashes[:STORED])

    mark = log_mark(b)
    two = generate(b.base_url, input_ids=ids, max_new_tokens=NEW_TOKENS)
    rid = two["meta_info"]["id"]
    text = wait_text(b, mark, [f"req={rid}"])
    lines = prefetch_lines(text, rid)
    # Rank 0 alone would have had 49 pages: the hit is the pages on EVERY rank.
    assert p2p.storage_hits(two) == CUT * PAGE, (two["meta_info"], text[-3000:])
    assert sorted(lines) == [0, 1], text[-3000:]
    assert all(f"completed={CUT * PAGE} " in line for line in lines.values()), lines
    # MIN over the ranks' batch_exists: rank 0 did not even ask for the pages past the cut.
    assert f"TP0] batch_get_v1 result: {CUT}/{CUT} hits" in text, text[-3000:]
    assert two["output_ids"] == ref["output_ids"]

    # B computed the rest and wrote back rank 1's two missing shards (the others exist: the
    # first writer keeps them). A page whose rank-0 shard is A's and rank-1 shard is B's:
    # both are this model's KV of these tokens, so A, with its caches flushed, gets a full
    # hit from the mix and the same tokens.
    want = {ns[1]: {hashes[k]: "trust-b/tp1" for k in (CUT, CUT + 10)}}
    seen = wait_stored(admin, want)
    assert all(seen[ns[1]].get(hashes[k]) == "trust-b/tp1" for k in (CUT, CUT + 10)), seen
    assert stored(admin, ns[0])[hashes[CUT]] == "trust-a/tp0"
    flush_cache(a.base_url)
    again = generate(a.base_url, input_ids=ids, max_new_tokens=NEW_TOKENS)
    assert p2p.storage_hits(again) == STORED * PAGE, again["meta_info"]
    assert again["output_ids"] == ref["output_ids"]


@pytest.mark.slow
def test_page_corrupted_on_rank1_fails_its_load_and_ends_the_hit_on_both_ranks(
    pair, admin, maru_url
):
    a, b, ns = pair
    ids = prompt_ids(seed=42)
    ref, hashes = compute_on_a(a, admin, ns, ids)

    # Rank 1's shard of page CUT is still registered (both ranks' batch_exists say 49), but
    # its bytes are not its writer's: with maru_checksums its load fails, rank 0's succeeds.
    corrupt(maru_url, f"{ns[1]}:{hashes[CUT]}")

    mark = log_mark(b)
    two = generate(b.base_url, input_ids=ids, max_new_tokens=NEW_TOKENS)
    rid = two["meta_info"]["id"]
    text = wait_text(b, mark, [f"req={rid}"])
    lines = prefetch_lines(text, rid)
    # Both ranks were asked for every stored page; rank 0 loaded them all, rank 1 not past the
    # corrupted one: SGLang keeps the pages completed on every rank (MIN), on both ranks.
    assert f"TP0] batch_get_v1 result: {STORED}/{STORED} hits" in text, text[-3000:]
    # (MaruStorage answers per page: every page but the corrupted one; SGLang keeps the
    # leading run, `_page_get_zero_copy`)
    assert f"TP1] batch_get_v1 result: {STORED - 1}/{STORED} hits" in text, text[-3000:]
    assert re.search(rf"TP1\] Prefetch operation {rid} failed to retrieve page {hashes[CUT]}", text)
    assert sorted(lines) == [0, 1], text[-3000:]
    assert all(f"completed={CUT * PAGE} " in line for line in lines.values()), lines
    assert p2p.storage_hits(two) == CUT * PAGE, (two["meta_info"], text[-3000:])
    assert two["output_ids"] == ref["output_ids"]

    # A, its caches flushed, reads what is in Maru now (the corrupted shard, a miss; what B
    # wrote): the same tokens again.
    flush_cache(a.base_url)
    again = generate(a.base_url, input_ids=ids, max_new_tokens=NEW_TOKENS)
    print(f"after the corruption, A reads {p2p.storage_hits(again)} tokens from Maru")
    assert p2p.storage_hits(again) >= CUT * PAGE, again["meta_info"]
    assert again["output_ids"] == ref["output_ids"]


@pytest.mark.slow
def test_another_models_pages_are_never_hits(pair, admin, tiny_model, maru_url, tmp_path):
    """Model Y: the same geometry (layers, heads, dtype, page, layout, TP), other weights,
    another served name. Its rank-1 shard of a page is not the first model's: other keys."""
    a, _, ns = pair
    other = build_tiny_model(tmp_path / "tiny-qwen2-other", seed=1)
    (y,) = p2p.start_servers(
        other, [server_args(maru_url, "trust-y")], log_dir=tmp_path, page_size=PAGE, env=tp_env()
    )
    try:
        ns_y = namespaces(y)
        assert ns_y[0] not in ns.values() and ns_y[1] not in ns.values(), (ns_y, ns)
        ids = prompt_ids(seed=43)
        ref_y = generate(y.base_url, input_ids=ids, max_new_tokens=NEW_TOKENS)
        hashes = page_hashes(ids)
        want = {ns_y[r]: {h: f"trust-y/tp{r}" for h in hashes[:STORED]} for r in range(TP)}
        seen = wait_stored(admin, want)
        assert all(seen[ns_y[1]].get(h) == "trust-y/tp1" for h in hashes[:STORED])

        # A has never seen the prompt; Maru holds Y's KV of it on both ranks: not A's.
        one = generate(a.base_url, input_ids=ids, max_new_tokens=NEW_TOKENS)
        assert one["meta_info"]["cached_tokens"] == 0, one["meta_info"]
        assert p2p.storage_hits(one) == 0, one["meta_info"]
        # (the models differ: Y's pages, taken as A's, would have changed what A says)
        assert one["output_ids"] != ref_y["output_ids"]
    finally:
        p2p.stop_servers([y])
