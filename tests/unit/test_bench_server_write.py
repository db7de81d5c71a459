"""bench_server_write.py keeps measuring what it says: a full instance's writes, each evicting
a write's worth of its own oldest keys, the freed pages written next. No timing asserted."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_server_write


def test_each_write_frees_the_next_writes_pages(tmp_path):
    freed = bench_server_write.run(3, tmp_path, share=32 << 20, warm=2)
    assert freed == [bench_server_write.BATCH] * 3


def test_callgrind_dump_is_read_per_shared_object(tmp_path):
    dump = tmp_path / "callgrind.out"
    dump.write_text(
        "events: Ir\nob=/x/libpython3.11.so\nfn=f\n1 100\ncalls=1 2\n2 999\n"
        "ob=/x/_shmindex.cpython-311.so\nfn=g\n3 7\n+1 3\n"
    )
    costs = bench_server_write.self_costs(dump)
    assert costs == {"/x/libpython3.11.so": 100, "/x/_shmindex.cpython-311.so": 10}
    assert bench_server_write.group_of("/x/_shmindex.cpython-311.so") == "local index (C)"
