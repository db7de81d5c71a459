"""`maru.client.poolpath`: where a client opens the server's region paths, and the proof by
the pool's mark (end to end, with real servers: integration/test_pool_path.py)."""

from __future__ import annotations

import pytest

from maru.client.poolpath import PoolMismatch, PoolPlace, prove
from maru.common.poolmark import encode_mark


def test_region_paths_are_opened_under_the_pool_path():
    file = PoolPlace("/dev/dax0.0", "/dev/dax1.0", directory=False)
    assert file.local_path("/dev/dax0.0") == "/dev/dax1.0"
    assert file.local_path("/dev/dax0.00") == "/dev/dax0.00"  # (not the pool: as named)
    fsdax = PoolPlace("/mnt/pmem/maru", "/pmem1/maru", directory=True)
    assert fsdax.local_path("/mnt/pmem/maru/region-7.mem") == "/pmem1/maru/region-7.mem"
    assert fsdax.local_path("/mnt/pmem/other/region-7.mem") == "/mnt/pmem/other/region-7.mem"
    same = PoolPlace("/dev/shm/p", "/dev/shm/p", directory=False)
    assert same.local_path("/dev/shm/p") == "/dev/shm/p"


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
    pool.write_bytes(bytes(4096) + encode_mark("g", "e").ljust(4096, b"\0"))
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

    from maru.common import poolmark

    calls: list[tuple[int, bool]] = []
    real = poolmark.flush_lines

    def counting(buffer, invalidate=False):
        lines = real(buffer, invalidate)
        calls.append((lines, invalidate))
        return lines

    monkeypatch.setattr(poolmark, "flush_lines", counting)
    path = tmp_path / "pool"
    path.write_bytes(bytes(3 * 4096))
    mark = poolmark.encode_mark("gen-1", "epoch-1")
    poolmark.write_mark_window(str(path), 4096, 4096, mark)
    assert poolmark.decode_mark(poolmark.read_mark_window(str(path), 4096, 4096)) == (
        "gen-1",
        "epoch-1",
    )
    lines = 1 if platform.machine() in ("x86_64", "AMD64") else 0
    assert calls == [(lines, False), (lines, True)]
