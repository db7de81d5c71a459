"""`StorageStats`: calls are recorded without a lock and folded when read, never lost."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from maru_sglang.storage_stats import FOLD_EVERY, StorageStats


def _batch(pool: str, results: list[bool]) -> SimpleNamespace:
    return SimpleNamespace(
        pool=SimpleNamespace(name=pool, page_bytes=100), keys=["k"] * len(results), results=results
    )


def test_calls_from_two_threads_are_all_counted_and_the_records_stay_bounded():
    stats = StorageStats(enable_metrics=True)
    calls = 3 * FOLD_EVERY + 7

    def work(reading: bool) -> None:
        for _ in range(calls):
            stats.record([_batch("kv", [True, False, True])], 0.001, reading)

    threads = [threading.Thread(target=work, args=(r,)) for r in (True, False)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(stats.calls) <= FOLD_EVERY  # folded on the way, not kept for ever
    counters = stats.counters
    assert counters["hits"] == 2 * calls and counters["misses"] == calls
    assert counters["pages_written"] == 2 * calls
    assert counters["bytes_written"] == counters["bytes_read"] == 200 * calls
    assert counters["pools"]["kv"]["hits"] == 2 * calls
    assert not stats.calls
    assert len(stats._prefetch_pgs) == len(stats._backup_pgs) == calls  # a sample per call


def test_a_waiting_record_keeps_no_batch_alive():
    """A record waits up to FOLD_EVERY calls; it keeps a tally of each batch, not the batch
    (its caller's keys, host pointers and results): kept, they grew the heap into untouched
    memory, page faults in SGLang's calling thread on every call until a fold."""
    import weakref

    class Batch(SimpleNamespace):
        pass

    stats = StorageStats(enable_metrics=True)
    batch = Batch(**vars(_batch("kv", [True, False])))
    gone = weakref.ref(batch)
    stats.record([batch], 0.001, reading=True)
    del batch
    assert len(stats.calls) == 1 and gone() is None
    assert stats.counters["hits"] == 1 and stats.counters["misses"] == 1
