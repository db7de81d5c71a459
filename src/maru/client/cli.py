"""`maru`: the operator's command line for a running `maru-server` (`build_parser` lists
the commands). It talks to the server through `MaruAdmin`, which never allocates: safe on a
full pool."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from maru import __version__
from maru.client.admin import (
    CLIENT_KEY_ENV,
    DEFAULT_SERVER_URL,
    SERVER_KEY_ENV,
    SERVER_URL_ENV,
    MaruAdmin,
)
from maru.common import hugepages
from maru.common.config import ConfigError, OneLineParser, fmt_bytes, number_arg
from maru.common.curve import write_keypair
from maru.common.errors import MaruConnectError, MaruConnectionError, MaruError
from maru.common.protocol import MAX_LIST_KEYS

if TYPE_CHECKING:
    from rich.console import RenderableType

Stats = dict[str, Any]

# -- formatting ------------------------------------------------------------------------------


def fmt_duration(seconds: float) -> str:
    s = int(seconds)
    if s < 60:
        return f"{seconds:.1f}s" if seconds < 10 else f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def fmt_latency(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f}us"
    if seconds < 1:
        return f"{seconds * 1e3:.1f}ms"
    return f"{seconds:.2f}s"


def fmt_pct(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "-"


def bar(fraction: float, width: int = 30) -> str:
    filled = max(0, min(width, round(fraction * width)))
    return "[" + "#" * filled + "-" * (width - filled) + "]"


def quantile(bounds: Sequence[float], buckets: Sequence[int], q: float) -> float | None:
    """Upper bound of the histogram bucket holding the q-quantile (inf: above the last)."""
    total = sum(buckets)
    if not total:
        return None
    rank, seen = q * total, 0
    for i, n in enumerate(buckets):
        seen += n
        if seen >= rank:
            return bounds[i] if i < len(bounds) else math.inf
    return math.inf


def fmt_quantile(bounds: Sequence[float], buckets: Sequence[int], q: float) -> str:
    value = quantile(bounds, buckets, q)
    if value is None:
        return "-"
    if math.isinf(value):
        return f">{fmt_latency(bounds[-1])}"
    return f"<={fmt_latency(value)}"


def table(rows: list[list[str]], right: Collection[int] = ()) -> list[str]:
    """Left-aligned columns (right-aligned for the indexes in `right`), two spaces apart."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))
        ]
        out.append("  ".join(cells).rstrip())
    return out


@dataclass
class Rows:
    """A table's data, gathered once and drawn by either renderer: as plain text (`table`,
    for `stats`, `--once` and pipes) or as a rich `Table` (the live view)."""

    header: list[str]
    rows: list[list[str]]
    right: set[int]  # the columns aligned right
    empty: str  # said instead of a table without rows
    more: str = ""  # a line below the table (rows left out)


def plain_table(t: Rows) -> list[str]:
    if not t.rows:
        return [t.empty]
    return table([t.header, *t.rows], right=t.right) + ([t.more] if t.more else [])


def hit_rate(hits: int, misses: int) -> str:
    return fmt_pct(hits, hits + misses)


# -- status / stats --------------------------------------------------------------------------


def _local_socket_line(s: Stats) -> str:
    address = s.get("local_socket")
    if not address:
        return "off (clients use TCP only; maru-server --local-socket)"
    return f"{address}, {s.get('local_connections', 0)} connections"


def _index_line(s: Stats) -> str:
    index = s.get("local_index")
    if not index:
        return "off (clients on this node ask the server for every read)"
    return (
        f"{index['path']}, {index['keys']} keys in {index['slots']} slots, "
        f"{hugepages.describe(index['huge'])}"
    )


def reaping_in(s: Stats, instance: Stats) -> float | None:
    """Seconds until the server reaps an instance that is gone, else None (alive). Gone: its
    TCP connection closed (`dropped`, at once), or it missed two heartbeats (a live one
    sends every third of the timeout)."""
    timeout, idle = s["heartbeat_timeout"], instance["idle_seconds"]
    if idle < timeout * 2 / 3 and not instance.get("dropped"):
        return None
    return max(0.0, timeout - idle)


def _gone_summary(s: Stats) -> str:
    gone = [r for r in (reaping_in(s, i) for i in s["instances"].values()) if r is not None]
    if not gone:
        return ""
    return f" ({len(gone)} gone, reaping in {math.ceil(min(gone))} s)"


def _cluster_line(s: Stats) -> str:
    """The cluster tier (`maru-server --cluster`): connected or why not, what it moved."""
    tier = s.get("cluster")
    if not tier:
        return "off (maru-server --cluster)"
    state = "connected" if tier["connected"] else f"NOT CONNECTED ({tier.get('error')})"
    return (
        f"{tier['kind']} {tier['master']}, {state}; {tier['published']} published "
        f"({tier['queue_depth']} queued, {tier['publish_drops']} dropped), {tier['pulled']} "
        f"pulled, {tier['pull_misses']} pull misses, {tier['proof_failures']} proof failures, "
        f"{tier.get('removed', 0)} removed by clears"
        + (f" ({tier['remove_failures']} failed)" if tier.get("remove_failures") else "")
    )


def _quota(limit: int) -> str:
    """A per-instance byte quota (0: none)."""
    return f"at most {fmt_bytes(limit)} an instance" if limit else "no quota"


def _holds_line(s: Stats) -> str:
    """What the instances' read leases and pins keep from eviction now (their keys' bytes,
    the instances' together), and the quota on each instance's."""
    return (
        f"{fmt_bytes(s.get('leased_bytes', 0))} under leases "
        f"({_quota(s.get('quota_lease_bytes', 0))}), {fmt_bytes(s.get('pinned_bytes', 0))} "
        f"pinned ({_quota(s.get('quota_pin_bytes', 0))})"
    )


def render_status(url: str, s: Stats) -> str:
    pool, counters = s["pool"], s["counters"]
    cap = pool["capacity"]
    orphaned = s.get("orphaned", {})
    lines = [
        f"maru-server {url} is up: version {s.get('version', '?')}, pid {s['server_pid']}, "
        f"up {fmt_duration(s.get('uptime_seconds', 0))}, epoch {s['epoch']}",
        f"pool:      {pool['kind']}:{pool['path']}",
        f"generation: {pool.get('generation') or '-'}",
        f"pages:     {hugepages.describe(pool.get('huge'))}",
        f"capacity:  {fmt_bytes(cap)} ({cap} bytes)",
        f"regions:   {fmt_bytes(pool['used'])} in {s['regions']} regions "
        f"({fmt_pct(pool['used'], cap)} of the pool), {fmt_bytes(pool['free'])} free, "
        f"fragmentation {pool['fragmentation']:.2f}",
        f"stored:    {fmt_bytes(s['live_bytes'])} in {s['keys']} keys "
        f"({fmt_pct(s['live_bytes'], cap)} of the pool; evicts above "
        f"{s['watermarks']['high']:.0%} down to {s['watermarks']['low']:.0%})",
        f"instances: {len(s['instances'])} connected{_gone_summary(s)}, "
        f"{orphaned.get('regions', 0)} orphaned regions, {s['leases']} leases",
        f"holds:     {_holds_line(s)}",
        f"hosts:     {_hosts_line(s)}",
        f"lookups:   {counters.get('lookups', 0)} keys, hit rate "
        f"{hit_rate(counters.get('hits', 0), counters.get('misses', 0))}, "
        f"{counters.get('evictions', 0)} keys evicted",
        f"exists:    {counters.get('exists', 0)} keys, hit rate "
        f"{hit_rate(counters.get('exists_hits', 0), counters.get('exists_misses', 0))}",
        f"local:     {_local_socket_line(s)}",
        f"index:     {_index_line(s)}",
        f"metrics:   {s.get('metrics_url') or 'off (maru-server --metrics-port)'}",
        f"cluster:   {_cluster_line(s)}",
    ]
    if not s.get("journal_writable", True):
        lines.append(
            f"journal:   NOT WRITABLE ({s.get('journal_error') or 'write failed'}): stores, "
            f"deletes and pins are refused until space is freed; reads go on "
            f"({counters.get('journal_write_errors', 0)} write errors)"
        )
    return "\n".join(lines)


def _hosts_line(s: Stats) -> str:
    """Instances and requests per host ("local": the server's Unix socket; a pod's other
    hosts by their address)."""
    instances = Counter(i.get("host") or "?" for i in s["instances"].values())
    requests = {h or "?": sum(ops.values()) for h, ops in s.get("host_requests", {}).items()}
    hosts = sorted(set(instances) | set(requests))
    if not hosts:
        return "-"
    return ", ".join(f"{h} {instances[h]} inst/{requests.get(h, 0)} req" for h in hosts)


def _idle(s: Stats, instance: Stats) -> str:
    left = reaping_in(s, instance)
    idle = fmt_duration(instance.get("idle_seconds", 0))
    return idle if left is None else f"{idle} (gone, reaping in {math.ceil(left)} s)"


def instance_rows(s: Stats, limit: int | None = None) -> Rows:
    """The instances, most bytes stored first; `limit`: at most that many rows."""
    instances = sorted(s["instances"].items(), key=lambda kv: -kv[1].get("bytes_stored", 0))
    header = [
        "INSTANCE",
        "PID",
        "REGIONS",
        "KEYS",
        "STORED",
        "PAGES",
        "HIT%",
        "EXIST%",
        "EVICTED",
        "LEASED",
        "PINNED",
        "IDLE",
    ]
    rows: list[list[str]] = []
    for iid, i in instances[:limit]:
        pages = str(i.get("pages", 0))
        if i.get("pages_total"):
            pages += f"/{i['pages_total']}"
        rows.append(
            [
                iid,
                str(i["pid"]),
                str(i["regions"]),
                str(i.get("keys", 0)),
                fmt_bytes(i.get("bytes_stored", 0)),
                pages,
                hit_rate(i["hits"], i["misses"]),
                hit_rate(i.get("exists_hits", 0), i.get("exists_misses", 0)),
                str(i["evicted"]),
                fmt_bytes(i.get("leased_bytes", 0)),
                fmt_bytes(i.get("pinned_bytes", 0)),
                _idle(s, i),
            ]
        )
    more = ""
    if limit is not None and len(instances) > limit:
        more = f"... and {len(instances) - limit} more"
    return Rows(header, rows, set(range(1, len(header))), "(no instances connected)", more)


def render_instances(s: Stats, limit: int | None = None) -> list[str]:
    return plain_table(instance_rows(s, limit))


def operation_rows(s: Stats, prev: Stats | None = None, dt: float = 0.0) -> Rows:
    """Requests per operation, most first; REQ/S over the `dt` seconds since `prev`."""
    ops = s.get("operations", {})
    bounds = s.get("latency_buckets", [])
    prev_ops = prev.get("operations", {}) if prev else {}
    rate_col = prev is not None and dt > 0
    head = ["OP", "REQ/S"] if rate_col else ["OP"]
    header = [*head, "COUNT", "ERRORS", "MEAN", "P50", "P99"]
    rows: list[list[str]] = []
    for name, o in sorted(ops.items(), key=lambda kv: -kv[1]["count"]):
        cells = [name]
        if rate_col:
            before = prev_ops.get(name, {}).get("count", 0)
            cells.append(f"{max(0, o['count'] - before) / dt:.1f}")
        mean = o["total_seconds"] / o["count"] if o["count"] else None
        buckets = o.get("buckets", [])
        cells += [str(o["count"]), str(o.get("errors", 0)), fmt_latency(mean)]
        cells += [fmt_quantile(bounds, buckets, q) for q in (0.5, 0.99)]  # P50, P99
        rows.append(cells)
    return Rows(header, rows, set(range(1, len(header))), "(no requests yet)")


def render_stats(url: str, s: Stats) -> str:
    lines = [render_status(url, s), "", "INSTANCES", *render_instances(s), ""]
    lines += ["OPERATIONS (server time per request)", *plain_table(operation_rows(s)), ""]
    counters = s["counters"]
    lines.append("COUNTERS")
    lines += table([[k, str(v)] for k, v in sorted(counters.items())], right={1})
    return "\n".join(lines)


# -- monitor ---------------------------------------------------------------------------------


def _delta(cur: Stats, prev: Stats | None, name: str) -> int | None:
    if prev is None:
        return None
    return max(0, cur["counters"].get(name, 0) - prev["counters"].get(name, 0))


@dataclass
class Gauge:
    """One summary line of a `maru monitor` frame: a label, a bar when `fraction` is set
    (a share of the pool), then the text."""

    label: str
    text: str
    fraction: float | None = None


@dataclass
class MonitorFrame:
    """What one `maru monitor` frame shows, drawn by `render_frame` (plain text: `--once`,
    pipes) or `rich_frame` (the live view): one set of numbers, two ways to draw it."""

    header: str
    gauges: list[Gauge] = field(default_factory=list)
    tables: list[Rows] = field(default_factory=list)
    message: str = ""  # a server that did not answer


def render_frame(frame: MonitorFrame) -> str:
    """A frame as plain text: its parts one after another, a blank line between."""
    parts = [[frame.header]]
    if frame.gauges:
        parts.append(
            [
                f"{g.label:<8}" + ("" if g.fraction is None else f"{bar(g.fraction)} ") + g.text
                for g in frame.gauges
            ]
        )
    parts += [plain_table(t) for t in frame.tables]
    if frame.message:
        parts.append([frame.message])
    return "\n\n".join("\n".join(lines) for lines in parts)


def render_monitor(*args: Any, **kwargs: Any) -> str:
    """`monitor_frame(...)` as plain text."""
    return render_frame(monitor_frame(*args, **kwargs))


def monitor_frame(
    url: str,
    cur: Stats,
    prev: Stats | None,
    dt: float,
    interval: float,
    now: datetime,
    *,
    live: bool = True,
) -> MonitorFrame:
    """One frame of `maru monitor`: rates are over the `dt` seconds since `prev` (none when
    there is no previous sample or the server restarted in between). `live`: the header
    says how to quit (not for `--once`, which exits by itself)."""
    if prev is not None and prev.get("epoch") != cur.get("epoch"):
        prev = None  # restarted: counters started again from zero
    pool, counters = cur["pool"], cur["counters"]
    cap = pool["capacity"] or 1

    def rate(name: str, unit: str, as_bytes: bool = False) -> str:
        d = _delta(cur, prev, name)
        if d is None or dt <= 0:
            return f"- {unit}"
        return f"{fmt_bytes(d / dt)}/s" if as_bytes else f"{d / dt:.1f} {unit}"

    def ratio(hit_name: str, miss_name: str, what: str) -> str:
        hits, misses = _delta(cur, prev, hit_name), _delta(cur, prev, miss_name)
        if hits is None or misses is None or dt <= 0:
            recent = "- (first sample)"
        elif hits + misses == 0:
            recent = f"no {what} in the last {dt:.1f}s"
        else:
            recent = (
                f"{hit_rate(hits, misses)} in the last {dt:.1f}s ({hits} of {hits + misses} keys)"
            )
        all_hits, all_misses = counters.get(hit_name, 0), counters.get(miss_name, 0)
        return f"{recent}; overall {hit_rate(all_hits, all_misses)} of {all_hits + all_misses} keys"

    requests = "-"
    if prev is not None and dt > 0:
        total = sum(o["count"] for o in cur.get("operations", {}).values())
        before = sum(o["count"] for o in prev.get("operations", {}).values())
        requests = f"{max(0, total - before) / dt:.1f}/s"
    high, low = cur["watermarks"]["high"], cur["watermarks"]["low"]
    if live:
        note = f"(every {interval:g}s; Ctrl-C quits)"
    elif prev is not None:
        note = f"(rates over {dt:.1f}s)"
    else:
        note = "(one sample: no rates)"
    header = (
        f"maru monitor  {url}  up {fmt_duration(cur.get('uptime_seconds', 0))}  "
        f"pid {cur['server_pid']}  {now:%H:%M:%S}  {note}"
    )
    gauges = [
        Gauge(
            "POOL",
            f"{fmt_pct(pool['used'], cap):>6} in regions: {fmt_bytes(pool['used'])} of "
            f"{fmt_bytes(pool['capacity'])}, {fmt_bytes(pool['free'])} free, "
            f"frag {pool['fragmentation']:.2f}",
            pool["used"] / cap,
        ),
        Gauge(
            "STORED",
            f"{fmt_pct(cur['live_bytes'], cap):>6} of pool: {fmt_bytes(cur['live_bytes'])} in "
            f"{cur['keys']} keys (evict above {high:.0%} down to {low:.0%})",
            cur["live_bytes"] / cap,
        ),
        Gauge("HITS", ratio("hits", "misses", "lookups")),
        Gauge("EXISTS", ratio("exists_hits", "exists_misses", "checks")),
        Gauge(
            "RATE",
            f"lookups {rate('lookups', 'keys/s')}  stores {rate('keys_registered', 'keys/s')}"
            f" ({rate('bytes_registered', '', as_bytes=True)})  evictions "
            f"{rate('evictions', 'keys/s')}  requests {requests}",
        ),
        Gauge(
            "STATE",
            f"{len(cur['instances'])} instances, {cur['regions']} regions, "
            f"{cur['leases']} leases, {cur.get('orphaned', {}).get('regions', 0)} orphaned "
            "regions",
        ),
    ]
    tables = [instance_rows(cur, limit=10), operation_rows(cur, prev, dt)]
    return MonitorFrame(header, gauges, tables)


# -- commands --------------------------------------------------------------------------------


def _connect(args: argparse.Namespace, *, probe: bool = True) -> MaruAdmin:
    """The admin connection of a command; `probe`: a server that is down (or not a
    maru-server) is said at once, as the library's connect says it."""
    admin = MaruAdmin(
        args.server,
        timeout_ms=args.timeout_ms,
        public_key=args.server_public_key,
        client_key=args.curve_client_key,
    )
    if probe:
        try:
            admin.probe()
        except MaruError:
            admin.close()
            raise
    return admin


def _json_default(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8", "backslashreplace")
    raise TypeError(f"cannot serialise {type(value).__name__}")


def cmd_curve_keypair(args: argparse.Namespace, out: TextIO) -> int:
    """Make a client's CURVE keypair (no server needed)."""
    if not Path(args.name).name:
        print(f"maru: curve-keypair: NAME {args.name!r} names no file", file=sys.stderr)
        return 2
    try:
        public, secret_path, public_path = write_keypair(Path(args.name))
    except OSError as exc:
        print(f"maru: curve-keypair: {exc}", file=sys.stderr)
        return 1
    print(f"public key {public}", file=out)
    print(f"secret key in {secret_path} (0600): the client's curve_client_key", file=out)
    print(f"public key in {public_path}: copy it into maru-server's --curve-clients", file=out)
    return 0


def cmd_status(args: argparse.Namespace, out: TextIO) -> int:
    with _connect(args) as admin:
        print(render_status(admin.url, admin.stats()), file=out)
    return 0


def cmd_stats(args: argparse.Namespace, out: TextIO) -> int:
    with _connect(args) as admin:
        s = admin.stats()
        if args.json:
            print(json.dumps(s, indent=2, sort_keys=True, default=_json_default), file=out)
        else:
            print(render_stats(admin.url, s), file=out)
    return 0


def _key_doc(key: str | bytes, length: int, owner: str) -> dict[str, Any]:
    """A key in `maru keys --json`: `type` tells a str key from a bytes key with the same
    text; a bytes key also comes exactly, as hex."""
    doc: dict[str, Any] = {"key": key, "type": type(key).__name__, "bytes": length, "owner": owner}
    if isinstance(key, bytes):
        doc["key_hex"] = key.hex()
    return doc


def cmd_keys(args: argparse.Namespace, out: TextIO) -> int:
    with _connect(args) as admin:
        keys, truncated = admin.keys(args.prefix, args.limit)
    if args.json:
        doc = {"keys": [_key_doc(k.key, k.length, k.owner) for k in keys], "truncated": truncated}
        print(json.dumps(doc, indent=2, default=_json_default), file=out)
        return 0
    if keys:
        # a key as a Python literal: 'bk' and b'bk' are two keys and must not print alike
        rows = [["BYTES", "OWNER", "KEY"]] + [[str(k.length), k.owner, repr(k.key)] for k in keys]
        print("\n".join(table(rows, right={0})), file=out)
    if truncated:
        print(
            f"(first {len(keys)} keys shown, most recently used first; more match: "
            f"raise --limit, at most {MAX_LIST_KEYS})",
            file=sys.stderr,
        )
    elif not keys:
        print(
            "(no keys" + (f" with prefix {args.prefix!r})" if args.prefix else ")"), file=sys.stderr
        )
    return 0


def cmd_evict(args: argparse.Namespace, out: TextIO) -> int:
    if not args.prefix:
        print(
            "maru evict: --prefix must not be empty; to delete every key: maru clear --yes",
            file=sys.stderr,
        )
        return 2
    with _connect(args) as admin:
        done = admin.delete_prefix(args.prefix, cluster=args.cluster)
        print(
            f"deleted {done[0]} keys with prefix {args.prefix!r} ({done[1]} pinned or leased, "
            "kept)",
            file=out,
        )
        return _cluster_outcome(admin, args.cluster and "these keys' objects", done.cluster, out)


def _cluster_outcome(admin: MaruAdmin, asked: str | bool, sent: bool, out: TextIO) -> int:
    """`evict` / `clear` with --cluster: say whether the cluster was asked to remove the keys'
    objects (`asked`: whose, or False). Exit 1 when the server has a tier that could not take
    it (the cluster still holds them); 0 without a tier (nothing to clear beyond the pool)."""
    if not asked:
        return 0
    if sent:
        print(f"cluster: asked to remove {asked} from Mooncake (not waited for)", file=out)
        return 0
    tier = admin.stats().get("cluster")
    if not tier:
        print("cluster: none (maru-server without --cluster): the pool alone was cleared", file=out)
        return 0
    why = tier.get("error") or "not connected"
    print(f"cluster: NOT asked, the tier is not connected ({why}): it still holds them", file=out)
    return 1


def cmd_clear(args: argparse.Namespace, out: TextIO) -> int:
    with _connect(args) as admin:
        if not args.yes:
            if not sys.stdin.isatty():
                print("maru clear: deletes every key; pass --yes to confirm", file=sys.stderr)
                return 2
            count = admin.stats()["keys"]
            answer = input(f"delete all {count} keys on {admin.url}? [y/N] ")
            if answer.strip().lower() not in ("y", "yes"):
                print("nothing deleted", file=out)
                return 1
        done = admin.clear(cluster=args.cluster)
        print(f"deleted {done[0]} keys ({done[1]} pinned or leased, kept)", file=out)
        whose = args.cluster and "every object of its tenant"
        return _cluster_outcome(admin, whose, done.cluster, out)


def cmd_monitor(
    args: argparse.Namespace, out: TextIO, *, sleep: Callable[[float], None] = time.sleep
) -> int:
    interval = max(0.0, args.interval)
    with _connect(args, probe=args.once) as admin:  # (live: a down server is a frame)
        if args.once:
            prev = admin.stats() if interval > 0 else None
            t0 = time.monotonic()
            if prev is not None:
                sleep(interval)
            cur = admin.stats()
            dt = time.monotonic() - t0
            print(
                render_monitor(admin.url, cur, prev, dt, interval, datetime.now(), live=False),
                file=out,
            )
            return 0
        if out.isatty():
            return _live_view(admin, interval, out, sleep)
        with contextlib.suppress(KeyboardInterrupt):  # a pipe, a file: frame after frame
            for frame in _frames(admin, interval):
                out.write(render_frame(frame) + "\n\n")
                out.flush()
                sleep(max(interval, 0.1))
        return 0


def _frames(admin: MaruAdmin, interval: float) -> Iterator[MonitorFrame]:
    """`maru monitor`'s frames, one per call: rates since the previous one; a server that
    does not answer is a frame that says so (and the next one starts the rates again)."""
    prev, t_prev = None, 0.0
    while True:
        try:
            cur, now = admin.stats(), time.monotonic()
            yield monitor_frame(admin.url, cur, prev, now - t_prev, interval, datetime.now())
            prev, t_prev = cur, now
        except MaruConnectionError as exc:
            yield MonitorFrame(
                f"maru monitor  {admin.url}  {datetime.now():%H:%M:%S}", message=str(exc)
            )
            prev = None


def _live_view(
    admin: MaruAdmin, interval: float, out: TextIO, sleep: Callable[[float], None]
) -> int:
    """The live view on a terminal, redrawn in place by `rich` (an optional dependency: the
    `monitor` extra), which keeps the screen and the terminal's state right."""
    try:
        from rich.console import Console
        from rich.live import Live
    except ImportError:
        print(
            "maru: the live view of `maru monitor` needs the 'rich' package: pip install "
            "'maru-kvcache[monitor]' (or `maru monitor --once`, or pipe its output)",
            file=sys.stderr,
        )
        return 1
    view = Live(console=Console(file=out, highlight=False), auto_refresh=False, screen=True)
    with contextlib.suppress(KeyboardInterrupt), view:
        for frame in _frames(admin, interval):
            view.update(rich_frame(frame), refresh=True)
            sleep(max(interval, 0.1))
    return 0


def rich_frame(frame: MonitorFrame) -> RenderableType:
    """A frame for the live view: the gauges in a grid with rich's bars, the instances and
    operations as rich tables (the same `MonitorFrame` that `render_frame` prints)."""
    from rich.console import Group
    from rich.progress_bar import ProgressBar
    from rich.table import Table
    from rich.text import Text

    parts: list[RenderableType] = [Text(frame.header, style="bold")]
    if frame.gauges:
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold")
        grid.add_column()
        for g in frame.gauges:
            value: RenderableType = Text(g.text)
            if g.fraction is not None:
                value = Table.grid(padding=(0, 1))
                value.add_row(ProgressBar(total=1.0, completed=g.fraction, width=30), Text(g.text))
            grid.add_row(g.label, value)
        parts.append(grid)
    for rows in frame.tables:
        if not rows.rows:
            parts.append(Text(rows.empty))
            continue
        t = Table(caption=Text(rows.more) if rows.more else None, caption_justify="left")
        for i, name in enumerate(rows.header):  # (on a narrow terminal the cells fold)
            t.add_column(name, justify="right" if i in rows.right else "left", overflow="fold")
        for cells in rows.rows:
            t.add_row(*map(Text, cells))  # (not markup: ids are the clients')
        parts.append(t)
    if frame.message:
        parts.append(Text(frame.message))
    return Group(*(p for part in parts for p in (part, Text(""))))


# -- parser ----------------------------------------------------------------------------------


# --timeout-ms: 0 would make every request time out at once (an up server reported down)
# (and at most what a C int holds: ZeroMQ's timeouts, and the deadline's clock, end in one)
_positive_ms = number_arg(int, minimum=1, above=False, top=2**31 - 1, noun="milliseconds")


def _given(text: str) -> str:
    """An argparse type: not empty (`--server "$URL"` with $URL unset must not mean the
    default server, nor `--server-public-key ""` plain TCP)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty (leave the flag out for its default)")
    return text


def _common(p: argparse.ArgumentParser, *, top: bool) -> None:
    # On subcommands the defaults are SUPPRESSed, so `maru --server X status` is not undone.
    default: Any = argparse.SUPPRESS
    p.add_argument(
        "--server",
        type=_given,
        metavar="URL",
        default=None if top else default,
        help=f"maru-server to talk to: tcp://host:port (default: ${SERVER_URL_ENV} or "
        f"{DEFAULT_SERVER_URL})",
    )
    p.add_argument(
        "--server-public-key",
        type=_given,
        metavar="KEY",
        default=None if top else default,
        help=f"the CURVE public key of a `maru-server --curve` (40 characters) or its file, "
        f"<state-dir>/curve.pub (default: ${SERVER_KEY_ENV}; none: plain TCP)",
    )
    p.add_argument(
        "--curve-client-key",
        type=_given,
        metavar="KEY",
        default=None if top else default,
        help="this client's CURVE secret key (40 characters) or its file, NAME.key of `maru "
        "curve-keypair NAME`, for a server with --curve-clients (default: "
        f"${CLIENT_KEY_ENV}; none: a throwaway keypair)",
    )
    p.add_argument(
        "--timeout-ms",
        type=_positive_ms,
        metavar="MS",
        default=2000 if top else default,
        help="RPC deadline; a server that does not answer in time counts as down (default: 2000)",
    )


def _text_arg(text: str) -> str:
    """An argparse type: text that is UTF-8 (a key prefix goes on the wire as UTF-8; bytes
    that are not text reach Python as surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError(
            f"expected text (UTF-8), got bytes that are not: {text!r}"
        ) from None
    return text


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="maru",
        description="Inspect and operate a running maru-server.",
        epilog="Exit status: 0 ok, 1 server unreachable or error, 2 usage. "
        "`maru COMMAND --help` for a command's options.",
    )
    p.add_argument("--version", action="version", version=f"maru {__version__}")
    _common(p, top=True)
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    def add(name: str, help_text: str, func: Any) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_text, description=help_text)
        _common(sp, top=False)
        sp.set_defaults(func=func)
        return sp

    add("status", "is the server up? pool, usage, instances (exit 1 when down)", cmd_status)
    sp = add("stats", "all statistics: pool, instances, operations (latency), counters", cmd_stats)
    sp.add_argument("--json", action="store_true", help="the raw STATS document as JSON")
    sp = add("keys", "list keys (most recently used first) with their size and owner", cmd_keys)
    sp.add_argument("--prefix", type=_text_arg, default=None, help="only keys starting with this")
    sp.add_argument(
        "--limit",
        type=number_arg(int, minimum=1, above=False, top=MAX_LIST_KEYS),
        default=100,
        help=f"at most this many keys (default: 100, at most {MAX_LIST_KEYS})",
    )
    sp.add_argument("--json", action="store_true", help="JSON instead of a table")
    sp = add(
        "monitor", "live view: pool usage, hit rate, throughput, instances, operations", cmd_monitor
    )
    sp.add_argument(
        "--interval",
        type=number_arg(float, minimum=0, above=False, top=86400, noun="seconds"),
        default=1.0,
        help="seconds between refreshes, at most a day (default: 1)",
    )
    sp.add_argument(
        "--once",
        action="store_true",
        help="print one frame and exit (rates measured over one --interval)",
    )
    sp = add(
        "evict",
        "delete every key with a prefix, e.g. one SGLang namespace (pinned and leased keys stay)",
        cmd_evict,
    )
    sp.add_argument(
        "--prefix", type=_text_arg, required=True, help="delete the keys starting with this"
    )
    sp.add_argument(
        "--cluster",
        action="store_true",
        help="also remove these keys' objects from the server's cluster tier (Mooncake), "
        "values only the cluster holds included, so that no node pulls them back",
    )
    sp = add("clear", "delete every key (pinned and leased keys stay)", cmd_clear)
    sp.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")
    sp.add_argument(
        "--cluster",
        action="store_true",
        help="also remove every object of the server's cluster tier (its tenant's, in "
        "Mooncake), so that no node pulls them back",
    )
    sp = add(
        "curve-keypair",
        "make a client CURVE keypair: NAME.key (secret, 0600) and NAME.pub (for the server's "
        "--curve-clients); needs no server",
        cmd_curve_keypair,
    )
    sp.add_argument("name", metavar="NAME", help="path prefix of the two files")
    return p


class OutputError(Exception):
    """The command's output could not be written (a full disk, /dev/full, EIO): said in one
    line by `main`, not a traceback. A closed pipe stays a `BrokenPipeError` (`maru ... | head`
    is no error)."""

    def __init__(self, cause: OSError):
        self.cause = cause
        super().__init__(f"cannot write the output: {cause.strerror or cause}")


class _Output:
    """`out` whose failed writes raise `OutputError`, told apart from the OSErrors of a
    command's other work; everything else (isatty, fileno, encoding: rich's Console asks) is
    `out`'s."""

    def __init__(self, out: TextIO):
        self._out = out

    def write(self, text: str) -> int:
        return self._guarded(self._out.write, text)

    def flush(self) -> None:
        self._guarded(self._out.flush)

    @staticmethod
    def _guarded(call: Callable[..., Any], *args: Any) -> Any:
        try:
            return call(*args)
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise OutputError(exc) from exc

    def __getattr__(self, name: str) -> Any:
        return getattr(self._out, name)


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    out = _Output(out or sys.stdout)  # type: ignore[assignment]
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    try:
        rc = int(args.func(args, out))
        out.flush()  # here, not at exit: a write that fails is said in one line
        return rc
    except ConfigError as exc:  # a malformed --server, $MARU_SERVER_URL or key
        print(f"maru: {exc}", file=sys.stderr)
        return 2
    except MaruConnectionError as exc:
        print(f"maru: maru-server is down or unreachable: {exc}", file=sys.stderr)
        return 1
    except MaruConnectError as exc:  # the probe: down, or something else on the port
        print(f"maru: {exc.url}: {exc.reason}", file=sys.stderr)
        return 1
    except MaruError as exc:
        print(f"maru: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `maru keys | head`
        return 0
    except OutputError as exc:  # `maru keys --json > keys.json` on a full disk
        print(f"maru: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C while a slow server's reply (or `clear`'s prompt) waits
        print("maru: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
