"""maru64, the page checksum of `maru_checksums`: one hash for writers and readers alike.

Written for Maru (no library's code). The C loop in `maru.common._memcopy` (scalar, AVX2 or
AVX-512: the same value) hashes while it copies, so a checksum costs no second read of the
page from memory; the definition is at the top of its hash section (a numpy reference the
tests check it against: `tests/unit/maru64.py`).

It detects accidental corruption (stray writes, reused, zeroed or truncated pages, flipped
bits, moved blocks), not an adversary: whoever can write the pool can also register keys.
A checksum is never 0: on the wire 0 means "stored without one".
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from maru.common._memcopy import copy_many_hashed as _c_hashed


def checksums(views: Sequence[memoryview]) -> np.ndarray:
    """The maru64 of each view's bytes as int64s (the wire's column type), read where they
    lie (no copy): one C call for all of them."""
    addresses = np.array([_address(v) for v in views], np.int64)
    sizes = np.array([v.nbytes for v in views], np.int64)
    return checksums_at(addresses, sizes)


def checksums_at(addresses: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """`checksums` of the bytes at int64 `addresses`, `sizes` long, in memory this process
    maps (for a caller that knows the addresses: no view to make per value)."""
    return np.frombuffer(_c_hashed(None, addresses, sizes, 1), np.int64)


def _address(view: memoryview) -> int:
    """The address of a contiguous view's first byte (read-only views too)."""
    return np.frombuffer(view, np.uint8).ctypes.data if view.nbytes else 0
