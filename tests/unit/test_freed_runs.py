"""A reply's `freed` notice read in C (`maru.common._freed.freed_runs`), against the same done in
Python: each page's first chunk, once, sorted by region, as arithmetic runs that hold exactly
those chunks."""

from __future__ import annotations

import random

import numpy as np
import pytest

from maru.common._freed import freed_runs


def _notice(pages: list[tuple[int, int]]) -> bytes:
    return np.array([(r, o, 4096) for r, o in pages], np.int64).reshape(-1, 3).tobytes()


def _expand(runs: list[tuple[int, int, int, int]]) -> list[tuple[int, int]]:
    return [(r, first + k * step) for r, first, step, count in runs for k in range(count)]


def test_a_notice_of_whole_runs_is_one_run_each():
    chunk = 1 << 16
    pages = [(7, o * chunk) for o in range(32, 48)] + [(7, o * chunk) for o in range(0, 16)]
    assert freed_runs(_notice(pages), chunk) == [(7, 0, 1, 16), (7, 32, 1, 16)]
    assert freed_runs(_notice([(3, 5 * chunk)]), chunk) == [(3, 5, 0, 1)]
    assert freed_runs(b"", chunk) == []


def test_random_notices_give_each_freed_chunk_once_in_order():
    rng = random.Random(5)
    for _ in range(500):
        chunk = rng.choice([1, 4096, 1 << 16, 3 << 20])
        pages = []
        for _ in range(rng.randint(1, 6)):  # (runs, as evictions free them, and strays)
            region, first = rng.randint(0, 3), rng.randint(0, 200)
            step, count = rng.choice([1, 1, 2, 5]), rng.randint(1, 20)
            pages += [(region, (first + k * step) * chunk) for k in range(count)]
        pages += [(rng.randint(0, 3), rng.randint(0, 400) * chunk + rng.randint(0, chunk - 1))]
        pages += rng.sample(pages, min(3, len(pages)))  # (given twice)
        rng.shuffle(pages)
        runs = freed_runs(_notice(pages), chunk)
        assert _expand(runs) == sorted({(r, o // chunk) for r, o in pages})
        assert all((step == 0) == (count == 1) and count >= 1 for _, _, step, count in runs)


def test_a_malformed_notice_is_refused():
    with pytest.raises(ValueError):
        freed_runs(b"\0" * 23, 4096)
    with pytest.raises(ValueError):
        freed_runs(b"", 0)
    with pytest.raises(TypeError):
        freed_runs("not bytes", 4096)


def test_offsets_at_the_ends_of_int64_are_read_as_python_reads_them():
    chunk = 4096
    pages = [(1, -(2**63)), (1, 2**63 - 1), (1, 0)]
    runs = freed_runs(_notice(pages), chunk)
    assert _expand(runs) == sorted({(r, o // chunk) for r, o in pages})
