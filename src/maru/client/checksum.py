"""maru64, the page checksum of `maru_checksums`: one hash for writers and readers alike.

Written for Maru (no library's code): 8 lanes of 64-bit words per 64-byte stripe, a
position-keyed 32x32-bit multiply and the word itself added per lane, a rotation per 1 KiB
block, a xorshift-multiply finalizer over the lanes and the length. The C loop in
`maru.client._memcopy` (scalar, AVX2 or AVX-512: the same value) hashes while it copies
(`maru.client.memcopy.copy_many_hashed`), so a checksum costs no second read of the page from
memory; the full definition is at the top of its hash section. `hash64` here is the reference
in numpy, slow but identical (`tests/unit/test_checksum.py` checks the two agree); it is the
fallback where the extension was not built.

It detects accidental corruption (stray writes, reused, zeroed or truncated pages, flipped
bits, moved blocks), not an adversary: whoever can write the pool can also register keys.
A checksum is never 0: on the wire 0 means "stored without one".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

try:
    from maru.client._memcopy import copy_many_hashed as _c_hashed
except ImportError:  # built without a C compiler
    _c_hashed = None

_M64 = (1 << 64) - 1
_STEP = 0xB6D4941343DB3FA5
_FOLD = 0xDFAF8FF3B0FE03B7
_MUL1 = 0xD677DF578F37CDBF
_MUL2 = 0xFDBE8440D3408A49
_ROT = 29
_STRIPE = 64
_BLOCK = 16  # stripes per block


def _fmix(h: int) -> int:
    h ^= h >> 31
    h = (h * _MUL1) & _M64
    h ^= h >> 29
    h = (h * _MUL2) & _M64
    return h ^ (h >> 32)


_KEYS = np.array(
    [[_fmix((_STEP * (8 * j + i + 1)) & _M64) for i in range(8)] for j in range(_BLOCK)],
    np.uint64,
)
_INIT = [_fmix((_STEP * (129 + i)) & _M64) for i in range(8)]


def hash64(data: Any) -> int:
    """The maru64 of the bytes of `data` (anything with the buffer protocol, C-contiguous) as
    an int64 (never 0): the reference, in numpy."""
    raw = memoryview(data).cast("B")
    n = raw.nbytes
    stripes = -(-n // _STRIPE)
    words = np.zeros(stripes * 8, "<u8")
    words.view(np.uint8)[:n] = np.frombuffer(raw, np.uint8)
    w = words.reshape(stripes, 8).astype(np.uint64)
    x = w ^ _KEYS[np.arange(stripes) % _BLOCK]
    terms = w + (x & np.uint64(0xFFFFFFFF)) * (x >> np.uint64(32))  # wraps mod 2**64
    acc = [int(v) for v in _INIT]
    for first in range(0, stripes, _BLOCK):
        block = terms[first : first + _BLOCK].sum(axis=0, dtype=np.uint64)
        acc = [(a + int(b)) & _M64 for a, b in zip(acc, block)]
        if first + _BLOCK <= stripes:  # a whole block: rotate
            acc = [((a << _ROT) | (a >> (64 - _ROT))) & _M64 for a in acc]
    h = (n * _FOLD) & _M64
    for a in acc:
        h = _fmix(h ^ a)
    h = h or 1
    return h - (1 << 64) if h >> 63 else h


def checksums(views: Sequence[memoryview]) -> np.ndarray:
    """The maru64 of each view's bytes as int64s (the wire's column type), read where they
    lie (no copy): one C call for all of them."""
    if _c_hashed is None:
        return np.array([hash64(v) for v in views], np.int64)
    addresses = np.array([_address(v) for v in views], np.int64)
    sizes = np.array([v.nbytes for v in views], np.int64)
    return np.frombuffer(_c_hashed(None, addresses, sizes, 1), np.int64)


def _address(view: memoryview) -> int:
    """The address of a contiguous view's first byte (read-only views too)."""
    return np.frombuffer(view, np.uint8).ctypes.data if view.nbytes else 0
