"""An adversarial audit of MaruStorage's v2 interface (hybrid models) against the first rule: a
hit is the bytes written under that key, or it is a miss. What these tests prove, each against
a real `maru-server` and SGLang 0.5.23's real host pools on CPU:

- a Mamba state (or SWA page) is stored and found under exactly SGLang's chained page hash
  (`get_storage_hash_str`): a prompt that diverges at page k finds no state past it, however
  alike its later pages, and keys that differ only in their last character share nothing;
- what `batch_get_v2` returns has the shape SGLang reads (a list of bools per pool name, found
  by `PoolName` and by its value), so that a KV page or a state gone between `batch_exists_v2`
  and the get makes SGLang's own `count_pool_hits` fall short and the prefetch be discarded;
- a `batch_set_v2` whose state write failed while the KV pages were stored never lets
  `batch_exists_v2` report that length, under TRAILING_PAGES (Mamba, SWA) and ALL_PAGES;
- a reader asking for a longer trailing window than was written is not given that length;
- in a pool too small for what is written (evictions, refused writes), every restorable
  length reported is backed by writes that succeeded, and every page loaded is byte-exact;
- two instances writing the same keys at once: every page read is one writer's whole page;
- a logical KV anchor (DeepSeek-V4: no bytes) proves nothing by itself: without a pool with
  bytes that gates the prefix, no length is reported.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

import pytest

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(300)]

import sglang_cpu  # noqa: E402

sglang_cpu.require()
# (SGLang's page hash is a JIT-built extension: one build per environment, as the servers use)
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    count_pool_hits,
)
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402

from maru_sglang.maru_storage import MaruStorage  # noqa: E402
from sglang_cpu.host_pools import Geometry, make_host_pool, storage_config  # noqa: E402
from sglang_cpu.hybrid_pools import (  # noqa: E402
    Hybrid,
    Sidecar,
    fill_bytes,
    make_hybrid,
    random_pages,
    read_bytes,
    register,
    slots,
    transfer,
)
from sglang_cpu.p2p import MARU_BACKEND  # noqa: E402

PAGE = 4  # tokens per KV page (Geometry's default)


def _storage(url: str, hybrid: Hybrid, local_index: bool = True, **extra: Any) -> MaruStorage:
    cfg = {**MARU_BACKEND, "maru_server_url": url, "maru_pool_size": "4M"}
    cfg.update(maru_local_index=local_index, **extra)
    storage = MaruStorage(storage_config(is_mla=hybrid.is_mla, extra=cfg), {})
    register(storage, hybrid)
    return storage


def _mamba_swa() -> Hybrid:
    """MHA KV + a Mamba state pool (window 1) + a sliding-window pool (window 2)."""
    hybrid = make_hybrid("mamba")
    swa = make_host_pool(Geometry(layers=2, head_dim=8))
    hybrid.sidecars.append(Sidecar("swa", swa, "trailing_pages", window=2))
    return hybrid


def _hashes(tokens: list[int]) -> list[str]:
    """SGLang's storage keys of `tokens`' full pages: each chains every page before it."""
    return list(get_storage_hash_str(tokens, None, page_size=PAGE))


def _write_all(
    storage: MaruStorage, hybrid: Hybrid, keys: list[str], seed: int
) -> dict[str, list[torch.Tensor]]:
    """KV (v1) and every sidecar (v2) page at every KV page, from host page 0; the pages."""
    n = len(keys)
    idx, pages = slots(hybrid.kv, 0, n), random_pages(hybrid.kv, n, seed)
    fill_bytes(hybrid.kv, idx, pages)
    assert storage.batch_set_v1(keys, idx) == [True] * n
    written = {"kv": pages}
    transfers = []
    for i, side in enumerate(hybrid.sidecars):
        sidx = slots(side.pool, 0, n)
        written[side.name] = random_pages(side.pool, n, seed * 100 + i)
        fill_bytes(side.pool, sidx, written[side.name])
        transfers.append(transfer(side, keys, sidx))
    got = storage.batch_set_v2(transfers)
    assert got == {s.name: [True] * n for s in hybrid.sidecars}
    assert storage.confirm_writes() == 0
    return written


def _probes(hybrid: Hybrid) -> list[PoolTransfer]:
    """The hit query's transfers: placeholders of each window's length, as SGLang sends."""
    return [transfer(s, ["__placeholder__"] * s.window, None) for s in hybrid.sidecars]


def _load_side(
    storage: MaruStorage, side: Sidecar, keys: list[str], first: int = 20
) -> tuple[list[bool], list[torch.Tensor]]:
    """`batch_get_v2` of `keys` into zeroed host pages `first`..; the results and the bytes."""
    dst = slots(side.pool, first, len(keys))
    zero = torch.zeros_like(random_pages(side.pool, 1, 0)[0])
    fill_bytes(side.pool, dst, [zero] * len(keys))
    got = storage.batch_get_v2([transfer(side, keys, dst)])
    return got[side.name], read_bytes(side.pool, dst, len(keys))


# -- 1. the state's key is SGLang's chained hash, exactly -------------------------------------


@pytest.mark.parametrize("local_index", [True, False])
def test_a_state_is_found_only_under_the_chained_hash_of_its_own_prefix(maru_server, local_index):
    """Prompt A (8 pages) is stored whole: KV, a Mamba state and an SWA page at every page.
    Prompt B has A's tokens except in page 1: its hashes equal A's at page 0 only, although
    its pages 2..7 hold the same tokens as A's. B's usable prefix is 1 page, and none of A's
    states or SWA pages past page 0 is ever served under B's keys."""
    hybrid = _mamba_swa()
    storage = _storage(maru_server.url, hybrid, local_index)
    tokens_a = list(range(1000, 1000 + 8 * PAGE))
    tokens_b = list(tokens_a)
    tokens_b[PAGE + 1] = 7  # one token of page 1
    keys_a, keys_b = _hashes(tokens_a), _hashes(tokens_b)
    assert keys_a[0] == keys_b[0] and all(a != b for a, b in zip(keys_a[1:], keys_b[1:]))
    written = _write_all(storage, hybrid, keys_a, seed=11)

    result = storage.batch_exists_v2(keys_b, _probes(hybrid))
    assert (result.kv_hit_pages, result.restorable_prefix_pages) == (1, [1])
    for side in hybrid.sidecars:
        hits, loaded = _load_side(storage, side, keys_b)
        assert hits == [True] + [False] * 7, side.name
        assert torch.equal(loaded[0], written[side.name][0])
    # A itself: every length restorable, every state byte-exact
    result = storage.batch_exists_v2(keys_a, _probes(hybrid))
    assert result.restorable_prefix_pages == list(range(1, 9))
    for side in hybrid.sidecars:
        hits, loaded = _load_side(storage, side, keys_a)
        assert hits == [True] * 8
        assert all(torch.equal(a, b) for a, b in zip(loaded, written[side.name])), side.name
    storage.close()


@pytest.mark.parametrize("local_index", [True, False])
def test_keys_differing_only_in_their_last_character_share_nothing(maru_server, local_index):
    """A state under hash h is never found or served under h with its last hex digit changed
    (no truncated or weakened key anywhere between MaruStorage and the server's index)."""
    hybrid = _mamba_swa()
    storage = _storage(maru_server.url, hybrid, local_index)
    keys = _hashes(list(range(3 * PAGE)))
    _write_all(storage, hybrid, keys, seed=12)
    near = [k[:-1] + ("0" if k[-1] != "0" else "1") for k in keys]
    assert storage.batch_exists(near) == 0
    assert storage.batch_exists_v2(near, _probes(hybrid)).kv_hit_pages == 0
    for side in hybrid.sidecars:
        assert _load_side(storage, side, near)[0] == [False] * 3
    storage.close()


# -- 2. a page gone between exists and get: what SGLang makes of Maru's answer ----------------


@pytest.mark.parametrize("gone", ["kv_middle", "mamba_end", "swa_window"])
def test_a_page_gone_after_exists_makes_sglangs_own_count_fall_short(maru_server, gone):
    """exists_v2 reports 8 pages; then one page SGLang will read is deleted. Maru's get
    results, read the way SGLang's controller reads them (`count_pool_hits`, looked up by
    `PoolName` and by value; the KV leading run of `_page_get_zero_copy`), fall short of
    what `_check_hybrid_prefetch_result` requires, so the prefetch is discarded; every page
    reported True holds the bytes written."""
    hybrid = _mamba_swa()
    storage = _storage(maru_server.url, hybrid)
    keys = _hashes(list(range(500, 500 + 8 * PAGE)))
    written = _write_all(storage, hybrid, keys, seed=13)
    assert storage.batch_exists_v2(keys, _probes(hybrid)).kv_hit_pages == 8
    pool, key = {"kv_middle": ("kv", 3), "mamba_end": ("mamba", 7), "swa_window": ("swa", 6)}[gone]
    assert storage.handler.delete(storage.pools[pool].keys([keys[key]])[0])

    dst = slots(hybrid.kv, 20, 8)
    kv = storage.batch_get_v1(keys, dst)
    kv_run = kv.index(False) if False in kv else len(kv)  # SGLang's _page_get_zero_copy
    loaded = read_bytes(hybrid.kv, dst, 8)
    assert all(torch.equal(loaded[i], written["kv"][i]) for i in range(8) if kv[i])
    # SGLang reads the sidecars only after every KV page arrived; they use the last pages
    side_keys = {"mamba": keys[-1:], "swa": keys[-2:]}
    transfers, dsts = [], {}
    for side in hybrid.sidecars:
        dsts[side.name] = slots(side.pool, 20, len(side_keys[side.name]))
        transfers.append(transfer(side, side_keys[side.name], dsts[side.name]))
    results = storage.batch_get_v2(transfers)
    assert set(results) == {"mamba", "swa"}
    for side in hybrid.sidecars:
        got = results[side.name]
        assert isinstance(got, list) and len(got) == len(side_keys[side.name])
        assert all(isinstance(ok, bool) for ok in got)
        want = written[side.name][8 - len(got) :]
        pages = read_bytes(side.pool, dsts[side.name], len(got))
        assert all(torch.equal(a, b) for ok, a, b in zip(got, pages, want) if ok)
    hits = count_pool_hits(results)
    by_enum = {n: hits.get(PoolName(n), 0) for n in ("mamba", "swa")}
    assert by_enum == {n: hits[n] for n in ("mamba", "swa")}
    complete = kv_run == 8 and all(by_enum[n] == len(side_keys[n]) for n in by_enum)
    assert not complete  # SGLang discards this prefetch
    if gone == "kv_middle":
        assert kv_run == 3
    storage.close()


# -- 3. a state write that failed ---------------------------------------------------------------


def test_a_failed_state_write_never_lets_exists_report_its_length(maru_server):
    """KV is stored for all 8 pages; the v2 backup of the node ending at page 8 fails for the
    Mamba state (its host indices are not a page of the pool) and for the SWA window's first
    page (a separate failing backup), while the node ending at page 4 is whole. exists_v2
    reports only length 4, and its state is the one written."""
    hybrid = _mamba_swa()
    mamba, swa = hybrid.sidecars
    storage = _storage(maru_server.url, hybrid)
    keys = _hashes(list(range(200, 200 + 8 * PAGE)))
    kv_idx = slots(hybrid.kv, 0, 8)
    fill_bytes(hybrid.kv, kv_idx, random_pages(hybrid.kv, 8, 14))
    assert storage.batch_set_v1(keys, kv_idx) == [True] * 8
    # the node ending at page 4: whole
    state4 = random_pages(mamba.pool, 1, 15)
    fill_bytes(mamba.pool, slots(mamba.pool, 0, 1), state4)
    fill_bytes(swa.pool, slots(swa.pool, 0, 2), random_pages(swa.pool, 2, 16))
    ok = storage.batch_set_v2(
        [
            transfer(mamba, keys[3:4], slots(mamba.pool, 0, 1)),
            transfer(swa, keys[2:4], slots(swa.pool, 0, 2)),
        ]
    )
    assert ok == {"mamba": [True], "swa": [True, True]}
    # the node ending at page 8: the state fails (indices beyond the pool), SWA page 7 stored
    beyond = torch.arange(10**6, 10**6 + 1, dtype=torch.int64)
    fill_bytes(swa.pool, slots(swa.pool, 3, 1), random_pages(swa.pool, 1, 17))
    ok = storage.batch_set_v2(
        [transfer(mamba, keys[7:8], beyond), transfer(swa, keys[7:8], slots(swa.pool, 3, 1))]
    )
    assert ok == {"mamba": [False], "swa": [True]}
    assert storage.confirm_writes() == 0
    result = storage.batch_exists_v2(keys, _probes(hybrid))
    assert (result.kv_hit_pages, result.restorable_prefix_pages) == (4, [4])
    # the state arrives later, the SWA window still lacks page 6: still 4
    fill_bytes(mamba.pool, slots(mamba.pool, 1, 1), random_pages(mamba.pool, 1, 18))
    assert storage.batch_set_v2([transfer(mamba, keys[7:8], slots(mamba.pool, 1, 1))]) == {
        "mamba": [True]
    }
    result = storage.batch_exists_v2(keys, _probes(hybrid))
    assert result.restorable_prefix_pages == [4]
    hits, loaded = _load_side(storage, mamba, keys[3:4])
    assert hits == [True] and torch.equal(loaded[0], state4[0])
    storage.close()


def test_a_failed_all_pages_write_cuts_the_prefix(maru_server):
    """ALL_PAGES (the DSA indexer, indices from KV): the indexer backup of pages 4..7 fails
    (indices that are not whole pages) while their KV is stored: the usable prefix is 4."""
    hybrid = make_hybrid("dsa")
    indexer = hybrid.sidecars[0]
    storage = _storage(maru_server.url, hybrid)
    keys = [f"{i:064x}" for i in range(1, 9)]
    idx = slots(hybrid.kv, 0, 8)
    fill_bytes(hybrid.kv, idx, random_pages(hybrid.kv, 8, 19))
    assert storage.batch_set_v1(keys, idx) == [True] * 8
    fill_bytes(indexer.pool, idx, random_pages(indexer.pool, 8, 20))
    assert storage.batch_set_v2([transfer(indexer, keys[:4], idx[: 4 * hybrid.page_size])]) == {
        "indexer": [True] * 4
    }
    torn = idx[4 * hybrid.page_size :] + 1  # not page-aligned
    assert storage.batch_set_v2([transfer(indexer, keys[4:], torn)]) == {"indexer": [False] * 4}
    result = storage.batch_exists_v2(keys, _probes(hybrid))
    assert (result.kv_hit_pages, result.restorable_prefix_pages) == (4, [1, 2, 3, 4])
    storage.close()


# -- 4. a reader's window longer than the writer's ---------------------------------------------


def test_a_longer_trailing_window_than_written_is_not_restorable(maru_server):
    """The writer stored SWA pages for a 2-page window ending at page 8 (pages 7, 8) and at
    page 4 (3, 4). A reader whose window is 3 pages is given no length: each needs a page
    nobody wrote. With window 2 the same store gives [4, 8]."""
    hybrid = _mamba_swa()
    hybrid.sidecars = hybrid.sidecars[1:]  # SWA only
    swa = hybrid.sidecars[0]
    storage = _storage(maru_server.url, hybrid)
    keys = _hashes(list(range(300, 300 + 8 * PAGE)))
    idx = slots(hybrid.kv, 0, 8)
    fill_bytes(hybrid.kv, idx, random_pages(hybrid.kv, 8, 21))
    assert storage.batch_set_v1(keys, idx) == [True] * 8
    side = keys[2:4] + keys[6:8]
    fill_bytes(swa.pool, slots(swa.pool, 0, 4), random_pages(swa.pool, 4, 22))
    assert storage.batch_set_v2([transfer(swa, side, slots(swa.pool, 0, 4))]) == {"swa": [True] * 4}
    assert storage.batch_exists_v2(keys, _probes(hybrid)).restorable_prefix_pages == [4, 8]
    wide = transfer(swa, ["__placeholder__"] * 3, None)
    result = storage.batch_exists_v2(keys, [wide])
    assert (result.kv_hit_pages, result.restorable_prefix_pages) == (0, [])
    storage.close()


# -- 5. an undersized pool under churn ----------------------------------------------------------


def test_in_an_undersized_pool_every_reported_length_was_written_and_loads_exactly(
    maru_server_factory,
):
    """Sixty 16-page prompts (KV, Mamba state at the node ends 8 and 16, SWA window 2 at
    each) into a server pool that holds a fraction of them: pages are evicted and writes may
    be refused. Then, for every prompt: each restorable length L reported has every KV page
    before L, the state at L and the SWA window ending at L among the writes that succeeded,
    and loading that length gives, for every page reported True, the bytes written."""
    server = maru_server_factory(pool_size="2M")
    hybrid = _mamba_swa()
    mamba, swa = hybrid.sidecars
    storage = _storage(server.url, hybrid, maru_pool_size="1M")
    n, ends = 16, (8, 16)
    prompts, stored, written = [], set(), {}
    for p in range(60):
        keys = _hashes([p * 7919 + t for t in range(n * PAGE)])
        prompts.append(keys)
        idx = slots(hybrid.kv, 0, n)
        pages = random_pages(hybrid.kv, n, 1000 + p)
        fill_bytes(hybrid.kv, idx, pages)
        for key, ok, page in zip(keys, storage.batch_set_v1(keys, idx), pages):
            written[("kv", key)] = page
            if ok:
                stored.add(("kv", key))
        side = {"mamba": [keys[e - 1] for e in ends], "swa": [keys[e - w] for e in ends
                for w in (2, 1)]}  # fmt: skip
        transfers = []
        for s in (mamba, swa):
            sidx = slots(s.pool, 0, len(side[s.name]))
            spages = random_pages(s.pool, len(side[s.name]), 2000 + p * 10 + len(s.name))
            fill_bytes(s.pool, sidx, spages)
            written.update({(s.name, k): pg for k, pg in zip(side[s.name], spages)})
            transfers.append(transfer(s, side[s.name], sidx))
        for name, oks in storage.batch_set_v2(transfers).items():
            stored.update((name, k) for k, ok in zip(side[name], oks) if ok)
    storage.confirm_writes()
    reported = whole = 0
    for keys in prompts:
        result = storage.batch_exists_v2(keys, _probes(hybrid))
        for length in result.restorable_prefix_pages:
            reported += 1
            need = [("kv", k) for k in keys[:length]] + [("mamba", keys[length - 1])]
            need += [("swa", k) for k in keys[max(0, length - 2) : length]]
            assert all(x in stored for x in need), (length, [x for x in need if x not in stored])
        whole += result.kv_hit_pages == n
        if not result.kv_hit_pages:
            continue
        length = result.kv_hit_pages
        dst = slots(hybrid.kv, 20, length)
        kv = storage.batch_get_v1(keys[:length], dst)
        got = read_bytes(hybrid.kv, dst, length)
        assert all(torch.equal(g, written[("kv", k)]) for ok, g, k in zip(kv, got, keys) if ok)
        for s, tail in ((mamba, keys[length - 1 : length]), (swa, keys[max(0, length - 2) :
                        length])):  # fmt: skip
            hits, loaded = _load_side(storage, s, tail)
            assert all(torch.equal(g, written[(s.name, k)]) for ok, g, k in
                       zip(hits, loaded, tail) if ok)  # fmt: skip
    # (premises: some prompts were evicted, some kept, so both branches above ran)
    assert 0 < whole < len(prompts) and reported
    storage.close()


# -- 6. two writers of the same keys at once ----------------------------------------------------


def test_two_instances_writing_the_same_keys_at_once_give_whole_pages_of_one(maru_server):
    """Instances A and B write KV and Mamba states under the same 8 keys at once, with
    different bytes (as if the model were not deterministic). A third instance reads: every
    page reported True is A's page or B's page, whole, never a mix."""
    hybrids = [_mamba_swa() for _ in range(3)]
    nodes = [_storage(maru_server.url, h) for h in hybrids]
    keys = _hashes(list(range(900, 900 + 8 * PAGE)))
    versions: list[dict[str, list[torch.Tensor]]] = []
    for i, hybrid in enumerate(hybrids[:2]):
        kv_pages = random_pages(hybrid.kv, 8, 30 + i)
        states = random_pages(hybrid.sidecars[0].pool, 8, 40 + i)
        fill_bytes(hybrid.kv, slots(hybrid.kv, 0, 8), kv_pages)
        fill_bytes(hybrid.sidecars[0].pool, slots(hybrid.sidecars[0].pool, 0, 8), states)
        versions.append({"kv": kv_pages, "mamba": states})
    start = threading.Barrier(2)
    errors: list[BaseException] = []

    def write(i: int) -> None:
        try:
            node, hybrid = nodes[i], hybrids[i]
            start.wait(timeout=30)
            node.batch_set_v1(keys, slots(hybrid.kv, 0, 8))
            node.batch_set_v2([transfer(hybrid.sidecars[0], keys, slots(hybrid.sidecars[0].pool,
                                                                         0, 8))])  # fmt: skip
            node.confirm_writes()
        except BaseException as exc:  # (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    reader, rh = nodes[2], hybrids[2]
    dst = slots(rh.kv, 10, 8)
    kv = reader.batch_get_v1(keys, dst)
    hits, states = _load_side(reader, rh.sidecars[0], keys, first=10)
    assert kv == [True] * 8 and hits == [True] * 8
    for name, got in (("kv", read_bytes(rh.kv, dst, 8)), ("mamba", states)):
        for i, page in enumerate(got):
            assert any(torch.equal(page, v[name][i]) for v in versions), (name, i)
    for node in nodes:
        node.close()


# -- 7. a logical KV anchor ----------------------------------------------------------------------


def test_a_logical_anchor_alone_proves_no_prefix(maru_server):
    """DeepSeek-V4's KV anchor is a `LogicalHostPool`: it has no bytes, nothing is stored for
    it, so it cannot prove that a prefix was ever written. With nothing stored, neither the
    v1 hit query (what SGLang asks when a request has no pool transfers) nor a v2 query whose
    pools gate nothing (none, or only BLOCK_GROUPS pools) may report a usable prefix. With an
    ALL_PAGES pool with bytes, its pages decide, as before."""
    from sglang.srt.mem_cache.memory_pool_host import LogicalHostPool

    anchor = LogicalHostPool(256, PAGE, layout="page_first_direct")
    blocks = Sidecar("deepseek_v4_c4", make_host_pool(Geometry(layers=1)), "block_groups")
    compressed = Sidecar("deepseek_v4_c1", make_host_pool(Geometry(layers=1)), "all_pages")
    hybrid = Hybrid("v4", anchor, False, [blocks, compressed])
    storage = _storage(maru_server.url, hybrid)
    assert storage.pools["kv"].logical
    keys = _hashes(list(range(700, 700 + 4 * PAGE)))

    assert storage.batch_exists(keys) == 0
    for transfers in ([], None):
        result = storage.batch_exists_v2(keys, transfers)
        assert (result.kv_hit_pages, result.restorable_prefix_pages or []) == (0, [])
    probe = transfer(blocks, ["g0", "g1"], None)
    probe.group_pages, probe.block_pages = 2, 4
    result = storage.batch_exists_v2(keys, [probe])
    assert (result.kv_hit_pages, result.restorable_prefix_pages or []) == (0, [])
    # the compressed pool with bytes gates: nothing stored, nothing usable; then 2 pages
    c1 = transfer(compressed, ["__placeholder__"], None)
    assert storage.batch_exists_v2(keys, [probe, c1]).kv_hit_pages == 0
    idx = slots(compressed.pool, 0, 2)
    fill_bytes(compressed.pool, idx, random_pages(compressed.pool, 2, 50))
    assert storage.batch_set_v2([transfer(compressed, keys[:2], idx)]) == {
        "deepseek_v4_c1": [True, True]
    }
    result = storage.batch_exists_v2(keys, [probe, c1])
    assert (result.kv_hit_pages, result.restorable_prefix_pages) == (2, [1, 2])
    assert PoolHitPolicy(compressed.policy) == PoolHitPolicy.ALL_PAGES
    storage.close()
