"""Code that runs in separate processes (multiprocessing "spawn": a fresh interpreter, its own
MaruHandler, its own mmap of the pool). Each worker puts one result dict on a queue."""

from __future__ import annotations

import ctypes
import hashlib
import math
import multiprocessing as mp
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

KiB, MiB = 1 << 10, 1 << 20
SPAWN = mp.get_context("spawn")


def mixed_sizes(n: int, seed: int, lo: int = 4 * KiB, hi: int = 8 * MiB) -> list[int]:
    """Log-uniform sizes in [lo, hi], both ends included, most of them not page multiples."""
    rng = np.random.default_rng(seed)
    sizes = np.exp(rng.uniform(math.log(lo), math.log(hi), n)).astype(np.int64).tolist()
    sizes[0], sizes[-1] = lo, hi
    return [min(max(int(s), lo), hi) for s in sizes]


def make_value(seed: int, size: int) -> memoryview:
    """`size` random bytes, reproducible from `seed`."""
    raw = np.random.Philox(seed).random_raw(-(-size // 8))
    return memoryview(raw).cast("B")[:size]


def digest(buf: Any) -> str:
    return hashlib.sha1(buf).hexdigest()


def owned_pages(h: Any) -> int:
    """Chunks in the regions `h` owns (regions are taken as data arrives: count after)."""
    return sum(r.length for r in h.list_allocations()) // h.get_chunk_size()


def flip_byte(handler: Any, key: str, at: int = 0) -> None:
    """Flip one byte of `key`'s value where it lies in the pool file (not through a mapping
    of Maru's: as a stray writer, a bad DIMM or a reused page would)."""
    import os

    info = handler.batch_retrieve([key])[0]
    assert info is not None, key
    region = handler._mapper.get(info.region_id).handle
    fd = os.open(region.path, os.O_RDWR)
    try:
        where = region.offset + info.offset + at
        (old,) = os.pread(fd, 1, where)
        assert os.pwrite(fd, bytes([old ^ 0xFF]), where) == 1
    finally:
        os.close(fd)


def _run(fn: Callable[..., dict], out_q: Any, idx: int, args: tuple) -> None:
    try:
        result = fn(*args)
    except BaseException:
        result = {"error": traceback.format_exc()}
    out_q.put((idx, result))


def run_processes(jobs: Sequence[tuple[Callable[..., dict], tuple]], timeout: float) -> list[dict]:
    """Run each (fn, args) in its own spawned process; return their result dicts in order.
    Raises (after killing stragglers) if one fails or the deadline passes."""
    out_q = SPAWN.Queue()
    procs = [
        SPAWN.Process(target=_run, args=(fn, out_q, i, args), daemon=True)
        for i, (fn, args) in enumerate(jobs)
    ]
    for p in procs:
        p.start()
    results: dict[int, dict] = {}
    try:
        for _ in procs:
            idx, result = out_q.get(timeout=timeout)
            if "error" in result:
                raise AssertionError(f"worker {idx} failed:\n{result['error']}")
            results[idx] = result
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
    return [results[i] for i in range(len(procs))]


def resident_bytes(address: int) -> int:
    """Bytes of this process's mapping that starts at `address` that its page tables map
    (/proc/self/smaps Rss): what a first copy through it will not fault on."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and not fields[0].endswith(":"):
            inside = int(fields[0].split("-")[0], 16) == address
        elif inside and fields and fields[0] == "Rss:":
            return int(fields[1]) * KiB
    return 0


def populated_mappings(h: Any) -> dict[int, tuple[int, int]]:
    """{region id: (its length, bytes of it mapped in)} of every region `h` maps, once the
    regions' population is over (at most 60 s)."""
    mapper = h._mapper
    if not mapper.wait_populated(60):
        raise AssertionError("regions still populating after 60 s")
    mapped = {rid: mapper.get(rid) for rid in mapper.region_ids()}
    return {rid: (m.handle.length, resident_bytes(m.address)) for rid, m in mapped.items() if m}


# -- workers -----------------------------------------------------------------------------------


def _handler(url: str, **kw: Any):
    from maru import MaruHandler

    h = MaruHandler(server_url=url, timeout_ms=10_000, **kw)
    if not h.connected:
        raise RuntimeError(f"cannot connect to {url}")
    return h


def store_keys(
    url: str,
    keys: list[str],
    sizes: list[int],
    seed: int,
    batch: int,
    handler_kw: dict[str, Any],
    barrier: Any = None,
    done: Any = None,
) -> dict:
    """Store keys[i] = make_value(seed + i, sizes[i]) in batches; report digests and pages.
    With `done`, keep the handler (and its regions) until the parent sets it."""
    h = _handler(url, **handler_kw)
    try:
        if barrier is not None:
            barrier.wait(30)
        ok: list[bool] = []
        digests: list[str] = []
        for start in range(0, len(keys), batch):
            idx = range(start, min(start + batch, len(keys)))
            values = [make_value(seed + i, sizes[i]) for i in idx]
            digests.extend(digest(v) for v in values)
            ok.extend(h.batch_store([keys[i] for i in idx], values))
        result = {
            "ok": ok,
            "digests": digests,
            "total_pages": owned_pages(h),
            "free_pages": h.free_chunks(),
            "regions": h.owned_region_ids(),
            "chunk": h.get_chunk_size(),
        }
        if done is not None:
            done.wait(60)
        return result
    finally:
        h.close()


def retrieve_keys(url: str, keys: list[str], batch: int) -> dict:
    """Look keys up in batches and digest the bytes straight from this process's mapping."""
    h = _handler(url, pool_size="4M")
    try:
        own = set(h.owned_region_ids())
        digests: list[str | None] = []
        lengths: list[int] = []
        readonly = True
        foreign = True
        for start in range(0, len(keys), batch):
            for info in h.batch_retrieve(keys[start : start + batch]):
                if info is None:
                    digests.append(None)
                    lengths.append(-1)
                    continue
                readonly &= info.view.readonly
                foreign &= info.region_id not in own
                digests.append(digest(info.view))
                lengths.append(info.length)
        return {"digests": digests, "lengths": lengths, "readonly": readonly, "foreign": foreign}
    finally:
        h.close()


def share_pool(
    url: str, me: int, n: int, count: int, handler_kw: dict[str, Any], stored: Any, checked: Any
) -> dict:
    """Instance `me` of `n`: store `count` values, wait until every instance stored (all
    still connected), then read every instance's values in place under a lease and digest
    them; stay connected until every instance checked. Values are reproducible from their key,
    so each instance knows what the others wrote."""

    def key(owner: int, i: int) -> str:
        return f"share/{owner}/{i}"

    def value(owner: int, i: int) -> memoryview:
        return make_value(1000 * owner + i, 3000 + (owner * 7919 + i * 104729) % (200 * KiB))

    h = _handler(url, **handler_kw)
    try:
        regions_at_connect = len(h.owned_region_ids())
        ok = h.batch_store([key(me, i) for i in range(count)], [value(me, i) for i in range(count)])
        held = h.stats()["instances"][h.instance_id]["region_bytes"]
        stored.wait(120)
        hits = wrong = 0
        for owner in range(n):
            keys = [key(owner, i) for i in range(count)]
            with h.leased(keys) as infos:
                for i, info in enumerate(infos):
                    if info is not None:
                        hits += 1
                        wrong += digest(info.view) != digest(value(owner, i))
        checked.wait(120)
        return {
            "ok": ok,
            "hits": hits,
            "wrong": wrong,
            "held": held,
            "regions_at_connect": regions_at_connect,
        }
    finally:
        h.close()


def _seed(key: str) -> int:
    return int(hashlib.sha1(key.encode()).hexdigest()[:12], 16)


def keep_writing(
    url: str, prefix: str, size: int, fill: int, handler_kw: dict[str, Any], filled: Any, stop: Any
) -> dict:
    """Store values of `size` bytes under prefix/0, prefix/1, ... (each make_value(_seed(key)))
    without pause; set `filled` once `fill` bytes were stored, go on until `stop` is set.
    Then read the last 8 acknowledged keys back under a lease: their wrong bytes."""
    h = _handler(url, **handler_kw)
    try:
        stored, failed, acked = 0, 0, []
        for i in range(1_000_000):
            if stop.is_set():
                break
            key = f"{prefix}/{i}"
            if h.store(key, make_value(_seed(key), size)):
                stored += 1
                acked.append(key)
            else:
                failed += 1
            if stored * size >= fill:
                filled.set()
        last = acked[-8:]
        with h.leased(last) as infos:
            hits = [(k, digest(i.view)) for k, i in zip(last, infos) if i is not None]
        wrong = sum(d != digest(make_value(_seed(k), size)) for k, d in hits)
        return {"stored": stored, "failed": failed, "hits": len(hits), "wrong": wrong}
    finally:
        h.close()


def write_behind(
    url: str,
    prefix: str,
    handler_kw: dict[str, Any],
    batches: int,
    fill: int = 0,
    filled: Any = None,
    stop: Any = None,
) -> dict:
    """Write batches of 8 values of 16 KiB (each make_value(_seed(key))) behind
    (`MaruHandler.put(..., behind=True)`), about 30% of batches also deleting 4 recent keys:
    `batches` of them, or (0) until `stop` is set; `filled` is set once the instance holds
    `fill` bytes of regions. Then read the last 8 acknowledged keys back under a lease.
    Returns the values tried, those stored (the replies confirmed) and the wrong bytes."""
    import random

    from maru.client.writes import Put, from_pointers

    size, batch = 16 * KiB, 8
    h = _handler(url, **handler_kw)
    try:
        rng = random.Random(prefix)
        late: list[int] = []
        tried = hoped = 0
        acked: list[str] = []
        kept: list[list[memoryview]] = []  # the sources of the writes not yet confirmed
        for b in range(batches or 1 << 30):
            if stop is not None and stop.is_set():
                break
            keys = [f"{prefix}/{b * batch + j}" for j in range(batch)]
            values = [make_value(_seed(k), size) for k in keys]
            pointers = [np.frombuffer(v, np.uint8).ctypes.data for v in values]
            put = Put(keys, size, from_pointers(pointers, [size] * batch), on_late=late.append)
            h.put([put], behind=True)
            kept = [*kept[-3:], values]
            tried += batch
            hoped += sum(put.results)
            acked = [*acked, *(k for k, ok in zip(keys, put.results) if ok)][-64:]
            if acked and rng.random() < 0.3:
                h.batch_delete(rng.sample(acked, min(4, len(acked))))
            if filled is not None and h._chunks.owned_bytes() >= fill:
                filled.set()
        h.confirm_writes()
        last = acked[-8:]
        with h.leased(last) as infos:
            hits = [(k, digest(i.view)) for k, i in zip(last, infos) if i is not None]
        wrong = sum(d != digest(make_value(_seed(k), size)) for k, d in hits)
        return {
            "tried": tried,
            "stored": hoped - sum(late),
            "refused": dict(h.refused_stores),
            "wrong": wrong,
        }
    finally:
        h.close()


def write_under_a_lease_flood(
    url: str,
    size: int,
    fill: int,
    count: int,
    progress: Any,
    filled: Any,
    flooded: Any,
    done: Any,
) -> dict:
    """Fill the pool (`fill` bytes of values of `size`, keys w/0...), set `filled`, wait until
    the flooder leased every key, then store `count` more one by one while it floods; read
    the acknowledged ones back under leases, then set `done`. Counts failed stores, hits and
    wrong bytes."""
    h = _handler(url, pool_size=fill, chunk_size_bytes=size)
    try:
        keys = [f"w/{i}" for i in range(fill // size + count)]
        n_fill = fill // size
        for i in range(n_fill):
            h.store(keys[i], make_value(_seed(keys[i]), size - 100))
            progress.value = i + 1
        filled.set()
        assert flooded.wait(60), "the flooder never leased"
        ok = []
        for i in range(n_fill, n_fill + count):
            ok.append(h.store(keys[i], make_value(_seed(keys[i]), size - 100)))
            progress.value = i + 1
        acked = [k for k, stored in zip(keys[n_fill:], ok) if stored]
        hits = wrong = 0
        for start in range(0, len(acked), 32):
            batch = acked[start : start + 32]
            with h.leased(batch) as infos:
                for key, info in zip(batch, infos):
                    if info is not None:
                        hits += 1
                        wrong += digest(info.view) != digest(make_value(_seed(key), size - 100))
        return {"failed": ok.count(False), "hits": hits, "wrong": wrong}
    finally:
        done.set()
        h.close()


def flood_leases(url: str, batch: int, progress: Any, filled: Any, flooded: Any, done: Any):
    """Every 0.5 s, lease every key the writer stored so far (w/0 .. w/progress), in batches
    of `batch` keys, and never release (the leases end at --lease-timeout). Reports the most
    keys it held under leases at once."""
    import time

    h = _handler(url, pool_size="2M")
    try:
        assert filled.wait(120), "the writer never filled the pool"
        held: list[Any] = []  # (lookup, when): never released
        most = 0
        while not done.is_set():
            keys = [f"w/{i}" for i in range(progress.value)]
            for start in range(0, len(keys), batch):
                found = h.lookup(keys[start : start + batch], lease=True)
                found.wait()
                if found.lease_id:
                    held.append((found, time.monotonic()))
            held = [(f, t) for f, t in held if time.monotonic() - t < 10]
            most = max(most, sum(int((f.lengths > 0).sum()) for f, _ in held))
            flooded.set()
            done.wait(0.5)
        return {"most_leased": most}
    finally:
        h.close()


def map_and_read(url: str, keys: list[str], size: int, seed: int) -> dict:
    """A new instance (eager map at connect): how much of each region it mapped is mapped in
    before it reads anything, then the digests of `keys` read back (None: a miss)."""
    h = _handler(url, pool_size="4M", chunk_size_bytes=size)
    try:
        before = populated_mappings(h)
        out = np.zeros((len(keys), size), np.uint8)
        buffers = out.ctypes.data + np.arange(len(keys), dtype=np.int64)[:, None] * size
        got = h.read(keys, buffers, np.array([size], np.int64), length=size)
        digests = [digest(out[i]) if hit else None for i, hit in enumerate(got)]
        return {"mapped": {str(k): v for k, v in before.items()}, "digests": digests}
    finally:
        h.close()


def many_handlers_store(url: str, handlers: int, values: int, size: int) -> dict:
    """One process, `handlers` handlers, storing `values` values of `size` bytes each, in
    turns (each under its own keys); the region bytes each instance holds at the end, the
    stores acknowledged, and how each handler's acknowledged values read back: "ok", "miss"
    (evicted to make room) or "wrong"."""
    hs = [_handler(url, pool_size="64M", chunk_size_bytes="1M") for _ in range(handlers)]
    try:
        acked: list[tuple[int, str]] = []
        for i in range(values):
            for n, h in enumerate(hs):
                if h.store(f"many/{n}/{i}", make_value(n * 1000 + i, size)):
                    acked.append((n, f"many/{n}/{i}"))
        reads = []
        for n, key in acked:
            got = hs[n].retrieve(key)
            want = digest(make_value(n * 1000 + int(key.rsplit("/", 1)[1]), size))
            reads.append("miss" if got is None else "ok" if digest(got.view) == want else "wrong")
        stats = hs[0].stats()["instances"]
        held = [stats[h.instance_id]["region_bytes"] for h in hs]
        return {"held": held, "acked": len(acked), "reads": reads}
    finally:
        for h in hs:
            h.close()


def copy_coherently(
    url: str, role: str, keys: list[str], size: int, seed: int, handler_kw: dict[str, Any]
) -> dict:
    """A writer (`batch_store`) or a reader (`read`, the data path's C copy) of
    keys[i] = make_value(seed + i, size): the coherence mode its handler agreed on, the
    WARNINGs `maru.client.coherence` logged, the cache lines its copies flushed (written
    back, invalidated), and per key whether it stored / read the bytes written."""
    import logging

    from maru.client.coherence import lines_flushed

    warned: list[str] = []
    catch = logging.Handler(logging.WARNING)
    catch.emit = lambda record: warned.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("maru.client.coherence").addHandler(catch)
    h = _handler(url, pool_size="64M", chunk_size_bytes=-(-size // 4096) * 4096, **handler_kw)
    try:
        before = lines_flushed()
        if role == "write":
            done = h.batch_store(keys, [make_value(seed + i, size) for i in range(len(keys))])
        else:
            out = np.zeros((len(keys), size), np.uint8)
            buffers = out.ctypes.data + np.arange(len(keys), dtype=np.int64)[:, None] * size
            hits = h.read(keys, buffers, np.array([size], np.int64), length=size)
            expected = [digest(make_value(seed + i, size)) for i in range(len(keys))]
            done = [hit and digest(out[i]) == expected[i] for i, hit in enumerate(hits)]
        after = lines_flushed()
        return {
            "done": [bool(d) for d in done],
            "mode": h.coherence,
            "local": h.reads_locally,
            "warned": warned,
            "lines": [after[0] - before[0], after[1] - before[1]],
        }
    finally:
        h.close()


def in_place_coherently(url: str, role: str, keys: list[str], size: int, seed: int) -> dict:
    """Values written and read in place, not by a copy loop: a writer fills one `alloc` run
    and seals it (`batch_store(keys, handles)`), then fills another and frees it; a reader
    digests `batch_retrieve`'s views, each value again through `get_buffer_view`, and
    `read_many` with a copy of its own. Per step the cache lines flushed
    (written back, invalidated) and per key whether the bytes are make_value(seed + i)."""
    from maru.client.coherence import lines_flushed

    h = _handler(url, pool_size="64M", chunk_size_bytes=-(-size // 4096) * 4096)
    try:
        expected = [make_value(seed + i, size) for i in range(len(keys))]
        steps: dict[str, list[int]] = {}

        def step(name: str, fn: Callable[[], Any]) -> Any:
            before = lines_flushed()
            out = fn()
            after = lines_flushed()
            steps[name] = [after[0] - before[0], after[1] - before[1]]
            return out

        if role == "write":
            run = h.alloc(size, len(keys))
            for i, value in enumerate(expected):
                run.slice(i, i + 1).buf[:] = value
            done = step("seal", lambda: h.batch_store(keys, run.split()))
            spare = h.alloc(size, len(keys))  # (written, then given back unsealed)
            spare.buf[:] = b"\xee" * len(spare.buf)
            step("free", lambda: h.free(spare))
            return {"done": done, "mode": h.coherence, "lines": steps}
        infos = step("retrieve", lambda: h.batch_retrieve(keys))
        done = [
            bool(info) and digest(info.view) == digest(expected[i]) for i, info in enumerate(infos)
        ]
        views = step(
            "view",
            lambda: [h.get_buffer_view(i.region_id, i.offset, i.length) for i in infos if i],
        )
        done += [digest(v) == digest(expected[i]) for i, v in enumerate(views)]
        out = np.zeros((len(keys), size), np.uint8)

        def by_ctypes(sources: np.ndarray) -> None:  # (as a device's copy would: no C loop)
            for i, source in enumerate(sources.tolist()):
                if source:
                    ctypes.memmove(out[i].ctypes.data, source, size)

        proven, _ = step("read_many", lambda: h.read_many(keys, [(len(keys), size, by_ctypes)]))
        done += [bool(p) and digest(out[i]) == digest(expected[i]) for i, p in enumerate(proven)]
        return {"done": done, "mode": h.coherence, "lines": steps}
    finally:
        h.close()
