"""Issue 42, "room is ready before a writer asks": an instance that holds its `pool_size` of
regions, all full, makes room for a whole batch with one EVICT_FOR in its own regions (it used
to ask once per value), never evicting a leased key, and the bytes read back are the bytes
written: the new batch's, and the older keys' that were not evicted."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from maru import MaruHandler
from maru.client.supply import AHEAD_WRITES
from maru.common.protocol import MsgType

from .workers import KiB, MiB, digest, make_value

CHUNK = 64 * KiB
CAP = 8 * MiB  # the instance's pool_size: 128 chunks
FULL = CAP // CHUNK
BATCH = 8  # 512 KiB: a 16th of the instance (it keeps AHEAD_WRITES batches of room ready)


def full_instance(url: str, size: int = CHUNK) -> MaruHandler:
    """An instance whose `pool_size` of regions is all taken and holds keys `old/0..127`
    (one value of `size` bytes in each 64 KiB chunk, stored in batches, oldest first)."""
    h = MaruHandler(server_url=url, pool_size=CAP, chunk_size_bytes=CHUNK, timeout_ms=10_000)
    assert h.connected
    for first in range(0, FULL, BATCH):
        keys = [f"old/{i}" for i in range(first, first + BATCH)]
        assert h.batch_store(keys, [make_value(i, size) for i in range(first, first + BATCH)])
    assert sum(r.length for r in h.list_allocations()) == CAP
    assert h._chunks.free_chunks() == 0
    return h


def count_evictions(h: MaruHandler) -> list[int]:
    """Count `h`'s asks for room from now on: [all, EVICT_FOR requests]. An ask is an
    EVICT_FOR (the supply sends them) or a REGISTER_KV carrying "ahead" (a write's seal that
    asks its next writes' room, with no request of its own)."""
    sent = [0, 0]
    supply, session = h._supply, h._s
    request: Callable[..., Any] = supply._request
    seal: Callable[..., Any] = session.request

    def counting(msg_type: MsgType, body: dict[str, Any]) -> Any:
        if msg_type == MsgType.EVICT_FOR:
            sent[0] += 1
            sent[1] += 1
        return request(msg_type, body)

    def sealing(msg_type: MsgType, body: dict[str, Any]) -> Any:
        if msg_type == MsgType.REGISTER_KV and body.get("ahead"):
            sent[0] += 1
        return seal(msg_type, body)

    supply._request = counting
    session.request = sealing
    return sent


def read_back(h: MaruHandler, keys: list[str]) -> list[str | None]:
    """Each key's digest as read under a lease (None: a miss)."""
    with h.leased(keys) as infos:
        return [None if info is None else digest(info.view) for info in infos]


def test_a_full_instance_makes_room_for_a_batch_with_one_eviction(maru_server_factory):
    """Each batch of a full instance asks for room once (it was once per page): the first,
    with an EVICT_FOR it waits for, for itself and the next AHEAD_WRITES batches; each later
    one, with its seal (no request of its own), for what that room lacks."""
    server = maru_server_factory(pool_size="64M")
    h = full_instance(server.url)
    rounds = h.stats()["counters"]["eviction_rounds"]
    sent = count_evictions(h)

    written: dict[str, str] = {}
    for batch in range(2):
        keys = [f"new/{batch}/{i}" for i in range(BATCH)]
        values = [make_value(1000 * (batch + 1) + i, CHUNK) for i in range(BATCH)]
        assert h.batch_store(keys, values) == [True] * BATCH
        assert sent == [batch + 1, 1]  # one ask per batch; one EVICT_FOR in all
        written.update((k, digest(v)) for k, v in zip(keys, values))
    assert h.stats()["counters"]["eviction_rounds"] == rounds + 2
    assert read_back(h, list(written)) == list(written.values())
    old = read_back(h, [f"old/{i}" for i in range(FULL)])
    # the least recently used pages made the room: two batches' and the next ones'
    gone = (2 + AHEAD_WRITES) * BATCH
    assert old[:gone] == [None] * gone
    assert old[gone:] == [digest(make_value(i, CHUNK)) for i in range(gone, FULL)]

    # values of differing sizes (placed one by one, more than a 16th of the instance: no
    # room made ahead), more than the room kept free: one request for all of them
    sizes = [CHUNK // 2 + i for i in range(2 * BATCH)] + [2 * CHUNK - i for i in range(BATCH)]
    assert sum(-(-size // CHUNK) for size in sizes) > h._chunks.free_chunks()
    keys = [f"mixed/{i}" for i in range(len(sizes))]
    values = [make_value(5000 + i, size) for i, size in enumerate(sizes)]
    assert h.batch_store(keys, values) == [True] * len(keys)
    assert sent[0] == 3
    assert read_back(h, keys) == [digest(v) for v in values]
    assert read_back(h, list(written)) == list(written.values())  # (read last: not evicted)
    h.close()


def test_room_around_leased_keys_takes_one_request_and_spares_them(maru_server_factory):
    """The batch's room is freed around keys another instance holds under a lease: the freed
    chunks are not one run, the values go one by one into them with no further request,
    and the leased keys' bytes are unchanged."""
    server = maru_server_factory(pool_size="64M")
    h = full_instance(server.url)
    reader = MaruHandler(server_url=server.url, pool_size="1M", timeout_ms=10_000)
    leased_keys = [f"old/{i}" for i in range(0, FULL, 2)]  # every other key
    sent = count_evictions(h)
    with reader.leased(leased_keys) as infos:
        assert all(info is not None for info in infos)
        keys = [f"new/{i}" for i in range(BATCH)]
        values = [make_value(3000 + i, CHUNK) for i in range(BATCH)]
        assert h.batch_store(keys, values) == [True] * BATCH
        assert sent[0] == 1
        assert [digest(info.view) for info in infos] == [
            digest(make_value(i, CHUNK)) for i in range(0, FULL, 2)
        ]
    assert read_back(h, keys) == [digest(v) for v in values]
    old = read_back(h, [f"old/{i}" for i in range(FULL)])
    assert [old[i] for i in range(1, 2 * BATCH, 2)] == [None] * BATCH  # the unleased went
    assert [old[i] for i in range(0, FULL, 2)] == [
        digest(make_value(i, CHUNK)) for i in range(0, FULL, 2)
    ]
    reader.close()
    h.close()


def test_room_for_values_short_of_a_chunk_evicts_no_more_keys_than_it_needs(
    maru_server_factory,
):
    """The server counts an eviction's bytes by keys' lengths: room for a batch of 60,000-byte
    values (in 64 KiB chunks) is asked in their bytes, so each batch evicts as many keys as
    it writes (in chunks' bytes it would evict one key more every 15)."""
    server = maru_server_factory(pool_size="64M")
    size = 60_000
    h = full_instance(server.url, size)
    evicted = h.stats()["counters"]["evictions"]
    sent = count_evictions(h)
    batches = 4
    for batch in range(batches):
        keys = [f"new/{batch}/{i}" for i in range(BATCH)]
        values = [make_value(7000 + 100 * batch + i, size) for i in range(BATCH)]
        assert h.batch_store(keys, values) == [True] * BATCH
        assert read_back(h, keys) == [digest(v) for v in values]
    assert sent[0] == batches
    # the batches' room and the next ones', exactly
    assert h.stats()["counters"]["evictions"] - evicted == (batches + AHEAD_WRITES) * BATCH
    old = read_back(h, [f"old/{i}" for i in range(FULL)])
    keep = range((batches + AHEAD_WRITES) * BATCH, FULL)
    assert [old[i] for i in keep] == [digest(make_value(i, size)) for i in keep]
    h.close()


def test_a_full_instance_writing_behind_finds_its_room_ready(maru_server_factory):
    """Write-behind (as `MaruStorage` writes), a full instance's batches after the first find
    their run free: the eviction each sends ahead is taken in during the next one's copy, so
    none looks for room (`RegionSupply.reserve`: waits for an eviction's reply) and none
    evicts for itself. Every batch reads back as written."""
    import numpy as np

    from maru.client import Put, values_at

    server = maru_server_factory(pool_size="64M")
    h = full_instance(server.url)
    sent = count_evictions(h)
    supply = h._supply
    slow: list[int] = []
    reserve = supply.reserve
    supply.reserve = lambda size, count: slow.append(count) or reserve(size, count)  # type: ignore[method-assign]
    written: dict[str, str] = {}
    batches = 12  # the share 1.5 times over
    for batch in range(batches):
        keys = [f"behind/{batch}/{i}" for i in range(BATCH)]
        values = [make_value(9000 + 100 * batch + i, CHUNK) for i in range(BATCH)]
        data = np.frombuffer(b"".join(values), np.uint8)
        pointers = data.ctypes.data + CHUNK * np.arange(BATCH, dtype=np.int64)
        put = Put(keys, CHUNK, values_at(pointers.reshape(-1, 1), [CHUNK]))
        h.put([put], behind=True)
        assert put.results == [True] * BATCH
        if batch == 0:  # (the first found no room: it evicted for itself and the next ones)
            assert slow == [BATCH]
            slow.clear()
        written.update((k, digest(v)) for k, v in zip(keys, values))
    assert slow == []
    assert sent[0] <= batches
    assert h.confirm_writes() == 0
    recent = list(written)[-(FULL // BATCH - AHEAD_WRITES - 1) * BATCH :]
    assert read_back(h, recent) == [written[k] for k in recent]
    h.close()


def test_a_write_whose_work_beside_its_copy_raises_finishes_the_copy_first(
    maru_server_factory, monkeypatch
):
    """A write begins its copy, then does its other work (the seal's preparation, the room
    ahead, earlier replies) while the copy runs. If that work raises, the copy is finished
    before the exception leaves the write, while its pages are mapped. Before, the copy begun
    stayed in the exception's traceback, and whoever dropped that traceback ran the rest of
    it, maybe after the region was unmapped and its addresses reused by other memory (a copy
    under 1 MiB is all the caller's: nothing was in the pages when the exception came out)."""
    import ctypes

    import numpy as np

    from maru.client import Put, values_at, writes

    server = maru_server_factory(pool_size="64M")
    targets: list[np.ndarray] = []
    begin = writes._c_copy_values_start

    def recorded(target: np.ndarray, *args: Any) -> Any:
        targets.append(target.copy())
        return begin(target, *args)

    def raises(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("the work beside the copy failed")

    monkeypatch.setattr(writes, "_c_copy_values_start", recorded)
    monkeypatch.setattr(writes.Writes, "_while_copying", raises)
    values = [make_value(7000 + i, CHUNK) for i in range(4)]
    data = np.frombuffer(b"".join(values), np.uint8)
    pointers = data.ctypes.data + CHUNK * np.arange(4, dtype=np.int64)
    with MaruHandler(server_url=server.url, pool_size="16M", chunk_size_bytes=CHUNK) as h:
        put = Put([f"k/{i}" for i in range(4)], CHUNK, values_at(pointers.reshape(-1, 1), [CHUNK]))
        kept = None
        try:
            h.put([put])
        except RuntimeError as exc:
            kept = exc  # (its traceback keeps the write's frames, the copy begun among them)
        assert kept is not None and len(targets) == 1
        landed = [ctypes.string_at(int(address), CHUNK) for address in targets[0]]
        assert [digest(v) for v in landed] == [digest(v) for v in values]
        del kept
