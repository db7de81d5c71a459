"""`maru-server`: the metadata server. It owns the pool; clients map it and move the bytes."""

from __future__ import annotations

import argparse
import contextlib
import errno
import grp
import logging
import os
import pwd
import signal
import socket
import stat
import sys
from pathlib import Path

import zmq

from maru import __version__
from maru.common.config import (
    COHERENCE_MODES,
    ConfigError,
    OneLineParser,
    fmt_bytes,
    number_arg,
    parse_size,
)
from maru.common.curve import read_allowlist
from maru.server import persistence
from maru.server.cluster.tier import PUBLISH_MODES, ClusterTier
from maru.server.instances import MAX_INSTANCES
from maru.server.journal import Journal
from maru.server.local_socket import LocalDoor, raise_fd_limit
from maru.server.localindex import open_local_index, retire_earlier, retire_in_pool
from maru.server.logs import configure_logging
from maru.server.metrics import start_metrics_server
from maru.server.pool import (
    INDEX_SLOTS_MAX,
    REGION_ALIGNMENT,
    Pool,
    PoolPathError,
    auto_index_slots,
    open_pool,
)
from maru.server.registry import Registry
from maru.server.service import MaruService
from maru.server.state_dir import (
    lock_state_dir,
    pool_generation,
    pool_size_change,
    purge,
    purge_pool,
    purge_state,
    recorded_pool,
    retire_pool_identity,
)
from maru.server.token import (
    CURVE_PUBLIC_FILE,
    TokenSigner,
    load_or_create_curve_keys,
    load_or_create_secret,
)

log = logging.getLogger("maru.server")

DEFAULT_PORT = 5555


_port = number_arg(int, minimum=0, above=False, top=65535)
_positive = number_arg(float, minimum=0, above=True)
_non_negative = number_arg(float, minimum=0, above=False)
_fraction = number_arg(float, minimum=0, above=True, top=1)
_count = number_arg(int, minimum=0, above=False)
_whole = number_arg(int, minimum=0, above=True)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="maru-server",
        description="Maru metadata server: owns a shared-memory pool, hands out regions, and "
        "keeps the key -> (region, offset, length) registry. Page bytes never pass through it.",
    )
    p.add_argument("--version", action="version", version=f"maru-server {__version__}")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument(
        "--port",
        type=_port,
        default=DEFAULT_PORT,
        help=f"TCP port to bind; 0 picks a free one (default: {DEFAULT_PORT})",
    )
    p.add_argument(
        "--pool",
        help="pool location: a file (shm, default /dev/shm/maru-<port>.pool), a "
        "/dev/dax* device (devdax) or a directory (fsdax)",
    )
    p.add_argument(
        "--pool-size",
        default="8G",
        help="pool capacity, e.g. 8G or 500M (devdax: a larger size is cut to what the device "
        "holds) (default: 8G)",
    )
    p.add_argument(
        "--preallocate",
        action="store_true",
        help="allocate the whole shm pool file at start (posix_fallocate), refusing to start "
        "if it does not fit (default: off: the free space is only checked at start)",
    )
    p.add_argument(
        "--pool-group", help="group that may map the pool (mode 0660); default: owner only (0600)"
    )
    p.add_argument(
        "--state-dir",
        help="directory for the token secret and persisted state "
        "(default: ~/.local/state/maru/<port>)",
    )
    p.add_argument(
        "--log-level",
        default="INFO",
        type=str.upper,
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="(default: INFO)",
    )
    p.add_argument(
        "--log-format",
        default="text",
        choices=["text", "json"],
        help="one line per event: text, or one JSON object (ts, level, logger, msg, instance) "
        "(default: text)",
    )
    p.add_argument(
        "--local-socket",
        default="auto",
        help="Unix socket for clients on this node, beside the TCP port (clients that cannot "
        "reach it use TCP): 'auto' (an abstract socket named after the endpoint), '@name' "
        "(abstract), a file path, or 'none' (default: auto)",
    )
    p.add_argument(
        "--local-uids",
        metavar="UIDS",
        default="",
        help="comma-separated users (uids or names) that may use the local socket besides the "
        "server's own user, root and the --pool-group's members (default: none)",
    )
    p.add_argument(
        "--curve",
        action="store_true",
        help="authenticate and encrypt the TCP port with ZeroMQ CURVE; clients need the public "
        "key in the state dir's curve.pub (default: off: plain TCP, for 127.0.0.1)",
    )
    p.add_argument(
        "--curve-clients",
        metavar="PATH",
        help="with --curve, talk only to clients whose CURVE public key is listed here: a "
        "directory of *.pub files (`maru curve-keypair`) or one file, a Z85 key per line; "
        "re-read when it changes (default: any client that has the server's public key)",
    )
    p.add_argument(
        "--metrics-port",
        type=_port,
        help="serve Prometheus metrics at http://<host>:<port>/metrics; 0 picks a free port "
        "(shown by `maru status`) (default: off)",
    )
    p.add_argument(
        "--eviction-high-watermark",
        type=_fraction,
        default=0.95,
        help="evict LRU keys when registered bytes exceed this fraction of the pool "
        "(default: 0.95)",
    )
    p.add_argument(
        "--eviction-low-watermark",
        type=_fraction,
        default=0.85,
        help="evict down to this fraction of the pool (default: 0.85)",
    )
    p.add_argument(
        "--lease-timeout",
        type=_positive,
        default=10.0,
        help="seconds a read lease protects a page if its reader never releases it (default: 10)",
    )
    p.add_argument(
        "--quota-region-bytes",
        default="100%",
        metavar="SIZE|PERCENT",
        help="most bytes of regions one client process may hold (its instances together): a "
        "size (16G) or a share of the "
        "pool (25%%); past it, region requests are refused (default: 100%%: no quota)",
    )
    p.add_argument(
        "--quota-leases",
        type=_count,
        default=4096,
        help="most read leases one instance may hold at once; a leased lookup past it is "
        "refused (QUOTA_EXCEEDED: misses). 0: no quota (default: 4096)",
    )
    p.add_argument(
        "--max-instances",
        type=_whole,
        default=MAX_INSTANCES,
        help="most instances (MaruHandlers) the server keeps at once, all clients together; "
        "past it a new handshake is refused (QUOTA_EXCEEDED) until one disconnects or is "
        f"reaped, so a client handshaking in a loop cannot grow the server (default: "
        f"{MAX_INSTANCES})",
    )
    p.add_argument(
        "--quota-lease-bytes",
        default="50%",
        metavar="SIZE|PERCENT",
        help="most bytes of keys one instance may hold under read leases: a size or a share "
        "of the pool; past it, lookups miss (default: 50%%; 100%%: no quota)",
    )
    p.add_argument(
        "--quota-pin-bytes",
        default="50%",
        metavar="SIZE|PERCENT",
        help="most bytes of keys one instance may hold pinned (never evicted) at once, each "
        "key once, whoever wrote it: a size or a share of the pool; a PIN past it pins "
        "nothing (QUOTA_EXCEEDED: a pinned lookup misses) (default: 50%%; 100%%: no quota)",
    )
    p.add_argument(
        "--heartbeat-timeout",
        type=_positive,
        default=15.0,
        help="seconds of silence after which a TCP client is reaped; a client on the local "
        "socket is reaped when its process exits (default: 15)",
    )
    p.add_argument(
        "--reap-hold",
        type=_non_negative,
        default=300.0,
        help="seconds the regions of a client reaped for its silence are kept from others, in "
        "case it was only paused and resumes writing into them (default: 300)",
    )
    p.add_argument(
        "--journal-fsync-ms",
        type=_non_negative,
        default=50.0,
        help="fsync the registry journal at most this often: a machine crash loses at most "
        "this window, a killed server nothing (default: 50)",
    )
    p.add_argument(
        "--snapshot-mb",
        type=_positive,
        default=64.0,
        help="start a new journal and write a snapshot (in the background) when the journals "
        "since the last snapshot exceed both this size and that snapshot's: a large registry "
        "snapshots once per journal of its own size, not every SNAPSHOT_MB; a restart replays "
        "at most about the larger of the two; the state dir needs room for that much journal "
        "plus two snapshots (default: 64)",
    )
    p.add_argument(
        "--busy-poll-us",
        type=_count,
        default=1000,
        help="after serving a request, keep polling for the next one this many microseconds "
        "before sleeping; 0: sleep at once (default: 1000)",
    )
    p.add_argument(
        "--coherence",
        choices=COHERENCE_MODES,
        default="hardware",
        help="how the hosts sharing the pool see each other's writes: hardware (coherent "
        "caches) or software (copies flush and invalidate cache lines, for CXL 2.0 sharing; "
        "used if either side says so) (default: hardware)",
    )
    p.add_argument(
        "--cluster",
        choices=("mooncake",),
        help="put a cluster tier behind the pool: a sidecar publishes the values sealed here "
        "for other nodes' pools (docs/operations.md, Cluster tier) (default: none)",
    )
    p.add_argument(
        "--cluster-config",
        metavar="FILE",
        help="with --cluster mooncake: the Mooncake JSON config SGLang's Mooncake backend reads",
    )
    p.add_argument(
        "--cluster-publish",
        choices=PUBLISH_MODES,
        default="write-through",
        help="when the tier publishes a value: write-through (each key sealed in the pool) or "
        "spill (a key a watermark eviction takes from the pool) (default: write-through)",
    )
    p.add_argument(
        "--cluster-lookup-ms",
        type=_count,
        default=200,
        help="how long a client's lookup waits for keys it missed to be pulled from the "
        "cluster; a pull that takes longer is a miss (default: 200)",
    )
    p.add_argument(
        "--no-local-index",
        action="store_true",
        help="do not publish the key index in shared memory: clients on this node then send a "
        "request for every lookup (for debugging and A/B benchmarks) (default: published)",
    )
    p.add_argument(
        "--index-slots",
        default="0",
        metavar="N|auto",
        help="put the key index in the pool, N slots (a power of two; auto: two per 64 KiB), "
        "for every host of a CXL pod (not fsdax); 0: in /dev/shm, this node only (default: 0)",
    )
    p.add_argument(
        "--no-restore",
        action="store_true",
        help="start with an empty registry, discarding the state in --state-dir",
    )
    p.add_argument(
        "--ready-file",
        help="write the bound endpoint to this file once serving (for scripts/tests)",
    )
    p.add_argument(
        "--purge",
        action="store_true",
        help="do not serve: delete the pool file (shm) or region files (fsdax) and the state "
        "in --state-dir of the server these flags name (it must be stopped), then exit",
    )
    return p


def quotas(args: argparse.Namespace, capacity: int) -> tuple[int, int, int]:
    """--quota-region-bytes (at least one region), --quota-lease-bytes and --quota-pin-bytes
    in bytes for a pool of `capacity`; 0: no quota."""
    return (
        pool_share(args.quota_region_bytes, capacity, "--quota-region-bytes", REGION_ALIGNMENT),
        pool_share(args.quota_lease_bytes, capacity, "--quota-lease-bytes", 1),
        pool_share(args.quota_pin_bytes, capacity, "--quota-pin-bytes", 1),
    )


def pool_share(text: str, capacity: int, flag: str, least: int) -> int:
    """A quota flag (a size or a share of the pool) in bytes for a pool of `capacity`, at
    least `least` (0: none, the pool is the limit); ConfigError if malformed."""
    if text.strip().endswith("%"):
        try:
            share = float(text.strip()[:-1])
        except ValueError:
            share = -1.0
        if not 0 < share <= 100:
            raise ConfigError(f"{flag}: expected a share in (0%, 100%], got {text}")
        quota = int(share / 100 * capacity)
    else:
        quota = parse_size(text, name=flag)
    return 0 if quota >= capacity else max(quota, least)


def local_uids(text: str) -> list[int]:
    """The uids of `--local-uids` ("1000,alice"): numbers, or names of existing users."""
    uids = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        if item.isdigit():
            uid = int(item)
            if uid >= 2**32 - 1:
                raise ValueError(f"uid {item} is out of range")
            uids.append(uid)
            continue
        try:
            uids.append(pwd.getpwnam(item).pw_uid)
        except KeyError:
            raise ValueError(f"no user named {item!r}") from None
    return uids


def index_slots(value: str, pool_bytes: int) -> int | None:
    """`--index-slots` as a number of slots (0: none), None if it is not one."""
    if value == "auto":
        return auto_index_slots(pool_bytes)
    try:
        slots = int(value)
    except ValueError:
        return None
    ok = slots == 0 or (8 <= slots <= INDEX_SLOTS_MAX and slots & (slots - 1) == 0)
    return slots if ok else None


def check_args(args: argparse.Namespace) -> str | None:
    """What the flags' types cannot check alone (paths, relations between flags): the first
    problem as one line naming the flag, or None. Sets `args.pool_bytes`."""
    for flag in ("--pool", "--state-dir", "--ready-file", "--curve-clients", "--cluster-config"):
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None and not value.strip():  # ("$POOL" unset: not the default pool)
            return f"{flag}: must not be empty (leave the flag out for its default)"
    if (args.cluster is None) != (args.cluster_config is None):
        return "--cluster and --cluster-config go together"
    try:
        args.pool_bytes = parse_size(args.pool_size, name="--pool-size")
    except ConfigError as exc:
        return str(exc)
    if args.pool_bytes < REGION_ALIGNMENT:
        return (
            f"--pool-size: {args.pool_size} is smaller than one region "
            f"({fmt_bytes(REGION_ALIGNMENT)}, the pool's allocation unit)"
        )
    args.index_slot_count = index_slots(args.index_slots, args.pool_bytes)
    if args.index_slot_count is None:
        return (
            f"--index-slots: {args.index_slots!r} is not 0, auto or a power of two up to "
            f"{INDEX_SLOTS_MAX}"
        )
    try:
        quotas(args, args.pool_bytes)
    except ConfigError as exc:
        return str(exc)
    for flag, value, top in (
        # a larger value cannot be served with: the snapshot size is an int of bytes (inf is
        # none), the fsync thread waits the interval (past threading.TIMEOUT_MAX the wait
        # raises and the thread dies: no fsync again), the busy poll spins without looking at
        # SIGTERM or housekeeping
        ("--snapshot-mb", args.snapshot_mb, 1 << 20),  # 1 TiB
        ("--journal-fsync-ms", args.journal_fsync_ms, 86_400_000),  # a day
        ("--busy-poll-us", args.busy_poll_us, 1_000_000),  # a second
        # (and times past a day: `inf` is no "never", it breaks the timers and `maru status`)
        ("--lease-timeout", args.lease_timeout, 86_400),
        ("--heartbeat-timeout", args.heartbeat_timeout, 86_400),
        ("--reap-hold", args.reap_hold, 86_400),
    ):
        if value > top:
            return f"argument {flag}: must be at most {top}, got {value:g}"
    if args.eviction_low_watermark > args.eviction_high_watermark:
        return (
            f"--eviction-low-watermark {args.eviction_low_watermark:g} is above "
            f"--eviction-high-watermark {args.eviction_high_watermark:g}"
        )
    if args.pool and args.pool.endswith("/"):
        bare = args.pool.rstrip("/") or "/"
        if os.path.lexists(bare) and not os.path.isdir(bare):
            # (a directory pool names a directory; its undo must never take the file)
            return f"--pool: {args.pool} names a file, not a directory"
    if args.pool and not (args.pool.startswith("/dev/dax") or Path(args.pool).exists()):
        # (a pool file is created, an fsdax directory too, but not the directories above:
        # a typo must not put a RAM-sized pool on the root disk)
        parent = Path(args.pool.rstrip("/") or "/").parent
        if parent.exists() and not parent.is_dir():
            return f"--pool: {parent} is a file, not a directory"
        if not parent.is_dir():
            return f"--pool: directory {parent} does not exist (create it, or pick another path)"
    if args.pool_group is not None:
        try:
            grp.getgrnam(args.pool_group)
        except KeyError:
            return f"--pool-group: no group named {args.pool_group!r}"
    try:
        local_uids(args.local_uids)
    except ValueError as exc:
        return f"--local-uids: {exc}"
    if args.curve_clients is not None:
        if not args.curve:
            return "--curve-clients needs --curve"
        try:
            if not read_allowlist(Path(args.curve_clients)):
                return f"--curve-clients: no client key in {args.curve_clients}"
        except (OSError, ValueError) as exc:
            return f"--curve-clients: {exc}"
    if args.state_dir is not None and Path(args.state_dir).is_file():
        return f"--state-dir: {args.state_dir} is not a directory"
    for flag, path in (("--ready-file", args.ready_file), ("--local-socket", args.local_socket)):
        named_file = path and path not in ("auto", "none") and not path.startswith("@")
        if named_file and not Path(path).parent.is_dir():
            return f"{flag}: directory {Path(path).parent} does not exist"
    if args.ready_file:
        return ready_file_problem(args.ready_file)
    return None


def ready_file_problem(path: str) -> str | None:
    """Why `--ready-file` could not be written once the server serves, found before it
    starts, by opening it for writing (an existing file is not changed; where there is none,
    the file `write_ready_file` renames into place is made and removed again, so a script
    waiting for `path` never sees it early; a FIFO or device is only asked for write access);
    None if it can be."""
    if os.path.isdir(path):
        return f"--ready-file: {path} is a directory"
    try:
        if not os.path.exists(path):
            probe = _ready_temp(path)
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            os.unlink(probe)
        elif stat.S_ISREG(os.stat(path).st_mode):
            os.close(os.open(path, os.O_WRONLY))
        elif not os.access(path, os.W_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
    except OSError as exc:
        return f"--ready-file: cannot write {path} ({exc.strerror or exc})"
    return None


def write_ready_file(path: str, endpoint: str) -> str | None:
    """Write the endpoint to `--ready-file`, whole: a regular file is written beside it and
    renamed into place, so whoever polls `path` reads either nothing or the endpoint, never
    a part of it (a FIFO or device is written to). Why not, as one line, or None."""
    try:
        if os.path.exists(path) and not stat.S_ISREG(os.stat(path).st_mode):
            Path(path).write_text(endpoint)
            return None
        temp = _ready_temp(path)
        try:
            Path(temp).write_text(endpoint)
            os.replace(temp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)
    except OSError as exc:
        return f"cannot write --ready-file {path}: {exc.strerror or exc}"
    return None


def _ready_temp(path: str) -> str:
    """The file `--ready-file` is written to before it is renamed into place (same folder)."""
    return f"{path}.{os.getpid()}.tmp"


def port_taken(host: str, port: int) -> str | None:
    """Why the server could not listen on host:port, checked before anything is created or
    logged (a port in use is the commonest failed start); None if it can (port 0 included)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as exc:
        return f"--host: cannot resolve {host!r} ({exc})"
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ binds
        try:
            probe.bind(address[:2] if family == socket.AF_INET else address)
        except OSError as exc:
            where = f"--host {host} --port {port}"
            if exc.errno == errno.EADDRINUSE:
                return (
                    f"{where}: the port is in use (another maru-server? `maru status "
                    f"--server {host}:{port}`)"
                )
            return f"{where}: cannot listen there ({exc.strerror or exc})"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    problem = check_args(args)
    if problem:
        parser.error(problem)  # usage and one line, exit status 2
    port_tag = str(args.port) if args.port else "auto"
    pool_path = args.pool or f"/dev/shm/maru-{port_tag}.pool"
    state_dir = Path(args.state_dir or Path.home() / ".local/state/maru" / port_tag)
    if args.purge:
        return purge(pool_path, state_dir, args.pool_bytes)
    taken = port_taken(args.host, args.port)
    if taken:
        print(f"maru-server: cannot start: {taken}", file=sys.stderr)
        return 1
    # A journal write past a file size limit (RLIMIT_FSIZE) must fail with EFBIG, which the
    # journal handles (changes refused until a snapshot succeeds), not kill the server.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    if args.metrics_port is not None:
        try:
            import prometheus_client  # noqa: F401
        except ImportError:
            print(
                "maru-server: --metrics-port needs the prometheus_client package, which is not "
                "installed: pip install prometheus-client (a dependency of maru-kvcache: "
                "reinstall it)",
                file=sys.stderr,
            )
            return 2
    configure_logging(args.log_level, args.log_format)
    # What this start creates, it removes again if it fails: no pool or state left behind;
    # only that (a pool that was there before, or anything else at its path, stays).
    state_existed = state_dir.exists()

    pool: Pool | None = None
    pool_made: tuple[int, int] | None = None  # (st_dev, st_ino) of the pool this start made
    state_lock: int | None = None

    def _undo_start() -> None:
        if pool is not None:
            pool.close()
        if state_lock is not None:
            os.close(state_lock)  # (purge_state takes the lock itself)
        with contextlib.suppress(OSError, RuntimeError):
            if not state_existed:
                purge_state(state_dir)
        with contextlib.suppress(OSError, RuntimeError):
            if pool_made is not None:
                purge_pool(pool_path, created=pool_made)

    raise_fd_limit()
    try:
        try:
            state_lock = lock_state_dir(state_dir)  # held (fd open) for the process's life
        except OSError as exc:  # (a path that cannot be a directory: say which flag)
            raise OSError(f"--state-dir {state_dir}: {exc.strerror or exc}") from None
        refusal = pool_size_change(args, pool_path, state_dir)
        if refusal:
            print(f"maru-server: cannot start: {refusal}", file=sys.stderr)
            return 2
        # locked for the life of the process too (the pool object holds the fd); what is
        # at the path is used only if it is this user's pool (or nothing: then made)
        pool = open_pool(
            pool_path,
            args.pool_bytes,
            args.pool_group,
            lock=True,
            preallocate=args.preallocate,
            index_slots=0 if args.no_local_index else args.index_slot_count,
            guard=True,
            known=recorded_pool(state_dir, pool_path),
        )
        if getattr(pool, "created", False):
            pool_made = pool.identity
        if args.index_slot_count and pool.index_area is None:
            log.warning("--index-slots: a directory pool has no in-pool index: /dev/shm's")
        retire_earlier(pool.kind, pool.path)  # before the pool can change (a new generation)
        retire_in_pool(pool)  # an earlier start's in-pool table, whatever this one's flags
        secret = load_or_create_secret(state_dir)
        journal = Journal(
            state_dir,
            fsync_interval=args.journal_fsync_ms / 1000.0,
            snapshot_bytes=int(args.snapshot_mb * (1 << 20)),
        )
        pool.generation, first_region_id = pool_generation(
            state_dir, pool, no_restore=args.no_restore
        )
        signer = TokenSigner(secret, pool.generation)
        snapshot, records = journal.load()
        quota_region_bytes, quota_lease_bytes, quota_pin_bytes = quotas(args, pool.capacity)
        registry = Registry(
            pool,
            signer,
            journal=journal,
            high_watermark=args.eviction_high_watermark,
            low_watermark=args.eviction_low_watermark,
            lease_seconds=args.lease_timeout,
            reap_hold=args.reap_hold,
            quota_region_bytes=quota_region_bytes,
            quota_leases=args.quota_leases,
            quota_lease_bytes=quota_lease_bytes,
        )
        registry.instances.max_instances = args.max_instances
        registry.pins.max_bytes = quota_pin_bytes  # (a request's bound: replay takes every pin)
        persistence.restore(registry, snapshot, records)
        registry.regions.next_id = max(registry.regions.next_id, first_region_id)
        journal.compact(persistence.snapshot_packed(registry))  # the replay, in one snapshot
        open_local_index(
            pool,
            registry,
            args.pool_group,
            enabled=not args.no_local_index,
            software=args.coherence == "software",
        )
        curve = load_or_create_curve_keys(state_dir) if args.curve else None
        service = MaruService(
            registry,
            f"tcp://{args.host}:{args.port}",
            journal=journal,
            curve_secret_key=curve[1] if curve else None,
            curve_clients=Path(args.curve_clients) if args.curve_clients else None,
            local_door=LocalDoor(
                local_uids(args.local_uids),
                grp.getgrnam(args.pool_group).gr_gid if args.pool_group else None,
            ),
            heartbeat_timeout=args.heartbeat_timeout,
            local_socket=args.local_socket,
            gc_freeze=True,  # see maru.server.housekeeping.freeze_heap
            busy_poll_us=args.busy_poll_us,
            coherence=args.coherence,
        )
        if args.cluster is not None:  # (its sidecar dies with this process, however it ends)
            service.cluster = ClusterTier(
                registry,
                args.cluster_config,
                publish=args.cluster_publish,
                lookup_ms=args.cluster_lookup_ms,
                log_level=args.log_level,
                coherence=args.coherence,
            )
    except PoolPathError as exc:  # (what the operator named: fix the flag, exit 2)
        print(f"maru-server: cannot start: {exc}", file=sys.stderr)
        _undo_start()
        return 2
    except (OSError, ValueError, KeyError, RuntimeError, zmq.ZMQError) as exc:
        print(f"maru-server: cannot start: {exc}", file=sys.stderr)
        _undo_start()
        return 1
    if curve is not None:
        log.info(
            "TCP is CURVE-authenticated: clients need server_public_key %s (%s)%s",
            curve[0].decode(),
            state_dir / CURVE_PUBLIC_FILE,
            f" and a client key listed in {args.curve_clients}" if args.curve_clients else "",
        )
    elif args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning(
            "TCP on %s is neither authenticated nor encrypted: use --curve for clients on "
            "other hosts (docs/operations.md)",
            args.host,
        )

    def _stop(signum: int, _frame: object) -> None:
        log.info("signal %d received", signum)
        service.stop()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    metrics_httpd = None
    if args.metrics_port is not None:
        try:
            metrics_httpd, service.metrics_url = start_metrics_server(
                service.stats, args.host, args.metrics_port
            )
        except OSError as exc:
            print(
                f"maru-server: cannot serve metrics on {args.host}:{args.metrics_port}: {exc}",
                file=sys.stderr,
            )
            service.close()
            _undo_start()
            return 1
    try:
        failed = write_ready_file(args.ready_file, service.endpoint) if args.ready_file else None
        if failed is None:
            service.serve_forever()
    finally:
        if registry.local_index is not None:
            registry.local_index.close()
        if metrics_httpd is not None:
            metrics_httpd.shutdown()
        service.close()
        pool.close()
    if failed:  # (checked before the start: it went since, or its filesystem is full)
        print(f"maru-server: {failed}", file=sys.stderr)
        _undo_start()
        return 1
    if service.pool_lost is not None:
        retire_pool_identity(state_dir, service.pool_lost)
        print(
            f"maru-server: pool {pool.path} {service.pool_lost} while serving: its keys are "
            "dropped; start maru-server again to serve a fresh pool",
            file=sys.stderr,
        )
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
