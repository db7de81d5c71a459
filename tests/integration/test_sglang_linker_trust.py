"""An adversarial audit of `MaruCacheLinker` (SGLang's `UnifiedCacheLinker` over Maru) against
the first rule: what a load reports landed is, byte for byte, what was written under its keys;
anything else is a miss (`load` False: recompute) or a failed batch (`finish_layer_wise_loading`
False: SGLang aborts the requests before their output is used). Real SGLang 0.5.23 device pools
on CPU, real maru-server processes, and a separate process where another instance must write.

Another instance's values are all 0xEE (`pool_places.OTHER`), never a byte pattern the tests
write, so a page that shows them where a key's bytes were expected is a served wrong page. Where
a test claims that such bytes reached the very pool pages a load reads, it checks that they did
(the pool file at the key's place), so the protection is what stops them, not luck.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(240)]

import sglang_cpu  # noqa: E402

sglang_cpu.require()  # (skips this module without SGLang; its CPU shims before it is imported)

import torch  # noqa: E402

from pool_places import OTHER, OtherInstance, places  # noqa: E402

from . import test_sglang_linker as base  # noqa: E402
from .test_sglang_linker import _hashes, _kv, _load, _offload, _wait, runtime  # noqa: E402, F401
from .workers import flip_byte  # noqa: E402

PAGE, LAYERS, WAIT = base.PAGE, base.LAYERS, base.WAIT
TESTS = Path(__file__).resolve().parent.parent
SMALL = {"maru_pool_size": "4M"}  # an owner that reuses its freed chunks soon (1024 of them)
SMALL_CHUNKS = 1024

# Another instance in its own process: a plain MaruHandler storing OTHER-filled values, either
# until given pool places hold them (filling what a restarted server hands out) or under given
# keys once `go` exists (racing a linker's offload of the same keys).
CHILD = r"""
import json, os, sys, time
sys.path.insert(0, sys.argv[2])
from pool_places import OTHER, OtherInstance
a = json.loads(sys.argv[1])
other = OtherInstance(a["url"], a["size"], a["chunk"])
out = {}
if a.get("keys"):
    open(a["ready"], "w").close()
    deadline = time.monotonic() + 30
    while not os.path.exists(a["go"]):
        assert time.monotonic() < deadline, "no go"
        time.sleep(0.001)
    out["stored"] = other.h.batch_store(a["keys"], [bytes([OTHER]) * a["size"]] * len(a["keys"]))
else:
    out["held"] = other.write([tuple(p) if p else None for p in a["places"]], 4096, "child")
    out["wrong"] = other.wrong()
print(json.dumps(out))
other.close()
"""


def _child(args: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, json.dumps(args), str(TESTS)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _result(proc: subprocess.Popen) -> dict:
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture
def make(runtime):  # noqa: F811
    """`make(url, **extra)`: an instance (device pool, allocator, linker) on that server."""
    made: list[base.Instance] = []

    def new(url: str, **extra) -> base.Instance:
        inst = base.Instance(runtime, url, **extra)
        made.append(inst)
        return inst

    yield new
    for inst in made:
        inst.close()


def _same(x: list[torch.Tensor], y: list[torch.Tensor]) -> bool:
    return len(x) == len(y) and all(torch.equal(a, b) for a, b in zip(x, y))


def _paint(inst: base.Instance, slots: torch.Tensor, byte: int) -> None:
    """Every byte of those slots' rows, every layer and part, set to `byte` (in place)."""
    for part in inst.buffers:
        for buf in part:
            buf.view(torch.uint8)[slots] = byte


def _all(rows: list[torch.Tensor], byte: int) -> bool:
    return all(bool((r == byte).all()) for r in rows)


def _stored(a: base.Instance, tag: str, n: int, seed: int) -> tuple[list[str], torch.Tensor]:
    """`n` pages of random rows offloaded by `a`: (their hashes, a's slots holding them)."""
    hashes = _hashes(n, tag)
    slots = a.allocator.alloc(n * PAGE)
    a.fill(slots, seed)
    assert _offload(a, hashes, slots)
    return hashes, slots


def _hold_after_layer_zero(inst: base.Instance) -> tuple[threading.Event, threading.Event]:
    """The next load copies layer 0, then waits for `hold` (set `reached` first)."""
    reached, hold = threading.Event(), threading.Event()
    real = inst.linker.layout.load_layers

    def held(sources, firsts):
        for layer, landed in enumerate(real(sources, firsts)):
            yield landed
            if layer == 0:
                reached.set()
                assert hold.wait(WAIT)

    inst.linker.layout.load_layers = held
    return reached, hold


def _overwrite_own(a: base.Instance, where: list, salt: str) -> None:
    """`a` (the pages' region owner, who gets their chunks back) stores OTHER values until
    every place in `where` holds them: another key's bytes in the very pages."""
    other = OtherInstance("", a.linker.layout.page_bytes, 0, handler=a.linker.handler)
    assert all(other.write(where, 3 * SMALL_CHUNKS, salt)), "the freed pages were not reused"


def test_pages_deleted_and_rewritten_after_lookup_are_a_miss(maru_server, make):
    """Between SGLang's `lookup` (match) and its `load`, the pages are deleted (an eviction's
    effect) and their owner writes other keys' 0xEE bytes into the very same pool pages. The
    load must be refused (recompute) and its slots never written. A linker that loaded from
    where `lookup` had found the pages, or did not check the leased lookup's lengths, would
    copy the 0xEE pages and report them landed (checked in a scratch run: such a linker's load
    was queued)."""
    a, b = make(maru_server.url, **SMALL), make(maru_server.url)
    hashes, _ = _stored(a, "del", 6, seed=11)
    keys = b.linker.keys(hashes)
    where = places(a.linker.handler, keys)
    assert b.linker.lookup("r", _kv(hashes)) == list(range(1, 7))
    assert all(a.linker.handler.batch_delete(keys))
    _overwrite_own(a, where, "del")

    dest = b.allocator.alloc(6 * PAGE)
    _paint(b, dest, 0x11)
    assert b.linker.load("r", _kv(hashes, dest)) is False
    assert b.linker.start_layer_wise_loading() == -1
    assert b.linker.lookup("r", _kv(hashes)) == []
    assert _all(b.rows(dest), 0x11)


def test_lease_lost_mid_copy_and_pages_rewritten_fails_the_batch(maru_server_factory, make):
    """The load copied layer 0, then stalls past --lease-timeout; the owner deletes the pages
    (the lease no longer stops it) and writes 0xEE values into the same pool pages; the copy
    resumes and the later layers copy 0xEE. SGLang must learn the batch failed: the last
    layer is failed and `finish_layer_wise_loading` says False. Without the lease proof in
    `_load_batch` (`_proven` True; checked in a scratch run) finish said True over 0xEE rows."""
    server = maru_server_factory(extra_args=["--lease-timeout", "1"])
    a, b = make(server.url, **SMALL), make(server.url)
    hashes, slots = _stored(a, "lease", 4, seed=12)
    keys = b.linker.keys(hashes)
    where = places(a.linker.handler, keys)
    reached, hold = _hold_after_layer_zero(b)
    got, index = _load(b, "r", hashes)
    counter = b.linker.layer_done_counter
    counter.set_consumer(index)
    assert reached.wait(WAIT)
    counter.wait_until(0)  # the forward may read layer 0 now: the stored bytes
    assert _same(b.rows(got, 0), a.rows(slots, 0))
    _wait(lambda: all(a.linker.handler.batch_delete(keys)))  # the lease expired
    _overwrite_own(a, where, "lease")
    hold.set()
    assert b.linker.finish_layer_wise_loading(index) is False
    assert _all(b.rows(got, LAYERS - 1), OTHER)  # the wrong bytes did reach the slots
    assert b.linker.counters["load_failures"] == 1
    assert b.linker.counters["loaded_pages"] == 0


@pytest.mark.parametrize("no_restore", [False, True], ids=["restore", "no-restore"])
def test_server_killed_mid_copy_fails_the_batch_then_old_keys_are_exact_or_missing(
    maru_server, make, no_restore
):
    """SIGKILL and restart of the maru-server while a load is between layers (leases taken
    by the dead server). With --no-restore, another instance in its own process then fills
    the fresh pool until the old pages' places hold 0xEE. The batch fails either way. After
    it, the old keys load byte-exact (state restored) or miss (not restored), and pages
    written after the restart load byte-exact: no mapping of the dead server's regions
    stands for the new server's."""
    a, b = make(maru_server.url), make(maru_server.url)
    hashes, slots = _stored(a, "kill", 6, seed=13)
    where = places(a.linker.handler, b.linker.keys(hashes))
    reached, hold = _hold_after_layer_zero(b)
    got, index = _load(b, "r", hashes)
    assert reached.wait(WAIT)
    maru_server.kill_and_start(no_restore=no_restore)
    if no_restore:
        page, chunk = b.linker.layout.page_bytes, a.linker.config.chunk_size_bytes
        child = _result(_child({"url": maru_server.url, "size": page, "chunk": chunk,
                                "places": where}))  # fmt: skip
        assert all(child["held"]) and child["wrong"] == []
    hold.set()
    assert b.linker.finish_layer_wise_loading(index) is False
    assert b.linker.counters["loaded_pages"] == 0

    hits = [] if no_restore else list(range(1, 7))
    _wait(lambda: b.linker.lookup("r2", _kv(hashes)) == hits)  # (reconnected)
    if not no_restore:
        got, index = _load(b, "r2", hashes)
        assert b.linker.finish_layer_wise_loading(index) is True
        assert _same(b.rows(got), a.rows(slots))
    else:
        assert b.linker.load("r2", _kv(hashes, b.allocator.alloc(6 * PAGE))) is False
    fresh = _hashes(6, "after")
    new_slots = a.allocator.alloc(6 * PAGE)
    a.fill(new_slots, seed=14)
    _wait(lambda: _offload(a, fresh, new_slots))  # (a's first try may meet lost regions)
    got, index = _load(b, "r3", fresh)
    assert b.linker.finish_layer_wise_loading(index) is True
    assert _same(b.rows(got), a.rows(new_slots))


def test_a_page_changed_in_the_pool_fails_the_batch_with_checksums(maru_server, make):
    """With `maru_checksums`, a stored page whose bytes changed in the pool while its key
    stayed (a stray writer, a bad DIMM: one byte flipped in the pool file, the lease intact)
    is copied, then found unlike its writer's checksum after the copy: the batch fails. The
    lease proof alone cannot see this (checked in a scratch run: `_proven` without the
    `corrupt()` check said True over the flipped byte)."""
    sums = {"maru_checksums": True}
    a, b = make(maru_server.url, **sums), make(maru_server.url, **sums)
    hashes, slots = _stored(a, "flip", 3, seed=22)
    flip_byte(a.linker.handler, b.linker.keys(hashes)[1], at=100)
    got, index = _load(b, "r", hashes)
    assert b.linker.finish_layer_wise_loading(index) is False
    assert not _same(b.rows(got), a.rows(slots))  # the changed byte was copied
    assert b.linker.handler.checksum_mismatches == 1
    assert b.linker.counters["load_failures"] == 1


def test_offload_seals_after_its_copy_and_reset_waits_for_it(maru_server, make):
    """An offload is copied by a thread after `offload` returned. While that copy is held:
    no key is visible to another instance (sealed only after the bytes are in), and
    SGLang's `reset` (after which it frees and reuses every device slot) does not return.
    Then the slots are reused (0xEE); the sealed pages are the bytes SGLang offloaded. A
    reset that did not wait for the offload thread (checked in a scratch run: `join` cut)
    returned at once and the pages sealed held the reused slots' 0xEE."""
    a, b = make(maru_server.url), make(maru_server.url)
    hashes = _hashes(5, "off")
    slots = a.allocator.alloc(5 * PAGE)
    a.fill(slots, seed=15)
    want = a.rows(slots)
    reached, hold = threading.Event(), threading.Event()
    real = a.linker.layout.store

    def held_store(targets, firsts, threads=1):
        reached.set()
        assert hold.wait(WAIT)
        return real(targets, firsts, threads)

    a.linker.layout.store = held_store
    assert a.linker.offload(_kv(hashes, slots))
    assert reached.wait(WAIT)
    assert b.linker.lookup("r", _kv(hashes)) == []
    reset = threading.Thread(target=a.linker.reset, daemon=True)
    reset.start()
    reset.join(0.3)
    assert reset.is_alive(), "reset returned while the offload was still copying"
    hold.set()
    reset.join(WAIT)
    assert not reset.is_alive()
    _paint(a, slots, OTHER)  # SGLang reuses the slots after the reset
    assert a.linker.num_completed_offloads() == 0
    got, index = _load(b, "r", hashes)
    assert b.linker.finish_layer_wise_loading(index) is True
    assert _same(b.rows(got), want)


@pytest.mark.parametrize("race", [False, True], ids=["exists", "seal-race"])
def test_offloading_a_stored_key_with_other_bytes_keeps_the_first(maru_server, make, race):
    """Keys are content hashes, so the first value stored under a key stays. Instance B
    offloads keys A stored with other bytes: skipped as present, or (`seal-race`: B's
    existence check answers 'absent', as when A seals between B's check and B's seal) copied
    and sealed, the server keeping A's. Either way the offload succeeds and every load of
    the keys gives A's bytes, never B's, never a mix (checked in a scratch run: a linker
    that replaced present keys served B's)."""
    a, b, c = make(maru_server.url), make(maru_server.url), make(maru_server.url)
    hashes, slots = _stored(a, "first", 4, seed=16)
    theirs = b.allocator.alloc(4 * PAGE)
    b.fill(theirs, seed=17)
    if race:
        b.linker.handler.batch_exists = lambda keys, **kw: [False] * len(keys)
    assert _offload(b, hashes, theirs)
    assert b.linker.counters["offload_skipped_pages"] == (0 if race else 4)
    got, index = _load(c, "r", hashes)
    assert c.linker.finish_layer_wise_loading(index) is True
    assert _same(c.rows(got), a.rows(slots))


def test_two_instances_offloading_the_same_keys_at_once(maru_server, make):
    """A linker offloads 16 pages while another instance, in its own process, stores the
    same keys with 0xEE values, both released at once. Whoever wins each key, a third
    instance's load gives per page one writer's whole page (A's rows or all 0xEE), and
    exactly the value the server registered under that key."""
    a, c = make(maru_server.url), make(maru_server.url)
    n = 16
    hashes = _hashes(n, "race")
    keys = a.linker.keys(hashes)
    slots = a.allocator.alloc(n * PAGE)
    a.fill(slots, seed=18)
    tmp = Path(maru_server.workdir)
    ready, go = tmp / "child-ready", tmp / "child-go"
    page, chunk = a.linker.layout.page_bytes, a.linker.config.chunk_size_bytes
    proc = _child({"url": maru_server.url, "size": page, "chunk": chunk, "keys": keys,
                   "ready": str(ready), "go": str(go)})  # fmt: skip
    _wait(lambda: ready.exists() or proc.poll() is not None)
    go.touch()
    assert a.linker.offload(_kv(hashes, slots))
    assert all(_result(proc)["stored"])
    _wait(lambda: a.linker.num_completed_offloads() >= 1)
    assert a.linker.pop_completed_offload() is True
    got, index = _load(c, "r", hashes)
    assert c.linker.finish_layer_wise_loading(index) is True
    registered = [bytes(i.view) for i in c.linker.handler.batch_retrieve(keys)]
    for i in range(n):
        page_slots = got[i * PAGE : (i + 1) * PAGE]
        loaded = c.rows(page_slots)
        mine = _same(loaded, a.rows(slots[i * PAGE : (i + 1) * PAGE]))
        assert mine or _all(loaded, OTHER), f"page {i} is neither writer's whole page"
        assert torch.cat([r.flatten() for r in loaded]).numpy().tobytes() == registered[i]


def test_cancelled_and_reset_loads_never_write_reused_slots(maru_server, make):
    """A load cancelled before it started leaves its slots alone: SGLang frees them and
    another request computes into them (0x11); later loads must not copy into them. A reset
    while a load is between layers waits for it to stop writing, and the slots then reused
    (0x22) stay so; the next batch's counter reports that batch only. A cancel that left
    the load queued (or a reset that returned mid-copy) would overwrite the reused rows
    (both checked in scratch runs: the batch failed / reset returned while copying)."""
    a, b = make(maru_server.url), make(maru_server.url)
    hashes, slots = _stored(a, "cancel", 4, seed=19)
    first = b.allocator.alloc(4 * PAGE)
    assert b.linker.load("x", _kv(hashes, first))
    assert b.linker.cancel_queued_load("x") is True
    _paint(b, first, 0x11)
    got, index = _load(b, "y", hashes)
    assert b.linker.finish_layer_wise_loading(index) is True
    assert _same(b.rows(got), a.rows(slots)) and _all(b.rows(first), 0x11)

    reached, hold = _hold_after_layer_zero(b)
    mid, _ = _load(b, "z", hashes)
    assert reached.wait(WAIT)
    reset = threading.Thread(target=b.linker.reset, daemon=True)
    reset.start()
    reset.join(0.3)
    assert reset.is_alive(), "reset returned while a load was still copying"
    hold.set()
    reset.join(WAIT)
    assert not reset.is_alive()
    _paint(b, mid, 0x22)
    b.linker.layout.load_layers = type(b.linker.layout).load_layers.__get__(b.linker.layout)
    got, index = _load(b, "w", hashes)
    assert b.linker.finish_layer_wise_loading(index) is True
    assert _same(b.rows(got), a.rows(slots)) and _all(b.rows(mid), 0x22)


def _variant(args, url: str, heads: int, head_dim: int, dtype: torch.dtype):
    """A linker over an MHA device pool of another geometry or dtype (same page bytes)."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from maru_sglang.linker import MaruCacheLinker

    device = MHATokenToKVPool(
        64, PAGE, dtype, head_num=heads, head_dim=head_dim, layer_num=LAYERS, device="cpu",
        enable_memory_saver=False, start_layer=0, end_layer=LAYERS - 1,
    )  # fmt: skip
    alloc = PagedTokenToKVPoolAllocator(64, PAGE, dtype, "cpu", device, need_sort=False)
    params = CacheInitParams(False, None, alloc, PAGE)
    linker = MaruCacheLinker(args, params, extra_config={"maru_server_url": url})
    return linker, alloc


def test_another_geometry_dtype_or_tp_rank_never_hits(maru_server, make, runtime, monkeypatch):  # noqa: F811
    """Pages of the same byte length but another head split, another 2-byte dtype (fp16 vs
    bf16) or another TP rank are other bytes for this instance: lookup finds none of them
    and a load is refused. The lengths alone cannot tell them apart (asserted equal), only
    the namespace does (checked in a scratch run: one namespace for all, the lookup hit)."""
    import sglang.srt.runtime_context as rc

    a = make(maru_server.url)
    hashes, _ = _stored(a, "ns", 3, seed=20)
    real = rc.get_parallel()
    rank1 = SimpleNamespace(  # what `_storage_config` reads of the ranks
        tp_rank=1, tp_size=2, attn_dcp_size=real.attn_dcp_size, attn_dcp_rank=real.attn_dcp_rank
    )
    variants = {
        "heads": (base.HEADS * 2, base.HEAD_DIM // 2, torch.bfloat16, real),
        "dtype": (base.HEADS, base.HEAD_DIM, torch.float16, real),
        "tp rank": (base.HEADS, base.HEAD_DIM, torch.bfloat16, rank1),
    }
    for name, (heads, dim, dtype, ranks) in variants.items():
        monkeypatch.setattr(rc, "get_parallel", lambda ranks=ranks: ranks)
        linker, alloc = _variant(runtime, maru_server.url, heads, dim, dtype)
        try:
            assert linker.layout.page_bytes == a.linker.layout.page_bytes, name
            assert linker.lookup("r", _kv(hashes)) == [], name
            assert linker.load("r", _kv(hashes, alloc.alloc(3 * PAGE))) is False, name
            assert linker.namespace != a.linker.namespace, name
        finally:
            linker.close()


def test_pages_maru_storage_wrote_load_through_the_linker_byte_for_byte(maru_server, make):
    """The other direction of the shared namespace: HiCache's MaruStorage stores
    `page_first_direct` host pages; the linker loads them into device rows equal to the
    host pages' bytes (K of every layer, then V), and a MaruStorage of another model name
    writes pages the linker never finds."""
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    from maru_sglang.maru_storage import MaruStorage
    from sglang_cpu.host_pools import storage_config
    from sglang_cpu.p2p import MARU_BACKEND

    b = make(maru_server.url)
    host = MHATokenToKVPoolHost(
        b.device.get_device_pool_infos()[0].buffer_info, 2, 0, PAGE, "page_first_direct",
        pin_memory=False, device="cpu", device_capacity_tokens=b.device.size,
        start_layer=0, end_layer=LAYERS - 1,
        write_back_staging=b.device.hicache_write_back_staging,
    )  # fmt: skip
    extra = {**MARU_BACKEND, "maru_server_url": maru_server.url, "maru_pool_size": "32M"}
    model = b.linker.storage_config.model_name
    host_slots = host.alloc(4 * PAGE)
    gen = torch.Generator().manual_seed(21)
    host.kv_buffer.view(torch.uint8).view(-1)[:] = torch.randint(
        0, 256, (host.kv_buffer.numel() * host.kv_buffer.element_size(),), generator=gen,
        dtype=torch.uint8,
    )  # fmt: skip
    pages = [host.get_data_page(int(host_slots[i * PAGE]), flat=True).view(torch.uint8).clone()
             for i in range(4)]  # fmt: skip
    for name, hashes in ((model, _hashes(4, "hs")), ("another-model", _hashes(4, "ho"))):
        storage = MaruStorage(storage_config(model=name, extra=extra), {})
        try:
            storage.register_mem_pool_host(host)
            assert storage.batch_set_v1(hashes, host_slots) == [True] * 4
        finally:
            storage.close()
    assert b.linker.lookup("r", _kv(_hashes(4, "ho"))) == []
    got, index = _load(b, "r", _hashes(4, "hs"))
    assert b.linker.finish_layer_wise_loading(index) is True
    for i in range(4):
        rows = got[i * PAGE : (i + 1) * PAGE]
        loaded = torch.cat([buf[rows].view(torch.uint8).flatten() for p in b.buffers for buf in p])
        assert torch.equal(loaded, pages[i]), i


def test_a_weight_update_that_names_a_version_rekeys_the_linkers_pages(maru_server, make):
    """The direct linker follows SGLang's weight version as MaruStorage does: once a weight
    update names a new version (`Scheduler.record_weight_version_change`), the pages the old
    weights computed are misses (mutation: `prefix` not following `weight_version()`: 3 of 3
    hits), and they are hits again for an instance back on the old version."""
    from sglang.srt.runtime_context import get_context, get_serving

    a = make(maru_server.url)
    hashes, _ = _stored(a, "wv", 3, seed=31)
    assert a.linker.lookup("r", _kv(hashes)) == [1, 2, 3]
    before = get_serving().weight_version
    try:
        get_context().override("scheduler.weight_version", weight_version="rl-step-1")
        assert a.linker.lookup("r", _kv(hashes)) == []
        b = make(maru_server.url)  # an instance started on the new version
        assert b.linker.namespace == a.linker.namespace
    finally:
        get_context().override("scheduler.weight_version", weight_version=before)
    assert a.linker.lookup("r", _kv(hashes)) == [1, 2, 3]
