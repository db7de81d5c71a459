"""A region of ours that leaves the mapper (closed, forgot by the server, given or taken back)
is fenced: a view or an address a caller kept into it still works, but its writes land in
private memory, never in the pool file, whose pages the server may hand to another instance.
Reads through it still see the pool."""

from __future__ import annotations

import ctypes
import os

import pytest

from maru.client.mapping import RegionMapper
from maru.common.region import RegionHandle

MiB = 1 << 20


def _region(tmp_path, region_id: int = 1, size: int = 2 * MiB) -> RegionHandle:
    path = tmp_path / "pool"
    path.write_bytes(b"\x00" * (region_id * size))
    return RegionHandle(region_id, str(path), (region_id - 1) * size, size, "ab" * 8, "w")


def _file_bytes(handle: RegionHandle, at: int, n: int) -> bytes:
    fd = os.open(handle.path, os.O_RDONLY)
    try:
        return os.pread(fd, n, handle.offset + at)
    finally:
        os.close(fd)


@pytest.mark.parametrize("how", ["unmap", "close"])
def test_a_write_through_a_kept_view_after_the_region_left_never_reaches_the_pool(tmp_path, how):
    """Before: the kept view still wrote the pool file (the shared mapping stays alive while a
    view of it does), so the next owner's registered bytes were overwritten."""
    mapper = RegionMapper(retire_s=0.0)
    handle = _region(tmp_path)
    mapped = mapper.map(handle, writable=True)
    kept = mapped.view[: 2 * 4096]  # (LMCache's memory object, an AllocHandle's buf)
    kept[:4096] = b"o" * 4096  # ours, while we own it: in the pool
    address = mapped.address
    mapper.unmap(handle.region_id) if how == "unmap" else mapper.close()
    # the next owner writes its value there; we read it through the kept view
    fd = os.open(handle.path, os.O_RDWR)
    os.pwrite(fd, b"n" * 4096, handle.offset + 4096)
    os.close(fd)
    assert bytes(kept[4096:]) == b"n" * 4096  # reads still see the pool
    kept[:] = b"L" * len(kept)  # a late write through the view...
    ctypes.memset(address + 4096, ord("M"), 16)  # ...and through the address
    assert _file_bytes(handle, 0, 2 * 4096) == b"o" * 4096 + b"n" * 4096
    assert bytes(kept[:4]) == b"LLLL" and mapped.fenced  # (landed in our private memory)
    del kept
    mapper.close()


def test_a_region_mapped_read_only_after_it_was_ours_reads_the_pool(tmp_path):
    """A region given back, then read through a read-only mapping (`Session.map`): the fenced
    writable one is no longer found, so no private page is ever read as the pool's."""
    mapper = RegionMapper(retire_s=60.0)
    handle = _region(tmp_path)
    mapped = mapper.map(handle, writable=True)
    kept = mapped.view[:4096]
    mapper.unmap(handle.region_id)
    kept[:] = b"L" * 4096
    again = mapper.map(handle, writable=False)
    assert again is not mapped and bytes(again.view[:4096]) == b"\x00" * 4096
    del kept
    mapper.close()


class _Reply:
    def __init__(self, body: dict):
        self.body = body

    def result(self) -> dict:
        return self.body

    def done(self) -> bool:
        return True


def _supply(tmp_path, replies: dict):
    """A `RegionSupply` owning one 2 MiB region of a file pool; `replies[msg type]`: each
    request's answer (the requests it sent are in `sent`)."""
    from maru.client.chunks import ChunkBook
    from maru.client.session import Session
    from maru.client.supply import RegionSupply
    from maru.common.config import MaruConfig

    sent: list = []

    def request(msg_type, body):
        sent.append(msg_type)
        return _Reply(replies.get(msg_type, {}))

    mapper = RegionMapper(retire_s=60.0)
    session = Session(MaruConfig(chunk_size_bytes=MiB), request, ChunkBook(MiB), mapper)
    supply = RegionSupply(session, request)
    handle = _region(tmp_path)
    session.chunks.adopt(mapper.map(handle, writable=True))
    return supply, handle, sent


@pytest.mark.parametrize("how", ["given_back", "taken_back", "forgot_after_restart"])
def test_a_region_we_stop_owning_is_fenced_before_anyone_else_can_get_it(tmp_path, how):
    """Our region given back (over our fair share: `give_up`, RETURN_REGION), taken back
    while parked (PARK_REGIONS' `gone`), or not listed by a restarted server's HANDSHAKE
    (`reattach`): a view kept from a reservation in it writes private memory from then on.
    Before: the pool file, i.e. the pages of whoever the server gives the region to next."""
    from maru.common.protocol import MsgType

    replies = {
        MsgType.PARK_REGIONS: {"gone": [1], "unparked": []},
        MsgType.RETURN_REGION: {"ok": True},
    }
    supply, handle, sent = _supply(tmp_path, replies)
    reserved = supply.chunks.take(MiB)
    assert reserved is not None
    kept = reserved.buf
    supply.chunks.give_back(reserved)  # (given back unsealed: the region may go)
    if how == "given_back":
        supply.shed(handle.length)
        supply.tick({})
        assert MsgType.RETURN_REGION in sent
    elif how == "taken_back":
        supply.chunks.park_idle()
        supply.chunks.park_idle()
        assert supply._park([1], []) == []
    else:
        assert supply.reattach({"regions": [], "pool": {}}) == 1
    assert 1 not in supply.chunks and supply.mapper.get(1) is None
    kept[:] = b"L" * len(kept)  # the late write
    assert _file_bytes(handle, 0, MiB) == b"\x00" * MiB
    del kept
    supply.mapper.close()
