"""The registry's key index: key -> KeyEntry, oldest first (the order eviction walks).

`KeyIndex` and `KeyEntry` are the C types from `maru.server._keyindex` (built with the
package): the index's batch calls (`get_many`, `add_entries`, `lookup_columns`) overlap the
cache misses of a batch's probes, which at 10^6 keys are most of a lookup's cost, and
`batch_fits` / `add_entries` (the insert and, `grouped`, the new keys counted per region and
length: `length_groups`), `lookup_columns`, `release_entries` and `clock_victims` do a
REGISTER_KV's, a LOOKUP_KV's, a RELEASE's and an eviction round's per-key work without a Python
step per key (the "K" record is packed in C too: `pack_record`, `maru.server.journal`). The
index takes only str and bytes keys (a lookup of anything else is a miss) and adds keys only
with `add_entries` (the first writer of a key wins). Its pure-Python model, which the tests
check it against, is `tests/unit/keyindex_model.py`.
"""

from __future__ import annotations

from maru.server._keyindex import (
    KeyEntry,
    KeyIndex,
    batch_fits,
    entry_locations,
    length_groups,
    release_entries,
)

__all__ = [
    "KeyEntry",
    "KeyIndex",
    "batch_fits",
    "entry_locations",
    "length_groups",
    "release_entries",
]
