"""Copying many page parts at once: the data path's only loop over pages, in C
(`maru.common._memcopy`) without the GIL.

Parts of 4 KiB or more that do not overlap are written with non-temporal stores on x86, then a
store fence (why: `_memcopy.c`); `streaming=False` is plain memmove (the benchmarks' baseline).
The pool is a file others can truncate, fill (SIGBUS) or unmap (SIGSEGV) under a copy, so each
value is copied under a guard (`_memcopy.c`): a value whose memory faults is not copied, the
rest are, and the call raises `CopyFaultError` naming the faulted values: their store fails,
their read is a miss, the process lives. In software coherence mode (`maru.client.coherence`)
the same loops also write back what they store and invalidate what they read.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# page_pointers (see its C docstring) is exported as it is: numpy's slice, cast, multiply and
# add around it would cost more than its arithmetic from cold caches.
from maru.common._memcopy import (
    COPY_VALUES,  # (its C loop, for the local index's read)
    STREAMING,
    CopyFaultError,
    guard_faults,
    page_pointers,
)
from maru.common._memcopy import copier_counts as _c_copier_counts
from maru.common._memcopy import copy_many as _c_copy_many
from maru.common._memcopy import copy_many_hashed as _c_copy_many_hashed
from maru.common._memcopy import copy_values as _c_copy_values
from maru.common._memcopy import copy_values_start as _c_copy_values_start

__all__ = [
    "COPY_VALUES",
    "STREAMING",
    "CopyFaultError",
    "CopyStarted",
    "copier_tasks",
    "copiers_called_off",
    "copy_many",
    "copy_many_hashed",
    "copy_values",
    "copy_values_start",
    "faulted",
    "guard_faults",
    "page_pointers",
]


def faulted(exc: CopyFaultError) -> np.ndarray:
    """The values (or buffers) a `CopyFaultError` says were not copied, as a bool array."""
    return np.frombuffer(exc.faulted, np.uint8).astype(bool)


def copy_many(
    dst: np.ndarray, src: np.ndarray, size: int | Sequence[int], *, streaming: bool = True
) -> None:
    """memmove `size` bytes from each address of `src` to the same index of `dst`. `dst` and
    `src` may be (values, parts) arrays with `size` one per part: copied value by value, each
    value's parts in order (a source whose parts lie back to back is read in address order)."""
    dst = np.ascontiguousarray(dst, dtype=np.int64)
    src = np.ascontiguousarray(src, dtype=np.int64)
    if dst.shape != src.shape:
        raise ValueError(f"copy_many: {dst.shape} destinations for {src.shape} sources")
    if np.ndim(size) == 0:  # (a numpy integer too)
        size = int(size)  # type: ignore[arg-type]
    else:
        per_part = np.asarray(size, dtype=np.int64)
        if dst.ndim != 2 or per_part.shape != (dst.shape[1],):
            raise ValueError(f"copy_many: {per_part.size} sizes for buffers {dst.shape}")
        size = np.tile(per_part, dst.shape[0])
    _c_copy_many(dst.ravel(), src.ravel(), size, streaming)


def copy_values(
    starts: np.ndarray,
    buffers: np.ndarray,
    sizes: Sequence[int] | np.ndarray,
    *,
    to_values: bool,
    hashed: bool = False,
    streaming: bool = True,
    threads: int = 1,
) -> np.ndarray | None:
    """Copy values stored as their parts back to back (KV pages in the pool) to or from the
    parts' buffers elsewhere: value i starts at `starts[i]` (0: a miss, skipped), its part j is
    `sizes[j]` bytes at `starts[i] + sum(sizes[:j])`, the other side `buffers[i, j]`.
    `to_values`: buffers -> values (a store), else values -> buffers. `hashed`
    (`maru_checksums`): returns each value's maru64 as copied (0 where skipped), else None.
    `threads` (`maru_copy_threads`): the caller and up to `threads - 1` copier threads."""
    starts, buffers, sizes = _value_columns(starts, buffers, sizes)
    out = _c_copy_values(starts, buffers, sizes, to_values, streaming, hashed, threads)
    return np.frombuffer(out, np.int64) if hashed else None


def _value_columns(
    starts: np.ndarray, buffers: np.ndarray, sizes: Sequence[int] | np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    starts = np.ascontiguousarray(starts, dtype=np.int64)
    buffers = np.ascontiguousarray(buffers, dtype=np.int64)
    sizes = np.ascontiguousarray(sizes, dtype=np.int64)
    if buffers.shape != (starts.size, sizes.size):
        raise ValueError(
            f"copy_values: buffers {buffers.shape} for {starts.size} values of {sizes.size} parts"
        )
    return starts, buffers, sizes


class CopyStarted:
    """A `copy_values_start` copy. `finish()` returns what `copy_values` returns; the bytes
    are in place only once it has returned (a write registers its keys after it)."""

    __slots__ = ("_flight", "_hashed", "_result")

    def __init__(self, flight: object | None, hashed: bool, result: np.ndarray | None = None):
        self._flight, self._hashed, self._result = flight, hashed, result

    def finish(self) -> np.ndarray | None:
        if self._flight is not None:
            out = self._flight.finish()  # type: ignore[attr-defined]
            self._flight = None
            self._result = np.frombuffer(out, np.int64) if self._hashed else None
        return self._result


def copy_values_start(
    starts: np.ndarray,
    buffers: np.ndarray,
    sizes: Sequence[int] | np.ndarray,
    *,
    to_values: bool,
    hashed: bool = False,
    streaming: bool = True,
    threads: int = 1,
) -> CopyStarted:
    """`copy_values` begun: the copier threads (`threads` > 1) start on it now; `finish()` does
    the caller's part and waits for theirs (one thread: copied here). `starts`, `buffers` and
    the bytes they point at must stay as they are until `finish()` returns."""
    if threads <= 1:
        result = copy_values(
            starts, buffers, sizes, to_values=to_values, hashed=hashed, streaming=streaming
        )
        return CopyStarted(None, hashed, result)
    starts, buffers, sizes = _value_columns(starts, buffers, sizes)
    flight = _c_copy_values_start(starts, buffers, sizes, to_values, streaming, hashed, threads)
    return CopyStarted(flight, hashed)


def copier_tasks() -> int:
    """Times this process has asked a copier thread to share a copy: for tests."""
    return _c_copier_counts()[0]


def copiers_called_off() -> int:
    """Of `copier_tasks`, those called off before the copier woke (the caller took the rest)."""
    return _c_copier_counts()[1]


def copy_many_hashed(
    dst: np.ndarray, src: np.ndarray, sizes: np.ndarray | list[int], *, streaming: bool = True
) -> np.ndarray:
    """`copy_many` of (values, parts) int64 addresses, `sizes` one per column or per buffer,
    returning each value's maru64 (its parts' bytes in order, read from `src`) as int64."""
    src = np.ascontiguousarray(src, dtype=np.int64)
    dst = np.ascontiguousarray(dst, dtype=np.int64)
    if src.ndim != 2 or dst.shape != src.shape:
        raise ValueError(f"copy_many_hashed: {dst.shape} destinations for {src.shape} sources")
    values, parts = src.shape
    if not parts:  # values of no bytes: each hashed as one empty part, nothing copied
        empty = np.zeros(values, np.int64)
        return np.frombuffer(_c_copy_many_hashed(None, empty, empty, 1, streaming), np.int64)
    sizes = np.broadcast_to(np.asarray(sizes, dtype=np.int64), src.shape)
    out = _c_copy_many_hashed(dst.ravel(), src.ravel(), sizes.ravel(), parts, streaming)
    return np.frombuffer(out, np.int64)
