"""`maru_sglang.hit_policy`: the arithmetic of `MaruStorage.batch_exists_v2` on presence
arrays alone (no server, no SGLang). The same policies through the real SGLang host pools and
a server: integration/test_sglang_hybrid.py."""

from __future__ import annotations

import logging

import numpy as np

from maru_sglang.hit_policy import (
    ALL_PAGES,
    BLOCK_GROUPS,
    TRAILING_PAGES,
    PoolPresence,
    all_pages,
    block_group_pages,
    leading_run,
    trailing_pages,
    usable_prefix,
)


def bits(text: str) -> np.ndarray:
    """'11.1' -> [True, True, False, True]; spaces only group the digits for the reader."""
    return np.array([c == "1" for c in text if c != " "], dtype=bool)


def lengths(ok: np.ndarray) -> list[int]:
    return np.flatnonzero(ok).tolist()


def test_leading_run_counts_from_the_start():
    """Over v2's answers (an array of bools)."""

    def run(text: str) -> int:
        return leading_run(bits(text))

    assert run("") == 0
    assert run("111") == 3
    assert run("11.1") == 2
    assert run(".111") == 0
    assert run("1.") == 1
    assert run("...") == 0


def test_all_pages_stops_at_the_first_hole_and_at_the_kv_prefix():
    assert lengths(all_pages(bits("1111"), 4, 4)) == [1, 2, 3, 4]
    assert lengths(all_pages(bits("11.1"), 4, 4)) == [1, 2]
    assert lengths(all_pages(bits("1111"), 2, 4)) == [1, 2]  # never past the KV hit
    assert lengths(all_pages(bits(""), 0, 0)) == []


def test_trailing_pages_needs_the_window_that_ends_each_length():
    # A Mamba state (window 1) at pages 4 and 8 (1-based): restorable lengths 4 and 8.
    assert lengths(trailing_pages(bits("...1...1"), 8, 8, 1)) == [4, 8]
    # An SWA window of 2: lengths whose last two pages both exist.
    assert lengths(trailing_pages(bits("11.111"), 6, 6, 2)) == [1, 2, 5, 6]
    assert lengths(trailing_pages(bits("111"), 3, 3, 1)) == [1, 2, 3]
    assert lengths(trailing_pages(bits(""), 0, 0, 1)) == []  # length 0 is never a hit


def test_a_window_longer_than_the_prefix_needs_every_page_of_the_prefix():
    assert lengths(trailing_pages(bits("111"), 3, 3, 8)) == [1, 2, 3]
    assert lengths(trailing_pages(bits("1.1"), 3, 3, 8)) == [1]


def test_block_groups_count_leading_complete_groups(caplog):
    assert block_group_pages(bits("11 11 11"), 2, 4, "c4") == 12
    assert block_group_pages(bits("11 1. 11"), 2, 4, "c4") == 4  # a hole ends the run
    assert block_group_pages(bits("11 1"), 2, 4, "c4") == 4  # an incomplete group: not yet
    assert block_group_pages(bits(""), 2, 4, "c4") == 0
    assert not caplog.records


def test_bad_block_groups_geometry_is_zero_with_an_error(caplog):
    with caplog.at_level(logging.ERROR, logger="maru_sglang"):
        assert block_group_pages(bits("1111"), 0, 4, "c4") == 0
        assert block_group_pages(bits("1111"), 2, -1, "c4") == 0
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "pool c4: BLOCK_GROUPS needs group_pages and block_pages > 0 (got 0, 4)",
        "pool c4: BLOCK_GROUPS needs group_pages and block_pages > 0 (got 2, -1)",
    ]


def test_usable_prefix_of_nothing_is_zero():
    assert usable_prefix(bits(""), [], "kv") == (0, {}, [])
    assert usable_prefix(bits("...."), [], "kv") == (0, {}, [])


def test_usable_prefix_with_every_page_present():
    pools = [
        PoolPresence("indexer", ALL_PAGES, bits("1111")),
        PoolPresence("mamba", TRAILING_PAGES, bits("1111")),
    ]
    assert usable_prefix(bits("1111"), pools, "kv") == (
        4,
        {"kv": 4, "indexer": 4, "mamba": 4},
        [1, 2, 3, 4],
    )


def test_usable_prefix_is_cut_by_every_gating_pool():
    pools = [
        PoolPresence("indexer", ALL_PAGES, bits("11111.11")),  # holes cut at 5
        PoolPresence("mamba", TRAILING_PAGES, bits("...1...1")),  # states at 4 and 8
    ]
    final, hits, restorable = usable_prefix(bits("1111111."), pools, "kv")  # KV: 7 pages
    assert (final, restorable) == (4, [4])
    assert hits == {"kv": 7, "indexer": 5, "mamba": 4}


def test_block_groups_report_their_own_verdict_and_never_gate():
    pools = [PoolPresence("c4", BLOCK_GROUPS, bits("11 .1"), group_pages=2, block_pages=4)]
    assert usable_prefix(bits("11"), pools, "kv") == (2, {"kv": 2, "c4": 4}, [1, 2])
    bad = [PoolPresence("c4", BLOCK_GROUPS, bits("11"), group_pages=0, block_pages=4)]
    assert usable_prefix(bits("11"), bad, "kv") == (2, {"kv": 2}, [1, 2])


def test_an_unregistered_pool_or_an_unknown_policy_restores_nothing(caplog):
    with caplog.at_level(logging.ERROR, logger="maru_sglang"):
        missing = [PoolPresence("mamba", TRAILING_PAGES, None)]
        assert usable_prefix(bits("111"), missing, "kv") == (0, {"kv": 3}, [])
        odd = [PoolPresence("x", "every_other_page", bits("111"))]
        assert usable_prefix(bits("111"), odd, "kv") == (0, {"kv": 3}, [])
    assert [r.getMessage() for r in caplog.records] == [
        "batch_exists_v2: pool mamba was never registered",
        "batch_exists_v2: pool x has unknown hit policy every_other_page",
    ]
