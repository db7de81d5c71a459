"""Identity is a credential the server issues (issue 13, P3): a process that picks another's
instance name gets an instance of its own, and no client can release, unpin, return, evict
from or register into what another instance holds. Real server, real processes."""

from __future__ import annotations

import json
import os
import select
import signal
import time
import traceback

import pytest

from maru import MaruHandler, MaruNotConnected
from maru.client.rpc import RpcClient
from maru.common.errors import MaruServerError
from maru.common.protocol import ErrorCode, MsgType, RegisterStatus, pack_int64

from .workers import SPAWN, digest, make_value, retrieve_keys, run_processes

NAME = "sglang-host:30000"  # what the docs once suggested for every TP rank


def churn(url: str, prefix: str, seed: int, barrier) -> dict:
    """Store 16 values a round and delete 8 of them, for 20 rounds, in a small pool: pages
    are reused all the time. Returns the instance id and the digests of the keys it kept."""
    h = MaruHandler(
        server_url=url,
        instance_id=NAME,
        pool_size="1M",
        chunk_size_bytes="64K",
        auto_expand=False,
        timeout_ms=10_000,
    )
    kept: dict[str, str] = {}
    try:
        barrier.wait(30)
        for r in range(20):
            keys = [f"{prefix}/{r}/{i}" for i in range(16)]
            values = [make_value(seed + r * 100 + i, 20_000 + 997 * i) for i in range(16)]
            results = h.batch_store(keys, values)
            for key, value, ok in zip(keys, values, results):
                if ok:
                    kept[key] = digest(value)
            gone = [k for k in keys[::2] if k in kept]
            for key, deleted in zip(gone, h.batch_delete(gone)):
                if deleted:
                    del kept[key]
        return {"iid": h.instance_id, "kept": kept}
    finally:
        h.close()


def test_two_live_processes_with_one_instance_name_get_two_instances(maru_server):
    """Scenario 5: both processes write and reuse pages at the same time; with one shared
    instance they wrote into each other's pages (256 of 640 values wrong)."""
    barrier = SPAWN.Barrier(2)
    a, b = run_processes(
        [(churn, (maru_server.url, "a", 1, barrier)), (churn, (maru_server.url, "b", 9, barrier))],
        timeout=120,
    )
    assert a["iid"] != b["iid"]
    assert a["iid"].startswith(NAME + ".") and b["iid"].startswith(NAME + ".")
    kept = {**a["kept"], **b["kept"]}
    assert len(kept) > 100  # acknowledged, and not deleted
    keys = list(kept)
    read = retrieve_keys(maru_server.url, keys, batch=64)["digests"]
    wrong = sum(got is not None and got != kept[k] for k, got in zip(keys, read))
    hits = sum(got is not None for got in read)  # the rest were evicted to make room
    assert wrong == 0 and hits >= 16


@pytest.fixture
def victim(maru_server):
    h = MaruHandler(
        server_url=maru_server.url, instance_id="victim", pool_size="4M", chunk_size_bytes="64K"
    )
    yield h
    h.close()


def test_no_client_can_act_on_another_instances_pins_leases_regions_or_pages(maru_server, victim):
    """Scenario 8: a client that knows the victim's instance id, lease ids and region tokens
    (LIST_ALLOCATIONS hands them to anyone) still cannot touch what the victim holds."""
    values = {f"v{i}": os.urandom(30_000 + i) for i in range(8)}
    assert victim.batch_store(list(values), list(values.values())) == [True] * 8
    assert victim.pin("v0")
    lease = victim.lookup(["v1", "v2"], lease=True)
    lease.wait()
    assert lease.lease_id > 0
    region = victim.list_allocations()[0]
    vid = victim.instance_id

    attacker = RpcClient(maru_server.url, timeout_ms=5000)
    mine = attacker.request(MsgType.HANDSHAKE, {"name": "victim"}).result()
    assert mine["iid"] != vid  # the same name is another instance
    forged = attacker.request(MsgType.HANDSHAKE, {"name": "x", "session": f"{vid}~{'f' * 32}"})
    assert forged.result()["iid"] != vid  # a made-up credential is no credential
    sessions = {"own": mine["session"], "forged": f"{vid}~{'0' * 32}", "none": None}

    def send(msg_type: MsgType, body: dict, session: str | None) -> dict:
        if session is not None:
            body = {**body, "session": session}
        try:
            return attacker.request(msg_type, body).result()
        except MaruServerError as exc:
            return {"ok": False, "code": exc.code}

    succeeded = []
    for who, session in sessions.items():
        ids = [lease.lease_id, *range(1, 50)]  # its real lease id (ids start at random)
        released = send(MsgType.RELEASE, {"leases": ids}, session)
        if released.get("released"):
            succeeded.append((who, "release"))
        unpinned = send(MsgType.UNPIN, {"keys": ["v0"]}, session)
        if any(unpinned.get("results") or ()):
            succeeded.append((who, "unpin"))
        freed = send(MsgType.EVICT_FOR, {"bytes": 4 << 20}, session)
        if freed.get("freed_bytes"):
            succeeded.append((who, "evict"))
        body = {
            "keys": ["intruder"],
            "region_ids": pack_int64([region.region_id]),
            "offsets": pack_int64([0]),
            "lengths": pack_int64([100]),
        }
        registered = send(MsgType.REGISTER_KV, body, session)
        if registered.get("results") == [RegisterStatus.REGISTERED]:
            succeeded.append((who, "register"))
        returned = send(
            MsgType.RETURN_REGION, {"region_id": region.region_id, "token": region.token}, session
        )
        if returned.get("ok"):
            succeeded.append((who, "return"))
        else:
            assert returned["code"] in (ErrorCode.NOT_OWNER, ErrorCode.UNKNOWN_INSTANCE)
    attacker.close()
    assert succeeded == []

    # The victim's state is intact: its pin, its lease, its region and its bytes.
    assert victim.delete("v0") is False  # still pinned
    assert victim.delete("v1") is False  # still leased
    lease.release()
    assert victim.owned_region_ids() == [region.region_id]
    assert not victim.exists("intruder")
    with MaruHandler(server_url=maru_server.url, pool_size="1M") as reader:
        got = [bytes(i.view) if i else None for i in reader.batch_retrieve(list(values))]
    assert got == list(values.values())


def test_a_reconnect_resumes_the_same_instance(maru_server, victim):
    """The session credential is what a reconnect presents: after the server forgets the
    session (a restart), the same handler comes back as the same instance, with its regions."""
    assert victim.store("k", b"x" * 1000)
    before = (victim.instance_id, victim.owned_region_ids())
    victim._handshake()
    assert (victim.instance_id, victim.owned_region_ids()) == before


def test_close_ends_the_instance_its_pins_leases_and_regions(maru_server):
    """close() sends DISCONNECT: pins and leases end at once (not at the reaper's timeout), the
    regions go back, the keys stay readable, and the old credential is void."""
    h = MaruHandler(server_url=maru_server.url, pool_size="1M", chunk_size_bytes="64K")
    assert h.batch_store(["p", "l"], [b"p" * 5000, b"l" * 5000]) == [True, True]
    assert h.pin("p")
    lease = h.lookup(["l"], lease=True)
    lease.wait()
    assert lease.lease_id > 0
    session = h._rpc.session
    h.close()

    with MaruHandler(server_url=maru_server.url, pool_size="1M") as other:
        assert bytes(other.retrieve("l").view) == b"l" * 5000  # keys outlive their writer
        assert other.delete("p") and other.delete("l")  # no pin, no lease holds them now
        owners = {r.owner for r in other.list_allocations()}
        assert h.instance_id not in owners
    rpc = RpcClient(maru_server.url, timeout_ms=5000)
    with pytest.raises(MaruServerError) as err:
        rpc.request(MsgType.PIN, {"keys": ["x"], "session": session}).result()
    rpc.close()
    assert err.value.code == ErrorCode.UNKNOWN_INSTANCE


# -- one credential, one process (issue 40, cases 2 and 5) -------------------------------------

VALUE = 40_000  # one 64 KiB chunk each
FORK_S = 60.0  # the most the forked child may take, start to exit


def store_values(h: MaruHandler, prefix: str, seed: int, n: int = 8) -> dict[str, str]:
    """Store `n` values under `prefix/i`; the digests of those acknowledged, by key."""
    keys = [f"{prefix}/{i}" for i in range(n)]
    values = [make_value(seed + i, VALUE) for i in range(n)]
    return {k: digest(v) for k, v, ok in zip(keys, values, h.batch_store(keys, values)) if ok}


def read_line(fd: int, deadline: float) -> bytes:
    """One line from a pipe, by `deadline` (time.monotonic()); b"" at EOF or past it."""
    data = b""
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return b""
        chunk = os.read(fd, 65536)
        if not chunk:
            return b""
        data += chunk
    return data


def forked_child(h: MaruHandler, url: str, report: int, go: int) -> None:
    """The child of `fork_and_store`: store with the handler it inherited, or, where that is
    refused, with one of its own; report; close the inherited one when told to."""
    first_use = "stored"
    own = None
    try:
        kept = store_values(h, "child", 500)
    except Exception as exc:  # the documented behaviour: the inherited handler refuses
        first_use = f"{type(exc).__name__}: {exc}"
        own = MaruHandler(server_url=url, pool_size="1M", chunk_size_bytes="64K", timeout_ms=5000)
        kept = store_values(own, "child", 500)
    kept.update(store_values(own or h, "child2", 600, n=4))
    os.write(report, json.dumps({"first_use": first_use, "kept": kept}).encode() + b"\n")
    read_line(go, time.monotonic() + FORK_S)  # the parent stored its values
    h.close()  # the inherited handler: must not end the parent's instance
    if own is not None:
        own.close()
    os.write(report, b"closed\n")


def fork_and_store(url: str) -> dict:
    """A process that connects, stores, then forks (as a worker pool started after the
    backend does); the child stores (first, while the parent waits: the inherited allocator
    would hand out the very chunks the parent takes next), then the parent stores, then the
    child closes the handler it inherited and the parent stores once more."""
    h = MaruHandler(
        server_url=url, pool_size="1M", chunk_size_bytes="64K", auto_expand=False, timeout_ms=5000
    )
    parent = store_values(h, "pre", 100, n=4)
    report_r, report_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the caller's code
        try:
            os.close(report_r)
            os.close(go_w)
            forked_child(h, url, report_w, go_r)
        except BaseException:
            os.write(report_w, json.dumps({"error": traceback.format_exc()}).encode() + b"\n")
        finally:
            os._exit(0)
    os.close(report_w)
    os.close(go_r)
    try:
        deadline = time.monotonic() + FORK_S
        child = json.loads(read_line(report_r, deadline) or b'{"error": "no report"}')
        regions = h.owned_region_ids()
        parent.update(store_values(h, "parent", 200))
        os.write(go_w, b"go\n")
        closed = read_line(report_r, deadline) == b"closed\n"
        after = (h.instance_id, h.owned_region_ids())
        parent.update(store_values(h, "post", 300, n=2))
        return {
            "parent": parent,
            "child": child,
            "child_closed": closed,
            "intact": after == (h.instance_id, regions),
        }
    finally:
        while os.waitpid(pid, os.WNOHANG) == (0, 0):  # still running
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        h.close()


def test_a_child_forked_after_connecting_never_writes_as_its_parent(maru_server):
    """Case 2: a process forked after connecting holds its parent's credential and a copy of
    its chunk allocator. Its first use of the inherited handler raises `MaruForkedError` (the
    child makes a handler of its own); before, it stored as its parent, into the chunks the
    parent took next, and its close() ended the parent's instance."""
    (out,) = run_processes([(fork_and_store, (maru_server.url,))], timeout=3 * FORK_S)
    child = out["child"]
    assert "error" not in child, child.get("error")
    kept = {**out["parent"], **child["kept"]}
    keys = list(kept)
    read = retrieve_keys(maru_server.url, keys, batch=64)["digests"]
    wrong = sum(got is not None and got != kept[k] for k, got in zip(keys, read))
    hits = sum(got is not None for got in read)
    print(f"\n{wrong} of {hits} values wrong; the child's first use: {child['first_use']}")
    assert wrong == 0 and hits == len(keys)
    assert len(out["parent"]) == 14 and len(child["kept"]) == 12  # all acknowledged
    assert child["first_use"].startswith("MaruForkedError: ")
    assert out["child_closed"] and out["intact"]  # the child's close() ended nothing of ours


def fork_while_locked(url: str) -> dict:
    """Fork while the handler's locks are held (as its heartbeat, populate or writer threads
    may hold one at the moment a worker pool forks): the child's first use of the inherited
    handler and its close() must not wait for a lock no thread of the child will release."""
    h = MaruHandler(server_url=url, pool_size="1M", chunk_size_bytes="64K", timeout_ms=5000)
    store_values(h, "pre", 100, n=2)
    locks = [h._mapper._lock, h._chunks._lock, h._rpc._channels_lock]
    for lock in locks:
        lock.acquire()
    report_r, report_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        outcome = "hung"
        try:
            signal.alarm(int(FORK_S))  # a child that waits for one of them dies of it
            try:
                h.batch_store(["child"], [b"x" * 10])
                outcome = "stored"
            except Exception as exc:
                outcome = type(exc).__name__
            h.close()
            os.write(report_w, f"{outcome} closed\n".encode())
        finally:
            os._exit(0)
    os.close(report_w)
    try:
        line = read_line(report_r, time.monotonic() + FORK_S + 5)
    finally:
        for lock in locks:
            lock.release()
        os.waitpid(pid, 0)
        h.close()
    return {"child": line.decode().strip()}


def test_a_child_forked_while_the_handler_holds_a_lock_is_refused_at_once(maru_server):
    """The refusal comes before anything that locks: a child forked while a thread of its
    parent held the mapper's, the chunk book's or the RPC client's lock gets
    `MaruForkedError` and closes the inherited handler (before: its store waited forever for
    the mapper's lock; the soak's forked child failed so once in ~20 runs)."""
    (out,) = run_processes([(fork_while_locked, (maru_server.url,))], timeout=2 * FORK_S)
    assert out["child"] == "MaruForkedError closed"


def present_credential(url: str, session: str, local: str, uid: int, region: list) -> dict:
    """Another process with a copy of an instance's credential: as a handler that connects
    with it (over TCP, as every first handshake) and stores, then as raw requests over the
    server's local socket (where the server knows who is asking)."""
    h = MaruHandler(
        server_url=url, pool_size="1M", chunk_size_bytes="64K", auto_connect=False, timeout_ms=5000
    )
    h._rpc.session = session  # copied out of the first process's handler
    connected = h.connect()
    try:  # (refused at connect: its stores raise "Not connected", as the original's do)
        stored = store_values(h, "intruder", 700)
    except MaruNotConnected:
        stored = {}
    h.close()
    rpc = RpcClient(url, timeout_ms=5000)
    rpc.use_local_socket(local, uid)
    region_id, token = region[0], region[4]
    answers = {}
    for msg_type, body in (
        (MsgType.HANDSHAKE, {"name": "intruder"}),
        (
            MsgType.REGISTER_KV,
            {
                "keys": ["intruder/raw"],
                "region_ids": pack_int64([region_id]),
                "offsets": pack_int64([0]),
                "lengths": pack_int64([VALUE]),
            },
        ),
        (MsgType.RETURN_REGION, {"region_id": region_id, "token": token}),
        (MsgType.DISCONNECT, {}),
    ):
        try:
            reply = rpc.request(msg_type, {**body, "session": session}).result()
            answers[msg_type.name] = f"ok {reply}"
        except MaruServerError as exc:
            answers[msg_type.name] = int(exc.code)
    rpc.close()
    return {"connected": connected, "stored": stored, "answers": answers}


def test_a_second_live_process_presenting_a_credential_is_refused(maru_server):
    """Case 2, by hand: a process that copied a live instance's credential is refused, over
    TCP and over the local socket, and cannot store over its pages. Before, its handshake
    resumed the instance, handed it the regions with every chunk free, and its stores wrote
    over the first process's values."""
    with MaruHandler(server_url=maru_server.url, pool_size="1M", chunk_size_bytes="64K") as a:
        mine = store_values(a, "a", 1, n=12)
        assert len(mine) == 12 and a._rpc.local_address is not None  # bound on the local socket
        regions = a.owned_region_ids()
        (region,) = a.list_allocations()
        (out,) = run_processes(
            [
                (
                    present_credential,
                    (
                        maru_server.url,
                        a._rpc.session,
                        a._rpc.local_address,
                        a._rpc.server_uid,
                        region.to_wire(),
                    ),
                )
            ],
            timeout=60,
        )
        keys = list(mine)
        read = retrieve_keys(maru_server.url, keys, batch=64)["digests"]
        wrong = sum(got is not None and got != mine[k] for k, got in zip(keys, read))
        print(f"\n{wrong} of {len(keys)} values wrong; the intruder: {out}")
        assert wrong == 0 and None not in read
        assert not out["connected"] and out["stored"] == {}
        assert out["answers"] == dict.fromkeys(
            ["HANDSHAKE", "REGISTER_KV", "RETURN_REGION", "DISCONNECT"], ErrorCode.NOT_AUTHORIZED
        )
        # the first process is untouched: its instance, its region, and it still stores
        assert a.owned_region_ids() == regions
        assert store_values(a, "a2", 50, n=2).keys() == {"a2/0", "a2/1"}
        assert not a.exists("intruder/raw")


def test_a_disconnected_credential_resumes_nothing(maru_server):
    """Case 5: after DISCONNECT (close()), a HANDSHAKE with the old credential gets a new
    instance of its own (never the old one, whose regions it cannot return or register into),
    over TCP, over the local socket and after a server restart. Before, it resumed the old
    instance id."""
    h = MaruHandler(server_url=maru_server.url, pool_size="1M", chunk_size_bytes="64K")
    mine = store_values(h, "v", 1, n=4)
    old_iid, session = h.instance_id, h._rpc.session
    local, uid = h._rpc.local_address, h._rpc.server_uid
    (region,) = h.list_allocations()
    h.close()

    def handshake(rpc: RpcClient) -> dict:
        return rpc.request(MsgType.HANDSHAKE, {"name": "again", "session": session}).result()

    tcp, unix = RpcClient(maru_server.url, timeout_ms=5000), RpcClient(maru_server.url)
    unix.use_local_socket(local, uid)
    try:
        replies = [handshake(tcp), handshake(unix)]
        maru_server.restart()
        tcp.close()
        tcp = RpcClient(maru_server.url, timeout_ms=5000)
        replies.append(handshake(tcp))
        for reply in replies:
            assert reply["iid"] != old_iid and reply["iid"].startswith("again.")
            assert reply["regions"] == [] and reply["session"] != session
        # what it got cannot touch the old region
        body = {
            "session": replies[-1]["session"],
            "keys": ["v/0-again"],
            "region_ids": pack_int64([region.region_id]),
            "offsets": pack_int64([0]),
            "lengths": pack_int64([VALUE]),
        }
        assert tcp.request(MsgType.REGISTER_KV, body).result()["results"] == [
            RegisterStatus.REJECTED
        ]
        with pytest.raises(MaruServerError) as err:
            body = {"session": replies[-1]["session"], "region_id": region.region_id}
            tcp.request(MsgType.RETURN_REGION, {**body, "token": region.token}).result()
        assert err.value.code == ErrorCode.NOT_OWNER
    finally:
        tcp.close()
        unix.close()
    keys = list(mine)
    read = retrieve_keys(maru_server.url, keys, batch=64)["digests"]
    assert [mine[k] for k in keys] == read  # the old values, as written
