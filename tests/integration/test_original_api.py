"""The original Maru client API, called the way LMCache 0.5.6's shipped `MaruBackend` calls it
(`lmcache/v1/storage_backend/maru_backend.py`): positional handles, `MaruConfig` with
`instance_id=None` and `auto_connect=False`, and reads by region id and page index through
`get_buffer_view`, across two real processes."""

from __future__ import annotations

import pytest

from maru import AllocHandle, MaruConfig, MaruHandler

from .workers import digest, make_value, run_processes

CHUNK = 64 << 10


def _connect(url: str) -> MaruHandler:
    # As MaruBackend._create_handler builds it: every keyword, instance_id None, connect().
    config = MaruConfig(
        server_url=url,
        instance_id=None,
        pool_size=8 << 20,
        chunk_size_bytes=CHUNK,
        auto_connect=False,
        timeout_ms=5000,
        use_async_rpc=True,
        max_inflight=64,
        eager_map=True,
    )
    handler = MaruHandler(config)
    if not handler.connect():
        raise RuntimeError(f"Failed to connect MaruHandler to {url}")
    return handler


def writer(url: str, keys: list[str], sizes: list[int]) -> dict:
    """Allocates, writes into `handle.buf`, stores by handle positionally: the first key with
    `store(key, handle)`, the rest with `batch_store(keys, handles)`."""
    h = _connect(url)
    try:
        assert h.get_chunk_size() == CHUNK
        handles = [h.alloc(size) for size in sizes]
        for i, (handle, size) in enumerate(zip(handles, sizes)):
            assert isinstance(handle, AllocHandle)
            handle.buf[:size] = make_value(i, size)
        first = h.store(keys[0], handles[0])
        rest = h.batch_store(keys[1:], handles[1:])
        spare = h.alloc(CHUNK)
        free_before = h.free_chunks()
        h.free(spare)
        return {
            "instance_id": h.instance_id,
            "ok": [first, *rest],
            "where": [(x.region_id, x.page_index) for x in handles],
            "freed_one": h.free_chunks() == free_before + 1,
            "digests": [digest(make_value(i, s)) for i, s in enumerate(sizes)],
        }
    finally:
        h.close()


def reader(url: str, keys: list[str]) -> dict:
    """Retrieves as `MaruBackend.get_blocking` does, then reads each value again through
    `get_buffer_view(region_id, page_index * chunk_size, len(view))`."""
    h = _connect(url)
    added: list[int] = []
    h.on_region_added(added.append)
    try:
        infos = [h.retrieve(keys[0]), *h.batch_retrieve(keys[1:])]
        out = {"where": [], "digests": [], "again": [], "pages": [], "lengths": []}
        for info in infos:
            chunk = h.get_chunk_size()
            view = h.get_buffer_view(info.region_id, info.page_index * chunk, len(info.view))
            out["where"].append((info.region_id, info.page_index))
            out["digests"].append(digest(info.view))
            out["again"].append(digest(view))
            out["pages"].append(h.get_region_page_count(info.region_id))
            out["lengths"].append(len(info.view))
        out["exists"] = [h.exists(keys[0]), h.batch_exists([*keys, "nope"])]
        out["pinned"] = [h.pin(keys[0]), h.batch_pin(keys[1:]), h.unpin(keys[0])]
        out["unpinned"] = h.batch_unpin(keys[1:])
        out["added"] = sorted(set(added))
        out["missing_view"] = h.get_buffer_view(10**6, 0, 1) is None
        return out
    finally:
        h.close()


def test_store_by_handle_in_one_process_read_by_location_in_another(maru_server_factory):
    server = maru_server_factory(pool_size="64M")
    sizes = [CHUNK, 1000, 3 * CHUNK - 5, 100_000]  # full and partial chunks
    keys = [f"lmcache@{i}" for i in range(len(sizes))]
    (a,) = run_processes([(writer, (server.url, keys, sizes))], 60)
    assert a["ok"] == [True] * len(keys)
    assert a["freed_one"]
    (b,) = run_processes([(reader, (server.url, keys))], 60)
    assert b["where"] == [tuple(w) for w in a["where"]]
    assert b["lengths"] == sizes  # partial chunks come back with their true size
    assert b["digests"] == a["digests"] and b["again"] == a["digests"]
    region_pages = (2 << 20) // CHUNK  # pool_size 8 MiB: a first region of 2 MiB
    assert b["pages"] == [region_pages] * len(keys)
    assert b["exists"] == [True, [True] * len(keys) + [False]]
    assert b["pinned"] == [True, [True] * (len(keys) - 1), True]
    assert b["unpinned"] == [True] * (len(keys) - 1)
    assert {rid for rid, _ in b["where"]} <= set(b["added"])  # the writer's region was added
    assert b["missing_view"]
    assert a["instance_id"]  # instance_id=None: a generated one


def test_store_keeps_data_as_a_keyword_and_rejects_both(maru_server):
    with MaruHandler(server_url=maru_server.url, pool_size="4M", chunk_size_bytes=CHUNK) as h:
        assert h.store("kw", data=b"bytes by keyword")
        assert h.store("pos", b"bytes by position")
        assert bytes(h.retrieve("kw").view) == b"bytes by keyword"
        assert h.batch_store(["p1", "p2"], [b"one", b"two"]) == [True, True]
        assert bytes(h.retrieve("p2").view) == b"two"
        handle = h.alloc(10)
        with pytest.raises(ValueError):
            h.store("both", b"x", handle=handle)
        with pytest.raises(ValueError):
            h.store("neither")


def _rewrite_freed_chunks(h: MaruHandler, r: MaruHandler, kept: str, kept_byte: bytes) -> None:
    """Four chunks reserved again (the freed ones among them, once `free_chunks` applied the
    server's notices) and stored as new0-3, each of its own byte; `r` then reads `kept` (all
    `kept_byte`) and each new key as its own bytes."""
    h.free_chunks()
    reused = [h.alloc(CHUNK) for _ in range(4)]
    for i, handle in enumerate(reused):
        handle.buf[:] = bytes([0x10 + i]) * CHUNK
    assert h.batch_store([f"new{i}" for i in range(4)], reused) == [True] * 4
    with r.leased([kept, *[f"new{i}" for i in range(4)]]) as infos:
        got = [bytes(info.view) for info in infos]
    assert got == [kept_byte * CHUNK, *[bytes([0x10 + i]) * CHUNK for i in range(4)]]


def test_a_handle_is_sealed_once(maru_server):
    """A handle stored under a second key, or stored after `free`, is refused (False, a
    WARNING): before, both were registered, and once one key went and its chunk was
    reserved again, the other read as a hit with the new value's bytes. A run sealed twice
    likewise."""
    with (
        MaruHandler(server_url=maru_server.url, pool_size="4M", chunk_size_bytes=CHUNK) as h,
        MaruHandler(server_url=maru_server.url, pool_size="4M", chunk_size_bytes=CHUNK) as r,
    ):
        a = h.alloc(CHUNK)
        a.buf[:] = b"\x01" * CHUNK
        assert h.store("a1", a) is True
        assert h.store("a2", a) is False  # (sealed already)
        c = h.alloc(CHUNK)
        c.buf[:] = b"\x03" * CHUNK
        h.free(c)
        assert h.store("c", c) is False  # (freed)
        run = h.alloc(CHUNK, 2)
        run.buf[:] = b"\x05" * (2 * CHUNK)
        assert h.seal(["r1", "r2"], run).wait() == [True, True]
        assert h.seal(["r3", "r4"], run).wait() == [False, False]
        assert h.delete("a1") and h.delete("r1")
        _rewrite_freed_chunks(h, r, "r2", b"\x05")
        assert r.batch_exists(["a2", "c", "r3", "r4"]) == [False] * 4


def test_a_handle_given_twice_in_one_store_is_sealed_once(maru_server):
    """The same handle (or a piece of a run given twice) under two keys of one `batch_store`:
    the first key is stored, the later ones fail (a WARNING). Before, all were registered on
    the same chunk, and once the first key was deleted and its chunk reserved and written
    again, the second read as a hit with the new value's bytes."""
    with (
        MaruHandler(server_url=maru_server.url, pool_size="4M", chunk_size_bytes=CHUNK) as h,
        MaruHandler(server_url=maru_server.url, pool_size="4M", chunk_size_bytes=CHUNK) as r,
    ):
        a = h.alloc(CHUNK)
        a.buf[:] = b"\x01" * CHUNK
        assert h.batch_store(["a1", "a2"], [a, a]) == [True, False]
        run = h.alloc(CHUNK, 2)
        run.buf[:] = b"\x05" * (2 * CHUNK)
        first, second = run.split()
        assert h.batch_store(["r1", "r2", "r3"], [first, second, run.split()[0]]) == [
            True,
            True,
            False,
        ]
        assert r.batch_exists(["a2", "r3"]) == [False, False]
        assert r.delete("a1") and r.delete("r1")
        _rewrite_freed_chunks(h, r, "r2", b"\x05")
        assert r.batch_exists(["a2", "r3"]) == [False, False]


def _alloc_at(h: MaruHandler, where: AllocHandle) -> AllocHandle:
    """A new one-chunk reservation on `where`'s chunk (free again: `h.free_chunks()` applied
    the server's notice), the others taken on the way given back."""
    h.free_chunks()
    taken = []
    try:
        for _ in range(256):
            handle = h.alloc(CHUNK)
            assert handle is not None
            if (handle.region_id, handle.offset) == (where.region_id, where.offset):
                return handle
            taken.append(handle)
        raise AssertionError(f"no reservation came on {where}")
    finally:
        for handle in taken:
            h.free(handle)


def _read(r: MaruHandler, keys: list[str]) -> list[bytes | None]:
    with r.leased(keys) as infos:
        return [None if info is None else bytes(info.view) for info in infos]


def test_a_stale_handle_is_refused_once_its_chunk_is_reserved_again(maru_server):
    """A handle freed, or sealed and its key deleted, whose chunk a later `alloc` reserved and
    wrote: storing it is refused (False, a WARNING), and the later reservation's own store
    succeeds. Before, the stale handle was taken for the new reservation (recognised by its
    first chunk): its key was registered over the new bytes, a hit with bytes never written
    under it, and the new value's store failed."""
    with (
        MaruHandler(server_url=maru_server.url, pool_size="4M", chunk_size_bytes=CHUNK) as h,
        MaruHandler(server_url=maru_server.url, pool_size="4M", chunk_size_bytes=CHUNK) as r,
    ):
        freed = h.alloc(CHUNK)
        freed.buf[:] = b"\x01" * CHUNK
        h.free(freed)
        again = _alloc_at(h, freed)
        again.buf[:] = b"\x02" * CHUNK
        assert h.store("freed", freed) is False
        assert h.seal(["freed-run"], freed).wait() == [False]  # (one handle: the run path)
        assert h.store("again", again) is True

        sealed = h.alloc(CHUNK)
        sealed.buf[:] = b"\x03" * CHUNK
        assert h.store("sealed", sealed) is True
        assert r.delete("sealed")
        reused = _alloc_at(h, sealed)
        reused.buf[:] = b"\x04" * CHUNK
        assert h.batch_store(["sealed-again", "reused"], [sealed, reused]) == [False, True]

        run = h.alloc(CHUNK, 3)
        run.buf[:] = b"\x05" * (3 * CHUNK)
        h.free(run.slice(1, 2))
        middle = _alloc_at(h, run.slice(1, 2))
        middle.buf[:] = b"\x06" * CHUNK
        pieces = run.split()
        assert h.seal(["run"], run.slice(1, 2)).wait() == [False]
        assert h.batch_store(
            ["p0", "p1", "middle", "p2"], [pieces[0], pieces[1], middle, pieces[2]]
        ) == [
            True,
            False,
            True,
            True,
        ]
        assert (
            r.batch_exists(["freed", "freed-run", "sealed", "sealed-again", "run", "p1"])
            == [False] * 6
        )
        assert _read(r, ["again", "reused", "p0", "middle", "p2"]) == [
            b"\x02" * CHUNK,
            b"\x04" * CHUNK,
            b"\x05" * CHUNK,
            b"\x06" * CHUNK,
            b"\x05" * CHUNK,
        ]


def test_a_handle_given_twice_in_one_seal_is_sealed_once(maru_server):
    """`seal(keys, [h, h])`, or a run and one of its values: the first key is sealed, the
    later one fails (a WARNING). Before, both keys were registered on one chunk: once the
    first was deleted and the chunk written again, the second read the new bytes."""
    with (
        MaruHandler(server_url=maru_server.url, pool_size="4M", chunk_size_bytes=CHUNK) as h,
        MaruHandler(server_url=maru_server.url, pool_size="4M", chunk_size_bytes=CHUNK) as r,
    ):
        twice = h.alloc(CHUNK)
        twice.buf[:] = b"\x01" * CHUNK
        assert h.seal(["x1", "x2"], [twice, twice]).wait() == [True, False]
        run = h.alloc(CHUNK, 2)
        run.buf[:] = b"\x05" * (2 * CHUNK)
        assert h.seal(["r", "r1"], [run.split()[0], run.slice(0, 2)]).wait() == [True, False]
        assert r.delete("x1") and r.delete("r")
        for deleted, byte in ((twice, 0x10), (run, 0x11)):
            handle = _alloc_at(h, deleted)
            handle.buf[:] = bytes([byte]) * CHUNK
            assert h.store(f"new{byte}", handle) is True
        assert r.batch_exists(["x2", "r1"]) == [False, False]
        assert _read(r, ["new16", "new17"]) == [b"\x10" * CHUNK, b"\x11" * CHUNK]


def test_a_length_past_the_handles_chunks_is_refused_and_its_chunks_come_back(maru_server):
    """`store(key, handle, length=...)` / `batch_store(..., lengths=...)` (or a `handle.size`
    set larger) past the value's own chunks is refused, that key alone (False, a WARNING,
    `refused_stores["value_size"]`), and its chunks come back. Before: True, the key
    registered over the next value's chunk too, and once that value was deleted and its
    chunk written again, the key read as a hit with the new value's bytes."""
    with (
        MaruHandler(server_url=maru_server.url, pool_size="4M", chunk_size_bytes=CHUNK) as h,
        MaruHandler(server_url=maru_server.url, pool_size="4M", chunk_size_bytes=CHUNK) as r,
    ):
        a, b = h.alloc(CHUNK), h.alloc(CHUNK)
        assert (b.region_id, b.offset) == (a.region_id, a.offset + CHUNK)  # b right after a
        a.buf[:], b.buf[:] = b"\x01" * CHUNK, b"\x02" * CHUNK
        assert h.store("b", b) is True
        free = h.free_chunks()
        assert h.store("long", a, length=2 * CHUNK) is False
        assert h.free_chunks() == free + 1  # a's chunk is back
        c, d = h.alloc(CHUNK), h.alloc(CHUNK)
        c.buf[:], d.buf[:] = b"\x03" * CHUNK, b"\x04" * CHUNK
        d.size = CHUNK + 1  # (a handle's size set past its chunk)
        assert h.batch_store(["c", "d"], [c, d], lengths=[CHUNK - 1, CHUNK + 1]) == [True, False]
        assert h.batch_store(["d2"], [d], lengths=[CHUNK]) == [False]  # (given back already)
        assert h.refused_stores["value_size"] == 2
        assert r.batch_exists(["long", "d", "d2"]) == [False] * 3
        assert r.delete("b")
        again = _alloc_at(h, b)
        again.buf[:] = b"\x10" * CHUNK
        assert h.store("again", again) is True
        assert _read(r, ["long", "c", "again"]) == [None, b"\x03" * (CHUNK - 1), b"\x10" * CHUNK]


def test_a_value_in_a_batch_of_handles_that_is_not_a_handle_fails_alone(maru_server):
    """`batch_store(keys, [handle, b"..."])`: the bytes' key fails (False, a WARNING,
    `value_type`), the handle is stored. Before: AttributeError from inside `seal`."""
    with MaruHandler(server_url=maru_server.url, pool_size="4M", chunk_size_bytes=CHUNK) as h:
        a = h.alloc(CHUNK)
        a.buf[:] = b"\x01" * CHUNK
        assert h.batch_store(["a", "bytes"], [a, b"not a handle"]) == [True, False]
        assert h.refused_stores["value_type"] == 1
        assert _read(h, ["a", "bytes"]) == [b"\x01" * CHUNK, None]


def test_a_free_of_a_handle_sealed_or_freed_before_frees_nothing(maru_server):
    """`free` of a handle freed before, or sealed, gives back nothing: before, it freed the
    chunk under whatever held it now (a later reservation being written, or the sealed
    key), and the next `alloc` wrote there: a hit with another value's bytes."""
    with (
        MaruHandler(server_url=maru_server.url, pool_size="4M", chunk_size_bytes=CHUNK) as h,
        MaruHandler(server_url=maru_server.url, pool_size="4M", chunk_size_bytes=CHUNK) as r,
    ):
        freed = h.alloc(CHUNK)
        h.free(freed)
        again = _alloc_at(h, freed)
        again.buf[:] = b"\x02" * CHUNK
        free = h.free_chunks()
        h.free(freed)  # a second free: `again` keeps its chunk
        assert h.free_chunks() == free
        sealed = h.alloc(CHUNK)
        sealed.buf[:] = b"\x03" * CHUNK
        assert h.store("sealed", sealed) is True
        h.free(sealed)  # sealed: the key keeps its chunk
        assert h.free_chunks() == free - 1
        later = [h.alloc(CHUNK) for _ in range(free - 1)]
        assert all(handle is not None for handle in later)
        taken = {(handle.region_id, handle.offset) for handle in later}
        assert not taken & {(again.region_id, again.offset), (sealed.region_id, sealed.offset)}
        for handle in later:
            handle.buf[:] = b"\x07" * CHUNK
        assert h.batch_store([f"later{i}" for i in range(len(later))], later) == [True] * len(later)
        assert h.store("again", again) is True
        assert _read(r, ["again", "sealed"]) == [b"\x02" * CHUNK, b"\x03" * CHUNK]


def test_a_seal_that_could_not_be_sent_gives_its_chunks_back_once(maru_server_factory):
    """A seal whose REGISTER_KV could not be sent (the server down) sealed nothing: its
    chunks come back at once, as a refused key's do, and a `free` of its handle after it
    gives back nothing more (a handle given to `seal` is not the caller's to free: it may
    be registered). Before, they stayed reserved until the caller freed the handle."""
    server = maru_server_factory(pool_size="64M")
    with MaruHandler(
        server_url=server.url, pool_size="4M", chunk_size_bytes=CHUNK, timeout_ms=1000
    ) as h:
        run, one = h.alloc(CHUNK, 2), h.alloc(CHUNK)
        free = h.free_chunks()
        server.halt()  # (the pool and state kept)
        assert h.seal(["r0", "r1"], run).wait() == [False, False]
        assert h.seal(["one"], [one]).wait() == [False]
        assert h.free_chunks() == free + 3
        h.free(run)
        h.free(one)
        assert h.free_chunks() == free + 3


def test_a_chunk_size_that_is_not_page_aligned_stores_and_reads_back(maru_server):
    """LMCache passes its full KV chunk in bytes (here 3 x 1000 + 7, as a small model's would
    be): taken, aligned to pages inside, and a chunk of that size round-trips."""
    chunk = 3007
    h = _connect_with(maru_server.url, chunk)
    try:
        assert h.get_chunk_size() % 4096 == 0 and h.get_chunk_size() >= chunk
        handles = [h.alloc(chunk) for _ in range(3)]
        for i, handle in enumerate(handles):
            handle.buf[:chunk] = make_value(i, chunk)
        assert h.batch_store(["u0", "u1", "u2"], handles) == [True] * 3
        infos = h.batch_retrieve(["u0", "u1", "u2"])
        assert [digest(i.view) for i in infos] == [digest(make_value(i, chunk)) for i in range(3)]
    finally:
        h.close()


def _connect_with(url: str, chunk: int) -> MaruHandler:
    config = MaruConfig(server_url=url, pool_size=8 << 20, chunk_size_bytes=chunk)
    return MaruHandler(config)


def test_a_value_off_the_readers_chunk_grid_has_no_page_index(maru_server):
    """`MemoryInfo.page_index` is all LMCache's MaruBackend keeps of a hit's place: it reads
    `get_buffer_view(region_id, page_index * chunk_size, ...)`. A value whose offset is not a
    multiple of the reader's chunk size (written with a smaller one, or pulled by the cluster
    tier) has page index -1, where that read finds nothing (a miss), never the chunk before
    it; its `view` is still its own bytes."""
    writer, reader = _connect_with(maru_server.url, 4096), _connect_with(maru_server.url, 16384)
    try:
        handles = [writer.alloc(4096) for _ in range(8)]
        for i, handle in enumerate(handles):
            handle.buf[:4096] = make_value(i, 4096)
        keys = [f"grid{i}" for i in range(8)]
        assert writer.batch_store(keys, handles) == [True] * 8
        infos = reader.batch_retrieve(keys)
        chunk = reader.get_chunk_size()
        on_grid = [h.offset % chunk == 0 for h in handles]
        assert any(on_grid) and not all(on_grid)
        assert [info.page_index >= 0 for info in infos] == on_grid
        for i, info in enumerate(infos):
            assert digest(info.view) == digest(make_value(i, 4096))
            view = reader.get_buffer_view(info.region_id, info.page_index * chunk, 4096)
            assert (view is not None and digest(view) == digest(info.view)) == on_grid[i]
    finally:
        writer.close()
        reader.close()


def test_get_stats_and_healthcheck_as_the_original_names_them(maru_server_factory):
    server = maru_server_factory(pool_size="64M")
    h = _connect(server.url)
    try:
        assert h.store("s", b"x" * 100)
        assert h.get_stats()["keys"] == 1
        assert h.healthcheck() is True
        server.stop()
        assert h.healthcheck() is False  # no answer: False, never an exception
    finally:
        h.close()
    assert h.healthcheck() is False


def test_data_operations_before_connect_and_after_close_raise_not_connected(maru_server):
    """As the original: a RuntimeError whose message starts "Not connected", not a None or a
    False that reads like a miss."""
    config = MaruConfig(server_url=maru_server.url, pool_size=8 << 20, auto_connect=False)
    h = MaruHandler(config)
    ops = {
        "alloc": lambda: h.alloc(100),
        "store": lambda: h.store("k", b"v"),
        "retrieve": lambda: h.retrieve("k"),
        "batch_retrieve": lambda: h.batch_retrieve(["k"]),
        "exists": lambda: h.exists("k"),
        "pin": lambda: h.pin("k"),
        "delete": lambda: h.delete("k"),
    }
    for op in ops.values():
        with pytest.raises(RuntimeError, match=r"^Not connected .*connect\(\) first"):
            op()
    assert h.connect()
    assert h.store("k", b"v") and bytes(h.retrieve("k").view) == b"v"
    h.close()
    for op in ops.values():
        with pytest.raises(RuntimeError, match=r"^Not connected .*was closed"):
            op()


def test_a_key_scope_goes_after_every_key_of_the_original_verbs(maru_server):
    """`set_key_scope` (what `CxlMemoryAdapter` sets to its layout): the original API's keyed
    verbs send `key + scope`, str and bytes keys alike; an unscoped handler sees the value
    only under that name; bad or empty keys are refused as before; a second, other scope is
    a ValueError (keys stored under the first would be lost to the handler)."""
    with _connect(maru_server.url) as scoped, _connect(maru_server.url) as plain:
        with pytest.raises(ValueError):
            scoped.set_key_scope("")
        with pytest.raises(ValueError):
            scoped.set_key_scope("x" * 65)
        scoped.set_key_scope("#kv:1")
        scoped.set_key_scope("#kv:1")  # the same again: nothing changes
        with pytest.raises(ValueError, match="scoped '#kv:1' already"):
            scoped.set_key_scope("#kv:2")
        assert scoped.key_scope == "#kv:1" and plain.key_scope == ""

        assert scoped.batch_store(["a", b"b"], datas=[b"A" * 10, b"B" * 20]) == [True, True]
        handle = scoped.alloc(5)
        assert handle is not None
        handle.buf[:5] = b"CCCCC"
        assert scoped.store("c", handle)
        assert scoped.store_outcomes(["", "d"], [b"x", b"D"])[0].name == "FAILED"
        assert plain.batch_exists(["a", b"b", "c", "d"]) == [False] * 4
        assert plain.batch_exists(["a#kv:1", b"b#kv:1", "c#kv:1", "d#kv:1"]) == [True] * 4
        assert [bytes(i.view) for i in plain.batch_retrieve(["a#kv:1", b"b#kv:1"])] == [
            b"A" * 10,
            b"B" * 20,
        ]
        assert bytes(scoped.retrieve("c").view) == b"CCCCC"
        assert scoped.exists(b"b") and scoped.batch_exists(["a", "zz"]) == [True, False]
        with scoped.leased(["a", "d"]) as infos:
            assert [bytes(i.view) for i in infos] == [b"A" * 10, b"D"]

        assert scoped.pin("a")
        assert plain.delete("a#kv:1") is False  # pinned under its scoped name
        assert scoped.unpin("a") and scoped.delete("a")
        assert plain.exists("a#kv:1") is False
        assert scoped.batch_delete([b"b", "c"]) == [True, True]
        assert plain.delete_prefix("d") == 1  # a prefix matches every scope's keys


def test_a_key_scope_is_set_before_the_handler_stores_or_pins(maru_server):
    """A scope set after the handler stored or pinned would lose those keys to it (its
    values missed, its pins never let go): a ValueError, the handler unchanged."""
    with _connect(maru_server.url) as stored, _connect(maru_server.url) as pinned:
        assert stored.store("early", b"E" * 10)
        with pytest.raises(ValueError, match="before this handler stores"):
            stored.set_key_scope("#kv:1")
        assert stored.key_scope == "" and bytes(stored.retrieve("early").view) == b"E" * 10
        assert pinned.pin("early")
        with pytest.raises(ValueError, match="before this handler stores"):
            pinned.set_key_scope("#kv:1")
        assert pinned.unpin("early") and pinned.key_scope == ""
        pinned.set_key_scope("#kv:1")  # (nothing held any more)
        assert pinned.key_scope == "#kv:1"
