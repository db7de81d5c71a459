"""A server starting on a host of the pod whose cache may hold stale lines of the in-pool
table's header (its readers loaded them before; software coherence: nothing refreshes them)
reads the header from memory before it decides whether that table is current.

`retire_in_pool` retires the table an earlier start left only if its header says current (not
retired, of the mark's generation). Read through a stale line (`retired` set in an older table
there, another generation), a current table is left current: readers on other hosts go on
proving copies from it while the restarted server reuses pages. This machine is coherent, so
the test checks the header's lines are invalidated before they are read.
"""

from __future__ import annotations

from types import SimpleNamespace

from maru.client.localindex import LocalIndexClient
from maru.common import _shmindex
from maru.server.localindex import LocalIndex, retire_in_pool
from maru.server.pool import DevDaxPool

MiB = 1 << 20


def test_a_start_reads_the_earlier_tables_header_from_memory_before_judging_it(
    tmp_path, monkeypatch
):
    """Before: no line of the header invalidated; the table judged from whatever the cache
    held."""
    path = str(tmp_path / "dax")
    with open(path, "wb") as f:
        f.truncate(16 * MiB)
    pool = DevDaxPool(path, index_slots=1024)
    pool.generation = "gen-1"
    pool.write_mark(pool.generation, "epoch-1")
    earlier = LocalIndex("devdax", path, pool.generation, in_pool=pool)
    earlier.publish(["k"], [1], [0], [4096], regions={1: SimpleNamespace(token="ab" * 8)})
    reader = LocalIndexClient.in_pool(SimpleNamespace(local=path), earlier.offer())
    assert reader is not None
    invalidated: list[bytes] = []
    flush = _shmindex.flush_lines

    def spy(buffer, invalidate=False):
        if invalidate:
            with memoryview(buffer) as view:
                invalidated.append(bytes(view[:8]) if len(view) >= 128 else b"")
        return flush(buffer, invalidate)

    monkeypatch.setattr(_shmindex, "flush_lines", spy)
    assert retire_in_pool(DevDaxPool(path, index_slots=1024)) == 1
    assert b"MARUIDX1" in invalidated  # (the header's first two lines, before the read)
    assert reader._reader.retired
    earlier.table.writer.close()
    earlier.table.map.close()
