"""maru64, the page checksum (`maru.common.checksum`): the C loops (scalar, AVX2, AVX-512) and
the numpy reference (`maru64.py`) compute one value; copy_many_hashed hashes a value given in
parts as the bytes of its parts in order while it copies them; the hash sees the faults it is
for."""

from __future__ import annotations

import numpy as np
import pytest

from maru.common import _memcopy, checksum, memcopy

from .maru64 import hash64

# Lengths around the stripe (64 B) and block (1 KiB) edges and the copy's 4 KiB step.
LENGTHS = [0, 1, 7, 8, 63, 64, 65, 1000, 1023, 1024, 1025, 4095, 4096, 4097, 16384 + 13, 1 << 20]


def _impls() -> list[str]:
    available = []
    for name in ("scalar", "avx2", "avx512"):
        try:
            before = _memcopy.hash_impl(name)
        except ValueError:  # not on this CPU
            continue
        _memcopy.hash_impl(before)
        available.append(name)
    return available


@pytest.fixture(params=_impls())
def impl(request):
    """Each C loop this CPU can run, switched back to the automatic pick afterwards."""
    _memcopy.hash_impl(request.param)
    yield request.param
    _memcopy.hash_impl("auto")


def _data(n: int, seed: int = 3) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, np.uint8).tobytes()


def test_reference_values_do_not_change(impl):
    """Stored checksums outlive a release: the hash of fixed inputs is pinned, in C and in the
    reference (change these only with a new name for the hash, `protocol.CHECKSUMS`)."""
    pinned = {
        b"": 4580747752613201002,
        bytes(range(256)) * 20 + b"maru": -5156904920467837260,
        bytes(4096): -1843791263870645489,
    }
    for data, value in pinned.items():
        assert hash64(data) == value
        assert int(checksum.checksums([memoryview(data)])[0]) == value


@pytest.mark.parametrize("n", LENGTHS)
def test_c_and_reference_agree(impl, n):
    data = _data(n, seed=n)
    assert int(checksum.checksums([memoryview(data)])[0]) == hash64(data)


def test_a_value_in_parts_hashes_as_its_bytes_in_order(impl):
    """copy_many_hashed: parts of any size (not stripe multiples), several values, each value's
    checksum that of its parts joined, and every part copied to its own place."""
    rng = np.random.default_rng(11)
    values, parts = 5, 4
    sizes = rng.integers(0, 3000, (values, parts))
    sizes[0] = [64, 64, 1024, 4096]  # aligned parts too
    sizes[1] = [18432, 8191, 8193, 12288]  # over the copy's 4 KiB step, a short last step
    sizes[2, 1] = (1 << 20) + 13
    src = np.frombuffer(_data(int(sizes.sum()), seed=1), np.uint8)
    dst = np.zeros(src.size + 64, np.uint8)
    starts = np.concatenate(([0], np.cumsum(sizes.ravel())[:-1])).reshape(values, parts)
    got = memcopy.copy_many_hashed(
        starts + dst.ctypes.data + 64, starts + src.ctypes.data, sizes.astype(np.int64)
    )
    assert bytes(dst[64:]) == bytes(src) and not dst[:64].any()
    for i in range(values):
        value = bytes(src[starts[i, 0] : starts[i, 0] + sizes[i].sum()])
        assert int(got[i]) == hash64(value), i
    # hashing alone (no destination) gives the same, as does one buffer per value
    alone = checksum.checksums(
        [memoryview(bytes(src[s : s + n])) for s, n in zip(starts[:, 0], sizes.sum(1))]
    )
    assert alone.tolist() == got.tolist()


@pytest.mark.parametrize("shift", [0, 8, 64 + 16], ids=["aligned", "8", "80"])
def test_one_pass_and_block_copies_agree(impl, shift):
    """copy_many_hashed copies a part in one pass (each stripe loaded once, streamed out and
    hashed from the same registers) when its destination is 64-byte aligned and the value is
    at a stripe boundary, else block by block: both give the reference's checksums and the
    bytes. Parts of 64-byte multiples keep later parts on the one-pass path; a 100-byte part
    moves the value off the stripe boundary for the parts after it."""
    sizes = np.array([[4096, 18432, 100, 65536, 70001], [1 << 20, 64, 4160, 13, 8192]])
    total = int(sizes.sum())
    src = np.frombuffer(_data(total, seed=4), np.uint8)
    raw = np.zeros(total + 256, np.uint8)
    base = raw.ctypes.data + (-raw.ctypes.data) % 64 + shift  # 64-byte aligned, then shifted
    starts = np.concatenate(([0], np.cumsum(sizes.ravel())[:-1])).reshape(sizes.shape)
    got = memcopy.copy_many_hashed(starts + base, starts + src.ctypes.data, sizes)
    first = base - raw.ctypes.data
    assert bytes(raw[first : first + total]) == bytes(src)
    assert not raw[:first].any() and not raw[first + total :].any()
    for i, (start, size) in enumerate(zip(starts[:, 0], sizes.sum(1))):
        assert int(got[i]) == hash64(bytes(src[start : start + size])), i


def test_the_faults_it_is_for_change_the_checksum(impl):
    """A flipped bit anywhere, a zeroed or truncated page, two 64-byte stripes or two 1 KiB
    blocks swapped, a word moved to another lane: each gives another checksum."""
    page = bytearray(_data(64 << 10, seed=5))
    base = checksum.checksums([memoryview(bytes(page))])[0]

    def differs(changed: bytes) -> bool:
        return checksum.checksums([memoryview(changed)])[0] != base

    rng = np.random.default_rng(9)
    for at in [0, len(page) - 1, *rng.integers(0, len(page), 200).tolist()]:
        for bit in (0, 7):
            flipped = bytearray(page)
            flipped[at] ^= 1 << bit
            assert differs(bytes(flipped)), (at, bit)
    assert differs(bytes(len(page)))  # zeros
    assert differs(bytes(page[:-1])) and differs(bytes(page) + b"\0")
    stripes = bytearray(page)
    stripes[0:64], stripes[64:128] = page[64:128], page[0:64]
    assert differs(bytes(stripes))
    blocks = bytearray(page)
    blocks[0:1024], blocks[1024:2048] = page[1024:2048], page[0:1024]
    assert differs(bytes(blocks))
    lanes = bytearray(page)
    lanes[0:8], lanes[8:16] = page[8:16], page[0:8]
    assert differs(bytes(lanes))
    assert all(hash64(bytes(n)) != 0 for n in (0, 1, 64))  # never 0 (0: none)


def test_bad_arguments_are_refused():
    from maru.common._memcopy import copy_many_hashed

    addresses = np.zeros(4, np.int64)
    with pytest.raises(ValueError, match="parts"):
        copy_many_hashed(None, addresses, np.zeros(4, np.int64), 0)
    with pytest.raises(ValueError, match="do not make values"):
        copy_many_hashed(None, addresses, np.zeros(3, np.int64), 1)
    with pytest.raises(ValueError, match="do not make values"):
        copy_many_hashed(None, addresses, np.zeros(4, np.int64), 3)
    with pytest.raises(ValueError, match="negative"):
        copy_many_hashed(None, addresses, np.full(4, -1, np.int64), 1)
    with pytest.raises(TypeError, match="int64"):
        copy_many_hashed(None, addresses.astype(np.int32), np.zeros(4, np.int64), 1)
    with pytest.raises(ValueError, match="destinations"):
        memcopy.copy_many_hashed(np.zeros((2, 2), np.int64), np.zeros((2, 1), np.int64), [8])
