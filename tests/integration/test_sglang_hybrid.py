"""MaruStorage's v2 interface (hybrid models' sidecar pools) against the real SGLang 0.5.23
host pools on CPU: `MambaPoolHost`, an MHA pool as sliding-window KV, `DSAIndexerPoolHost` on an
MLA pool. Registered and driven the way `HybridCacheController` drives a backend.

Needs SGLang (`make install` puts it in .venv); skipped without it. The CPU shims in
tests/sglang_cpu replace CUDA-only pieces of SGLang, never anything of ours.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(300)]

import sglang_cpu  # noqa: E402

sglang_cpu.require()

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)

from maru.common.protocol import MsgType  # noqa: E402
from maru_sglang.maru_storage import MaruStorage  # noqa: E402
from sglang_cpu.host_pools import Geometry, make_host_pool, storage_config  # noqa: E402
from sglang_cpu.hybrid_peer import PAGES  # noqa: E402
from sglang_cpu.hybrid_pools import (  # noqa: E402
    Hybrid,
    Sidecar,
    _mamba_pool,
    fill_bytes,
    make_hybrid,
    random_pages,
    read_bytes,
    register,
    slots,
    transfer,
)
from sglang_cpu.p2p import MARU_BACKEND  # noqa: E402


def _storage(url: str, hybrid: Hybrid, local_index: bool = True, **cfg) -> MaruStorage:
    extra = {**MARU_BACKEND, "maru_server_url": url, "maru_pool_size": "32M"}
    extra["maru_local_index"] = local_index
    storage = MaruStorage(storage_config(is_mla=hybrid.is_mla, extra=extra, **cfg), {})
    register(storage, hybrid)
    return storage


def _run_peer(role: str, url: str, seed: int, *rank: int) -> dict:
    proc = subprocess.run(
        [
            sys.executable,
            str(sglang_cpu.SHIM_DIR / "hybrid_peer.py"),
            role,
            url,
            str(seed),
            *map(str, rank),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=sglang_cpu.sglang_env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _store_kv(storage: MaruStorage, hybrid: Hybrid, keys: list[str], seed: int = 1):
    idx = slots(hybrid.kv, 0, len(keys))
    pages = random_pages(hybrid.kv, len(keys), seed)
    fill_bytes(hybrid.kv, idx, pages)
    assert storage.batch_set_v1(keys, idx) == [True] * len(keys)
    return idx, pages


def _store_side(storage, sidecar: Sidecar, keys: list[str], first_slot: int, seed: int):
    idx = slots(sidecar.pool, first_slot, len(keys))
    pages = random_pages(sidecar.pool, len(keys), seed)
    fill_bytes(sidecar.pool, idx, pages)
    assert storage.batch_set_v2([transfer(sidecar, keys, idx)]) == {
        sidecar.name: [True] * len(keys)
    }
    return idx, pages


def _probe(sidecar: Sidecar) -> PoolTransfer:
    """A hit query's transfer: only the window length of its keys matters."""
    return transfer(sidecar, [""] * sidecar.window, None)


def _delete(storage: MaruStorage, pool: str, key: str) -> None:
    assert storage.handler.delete(storage.pools[pool].keys([key])[0])


# -- two processes -----------------------------------------------------------------------------


def test_every_pool_is_shared_across_processes_byte_identical(maru_server):
    """Process 1 stores KV with batch_set_v1 and every sidecar with batch_set_v2; process 2,
    with its own host pools, sees the whole prefix with batch_exists_v2 and loads identical
    bytes into other slots with batch_get_v1 / batch_get_v2."""
    written = _run_peer("writer", maru_server.url, 21)
    assert written["mamba"]["kv"] == PAGES and written["mamba"]["mamba"] == 2
    assert written["swa"]["swa"] == 4  # two windows of 2
    assert written["dsa"]["indexer"] == PAGES
    loaded = _run_peer("reader", maru_server.url, 21)
    half = PAGES // 2
    expected_exists = {
        # a Mamba state exists at the two node ends only: those are the restorable lengths
        "mamba": {"kv_hit_pages": PAGES, "restorable": [half, PAGES]},
        "swa": {"kv_hit_pages": PAGES, "restorable": [half, PAGES]},
        "dsa": {"kv_hit_pages": PAGES, "restorable": list(range(1, PAGES + 1))},
    }
    for kind, want in expected_exists.items():
        got = loaded[kind]
        assert {k: got["exists"][k] for k in want} == want, kind
        assert got["kv"] == {"loaded": PAGES, "identical": PAGES}, kind
    assert loaded["mamba"]["mamba"] == {"loaded": 2, "identical": 2}
    assert loaded["swa"]["swa"] == {"loaded": 4, "identical": 4}
    assert loaded["dsa"]["indexer"] == {"loaded": PAGES, "identical": PAGES}
    assert loaded["dsa"]["pool_stats"]["indexer"]["hits"] == PAGES


def test_tp_ranks_share_only_rank_replicated_pools(maru_server):
    """Rank 0 of a TP=2 server stores; rank 1 (another process, another Maru instance) reads:
    MLA KV and the DSA indexer are the same on every rank and hit; MHA KV, Mamba state and SWA
    KV are TP shards and miss (rank 1 has its own)."""
    _run_peer("writer", maru_server.url, 31, 0, 2)
    loaded = _run_peer("reader", maru_server.url, 31, 1, 2)
    assert loaded["dsa"]["exists"]["kv_hit_pages"] == PAGES
    assert loaded["dsa"]["kv"] == {"loaded": PAGES, "identical": PAGES}
    assert loaded["dsa"]["indexer"] == {"loaded": PAGES, "identical": PAGES}
    for kind in ("mamba", "swa"):
        assert loaded[kind]["exists"]["kv_hit_pages"] == 0, kind
        assert loaded[kind]["kv"]["loaded"] == 0, kind


# -- hit policies ------------------------------------------------------------------------------


def test_missing_mamba_state_shrinks_the_prefix(maru_server):
    hybrid = make_hybrid("mamba")
    mamba = hybrid.sidecars[0]
    storage = _storage(maru_server.url, hybrid)
    keys = [f"m{i}" for i in range(8)]
    _store_kv(storage, hybrid, keys)
    # no state at all: KV alone is not a hit
    result = storage.batch_exists_v2(keys, [_probe(mamba)])
    assert (result.kv_hit_pages, result.restorable_prefix_pages) == (0, [])
    assert result.extra_pool_hit_pages == {"kv": 8}
    _store_side(storage, mamba, [keys[3]], 0, seed=2)  # a node ends at page 4
    _store_side(storage, mamba, [keys[7]], 1, seed=3)  # and at page 8
    result = storage.batch_exists_v2(keys, [_probe(mamba)])
    assert (result.kv_hit_pages, result.restorable_prefix_pages) == (8, [4, 8])
    _delete(storage, "mamba", keys[7])  # the state at 8 is gone: back to 4
    result = storage.batch_exists_v2(keys, [_probe(mamba)])
    assert (result.kv_hit_pages, result.restorable_prefix_pages) == (4, [4])
    assert result.extra_pool_hit_pages == {"kv": 8, "mamba": 4}
    # a KV hole before page 4 cuts it further: nothing restorable
    _delete(storage, "kv", keys[2])
    result = storage.batch_exists_v2(keys, [_probe(mamba)])
    assert (result.kv_hit_pages, result.restorable_prefix_pages) == (0, [])
    storage.close()


def test_swa_window_must_be_complete_at_the_prefix_end(maru_server):
    hybrid = make_hybrid("swa")
    swa = hybrid.sidecars[0]  # window 2
    storage = _storage(maru_server.url, hybrid)
    keys = [f"s{i}" for i in range(6)]
    _store_kv(storage, hybrid, keys)
    _store_side(storage, swa, keys[1:3], 0, seed=4)  # window ending at page 3
    _store_side(storage, swa, keys[4:5], 2, seed=5)  # half a window ending at page 5
    result = storage.batch_exists_v2(keys, [_probe(swa)])
    assert (result.kv_hit_pages, result.restorable_prefix_pages) == (3, [3])
    _store_side(storage, swa, keys[3:4], 3, seed=6)  # completes the windows at 4 and 5
    result = storage.batch_exists_v2(keys, [_probe(swa)])
    assert result.restorable_prefix_pages == [3, 4, 5]
    assert result.kv_hit_pages == 5
    storage.close()


def test_indexer_hole_cuts_the_all_pages_prefix(maru_server):
    hybrid = make_hybrid("dsa")
    indexer = hybrid.sidecars[0]
    storage = _storage(maru_server.url, hybrid)
    keys = [f"d{i}" for i in range(5)]
    kv_idx, _ = _store_kv(storage, hybrid, keys)
    pages = random_pages(indexer.pool, 5, seed=7)
    fill_bytes(indexer.pool, kv_idx, pages)
    assert storage.batch_set_v2([transfer(indexer, keys, kv_idx)]) == {"indexer": [True] * 5}
    _delete(storage, "indexer", keys[3])
    result = storage.batch_exists_v2(keys, [_probe(indexer)])
    assert (result.kv_hit_pages, result.restorable_prefix_pages) == (3, [1, 2, 3])
    assert result.extra_pool_hit_pages == {"kv": 5, "indexer": 3}
    # the controller reads the KV-derived indexer per KV batch and clamps to the shorter
    dst = slots(hybrid.kv, 9, 5)
    assert storage.batch_get_v1(keys, dst) == [True] * 5
    got = storage.batch_get_v2([transfer(indexer, keys, dst)])
    assert got == {"indexer": [True, True, True, False, True]}
    assert all(torch.equal(a, b) for a, b in zip(read_bytes(indexer.pool, dst, 3), pages))
    storage.close()


def test_unregistered_pool_is_never_a_hit(maru_server):
    hybrid = make_hybrid("mamba")
    storage = _storage(maru_server.url, hybrid)
    keys = ["u0", "u1"]
    _store_kv(storage, hybrid, keys)
    ghost = Sidecar("swa", None, "all_pages")
    result = storage.batch_exists_v2(keys, [_probe(ghost)])
    assert result.kv_hit_pages == 0
    assert storage.batch_get_v2([transfer(ghost, keys, slots(hybrid.kv, 0, 2))]) == {
        "swa": [False, False]
    }
    storage.close()


def test_block_groups_report_their_own_verdict_and_never_gate(maru_server):
    """BLOCK_GROUPS (compressed blocks): the pool's own keys in groups; the leading complete
    groups' pages are its verdict, the KV hit stays what KV and the other pools say."""
    hybrid = make_hybrid("mamba")
    blocks = Sidecar("deepseek_v4_c4", make_host_pool(Geometry(layers=1)), "block_groups")
    hybrid.sidecars.append(blocks)
    storage = _storage(maru_server.url, hybrid)
    keys = [f"b{i}" for i in range(8)]
    _store_kv(storage, hybrid, keys)
    _store_side(storage, hybrid.sidecars[0], [keys[7]], 0, seed=8)  # Mamba state at 8
    group_keys = [f"g{i}" for i in range(6)]  # 3 groups of 2 keys, 4 KV pages each
    _store_side(storage, blocks, group_keys, 0, seed=9)
    _delete(storage, "deepseek_v4_c4", group_keys[3])  # the second group is incomplete

    def probe():
        t = transfer(blocks, group_keys, None)
        t.group_pages, t.block_pages = 2, 4
        return [_probe(hybrid.sidecars[0]), t]

    result = storage.batch_exists_v2(keys, probe())
    assert result.kv_hit_pages == 8  # not gated by the block pool
    assert result.extra_pool_hit_pages["deepseek_v4_c4"] == 4  # one complete group
    _delete(storage, "deepseek_v4_c4", group_keys[0])
    result = storage.batch_exists_v2(keys, probe())
    assert result.kv_hit_pages == 8
    assert "deepseek_v4_c4" not in result.extra_pool_hit_pages
    storage.close()


# -- keys, RPCs, ranks -------------------------------------------------------------------------


def test_no_pool_reads_another_pools_pages(maru_server):
    hybrid = make_hybrid("mamba")
    mamba = hybrid.sidecars[0]
    hybrid.sidecars.append(Sidecar("swa", make_host_pool(Geometry()), "trailing_pages"))
    storage = _storage(maru_server.url, hybrid)
    _store_side(storage, mamba, ["x"], 0, seed=10)
    namespaces = {p.namespace for p in storage.pools.values()}
    assert len(namespaces) == 3  # kv, mamba, swa
    assert storage.batch_exists(["x"]) == 0  # the KV pool does not see the Mamba page
    swa = hybrid.sidecars[1]  # same geometry as KV, another pool: its own keys
    assert storage.batch_get_v2([transfer(swa, ["x"], slots(swa.pool, 0, 1))]) == {"swa": [False]}
    # another Mamba geometry (conv dim 32): a miss, never a wrong-sized page
    other = Hybrid(
        "mamba",
        make_host_pool(Geometry()),
        False,
        [Sidecar("mamba", _mamba_pool(32), "trailing_pages")],
    )
    reader = _storage(maru_server.url, other)
    side = other.sidecars[0]
    assert reader.pools["mamba"].namespace != storage.pools["mamba"].namespace
    assert reader.batch_get_v2([transfer(side, ["x"], slots(side.pool, 0, 1))]) == {
        "mamba": [False]
    }
    reader.close()
    storage.close()


def test_one_metadata_rpc_per_batch_across_pools(maru_server):
    hybrid = make_hybrid("mamba")
    hybrid.sidecars.append(
        Sidecar("swa", make_host_pool(Geometry(layers=2)), "trailing_pages", window=2)
    )
    storage = _storage(maru_server.url, hybrid)
    sent: list[MsgType] = []
    original = storage.handler._s.request

    def counting(msg_type, body):
        sent.append(msg_type)
        return original(msg_type, body)

    storage.handler._s.request = counting
    keys = [f"r{i}" for i in range(4)]
    _store_kv(storage, hybrid, keys)
    mamba, swa = hybrid.sidecars
    sent.clear()
    transfers = [
        transfer(mamba, keys[-1:], slots(mamba.pool, 0, 1)),
        transfer(swa, keys[-2:], slots(swa.pool, 0, 2)),
    ]
    assert storage.batch_set_v2(transfers) == {"mamba": [True], "swa": [True, True]}
    assert sent == [MsgType.REGISTER_KV]
    sent.clear()
    result = storage.batch_exists_v2(keys, [_probe(mamba), _probe(swa)])
    assert result.kv_hit_pages == 4 and sent == []  # on the server's node: the local index
    sent.clear()
    transfers = [
        transfer(mamba, keys[-1:], slots(mamba.pool, 5, 1)),
        transfer(swa, keys[-2:], slots(swa.pool, 5, 2)),
    ]
    reads = []
    read = storage.handler.read
    storage.handler.read = lambda keys, *a, **kw: reads.append(len(keys)) or read(keys, *a, **kw)
    assert storage.batch_get_v2(transfers) == {"mamba": [True], "swa": [True, True]}
    assert MsgType.LOOKUP_KV not in sent and MsgType.REGISTER_KV not in sent  # (likewise)
    assert reads == [1, 2]  # each pool: probe, copy and proof in one C call
    storage.close()
    # without the local index: one request for all pools, each way
    storage = _storage(maru_server.url, hybrid, local_index=False)
    original = storage.handler._s.request
    storage.handler._s.request = counting
    sent.clear()
    result = storage.batch_exists_v2(keys, [_probe(mamba), _probe(swa)])
    assert result.kv_hit_pages == 4 and sent == [MsgType.EXISTS]
    sent.clear()
    assert storage.batch_get_v2(transfers) == {"mamba": [True], "swa": [True, True]}
    assert sent.count(MsgType.LOOKUP_KV) == 1 and MsgType.REGISTER_KV not in sent
    storage.close()


def test_a_changed_page_is_a_miss_in_a_read_of_several_pools(maru_server):
    """`batch_get_v2` of several pools on the server's node (each pool one `MaruHandler.read`):
    with `maru_checksums`, a page whose bytes changed in the pool after it was sealed is a
    miss, counted for its pool; every other page of both pools is a hit with its bytes."""
    from .workers import flip_byte

    hybrid = make_hybrid("mamba")
    hybrid.sidecars.append(
        Sidecar("swa", make_host_pool(Geometry(layers=2)), "trailing_pages", window=2)
    )
    mamba, swa = hybrid.sidecars
    extra = {**MARU_BACKEND, "maru_server_url": maru_server.url, "maru_pool_size": "32M"}
    storage = MaruStorage(storage_config(extra={**extra, "maru_checksums": True}), {})
    register(storage, hybrid)
    assert storage.handler.reads_locally
    keys = [f"flip{i}" for i in range(4)]
    _, swa_pages = _store_side(storage, swa, keys, 0, seed=31)
    _, states = _store_side(storage, mamba, keys[-1:], 0, seed=32)
    assert storage.confirm_writes() == 0
    flip_byte(storage.handler, storage.pools["swa"].keys([keys[1]])[0], at=7)
    swa_back, state_back = slots(swa.pool, 8, 4), slots(mamba.pool, 5, 1)
    back = [transfer(swa, keys, swa_back), transfer(mamba, keys[-1:], state_back)]
    assert storage.batch_get_v2(back) == {"swa": [True, False, True, True], "mamba": [True]}
    got = read_bytes(swa.pool, swa_back, 4)
    assert [torch.equal(got[i], swa_pages[i]) for i in (0, 2, 3)] == [True] * 3
    assert torch.equal(read_bytes(mamba.pool, state_back, 1)[0], states[0])
    pools = storage.counters["pools"]
    assert (pools["swa"]["checksum_mismatches"], pools["mamba"]["checksum_mismatches"]) == (1, 0)
    storage.close()


def test_a_large_pool_is_registered_while_the_next_pool_is_copied(maru_server, monkeypatch):
    """batch_set_v2 seals a pool's run of at least PIPELINE_MIN_PAGES pages as soon as it is
    copied: its registration is in flight while the next pool is copied, and the server gets
    a run of one length (a uniform batch). The small pools after it go in one registration at
    the end; every page reads back byte-identical."""
    from maru_sglang.maru_storage import PIPELINE_MIN_PAGES

    hybrid = make_hybrid("mamba")
    hybrid.sidecars.append(
        Sidecar("swa", make_host_pool(Geometry(layers=2)), "trailing_pages", window=2)
    )
    mamba, swa = hybrid.sidecars
    storage = _storage(maru_server.url, hybrid)
    events: list[str] = []
    original = storage.handler._s.request

    def sending(msg_type, body):
        events.append(f"send {MsgType(msg_type).name} {len(body.get('keys', []))}")
        return original(msg_type, body)

    storage.handler._s.request = sending
    # which pool a copy the write verb begins (in C) is of: its part sizes tell
    import maru.client.writes as writes

    real_start = writes._c_copy_values_start
    names = {tuple(storage.pools[n].sizes.tolist()): n for n in ("mamba", "swa")}

    def copying(targets, buffers, sizes, *args):
        events.append(f"copy {names[tuple(sizes.tolist())]}")
        return real_start(targets, buffers, sizes, *args)

    monkeypatch.setattr(writes, "_c_copy_values_start", copying)
    n = PIPELINE_MIN_PAGES + 8
    keys = [f"big{i}" for i in range(n)]
    swa_idx = slots(swa.pool, 0, n)
    swa_pages = random_pages(swa.pool, n, 5)
    fill_bytes(swa.pool, swa_idx, swa_pages)
    state_idx = slots(mamba.pool, 0, 1)
    state = random_pages(mamba.pool, 1, 6)
    fill_bytes(mamba.pool, state_idx, state)
    transfers = [transfer(swa, keys, swa_idx), transfer(mamba, keys[-1:], state_idx)]
    assert storage.batch_set_v2(transfers) == {"swa": [True] * n, "mamba": [True]}
    assert events == ["copy swa", f"send REGISTER_KV {n}", "copy mamba", "send REGISTER_KV 1"]
    swa_back, state_back = slots(swa.pool, n, n), slots(mamba.pool, 1, 1)
    back = [transfer(swa, keys, swa_back), transfer(mamba, keys[-1:], state_back)]
    assert storage.batch_get_v2(back) == {"swa": [True] * n, "mamba": [True]}
    got = read_bytes(swa.pool, swa_back, n) + read_bytes(mamba.pool, state_back, 1)
    assert all(torch.equal(a, b) for a, b in zip(got, swa_pages + state, strict=True))
    storage.close()


def test_rank_replicated_pools_are_written_by_the_writer_rank_only(maru_server):
    rank1_pools = make_hybrid("dsa")
    rank1_pools.sidecars.append(Sidecar("mamba", _mamba_pool(), "trailing_pages"))
    rank1 = _storage(maru_server.url, rank1_pools, tp_rank=1, tp_size=2)
    assert not rank1.storage_config.is_storage_writer
    assert rank1.pools["indexer"].replicated and not rank1.pools["mamba"].replicated
    indexer, mamba = rank1_pools.sidecars
    keys = ["w0", "w1"]
    idx = slots(rank1_pools.kv, 0, 2)
    results = rank1.batch_set_v2(
        [transfer(indexer, keys, idx), transfer(mamba, keys[-1:], slots(mamba.pool, 0, 1))]
    )
    assert results == {"indexer": [True, True], "mamba": [True]}
    pools = rank1.get_stats().maru["pools"]
    assert "indexer" not in pools  # nothing copied, nothing registered: rank 0 writes these
    assert pools["mamba"]["pages_written"] == 1  # Mamba state is a TP shard: every rank's own
    rank0_pools = make_hybrid("dsa")
    rank0 = _storage(maru_server.url, rank0_pools, tp_rank=0, tp_size=2)
    assert rank0.storage_config.is_storage_writer
    pages = random_pages(indexer.pool, 2, seed=11)
    fill_bytes(rank0_pools.sidecars[0].pool, idx, pages)
    assert rank0.batch_set_v2([transfer(rank0_pools.sidecars[0], keys, idx)]) == {
        "indexer": [True, True]
    }
    assert rank0.confirm_writes() == 0  # registered: another instance finds them from now on
    dst = slots(rank1_pools.kv, 4, 2)
    assert rank1.batch_get_v2([transfer(indexer, keys, dst)]) == {"indexer": [True, True]}
    assert all(torch.equal(a, b) for a, b in zip(read_bytes(indexer.pool, dst, 2), pages))
    rank0.close()
    rank1.close()


def test_mamba_with_slot_side_state_is_stored_whole_page(maru_server):
    """A Mamba pool with registered slot side states has no zero-copy description
    (`get_page_buffer_meta` raises): its pages go through get_data_page /
    set_from_flat_data_page, still byte-identical, still one RPC per batch."""
    pools = [_side_state_pool(), _side_state_pool()]
    storages = _mamba_storages(maru_server.url, pools)
    assert all(storage.pools["mamba"].whole_page for storage in storages)
    side = Sidecar("mamba", pools[0], "trailing_pages")
    _, pages = _store_side(storages[0], side, ["a", "b"], 3, seed=12)
    assert storages[0].confirm_writes() == 0
    reader_side = Sidecar("mamba", pools[1], "trailing_pages")
    dst = slots(pools[1], 7, 2)
    assert storages[1].batch_get_v2([transfer(reader_side, ["a", "b"], dst)]) == {
        "mamba": [True, True]
    }
    assert all(torch.equal(a, b) for a, b in zip(read_bytes(pools[1], dst, 2), pages))
    for s in storages:
        s.close()


def _side_state_pool(side_dtype: torch.dtype = torch.int32):
    """A Mamba pool with a slot side state of `side_dtype`: no zero-copy description, stored
    whole-page."""
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    info = MambaStateBufferInfo(
        temporal=torch.zeros(2, 12, 4, 8, dtype=torch.float32),
        conv=(torch.zeros(2, 12, 3, 16, dtype=torch.bfloat16),),
        extra_checkpoint_buffers=(torch.zeros(12, 5, dtype=side_dtype),),
    )
    return MambaPoolHost(info, 2, 0, device_capacity=12, pin_memory=False, layout="page_first")


def _mamba_storages(url: str, pools: list) -> list:
    """A MaruStorage per Mamba pool of `pools` (its one sidecar, trailing pages)."""
    return [
        _storage(
            url,
            Hybrid(
                "mamba",
                make_host_pool(Geometry()),
                False,
                [Sidecar("mamba", pool, "trailing_pages")],
            ),
        )
        for pool in pools
    ]


def test_whole_page_pools_write_back_and_invalidate_in_software_coherence(maru_server_factory):
    """A whole-page pool's pages are copied by a plain memmove (no copy loop, without
    `maru_checksums`): under `maru-server --coherence software` the writer writes back every
    line of every page before the registration, and the reader invalidates every line of
    every page before it copies (`read_many`). (Before: the write's lines were not written
    back, 0 lines, and stayed dirty in the writer's cache past the publication.)"""
    from maru.client.coherence import lines_flushed

    url = maru_server_factory(pool_size="256M", extra_args=["--coherence", "software"]).url
    pools = [_side_state_pool(), _side_state_pool()]
    storages = _mamba_storages(url, pools)
    for storage in storages:
        assert storage.pools["mamba"].whole_page
        assert storage.handler.coherence == "software"
    page_lines = -(-storages[0].pools["mamba"].page_bytes // 64)  # (pages start on a chunk)
    try:
        before = lines_flushed()
        _, pages = _store_side(storages[0], Sidecar("mamba", pools[0], "trailing_pages"),
                               ["a", "b"], 3, seed=12)  # fmt: skip
        assert storages[0].confirm_writes() == 0
        written = lines_flushed()[0] - before[0]
        assert written == 2 * page_lines
        dst = slots(pools[1], 7, 2)
        before = lines_flushed()
        side = Sidecar("mamba", pools[1], "trailing_pages")
        got = storages[1].batch_get_v2([transfer(side, ["a", "b"], dst)])
        assert got == {"mamba": [True, True]}
        assert lines_flushed()[1] - before[1] >= 2 * page_lines
        assert all(torch.equal(a, b) for a, b in zip(read_bytes(pools[1], dst, 2), pages))
    finally:
        for s in storages:
            s.close()


def test_mamba_states_of_another_element_type_are_a_miss(maru_server):
    """A Mamba pool's `dtype` is its conv state's; the SSM (temporal) state has its own
    (SGLANG_MAMBA_SSM_DTYPE or the model's `mamba_ssm_dtype`), and slot side states theirs.
    A bf16 and an fp16 SSM state are as long, and so are int32 and fp32 side states: a run
    of the other type misses (it read the other's states as hits), the same type hits."""
    cases = {
        "ssm": (
            _mamba_pool(temporal_dtype=torch.bfloat16),
            _mamba_pool(temporal_dtype=torch.float16),
            _mamba_pool(temporal_dtype=torch.bfloat16),
        ),
        "side": (
            _side_state_pool(torch.int32),
            _side_state_pool(torch.float32),
            _side_state_pool(torch.int32),
        ),
    }
    for case, pools in cases.items():
        storages = _mamba_storages(maru_server.url, list(pools))
        writer, other, same = storages
        assert writer.pools["mamba"].page_bytes == other.pools["mamba"].page_bytes, case
        keys = [f"{case}-a", f"{case}-b"]
        _, pages = _store_side(writer, Sidecar("mamba", pools[0], "trailing_pages"), keys, 1, 4)
        assert writer.confirm_writes() == 0
        for storage, pool, hits in ((other, pools[1], False), (same, pools[2], True)):
            side = Sidecar("mamba", pool, "trailing_pages")
            dst = slots(pool, 5, 2)
            got = storage.batch_get_v2([transfer(side, keys, dst)])
            assert got == {"mamba": [hits, hits]}, case
        assert all(torch.equal(a, b) for a, b in zip(read_bytes(pools[2], dst, 2), pages)), case
        for s in storages:
            s.close()


# -- failure injection, stats, clear -----------------------------------------------------------


def test_sglang_failure_injection_runs_cleanly(maru_server, monkeypatch):
    """SGLang's own injector (random delays and failures before every call) around MaruStorage:
    no exception escapes, a failed call reads as misses, and every hit is the stored bytes."""
    from sglang.srt.mem_cache.hicache_storage import (
        HiCacheStorageFailureInjector,
        _maybe_wrap_hicache_storage_failure_injector,
    )

    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", "0.002")
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.3")
    hybrid = make_hybrid("mamba")
    mamba = hybrid.sidecars[0]
    backend = _maybe_wrap_hicache_storage_failure_injector(_storage(maru_server.url, hybrid))
    assert isinstance(backend, HiCacheStorageFailureInjector)
    # The injector draws from an unseeded per-thread Random: seed it, or one run in ~250
    # fails every get and the test reads a lucky streak as a broken store.
    monkeypatch.setattr(
        HiCacheStorageFailureInjector._thread_local, "random", random.Random(11), raising=False
    )
    rng = random.Random(5)
    stored: dict[str, torch.Tensor] = {}
    outcomes = {"hit": 0, "miss": 0}
    for step in range(40):
        key = f"f{rng.randrange(12)}"
        if rng.random() < 0.5:
            idx = slots(mamba.pool, 0, 1)
            page = random_pages(mamba.pool, 1, seed=100 + step)
            fill_bytes(mamba.pool, idx, page)
            kv_idx = slots(hybrid.kv, 0, 1)
            if backend.batch_set_v1([key], kv_idx) == [True] and key not in stored:
                ok = backend.batch_set_v2([transfer(mamba, [key], idx)])["mamba"]
                if ok == [True]:
                    stored[key] = page[0]
        else:
            result = backend.batch_exists_v2([key], [_probe(mamba)])
            dst = slots(mamba.pool, 9, 1)
            got = backend.batch_get_v2([transfer(mamba, [key], dst)])["mamba"]
            if got == [True]:
                assert key in stored and torch.equal(read_bytes(mamba.pool, dst, 1)[0], stored[key])
                outcomes["hit"] += 1
            else:
                outcomes["miss"] += 1
            assert result.kv_hit_pages in (0, 1)
    assert outcomes["hit"] and outcomes["miss"], outcomes
    backend.close()


def test_stats_are_per_pool(maru_server):
    hybrid = make_hybrid("mamba")
    mamba = hybrid.sidecars[0]
    storage = _storage(maru_server.url, hybrid)
    keys = ["t0", "t1", "t2"]
    _store_kv(storage, hybrid, keys)
    _store_side(storage, mamba, keys[-1:], 0, seed=13)
    storage.batch_get_v2([transfer(mamba, ["t2", "nope"], slots(mamba.pool, 4, 2))])
    stats = storage.get_stats()
    pools = stats.maru["pools"]
    kv_bytes, mamba_bytes = storage.pools["kv"].page_bytes, storage.pools["mamba"].page_bytes
    assert pools["kv"]["pages_written"] == 3 and pools["kv"]["bytes_written"] == 3 * kv_bytes
    assert pools["mamba"]["pages_written"] == 1
    assert (pools["mamba"]["hits"], pools["mamba"]["misses"]) == (1, 1)
    assert pools["mamba"]["bytes_read"] == mamba_bytes
    assert stats.maru["pages_written"] == 4 and stats.maru["hits"] == 1
    assert stats.backup_pgs == [3, 1] and stats.prefetch_pgs == [2]
    storage.close()


def test_clear_empties_every_pool_of_this_model_only(maru_server):
    mine, theirs = make_hybrid("mamba"), make_hybrid("mamba")
    a = _storage(maru_server.url, mine)
    b = _storage(maru_server.url, theirs, model="another-model")
    for storage, hybrid in ((a, mine), (b, theirs)):
        _store_kv(storage, hybrid, ["c0", "c1"])
        _store_side(storage, hybrid.sidecars[0], ["c1"], 0, seed=14)
    a.clear()
    assert a.batch_exists_v2(["c0", "c1"], [_probe(mine.sidecars[0])]).kv_hit_pages == 0
    assert a.handler.batch_exists(a.pools["mamba"].keys(["c1"])) == [False]
    assert b.batch_exists_v2(["c0", "c1"], [_probe(theirs.sidecars[0])]).kv_hit_pages == 2
    a.close()
    b.close()


def test_pool_names_cover_sglang(maru_server):
    """Every PoolName SGLang 0.5.23 defines registers (any host pool class that describes its
    pages), each in a namespace of its own."""
    storage = _storage(maru_server.url, make_hybrid("mamba"))
    pool = make_host_pool(Geometry(layers=1))
    for name in PoolName:
        if name != PoolName.KV:
            storage.register_mem_host_pool_v2(pool, name)
    assert set(storage.pools) >= {str(n) for n in PoolName}
    assert len({p.namespace for p in storage.pools.values()}) == len(storage.pools)
    assert {p.value for p in PoolHitPolicy} == {"all_pages", "trailing_pages", "block_groups"}
    storage.close()


def test_draft_pages_of_another_draft_model_are_a_miss(maru_server):
    """A speculative draft pool's pages are computed by the draft model, which the served
    (target) model name does not name: two servers of one target with different drafts of one
    geometry (two EAGLE heads) wrote draft pages of one length under one key, each reading
    the other's as hits. The draft model is in the namespace now; the same draft still hits."""
    from sglang.srt.runtime_context import get_context

    draft = make_host_pool(Geometry(layers=1))
    sidecar = Sidecar("draft", draft, "all_pages", from_kv=True)
    keys = ["d0", "d1"]

    def storage_with(path: str) -> MaruStorage:
        with get_context().override_server_args(
            speculative_algorithm="EAGLE3", speculative_draft_model_path=path
        ):
            storage = _storage(maru_server.url, make_hybrid("mamba"))
            storage.register_mem_host_pool_v2(draft, PoolName.DRAFT)
        return storage

    writer = storage_with("/models/eagle3-a")
    _, pages = _store_side(writer, sidecar, keys, 0, seed=21)
    writer.confirm_writes()
    other, same = storage_with("/models/eagle3-b"), storage_with("/models/eagle3-a")
    dst = slots(draft, 4, len(keys))
    assert other.batch_get_v2([transfer(sidecar, keys, dst)]) == {"draft": [False, False]}
    assert same.batch_get_v2([transfer(sidecar, keys, dst)]) == {"draft": [True, True]}
    assert all(torch.equal(x, y) for x, y in zip(read_bytes(draft, dst, len(keys)), pages))
    for storage in (writer, other, same):
        storage.close()
