"""`maru-server`: the metadata server. It owns the pool; clients map it and move the bytes."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

from maru.config import ConfigError, parse_size
from maru.pool.backends import open_pool
from maru.pool.token import TokenSigner, load_or_create_secret
from maru.server.registry import Registry
from maru.server.service import MaruService

log = logging.getLogger("maru.server")

DEFAULT_PORT = 5555


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="maru-server",
        description="Maru metadata server: owns a shared-memory pool, hands out regions, and "
        "keeps the key -> (region, offset, length) registry. Page bytes never pass through it.",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument(
        "--port",
        type=int,
        default=DEFAULT_PORT,
        help=f"TCP port to bind; 0 picks a free one (default: {DEFAULT_PORT})",
    )
    p.add_argument(
        "--pool",
        default=None,
        help="pool location: a file (shm, default /dev/shm/maru-<port>.pool), a "
        "/dev/dax* device (devdax) or a directory (fsdax)",
    )
    p.add_argument(
        "--pool-size",
        default="8G",
        help="pool capacity, e.g. 8G or 500M (devdax: defaults to the device size) (default: 8G)",
    )
    p.add_argument(
        "--pool-group",
        default=None,
        help="group that may map the pool (mode 0660); default: owner only (0600)",
    )
    p.add_argument(
        "--state-dir",
        default=None,
        help="directory for the token secret and persisted state "
        "(default: ~/.local/state/maru/<port>)",
    )
    p.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="(default: INFO)",
    )
    p.add_argument(
        "--ready-file",
        default=None,
        help="write the bound endpoint to this file once serving (for scripts/tests)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        pool_size = parse_size(args.pool_size, name="--pool-size")
    except ConfigError as exc:
        print(f"maru-server: {exc}", file=sys.stderr)
        return 2
    port_tag = str(args.port) if args.port else "auto"
    pool_path = args.pool or f"/dev/shm/maru-{port_tag}.pool"
    state_dir = Path(args.state_dir or Path.home() / ".local/state/maru" / port_tag)
    try:
        pool = open_pool(pool_path, pool_size, args.pool_group)
        signer = TokenSigner(load_or_create_secret(state_dir))
        service = MaruService(Registry(pool, signer), f"tcp://{args.host}:{args.port}")
    except (OSError, ValueError, KeyError) as exc:
        print(f"maru-server: cannot start: {exc}", file=sys.stderr)
        return 1

    def _stop(signum: int, _frame: object) -> None:
        log.info("signal %d received", signum)
        service.stop()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    if args.ready_file:
        Path(args.ready_file).write_text(service.endpoint)
    try:
        service.serve_forever()
    finally:
        service.close()
        pool.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
