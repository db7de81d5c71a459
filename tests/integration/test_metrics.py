"""`maru-server --metrics-port`: the endpoint scraped over HTTP and parsed with the Prometheus
text parser; `--log-format json` lines parsed. Real server processes throughout."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from datetime import datetime
from urllib.parse import urlparse

import pytest

from maru import MaruAdmin, MaruHandler, __version__
from maru.client.rpc import RpcClient
from maru.common.errors import MaruServerError
from maru.common.protocol import MsgType

prometheus_parser = pytest.importorskip("prometheus_client.parser")

GiB = 1 << 30
INSTANCE = "metrics-writer"


def scrape(url: str) -> dict[str, object]:
    """Families by name (counters without their _total suffix, as the parser reports them)."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    return {f.name: f for f in prometheus_parser.text_string_to_metric_families(text)}


def value(families, name: str, sample: str | None = None, **labels: str) -> float:
    family = families[name]
    sample = sample or (f"{name}_total" if family.type == "counter" else name)
    matches = [
        s.value
        for s in family.samples
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    assert len(matches) == 1, (sample, labels, family.samples)
    return matches[0]


@pytest.fixture
def server(maru_server_factory):
    return maru_server_factory(pool_size="1G", extra_args=["--metrics-port", "0"])


@pytest.fixture
def metrics_url(server) -> str:
    with MaruAdmin(server.url) as admin:
        url = admin.stats()["metrics_url"]
    assert url and urlparse(url).hostname == "127.0.0.1"  # bound to --host
    return url


def test_metrics_endpoint_exports_pool_keys_instances_and_histograms(server, metrics_url):
    with MaruHandler(
        server_url=server.url,
        instance_id=INSTANCE,
        pool_size="16M",
        expand_size="16M",  # its first region: the whole cap
        chunk_size_bytes="64K",
    ) as h:
        assert all(h.batch_store([f"k{i}" for i in range(5)], [b"x" * 70000] * 5))
        assert [x is not None for x in h.batch_retrieve(["k0", "k1", "zz"])] == [1, 1, 0]
        assert h.batch_exists(["k4", "zz", "yy", "k3"]) == [True, False, False, True]
        h._beat()  # (the heartbeat reports the checks its local index answered)
        with pytest.raises(MaruServerError):
            RpcClient(server.url).request(99, {}).result()  # unknown type: an invalid request

        fam = scrape(metrics_url)
        pool = f"shm:{server.pool_path}"
        assert value(fam, "maru_pool_capacity_bytes", pool=pool) == GiB
        assert value(fam, "maru_pool_used_bytes", pool=pool) == 16 << 20
        assert value(fam, "maru_pool_free_bytes", pool=pool) == GiB - (16 << 20)
        assert value(fam, "maru_pool_fragmentation_ratio", pool=pool) == 0
        assert value(fam, "maru_keys") == 5
        assert value(fam, "maru_stored_bytes") == 5 * 70000
        assert value(fam, "maru_regions") == 1 and value(fam, "maru_instances") == 1
        assert value(fam, "maru_local_connections") >= 1  # the handler talks over the socket
        assert value(fam, "maru_journal_fsync_errors") == 0
        assert value(fam, "maru_journal_fsyncs") >= 0  # exported (the thread may not have run)
        assert value(fam, "maru_eviction_watermark_ratio", level="high") == 0.95
        assert value(fam, "maru_lookup_keys") == 3
        assert value(fam, "maru_lookup_hits") == 2
        assert value(fam, "maru_lookup_misses") == 1
        assert value(fam, "maru_exists_keys") == 4
        assert value(fam, "maru_exists_hits") == 2 and value(fam, "maru_exists_misses") == 2
        assert value(fam, "maru_keys_registered") == 5
        assert value(fam, "maru_registered_bytes") == 350000
        assert value(fam, "maru_regions_allocated") == 1
        (info,) = fam["maru_server_info"].samples
        assert info.value == 1 and info.labels["version"] == __version__
        assert info.labels["pool"] == pool and info.labels["kind"] == "shm"

        # per instance
        assert value(fam, "maru_instance_keys", instance=h.instance_id) == 5
        assert value(fam, "maru_instance_stored_bytes", instance=h.instance_id) == 350000
        assert value(fam, "maru_instance_pages", instance=h.instance_id) == 5 * 2
        assert value(fam, "maru_instance_pages_capacity", instance=h.instance_id) == 256
        assert value(fam, "maru_instance_regions", instance=h.instance_id) == 1
        assert value(fam, "maru_instance_region_bytes", instance=h.instance_id) == 16 << 20
        assert value(fam, "maru_instance_parked_regions", instance=h.instance_id) == 0
        assert value(fam, "maru_instance_lookup_hits", instance=h.instance_id) == 2
        assert value(fam, "maru_instance_lookup_misses", instance=h.instance_id) == 1
        assert value(fam, "maru_instance_exists_hits", instance=h.instance_id) == 2
        assert value(fam, "maru_instance_evicted_keys", instance=h.instance_id) == 0

        # per operation: a histogram with cumulative buckets ending in +Inf == count
        hist = fam["maru_rpc_request_duration_seconds"]
        assert hist.type == "histogram"
        name = "maru_rpc_request_duration_seconds"
        assert value(fam, name, f"{name}_count", op="lookup_kv") == 1
        assert value(fam, name, f"{name}_count", op="register_kv") == 1
        assert value(fam, name, f"{name}_sum", op="lookup_kv") > 0
        buckets = [
            (float(s.labels["le"]), s.value)
            for s in hist.samples
            if s.name == f"{name}_bucket" and s.labels["op"] == "lookup_kv"
        ]
        assert [b for b, _ in buckets] == sorted(b for b, _ in buckets)
        assert buckets[0][0] == pytest.approx(1e-5) and buckets[-1][0] == float("inf")
        counts = [c for _, c in buckets]
        assert counts == sorted(counts) and counts[-1] == 1
        assert value(fam, "maru_rpc_errors", op="invalid") == 1
        assert value(fam, "maru_rpc_errors", op="lookup_kv") == 0

        # counters move by exactly what happened between two scrapes
        h.batch_retrieve(["k2", "k3"])
        again = scrape(metrics_url)
        assert value(again, "maru_lookup_keys") == 5
        assert value(again, name, f"{name}_count", op="lookup_kv") == 2


def test_metric_names_follow_prometheus_conventions(server, metrics_url):
    with MaruHandler(server_url=server.url, instance_id=INSTANCE, pool_size="4M") as h:
        h.store("k", b"v")
        h.retrieve("k")
        fam = scrape(metrics_url)
    maru = {n: f for n, f in fam.items() if n.startswith("maru_")}
    assert len(maru) >= 40
    assert set(fam) - set(maru) <= {n for n in fam if n.startswith("process_")}
    assert any(n.startswith("process_") for n in fam)  # process_cpu_seconds_total etc.
    for name, f in maru.items():
        assert f.type in {"counter", "gauge", "histogram"}, name
        assert f.documentation, name
        assert name == name.lower() and " " not in name
        samples = {s.name for s in f.samples}
        if f.type == "counter":
            assert samples <= {f"{name}_total"}, name
        if f.type == "gauge":
            assert not name.endswith("_total"), name
        if f.type == "histogram":
            assert name.endswith("_seconds"), name
        if "bytes" in name:
            assert name.endswith("_bytes"), name  # unit suffix (counters add _total after)
        if "seconds" in name and f.type != "histogram":
            assert name.endswith("_seconds"), name


def test_scrapes_stay_consistent_while_the_registry_changes(server, metrics_url):
    """The collector reads the registry from the HTTP thread while the RPC thread mutates it:
    instances come and go and keys are stored and deleted during the scrapes."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def churn(n: int) -> None:
        try:
            for round_ in range(200):
                if stop.is_set():
                    return
                with MaruHandler(
                    server_url=server.url, instance_id=f"churn-{n}-{round_}", pool_size="2M"
                ) as h:
                    keys = [f"c{n}:{round_}:{i}" for i in range(20)]
                    h.batch_store(keys, [b"z" * 100] * len(keys))
                    h.batch_retrieve(keys)
                    h.batch_delete(keys[::2])
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=churn, args=(n,), daemon=True) for n in range(2)]
    for t in threads:
        t.start()
    try:
        for _ in range(25):
            fam = scrape(metrics_url)
            keys = value(fam, "maru_keys")
            stored = value(fam, "maru_stored_bytes")
            assert stored == keys * 100
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not errors, errors


def test_metrics_port_in_use_fails_clearly(maru_server_factory):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(RuntimeError, match=r"cannot serve metrics on 127\.0\.0\.1:\d+: "):
            maru_server_factory(pool_size="64M", extra_args=["--metrics-port", str(port)])


def test_metrics_port_without_prometheus_client_fails_clearly(tmp_path):
    code = (
        "import sys; sys.modules['prometheus_client'] = None\n"
        "from maru.server.cli import main\n"
        f"sys.exit(main(['--port', '0', '--pool', {str(tmp_path / 'pool')!r}, "
        f"'--state-dir', {str(tmp_path / 'state')!r}, '--metrics-port', '0']))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "--metrics-port needs the prometheus_client package" in proc.stderr
    assert "pip install prometheus-client" in proc.stderr
    assert not (tmp_path / "pool").exists()  # refused before touching anything


def test_json_logs_one_object_per_event_with_instance_ids(maru_server_factory):
    server = maru_server_factory(
        pool_size="64M",
        extra_args=[
            "--log-format",
            "json",
            "--log-level",
            "info",
            "--eviction-high-watermark",
            "0.1",
            "--eviction-low-watermark",
            "0.05",
            "--heartbeat-timeout",
            "1",
        ],
    )
    with MaruHandler(
        server_url=server.url,
        instance_id="json-logger",
        pool_size="16M",
        expand_size="16M",
        chunk_size_bytes="1M",
    ) as h:
        # 8 MiB registered > 10% of 64 MiB: the second batch triggers an eviction round
        # (of the first batch's keys: a batch never evicts the keys it just registered)
        assert all(h.batch_store([f"j{i}" for i in range(4)], [b"q" * (1 << 20)] * 4))
        assert all(h.batch_store([f"j{i}" for i in range(4, 8)], [b"q" * (1 << 20)] * 4))
    silent = RpcClient(server.url, timeout_ms=5000)  # handshakes, then never heart-beats
    silent_iid = silent.request(MsgType.HANDSHAKE, {"name": "silent"}).result()["iid"]
    with MaruAdmin(server.url) as admin:
        admin.clear()
        assert admin.stats()["counters"]["eviction_rounds"] >= 1
        for _ in range(200):  # reaped after 1 s
            if not admin.stats()["instances"]:
                break
            time.sleep(0.05)
        assert not admin.stats()["instances"]
    server.stop()  # flushes and ends the log

    records = []
    for line in server.read_log().splitlines():
        if not line.strip():
            continue
        record = json.loads(line)  # every line is one JSON object
        assert {"ts", "level", "logger", "msg"} <= set(record), record
        assert record["ts"].endswith("Z")
        datetime.fromisoformat(record["ts"].replace("Z", "+00:00"))
        assert record["level"] in {"INFO", "WARNING", "ERROR"}  # --log-level info
        assert record["logger"].startswith("maru")
        records.append(record)

    def find(fragment: str) -> dict:
        found = [r for r in records if fragment in r["msg"]]
        assert found, (fragment, [r["msg"] for r in records])
        return found[0]

    assert find("restored 0 regions")  # recovery
    assert find("listening on")
    iid = h.instance_id  # the server's id for it: the name and a random suffix
    assert iid.startswith("json-logger.")
    assert find(f"instance {iid} connected")["instance"] == iid
    allocated = find(f"allocated to {iid}")
    assert allocated["instance"] == iid and allocated["region"] == 1
    eviction = find("eviction round (above the high watermark 0.1)")
    assert eviction["instance"] == [iid]
    assert find(f"instance {iid} disconnected by its client")["instance"] == iid
    assert "by an operator" in find("keys deleted (every key")["msg"]
    assert find(f"region 1 (16777216 bytes) of {iid} freed")["instance"] == iid
    reaped = find(f"instance {silent_iid} reaped after 1s without a heartbeat")
    assert reaped["instance"] == silent_iid
    silent.close()


def test_instances_and_requests_are_counted_per_host(server, metrics_url):
    """A pod's operator sees who asks what, per host: an instance on the Unix socket is
    "local", one over TCP is its connection's address; its requests count under it (STATS
    `host_requests`, `maru stats`' hosts line, Prometheus `maru_host_*`)."""
    from maru.client.cli import render_status

    kw = {"server_url": server.url, "pool_size": "4M", "chunk_size_bytes": "64K"}
    with (
        MaruHandler(instance_id="on-socket", **kw) as local,
        MaruHandler(instance_id="over-tcp", local_socket=False, **kw) as remote,
    ):
        assert local.store("a", b"x" * 100) and remote.store("b", b"y" * 100)
        for _ in range(3):
            assert remote.exists("a")
        stats = remote.stats()
        families = scrape(metrics_url)
    hosts = {i["host"] for i in stats["instances"].values()}
    by_name = {iid.split(".")[0]: i["host"] for iid, i in stats["instances"].items()}
    assert by_name == {"on-socket": "local", "over-tcp": "127.0.0.1"}, hosts
    tcp, unix = stats["host_requests"]["127.0.0.1"], stats["host_requests"]["local"]
    assert tcp["exists"] == 3 and "exists" not in unix  # only the TCP client asked
    assert tcp["register_kv"] == 1 and unix["register_kv"] == 1
    assert value(families, "maru_host_instances", host="local") == 1
    assert value(families, "maru_host_requests", host="127.0.0.1", op="exists") == 3
    line = render_status(server.url, stats).split("hosts:", 1)[1].splitlines()[0]
    assert "127.0.0.1 1 inst/" in line and "local 1 inst/" in line
