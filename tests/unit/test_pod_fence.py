"""Software coherence when a region stops being ours (`RegionMapper._fence`).

Caches are tagged by physical address: remapping a region MAP_PRIVATE (the fence) leaves the
lines this host dirtied through the shared mapping in its cache, and they reach the pool
whenever the cache evicts them, over whatever the region's next owner (on another host of a
pod) wrote and sealed there since. Values written in place through `alloc` and neither sealed
nor freed (a close, a region the server forgot, a host reaped after a cut) hold such lines.
So, in software mode, the fence writes back every line of the region's pages mapped here
before the region can be handed out. This machine is coherent: the test counts the lines the
extension wrote back, as tests/unit/test_coherence.py does.
"""

from __future__ import annotations

import ctypes
import platform

import pytest

from maru.client.coherence import lines_flushed
from maru.client.mapping import RegionMapper
from maru.common.region import RegionHandle

pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64"), reason="software coherence is x86-64's"
)

MiB, PAGE, LINE = 1 << 20, 4096, 64


def _region(tmp_path, size: int = 4 * MiB) -> RegionHandle:
    path = tmp_path / "pool"
    path.write_bytes(b"\x00" * size)
    return RegionHandle(1, str(path), 0, size, "ab" * 8, "w")


@pytest.mark.parametrize("how", ["unmap", "close"])
def test_a_region_that_stops_being_ours_has_the_lines_written_in_place_written_back(
    tmp_path, software, how
):
    """An `alloc` buffer of 3 pages written in place (cached stores, not a copy loop) and
    never sealed nor freed, then the region leaves (a drop, a close): every line of it is
    written back before the fence, and nothing of the region's pages not mapped here is
    touched. Before: 0 lines written back; the dirty lines stayed in this host's cache."""
    mapper = RegionMapper(retire_s=0.0)
    handle = _region(tmp_path)
    mapped = mapper.map(handle, writable=True)
    at = mapped.address + MiB + 123  # (not on a line: a partial first and last line)
    size = 3 * PAGE - 200
    ctypes.memset(at, 0x5A, size)
    dirty = (at + size - 1) // LINE - at // LINE + 1
    before = lines_flushed()
    mapper.unmap(handle.region_id) if how == "unmap" else mapper.close()
    written_back = lines_flushed()[0] - before[0]
    assert mapped.fenced
    assert written_back >= dirty, (written_back, dirty)
    assert written_back < handle.length // LINE  # (only the pages mapped here: not all 4 MiB)
    mapper.close()


def test_in_hardware_mode_a_fence_writes_nothing_back(tmp_path):
    mapper = RegionMapper(retire_s=0.0)
    handle = _region(tmp_path)
    mapped = mapper.map(handle, writable=True)
    ctypes.memset(mapped.address, 1, PAGE)
    before = lines_flushed()
    mapper.close()
    assert mapped.fenced and lines_flushed() == before
