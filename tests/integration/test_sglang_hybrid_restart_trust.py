"""MaruStorage's v2 interface (hybrid models) across evictions and `maru-server` restarts: a
page `batch_get_v2` reports True, in any pool, holds the bytes written under its key in that
pool, or it is a miss; never another instance's bytes, never another pool's.

SGLang's real hybrid host pools on CPU: an MHA KV anchor (v1, as `HybridCacheController`
reads KV first), a sliding-window MHA pool (TRAILING_PAGES, window 2; copied by pointers) and a
Mamba pool with a slot side state (TRAILING_PAGES, window 1; no zero-copy description, so
copied whole-page through `read_many` / `PoolIO.copy_in`). Between `batch_exists_v2` and
`batch_get_v2`, during a `batch_get_v2` copy and during a write-behind `batch_set_v2`, the
sidecar pools' keys are deleted or evicted, or the server is SIGKILLed and started again with
the same arguments (restored, or `--no-restore`); another instance then writes values of 0xEE
bytes into the places the old pages lay. Every page reported loaded is compared byte for byte
with what was written (the pattern of test_sglang_restart_trust.py, for v1).
"""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(120)]

import sglang_cpu  # noqa: E402

sglang_cpu.require()

import torch  # noqa: E402

import maru.client.writes as writes_module  # noqa: E402
from maru_sglang.maru_storage import MaruStorage  # noqa: E402
from maru_sglang.pools import PoolIO  # noqa: E402
from pool_places import OtherInstance  # noqa: E402
from pool_places import places as pool_places  # noqa: E402
from sglang_cpu.host_pools import Geometry, make_host_pool, storage_config  # noqa: E402
from sglang_cpu.hybrid_pools import (  # noqa: E402
    Hybrid,
    Sidecar,
    fill_bytes,
    random_pages,
    read_bytes,
    register,
    slots,
    transfer,
)
from sglang_cpu.p2p import MARU_BACKEND  # noqa: E402

POOL = 8 << 20  # the server's pool: small, so that another instance's writes evict ours
N = 8  # KV pages per prompt
SIDECARS = ("swa", "mamba")
Place = tuple[str, int, int]  # (pool file, offset, bytes)


def _side_state_mamba() -> Any:
    """A `MambaPoolHost` with a slot side state: `get_page_buffer_meta` raises, so MaruStorage
    copies its pages whole-page (`PoolIO.copy_in` / `copy_out` through `read_many`)."""
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    info = MambaStateBufferInfo(
        temporal=torch.zeros(2, 12, 4, 8, dtype=torch.float32),
        conv=(torch.zeros(2, 12, 3, 16, dtype=torch.bfloat16),),
        extra_checkpoint_buffers=(torch.zeros(12, 5, dtype=torch.int32),),
    )
    return MambaPoolHost(info, 2, 0, device_capacity=12, pin_memory=False, layout="page_first")


def _hybrid() -> Hybrid:
    """KV + a sliding-window pool (pointer copies) + a whole-page Mamba pool."""
    swa = Sidecar("swa", make_host_pool(Geometry(layers=2, head_dim=8)), "trailing_pages", 2)
    mamba = Sidecar("mamba", _side_state_mamba(), "trailing_pages", 1)
    return Hybrid("swa+mamba", make_host_pool(Geometry()), False, [swa, mamba])


class _Node:
    """One instance: a MaruStorage over its own hybrid host pools."""

    def __init__(self, url: str, **extra: Any):
        self.hybrid = _hybrid()
        cfg = {**MARU_BACKEND, "maru_server_url": url, "maru_pool_size": "2M", **extra}
        self.s = MaruStorage(storage_config(extra=cfg), {})
        register(self.s, self.hybrid)
        self.side = {c.name: c for c in self.hybrid.sidecars}
        assert self.s.pools["mamba"].whole_page and not self.s.pools["swa"].whole_page

    def close(self) -> None:
        self.s.close()


def _side_keys(keys: list[str]) -> dict[str, list[str]]:
    """Each sidecar's stored keys: a window at every page (swa), a state at the node ends (the
    middle and the end, Mamba)."""
    return {"swa": list(keys), "mamba": [keys[N // 2 - 1], keys[-1]]}


def _fill(node: _Node, keys: list[str], seed: int) -> tuple[dict[str, Any], dict[str, list]]:
    """Random pages into host pages 0.. of every pool: (host indices, pages) per pool."""
    idx, pages = {}, {}
    idx["kv"], pages["kv"] = slots(node.hybrid.kv, 0, N), random_pages(node.hybrid.kv, N, seed)
    fill_bytes(node.hybrid.kv, idx["kv"], pages["kv"])
    for name, side_keys in _side_keys(keys).items():
        pool = node.side[name].pool
        idx[name] = slots(pool, 0, len(side_keys))
        pages[name] = random_pages(pool, len(side_keys), seed * 10 + len(name))
        fill_bytes(pool, idx[name], pages[name])
    return idx, pages


def _side_transfers(node: _Node, keys: list[str], idx: dict[str, Any], order=SIDECARS) -> list:
    sk = _side_keys(keys)
    return [transfer(node.side[n], sk[n], idx[n]) for n in order]


def _write(node: _Node, keys: list[str], seed: int) -> dict[str, list]:
    """KV with `batch_set_v1`, the sidecars with one `batch_set_v2` (write-behind, then
    confirmed); the pages written, per pool."""
    idx, pages = _fill(node, keys, seed)
    assert node.s.batch_set_v1(keys, idx["kv"]) == [True] * N
    got = node.s.batch_set_v2(_side_transfers(node, keys, idx))
    assert got == {n: [True] * len(v) for n, v in _side_keys(keys).items()}
    assert node.s.confirm_writes() == 0
    return pages


def _get(node: _Node, keys: list[str], expected: dict[str, list]) -> dict[str, list[bool]]:
    """KV with `batch_get_v1`, then the sidecars with one `batch_get_v2` (SGLang's order), into
    host pages 12.. (zeroed first). Every page reported True, in any pool, must hold exactly
    the bytes written under its key in that pool (asserted here); the results per pool."""
    dst = {"kv": slots(node.hybrid.kv, 12, N)}
    for name, sk in _side_keys(keys).items():
        dst[name] = slots(node.side[name].pool, 12, len(sk))
    for name, d in dst.items():
        pool = node.hybrid.kv if name == "kv" else node.side[name].pool
        fill_bytes(pool, d, [torch.zeros_like(p) for p in expected[name]])
    results = {"kv": node.s.batch_get_v1(keys, dst["kv"])}
    results.update(node.s.batch_get_v2(_side_transfers(node, keys, dst)))
    for name, got in results.items():
        pool = node.hybrid.kv if name == "kv" else node.side[name].pool
        loaded = read_bytes(pool, dst[name], len(got))
        wrong = [i for i, (hit, a, b) in enumerate(zip(got, loaded, expected[name])) if hit and
                 not torch.equal(a, b)]  # fmt: skip
        assert wrong == [], f"pool {name}: pages {wrong} reported loaded with other bytes"
    return results


def _exists(node: _Node, keys: list[str]) -> tuple[int, list[int]]:
    """`batch_exists_v2` as the controller asks it: (kv_hit_pages, restorable lengths)."""
    probes = [transfer(c, [""] * c.window, None) for c in node.hybrid.sidecars]
    r = node.s.batch_exists_v2(keys, probes)
    return r.kv_hit_pages, r.restorable_prefix_pages


def _stored_keys(node: _Node, keys: list[str], pools=("kv", *SIDECARS)) -> list[str]:
    """The stored (namespaced) keys of `pools`' pages."""
    sk = {"kv": keys, **_side_keys(keys)}
    return [k for p in pools for k in node.s.pools[p].keys(sk[p])]


def _where(node: _Node, keys: list[str], pools=("kv", *SIDECARS)) -> list[Place | None]:
    """Where each page of `pools` lies in the pool file, with its size; None for a miss."""
    h, out = node.s.handler, []
    sk = {"kv": keys, **_side_keys(keys)}
    for p in pools:
        size = node.s.pools[p].page_bytes
        at = pool_places(h, node.s.pools[p].keys(sk[p]))
        out += [None if place is None else (*place, size) for place in at]
    return out


def _other(url: str, node: _Node) -> OtherInstance:
    """Another instance writing one-chunk values: a run of them covers a page of any pool (a
    page starts on a chunk)."""
    chunk = node.s.handler.get_chunk_size()
    return OtherInstance(url, chunk, chunk)


def _misses(keys: list[str]) -> dict[str, list[bool]]:
    return {"kv": [False] * N, **{n: [False] * len(v) for n, v in _side_keys(keys).items()}}


def _hits(keys: list[str]) -> dict[str, list[bool]]:
    return {"kv": [True] * N, **{n: [True] * len(v) for n, v in _side_keys(keys).items()}}


# -- 1. sidecar pages evicted or deleted in SGLang's prefetch gap -----------------------------


@pytest.mark.parametrize("how", ["sidecars_deleted", "all_evicted"])
def test_sidecar_pages_gone_between_exists_and_get_are_misses(maru_server_factory, how):
    """Writer A stored 8 KV pages, a swa window at every page and Mamba states at pages 4 and
    8; reader B's `batch_exists_v2` counted all 8 (restorable 4 and 8). Before B's get, the
    swa and Mamba pages are deleted (the KV pages kept), or nothing is deleted; another
    instance fills the pool until every swa and Mamba page (and, `all_evicted`, every KV page)
    holds its bytes. B's `batch_get_v2` reports every swa and Mamba page False (none True with
    0xEE, none with a KV page's bytes); any KV page reported True holds its own bytes; the
    next `batch_exists_v2` restores nothing. Written again, every page of every pool loads."""
    server = maru_server_factory(pool_size="8M")
    a, b = _Node(server.url), _Node(server.url, maru_local_index=False)
    other = _other(server.url, a)
    try:
        keys = [f"gap-{i}" for i in range(N)]
        pages = _write(a, keys, seed=1)
        pools = SIDECARS if how == "sidecars_deleted" else ("kv", *SIDECARS)
        places = _where(a, keys, pools)
        a.close()  # (its region goes back: the other instance may get it)
        assert _exists(b, keys) == (N, [N // 2, N])
        if how == "sidecars_deleted":
            doomed = _stored_keys(b, keys, SIDECARS)
            assert b.s.handler.batch_delete(doomed) == [True] * len(doomed)
        assert other.write(places, 4 * POOL // other.size, "gap") == [True] * len(places)
        got = _get(b, keys, pages)
        assert {n: got[n] for n in SIDECARS} == {n: _misses(keys)[n] for n in SIDECARS}
        if how == "all_evicted":
            assert got["kv"] == [False] * N
        assert _exists(b, keys)[1] == []
        assert other.wrong() == []
        a = _Node(server.url)
        again = _write(a, keys, seed=1)
        assert _exists(b, keys) == (N, [N // 2, N])
        assert _get(b, keys, again) == _hits(keys)
    finally:
        other.close()
        a.close()
        b.close()


@pytest.mark.parametrize("gone", SIDECARS, ids=["swa_gone", "mamba_gone"])
def test_one_pool_gone_between_exists_and_get_misses_only_that_pool(maru_server_factory, gone):
    """As above, but only one sidecar pool's pages are deleted, and their chunks are reused
    (the writer's own later values of 0xEE bytes, in its region) before B's get. B's
    `batch_get_v2` (no local index: both pools in one `read_many`, one lookup) reports that
    pool's pages False and the other pool's True with their own bytes, and every KV page
    True: one pool's misses never spill into another's results, nor its hits into them; the
    next `batch_exists_v2` restores nothing (every length needs both pools)."""
    server = maru_server_factory(pool_size="8M")
    a, b = _Node(server.url), _Node(server.url, maru_local_index=False)
    try:
        keys = [f"one-{i}" for i in range(N)]
        pages = _write(a, keys, seed=7)
        places = _where(a, keys, (gone,))
        assert _exists(b, keys) == (N, [N // 2, N])
        doomed = _stored_keys(b, keys, (gone,))
        assert b.s.handler.batch_delete(doomed) == [True] * len(doomed)
        chunk = a.s.handler.get_chunk_size()  # (A's own handler: its freed chunks are reused)
        reuse = OtherInstance(server.url, chunk, chunk, handler=a.s.handler)
        assert reuse.write(places, 2048, "reuse") == [True] * len(places)
        got = _get(b, keys, pages)
        want = _hits(keys)
        want[gone] = _misses(keys)[gone]
        assert got == want
        assert _exists(b, keys)[1] == []
        assert reuse.wrong() == []
    finally:
        a.close()
        b.close()


# -- 2. a restart in the gap, during a get's copy, during a write-behind set ------------------


@pytest.mark.parametrize("no_restore", [False, True], ids=["restored", "no_restore"])
def test_a_restart_between_exists_and_get_v2_loads_only_own_bytes(maru_server_factory, no_restore):
    """B counted A's pages in every pool (local index); the server is SIGKILLed and started
    again, and another instance writes until every old page of every pool holds its bytes (a
    new generation) or 512 values (restored). B's gets load each page with its own bytes or
    report it False: restored, every page of every pool; a new generation, none, and
    `batch_exists_v2` finds nothing."""
    server = maru_server_factory(pool_size="8M")
    a, b = _Node(server.url), _Node(server.url)
    try:
        keys = [f"restart-gap-{i}" for i in range(N)]
        pages = _write(a, keys, seed=2)
        places = _where(a, keys)
        assert _exists(b, keys) == (N, [N // 2, N])
        assert b.s.handler.reads_locally
        server.kill_and_start(no_restore)
        other = _other(server.url, a)
        try:
            rewritten = other.write(places if no_restore else [None], 512, "gap")
            if no_restore:
                assert rewritten == [True] * len(places)
            assert _get(b, keys, pages) == (_misses(keys) if no_restore else _hits(keys))
            assert _exists(b, keys) == ((0, []) if no_restore else (N, [N // 2, N]))
            assert other.wrong() == []
        finally:
            other.close()
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("local", [False, True], ids=["requests", "local_index"])
@pytest.mark.parametrize("no_restore", [False, True], ids=["restored", "no_restore"])
def test_a_restart_during_a_get_v2_copy_is_a_miss(maru_server_factory, no_restore, local,
                                                  monkeypatch):  # fmt: skip
    """B's `batch_get_v2` of swa and Mamba is in its copy (`PoolIO.copy_out`, in `read_many`,
    its lookup leased) when the server is SIGKILLed and started again; another instance
    deletes the sidecar keys (restored: no lease holds them) and fills the pool until every
    sidecar page holds its bytes, all before the copy reads them. `requests` (no local index):
    both pools are in that one `read_many`, every page False. `local_index`: swa was read
    (and proven) by its own `read` before; only the whole-page Mamba pool goes through
    `read_many`: swa True with its own bytes, Mamba False. The next get loads no sidecar page."""
    server = maru_server_factory(pool_size="8M")
    a, b = _Node(server.url), _Node(server.url, maru_local_index=local)
    other = None
    try:
        keys = [f"restart-copy-{i}" for i in range(N)]
        pages = _write(a, keys, seed=3)
        places = _where(a, keys, SIDECARS)
        a.close()  # (its region goes back: the other instance may get it)
        real = PoolIO.copy_out
        seen: dict[str, Any] = {}

        def copy_out(self: PoolIO, *args: Any, **kwargs: Any) -> Any:
            nonlocal other
            if not seen:  # (the lookup is answered, its lease taken: the copy begins)
                seen["pool"] = self.name
                server.kill_and_start(no_restore)
                other = _other(server.url, b)
                seen["deleted"] = other.h.batch_delete(_stored_keys(b, keys, SIDECARS))
                seen["rewritten"] = other.write(places, 4 * POOL // other.size, "copy")
            return real(self, *args, **kwargs)

        assert _exists(b, keys) == (N, [N // 2, N])
        monkeypatch.setattr(PoolIO, "copy_out", copy_out)
        got = _get(b, keys, pages)
        monkeypatch.undo()
        assert seen["pool"] == ("mamba" if local else "swa"), seen
        assert seen["rewritten"] == [True] * len(places), seen
        assert seen["deleted"] == [not no_restore] * len(places)  # (a new generation: gone)
        assert got["kv"] == [True] * N  # (read before the restart)
        assert got["swa"] == [local] * N
        assert got["mamba"] == [False, False]
        again = _get(b, keys, pages)
        assert {n: again[n] for n in SIDECARS} == {n: _misses(keys)[n] for n in SIDECARS}
        assert other is not None and other.wrong() == []
    finally:
        if other is not None:
            other.close()
        a.close()
        b.close()


@pytest.mark.parametrize("first", SIDECARS, ids=["swa_first", "mamba_first"])
@pytest.mark.parametrize("no_restore", [False, True], ids=["restored", "no_restore"])
def test_a_restart_during_a_write_behind_set_v2_registers_only_its_own_bytes(
    maru_server_factory, no_restore, first, monkeypatch
):
    """A's write-behind `batch_set_v2` of swa and Mamba: its chunks reserved, the server is
    SIGKILLed and started again as the first pool's copy begins (`swa_first`: a pointer copy
    begun in C; `mamba_first`: a whole-page `PoolIO.copy_in`), another instance writes into
    the pool, then the copies and the registration go on. Restored, every page is registered
    and B loads it with A's bytes. A new generation: none of the first pool's pages is
    (refused, or counted lost); the second pool's, whose chunks may have been reserved after
    A's handler met the new pool, load whole with A's bytes or are all misses. Whatever B
    loads holds A's bytes, and the other's values keep theirs. Written again, every
    page of every pool loads whole."""
    server = maru_server_factory(pool_size="8M")
    a, b = _Node(server.url), _Node(server.url)
    other = None
    try:
        keys = [f"restart-set-{i}" for i in range(N)]
        idx, pages = _fill(a, keys, seed=5)
        assert a.s.batch_set_v1(keys, idx["kv"]) == [True] * N  # (A holds a region now)
        assert a.s.confirm_writes() == 0
        armed = [True]

        def trigger() -> None:
            nonlocal other
            if armed[0]:  # (the chunks are reserved: the copy begins)
                armed[0] = False
                server.kill_and_start(no_restore)
                other = _other(server.url, a)
                other.write([None], 512, "set")

        real_start, real_copy_in = writes_module._c_copy_values_start, PoolIO.copy_in

        def start(*args: Any) -> Any:
            trigger()
            return real_start(*args)

        def copy_in(self: PoolIO, *args: Any, **kwargs: Any) -> Any:
            trigger()
            return real_copy_in(self, *args, **kwargs)

        monkeypatch.setattr(writes_module, "_c_copy_values_start", start)
        monkeypatch.setattr(PoolIO, "copy_in", copy_in)
        order = (first, *(n for n in SIDECARS if n != first))
        sent = a.s.batch_set_v2(_side_transfers(a, keys, idx, order))
        assert not armed[0]
        monkeypatch.undo()
        lost = a.s.confirm_writes()
        got = _get(b, keys, pages)
        side_got = sum(sum(got[n]) for n in SIDECARS)
        assert side_got == sum(sum(v) for v in sent.values()) - lost
        if no_restore:  # the first pool's chunks lay in the old pool: never registered
            assert got[first] == _misses(keys)[first], (sent, lost)
            # the second one's were reserved after the restart or before it: either every
            # page was written into the new pool (its bytes checked above) or none counts
            assert len(set(got[order[1]])) == 1, (sent, lost)
        else:
            assert {n: got[n] for n in SIDECARS} == {n: _hits(keys)[n] for n in SIDECARS}
        assert other is not None and other.wrong() == []
        again = _write(a, keys, seed=5)
        assert _get(b, keys, again) == _hits(keys)
        assert other.wrong() == []
    finally:
        if other is not None:
            other.close()
        a.close()
        b.close()
