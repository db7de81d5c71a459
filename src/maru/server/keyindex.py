"""The registry's key index: key -> KeyEntry, oldest first (the order eviction walks).

The C types and batch calls of `maru.server._keyindex`, which do a REGISTER_KV's, a
LOOKUP_KV's, a RELEASE's and an eviction round's per-key work without a Python step per key
(why: docs/architecture.md, "Key index"). The index takes only str and bytes keys and adds
keys only with `add_entries` (the first writer of a key wins). Its pure-Python model, which
the tests check it against, is `tests/unit/keyindex_model.py`.
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
