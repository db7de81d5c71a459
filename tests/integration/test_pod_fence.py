"""A writer that closes (or loses its regions) with values written in place and not sealed:
in software coherence its dirty lines of those chunks go to the pool before DISCONNECT frees
the region, never later over the bytes of the region's next owner on another host.

This machine is coherent: the test counts the lines the extension wrote back (as
test_coherence.py does). Before the fix: 0 lines at the close, the fence only remapped.
"""

from __future__ import annotations

import platform

import pytest

from maru import MaruHandler
from maru.client.coherence import lines_flushed

pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64"), reason="software coherence is x86-64's"
)

LINE = 64


@pytest.mark.parametrize("server", ["software", "hardware"])
def test_a_close_with_an_unsealed_alloc_writes_its_lines_back_before_the_region_goes(
    maru_server_factory, server
):
    """An `alloc` run of 4 values written in place (LMCache's memory objects, say) and still
    reserved when the handler closes: in software, every line of the run is written back at
    the close, before DISCONNECT hands the region to whoever asks next; in hardware, none."""
    url = maru_server_factory(pool_size="64M", extra_args=["--coherence", server]).url
    h = MaruHandler(server_url=url, timeout_ms=10_000, pool_size="16M")
    assert h.connected and h.coherence == server
    size, count = 3 * 4096 + 100, 4
    run = h.alloc(size, count)
    assert run is not None
    run.buf[:] = b"\xa5" * len(run.buf)  # (cached stores: no copy loop, no seal, no free)
    span = len(run.buf)
    del run
    before = lines_flushed()
    h.close()
    written_back = lines_flushed()[0] - before[0]
    if server == "software":
        assert written_back >= -(-span // LINE), (written_back, span)
    else:
        assert written_back == 0
