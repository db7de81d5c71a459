"""The read verb's request path (`MaruHandler.read` / `read_many`): a leased lookup, the
caller's copies, the proof, the release. (The local index's path is `LocalIndexClient.read`.)

A hit is the bytes its writer stored or it is a miss: after the copies, a key whose bytes no
longer hash to its writer's checksum (`maru_checksums`) is a miss, and so is every key if the
lease ended before it was released.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np

from maru.client.requests import Lookup

log = logging.getLogger(__name__)

# `copy(sources)`: copy the value at each source address (0: skip it) to the caller's side;
# returns each value's checksum as copied (`maru_checksums`) or None (`Lookup.copy_out`)
CopyOut = Callable[[np.ndarray], "np.ndarray | None"]
# a run of keys read alike: (how many keys, the bytes each has, their copy; None: not copied)
Segment = tuple[int, int, "CopyOut | None"]


def copy_and_prove(
    found: Lookup,
    segments: Sequence[Segment] | Callable[[], Sequence[Segment]],
    *,
    invalidate: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """Copy each segment's hits through its copy, then prove them; `segments` may be a
    function that makes them (called once the lookup is sent: the caller prepares its copy
    while the server answers). `invalidate`: the copies read in place without invalidating
    (software coherence: `Lookup.invalidate` first; a hit whose memory faults there is a miss
    no copy is given). Returns per key (proven, mismatched): proven True where the bytes
    copied are the ones its writer stored; mismatched True where a hit's bytes were unlike
    their checksum under a lease that held (misses, for the caller's statistics; not a page
    rewritten after its lease ended, nor one whose entry changed). The lease is released in
    every case, an exception's too (which then goes to the caller)."""
    n = found.n
    try:
        if invalidate:
            found.invalidate()
        start = 0
        for count, length, copy in segments() if callable(segments) else segments:
            if copy is not None:
                found.copy_out(copy, length, start=start, stop=start + count)
            start += count
        corrupt = found.corrupt()  # after the copies, of the bytes the copies read
    except BaseException:
        found.release()
        raise
    copied = found.copied if found.copied is not None else np.zeros(n, bool)
    proven = copied & ~corrupt
    if not found.release(confirm=True):  # the lease ended mid-copy: not proven
        log.warning("read: the lease on %d keys ended during the copy: misses", n)
        proven[:] = False
    return proven, copied & found.mismatched()
