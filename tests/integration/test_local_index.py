"""The local index against a real `maru-server` (issue 17, part 1): readers on the server's node
answer `exists`, `batch_exists` and copying reads from the shared table without a request, agree
with the request path, never take a changed entry's bytes as a hit (delete, reuse, eviction,
server SIGKILL and restart, a recreated pool), and their hits count as use for eviction."""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import time
from typing import Any
from unittest import mock

import numpy as np
import pytest

import maru.client.handler as handler_module
import maru.client.localindex as localindex_module
from maru import MaruAdmin, MaruHandler
from maru.common.shmindex import MAX_KEY, table_files

from .workers import SPAWN

KiB, MiB = 1 << 10, 1 << 20
CHUNK = 64 * KiB


def value(key: str, version: int = 0, size: int = CHUNK) -> bytes:
    """`size` bytes that only `key` at `version` has: its digest, repeated."""
    digest = hashlib.sha256(f"{key}@{version}".encode()).digest()
    return (digest * (size // 32 + 1))[:size]


def handler(url: str, **kw: Any) -> MaruHandler:
    kw.setdefault("pool_size", "64M")
    kw.setdefault("chunk_size_bytes", CHUNK)
    return MaruHandler(server_url=url, **kw)


WAYS = ["lookup", "read"]  # the two copying reads: lookup + copy + checks, `MaruHandler.read`


def read(
    h: MaruHandler,
    keys: list[Any],
    before_copy: Any = None,
    prefix: Any = "",
    way: str = "lookup",
    copier: Any = None,
) -> tuple[list, Any]:
    """A copying read as MaruStorage does it: copy the hits, then drop what `corrupt()` names
    (and everything if `release(confirm=True)` says the batch is not proven). `way` "read":
    through `MaruHandler.read` into host rows of CHUNK bytes, where on the index probe, copy
    and check are one C call: `before_copy` then runs inside it, through `copier` (the
    `fused_copier` fixture), or before the request path's copy. Returns (each key's bytes
    or None, whether the index answered)."""
    if way == "read":
        return _read_into(h, keys, before_copy, prefix, copier)
    with h.lookup(keys, lease=True, for_copy=True, prefix=prefix) as found:
        if before_copy is not None:
            before_copy()
        data = [
            ctypes.string_at(int(a), int(n)) if a else None
            for a, n in zip(found.addresses, found.lengths)
        ]
        bad = found.corrupt()
        held = found.release(confirm=True)
    local = type(found).__name__ == "IndexLookup"
    return [None if (b or not held) else d for d, b in zip(data, bad)], local


def _read_into(h: MaruHandler, keys, before_copy, prefix, copier) -> tuple[list, Any]:
    out = np.zeros((len(keys), CHUNK), np.uint8)
    buffers = (out.ctypes.data + np.arange(len(keys), dtype=np.int64) * CHUNK)[:, None]
    hooks = contextlib.ExitStack()
    if before_copy is not None:
        real = handler_module.copy_values

        def copy_after(*args: Any, **kw: Any) -> Any:
            before_copy()
            return real(*args, **kw)

        hooks.enter_context(mock.patch.object(handler_module, "copy_values", copy_after))
        hooks.enter_context(
            mock.patch.object(localindex_module, "COPY_VALUES", copier(before_copy))
        )
    fallbacks = h._index.fallbacks if h._index is not None else 0
    with hooks:
        proven = h.read(keys, buffers, np.array([CHUNK], np.int64), length=CHUNK, prefix=prefix)
    local = h._index is not None and h._index.fallbacks == fallbacks  # (no lookup was asked)
    return [bytes(out[i]) if ok else None for i, ok in enumerate(proven)], local


def operations(url: str) -> dict[str, int]:
    ops = MaruAdmin(url).stats()["operations"]
    return {name: ops.get(name, {}).get("count", 0) for name in ("lookup_kv", "exists")}


def _reader_process(url: str, keys: list[str], out: Any) -> None:
    """Another process: connect, then exists, batch_exists and a copying read of `keys`."""
    with handler(url) as h:
        index = h._index is not None
        singles = [h.exists(k) for k in keys[:4]]
        present = h.batch_exists(keys)
        data, _ = read(h, keys)
        wrong = sum(d is not None and d != value(k) for k, d in zip(keys, data))
        out.put((index, singles, present, [d is not None for d in data], wrong))


def test_a_reader_process_finds_and_copies_keys_without_a_single_request(maru_server):
    keys = [f"ns:{i:064x}" for i in range(64)]
    with handler(maru_server.url) as w:
        assert all(w.batch_store(keys[:48], [value(k) for k in keys[:48]]))
        before = operations(maru_server.url)
        q = SPAWN.Queue()
        proc = SPAWN.Process(target=_reader_process, args=(maru_server.url, keys, q))
        proc.start()
        index, singles, present, hits, wrong = q.get(timeout=60)
        proc.join(30)
    assert index
    assert singles == [True] * 4
    assert present == hits == [True] * 48 + [False] * 16
    assert wrong == 0
    assert operations(maru_server.url) == before  # no LOOKUP_KV, no EXISTS: all local


def counters(url: str) -> dict[str, int]:
    stats = MaruAdmin(url).stats()["counters"]
    return {name: stats.get(name, 0) for name in READ_COUNTERS}


READ_COUNTERS = ("lookups", "hits", "misses", "exists", "exists_hits", "exists_misses")


def test_reads_answered_locally_are_in_the_servers_hit_counts(maru_server):
    """The server never sees a local read, so the client reports them: with each heartbeat,
    and with DISCONNECT (here the reader's close)."""
    keys = [f"ns:{i:064x}" for i in range(64)]
    with handler(maru_server.url) as w:
        assert all(w.batch_store(keys[:48], [value(k) for k in keys[:48]]))
        before = counters(maru_server.url)
        with handler(maru_server.url) as r:
            assert r._index is not None
            r.batch_exists(keys)
            data, _ = read(r, keys)
            assert sum(d is not None for d in data) == 48
            r._beat()  # what the heartbeat thread does every interval
            after_beat = counters(maru_server.url)
            r._beat()  # nothing new to report: the counts are not sent twice
            assert counters(maru_server.url) == after_beat
            r.exists(keys[0])
            r.exists(keys[-1])
            assert r.leading_hits(keys) == 48  # 49 keys checked: the hits and the first miss
        after_close = counters(maru_server.url)
    delta = {k: after_beat[k] - before[k] for k in READ_COUNTERS}
    assert delta == {
        "lookups": 64,
        "hits": 48,
        "misses": 16,
        "exists": 64,
        "exists_hits": 48,
        "exists_misses": 16,
    }
    assert after_close["exists"] - after_beat["exists"] == 2 + 49
    assert after_close["exists_hits"] - after_beat["exists_hits"] == 1 + 48


@pytest.mark.parametrize("way", WAYS)
def test_the_index_agrees_with_the_request_path(maru_server, way):
    keys = [f"k{i}" for i in range(40)] + [b"k1", b"bytes-key"]
    with handler(maru_server.url) as w, handler(maru_server.url, local_index=False) as plain:
        stored = [k for k in keys if k not in ("k3", "k7", b"k1")]
        assert all(w.batch_store(stored, [value(str(k)) for k in stored]))
        w.batch_delete(["k5"])
        local = handler(maru_server.url)
        assert local._index is not None and plain._index is None
        assert local.batch_exists(keys) == plain.batch_exists(keys)
        for start in range(len(keys)):  # SGLang's batch_exists: the hits from the start
            assert local.leading_hits(keys[start:]) == plain.leading_hits(keys[start:])
        got, answered_locally = read(local, keys, way=way)
        assert answered_locally
        with plain.leased(keys) as infos:
            expected = [bytes(i.view) if i else None for i in infos]
        assert got == expected and sum(d is not None for d in got) == len(stored) - 1
        local.close()


def test_prefixed_calls_answer_for_the_joined_keys_with_the_index_and_without(maru_server):
    """`batch_exists`, `exists` and copying `lookup` with `prefix=` (MaruStorage's namespace)
    answer for `prefix + key`: the index in two parts, the request path joined in Python, with
    the same answers for str and bytes keys, non-ASCII ones, one prefix per key, and a key
    that fits the table alone but not with its prefix (the request path has it)."""
    pre = "名前:"  # 7 UTF-8 bytes
    hashes = [f"{i:064x}" for i in range(12)] + ["ü" * 3, "k" * (MAX_KEY - 7), "k" * (MAX_KEY - 6)]
    stored = [pre + h for h in hashes[:8] + hashes[12:]] + [b"ns:raw"]
    mixed, mixed_prefix = ["0" * 64, "raw", b"raw", b"absent"], [pre, pre, b"ns:", b"ns:"]
    url = maru_server.url
    with handler(url) as w, handler(url, local_index=False) as plain, handler(url) as local:
        assert all(w.batch_store(stored, [value(str(k)) for k in stored]))
        assert local._index is not None and plain._index is None
        expected = [pre + h in stored for h in hashes]
        assert expected == [True] * 8 + [False] * 4 + [True] * 3
        for h in (local, plain):
            assert h.batch_exists(hashes, prefix=pre) == expected
            assert h.batch_exists([pre + k for k in hashes]) == expected
            assert h.batch_exists(mixed, prefix=mixed_prefix) == [True, False, True, False]
            assert [h.exists(k, prefix=pre) for k in hashes[7:9]] == [True, False]
            assert h.leading_hits(hashes, prefix=pre) == 8
            assert h.leading_hits(hashes[12:], prefix=pre) == 3
        got = {}
        for name, h in (("local", local), ("plain", plain)):
            data, answered_locally = read(h, hashes, prefix=pre)
            assert data == [value(pre + k) if e else None for k, e in zip(hashes, expected)]
            got[name] = (data, read(h, mixed, prefix=mixed_prefix)[0], answered_locally)
        assert got["local"][:2] == got["plain"][:2]
        assert not got["local"][2]  # the last key cannot be in the table: asked
        assert got["plain"][1] == [value(pre + mixed[0]), None, value("b'ns:raw'"), None]
        before = operations(url)
        assert local.batch_exists(hashes[:-1], prefix=pre) == expected[:-1]
        assert local.leading_hits(hashes[:-1], prefix=pre) == 8
        data, answered_locally = read(local, hashes[:-1], prefix=pre)
        assert answered_locally and data == got["plain"][0][:-1]
        assert operations(url) == before  # all local: the keys that fit were joined in C
        assert local.batch_exists(hashes[-1:], prefix=pre) == [True]
        assert operations(url)["exists"] == before["exists"] + 1
        for h in (local, plain):
            with pytest.raises(TypeError):
                h.batch_exists([b"raw"], prefix=pre)  # as `pre + b"raw"` raises
            with pytest.raises(ValueError):
                h.batch_exists(hashes, prefix=[pre])  # one per key


def test_a_first_read_of_an_unmapped_region_asks_once_then_reads_locally(maru_server):
    keys = [f"k{i}" for i in range(8)]
    with handler(maru_server.url) as w, handler(maru_server.url, eager_map=False) as r:
        w.batch_store(keys, [value(k) for k in keys])
        before = operations(maru_server.url)["lookup_kv"]
        assert read(r, keys)[0] == [value(k) for k in keys]  # region not mapped: a request
        assert operations(maru_server.url)["lookup_kv"] == before + 1
        assert read(r, keys)[0] == [value(k) for k in keys]
        assert operations(maru_server.url)["lookup_kv"] == before + 1  # now local
        assert r._index.fallbacks == 1


def test_a_reader_maps_the_regions_made_after_it_connected_at_its_next_heartbeat(
    maru_server_factory,
):
    """`eager_map`: a reader that connected before a writer took its region maps it at its
    next heartbeat (interval: the server's timeout / 3), so that its first read of the
    writer's values is local (no request), like its second; without `eager_map` that read
    asks the server once."""
    server = maru_server_factory(extra_args=["--heartbeat-timeout", "1.5"])
    keys = [f"k{i}" for i in range(8)]
    with (  # the readers connect first: the writer takes its region after
        handler(server.url) as r,
        handler(server.url, eager_map=False) as lazy,
        handler(server.url) as w,
    ):
        w.batch_store(keys, [value(k) for k in keys])
        (region,) = w._chunks.region_ids()
        deadline = time.monotonic() + 30
        while r._mapper.get(region) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert r._mapper.get(region) is not None, "not mapped by the heartbeat"
        assert lazy._mapper.get(region) is None
        before = operations(server.url)["lookup_kv"]
        assert read(r, keys)[0] == [value(k) for k in keys]
        assert operations(server.url)["lookup_kv"] == before  # mapped already: local
        assert r._index.fallbacks == 0
        assert read(lazy, keys)[0] == [value(k) for k in keys]
        assert operations(server.url)["lookup_kv"] == before + 1


@pytest.mark.parametrize("way", WAYS)
def test_an_entry_deleted_and_its_page_reused_during_the_copy_is_a_miss(
    maru_server, way, fused_copier
):
    keys = [f"k{i}" for i in range(4)]
    with handler(maru_server.url, pool_size="2M") as w, handler(maru_server.url) as r:
        assert all(w.batch_store(keys, [value(k) for k in keys]))
        read(r, keys)  # (maps the writer's region: a region new to a reader is asked for)

        def delete_and_reuse() -> None:  # between the probe and the copy
            assert w.batch_delete(keys[:2]) == [True, True]
            more = [f"new{i}" for i in range(30)]  # every free chunk, the freed two too
            assert all(w.batch_store(more, [value(k) for k in more]))

        got, answered_locally = read(r, keys, delete_and_reuse, way=way, copier=fused_copier)
        assert answered_locally
        assert got == [None, None, value(keys[2]), value(keys[3])]
        assert r._index.stale == 2
        assert read(r, keys, way=way)[0] == [None, None, value(keys[2]), value(keys[3])]
        assert r.batch_exists(keys) == [False, False, True, True]


def test_a_copying_lookup_asked_of_the_server_is_leased_unasked(maru_server):
    """`lookup(keys, for_copy=True)` without `lease=True` where no local index answers (the
    request path): its hits are leased all the same, so a delete during the copy cannot free
    and reuse their chunks, and `release(confirm=True)` proves the copy. Before: no lease,
    the chunk was rewritten under the copy, and `corrupt()` and `release(confirm=True)` both
    vouched for another key's bytes."""
    with (
        handler(maru_server.url, pool_size="2M", local_index=False) as w,
        handler(maru_server.url, local_index=False) as r,
    ):
        assert w.store("k1", value("k1"))
        with r.lookup(["k1"], for_copy=True) as found:
            assert type(found).__name__ == "Lookup"  # (asked of the server)
            w.batch_delete(["k1"])
            more = [f"new{i}" for i in range(32)]  # every chunk of the writer's 2M
            w.batch_store(more, [value(k) for k in more])
            data = ctypes.string_at(int(found.addresses[0]), int(found.lengths[0]))
            bad = found.corrupt()
            held = found.release(confirm=True)
        assert data == value("k1") and not bad.any() and held
        assert r.batch_exists(["k1"]) == [True]  # (its delete waited for the lease)


@pytest.mark.parametrize("local_index", [True, False], ids=["index", "requests"])
def test_a_read_of_length_zero_finds_nothing_either_way(maru_server, local_index):
    """A miss's length is 0, so a read of 0 bytes took every miss for a copy on the request
    path (True for a key never written); the index said False. Both say False now."""
    with handler(maru_server.url, local_index=local_index) as h:
        assert h.store("k", value("k"))
        buf = np.zeros(16, np.uint8)
        rows = np.full((2, 1), buf.ctypes.data, np.int64)
        assert h.read(["never-written", "k"], rows, np.array([0], np.int64), length=0) == [
            False,
            False,
        ]


@pytest.mark.parametrize("local_index", [True, False], ids=["index", "requests"])
def test_a_read_whose_parts_do_not_add_up_to_its_length_is_refused_either_way(
    maru_server, local_index
):
    """`sizes` that add up to more than `length` made the request path copy past the
    caller's rows (a corrupted heap, a crash), and to less, copy part of the value and call it
    proven; the index path refused both. Both refuse them now, and bad pointers, alike."""
    with handler(maru_server.url, local_index=local_index) as h:
        assert h.store("rk", value("rk"))
        out = np.zeros(CHUNK, np.uint8)
        row = np.array([[out.ctypes.data]], np.int64)
        for sizes in ([2 * CHUNK], [100, 100], [], [-1, CHUNK + 1]):
            with pytest.raises(ValueError, match="sizes must be int64 parts"):
                h.read(["rk"], row, np.array(sizes, np.int64), length=CHUNK)
        with pytest.raises(ValueError, match="buffers must be int64"):
            h.read(["rk"], row.astype(np.float64), np.array([CHUNK], np.int64), length=CHUNK)
        with pytest.raises(ValueError, match="buffers must be int64"):
            h.read(["rk", "x"], row, np.array([CHUNK], np.int64), length=CHUNK)
        flat = np.array([out.ctypes.data], np.int64)  # (one part a key: a flat row is taken)
        assert h.read(["rk"], flat, np.array([CHUNK], np.int64), length=CHUNK) == [True]
        assert bytes(out) == value("rk")


@pytest.mark.parametrize("way", WAYS)
def test_reads_around_a_server_sigkill_and_restart_are_right_or_misses(
    maru_server, way, fused_copier
):
    keys = [f"k{i}" for i in range(16)]
    with handler(maru_server.url) as w, handler(maru_server.url) as r:
        assert all(w.batch_store(keys, [value(k) for k in keys]))
        old = r._index.path

        def restart() -> None:  # the reader holds the old table; the new server retires it
            maru_server.proc.kill()
            maru_server.proc.wait(10)
            maru_server.start(maru_server.port)

        got, _ = read(r, keys, restart, way=way, copier=fused_copier)
        assert got == [None] * 16  # copied across the restart: not proven
        assert not os.path.exists(old)
        got, _ = read(r, keys, way=way)  # the restarted server's table, the same regions
        assert got == [value(k) for k in keys]
        assert r._index.path != old and r.batch_exists(keys) == [True] * 16


def test_a_recreated_pool_never_serves_the_old_bytes(maru_server):
    keys = [f"k{i}" for i in range(16)]
    with handler(maru_server.url) as w, handler(maru_server.url) as r:
        assert all(w.batch_store(keys, [value(k, 1) for k in keys]))
        assert read(r, keys)[0] == [value(k, 1) for k in keys]
        maru_server.proc.kill()
        maru_server.proc.wait(10)
        maru_server.start(maru_server.port, once_args=["--no-restore"])
        assert r.batch_exists(keys) == [False] * 16  # the new server's table: empty
        assert all(w.batch_store(keys, [value(k, 2) for k in keys]))
        got, _ = read(r, keys)
        assert got == [value(k, 2) for k in keys]  # region tags differ: asked, then mapped


def test_a_key_read_through_the_index_survives_an_eviction_that_takes_an_unread_one(
    maru_server_factory,
):
    server = maru_server_factory(
        pool_size="16M",
        extra_args=["--eviction-high-watermark", "0.5", "--eviction-low-watermark", "0.4"],
    )
    old = [f"old{i}" for i in range(40)]
    with handler(server.url, pool_size="16M") as w, handler(server.url) as r:
        assert all(w.batch_store(old, [value(k) for k in old]))
        assert read(r, old[:10])[0] == [value(k) for k in old[:10]]  # used, locally only
        new = [f"new{i}" for i in range(100)]
        for i in range(0, 100, 10):  # past the high watermark: an eviction round
            assert all(w.batch_store(new[i : i + 10], [value(k) for k in new[i : i + 10]]))
        stats = MaruAdmin(server.url).stats()
        assert stats["counters"]["evictions"] > 10
        assert r.batch_exists(old[:10]) == [True] * 10  # second chance
        assert r.batch_exists(old[10:20]) == [False] * 10  # never read: evicted first


def test_no_index_without_the_unix_socket_or_with_no_local_index(maru_server_factory):
    plain = maru_server_factory(extra_args=["--no-local-index"])
    with handler(plain.url) as h:
        assert h._index is None
        assert type(h.lookup(["x"], for_copy=True)).__name__ == "Lookup"
    published = maru_server_factory()
    with handler(published.url, local_socket=False) as tcp:  # the reply came over TCP only
        assert tcp._index is None
    assert len(table_files(published.pool_path + ".index")) == 1


def test_views_taken_before_the_copy_are_proven_after_it(maru_server):
    """`lookup(keys, for_copy=True)` answered by the index, its views taken (`infos()`) before
    the copy, as a caller copying from views does: a key deleted and its chunk written again
    during the copy makes `release(confirm=True)` False. (Before: `infos()` checked the slots
    once, and the check after the copy passed without looking again: a proven copy of the new
    bytes.)"""
    keys = [f"v{i}" for i in range(4)]
    with handler(maru_server.url) as w:
        assert all(w.batch_store(keys, [value(k) for k in keys]))
        r = handler(maru_server.url)  # (after the store: it maps the writer's region at start)
        with r, r.lookup(keys, for_copy=True) as found:
            assert type(found).__name__ == "IndexLookup"
            views = found.infos()
            assert all(v is not None for v in views)
            assert w.delete(keys[0])
            w.confirm_writes()
            assert w.store("x-new", value("x-new"))  # (into the freed chunk, or elsewhere)
            copied = [bytes(v.view) for v in views]  # the copy, after the change
            assert not found.release(confirm=True)
            assert found.corrupt()[0]
        assert copied[1:] == [value(k) for k in keys[1:]]
