"""The server's statistics: the dict STATS returns, and its Prometheus export (`--metrics-port`),
both built on demand from the registry's own bookkeeping, so nothing is counted twice. The HTTP
thread reads while the RPC thread mutates the registry: the statistics are built from copies
(`list(...)` of a dict is atomic under the GIL; regions looked up with `.get`), and a read is
retried when a dict changed size under it (`read_stats`). `prometheus_client` is imported only
where used: it may be missing (`--no-deps`), and a server without `--metrics-port` runs anyway.
"""

from __future__ import annotations

import logging
import os
import time
from bisect import bisect_left
from collections import Counter
from collections.abc import Callable, Iterator
from itertools import accumulate
from typing import TYPE_CHECKING, Any, Protocol

from maru.common.protocol import MsgType

if TYPE_CHECKING:  # (none of them imports this module)
    from maru.server.eviction import Eviction
    from maru.server.holds import LeaseTable, Pins
    from maru.server.instances import InstanceTable
    from maru.server.keyindex import KeyIndex
    from maru.server.localindex import LocalIndex
    from maru.server.pool import Pool
    from maru.server.regions import RegionTable

log = logging.getLogger(__name__)

# Upper bounds (seconds) of the per-operation latency histogram buckets; one more bucket counts
# everything slower. Fixed, so recording a request is one bisect and three increments.
LATENCY_BUCKETS = (
    10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6,
    1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3, 500e-3, 1.0,
)  # fmt: skip


class RequestStats:
    """Per message type served: count, total seconds, errors and non-cumulative LATENCY_BUCKETS
    counts; plus requests that were no message we serve (`invalid`). The loop thread records,
    the metrics thread reads: every `ops` entry exists from the start, so it never changes size."""

    def __init__(self, msg_types: list[int]):
        # per type: [count, total seconds, bucket counts, errors]
        self.ops: dict[int, list[Any]] = {
            int(t): [0, 0.0, [0] * (len(LATENCY_BUCKETS) + 1), 0] for t in msg_types
        }
        self.names = {int(t): MsgType(t).name.lower() for t in msg_types}
        self.invalid = 0  # undecodable frames and unknown message types
        # per host (`MaruService.host_of`), requests of each type, served or not: a new host's
        # entry is whole when it goes in (the reader copies the outer dict in one C call)
        self.by_host: dict[str, dict[int, int]] = {}

    def count_host(self, host: str, msg_type: int) -> None:
        """One request of `msg_type` (0: not a message we serve) from `host`."""
        counts = self.by_host.get(host)
        if counts is None:
            counts = dict.fromkeys([0, *self.ops], 0)
            self.by_host[host] = counts
        counts[msg_type if msg_type in counts else 0] += 1

    def served(self, msg_type: int, seconds: float) -> None:
        op = self.ops[msg_type]
        op[0] += 1
        op[1] += seconds
        op[2][bisect_left(LATENCY_BUCKETS, seconds)] += 1

    def failed(self, msg_type: int | None) -> None:
        """An error reply to a request of `msg_type`, or (None) to a request that was none."""
        if msg_type is None:
            self.invalid += 1
        else:
            self.ops[msg_type][3] += 1

    def report(self) -> dict[str, Any]:
        """The STATS fields `latency_buckets`, `operations` and `invalid_requests`."""
        operations = {
            self.names[t]: {
                "count": count,
                "total_seconds": seconds,
                "errors": errors,
                "buckets": list(buckets),
            }
            for t, (count, seconds, buckets, errors) in list(self.ops.items())
            if count or errors
        }
        hosts = {
            host: {self.names.get(t, "invalid"): n for t, n in list(counts.items()) if n}
            for host, counts in list(self.by_host.items())
        }
        return {
            "latency_buckets": list(LATENCY_BUCKETS),
            "operations": operations,
            "invalid_requests": self.invalid,
            "host_requests": hosts,
        }


# registry counter -> (metric name without _total, help)
COUNTERS: dict[str, tuple[str, str]] = {
    "lookups": ("maru_lookup_keys", "Keys looked up (LOOKUP_KV)."),
    "hits": ("maru_lookup_hits", "Looked-up keys that were found."),
    "misses": ("maru_lookup_misses", "Looked-up keys that were not found."),
    "exists": ("maru_exists_keys", "Keys checked with EXISTS (SGLang asks before prefetching)."),
    "exists_hits": ("maru_exists_hits", "Keys checked with EXISTS that were found."),
    "exists_misses": ("maru_exists_misses", "Keys checked with EXISTS that were not found."),
    "keys_registered": ("maru_keys_registered", "Keys registered (stored)."),
    "bytes_registered": ("maru_registered_bytes", "Bytes of the keys registered."),
    "keys_duplicate": (
        "maru_keys_duplicate",
        "Registrations refused because the key existed (first writer wins).",
    ),
    "keys_over_region": (
        "maru_keys_over_region",
        "Registrations refused because their region's keys would hold more bytes than it has, "
        "or outnumber its pages (keys registered over the same bytes).",
    ),
    "keys_deleted": ("maru_keys_deleted", "Keys deleted (DELETE_KV, DELETE_PREFIX, clear)."),
    "corrupt_dropped": (
        "maru_corrupt_dropped",
        "Entries dropped because a reader found their bytes unlike their writer's checksum "
        "(CORRUPT_KV): a writer may store the key again.",
    ),
    "evictions": ("maru_evicted_keys", "Keys evicted (watermark, room for a writer, orphans)."),
    "bytes_evicted": ("maru_evicted_bytes", "Bytes of the keys evicted."),
    "eviction_rounds": ("maru_eviction_rounds", "Eviction rounds that evicted at least one key."),
    "leases_expired": ("maru_leases_expired", "Read leases that expired instead of released."),
    "journal_fsyncs": ("maru_journal_fsyncs", "Successful fsyncs of the registry journal."),
    "journal_fsync_errors": (
        "maru_journal_fsync_errors",
        "Failed fsyncs of the registry journal (each answered by a fresh snapshot).",
    ),
    "journal_write_errors": (
        "maru_journal_write_errors",
        "Failed journal writes (state dir full, I/O error): each refused its request, and "
        "changes are refused until a snapshot succeeds.",
    ),
    "journal_snapshot_errors": (
        "maru_journal_snapshot_errors",
        "Snapshot writes in the background that failed (state dir full, I/O error): the last "
        "snapshot and the journals after it stay, and a restart replays them all.",
    ),
    "replies_dropped": (
        "maru_replies_dropped",
        "ZMQ replies dropped: the client had gone, or left more than 16 replies unread.",
    ),
    "releases_refused": (
        "maru_releases_refused",
        "RELEASE requests for a lease another instance holds (ignored).",
    ),
    "instances_reaped": (
        "maru_instances_reaped",
        "Instances disconnected after the heartbeat timeout.",
    ),
    "regions_allocated": ("maru_regions_allocated", "Regions carved out of the pool."),
    "regions_freed": ("maru_regions_freed", "Regions given back to the pool."),
    "regions_reclaimed": (
        "maru_regions_reclaimed",
        "Parked regions taken back from idle instances for another's region request.",
    ),
    "shed_requests": (
        "maru_shed_requests",
        "Requests to an instance over its fair share of the pool to give regions back, for "
        "an instance below its share that found no room.",
    ),
}

# per-instance gauge field -> (metric name, help)
INSTANCE_GAUGES: dict[str, tuple[str, str]] = {
    "regions": ("maru_instance_regions", "Regions the instance owns."),
    "region_bytes": ("maru_instance_region_bytes", "Bytes of the regions the instance owns."),
    "parked_regions": (
        "maru_instance_parked_regions",
        "Regions the instance parked (idle): the server may take them back for another.",
    ),
    "keys": ("maru_instance_keys", "Keys stored in the instance's regions."),
    "bytes_stored": ("maru_instance_stored_bytes", "Bytes of the keys in the instance's regions."),
    "pages": ("maru_instance_pages", "Pages used by stored keys in the instance's regions."),
    "pages_total": (
        "maru_instance_pages_capacity",
        "Pages in the instance's regions (0 when its page size is unknown).",
    ),
    "pins": ("maru_instance_pins", "Pins the instance holds."),
    "leases": ("maru_instance_leases", "Read leases the instance holds."),
    "pinned_bytes": (
        "maru_instance_pinned_bytes",
        "Bytes of the keys the instance pins, each key once (bounded by --quota-pin-bytes).",
    ),
    "leased_bytes": (
        "maru_instance_leased_bytes",
        "Bytes of the keys its read leases hold (bounded by --quota-lease-bytes).",
    ),
    "idle_seconds": (
        "maru_instance_idle_seconds",
        "Seconds since the instance's last message (reaped after the heartbeat timeout).",
    ),
    "local_connections": (
        "maru_instance_local_connections",
        "The instance's connections to the Unix socket now (one per client thread that sends).",
    ),
    "dropped": (
        "maru_instance_dropped",
        "1 once the instance's TCP connection closed and it has not spoken since (gone; "
        "reaped after the heartbeat timeout unless it reconnects).",
    ),
}

# per-instance counter field -> (metric name without _total, help)
INSTANCE_COUNTERS: dict[str, tuple[str, str]] = {
    "hits": ("maru_instance_lookup_hits", "Keys the instance looked up and found."),
    "misses": ("maru_instance_lookup_misses", "Keys the instance looked up and did not find."),
    "exists_hits": ("maru_instance_exists_hits", "Keys the instance checked and found."),
    "exists_misses": ("maru_instance_exists_misses", "Keys the instance checked, not found."),
    "evicted": ("maru_instance_evicted_keys", "Keys evicted out of the instance's regions."),
    "keys_registered": ("maru_instance_keys_registered", "Keys the instance registered."),
    "bytes_registered": (
        "maru_instance_registered_bytes",
        "Bytes of the keys the instance registered.",
    ),
}


# pool field -> (gauge name, help), labelled with the pool
POOL_GAUGES: dict[str, tuple[str, str]] = {
    "capacity": ("maru_pool_capacity_bytes", "Pool capacity."),
    "used": ("maru_pool_used_bytes", "Pool bytes carved into regions."),
    "free": ("maru_pool_free_bytes", "Pool bytes not in any region."),
    "fragmentation": (
        "maru_pool_fragmentation_ratio",
        "1 - largest free extent / free bytes (0: all free space is contiguous).",
    ),
}


# The cluster tier's part of STATS (`maru.server.cluster.tier.ClusterTier.stats`): field ->
# (metric, help, counter or not). Exported only by a server with `--cluster`.
CLUSTER_METRICS = {
    "connected": ("maru_cluster_connected", "1 while the tier's Mooncake client is up.", False),
    "queue_depth": ("maru_cluster_publish_queue", "Keys waiting to be published.", False),
    "pulling": ("maru_cluster_pulling", "Keys being probed or pulled now.", False),
    "published": ("maru_cluster_published", "Values published to the cluster.", True),
    "published_bytes": ("maru_cluster_published_bytes", "Bytes of those values.", True),
    "publish_drops": (
        "maru_cluster_publish_drops",
        "Keys not published that the mode publishes: write-through, the queue was full; "
        "spill, evicted while the tier could not take them or for a write waiting for room.",
        True,
    ),
    "publish_failures": ("maru_cluster_publish_failures", "Publishes Mooncake failed.", True),
    "publish_refused": (
        "maru_cluster_publish_refused",
        "Values not published: their pages did not match their writer's checksum.",
        True,
    ),
    "pulled": ("maru_cluster_pulled", "Values pulled, proven and registered (pull hits).", True),
    "pulled_bytes": ("maru_cluster_pulled_bytes", "Bytes of those values.", True),
    "pull_misses": ("maru_cluster_pull_misses", "Keys missed here that the cluster lacked.", True),
    "pull_failures": ("maru_cluster_pull_failures", "Pulls that failed (Mooncake, room).", True),
    "proof_failures": (
        "maru_cluster_proof_failures",
        "Pulled values dropped: their bytes did not match their proof.",
        True,
    ),
    "sidecar_starts": ("maru_cluster_sidecar_starts", "Starts of the tier's sidecar.", True),
    "removed": (
        "maru_cluster_removed",
        "Objects the cluster removed for clears (DELETE_PREFIX with cluster).",
        True,
    ),
    "remove_failures": (
        "maru_cluster_remove_failures",
        "Clears' removals that failed (Mooncake, or the sidecar gone before it answered).",
        True,
    ),
    "removing": ("maru_cluster_removing", "Clears' removals sent and not answered yet.", False),
    "exists_kept": (
        "maru_cluster_exists_kept",
        "Lookups (EXISTS) answered when the pulls they waited for landed.",
        True,
    ),
    "exists_kept_late": (
        "maru_cluster_exists_kept_late",
        "Of those, answered at the end of their wait with pulls still on their way.",
        True,
    ),
}


def _cluster_metrics(s: dict[str, Any]) -> Iterator[Any]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    tier = s.get("cluster")
    if not tier:
        return
    for field, (metric, doc, counter) in CLUSTER_METRICS.items():
        family = CounterMetricFamily if counter else GaugeMetricFamily
        yield family(metric, doc, value=float(tier.get(field) or 0))


def _host_metrics(s: dict[str, Any]) -> Iterator[Any]:
    """Per host of a pod (`host` of each instance; "local": the server's Unix socket):
    instances connected, and requests by operation."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    instances = GaugeMetricFamily(
        "maru_host_instances",
        "Instances connected now, by the host they came from.",
        labels=["host"],
    )
    hosts = Counter(inst.get("host", "") for inst in s["instances"].values())
    for host, n in sorted(hosts.items()):
        instances.add_metric([host], float(n))
    yield instances
    requests = CounterMetricFamily(
        "maru_host_requests", "Requests received, by host and operation.", labels=["host", "op"]
    )
    for host, ops in sorted(s.get("host_requests", {}).items()):
        for op, n in sorted(ops.items()):
            requests.add_metric([host, op], float(n))
    yield requests


def _server_gauges(s: dict[str, Any]) -> list[tuple[str, str, float]]:
    """(gauge name, help, value) of the server-wide gauges, from the STATS dict `s`."""
    orphaned = s.get("orphaned", {})
    return [
        ("maru_server_start_time_seconds", "Unix time the server started.", s["started_at"]),
        ("maru_keys", "Keys registered now.", s["keys"]),
        ("maru_stored_bytes", "Bytes of the keys registered now.", s["live_bytes"]),
        ("maru_regions", "Regions allocated now.", s["regions"]),
        ("maru_instances", "Instances connected now.", len(s["instances"])),
        ("maru_leases", "Read leases held now.", s["leases"]),
        (
            "maru_leased_bytes",
            "Bytes of the keys under read leases now, the instances' together (a key two "
            "instances lease counts twice).",
            s.get("leased_bytes", 0),
        ),
        (
            "maru_pinned_bytes",
            "Bytes of the keys pinned now, the instances' together (each key once per "
            "instance pinning it).",
            s.get("pinned_bytes", 0),
        ),
        (
            "maru_quota_lease_bytes",
            "Most bytes of keys one instance may hold under leases (--quota-lease-bytes; 0: "
            "no quota).",
            s.get("quota_lease_bytes", 0),
        ),
        (
            "maru_quota_pin_bytes",
            "Most bytes of keys one instance may pin (--quota-pin-bytes; 0: no quota).",
            s.get("quota_pin_bytes", 0),
        ),
        (
            "maru_journal_writable",
            "1 while the registry journal can be written; 0 while changes are refused "
            "(the state dir is full or failing; reads go on).",
            1 if s.get("journal_writable", True) else 0,
        ),
        (
            "maru_local_connections",
            "Client connections on the Unix socket now (the rest use TCP).",
            s.get("local_connections", 0),
        ),
        (
            "maru_orphaned_regions",
            "Returned regions kept alive by their keys.",
            orphaned.get("regions", 0),
        ),
        ("maru_orphaned_region_bytes", "Bytes of those regions.", orphaned.get("region_bytes", 0)),
        ("maru_orphaned_keys", "Keys in those regions.", orphaned.get("keys", 0)),
        (
            "maru_held_regions",
            "Of them, regions kept from reuse (--reap-hold).",
            orphaned.get("held", 0),
        ),
    ]


class StatsSource(Protocol):
    """What the statistics read of the registry (which is one), and nothing else."""

    pool: Pool
    local_index: LocalIndex | None
    keys: KeyIndex
    live_bytes: int
    regions: RegionTable
    leases: LeaseTable
    pins: Pins
    quota_lease_bytes: int
    eviction: Eviction
    instances: InstanceTable
    counters: dict[str, int]


def registry_stats(registry: StatsSource) -> dict[str, Any]:
    """Pool, registry, per-instance and counter statistics."""
    now = time.monotonic()
    regions = registry.regions
    instances = {}
    for i in list(registry.instances.values()):
        owned = [r for r in map(regions.get, list(i.regions)) if r is not None]
        instances[i.instance_id] = {
            "pid": i.pid,
            "regions": len(owned),
            "region_bytes": sum(r.length for r in owned),
            "parked_regions": sum(r.parked for r in owned),
            "keys": sum(r.live_keys for r in owned),
            "bytes_stored": sum(r.live_bytes for r in owned),
            "pages": sum(r.live_pages for r in owned),
            "pages_total": sum(r.length // r.page_size for r in owned if r.page_size),
            "page_size": i.page_size,
            **{field: getattr(i, field) for field in INSTANCE_COUNTERS},
            "pins": i.pin_count,
            "leases": len(i.leases),
            "pinned_bytes": i.pin_bytes,  # (each key once: what --quota-pin-bytes bounds)
            "leased_bytes": i.lease_bytes,  # (what --quota-lease-bytes bounds)
            "idle_seconds": round(max(0.0, now - i.last_seen), 3),
            "dropped": i.dropped,  # its TCP connection closed: gone (`maru status`)
            "host": i.host,
            "watched_pids": registry.instances.processes.pids(i.instance_id),
        }
    orphaned = [r for r in list(regions.values()) if r.returned]
    eviction = registry.eviction
    return {
        "pool": registry.pool.stats(),
        "local_index": index.stats() if (index := registry.local_index) is not None else None,
        "keys": len(registry.keys),
        "live_bytes": registry.live_bytes,
        "regions": len(regions),
        "leases": len(registry.leases),
        # The instances' holds together: running totals kept at each change (`Pins.bytes`,
        # `LeaseTable.bytes`), O(1) to read, not a second pass over the instances' figures.
        "leased_bytes": registry.leases.bytes,
        "pinned_bytes": registry.pins.bytes,
        "quota_lease_bytes": registry.quota_lease_bytes,  # per instance; 0: no quota
        "quota_pin_bytes": registry.pins.max_bytes,
        "watermarks": {"high": eviction.high_watermark, "low": eviction.low_watermark},
        "instances": instances,
        "orphaned": {  # returned regions (owner gone) kept alive by keys still in them
            "regions": len(orphaned),
            "region_bytes": sum(r.length for r in orphaned),
            "keys": sum(r.live_keys for r in orphaned),
            "bytes_stored": sum(r.live_bytes for r in orphaned),
            "held": len(regions.held),  # of them, kept from reuse after a reap for silence
        },
        "counters": dict(registry.counters),
        "server_pid": os.getpid(),
    }


def read_stats(source: Callable[[], dict[str, Any]], retries: int = 20) -> dict:
    """Call `source` (e.g. `MaruService.stats`) from a thread other than the RPC loop's,
    retrying while the registry changes under it."""
    for attempt in range(1, retries):
        try:
            return source()
        except RuntimeError:  # "dictionary changed size during iteration"
            time.sleep(0.001 * attempt)
    return source()


class MaruCollector:
    """A prometheus_client collector over `stats_source()` (the STATS dict)."""

    def __init__(self, stats_source: Callable[[], dict[str, Any]]):
        self.stats_source = stats_source

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        s = read_stats(self.stats_source)
        pool = s["pool"]
        name = f"{pool['kind']}:{pool['path']}"
        info = GaugeMetricFamily(
            "maru_server_info",
            "Constant 1, labelled with the server's version, epoch (changes on every start) and "
            "pool.",
            labels=["version", "epoch", "pool", "kind"],
        )
        info.add_metric([str(s["version"]), str(s["epoch"]), name, str(pool["kind"])], 1)
        yield info
        for field, (metric, doc) in POOL_GAUGES.items():
            g = GaugeMetricFamily(metric, doc, labels=["pool"])
            g.add_metric([name], float(pool[field]))
            yield g
        for metric, doc, value in _server_gauges(s):
            yield GaugeMetricFamily(metric, doc, value=value)
        marks = GaugeMetricFamily(
            "maru_eviction_watermark_ratio",
            "Eviction starts above the high watermark (fraction of the pool) and stops at the "
            "low one.",
            labels=["level"],
        )
        for level in ("high", "low"):
            marks.add_metric([level], float(s["watermarks"][level]))
        yield marks

        counters = s["counters"]
        for key, value in counters.items():
            metric, doc = COUNTERS.get(key, (f"maru_{key}", f"Registry counter {key}."))
            yield CounterMetricFamily(metric, doc, value=value)

        instances = s["instances"]
        for family, fields in (
            (GaugeMetricFamily, INSTANCE_GAUGES),
            (CounterMetricFamily, INSTANCE_COUNTERS),
        ):
            for field, (metric, doc) in fields.items():
                m = family(metric, doc, labels=["instance"])
                for iid, inst in instances.items():
                    m.add_metric([iid], float(inst.get(field, 0)))
                yield m

        bounds = s["latency_buckets"]
        hist = HistogramMetricFamily(
            "maru_rpc_request_duration_seconds",
            "Server time per request (decode, handle, encode), by operation.",
            labels=["op"],
        )
        errors = CounterMetricFamily(
            "maru_rpc_errors",
            "Requests answered with an error, by operation (op=invalid: bad frame or type).",
            labels=["op"],
        )
        for op, o in sorted(s["operations"].items()):
            buckets = [(repr(float(b)), n) for b, n in zip(bounds, accumulate(o["buckets"]))]
            hist.add_metric([op], [*buckets, ("+Inf", o["count"])], float(o["total_seconds"]))
            errors.add_metric([op], o["errors"])
        errors.add_metric(["invalid"], s.get("invalid_requests", 0))
        yield hist
        yield errors
        yield from _host_metrics(s)
        yield from _cluster_metrics(s)


def start_metrics_server(
    stats_source: Callable[[], dict[str, Any]], host: str, port: int
) -> tuple[Any, str]:
    """Serve /metrics on `host:port` (0: a free port) from a daemon thread. Returns the
    server (call `.shutdown()`) and the URL it serves. Raises OSError."""
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.process_collector import ProcessCollector

    registry = CollectorRegistry(auto_describe=False)
    registry.register(MaruCollector(stats_source))
    ProcessCollector(registry=registry)
    httpd, _thread = start_http_server(port, addr=host, registry=registry)
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{httpd.server_address[1]}/metrics"
    log.info("Prometheus metrics on %s", url)
    return httpd, url
