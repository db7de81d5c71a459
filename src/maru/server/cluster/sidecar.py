"""The cluster tier's sidecar: the pool's one Mooncake Store client, a process of its own
because Mooncake's calls hold the GIL while they block (for seconds while the master is gone).
maru-server (`maru.server.cluster.tier.ClusterTier`) starts and supervises it and talks to it
over a socketpair it inherits (`maru.server.cluster.link`), msgpack messages:

    server -> sidecar  {"op": "publish", "batch": id, "jobs": [[name, path, offset, length,
                        maru64 or 0, job id], ...]}  (path, offset: the value's pool place)
                       {"op": "probe", "batch": id, "jobs": [name, ...]}
                       {"op": "pull", "batch": id, "jobs": [[name, path, offset, length,
                        guessed, job id], ...]}  (pages the server reserved for the value)
                       {"op": "remove", "batch": id, "jobs": [regex, ...]}  (a clear: the
                        objects whose names match, `maru.server.cluster.proof.name_pattern`)
    sidecar -> server  {"op": "state", "connected": bool, "error": str | None}  (after
                        each setup, and whenever the master stops or starts answering)
                       {"op": "<op>-done", "batch": id, "results": [one per job, in the
                        jobs' order, see `Sidecar.publish`, `probe`, `pull`], "error": str |
                        None}

A batch's id is its first job's, the job ids of the server's life never repeat, and each
pull or publish result names its job's id (a publish's [code, job id], a pull's [code,
maru64 or length, job id]), taken from the job its work was done for: the server applies
a result only to the job it answers (`maru.server.cluster.tier.unbind`), never to another
job of its batch, of another batch, or of one answered before.

The pool's files are mapped here and registered with Mooncake's transfer engine: no extra
copy either way. The one module under maru.server that loads `maru.common.checksum` (numpy);
maru-server never imports it.

Coherence (`--coherence`, maru-server's: docs/architecture.md "Coherence"): in software mode
the proof's hash (`checksums_at`) evicts every line of a value before it reads it. A publish
then hashes, and Mooncake sends, what a writer on another host of the pod wrote back to
memory, never a line this host cached earlier; a pull's pages, which Mooncake wrote here, are
written back by that eviction (a dirty line goes to memory first) and their proof is hashed
from memory, before the reply that has them registered: other hosts read them from memory,
and no dirty line of this host outlives their registration.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import mmap
import os
import select
import signal
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from maru.common.checksum import checksums_at
from maru.common.memcopy import CopyFaultError, faulted, guard_faults
from maru.common.populate import (
    MADV_POPULATE_WRITE,
    POPULATE_STEP,
    backed_extents,
    populate,
    populate_works,
)
from maru.server.cluster.config import MooncakeConfig
from maru.server.cluster.link import Link
from maru.server.cluster.mooncake import load_mooncake
from maru.server.cluster.proof import (
    ABSENT,
    FAILED,
    LENGTH,
    PUBLISHED,
    REFUSED,
    TRAILER_BYTES,
    decode_trailer,
    encode_trailer,
    value_length,
)

log = logging.getLogger("maru.server.cluster")

SETUP_RETRY_S = 2.0
CHECK_S = 1.0  # how often the sidecar asks whether the master answers (and after a failure)
LOCAL_BUFFER = 16 << 20  # Mooncake's own staging buffer (the zero-copy calls do not use it)
NOT_FOUND = -704  # Mooncake's OBJECT_NOT_FOUND
# Mooncake's code for buffers smaller than the object (refused before any transfer). Buffers
# larger than it are refused at submit with TRANSFER_FAIL (-800), the code of a transfer that
# failed on the way too: only the object's length, found to be another, tells them apart.
BUFFER_TOO_SMALL = -600
# A pull's proof is hashed on two threads past this many bytes: its reader waits for it, and
# with the transfer done the CPUs are free. Below it the helper's wake-up costs more than it
# saves (4 MiB: 0.29 ms on one thread, 0.46 on two; 64 MiB: 5.5 and 4.4). (A publish's is
# hashed on one thread: writers copy then.)
SPLIT_PROOF_BYTES = 8 << 20
JOB_ID = 5  # where a pull's or a publish's job holds its id (echoed in its result)
REMOVE_FAILED = -1  # a removal's result where no Mooncake client could make it (else its code)


class PoolMaps:
    """The pool's files, each mapped once and registered with Mooncake, their pages populated
    on a thread of their own so that a pull does not fault per page inside Mooncake's receive.
    A file no longer at its path (an fsdax region freed: its file unlinked) is let go
    (`forget_gone`): a mapping would keep its blocks allocated on the pool's filesystem."""

    def __init__(self, register: Any, device_bytes: int, unregister: Any = None):
        self.register = register  # MooncakeDistributedStore.register_buffer
        self.unregister = unregister  # ... and its unregister_buffer
        self.device_bytes = device_bytes  # what to map of a device (whose size fstat says 0)
        # path -> (mapping, address, the mapped file's (device, inode): `forget_gone`)
        self.maps: dict[str, tuple[mmap.mmap, int, tuple[int, int]]] = {}

    def address(self, path: str, offset: int, length: int) -> int:
        """The address of the pages at (path, offset, length) (ValueError outside the file)."""
        mm, address = self.mapped(path)
        if offset < 0 or length <= 0 or offset + length > len(mm):
            raise ValueError(f"{path}: [{offset}, +{length}) is outside its {len(mm)} bytes")
        return address + offset

    def mapped(self, path: str) -> tuple[mmap.mmap, int]:
        """The file's mapping and its address, mapped and registered on first use."""
        if path in self.maps:
            mm, address, _ = self.maps[path]
            return mm, address
        fd = os.open(path, os.O_RDWR)
        try:
            st = os.fstat(fd)
            mm = mmap.mmap(fd, st.st_size or self.device_bytes, mmap.MAP_SHARED)
            backed = backed_extents(fd, 0, len(mm))
        finally:
            os.close(fd)
        address = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        rc = self.register(address, len(mm))
        if rc != 0:
            raise OSError(f"Mooncake register_buffer of {path} ({len(mm)} bytes) failed: {rc}")
        log.info("pool file %s (%d bytes) registered with Mooncake", path, len(mm))
        if backed and populate_works():
            args = (path, address, backed)
            threading.Thread(target=_populate, args=args, name="populate", daemon=True).start()
        self.maps[path] = mm, address, (st.st_dev, st.st_ino)
        return mm, address

    def forget_gone(self) -> list[str]:
        """Unregister and unmap the files no longer at their path (or another file there now);
        the paths let go. No job is in flight on one: the server frees a region only once no
        key lives in it, and it holds what it publishes or pulls until the reply."""
        gone = []
        for path, (mm, address, identity) in list(self.maps.items()):
            try:
                st = os.stat(path)
                if (st.st_dev, st.st_ino) == identity:
                    continue
            except FileNotFoundError:
                pass
            del self.maps[path]
            if self.unregister is not None:
                self.unregister(address)
            try:
                mm.close()
            except BufferError:  # (a view still held: unmapped when it is collected)
                log.warning("pool file %s gone, but a view of it is still held", path)
            gone.append(path)
            log.info("pool file %s is gone: unregistered and unmapped", path)
        return gone


def proofs(addresses: list[int], lengths: list[int]) -> list[int]:
    """The maru64 of each value's pages, hashed under the copies' fault guard: 0 (never a
    maru64) for a value whose pages faulted (the pool's file truncated under it, its
    filesystem out of room), which then fails alone; the sidecar, its other values and the
    batches behind them go on. (Before, the fault's CopyFaultError went out of the batch and
    the sidecar exited.)"""
    at, sizes = np.array(addresses, np.int64), np.array(lengths, np.int64)
    out, todo = np.zeros(len(at), np.int64), np.arange(len(at))
    while len(todo):  # (each round drops one faulted value at least)
        try:
            out[todo] = checksums_at(at[todo], sizes[todo])
            break
        except CopyFaultError as exc:
            bad = faulted(exc)
            if len(bad) != len(todo):  # (no flags: all of them)
                log.error("pool pages of %d values faulted as they were hashed", len(todo))
                break
            log.error("pool pages of %d values faulted as they were hashed", int(bad.sum()))
            todo = todo[~bad]
    return out.tolist()


def failed(op: str, job: Any) -> Any:
    """A job's result, in its op's form, where it failed: a pull's [FAILED, 0, job id], a
    publish's [FAILED, job id], a probe's None (no length, never a bare code the server would
    take for one), a removal's REMOVE_FAILED (negative: never a count removed)."""
    if op == "probe":
        return None
    if op == "remove":
        return REMOVE_FAILED
    return [FAILED, 0, job[JOB_ID]] if op == "pull" else [FAILED, job[JOB_ID]]


def _populate(path: str, address: int, extents: list[tuple[int, int]]) -> None:
    """Map a pool file's pages in bulk, at the lowest priority (the call drops the GIL); after a
    refusal (logged) the pages fault in as they are touched."""
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    for start, end in extents:
        for at in range(start, end, POPULATE_STEP):
            code = populate(address + at, min(POPULATE_STEP, end - at), MADV_POPULATE_WRITE)
            if code:
                why = os.strerror(code)
                log.warning("pool file %s: pages not populated from %d: %s", path, at, why)
                return


class Sidecar:
    def __init__(self, config: MooncakeConfig, link: Link, device_bytes: int, pool_file: str = ""):
        self.config = config
        self.device_bytes = device_bytes
        self.pool_file = pool_file  # mapped (and populated) as soon as connected
        self.link = link
        self.module = load_mooncake()
        self.store: Any = None
        self.maps: PoolMaps | None = None
        self.trailers: np.ndarray | None = None  # registered slots for a batch's trailers
        self.error: str | None = "not connected yet"
        self.helper = ThreadPoolExecutor(1, "proof") if (os.cpu_count() or 1) > 1 else None

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
        guard_faults()  # (a handler Mooncake put in place would kill us for a guarded fault)
        self.maps = PoolMaps(store.register_buffer, self.device_bytes, store.unregister_buffer)
        log.info("connected to Mooncake master %s as %s", c.master_server_address, c.local_hostname)
        if self.pool_file:  # (its pages mapped before the first pull needs them)
            try:
                self.maps.mapped(self.pool_file)
            except OSError as exc:
                log.warning("pool file %s not mapped yet: %s", self.pool_file, exc)
        return True

    def send(self, message: dict[str, Any]) -> None:
        self.link.send(message)

    def _slots(self, n: int) -> tuple[np.ndarray, int]:
        """n trailer slots (rows of TRAILER_BYTES, `maru.server.cluster.proof`) in memory
        registered with Mooncake, and the first one's address (OSError when it is refused)."""
        assert self.store is not None
        if self.trailers is None or len(self.trailers) < n:
            buffer = np.zeros((max(n, 64), TRAILER_BYTES), np.uint8)
            rc = self.store.register_buffer(buffer.ctypes.data, buffer.nbytes)
            if rc != 0:
                raise OSError(f"Mooncake register_buffer of trailer slots failed: {rc}")
            if self.trailers is not None:
                self.store.unregister_buffer(self.trailers.ctypes.data)
            self.trailers = buffer
        return self.trailers[:n], self.trailers.ctypes.data

    def _mapped(self, jobs: list[list[Any]]) -> tuple[list[int], list[int], str | None]:
        """Each job's pool pages (name, path, offset, length, ...): their addresses, the
        jobs they belong to, and why any could not be mapped."""
        assert self.maps is not None
        addresses, places, error = [], [], None
        for i, (_, path, offset, length, *_rest) in enumerate(jobs):
            try:
                addresses.append(self.maps.address(path, offset, length))
            except (OSError, ValueError) as exc:
                error = str(exc)
                continue
            places.append(i)
        return addresses, places, error

    def publish(self, jobs: list[list[Any]]) -> tuple[list[list[int]], str | None]:
        """Publish each job's pages and trailer (their maru64) as one object: per job PUBLISHED,
        REFUSED (a writer's checksum unlike its pages) or FAILED, with the job's id; and why
        any failed. (Each id is the one of the job whose pages were read: `ids[j]`.)"""
        assert self.store is not None
        results = [failed("publish", job) for job in jobs]
        addresses, places, error = self._mapped(jobs)
        ids = [jobs[i][JOB_ID] for i in places]
        computed = proofs(addresses, [jobs[i][3] for i in places])
        for j, i in enumerate(places):
            if not computed[j]:  # (its pages faulted: Mooncake's read of them would too)
                error = error or "pool pages faulted as they were hashed"
            elif jobs[i][4] and jobs[i][4] != computed[j]:
                results[i] = [REFUSED, ids[j]]  # the writer's checksum does not match its pages
        keep = [j for j, i in enumerate(places) if results[i][0] != REFUSED and computed[j]]
        if not keep:
            return results, error
        slots, base = self._slots(len(keep))
        names = [jobs[places[j]][0] for j in keep]
        buffers = [[addresses[j], base + n * TRAILER_BYTES] for n, j in enumerate(keep)]
        sizes = [[jobs[places[j]][3], TRAILER_BYTES] for j in keep]
        for n, j in enumerate(keep):
            slots[n] = np.frombuffer(encode_trailer(names[n], sizes[n][0], computed[j]), np.uint8)
        codes = self.store.batch_put_from_multi_buffers(names, buffers, sizes)
        for j, rc in zip(keep, codes):
            if rc == 0:
                results[places[j]] = [PUBLISHED, ids[j]]
        if any(rc != 0 for rc in codes):
            error = f"Mooncake batch_put_from_multi_buffers: {sorted(set(codes) - {0})}"
        return results, error

    def probe(self, names: list[str]) -> tuple[list[int | None], str | None]:
        """Each object's value length, from the master's metadata (no transfer), or None
        where the cluster holds no object of that name in memory (or one too short)."""
        assert self.store is not None
        try:
            found = self.store.batch_get_replica_desc(names)
        except RuntimeError as exc:  # (pybind11's translation of a C++ error)
            return [None] * len(names), f"Mooncake batch_get_replica_desc: {exc}"
        out: list[int | None] = []
        for name in names:
            sizes = [
                r.get_memory_descriptor().buffer_descriptor.size
                for r in found.get(name) or ()
                if r.is_memory_replica()
            ]
            out.append(value_length(sizes[0]) if sizes else None)
        return out, None

    def pull(self, jobs: list[list[Any]]) -> tuple[list[list[int]], str | None]:
        """Get each job's value into its reserved pool pages and its trailer into a slot, and
        prove it: [PUBLISHED, maru64] where the trailer is this name's and states the bytes'
        length and maru64, else [REFUSED, 0]; [ABSENT, 0] where the cluster lacks it;
        [FAILED, 0] where Mooncake failed or the pages faulted as they were hashed. A guessed
        length whose get failed is probed: [LENGTH, length] where the object has another
        length (the server pulls it again), [ABSENT, 0] where the buffers were refused as too
        small and the object is gone, else FAILED (the transfer may still land). Each with the
        job's id last: the one of the job whose name and pages the work used (`ids[j]`, beside
        `names[j]`)."""
        assert self.store is not None
        results = [failed("pull", job) for job in jobs]
        addresses, places, error = self._mapped(jobs)
        if not places:
            return results, error
        ids = [jobs[i][JOB_ID] for i in places]
        slots, base = self._slots(len(places))
        slots[:] = 0  # (a slot a failed get leaves alone never proves anything)
        buffers = [[a, base + n * TRAILER_BYTES] for n, a in enumerate(addresses)]
        sizes = [[jobs[i][3], TRAILER_BYTES] for i in places]
        names = [jobs[i][0] for i in places]
        codes = self.store.batch_get_into_multi_buffers(names, buffers, sizes)
        computed = self._checksums(addresses, [size for size, _ in sizes])
        misfits = []
        for j, i in enumerate(places):
            length = jobs[i][3]
            if codes[j] == NOT_FOUND:
                results[i] = [ABSENT, 0, ids[j]]
            elif codes[j] < 0 and jobs[i][4]:
                misfits.append((i, codes[j]))  # (a guessed length: the object may have another)
            elif codes[j] < 0:
                error = f"Mooncake batch_get_into_multi_buffers: {codes[j]}"
            elif not computed[j]:  # (its pages faulted as they were hashed: unproven)
                error = "pool pages faulted as they were hashed"
            else:
                stated = decode_trailer(names[j], slots[j].tobytes())
                ok = codes[j] == length + TRAILER_BYTES and stated == (length, computed[j])
                # (else: another length, name or format, or bytes unlike the trailer)
                results[i] = [PUBLISHED, computed[j], ids[j]] if ok else [REFUSED, 0, ids[j]]
        if misfits:
            lengths, why = self.probe([jobs[i][0] for i, _ in misfits])
            for (i, code), length in zip(misfits, lengths):
                # Nothing was transferred only where Mooncake refused the buffers: too small,
                # or the object has another length. A TRANSFER_FAIL for an object of the
                # guessed length (or one gone since) is a transfer that failed, and may still
                # land: FAILED, its pages doubted (`maru.server.cluster.tier.Lingering`).
                refused = code == BUFFER_TOO_SMALL
                if why is None and length is not None and length != jobs[i][3]:
                    results[i] = [LENGTH, length, jobs[i][JOB_ID]]
                elif why is None and length is None and refused:
                    results[i] = [ABSENT, 0, jobs[i][JOB_ID]]
                elif why is None:
                    error = error or f"Mooncake batch_get_into_multi_buffers: {code}"
            error = error or why
        return results, error

    def remove(self, patterns: list[str]) -> tuple[list[int], str | None]:
        """Remove the objects whose names match each pattern (a clear): per pattern the
        number Mooncake removed, or its negative error code; and why any failed. Not forced:
        Mooncake keeps an object a reader holds a lease on (one read in the master's
        `--default_kv_lease_ttl`, 10 s by default) or a put is still writing, as SGLang's own
        backend's `remove_all` does; it says how many it removed, not how many it kept."""
        assert self.store is not None
        results, error = [], None
        for pattern in patterns:
            try:
                removed = int(self.store.remove_by_regex(pattern))
            except RuntimeError as exc:  # (pybind11's translation of a C++ error)
                removed, error = REMOVE_FAILED, f"Mooncake remove_by_regex: {exc}"
            if removed < 0:
                error = error or f"Mooncake remove_by_regex: {removed}"
            results.append(removed)
        return results, error

    def _checksums(self, addresses: list[int], lengths: list[int]) -> list[int]:
        """`proofs` of each value's pages, half of the bytes on the helper thread when there
        are more than SPLIT_PROOF_BYTES (the C loop drops the GIL)."""
        sizes = np.array(lengths, np.int64)
        total = int(sizes.sum())
        if self.helper is None or total <= SPLIT_PROOF_BYTES or len(sizes) < 2:
            return proofs(addresses, lengths)
        split = min(int(np.searchsorted(np.cumsum(sizes), total // 2)) + 1, len(sizes) - 1)
        later = self.helper.submit(proofs, addresses[split:], lengths[split:])
        return proofs(addresses[:split], lengths[:split]) + later.result()

    def check(self) -> bool:
        """Whether the master answers now (`health_check` blocks while it is gone); each change
        goes to the server ("state"), so lookups miss at once while the cluster is away."""
        assert self.store is not None
        try:
            rc = self.store.health_check()
        except RuntimeError as exc:  # (pybind11's translation of a C++ error)
            rc, why = -1, str(exc)
        else:
            why = {1: "client closed", 2: "master unreachable"}.get(rc, f"code {rc}")
        error = f"Mooncake master {self.config.master_server_address}: {why}" if rc else None
        if error != self.error:
            if error:
                log.warning("%s", error)
            else:
                log.info("Mooncake master %s answers again", self.config.master_server_address)
            self.error = error
            self.send({"op": "state", "connected": error is None, "error": error})
        return error is None

    def run(self) -> None:
        """Serve the server's messages until it says "stop" or its end of the channel closes."""
        poller = select.poll()
        poller.register(self.link.fileno(), select.POLLIN)
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
                if self.maps is not None:
                    self.maps.forget_gone()
                next_check = time.monotonic() + CHECK_S
            if not poller.poll(200):
                continue
            for message in self.link.receive():
                if message.get("op") == "stop":
                    return
                reply = self.answer(message)
                if reply is not None:
                    self.send(reply)
                    if reply["error"] is not None and self.store is not None:
                        next_check = 0.0  # a call failed: is the master still there?
            if self.link.closed:
                log.info("maru-server closed the channel: stopping")
                return

    def answer(self, message: dict[str, Any]) -> dict[str, Any] | None:
        """The reply to a publish, probe, pull or remove batch (None: no such op). Without a
        Mooncake client (not set up yet), every job fails in its op's own form (`failed`).
        Batches are answered in the order they came: a removal sent after a publish removes
        what it published, never what is published after it."""
        op = message.get("op")
        ops = {"publish": self.publish, "probe": self.probe, "pull": self.pull}
        work = {**ops, "remove": self.remove}.get(op)
        if work is None:
            return None
        jobs = message["jobs"]
        if self.store is None:
            results, error = [failed(op, job) for job in jobs], self.error
        else:
            results, error = work(jobs)
        return {"op": f"{op}-done", "batch": message["batch"], "results": results, "error": error}


def apply_coherence(mode: str) -> None:
    """This process's copies and hashes in maru-server's coherence mode (see the module's
    docstring); OSError for software where the CPU has no cache-line flushes."""
    from maru.common._memcopy import coherence

    coherence(mode)


def _die_with_parent() -> None:
    """SIGKILL when maru-server exits, however it exits (prctl PR_SET_PDEATHSIG)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the parent was gone before the prctl
        sys.exit(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="maru-cluster-sidecar")
    parser.add_argument("--config", required=True)
    parser.add_argument("--fd", type=int, required=True, help="the channel's socket (inherited)")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--device-bytes", type=int, default=0, help="to map of a devdax pool")
    parser.add_argument("--pool-file", default="", help="the pool's file, mapped at connect")
    parser.add_argument(
        "--coherence",
        choices=("hardware", "software"),
        default="hardware",
        help="maru-server's --coherence: software flushes what the proofs read",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s cluster-sidecar: %(message)s"
    )
    _die_with_parent()
    try:
        apply_coherence(args.coherence)
    except OSError as exc:
        log.error("%s", exc)
        return 1
    link = Link(socket.socket(fileno=args.fd), blocking=True)
    config = MooncakeConfig.from_file(args.config)
    Sidecar(config, link, args.device_bytes, args.pool_file).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
