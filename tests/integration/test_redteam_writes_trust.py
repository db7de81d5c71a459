"""Red team, write side: an `AllocHandle` (the original API: `alloc`, write in place, `seal`)
whose reservation ended, by `free` or by a seal, is never registered again once its chunks
are reserved by the next `alloc`: else a key would read the next value's bytes (a wrong hit).
Each test checks, through a real maru-server and a second handler's reads, that every hit is
the bytes written under its key and that the stale seal reports False."""

from __future__ import annotations

import hashlib

from maru import MaruHandler

KiB = 1 << 10
SIZE = 60 * KiB  # one 64 KiB chunk a value


def value_of(key: str) -> bytes:
    """Bytes that name their key: a digest of the key, then a body made from it."""
    body = hashlib.shake_256(key.encode()).digest(SIZE - 16)
    return hashlib.blake2b(key.encode() + body, digest_size=16).digest() + body


def read_back(handler: MaruHandler, keys: list[str]) -> dict[str, bool | None]:
    """Per key: None (a miss), True (its own bytes), False (a wrong hit)."""
    out: dict[str, bool | None] = {}
    with handler.leased(keys) as infos:
        for key, info in zip(keys, infos):
            out[key] = None if info is None else bytes(info.view) == value_of(key)
    return out


def test_a_freed_handle_sealed_after_its_chunks_were_reserved_again_registers_nothing(
    maru_server,
):
    """alloc H1, write K1, free H1; alloc H2 gets the same chunks, write K2; seal K1 on H1
    (stale), K2 on H2, then K3 on H2 again and K4 on a slice of H2 (both spent). Only K2 is
    stored, with its bytes. Fails with `_Reserved.holds` ignoring the reservation's serial
    (`return True` for a run as taken, whoever's it is): K1 is then registered over H2's
    chunks and reads K2's bytes."""
    kw = {"server_url": maru_server.url, "pool_size": "2M", "chunk_size_bytes": "64K"}
    with MaruHandler(**kw) as h, MaruHandler(**kw) as reader:
        h1 = h.alloc(SIZE, 2)
        assert h1 is not None
        h1.buf[:SIZE] = value_of("k1")
        h.free(h1)
        h2 = h.alloc(SIZE, 2)
        assert h2 is not None
        assert (h2.region_id, h2.offset) == (h1.region_id, h1.offset)  # the same chunks
        h2.buf[:SIZE] = value_of("k2/0")
        h2.buf[h2.stride : h2.stride + SIZE] = value_of("k2/1")

        assert h.seal(["k1", "k1/1"], h1, SIZE).wait() == [False, False]
        assert h.seal(["k2/0", "k2/1"], h2, SIZE).wait() == [True, True]
        assert h.seal(["k3/0", "k3/1"], h2, SIZE).wait() == [False, False]
        assert h.seal(["k4"], [h2.slice(1, 2)], [SIZE]).wait() == [False]

        got = read_back(reader, ["k1", "k1/1", "k2/0", "k2/1", "k3/0", "k3/1", "k4"])
        assert False not in got.values(), got  # no wrong hit
        assert got == {
            "k1": None,
            "k1/1": None,
            "k2/0": True,
            "k2/1": True,
            "k3/0": None,
            "k3/1": None,
            "k4": None,
        }


def test_a_seal_prepared_before_its_handle_was_freed_and_reserved_again_sends_nothing(
    maru_server,
):
    """prepare_seal(K1, H1) (as a write prepares it during its copy), then H1 freed and its
    chunks reserved again by H2 and written with K2; the prepared seal sent afterwards must
    register nothing (the claim at send is one step with the check). Fails with
    `Sealing._claim` trusting the check made at prepare time (returning before
    `ChunkBook.written`): K1 is registered over H2's chunks and reads K2's bytes."""
    kw = {"server_url": maru_server.url, "pool_size": "2M", "chunk_size_bytes": "64K"}
    with MaruHandler(**kw) as h, MaruHandler(**kw) as reader:
        h1 = h.alloc(SIZE)
        assert h1 is not None
        h1.buf[:] = value_of("k1")
        sealing = h.prepare_seal(["k1"], h1)  # checked now: still reserved
        h.free(h1)
        h2 = h.alloc(SIZE)
        assert h2 is not None and (h2.region_id, h2.offset) == (h1.region_id, h1.offset)
        h2.buf[:] = value_of("k2")
        assert sealing.send().wait() == [False]
        assert h.store("k2", h2)
        got = read_back(reader, ["k1", "k2"])
        assert got == {"k1": None, "k2": True}, got
