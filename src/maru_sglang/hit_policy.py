"""The hit policies of `MaruStorage.batch_exists_v2` (docs/sglang.md, Hit policies): pure
functions over presence arrays, testable without a server or SGLang. A hybrid model's KV
prefix is usable only as far as every sidecar pool can restore it, each by its own rule
(SGLang's `PoolHitPolicy`); sidecar pages are stored under the hash of their KV page.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

# The values of SGLang's PoolHitPolicy, a str Enum: its members compare equal to these.
ALL_PAGES = "all_pages"
TRAILING_PAGES = "trailing_pages"
BLOCK_GROUPS = "block_groups"


@dataclasses.dataclass(frozen=True)
class PoolPresence:
    """One sidecar pool's share of the existence answer. `present`: per looked-up page (the
    pool's own keys for BLOCK_GROUPS); None: never registered. `policy`: SGLang's or its value."""

    name: str
    policy: Any
    present: np.ndarray | None
    window: int = 1  # TRAILING_PAGES: pages that must end the prefix
    group_pages: Any = 0  # BLOCK_GROUPS geometry, as SGLang passes it
    block_pages: Any = 0


def leading_run(present: np.ndarray) -> int:
    """Number of True from the start."""
    missing = np.flatnonzero(~present)
    return int(missing[0]) if missing.size else int(present.size)


def all_pages(present: np.ndarray, kv_pages: int, n: int) -> np.ndarray:
    """`ok[p]` (p = 0..n): a pool page exists for each of the first p KV pages (p > 0)."""
    ok = np.zeros(n + 1, dtype=bool)
    ok[1 : leading_run(present[:kv_pages]) + 1] = True
    return ok


def trailing_pages(present: np.ndarray, kv_pages: int, n: int, window: int) -> np.ndarray:
    """`ok[p]` (p = 0..n): the `window` pool pages ending at page p all exist (fewer when
    p < window), p <= kv_pages and p > 0."""
    missing = np.concatenate(([0], np.cumsum(~present[:kv_pages])))
    lengths = np.arange(kv_pages + 1)
    ok = np.zeros(n + 1, dtype=bool)
    starts = np.maximum(0, lengths - window)
    ok[: kv_pages + 1] = (missing[lengths] - missing[starts]) == 0
    ok[0] = False
    return ok


def block_group_pages(present: np.ndarray, group_pages: Any, block_pages: Any, name: str) -> int:
    """KV pages covered by the leading complete groups of a BLOCK_GROUPS pool; 0, with an
    error logged, for a geometry that is not positive."""
    group, block = int(group_pages), int(block_pages)
    if group <= 0 or block <= 0:
        log.error(
            "pool %s: BLOCK_GROUPS needs group_pages and block_pages > 0 (got %d, %d)",
            name,
            group,
            block,
        )
        return 0
    whole = present.size // group
    groups = present[: whole * group].reshape(whole, group).all(axis=1)
    return leading_run(groups) * block


def usable_prefix(
    kv_present: np.ndarray, pools: Sequence[PoolPresence], kv_name: str
) -> tuple[int, dict[str, int], list[int]]:
    """SGLang's `PoolTransferResult` fields for `kv_present` (per KV page hash, in order) and
    the sidecars' answers: the usable prefix, the pages each pool (KV: `kv_name`) restores on
    its own (none: left out), and every restorable prefix length. A pool never registered
    restores nothing; BLOCK_GROUPS is the pool's own verdict and never shortens the KV hit."""
    n = int(kv_present.size)
    kv_pages = leading_run(kv_present)
    hit_pages: dict[str, int] = {kv_name: kv_pages} if kv_pages else {}
    restorable = np.zeros(n + 1, dtype=bool)  # restorable[p]: a prefix of p pages works
    restorable[1 : kv_pages + 1] = True
    for pool in pools:
        if pool.present is None:
            log.error("batch_exists_v2: pool %s was never registered", pool.name)
            restorable[:] = False
            continue
        if pool.policy == BLOCK_GROUPS:
            covered = block_group_pages(pool.present, pool.group_pages, pool.block_pages, pool.name)
            if covered:
                hit_pages[pool.name] = covered
            continue
        if pool.policy == ALL_PAGES:
            ok = all_pages(pool.present, kv_pages, n)
        elif pool.policy == TRAILING_PAGES:
            ok = trailing_pages(pool.present, kv_pages, n, pool.window)
        else:
            log.error("batch_exists_v2: pool %s has unknown hit policy %s", pool.name, pool.policy)
            ok = np.zeros(n + 1, dtype=bool)
        own = np.flatnonzero(ok)
        if own.size:
            hit_pages[pool.name] = int(own[-1])
        restorable &= ok
    lengths = np.flatnonzero(restorable)
    return (int(lengths[-1]) if lengths.size else 0), hit_pages, lengths.tolist()
