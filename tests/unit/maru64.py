"""maru64 in numpy, slow but identical: the reference the C loops of `maru.common._memcopy`
(scalar, AVX2, AVX-512) are checked against; the definition is at the top of the hash section
of `_memcopy.c`. Tests only: Maru hashes in C."""

from __future__ import annotations

from typing import Any

import numpy as np

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
