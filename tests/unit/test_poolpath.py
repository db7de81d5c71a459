"""`maru.client.poolpath`: where a client opens the server's region paths, and the proof by
the pool's mark (end to end, with real servers: integration/test_pool_path.py)."""

from __future__ import annotations

import pytest

from maru.client.poolpath import PoolMismatch, PoolPlace, prove
from maru.common import poolmark
from maru.common.poolmark import encode_mark

KEY = bytes(range(16))  # a pool key (a server draws one at every start)


def test_region_paths_are_opened_under_the_pool_path():
    file = PoolPlace("/dev/dax0.0", "/dev/dax1.0", directory=False)
    assert file.local_path("/dev/dax0.0") == "/dev/dax1.0"
    assert file.local_path("/dev/dax0.00") == "/dev/dax0.00"  # (not the pool: as named)
    fsdax = PoolPlace("/mnt/pmem/maru", "/pmem1/maru", directory=True)
    assert fsdax.local_path("/mnt/pmem/maru/region-7.mem") == "/pmem1/maru/region-7.mem"
    assert fsdax.local_path("/mnt/pmem/other/region-7.mem") == "/mnt/pmem/other/region-7.mem"
    same = PoolPlace("/dev/shm/p", "/dev/shm/p", directory=False)
    assert same.local_path("/dev/shm/p") == "/dev/shm/p"


def test_an_index_beside_the_pool_file_is_opened_beside_the_pool_path():
    shm = PoolPlace("/dev/shm/maru.pool", "/volume/maru.pool", directory=False)
    assert shm.local_index_path("/dev/shm/maru.pool.index.3") == "/volume/maru.pool.index.3"
    # (anything else as named: another file's index, a /dev/shm table of a device's pool)
    assert shm.local_index_path("/dev/shm/maru.pool2.index.3") == "/dev/shm/maru.pool2.index.3"
    assert shm.local_index_path("/dev/shm/maru-index-ab.1") == "/dev/shm/maru-index-ab.1"
    fsdax = PoolPlace("/mnt/pmem/maru", "/pmem1/maru", directory=True)
    assert fsdax.local_index_path("/mnt/pmem/maru.index.1") == "/mnt/pmem/maru.index.1"
    same = PoolPlace("/dev/shm/p", "/dev/shm/p", directory=False)
    assert same.local_index_path("/dev/shm/p.index.1") == "/dev/shm/p.index.1"


@pytest.mark.parametrize(
    ("mark", "why"),
    [
        (None, "sends no pool mark"),
        ("garbage", "sends no pool mark"),
        ({"generation": "g", "epoch": "e", "file": "", "offset": 0, "span": 0}, "cannot read"),
        ({"generation": "g", "epoch": "e", "file": "", "offset": "x", "span": 1}, "cannot read"),
        ({"generation": "g", "epoch": "e", "file": "", "offset": 8192, "span": 4096}, "cannot"),
        ({"generation": "g", "epoch": "e", "file": "", "offset": 0, "span": 4096}, "no pool mark"),
        ({"generation": "g", "epoch": "f", "file": "", "offset": 4096, "span": 4096}, "epoch e,"),
    ],
)
def test_anything_but_the_mark_the_server_names_is_refused_naming_the_path(tmp_path, mark, why):
    pool = tmp_path / "pool"
    pool.write_bytes(bytes(4096) + encode_mark("g", "e", KEY).ljust(4096, b"\0"))
    with pytest.raises(PoolMismatch, match=why) as refused:
        prove({"path": "/srv/pool", "kind": "shm", "mark": mark}, str(pool))
    assert f"pool_path {pool}" in str(refused.value)
    right = {"generation": "g", "epoch": "e", "file": "", "offset": 4096, "span": 4096}
    place = prove({"path": "/srv/pool", "kind": "shm", "mark": right}, str(pool))
    assert place.local_path("/srv/pool") == str(pool)


def test_the_mark_is_written_back_and_read_from_memory(tmp_path, monkeypatch):
    """The server writes the mark's line back to memory and a client evicts it from its cache
    before reading (a pod without coherence): one line each way, then the bytes round trip."""
    import platform

    calls: list[tuple[int, bool]] = []
    real = poolmark.flush_lines

    def counting(buffer, invalidate=False):
        lines = real(buffer, invalidate)
        calls.append((lines, invalidate))
        return lines

    monkeypatch.setattr(poolmark, "flush_lines", counting)
    path = tmp_path / "pool"
    path.write_bytes(bytes(3 * 4096))
    mark = poolmark.encode_mark("gen-1", "epoch-1", KEY)
    poolmark.write_mark_window(str(path), 4096, 4096, mark)
    assert poolmark.decode_mark(poolmark.read_mark_window(str(path), 4096, 4096)) == (
        "gen-1",
        "epoch-1",
    )
    lines = 1 if platform.machine() in ("x86_64", "AMD64") else 0
    assert calls == [(lines, False), (lines, True)]


def test_the_proof_is_the_instances_own_hmac_of_the_key_only_the_pool_holds(tmp_path):
    """The key in the mark never crosses a socket (the HANDSHAKE names only where the mark
    lies): the proof made from it is bound to the instance, and a mark of another start (its
    own key) makes another proof."""
    pool = tmp_path / "pool"
    pool.write_bytes(bytes(4096) + encode_mark("g", "e", KEY).ljust(4096, b"\0"))
    fields = {"generation": "g", "epoch": "e", "file": "", "offset": 4096, "span": 4096}
    place = prove({"path": str(pool), "kind": "shm", "mark": fields}, None, "inst-1")
    assert place.proof == poolmark.pool_proof(KEY, "inst-1")
    assert place.proof != poolmark.pool_proof(KEY, "inst-2")
    assert place.proof != poolmark.pool_proof(bytes(16), "inst-1")
    assert len(place.proof) == 32 and KEY.hex() not in place.proof


def test_a_mark_written_before_pool_keys_still_names_its_state_but_proves_nothing(tmp_path):
    """A pool an older server marked (no key): a server restoring its state still reads the
    generation and epoch there; it has no key, so no client proof comes from it (every start
    writes a mark with a key before it serves)."""
    import hashlib

    body = b"MARUPOOL" + b"gen-0".ljust(16) + b"ep-0".ljust(16)
    keyless = body + hashlib.blake2b(body, digest_size=8).digest()
    assert poolmark.decode_mark(keyless.ljust(4096, b"\0")) == ("gen-0", "ep-0")
    assert poolmark.parse_mark(keyless.ljust(4096, b"\0")) == ("gen-0", "ep-0", b"")
    keyed = encode_mark("gen-0", "ep-0", KEY)
    assert poolmark.decode_mark(keyed) == ("gen-0", "ep-0") and poolmark.parse_mark(keyed)[2] == KEY
    flipped = bytearray(keyed)
    flipped[len(body) + 3] ^= 1  # (a byte of the key: the digest covers it)
    assert poolmark.decode_mark(bytes(flipped)) is None
    with pytest.raises(ValueError, match="16 bytes"):
        encode_mark("g", "e", b"short")


def test_a_server_that_cannot_prove_the_pool_key_or_a_keyless_mark_is_refused(tmp_path):
    """The server's proof of the handshake's nonce must be the one the mark's key makes: a
    replayed proof (of another nonce), none, or one of another key is refused; so is a mark
    without a key (an older server's, which no server of this version leaves)."""
    pool = tmp_path / "pool"
    pool.write_bytes(bytes(4096) + encode_mark("g", "e", KEY).ljust(4096, b"\0"))
    fields = {"generation": "g", "epoch": "e", "file": "", "offset": 4096, "span": 4096}
    good = {**fields, "proof": poolmark.server_proof(KEY, "nonce-1")}
    assert prove({"path": str(pool), "kind": "shm", "mark": good}, None, "i", "nonce-1").proof
    for proof in (
        poolmark.server_proof(KEY, "nonce-0"),
        None,
        poolmark.server_proof(KEY[::-1], "nonce-1"),
    ):
        mark = {**fields, "proof": proof} if proof else fields
        with pytest.raises(PoolMismatch, match="cannot prove it holds the key"):
            prove({"path": str(pool), "kind": "shm", "mark": mark}, None, "i", "nonce-1")
    import hashlib

    body = b"MARUPOOL" + b"g".ljust(16) + b"e".ljust(16)
    keyless = body + hashlib.blake2b(body, digest_size=8).digest()
    pool.write_bytes(bytes(4096) + keyless.ljust(4096, b"\0"))
    with pytest.raises(PoolMismatch, match="holds no pool key"):
        prove({"path": str(pool), "kind": "shm", "mark": good}, None, "i", "nonce-1")
