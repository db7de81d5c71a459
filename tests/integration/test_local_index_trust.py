"""What a reader may trust of the local index's /dev/shm table after its server is gone
(docs/reliability.md, "Reads through the local index"): a starting server retires every table
an earlier one left, whatever became of that table's use-bits file, so that a reader still
mapping it proves no copy once the pool can change."""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np

from maru.client.localindex import _open
from maru.common.shmindex import NCOLS, USE_SUFFIX, region_tag
from maru.server.localindex import LocalIndex, retire_earlier

TOKEN = "0123456789abcdef" * 2
REGIONS = {1: SimpleNamespace(token=TOKEN)}


def test_a_start_retires_an_earlier_table_whose_use_file_was_cut_short(tmp_path):
    """A killed server's table whose use bits are gone (the file is 0660 with `--pool-group`:
    a member may truncate it; a server that then marks a slot dies of SIGBUS): the next start
    still retires the table, so a reader's hit from it is not proven. Before: the table was
    removed unretired, and the reader's hit stayed proven while the new server reused pages."""
    pool = str(tmp_path / "pool")
    killed = LocalIndex("shm", pool, "gen-1")  # as a SIGKILL leaves it: never retired
    keys = [f"k{i}" for i in range(8)]
    killed.publish(keys, [1] * 8, [4096 * i for i in range(8)], [100] * 8, regions=REGIONS)
    reader = _open(killed.path, os.getuid())
    assert reader is not None
    regions = np.array([[1, 1 << 40, 1 << 30, region_tag(TOKEN)]], np.int64)
    columns = np.frombuffer(reader.probe(keys, regions), np.int64).reshape(NCOLS, len(keys))
    slots, seqs = columns[5].tobytes(), columns[6].tobytes()
    assert reader.changed(slots, seqs) is None  # every hit proven while the table is current

    os.truncate(killed.path + USE_SUFFIX, 0)
    assert retire_earlier("shm", pool) == 1  # the next start, before the pool can change

    assert reader.retired, "a table left current: its readers go on proving copies"
    assert reader.changed(slots, seqs) == b"\x01" * len(keys)  # no copy proven by it
    killed.table = None  # (its files are gone)
