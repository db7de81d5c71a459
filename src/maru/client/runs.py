"""A client's chunk allocator: `ExtentAllocator` with runs. A write reserves its values as one
run of equal extents (`allocate_run`), kept as one record however many values it holds; each
value can still be freed on its own, and what stays allocated of a run stays a run. So a batch
costs a few Python steps to reserve and, when the server evicts it, to free, not one a chunk.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from collections.abc import Iterable, Sequence

import numpy as np

from maru.common.extents import ExtentAllocator


class RunAllocator(ExtentAllocator):
    def __init__(self, capacity: int, alignment: int = 1):
        super().__init__(capacity, alignment)
        # runs of equal extents allocated together (`allocate_run`): first -> (length, count)
        self._runs: dict[int, tuple[int, int]] = {}
        self._run_firsts: list[int] = []  # their firsts, sorted

    def allocate_run(self, length: int, count: int) -> range | None:
        """Allocate `count` adjacent extents of `length` with one search (a batch of equal
        pages), kept as one record; each can still be freed on its own. Their starts, or None
        when no free extent holds them all."""
        first = self.allocate(length * count)
        if first is None:
            return None
        del self._allocated[first]
        self._runs[first] = (length, count)
        insort(self._run_firsts, first)
        return range(first, first + length * count, length)

    def free_extent(self, start: int) -> int:
        """Free the extent that begins at `start`; returns its length."""
        length = self._allocated.pop(start, None)
        if length is None:
            if not self.is_allocated(start):
                raise KeyError(f"no allocated extent starts at {start}")
            return self.free_many([start])
        self._release(start, length)
        return length

    def free_many(self, starts: Iterable[int] | np.ndarray) -> int:
        """Free every allocated extent that begins at one of `starts` (others are skipped);
        returns the units freed. A run's extents (an evicted batch is mostly one whole run,
        or the end of one and the start of the next) are found with numpy: freeing them costs
        a few Python steps a run touched, not one an extent."""
        given = starts if isinstance(starts, np.ndarray) else np.fromiter(starts, np.int64)
        at = np.sort(given)
        steps = np.diff(at)
        if len(at) > 1 and not steps.all():  # (a start given twice: once)
            at = at[np.concatenate(([True], steps != 0))]
            steps = np.diff(at)
        if not len(at):
            return 0
        first = int(at[0])
        length, count = self._runs.get(first, (0, 0))
        if count == len(at) and (count == 1 or (steps == length).all()):  # one whole run
            self._drop_run(first)
            self._release(first, length * count)
            return length * count
        freed, i, n = 0, 0, len(at)
        while i < n:
            start = int(at[i])
            length = self._allocated.pop(start, 0)
            if length:  # (an extent allocated alone)
                self._release(start, length)
                freed, i = freed + length, i + 1
                continue
            k = bisect_right(self._run_firsts, start) - 1
            if k < 0:  # (before every run, and not allocated alone: skipped)
                i += 1
                continue
            first = self._run_firsts[k]
            length, count = self._runs[first]
            end = first + length * count
            if start >= end:  # (not allocated: skipped)
                i += 1
                continue
            j = int(at.searchsorted(end))
            low, off = divmod(start - first, length)
            if not off and (j - i == 1 or (steps[i : j - 1] == length).all()):  # (adjacent)
                positions: Sequence[int] | np.ndarray = range(low, low + j - i)
            else:
                offsets = at[i:j] - first
                positions = offsets[offsets % length == 0] // length
            freed += self._free_in_run(first, length, count, positions)
            i = j
        return freed

    def free_stride(self, first: int, step: int, count: int) -> int:
        """Free the extents that begin at first, first + step, ... (`count` of them; others
        are skipped); returns the units freed. A full instance's eviction frees mostly whole
        runs of its writes back to back: each costs a few dict steps here, no numpy; what is
        left (part of a run) goes to `free_many`."""
        freed = 0
        while count:
            length, n = self._runs.get(first, (0, 0))
            if n and n <= count and (n == 1 or length == step):  # (a whole run)
                self._drop_run(first)
            else:
                n, length = 1, self._allocated.pop(first, 0)  # (an extent allocated alone)
                if not length:
                    break
            self._release(first, length * n)
            freed += length * n
            first, count = first + step * n, count - n
        if count:
            freed += self.free_many(first + np.arange(count, dtype=np.int64) * step)
        return freed

    def _free_in_run(
        self, first: int, length: int, count: int, positions: Sequence[int] | np.ndarray
    ) -> int:
        """Free the extents at `positions` (sorted, distinct: a range when adjacent) of the
        run at `first`; what stays allocated of it stays a run (or runs). The units freed."""
        if not len(positions):
            return 0
        self._drop_run(first)
        # the stretches freed: maximal ranges of adjacent positions, each released at once
        if isinstance(positions, range):
            lows, highs = [positions.start], [positions.stop]
        else:
            breaks = np.flatnonzero(np.diff(positions) != 1)
            lows = [int(positions[0]), *(positions[breaks + 1].tolist())]
            highs = [*(positions[breaks] + 1).tolist(), int(positions[-1]) + 1]
        kept_from = 0  # the first position not yet freed or kept
        for low, high in zip(lows, highs):
            self._keep_run(first, length, kept_from, low)
            self._release(first + low * length, (high - low) * length)
            kept_from = high
        self._keep_run(first, length, kept_from, count)
        return len(positions) * length

    def _drop_run(self, first: int) -> None:
        del self._runs[first]
        del self._run_firsts[bisect_left(self._run_firsts, first)]

    def _keep_run(self, first: int, length: int, low: int, high: int) -> None:
        """Extents [low, high) of a run at `first` stay allocated, as a run of their own."""
        if high > low:
            start = first + low * length
            self._runs[start] = (length, high - low)
            insort(self._run_firsts, start)

    def is_allocated(self, start: int) -> bool:
        """Whether an allocated extent (alone, or in a run) begins at `start`."""
        if start in self._allocated:
            return True
        k = bisect_right(self._run_firsts, start) - 1
        if k < 0:
            return False
        first = self._run_firsts[k]
        length, count = self._runs[first]
        return start < first + length * count and (start - first) % length == 0
