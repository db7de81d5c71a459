"""Copying many page parts at once: the data path's only loop over pages.

`copy_many(dst, src, size)` does `memmove(dst[i], src[i], size)` for every i, with the
addresses in int64 numpy arrays. The loop runs in C (`maru.client._memcopy`, built by
`pip install -e .` when a compiler is present) without the GIL; without the extension it is a
ctypes loop, correct but about a microsecond slower per part.

By default the C loop writes parts of 4 KiB or more that do not overlap with non-temporal
(streaming) stores on x86 and ends with a store fence: the bytes go to memory without first
pulling every destination line into the cache (why: `_memcopy.c`). `streaming=False` is plain
memmove (the benchmark's baseline).
"""

from __future__ import annotations

import ctypes
import logging

import numpy as np

log = logging.getLogger(__name__)

try:
    from maru.client._memcopy import STREAMING
    from maru.client._memcopy import copy_many as _c_copy_many
except ImportError:  # built without a C compiler
    _c_copy_many = None
    STREAMING = 0
    log.debug("maru.client._memcopy not built: page copies use a ctypes loop")

COMPILED = _c_copy_many is not None


def copy_many(dst: np.ndarray, src: np.ndarray, size: int, *, streaming: bool = True) -> None:
    """memmove `size` bytes from each address of `src` to the same index of `dst` (streaming
    stores where the C loop has them and the ranges do not overlap)."""
    if len(dst) != len(src):
        raise ValueError(f"copy_many: {len(dst)} destinations for {len(src)} sources")
    if _c_copy_many is not None:
        _c_copy_many(
            np.ascontiguousarray(dst, dtype=np.int64),
            np.ascontiguousarray(src, dtype=np.int64),
            size,
            streaming,
        )
        return
    memmove = ctypes.memmove
    for to, frm in zip(dst.tolist(), src.tolist()):
        memmove(to, frm, size)
