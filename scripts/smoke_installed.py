"""Smoke test of an installed maru-kvcache (run by scripts/check_dist.sh in a fresh venv, from
outside the checkout): the console scripts, the import names, the C helpers, and one store and
retrieve through a real server whose Prometheus endpoint answers. Exits non-zero on failure."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

SERVER_LOG: list[Path] = []  # printed when a check fails


def check(condition: bool, what: str) -> None:
    if not condition:
        for log in SERVER_LOG:
            print(log.read_text(errors="replace"), file=sys.stderr)
        sys.exit(f"[smoke] FAILED: {what}")


def main() -> None:
    label = sys.argv[1] if len(sys.argv) > 1 else "installed"
    bin_dir = Path(sys.executable).parent
    dist = importlib.metadata.distribution("maru-kvcache")
    check(dist.version == "0.1.0", f"maru-kvcache version {dist.version}")
    import maru

    check("site-packages" in maru.__file__, f"maru imported from {maru.__file__}")
    check(importlib.util.find_spec("maru_sglang") is not None, "maru_sglang is installed")
    for ext in ("common._memcopy", "client._busypoll", "server._keyindex", "common._shmindex"):
        check(importlib.util.find_spec(f"maru.{ext}") is not None, f"maru.{ext} built")
    from maru import MaruConfig, MaruHandler

    with tempfile.TemporaryDirectory() as tmp:
        pool = f"/dev/shm/maru-smoke-{uuid.uuid4().hex}.pool"
        ready, state, log = Path(tmp, "ready"), Path(tmp, "state"), Path(tmp, "server.log")
        server_args = ["--port", "0", "--pool", pool, "--state-dir", str(state)]
        SERVER_LOG.append(log)
        server = subprocess.Popen(
            [bin_dir / "maru-server", *server_args, "--pool-size", "64M", "--metrics-port", "0",
             "--ready-file", str(ready)],
            stdout=log.open("w"), stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 30
            while not ready.exists() or not ready.read_text().startswith("tcp://"):
                check(server.poll() is None, "maru-server started")
                check(time.monotonic() < deadline, "maru-server ready within 30 s")
                time.sleep(0.05)
            url = ready.read_text()
            with MaruHandler(MaruConfig(server_url=url, pool_size="8M")) as h:
                check(h.store("page-0", b"smoke") is True, "store")
                check(bytes(h.retrieve("page-0").view) == b"smoke", "retrieve")
                status = subprocess.run(
                    [bin_dir / "maru", "--server", url, "status"],
                    capture_output=True,
                    text=True,
                    timeout=30,
                )
                check(status.returncode == 0 and " is up" in status.stdout, "maru status")
                metrics_url = next(
                    line.split()[-1]
                    for line in status.stdout.splitlines()
                    if line.startswith("metrics:")
                )
                with urllib.request.urlopen(metrics_url, timeout=10) as reply:
                    check(b"maru_keys" in reply.read(), f"metrics at {metrics_url}")
        finally:
            server.terminate()
            server.wait(10)
        purge = subprocess.run(
            [bin_dir / "maru-server", *server_args, "--purge"], capture_output=True, text=True
        )
        check(purge.returncode == 0 and not Path(pool).exists(), "maru-server --purge")
    print(f"[smoke] {label}: ok (maru-kvcache {dist.version}, server, store, status, metrics)")


if __name__ == "__main__":
    main()
