"""The registry's batch paths (one C-level pass per check, per-region bookkeeping) against the
key-by-key ones: REGISTER_KV, DELETE_KV, eviction, LOOKUP_KV and EXISTS give the same statuses
and leave the same keys, region counters, counters, journal records and freed-page notices;
and a journal they wrote replays to the same state (as do journals of the older forms)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from maru.common.protocol import MAX_KEY_BYTES, DeleteStatus, RegisterStatus, freed_notices
from maru.server import persistence
from maru.server.journal import Journal
from maru.server.pool import ShmPool
from maru.server.registry import Registry

from .registry_calls import lease
from .test_eviction_leases import MiB, consistent, make_registry
from .test_journal import SIGNER, Env, state

REG, EXISTS, REJ = (int(s) for s in RegisterStatus)


class Recorder:
    """A journal that keeps its records."""

    def __init__(self) -> None:
        self.records: list[Any] = []

    def append(self, record: Any) -> None:
        self.records.append(record)


def setup(tmp_path, name: str, **kw) -> tuple[Registry, Recorder, list[int]]:
    """A registry with three regions: two of A's (page size 4096), one of B's (unknown page
    size); every change recorded."""
    (tmp_path / name).mkdir()
    reg = make_registry(tmp_path / name, **kw)
    reg.instances.handshake("A", 1, chunk_size=4096)
    rids = [reg.request_region("A", 2 * MiB).region_id for _ in range(2)]
    rids.append(reg.request_region("B", 2 * MiB).region_id)
    reg.journal = journal = Recorder()
    return reg, journal, rids


def full_state(reg: Registry) -> dict:
    """Everything the batch paths touch, in the order it is kept."""
    return {
        "keys": [
            (k, e.region_id, e.offset, e.length, e.pins, e.leases, e.referenced)
            for k, e in reg.keys.items()
        ],
        "regions": {
            rid: (r.returned, r.live_keys, r.live_bytes, r.live_pages)
            for rid, r in reg.regions.items()
        },
        "live_bytes": reg.live_bytes,
        "pool_used": reg.pool.used,
        "counters": dict(reg.counters),
        "instances": {
            iid: (
                i.keys_registered,
                i.bytes_registered,
                i.hits,
                i.misses,
                i.exists_hits,
                i.exists_misses,
                i.evicted,
                freed_notices(bytes(i.freed)),
                sorted(lease - reg.leases.first_id for lease in i.leases),  # (random start)
            )
            for iid, i in reg.instances.items()
        },
    }


def recounted(reg: Registry) -> None:
    """Each region's live_* counters are those of the keys in it (beyond `consistent`)."""
    for rid, region in reg.regions.items():
        lengths = [e.length for e in reg.keys.values() if e.region_id == rid]
        pages = sum(region.pages_for(n) for n in lengths)
        assert (region.live_keys, region.live_bytes, region.live_pages) == (
            len(lengths),
            sum(lengths),
            pages,
        ), rid


def as_rows(records: list[Any]) -> list[Any]:
    """Journal records with "K" (a registration, four columns) spelled in its form before
    protocol 2: one [key, region_id, offset, length] row per key."""
    return [["K", [list(row) for row in zip(*r[1:])]] if r[0] == "K" else r for r in records]


def as_old_columnar(records: list[Any]) -> list[Any]:
    """... and as the "C" records of then: one region and one length per record."""
    out = []
    for record in records:
        if record[0] == "K":
            _, keys, region_ids, offsets, lengths = record
            record = ["C", keys, region_ids[0], offsets, lengths[0]]
            if len(set(region_ids)) > 1 or len(set(lengths)) > 1:
                record = as_rows([["K", keys, region_ids, offsets, lengths]])[0]
        out.append(record)
    return out


def random_batch(rnd: random.Random, rids: list[int], clean: bool) -> tuple:
    """(keys, region_ids, offsets, lengths) for `register`. Mostly one region and one length
    (the usual batch); a clean batch has only valid keys and locations (it may repeat keys,
    or name registered ones); otherwise anything a client could send: bad keys, offsets and
    lengths, regions not the caller's, or none."""
    n = rnd.randint(1, 40)
    length = rnd.choice([100, 4096, 5000, 8192])
    rid = rids[0] if rnd.random() < 0.8 else rids[1]
    keys: list[Any] = [f"k{rnd.randrange(300)}" for _ in range(n)]
    if rnd.random() < 0.3:
        keys[rnd.randrange(n)] = f"k{rnd.randrange(300)}".encode()  # bytes beside str
    region_ids, lengths = [rid] * n, [length] * n
    if rnd.random() < 0.2:  # several regions and lengths in one batch
        region_ids = [rnd.choice(rids[:2]) for _ in range(n)]
        lengths = [rnd.choice([100, 4096, 5000, 8192]) for _ in range(n)]
    offsets = [rnd.randrange(0, 2 * MiB - size + 1) for size in lengths]
    if rnd.random() < 0.1:
        i = rnd.randrange(n)
        offsets[i] = 2 * MiB - lengths[i]  # exactly at the end: fine
    if not clean:
        bad_keys = [
            7,
            None,
            "x" * (MAX_KEY_BYTES + 1),
            "é" * (MAX_KEY_BYTES // 2 + 1),  # short enough in chars, too long encoded
            "y" * (MAX_KEY_BYTES // 4 + 1),  # long but valid: needs encoding to tell
            b"z" * (MAX_KEY_BYTES + 1),
        ]
        for _ in range(rnd.randint(1, 3)):
            i, what = rnd.randrange(n), rnd.random()
            if what < 0.4:
                keys[i] = rnd.choice(bad_keys)
            elif what < 0.7:
                offsets[i] = rnd.choice([-1, 2 * MiB - lengths[i] + 1])
            elif what < 0.85:
                lengths[i] = rnd.choice([0, -5, 2 * MiB + 1])
            else:
                region_ids[i] = rnd.choice([rids[2], 999])  # B's region, or none
        if rnd.random() < 0.1:  # the whole batch in B's region, or none
            region_ids = [rnd.choice([rids[2], 999])] * n
    return keys, region_ids, offsets, lengths


def exercise(rnd: random.Random, reg: Registry, register) -> list[Any]:
    """Random traffic with `register(reg, keys, region_ids, offsets, lengths)` as the
    registration: lookups (CLOCK bits), leases held for a while, deletes, registrations that
    evict (with low watermarks). Returns every result, for comparison."""
    rids = sorted(reg.regions)
    out: list[Any] = []
    leases: list[int] = []
    for i in range(150):
        batch = random_batch(rnd, rids, rnd.random() < 0.6)
        out.append(register(reg, *batch))
        probe = [f"k{rnd.randrange(300)}" for _ in range(10)]
        out.append(reg.lookup(probe, "B", lease=i % 3 == 0)[:3])
        out.append(reg.exists(probe[:5], "B"))
        if i % 3 == 0:
            leases.append(max(reg.leases, default=0))
        if len(leases) > 4:
            out.append(reg.leases.release([leases.pop(0)], "B"))
        if i % 7 == 0:
            out.append(reg.delete([f"k{rnd.randrange(300)}" for _ in range(15)]))
        if i % 11 == 0:
            out.append(reg.instances.take_freed("A"))
    return out


def by_batch(reg: Registry, keys, region_ids, offsets, lengths) -> list[int]:
    return reg.register("A", keys, region_ids, offsets, lengths)


def by_key_bad_offset(reg: Registry, keys, region_ids, offsets, lengths) -> list[int]:
    """`register` forced onto its key-by-key path: one more key, with a bad offset."""
    statuses = reg.register(
        "A", [*keys, "extra"], [*region_ids, region_ids[0]], [*offsets, -1], [*lengths, 1]
    )
    assert statuses[-1] == REJ
    return statuses[:-1]


def by_key_other_region(reg: Registry, keys, region_ids, offsets, lengths) -> list[int]:
    """... or one more key in a region that does not exist."""
    statuses = reg.register("A", [*keys, "extra"], [*region_ids, 999], [*offsets, 0], [*lengths, 1])
    assert statuses[-1] == REJ
    return statuses[:-1]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("reference", [by_key_bad_offset, by_key_other_region])
def test_the_batch_registration_matches_the_per_key_path(tmp_path, seed, reference):
    """Same random traffic through `register` as it comes (the usual batch takes the batch
    path) and forced onto its key-by-key path: same results every step, same state, the same
    journal."""
    small = dict(pool_mib=8, high=0.1, low=0.05)  # evict above 0.8 MiB, down to 0.4
    bulk, bulk_journal, _ = setup(tmp_path, "bulk", **small)
    ref, ref_journal, _ = setup(tmp_path, "ref", **small)
    got = exercise(random.Random(seed), bulk, by_batch)
    want = exercise(random.Random(seed), ref, reference)
    assert got == want
    assert full_state(bulk) == full_state(ref)
    assert bulk_journal.records == ref_journal.records
    assert bulk.counters["evictions"] > 0 and bulk.counters["keys_duplicate"] > 0
    consistent(bulk)
    recounted(bulk)


def test_duplicates_within_a_batch_first_occurrence_wins(tmp_path):
    reg, journal, (rid, _, _) = setup(tmp_path, "r")
    assert reg.register("A", ["old"], [rid], [0], [100]) == [REG]
    old = reg.keys["old"]
    keys = ["k", "x", "k", "old", "y", "x", b"k"]
    offsets = [4096, 8192, 12288, 16384, 20480, 24576, 28672]
    got = reg.register("A", keys, [rid] * 7, offsets, [100] * 7)
    assert got == [REG, REG, EXISTS, EXISTS, REG, EXISTS, REG]
    assert reg.keys["old"] is old and old.offset == 0  # the first writer's entry, untouched
    assert [reg.keys[k].offset for k in ("k", "x", "y", b"k")] == [4096, 8192, 20480, 28672]
    assert reg.counters["keys_duplicate"] == 3
    assert reg.counters["keys_registered"] == 5
    region = reg.regions[rid]
    assert (region.live_keys, region.live_bytes, region.live_pages) == (5, 500, 5)
    assert reg.instances["A"].keys_registered == 5
    new_keys, new_offsets = ["k", "x", "y", b"k"], [4096, 8192, 20480, 28672]
    assert journal.records[-1] == ["K", new_keys, [rid] * 4, new_offsets, [100] * 4]


def populated(tmp_path, name: str) -> tuple[Registry, Recorder, list[str]]:
    """Keys spread over A's two regions and B's (interleaved), one of A's returned (its freeing
    deferred), some with a CLOCK bit; the journal cleared."""
    reg, journal, rids = setup(tmp_path, name, pool_mib=64, high=1.0, low=1.0)
    names = [f"k{i}" for i in range(90)]
    for i, key in enumerate(names):
        rid = rids[i % 3]
        owner = "B" if rid == rids[2] else "A"
        length = 5000 if i % 5 else 100  # pages: 2 or 1 in A's regions
        assert reg.register(owner, [key], [rid], [i * 8192], [length]) == [REG]
    reg.exists(names[::4])
    handle = reg.regions[rids[1]].handle()
    reg.return_region("A", handle.region_id, handle.token)
    reg.instances.take_freed("A"), reg.instances.take_freed("B")
    journal.records.clear()
    return reg, journal, names


def same_drop(bulk: Registry, bulk_journal: Recorder, ref: Registry, ref_journal: Recorder):
    """What dropping in one batch and one key at a time must agree on: the state (freed
    notices and their order included), and the journal but for how the "D" records split."""
    assert full_state(bulk) == full_state(ref)
    assert [r for r in bulk_journal.records if r[0] != "D"] == [
        r for r in ref_journal.records if r[0] != "D"
    ]
    dropped = [k for r in bulk_journal.records if r[0] == "D" for k in r[1]]
    assert dropped == [k for r in ref_journal.records if r[0] == "D" for k in r[1]]
    consistent(bulk)
    recounted(bulk)


@pytest.mark.parametrize("clean", [True, False], ids=["batch", "with-busy-missing-repeated"])
def test_delete_over_several_regions_matches_one_by_one(tmp_path, clean):
    bulk, bulk_journal, names = populated(tmp_path, "bulk")
    ref, ref_journal, _ = populated(tmp_path, "ref")
    keys: list[Any] = random.Random(1).sample(names, len(names))
    if not clean:
        for reg in (bulk, ref):
            reg.pins.pin([keys[3]], "A")
            lease(reg, [keys[5]], "B")
        keys += ["missing", keys[0], 42]
    got = bulk.delete(keys)
    assert got == [s for k in keys for s in ref.delete([k])]
    assert got.count(DeleteStatus.DELETED) == (90 if clean else 88)
    same_drop(bulk, bulk_journal, ref, ref_journal)
    busy = set() if clean else {keys[3], keys[5]}
    in_live_region = [k for k in names if int(k[1:]) % 3 == 0 and k not in busy]
    assert sorted(o for _, o, _ in freed_notices(bytes(bulk.instances["A"].freed))) == sorted(
        int(k[1:]) * 8192 for k in in_live_region
    )
    if clean:  # A's returned region went with its last key: "F" after the one "D"
        assert [r[0] for r in bulk_journal.records] == ["D", "F"]
        assert not bulk.keys and len(bulk.regions) == 2


def test_delete_that_frees_several_returned_regions_frees_them_in_key_order(tmp_path):
    bulk, bulk_journal, names = populated(tmp_path, "bulk")
    ref, ref_journal, _ = populated(tmp_path, "ref")
    rids = sorted(bulk.regions)  # A's live region, A's returned one, B's
    for reg, journal in ((bulk, bulk_journal), (ref, ref_journal)):
        reg.instances.disconnect("B")  # B's region returned too: two regions wait for their keys
        journal.records.clear()
    # B's keys but two, A's returned region's, some of A's live region's, B's last two: B's
    # region is emptied last although its keys come first.
    b_keys, a_returned = names[2::3], names[1::3]
    keys = b_keys[2:] + a_returned + names[0:30:3] + b_keys[:2]
    assert bulk.delete(keys) == [s for k in keys for s in ref.delete([k])]
    same_drop(bulk, bulk_journal, ref, ref_journal)
    assert bulk_journal.records[1:] == [["F", rids[1]], ["F", rids[2]]]
    assert sorted(bulk.regions) == [rids[0]]


def test_eviction_over_several_regions_matches_deleting_the_victims_one_by_one(tmp_path):
    bulk, bulk_journal, names = populated(tmp_path, "bulk")
    ref, ref_journal, _ = populated(tmp_path, "ref")
    for reg in (bulk, ref):
        lease(reg, names[10:14], "B")  # busy: skipped by eviction
    bulk.eviction.high_watermark = bulk.eviction.low_watermark = (
        0.001  # of a 64 MiB pool: keep ~67 KB
    )
    freed_bytes = bulk.eviction.to_watermark()
    (record,) = [r for r in bulk_journal.records if r[0] == "D"]
    victims = record[1]
    assert len(victims) > 40 and freed_bytes == ref.live_bytes - bulk.live_bytes
    assert len({ref.keys[k].region_id for k in victims}) == 3
    for key in victims:  # the same keys, in the same order, one at a time
        assert ref.delete([key]) == [DeleteStatus.DELETED]
    b, r = full_state(bulk), full_state(ref)
    assert b["regions"] == r["regions"] and b["live_bytes"] == r["live_bytes"]
    assert b["instances"]["A"][7] == r["instances"]["A"][7]  # freed notices, in order
    assert b["instances"]["B"][7] == r["instances"]["B"][7]
    assert len(b["instances"]["A"][7]) > 10 and len(b["instances"]["B"][7]) > 10
    # Eviction reorders keys and clears bits (second chances): compare the rest.
    assert {k: v[:5] for k, *v in b["keys"]} == {k: v[:5] for k, *v in r["keys"]}
    assert bulk.counters["evictions"] == len(victims) == ref.counters["keys_deleted"]
    assert bulk.instances["A"].evicted == sum(int(k[1:]) % 3 != 2 for k in victims)
    assert bulk.instances["B"].evicted == sum(int(k[1:]) % 3 == 2 for k in victims)
    assert [x for x in bulk_journal.records if x[0] != "D"] == [
        x for x in ref_journal.records if x[0] != "D"
    ]
    consistent(bulk)
    recounted(bulk)


@pytest.mark.parametrize("seed", range(3))
def test_lookup_and_exists_match_the_per_key_rules(tmp_path, seed):
    """The batch lookup (one call into the key index) against the rules spelled out key by
    key on a twin registry: hits, CLOCK bits, lease counts, counters, lease ids."""
    bulk, _, names = populated(tmp_path, "bulk")
    ref, _, _ = populated(tmp_path, "ref")
    rnd = random.Random(seed)
    pool = [*names, "missing", b"k1", "k1"]
    for i in range(30):
        keys = [rnd.choice(pool) for _ in range(rnd.randint(0, 20))]
        lease = i % 2 == 0
        *columns, checksums, handles, lease_id = bulk.lookup(keys, "B", lease)
        rids, offsets, lengths = (memoryview(c).cast("q").tolist() for c in columns)
        assert not any(memoryview(checksums).cast("q"))  # stored without checksums
        hits = [ref.keys.get(k) for k in keys]  # what a lookup does, one key at a time
        locations = [[e.region_id, e.offset, e.length] if e else None for e in hits]
        held = [e for e in hits if e is not None]
        for entry in held:
            entry.referenced = True
            entry.leases += lease
        ref.counters["lookups"] += len(keys)
        ref.counters["hits"] += len(held)
        ref.counters["misses"] += len(keys) - len(held)
        ref.instances["B"].hits += len(held)
        ref.instances["B"].misses += len(keys) - len(held)
        ref_lease = ref.leases.add(held, "B") if lease and held else 0
        ref_handles = {e.region_id for e in held}
        assert [[r, o, n] if r else None for r, o, n in zip(rids, offsets, lengths)] == locations
        assert sorted(h.region_id for h in handles) == sorted(ref_handles)
        # (lease ids start at a random point in each registry)
        assert (lease_id and lease_id - bulk.leases.first_id) == (
            ref_lease and ref_lease - ref.leases.first_id
        )
        assert bool(lease_id) == bool(ref_lease)
        if lease_id and i % 4 == 0:
            assert bulk.leases.release([lease_id], "B") == ref.leases.release([ref_lease], "B") == 1
        probe = [rnd.choice(pool) for _ in range(10)]
        assert bulk.exists(probe, "B") == [k in ref.keys for k in probe]
        for k in probe:  # what exists does, one key at a time
            if k in ref.keys:
                ref.keys[k].referenced = True
        ref.counters["exists"] += len(probe)
        hits = sum(k in ref.keys for k in probe)
        ref.counters["exists_hits"] += hits
        ref.counters["exists_misses"] += len(probe) - hits
        ref.instances["B"].exists_hits += hits
        ref.instances["B"].exists_misses += len(probe) - hits
        assert full_state(bulk) == full_state(ref)
    consistent(bulk)
    recounted(bulk)


def test_keys_neither_str_nor_bytes_are_misses(tmp_path):
    """Even those a dict would match (a memoryview equals and hashes like its bytes), or
    could not hash; what the service never lets through, for direct callers."""
    reg, _, names = populated(tmp_path, "r")
    assert reg.register("A", [b"bk"], [sorted(reg.regions)[0]], [0], [100]) == [REG]
    odd = [["not", "hashable"], memoryview(b"bk"), 7]
    assert reg.exists([names[0], *odd, b"bk"]) == [True, False, False, False, True]
    assert reg.delete([names[0], *odd]) == [DeleteStatus.DELETED] + [DeleteStatus.NOT_FOUND] * 3
    assert b"bk" in reg.keys


# -- journal ----------------------------------------------------------------------------------


def bulk_traffic(reg: Registry) -> None:
    """Registrations (clean, repeated, partly bad, over several regions), batch deletes (clean and
    not), evictions across regions, a returned region freed by deleting its keys."""
    for iid in ("A", "B"):
        reg.instances.handshake(iid, 1, chunk_size=4096)
    rids = [reg.request_region("A", 2 * MiB).region_id for _ in range(2)]
    rid_b = reg.request_region("B", 2 * MiB).region_id
    rnd = random.Random(5)
    for i in range(40):
        rid = rids[i % 2]
        batch = random_batch(rnd, [rid, rid, rid_b], clean=i % 3 != 0)
        reg.register("A", *batch)
        if i % 4 == 0:
            keys = [f"b{i}-{j}" for j in range(20)]
            reg.register("B", keys, [rid_b] * 20, [0] * 20, [3000] * 20)
        if i % 5 == 0:
            reg.delete([f"k{rnd.randrange(300)}" for _ in range(20)])
        if i % 6 == 0:
            reg.eviction.evict_for("A", 100_000)
    handle = reg.regions[rids[1]].handle()
    reg.return_region("A", handle.region_id, handle.token)
    reg.delete([k for k, e in reg.keys.items() if e.region_id == rids[1]])  # T ... D, F
    assert rids[1] not in reg.regions


def test_journal_replay_after_bulk_operations_reproduces_the_state(tmp_path):
    env = Env(tmp_path)
    reg = env.open()
    bulk_traffic(reg)
    expected = state(reg)
    assert len(reg.keys) > 100
    env.close()
    records = Journal(env.state_dir).load()[1]
    assert {r[0] for r in records} >= {"R", "K", "D", "T", "F"}
    assert state(env.open()) == expected
    env.close()


def test_records_replay_twice_and_the_records_before_protocol_2_still_replay(tmp_path):
    env = Env(tmp_path)
    reg = env.open()
    bulk_traffic(reg)
    expected = state(reg)
    env.close()
    _, records = Journal(env.state_dir).load()
    assert "K" in {r[0] for r in records}
    doubled = [x for r in records for x in ([r] if r[0] == "R" else [r, r])]
    fresh = Registry(ShmPool(str(tmp_path / "pool"), 32 * MiB), SIGNER)
    persistence.restore(fresh, None, doubled)
    assert state(fresh) == expected
    # A state dir written before protocol 2 (registrations as rows, or as "C" records of one
    # region and one length) replays the same.
    for old_form in (as_rows, as_old_columnar):
        old = Registry(ShmPool(str(tmp_path / "pool"), 32 * MiB), SIGNER)
        persistence.restore(old, None, old_form(records))
        assert state(old) == expected, old_form.__name__
    assert "C" in {r[0] for r in as_old_columnar(records)}
