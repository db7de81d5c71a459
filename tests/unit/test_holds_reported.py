"""What each instance holds, visible: the bytes of the keys its read leases hold and of the
keys it pins (what --quota-lease-bytes and --quota-pin-bytes bound) in STATS, per instance and
the instances' together, in the Prometheus export and in `maru status` / `maru stats`, back to
0 as the holds end (RELEASE and UNPIN, expiry, DISCONNECT, reaping). A PIN's two bounds
(keys, bytes) are checked in one pass with the same refusals; a heartbeat never marks use, so
heartbeats alone leave an instance reapable as idle while a request does not."""

from __future__ import annotations

import io
import re
import time
import urllib.request

import pytest

from maru import MaruAdmin, MaruHandler
from maru.client.cli import main, render_stats
from maru.client.rpc import RpcClient
from maru.common.protocol import ErrorCode, MsgType, ProtocolError
from maru.server import handlers
from maru.server.instances import Instance

from .service_calls import call, ok, page_keys, refused

MiB = 1 << 20
PAGE = 4096


def held(stats: dict) -> tuple[int, int, dict[str, tuple[int, int]]]:
    """(leased bytes, pinned bytes, {instance: (leased, pinned)}) of a STATS dict; the totals
    (running sums kept by the holds) must be the instances' figures added up."""
    per = {iid: (i["leased_bytes"], i["pinned_bytes"]) for iid, i in stats["instances"].items()}
    assert stats["leased_bytes"] == sum(leased for leased, _ in per.values())
    assert stats["pinned_bytes"] == sum(pinned for _, pinned in per.values())
    return stats["leased_bytes"], stats["pinned_bytes"], per


def exported(stats_source) -> dict[tuple[str, tuple], float]:
    """The Prometheus text of `stats_source`, parsed: {(sample, labels): value}."""
    prometheus_client = pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    from maru.server.metrics import MaruCollector

    reg = prometheus_client.CollectorRegistry(auto_describe=False)
    reg.register(MaruCollector(stats_source))
    text = prometheus_client.generate_latest(reg).decode()
    return parse_metrics(text, text_string_to_metric_families)


def parse_metrics(text: str, families) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in families(text)
        for s in f.samples
    }


def instance_table(text: str) -> dict[str, dict[str, str]]:
    """`maru stats`'s INSTANCES table: {instance: {column: cell}} (cells split on 2+ spaces)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("INSTANCE "))
    header = re.split(r"\s{2,}", lines[start].strip())
    rows = {}
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        cells = re.split(r"\s{2,}", line.strip())
        rows[cells[0]] = dict(zip(header, cells))
    return rows


def holds_line(text: str) -> str:
    return next(line for line in text.splitlines() if line.startswith("holds:"))


# -- leased and pinned bytes, in-process ----------------------------------------------------


def take_holds(svc, keys: list[str]) -> tuple[int, int]:
    """P pins keys 0 (twice: its bytes once) and 1, 3 pages; L leases keys 2..4, 12 pages, and
    P key 4 too, 5 pages. The ids of L's lease and P's."""
    assert ok(svc, MsgType.PIN, {"iid": "P", "keys": [keys[0], keys[0], keys[1]]})["results"]
    lease = ok(svc, MsgType.LOOKUP_KV, {"iid": "L", "keys": keys[2:5], "lease": True})
    mine = ok(svc, MsgType.LOOKUP_KV, {"iid": "P", "keys": keys[4:5], "lease": True})
    assert lease["lease_id"] and mine["lease_id"]
    return lease["lease_id"], mine["lease_id"]


def test_leased_and_pinned_bytes_show_in_stats_metrics_and_maru_stats(service):
    """Without a lease quota (--quota-lease-bytes 100%) the bytes of leased keys were never
    counted, and neither figure was reported anywhere."""
    reg = service.registry
    reg.pins.max_bytes = 64 * PAGE
    reg.quota_lease_bytes = 0  # no lease quota: the leased bytes are counted all the same
    for name in ("W", "P", "L"):
        ok(service, MsgType.HANDSHAKE, {"iid": name})
    keys = page_keys(service, "W", [1, 2, 3, 4, 5])
    assert held(service.stats()) == (0, 0, {"W": (0, 0), "P": (0, 0), "L": (0, 0)})
    take_holds(service, keys)

    stats = service.stats()
    assert held(stats) == (
        17 * PAGE,
        3 * PAGE,
        {"W": (0, 0), "P": (5 * PAGE, 3 * PAGE), "L": (12 * PAGE, 0)},
    )
    assert (stats["quota_lease_bytes"], stats["quota_pin_bytes"]) == (0, 64 * PAGE)

    metrics = exported(service.stats)
    assert metrics[("maru_leased_bytes", ())] == 17 * PAGE
    assert metrics[("maru_pinned_bytes", ())] == 3 * PAGE
    assert metrics[("maru_quota_lease_bytes", ())] == 0
    assert metrics[("maru_quota_pin_bytes", ())] == 64 * PAGE
    by = (("instance", "P"),)
    assert metrics[("maru_instance_leased_bytes", by)] == 5 * PAGE
    assert metrics[("maru_instance_pinned_bytes", by)] == 3 * PAGE
    assert metrics[("maru_instance_leased_bytes", (("instance", "L"),))] == 12 * PAGE

    text = render_stats("tcp://x:1", stats)
    assert holds_line(text) == (
        "holds:     68.0 KiB under leases (no quota), 12.0 KiB pinned "
        "(at most 256.0 KiB an instance)"
    )
    rows = instance_table(text)
    assert (rows["P"]["LEASED"], rows["P"]["PINNED"]) == ("20.0 KiB", "12.0 KiB")
    assert (rows["L"]["LEASED"], rows["L"]["PINNED"]) == ("48.0 KiB", "0 B")
    assert rows["P"]["IDLE"].endswith("s")  # (IDLE stays the last column)


@pytest.mark.parametrize("how", ["release", "expire", "disconnect", "reap"])
def test_held_bytes_return_to_zero_when_the_holds_end(service, how):
    reg = service.registry
    reg.pins.max_bytes = 64 * PAGE
    reg.quota_lease_bytes = 64 * PAGE
    for name in ("W", "P", "L"):
        ok(service, MsgType.HANDSHAKE, {"iid": name})
    keys = page_keys(service, "W", [1, 2, 3, 4, 5])
    lease_l, lease_p = take_holds(service, keys)
    assert held(service.stats())[:2] == (17 * PAGE, 3 * PAGE)
    if how == "release":
        ok(service, MsgType.UNPIN, {"iid": "P", "keys": [keys[0]]})  # one of two pins on it
        assert held(service.stats())[:2] == (17 * PAGE, 3 * PAGE)
        ok(service, MsgType.UNPIN, {"iid": "P", "keys": [keys[0], keys[1]]})
        assert ok(service, MsgType.RELEASE, {"iid": "L", "leases": [lease_l]})["released"] == 1
        left = (5 * PAGE, 0, {"W": (0, 0), "P": (5 * PAGE, 0), "L": (0, 0)})
        assert held(service.stats()) == left
        # another's lease is not released by it (`releases_refused`): its bytes stay
        assert ok(service, MsgType.RELEASE, {"iid": "L", "leases": [lease_p]})["released"] == 0
        assert held(service.stats()) == left
        assert ok(service, MsgType.RELEASE, {"iid": "P", "leases": [lease_p]})["released"] == 1
    elif how == "expire":
        reg.leases.expire(time.monotonic() + 3600)
        left = (0, 3 * PAGE, {"W": (0, 0), "P": (0, 3 * PAGE), "L": (0, 0)})
        assert held(service.stats()) == left
        ok(service, MsgType.UNPIN, {"iid": "P", "keys": [keys[0], keys[0], keys[1]]})
    elif how == "disconnect":
        for name in ("P", "L"):
            ok(service, MsgType.DISCONNECT, {"iid": name})
    else:
        ok(service, MsgType.HEARTBEAT, {"iid": "W"})
        gone = reg.instances.reap(timeout=15.0, now=time.monotonic() + 16.0)
        assert sorted(gone) == ["L", "P", "W"]
    stats = service.stats()
    assert held(stats)[:2] == (0, 0)
    assert all(i.pin_bytes == 0 == i.lease_bytes for i in reg.instances.values())
    metrics = exported(service.stats)
    assert metrics[("maru_leased_bytes", ())] == 0 == metrics[("maru_pinned_bytes", ())]
    assert holds_line(render_stats("tcp://x:1", stats)).startswith("holds:     0 B under leases")


# -- one pass for a PIN's bounds ------------------------------------------------------------


class Walked(list):
    """A batch of keys that counts the passes made over it (C calls that take a sequence,
    the key checks and the index's batch lookup, count too: compare, never count)."""

    walks = 0

    def __iter__(self):
        self.walks += 1
        return super().__iter__()


def walks_to_refuse(svc, iid: str, keys: list[str], message: str) -> int:
    """The passes over `keys` a PIN by `iid` makes to be refused with `message`."""
    body = {"iid": iid, "keys": Walked(keys), "leading": False}
    with pytest.raises(ProtocolError) as refusal:
        handlers.on_pin(svc, body)
    assert refusal.value.code == ErrorCode.QUOTA_EXCEEDED
    assert str(refusal.value) == message
    return body["keys"].walks


def test_a_pins_bounds_are_checked_in_one_pass_with_the_same_refusals(service):
    """The count bound (`max_keys`, keys counted as if all were pinned) and the byte bound
    (`max_bytes`, each key once, none pinned already, with `leading` none after a miss) were
    two passes over the batch; one now, the count still refused first, the same messages."""
    pins = service.registry.pins
    pins.max_keys, pins.max_bytes = 4, 6 * PAGE
    for name in ("W", "P"):
        ok(service, MsgType.HANDSHAKE, {"iid": name})
    keys = page_keys(service, "W", [1, 1, 1, 4, 1, 1])
    assert ok(service, MsgType.PIN, {"iid": "P", "keys": keys[:3]})["results"] == [True] * 3

    # Q pins 6 pages in 3 keys: a key more is within the count however it is counted
    ok(service, MsgType.HANDSHAKE, {"iid": "Q"})
    ok(service, MsgType.PIN, {"iid": "Q", "keys": [keys[3], keys[0], keys[1]]})
    message = f"instance Q holds {6 * PAGE} pinned bytes ({PAGE} more asked): its quota is "
    one_pass = walks_to_refuse(service, "Q", [keys[2]], message + str(6 * PAGE))
    # P's batch is within the count only once the keys it pins already are told apart (3
    # pinned + 1 new), not within the bytes (3 + 4 pages): refused whole, and the keys walked
    # no more often than Q's (before, a pass of its own for the count, then the bytes')
    message = f"instance P holds {3 * PAGE} pinned bytes ({4 * PAGE} more asked): its quota is "
    assert walks_to_refuse(service, "P", keys[:4], message + str(6 * PAGE)) == one_pass
    assert set(pins.instances["P"].pins) == set(keys[:3])

    assert ok(service, MsgType.PIN, {"iid": "P", "keys": [keys[0], keys[4], keys[4]]})["results"]

    # Past the count (4 pinned + 2 new) and the bytes: the count is said
    why = refused(service, MsgType.PIN, {"iid": "P", "keys": [keys[5], keys[3], keys[0]]})
    assert why == "instance P holds 4 pinned keys (2 more asked): its quota is 4"
    # A key missing counts toward the count (as if pinned) but holds no bytes
    why = refused(service, MsgType.PIN, {"iid": "P", "keys": ["no-such-key"]})
    assert why == "instance P holds 4 pinned keys (1 more asked): its quota is 4"
    pins.max_keys = 8
    # With "leading" the bytes stop at the first miss: keys[3] (4 pages) is not counted
    lead = {"iid": "P", "keys": [keys[5], "no-such-key", keys[3]], "leading": True}
    assert ok(service, MsgType.PIN, lead)["results"] == [True, False, False]
    # Without, it is: 5 pages pinned + 4 more
    why = refused(service, MsgType.PIN, {"iid": "P", "keys": [keys[5], "no-such-key", keys[3]]})
    assert why == (
        f"instance P holds {5 * PAGE} pinned bytes ({4 * PAGE} more asked): its quota is {6 * PAGE}"
    )
    assert service.stats()["instances"]["P"]["pinned_bytes"] == 5 * PAGE


# -- heartbeats are life, not use -----------------------------------------------------------


def test_heartbeats_alone_leave_an_instance_reapable_as_idle_and_a_request_does_not(service, clock):
    """A HEARTBEAT marks no use in the first place (before, `touch` marked one and `beat`
    took it back, so a heartbeat refused on its way marked use): of instances holding
    nothing, a full table reaps one that only beat, never one that asked or reported reads."""
    service.housekeeper.heartbeat_timeout = 1.5  # clients beat every 0.5 s
    table = service.registry.instances
    table.max_instances = 5
    assert "active_before" not in Instance.__dataclass_fields__
    for name in ("beater", "refused", "reader", "asker", "W"):
        ok(service, MsgType.HANDSHAKE, {"iid": name})
    keys = page_keys(service, "W", [1])
    since = table["beater"].active_at
    for _ in range(3):
        clock(0.3)
        ok(service, MsgType.HEARTBEAT, {"iid": "beater"})
        ok(service, MsgType.HEARTBEAT, {"iid": "beater", "local_reads": [0, 0, 0, 0]})
        # a heartbeat refused (bad counts): a sign of life all the same, but no use
        reply = call(service, MsgType.HEARTBEAT, {"iid": "refused", "local_reads": [1, 2, 0, 0]})
        assert reply["code"] == ErrorCode.BAD_REQUEST
    assert table["beater"].active_at == since < table["beater"].last_seen
    assert table["refused"].active_at == since < table["refused"].last_seen
    ok(service, MsgType.HEARTBEAT, {"iid": "reader", "local_reads": [2, 1, 0, 0]})  # reads
    ok(service, MsgType.EXISTS, {"iid": "asker", "keys": keys})  # a request
    ok(service, MsgType.HANDSHAKE, {"iid": "new1"})
    ok(service, MsgType.HANDSHAKE, {"iid": "new2"})
    assert sorted(table) == ["W", "asker", "new1", "new2", "reader"]
    assert refused(service, MsgType.HANDSHAKE, {"iid": "new3"})
    # The table's own verbs: a heartbeat's touch marks life only
    at = table["asker"].active_at
    clock(1.0)
    table.touch("asker", heartbeat=True)
    assert table["asker"].active_at == at < table["asker"].last_seen
    table.touch("asker")
    assert table["asker"].active_at == table["asker"].last_seen > at


# -- end to end: a real server --------------------------------------------------------------


def test_a_real_server_reports_held_bytes_until_released_disconnected_or_reaped(
    maru_server_factory,
):
    """Over TCP, as a client that pins and leases sees it: STATS, the metrics endpoint and
    `maru stats` show the bytes while held, and 0 once released, disconnected or reaped."""
    prometheus_parser = pytest.importorskip("prometheus_client.parser")
    server = maru_server_factory(
        pool_size="256M",
        extra_args=[
            "--metrics-port",
            "0",
            "--quota-lease-bytes",
            "8M",
            "--quota-pin-bytes",
            "4M",
            "--heartbeat-timeout",
            "1",
        ],
    )
    sizes = [10_000, 20_000, 30_000, 40_000]
    keys = [f"held-{i}" for i in range(len(sizes))]
    with (
        MaruHandler(
            server_url=server.url,
            instance_id="held-writer",
            pool_size="16M",
            expand_size="16M",
            chunk_size_bytes="64K",
        ) as writer,
        MaruAdmin(server.url) as admin,
    ):
        assert all(writer.batch_store(keys, [b"v" * n for n in sizes]))
        metrics_url = admin.stats()["metrics_url"]

        def scrape() -> dict[tuple[str, tuple], float]:
            with urllib.request.urlopen(metrics_url, timeout=10) as resp:
                text = resp.read().decode()
            return parse_metrics(text, prometheus_parser.text_string_to_metric_families)

        def maru_stats() -> str:
            out = io.StringIO()
            assert main(["stats", "--server", server.url], out=out) == 0
            return out.getvalue()

        def holder(name: str) -> tuple[RpcClient, str, str]:
            rpc = RpcClient(server.url, timeout_ms=10_000)
            reply = rpc.request(MsgType.HANDSHAKE, {"name": name, "pid": 0}).result()
            session = reply["session"]
            pin = {"session": session, "keys": keys[:2]}
            assert rpc.request(MsgType.PIN, pin).result()["results"] == [True, True]
            lookup = {"session": session, "keys": keys[1:], "lease": True}
            assert rpc.request(MsgType.LOOKUP_KV, lookup).result()["lease_id"]
            return rpc, session, reply["iid"]

        def check_held(iid: str) -> None:
            stats = admin.stats()
            leased, pinned = 90_000, 30_000
            assert held(stats)[:2] == (leased, pinned)
            assert stats["instances"][iid]["leased_bytes"] == leased
            assert stats["instances"][iid]["pinned_bytes"] == pinned
            assert (stats["quota_lease_bytes"], stats["quota_pin_bytes"]) == (8 * MiB, 4 * MiB)
            m = scrape()
            assert (m[("maru_leased_bytes", ())], m[("maru_pinned_bytes", ())]) == (
                leased,
                pinned,
            )
            assert m[("maru_quota_lease_bytes", ())] == 8 * MiB
            assert m[("maru_quota_pin_bytes", ())] == 4 * MiB
            by = (("instance", iid),)
            assert m[("maru_instance_leased_bytes", by)] == leased
            assert m[("maru_instance_pinned_bytes", by)] == pinned
            text = maru_stats()
            assert holds_line(text) == (
                "holds:     87.9 KiB under leases (at most 8.0 MiB an instance), 29.3 KiB "
                "pinned (at most 4.0 MiB an instance)"
            )
            row = instance_table(text)[iid]
            assert (row["LEASED"], row["PINNED"]) == ("87.9 KiB", "29.3 KiB")

        def check_none() -> None:
            assert held(admin.stats())[:2] == (0, 0)
            m = scrape()
            assert m[("maru_leased_bytes", ())] == 0 == m[("maru_pinned_bytes", ())]
            assert holds_line(maru_stats()).startswith("holds:     0 B under leases")

        # released (RELEASE, UNPIN)
        rpc, session, iid = holder("releases")
        check_held(iid)
        lookup = {"session": session, "keys": keys[:1], "lease": True}
        lease_id = rpc.request(MsgType.LOOKUP_KV, lookup).result()["lease_id"]
        assert held(admin.stats())[:2] == (100_000, 30_000)
        body = {"session": session, "leases": [lease_id]}
        assert rpc.request(MsgType.RELEASE, body).result()["released"] == 1
        check_held(iid)
        unpin = {"session": session, "keys": keys[:2]}
        assert rpc.request(MsgType.UNPIN, unpin).result()["results"] == [True, True]
        assert held(admin.stats())[:2] == (90_000, 0)
        rpc.request(MsgType.DISCONNECT, {"session": session}).result()  # (its lease goes)
        check_none()
        rpc.close()

        # disconnected
        rpc, session, iid = holder("disconnects")
        check_held(iid)
        reply = rpc.request(MsgType.DISCONNECT, {"session": session}).result()
        assert (reply["pins"], reply["leases"]) == (2, 1)
        check_none()
        rpc.close()

        # reaped: silent past --heartbeat-timeout (the writer beats on)
        rpc, session, iid = holder("goes-silent")
        check_held(iid)
        deadline = time.monotonic() + 60
        while iid in admin.stats()["instances"]:
            assert time.monotonic() < deadline, "never reaped"
            time.sleep(0.1)
        check_none()
        assert "held-writer" in {i.split(".")[0] for i in admin.stats()["instances"]}
        rpc.close()
