"""The journal's CRC-32 (`maru.server._keyindex.crc32`, maru/common/crc32.h): zlib's values on
both of its paths (PCLMULQDQ folding and the table loop), so a journal framed with zlib's CRC
(every journal before it) replays unchanged."""

from __future__ import annotations

import random
import re
import zlib
from pathlib import Path

import msgpack
import numpy as np
import pytest

from maru.server import _keyindex
from maru.server._keyindex import crc32
from maru.server.journal import FRAME, read_records

HEADER = Path(__file__).resolve().parents[2] / "src" / "maru" / "common" / "crc32.h"
P = 0x104C11DB7  # CRC-32's polynomial, x^32 + ... + 1


def x_pow_mod_p(e: int) -> int:
    """x^e mod P over GF(2), bit d the coefficient of x^d."""
    r = 1
    for _ in range(e):
        r <<= 1
        if r >> 32 & 1:
            r ^= P
    return r


def reflected64(v: int) -> int:
    """A polynomial of degree < 32 as the folding's 64-bit constant: bit i holds x^(63-i)."""
    return sum(((v >> d) & 1) << (63 - d) for d in range(32))


@pytest.fixture(params=[True, False], ids=["clmul", "table"])
def path(request):
    """Each path in turn (the folding one only where the CPU has PCLMULQDQ), then back."""
    used = _keyindex._crc32_path(request.param)
    if request.param and not used:
        pytest.skip("this CPU has no PCLMULQDQ: the table path is the only one")
    yield used
    _keyindex._crc32_path(True)


def test_the_folding_constants_are_the_powers_of_x_the_header_says():
    """x^(63+D) and x^(D-1) mod P for D = 512 and 128, as the header defines them."""
    text = HEADER.read_text()
    for d in (512, 128):
        lo = int(re.search(rf"MARU_CRC_K{d}_LO (0x[0-9a-f]+)ull", text).group(1), 16)
        hi = int(re.search(rf"MARU_CRC_K{d}_HI (0x[0-9a-f]+)ull", text).group(1), 16)
        assert lo == reflected64(x_pow_mod_p(63 + d))
        assert hi == reflected64(x_pow_mod_p(d - 1))


def test_every_length_and_alignment_gives_zlibs_value(path):
    rng = random.Random(42)
    data = rng.randbytes(4096 + 64)
    for n in [*range(0, 300), 511, 512, 513, 1023, 1024, 4095, 4096]:
        start = rng.randrange(64)
        view = memoryview(data)[start : start + n]
        value = rng.getrandbits(32) if n % 3 else 0
        assert crc32(view, value) == zlib.crc32(view, value), (n, start, value)
        assert crc32(view) == zlib.crc32(view), (n, start)


def test_large_buffers_and_chaining_give_zlibs_value(path):
    data = random.Random(7).randbytes(3 << 20)
    assert crc32(data) == zlib.crc32(data)
    # in two parts, the second continuing from the first's value (as zlib chains)
    assert crc32(data[12345:], crc32(data[:12345])) == zlib.crc32(data)
    assert crc32(b"\x00" * 100_000) == zlib.crc32(b"\x00" * 100_000)
    assert crc32(b"\xff" * 100_000, 0xFFFFFFFF) == zlib.crc32(b"\xff" * 100_000, 0xFFFFFFFF)


def test_any_contiguous_buffer_is_taken_and_others_refused():
    data = bytes(range(256)) * 4
    expected = zlib.crc32(data)
    for buffer in (data, bytearray(data), memoryview(data), np.frombuffer(data, np.uint8)):
        assert crc32(buffer) == expected
    with pytest.raises((BufferError, ValueError)):  # (numpy's word for it)
        crc32(np.frombuffer(data, np.uint8)[::2])
    with pytest.raises(TypeError):
        crc32("not bytes")
    with pytest.raises(TypeError):
        crc32()


def test_a_journal_framed_with_zlibs_crc_replays():
    """Journals written before this CRC (zlib's) read back whole, and a damaged one stops at
    the damage, as before."""
    records = [["K", [f"key-{i}" for i in range(300)], list(range(900))], ["D", ["key-1"]]]
    frames = b""
    for record in records:
        payload = msgpack.packb(record, use_bin_type=True)
        frames += FRAME.pack(len(payload), zlib.crc32(payload)) + payload
    assert read_records(frames) == (records, len(frames))
    damaged = bytearray(frames)
    damaged[FRAME.size + 40] ^= 1
    assert read_records(bytes(damaged)) == ([], 0)
