"""The cluster tier's sidecar: the pool's one Mooncake Store client, a process of its own.

Why a process and not a thread of maru-server: Mooncake's Python calls hold the GIL while
they block (a setup, or a read while the master is gone, blocks for seconds), which would
stop the server's request loop. maru-server (`maru.server.cluster.tier.ClusterTier`) starts
and supervises this process and talks to it over a ZMQ PAIR socket, msgpack frames:

    server -> sidecar  {"op": "publish", "batch": id, "jobs": [[name, path, offset, length,
                        maru64 or 0], ...]}     (path, offset: the value's place in the pool)
                       {"op": "probe", "batch": id, "jobs": [name, ...]}
                       {"op": "pull", "batch": id, "jobs": [[name, path, offset, length,
                        maru64], ...]}          (pages the server reserved for the value)
    sidecar -> server  {"op": "state", "connected": bool, "error": str | None}  (after
                        each setup, and whenever the master stops or starts answering)
                       {"op": "<op>-done", "batch": id, "results": [one per job],
                        "error": str | None}
    (results: PUBLISHED, REFUSED or FAILED for publish and pull; [length, maru64] or None
    for a probe)

Zero extra copies: the sidecar maps the pool's file(s) itself, registers each mapping with
Mooncake's transfer engine (`register_buffer`) and publishes straight from the pool's pages
(`batch_put_from`), and pulls straight into pages the server reserved (`batch_get_into`),
proven there against the value's proof before the server registers them. Before a value
is published its maru64 is computed from the pages: a writer's checksum that does not match
is REFUSED (never published), a value without one gets the computed one; the proof
(`maru.server.cluster.proof`) goes after the bytes. The server holds the values' keys (no
eviction, no delete, no page reuse) until the batch's reply.

    python -m maru.server.cluster.sidecar --config FILE --endpoint ZMQ_URL [--device-bytes N]

The one module under maru.server that loads `maru.client.checksum` (and so numpy): the one
maru64, in a process of its own; maru-server itself never imports this module.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import mmap
import os
import signal
import sys
import time
from typing import Any

import msgpack
import zmq

from maru.client.checksum import checksums
from maru.server.cluster.config import MooncakeConfig
from maru.server.cluster.mooncake import load_mooncake
from maru.server.cluster.proof import (
    FAILED,
    PUBLISHED,
    REFUSED,
    decode_proof,
    encode_proof,
    proof_name,
)

log = logging.getLogger("maru.server.cluster")

SETUP_RETRY_S = 2.0
CHECK_S = 1.0  # how often the sidecar asks whether the master answers (and after a failure)
LOCAL_BUFFER = 16 << 20  # Mooncake's own staging buffer (the zero-copy calls do not use it)


class PoolMaps:
    """The pool's files, each mapped once (shared, read-write) and registered with Mooncake."""

    def __init__(self, register: Any, device_bytes: int):
        self.register = register  # MooncakeDistributedStore.register_buffer
        self.device_bytes = device_bytes  # what to map of a device (whose size fstat says 0)
        self.maps: dict[str, tuple[mmap.mmap, int]] = {}  # path -> (mapping, address)

    def view(self, path: str, offset: int, length: int) -> tuple[memoryview, int]:
        """The pages at (path, offset, length) and their address (ValueError outside the file)."""
        mapped = self.maps.get(path)
        if mapped is None:
            mapped = self.maps[path] = self._map(path)
        mm, address = mapped
        if offset < 0 or length <= 0 or offset + length > len(mm):
            raise ValueError(f"{path}: [{offset}, +{length}) is outside its {len(mm)} bytes")
        return memoryview(mm)[offset : offset + length], address + offset

    def _map(self, path: str) -> tuple[mmap.mmap, int]:
        fd = os.open(path, os.O_RDWR)
        try:
            mm = mmap.mmap(fd, os.fstat(fd).st_size or self.device_bytes, mmap.MAP_SHARED)
        finally:
            os.close(fd)
        address = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        rc = self.register(address, len(mm))
        if rc != 0:
            raise OSError(f"Mooncake register_buffer of {path} ({len(mm)} bytes) failed: {rc}")
        log.info("pool file %s (%d bytes) registered with Mooncake", path, len(mm))
        return mm, address


class Sidecar:
    def __init__(self, config: MooncakeConfig, sock: zmq.Socket, device_bytes: int):
        self.config = config
        self.device_bytes = device_bytes
        self.sock = sock
        self.module = load_mooncake()
        self.store: Any = None
        self.maps: PoolMaps | None = None
        self.error: str | None = "not connected yet"

    def connect(self) -> bool:
        """Set up a Mooncake client (it blocks while the master is unreachable): True once."""
        c = self.config
        store = self.module.MooncakeDistributedStore()
        rc = store.setup(
            c.local_hostname,
            c.metadata_server,
            c.global_segment_size,
            LOCAL_BUFFER,
            c.protocol,
            c.device_name,
            c.master_server_address,
        )
        if rc != 0:
            self.error = f"Mooncake setup with master {c.master_server_address} failed: {rc}"
            log.warning("%s; retrying in %.0f s", self.error, SETUP_RETRY_S)
            return False
        self.store, self.error = store, None
        self.maps = PoolMaps(store.register_buffer, self.device_bytes)
        log.info("connected to Mooncake master %s as %s", c.master_server_address, c.local_hostname)
        return True

    def send(self, message: dict[str, Any]) -> None:
        self.sock.send(msgpack.packb(message, use_bin_type=True))

    def _mapped(self, jobs: list[list[Any]]) -> tuple[list[Any], list[int], list[int], str | None]:
        """Each job's pool pages (name, path, offset, length, checksum): their views and
        addresses, the jobs they belong to, and why any could not be mapped."""
        assert self.maps is not None
        views, addresses, places, error = [], [], [], None
        for i, (_, path, offset, length, _) in enumerate(jobs):
            try:
                view, address = self.maps.view(path, offset, length)
            except (OSError, ValueError) as exc:
                error = str(exc)
                continue
            views.append(view)
            addresses.append(address)
            places.append(i)
        return views, addresses, places, error

    def publish(self, jobs: list[list[Any]]) -> tuple[list[int], str | None]:
        """Publish each job's pages with its proof: a result per job, and why any failed."""
        assert self.store is not None and self.maps is not None
        results = [FAILED] * len(jobs)
        views, addresses, places, error = self._mapped(jobs)
        names = [jobs[i][0] for i in places]
        sizes = [jobs[i][3] for i in places]
        sums: list[int] = []
        computed = checksums(views).tolist() if views else []
        for view in views:
            view.release()
        keep = []
        for j, i in enumerate(places):
            stated = jobs[i][4]
            if stated and stated != computed[j]:
                results[i] = REFUSED  # the writer's checksum does not match its pages
                continue
            keep.append(j)
            sums.append(computed[j])
        if not keep:
            return results, error
        codes = self.store.batch_put_from(
            [names[j] for j in keep], [addresses[j] for j in keep], [sizes[j] for j in keep]
        )
        put = [(j, s) for j, s, rc in zip(keep, sums, codes) if rc == 0]
        if len(put) < len(keep):
            error = f"Mooncake batch_put_from: {sorted(set(codes) - {0})}"
        if put:
            rc = self.store.put_batch(
                [proof_name(names[j]) for j, _ in put],
                [encode_proof(names[j], sizes[j], s) for j, s in put],
            )
            if rc != 0:
                return results, f"Mooncake put_batch of proofs: {rc}"
            for j, _ in put:
                results[places[j]] = PUBLISHED
        return results, error

    def probe(self, names: list[str]) -> tuple[list[list[int] | None], str | None]:
        """Each object's proof as [length, maru64], or None where the cluster has none (or
        not a valid one for that name)."""
        assert self.store is not None
        try:
            proofs = self.store.get_batch([proof_name(n) for n in names])
        except RuntimeError as exc:  # (pybind11's translation of a C++ error)
            return [None] * len(names), f"Mooncake get_batch of proofs: {exc}"
        out = [decode_proof(n, bytes(p)) if p else None for n, p in zip(names, proofs)]
        return [list(p) if p is not None else None for p in out], None

    def pull(self, jobs: list[list[Any]]) -> tuple[list[int], str | None]:
        """Read each job's object straight into its pool pages (reserved by the server,
        registered by nobody yet) and prove it: PUBLISHED where the bytes have the length and
        maru64 of the proof, REFUSED where they do not, FAILED where Mooncake failed."""
        assert self.store is not None and self.maps is not None
        results = [FAILED] * len(jobs)
        views, addresses, places, error = self._mapped(jobs)
        if not places:
            return results, error
        codes = self.store.batch_get_into(
            [jobs[i][0] for i in places], addresses, [jobs[i][3] for i in places]
        )
        computed = checksums(views).tolist()
        for view in views:
            view.release()
        for j, i in enumerate(places):
            _, _, _, length, stated = jobs[i]
            if codes[j] < 0:
                error = f"Mooncake batch_get_into: {codes[j]}"
            elif codes[j] == length and computed[j] == stated:
                results[i] = PUBLISHED
            else:
                results[i] = REFUSED  # another length, or bytes unlike their proof
        return results, error

    def check(self) -> bool:
        """Whether the master answers now (Mooncake's `health_check`, which blocks for
        seconds while it is gone): the server learns each change (a "state" message), so
        lookups turn into misses at once while the cluster is away, and come back with it
        (Mooncake's client reconnects by itself once its master is back)."""
        assert self.store is not None
        try:
            rc = self.store.health_check()
        except RuntimeError as exc:  # (pybind11's translation of a C++ error)
            rc, why = -1, str(exc)
        else:
            why = {1: "client closed", 2: "master unreachable"}.get(rc, f"code {rc}")
        error = None
        if rc != 0:
            error = f"Mooncake master {self.config.master_server_address}: {why}"
        if error != self.error:
            if error:
                log.warning("%s", error)
            else:
                log.info("Mooncake master %s answers again", self.config.master_server_address)
            self.error = error
            self.send({"op": "state", "connected": error is None, "error": error})
        return error is None

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        next_try = next_check = 0.0
        while True:
            now = time.monotonic()
            if self.store is None and now >= next_try:
                connected = self.connect()
                self.send({"op": "state", "connected": connected, "error": self.error})
                next_try = time.monotonic() + SETUP_RETRY_S
                next_check = time.monotonic() + CHECK_S
            elif self.store is not None and now >= next_check:
                self.check()
                next_check = time.monotonic() + CHECK_S
            if not poller.poll(200):
                continue
            message = msgpack.unpackb(self.sock.recv(), raw=False)
            op = message.get("op")
            if op == "stop":
                return
            work = {"publish": self.publish, "probe": self.probe, "pull": self.pull}.get(op)
            if work is not None:
                jobs = message["jobs"]
                if self.store is None:
                    results, error = [FAILED] * len(jobs), self.error
                else:
                    results, error = work(jobs)
                reply = {"op": f"{op}-done", "batch": message["batch"], "results": results}
                self.send({**reply, "error": error})
                if error is not None and self.store is not None:
                    next_check = 0.0  # a call failed: is the master still there?


def _die_with_parent() -> None:
    """SIGKILL when maru-server exits, however it exits (prctl PR_SET_PDEATHSIG)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the parent was gone before the prctl
        sys.exit(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="maru-cluster-sidecar")
    parser.add_argument("--config", required=True)
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--device-bytes", type=int, default=0, help="to map of a devdax pool")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s cluster-sidecar: %(message)s"
    )
    _die_with_parent()
    sock = zmq.Context.instance().socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(args.endpoint)
    Sidecar(MooncakeConfig.from_file(args.config), sock, args.device_bytes).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
