"""First-fit extent allocator with alignment and coalescing: the server carves regions (bytes,
2 MiB aligned) out of the pool with it, and each client pages (chunks) out of its regions
(`maru.client.runs.RunAllocator`, which adds runs of equal extents)."""

from __future__ import annotations

import bisect


class ExtentAllocator:
    """Hands out [start, start + length) ranges of `0..capacity`; frees merge with neighbours."""

    def __init__(self, capacity: int, alignment: int = 1):
        if capacity <= 0 or alignment <= 0:
            raise ValueError("capacity and alignment must be positive")
        self.capacity = capacity
        self.alignment = alignment
        self._starts: list[int] = [0]  # free extents, sorted by start, never adjacent
        self._lengths: list[int] = [capacity]
        self._allocated: dict[int, int] = {}  # start -> length
        self.used = 0

    @property
    def free(self) -> int:
        return self.capacity - self.used

    @property
    def largest_free(self) -> int:
        return max(self._lengths, default=0)

    @property
    def free_extents(self) -> int:
        return len(self._starts)

    def allocate(self, length: int, alignment: int | None = None) -> int | None:
        """Return the start of a new extent of `length` (at a multiple of `alignment`, by
        default the allocator's), or None when nothing fits."""
        if length <= 0:
            raise ValueError("length must be positive")
        align = alignment or self.alignment
        for i, (start, free_len) in enumerate(zip(self._starts, self._lengths)):
            aligned = -(-start // align) * align
            if aligned - start + length <= free_len:
                self._take(i, aligned, length)
                return aligned
        return None

    def _take(self, i: int, start: int, length: int) -> None:
        """Allocate [start, start + length), which lies in free extent i."""
        head = start - self._starts[i]
        tail = self._lengths[i] - head - length
        if tail:
            self._starts.insert(i + 1, start + length)
            self._lengths.insert(i + 1, tail)
        if head:
            self._lengths[i] = head
        else:
            del self._starts[i]
            del self._lengths[i]
        self._allocated[start] = length
        self.used += length

    def free_extent(self, start: int) -> int:
        """Free the extent that begins at `start`; returns its length."""
        length = self._allocated.pop(start, None)
        if length is None:
            raise KeyError(f"no allocated extent starts at {start}")
        self._release(start, length)
        return length

    def _release(self, start: int, length: int) -> None:
        """Put [start, start + length), allocated until now, back on the free list, merged
        with its free neighbours (and out of `used`): every free ends here."""
        self.used -= length
        i = bisect.bisect_left(self._starts, start)
        merge_prev = i > 0 and self._starts[i - 1] + self._lengths[i - 1] == start
        merge_next = i < len(self._starts) and start + length == self._starts[i]
        if merge_prev and merge_next:
            self._lengths[i - 1] += length + self._lengths[i]
            del self._starts[i]
            del self._lengths[i]
        elif merge_prev:
            self._lengths[i - 1] += length
        elif merge_next:
            self._starts[i] = start
            self._lengths[i] += length
        else:
            self._starts.insert(i, start)
            self._lengths.insert(i, length)

    def reserve(self, start: int, length: int) -> None:
        """Mark a known extent as allocated (used when replaying persisted state)."""
        i = bisect.bisect_right(self._starts, start) - 1
        if i < 0 or start + length > self._starts[i] + self._lengths[i]:
            raise ValueError(f"extent [{start}, {start + length}) is not free")
        self._take(i, start, length)

    def is_allocated(self, start: int) -> bool:
        """Whether an allocated extent begins at `start`."""
        return start in self._allocated

    def fragmentation(self) -> float:
        """1 - largest free extent / total free: 0 when all free space is one extent."""
        free = self.free
        return 0.0 if free == 0 else 1.0 - self.largest_free / free
