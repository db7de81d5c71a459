"""A journal write that fails or comes up short (the state dir is full, a size limit) must leave
no torn record, refuse every later record until a snapshot, and refuse the request that needed
it with no side effect (issue 13, promise P2 in docs/reliability.md).

The fault is real: each scenario runs in a child process whose RLIMIT_FSIZE stops the journal
file from growing (SIGXFSZ ignored, as `maru-server` does, so the kernel answers with a short
write and then EFBIG). The child reports what it saw as JSON; the parent asserts it and replays
the state dir the child left, as a restarted server would.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import maru
from maru.client.cli import render_status
from maru.server import persistence
from maru.server.journal import Journal, _frame
from maru.server.pool import ShmPool
from maru.server.registry import Registry
from maru.server.token import TokenSigner

from .service_calls import make_service

MiB = 1 << 20
CHILD_TIMEOUT_S = 60

PRELUDE = """
import json, resource, signal, sys, time
from pathlib import Path
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
_, HARD = resource.getrlimit(resource.RLIMIT_FSIZE)

def limit_files_to(nbytes):
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, HARD))

def unlimit_files():
    resource.setrlimit(resource.RLIMIT_FSIZE, (HARD, HARD))
"""

JOURNAL_CHILD = """
from maru.server.journal import Journal, JournalWriteError, read_records

state_dir, limit = Path(sys.argv[1]), int(sys.argv[2])
j = Journal(state_dir, fsync_interval=0.0)
j.load()
path = state_dir / f"journal-{j.generation}.log"
limit_files_to(limit)
good, i = [], 0
while True:
    record = ["K", [f"key-{i}" * (1 + i % 7)], [1], [i * 4096], [4096]]
    try:
        j.append(record)
    except JournalWriteError as exc:
        failure = exc.cause.errno
        break
    good.append(record)
    i += 1
data = path.read_bytes()
records, good_bytes = read_records(data)
refused = 0
for k in range(5):
    try:
        j.append(["D", [f"key-{k}"]])
    except JournalWriteError:
        refused += 1
out = {
    "good": good, "errno": failure, "size": len(data), "good_bytes": good_bytes,
    "replayed": records, "refused": refused, "size_after_refused": path.stat().st_size,
    "write_errors": j.write_errors, "writable": j.writable, "needs_snapshot": j.needs_snapshot,
}
j.write_snapshot({"written": len(good)})  # small: fits under the limit, as freed space would
out["writable_after_snapshot"] = j.writable
out["needs_snapshot_after"] = j.needs_snapshot
for record in (["D", ["key-0"]], ["K", ["late"], [1], [0], [8]]):
    j.append(record)
j.close()
print(json.dumps(out))
"""

SERVICE_CHILD = """
from maru.client.poolpath import prove
from maru.common import protocol
from maru.common.protocol import ErrorCode, MsgType, freed_notices, pack_int64
from maru.server.journal import Journal
from maru.server.pool import ShmPool
from maru.server.registry import Registry
from maru.server.service import MaruService
from maru.server.token import TokenSigner
from maru.server import persistence

state_dir, pool_path = Path(sys.argv[1]), sys.argv[2]
journal = Journal(state_dir, fsync_interval=0.0)
snapshot, records = journal.load()
reg = Registry(ShmPool(pool_path, 16 << 20), TokenSigner(b"w" * 32), journal=journal)
persistence.restore(reg, snapshot, records)
svc = MaruService(reg, "tcp://127.0.0.1:0", journal=journal, local_socket="none")
svc.new_instance_id = str  # instance "A" is called "A"

def call(msg_type, body):
    body = dict(body)
    if "iid" in body:  # the instance's name: its session credential on the wire
        name = body.pop("iid")
        if msg_type == MsgType.HANDSHAKE:
            body["name"] = name
        else:
            body["session"] = reg.signer.session(name)
        if msg_type == MsgType.REQUEST_REGION:  # (the proof a client makes: its pool's mark)
            body["pool_proof"] = prove(reg.pool.handshake_fields(), None, name).proof
    return protocol.decode(svc.handle_frame(protocol.encode(msg_type, 1, body)))[1]

def register(keys, rid, first_offset):
    n = len(keys)
    return call(MsgType.REGISTER_KV, {
        "iid": "A", "keys": keys, "region_ids": pack_int64([rid] * n),
        "offsets": pack_int64(range(first_offset, first_offset + 4096 * n, 4096)),
        "lengths": pack_int64([100] * n),
    })

def present(keys):
    return call(MsgType.EXISTS, {"keys": keys})["results"]

def error(reply):
    return None if reply["ok"] else ErrorCode(reply["code"]).name

out = {}
call(MsgType.HANDSHAKE, {"iid": "A", "pid": 1})
region = call(MsgType.REQUEST_REGION, {"iid": "A", "size": 1 << 20})["region"]
rid, token = region[0], region[4]
keys = [f"k{i}" for i in range(10)]
assert register(keys, rid, 0)["results"] == [0] * 10
assert call(MsgType.PIN, {"iid": "A", "keys": ["k9"]})["ok"]

limit_files_to(journal._size + 3)  # the next record is cut short after 3 bytes
reply = call(MsgType.DELETE_KV, {"iid": "A", "keys": ["k0"]})  # fails writing its "D"
out["first_delete"] = error(reply)
out["first_delete_freed"] = freed_notices(reply.get("freed", b""))
out["message"] = reply.get("error", "")
out["size_after_failure"] = (state_dir / f"journal-{journal.generation}.log").stat().st_size
out["good_size"] = journal._size
out["refused"] = {
    "delete": error(call(MsgType.DELETE_KV, {"iid": "A", "keys": ["k1"]})),
    "register": error(register(["new"], rid, 40960)),
    "pin": error(call(MsgType.PIN, {"iid": "A", "keys": ["k2"]})),
    "unpin": error(call(MsgType.UNPIN, {"iid": "A", "keys": ["k9"]})),
    "prefix": error(call(MsgType.DELETE_PREFIX, {"prefix": "k"})),
    "evict_for": error(call(MsgType.EVICT_FOR, {"iid": "A", "bytes": 1 << 20})),
    "request_region": error(call(MsgType.REQUEST_REGION, {"iid": "A", "size": 1 << 20})),
    "return_region": error(
        call(MsgType.RETURN_REGION, {"iid": "A", "region_id": rid, "token": token})
    ),
}
lookup = call(MsgType.LOOKUP_KV, {"iid": "A", "keys": keys + ["new"], "lease": True})
out["reads"] = {
    "lookup": error(lookup),
    "hits": sum(1 for r in memoryview(lookup["region_ids"]).cast("q") if r),
    "release": error(call(MsgType.RELEASE, {"iid": "A", "leases": [lookup["lease_id"]]})),
    "heartbeat": error(call(MsgType.HEARTBEAT, {"iid": "A"})),
    "keys": error(call(MsgType.KEYS, {"limit": 5})),
}
out["present"] = present(keys + ["new"])
out["pins_k9"] = reg.keys.get("k9").pins
out["pins_k2"] = reg.keys.get("k2").pins
out["regions"] = sorted(reg.regions)
out["owned"] = sorted(reg.instances["A"].regions)
out["freed_pending"] = freed_notices(bytes(reg.instances["A"].freed))
stats = call(MsgType.STATS, {})["stats"]
out["stats"] = [stats["journal_writable"], stats["counters"]["journal_write_errors"]]
# a reap now would journal "X" and "T": it does nothing, and does not raise
out["reaped"] = reg.instances.reap(0.0, time.monotonic() + 100)
out["instances"] = sorted(reg.instances)

limit_files_to(16)  # no snapshot fits either: the server carries on, refusing changes
svc.housekeeping()
out["after_failed_snapshot"] = [journal.writable, sorted(p.name for p in state_dir.iterdir())]
unlimit_files()  # space freed
svc.housekeeping(time.monotonic() + 2)  # the next retry
out["writable_again"] = journal.writable
reply = call(MsgType.DELETE_KV, {"iid": "A", "keys": ["k0"]})
out["delete_again"] = [error(reply), reply.get("results"), freed_notices(reply.get("freed", b""))]
out["register_again"] = register(["new"], rid, 40960)["results"]
stats = call(MsgType.STATS, {})["stats"]
out["stats_again"] = [stats["journal_writable"], stats["counters"]["journal_write_errors"]]
svc.close()
print(json.dumps(out))
"""


def run_child(code: str, *args: str) -> dict:
    src = str(Path(maru.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-c", PRELUDE + code, *args],
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def test_short_write_leaves_no_torn_record_and_refuses_until_a_snapshot(tmp_path):
    state_dir = tmp_path / "state"
    out = run_child(JOURNAL_CHILD, str(state_dir), str(10_000 + 7))
    good = out["good"]
    assert len(good) > 50  # the fault came after many good records, not at once
    assert out["errno"] == errno.EFBIG
    # the file ends at the last good record: the short write was cut away
    assert out["size"] == out["good_bytes"] == sum(len(_frame(r)) for r in good)
    assert out["replayed"] == good
    # no record follows the gap: every later append raised and wrote nothing
    assert out["refused"] == 5 and out["size_after_refused"] == out["size"]
    assert out["write_errors"] == 1
    assert out["writable"] is False and out["needs_snapshot"] is True
    assert out["writable_after_snapshot"] is True and out["needs_snapshot_after"] is False
    # a restart reads the snapshot and every record appended after it
    journal = Journal(state_dir, fsync_interval=0.0)
    snapshot, records = journal.load()
    journal.close()
    assert snapshot is not None and snapshot["written"] == len(good)
    assert records == [["D", ["key-0"]], ["K", ["late"], [1], [0], [8]]]
    assert not list(state_dir.glob("*.tmp"))


def test_refused_requests_have_no_side_effect_and_changes_resume(tmp_path):
    state_dir, pool = tmp_path / "state", str(tmp_path / "pool")
    out = run_child(SERVICE_CHILD, str(state_dir), pool)
    unavailable = "STATE_UNAVAILABLE"
    # the request whose record failed, and every change after it, refused (never INTERNAL)
    assert out["first_delete"] == unavailable
    assert "cannot write its journal" in out["message"] and str(state_dir) in out["message"]
    assert out["refused"] == dict.fromkeys(out["refused"], unavailable)
    assert out["size_after_failure"] == out["good_size"]  # the torn record is gone
    # ... and none of them changed anything: keys, pins, regions, freed pages
    assert out["present"] == [True] * 10 + [False]
    assert out["pins_k9"] == 1 and out["pins_k2"] == 0
    assert len(out["regions"]) == 1 and out["owned"] == out["regions"]
    assert out["first_delete_freed"] == [] and out["freed_pending"] == []
    # reads went on
    assert out["reads"] == {
        "lookup": None,
        "hits": 10,
        "release": None,
        "heartbeat": None,
        "keys": None,
    }
    assert out["stats"] == [False, 1]
    assert out["reaped"] == [] and out["instances"] == ["A"]
    # a failed snapshot did not stop the service, and left no partial file behind
    writable, names = out["after_failed_snapshot"]
    assert writable is False
    assert not [n for n in names if n.endswith(".tmp")]
    # once the space is back, changes are accepted again
    assert out["writable_again"] is True
    error, results, freed = out["delete_again"]
    assert error is None and results == [0] and len(freed) == 1
    assert out["register_again"] == [0]
    assert out["stats_again"] == [True, 1]
    # a restart replays exactly what was acknowledged
    journal = Journal(state_dir, fsync_interval=0.0)
    snapshot, records = journal.load()
    reg = Registry(ShmPool(pool, 16 * MiB), TokenSigner(b"w" * 32), journal=journal)
    persistence.restore(reg, snapshot, records)
    try:
        assert sorted(reg.keys) == sorted([f"k{i}" for i in range(1, 10)] + ["new"])
        assert reg.keys.get("k9").pins == 1
    finally:
        journal.close()


def test_maru_status_says_when_the_journal_is_not_writable(tmp_path):
    svc = make_service(tmp_path)
    try:
        stats = svc.stats()
    finally:
        svc.close()
    assert stats["journal_writable"] is True and stats["journal_error"] is None
    assert "journal:" not in render_status("tcp://x:1", stats)
    stats.update(journal_writable=False, journal_error="[Errno 28] No space left on device")
    stats["counters"]["journal_write_errors"] = 2
    line = render_status("tcp://x:1", stats).splitlines()[-1]
    assert line.startswith("journal:   NOT WRITABLE ([Errno 28] No space left on device)")
    assert "(2 write errors)" in line
