"""The cluster tier, server side: what maru-server's request loop does for it. The loop never
waits on Mooncake: it sends work to the sidecar (`maru.server.cluster.sidecar`) without
blocking and applies its replies when its socket is ready, like a client's request.

A value being published is held (leased without expiry: no eviction, no delete, so no page
reuse) until the sidecar's reply. A pulled value lands in the tier's own pages
(`maru.server.cluster.pages`) and is registered only once the sidecar has proven it
(`maru.server.cluster.proof`). Modes, retries and faults: docs/operations.md#cluster-tier.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import zmq

from maru.common.protocol import Key, RegisterStatus
from maru.server.cluster.config import MooncakeConfig
from maru.server.cluster.link import Link
from maru.server.cluster.pages import TierPages
from maru.server.cluster.proof import (
    ABSENT,
    FAILED,
    LENGTH,
    PUBLISHED,
    REFUSED,
    name_pattern,
    object_name,
)
from maru.server.journal import JournalWriteError
from maru.server.keyindex import KeyEntry, release_entries
from maru.server.registry import Registry

log = logging.getLogger("maru.server.cluster")

PUBLISH_MODES = ("write-through", "spill")
QUEUE_KEYS = 65536  # keys waiting to be published; past it new ones are dropped (counted)
BATCH_KEYS = 64  # keys per publish batch
IN_FLIGHT = 4  # batches sent and not answered
STALL_S = 30.0  # a batch unanswered this long: the sidecar is killed and started again
RESTART_S = 2.0  # the least time between two starts of the sidecar
REAP_S = 10.0  # how long `close` waits for a killed sidecar to be reaped, then sets it aside
# How long a failed pull's pages are not reused (`Lingering`): twice Mooncake's transfer wait
# (60 s), after which its transfer engine has given the transfer up.
DOUBT_S = 120.0
CHECK_S = 0.1  # how often the loop looks after the sidecar and the tier's pages
ABSENT_S = 1.0  # a key the cluster did not hold is not asked for again this long
RETRY_S = 0.5  # a publish Mooncake failed (a master or link back a moment ago) goes again then
RETRIES = 3  # times a value's publish goes again before it counts as failed
# A pull's and a publish's results, bound to their jobs: items each ([code, maru64 or length,
# job id], [code, job id]); a probe's, not (a wrong length is refused by the pull's proof).
BOUND = {"pull": 3, "publish": 2}
FAILURES = {REFUSED: "proof_failures", ABSENT: "pull_misses"}  # a pull's, counted (else failures)
COUNTS = (  # what the tier counts (`stats`, Prometheus)
    "published",
    "published_bytes",
    "publish_drops",
    "publish_failures",
    "publish_refused",
    "pulled",
    "pulled_bytes",
    "pull_misses",
    "pull_failures",
    "proof_failures",
    "sidecar_starts",
    "removed",
    "remove_failures",
)


@dataclass
class Batch:
    op: str  # "publish", "probe", "pull" or "remove"
    keys: list[Key]  # (a removal's: none, its `patterns` instead)
    held: list[KeyEntry] = field(default_factory=list)  # publish: leased until the reply
    nbytes: list[int] = field(default_factory=list)  # publish, pull: each value's length
    places: list[tuple[int, int]] = field(default_factory=list)  # pull: (region id, offset)
    spill: bool = False  # publish: evicted keys, dropped once published
    room_for: str = ""  # spill: the instance whose room they are (an eviction ahead), if one
    patterns: list[str] = field(default_factory=list)  # remove: the names' regexes, a job each
    sent: float = field(default_factory=time.monotonic)


def landing(*batches: Iterable[Batch]) -> set[int]:
    """The regions pulls in flight are landing in (their pages not registered yet)."""
    return {place[0] for some in batches for b in some if b.op == "pull" for place in b.places}


def fits(batch: Batch, results: Any) -> bool:
    """Whether a reply's results (their job ids off: `unbind`) fit its batch: one per key
    (a removal's: per pattern), each in its op's form (a pull's [code, int], a probe's int or
    None, a publish's int, a removal's count or negative code), every int an int64."""
    jobs = len(batch.patterns) if batch.op == "remove" else len(batch.keys)
    if type(results) is not list or len(results) != jobs:
        return False
    if batch.op == "pull":
        return all(type(r) is list and len(r) == 2 and all(map(_int64, r)) for r in results)
    return all(_int64(r) or (r is None and batch.op == "probe") for r in results)


def batch_id(reply: dict[str, Any]) -> int:
    """The batch a reply answers (ValueError: not an int id; a bool's True would be batch 1)."""
    value = reply["batch"]
    if type(value) is not int:
        raise ValueError(f"a reply for batch {value!r}")
    return value


def numbered(first: int, op: str, jobs: list[Any]) -> list[Any]:
    """A batch's jobs, a pull's or a publish's each with its id last: the batch's id, then the
    next ones (`_send` counts batch ids in jobs), so that no two jobs the tier sends share
    one. The sidecar echoes it in the job's result (`unbind`)."""
    if op in BOUND:
        for n, job in enumerate(jobs):
            job.append(first + n)
    return jobs


def unbind(batches: dict[int, Batch], message: dict[str, Any]) -> dict[str, Any]:
    """A reply to a pull or a publish in flight, its results checked against the jobs sent:
    each must name its job's id, in the jobs' order; those ids taken off, what `_apply`
    applies. ValueError where one does not (results reordered, another batch's under this
    id, a stale reply): a broken channel, never a key registered with another job's result
    nor a hold released while the sidecar may still read its pages. No hashing: O(jobs)
    compares. Other messages (a state, a probe's reply, one for no batch) as they came."""
    if message["op"] == "state":
        return message
    first = batch_id(message)
    batch = batches.get(first)
    if batch is None or batch.op not in BOUND:
        return message
    results, width = message["results"], BOUND[batch.op]
    if type(results) is not list or not all(
        type(r) is list and len(r) == width and type(r[-1]) is int and r[-1] == first + n
        for n, r in enumerate(results)
    ):
        raise ValueError(f"{message['op']} results that do not answer batch {first}'s jobs")
    bare = [r[0] for r in results] if batch.op == "publish" else [r[:-1] for r in results]
    return {**message, "results": bare}


def outcome(result: list[int]) -> int:
    """A pull result's code, PUBLISHED only with a maru64: one is never 0, and 0 would
    register the key as stored without a checksum, its bytes never judged (REFUSED then)."""
    return REFUSED if result[0] == PUBLISHED and not result[1] else result[0]


def _int64(value: Any) -> bool:
    return type(value) is int and -(1 << 63) <= value < 1 << 63


def unspill(registry: Registry, batch: Batch) -> None:
    """A spill batch is over: its bytes no longer count as being evicted."""
    eviction, nbytes = registry.eviction, sum(batch.nbytes)
    eviction.spilling -= nbytes
    if batch.room_for:
        eviction.coming[batch.room_for] -= nbytes
        if eviction.coming[batch.room_for] <= 0:
            del eviction.coming[batch.room_for]


def drop_spilled(registry: Registry, batch: Batch) -> None:
    """Drop spilled keys once published (or failed); those a reader holds wait a later round."""
    unspill(registry, batch)
    keys, entries = [], []
    for key, entry in zip(batch.keys, batch.held):  # (`held`: the keys' entries, in order)
        if not entry.busy and registry.keys.get(key) is entry:
            keys.append(key)
            entries.append(entry)
    try:
        registry.eviction.view.drop_keys(keys, entries)
    except JournalWriteError as exc:
        log.error("cluster tier: %d spilled keys not dropped: %s", len(keys), exc)


class Lingering:
    """What a sidecar may still write or read after the tier is done with it: killed sidecars
    the kernel has not reaped yet (stuck in the kernel: D state), each with the batches it was
    sent, and the pages of pulls that failed. A killed sidecar's copies and transfer engine
    may touch its batches' pages until it is gone. A failed pull's transfer may not be over:
    Mooncake's wait for a transfer gives up after a timeout without cancelling it, and a
    failed part can end the wait while others go on, so its pages are not reused (a late
    write would change a value registered there since) until DOUBT_S has passed or its
    sidecar is gone. `landing` counts the regions of all of them."""

    def __init__(self) -> None:
        self.procs: list[tuple[subprocess.Popen, list[Batch]]] = []
        self.doubtful: list[Batch] = []  # failed pulls' pages, a Batch each (no keys)

    def doubt(self, place: tuple[int, int]) -> None:
        self.doubtful.append(Batch("pull", [], places=[place]))

    def stop(self, proc: subprocess.Popen | None, batches: list[Batch]) -> list[Batch]:
        """SIGKILL `proc` (if any) and reap it: `batches` and the failed pulls' pages to
        release now, once it is gone, else none (logged: set aside with them)."""
        batches, self.doubtful = batches + self.doubtful, []
        if proc is None:
            return batches
        proc.kill()
        try:
            proc.wait(REAP_S)
        except subprocess.TimeoutExpired:
            log.error(
                "cluster tier: sidecar %d not reaped %.0f s after SIGKILL: the pages of its %d "
                "batches stay held until it is",
                proc.pid,
                REAP_S,
                len(batches),
            )
            self.procs.append((proc, batches))
            return []
        return batches

    def reaped(self, now: float) -> list[Batch]:
        """The batches to release now: those of the sidecars reaped since the last call
        (`poll` reaps them), and failed pulls' pages doubted for DOUBT_S."""
        left, done = [], [b for b in self.doubtful if now - b.sent > DOUBT_S]
        self.doubtful = [b for b in self.doubtful if now - b.sent <= DOUBT_S]
        for proc, batches in self.procs:
            if proc.poll() is None:
                left.append((proc, batches))
            else:
                log.info("cluster tier: killed sidecar %d reaped at last", proc.pid)
                done += batches
        self.procs = left
        return done

    def __iter__(self) -> Iterator[Batch]:
        """The batches whose pages may still be touched."""
        yield from (batch for _, batches in self.procs for batch in batches)
        yield from self.doubtful


class Retries:
    """Write-through publishes Mooncake failed (a master or link back a moment ago), going
    again after RETRY_S, each at most RETRIES times, at most QUEUE_KEYS keys at once."""

    def __init__(self) -> None:
        self.due: deque[tuple[float, Key]] = deque()  # (when, key), oldest first
        self.tries: dict[Key, int] = {}

    def __len__(self) -> int:
        return len(self.due)

    def again(self, key: Key) -> bool:
        """Whether `key`'s failed publish goes again (False: it counts as failed)."""
        tries = self.tries.get(key, 0)
        if tries < RETRIES and len(self.tries) < QUEUE_KEYS:
            self.tries[key] = tries + 1
            self.due.append((time.monotonic() + RETRY_S, key))
            return True
        self.tries.pop(key, None)
        return False

    def done(self, key: Key) -> None:
        """`key` was published, refused, or is gone: no more tries."""
        self.tries.pop(key, None)

    def take(self, now: float, room: int) -> Iterator[Key]:
        """Up to `room` keys whose time to go again came."""
        while room > 0 and self.due and self.due[0][0] <= now:
            room -= 1
            yield self.due.popleft()[1]


class ClusterTier:
    def __init__(
        self,
        registry: Registry,
        config_path: str,
        *,
        publish: str = "write-through",
        lookup_ms: int = 200,
        log_level: str = "INFO",
        coherence: str = "hardware",
    ):
        """`config_path` is read now, so that a bad file stops maru-server at start
        (`ClusterConfigError`). `lookup_ms`: how long a client waits for a pull (announced at
        HANDSHAKE). The CLI's parser checks `publish` and `lookup_ms`. `coherence`:
        maru-server's `--coherence`, the sidecar's too (`maru.server.cluster.sidecar`)."""
        self.registry = registry
        self.config = MooncakeConfig.from_file(config_path)
        self.config_path = config_path
        self.publish_mode = publish
        self.lookup_ms = lookup_ms
        self.sidecar_flags = ["--log-level", log_level, "--coherence", coherence]
        self.lingering = Lingering()  # (pages a sidecar may write, beyond its batches')
        self.pages = TierPages(registry, lambda: landing(self.batches.values(), self.lingering))
        if publish == "spill":
            registry.eviction.spill = self.spill
        self.queue: deque[Key] = deque()  # to publish
        self.retry = Retries()  # write-through publishes Mooncake failed, to go again
        self.wanted: deque[Key] = deque()  # to probe, then pull
        self.guess = 0  # the last value's length: pulls go out with it, unprobed (0: probe)
        self.pulling: set[Key] = set()  # wanted, probed or being pulled
        self.absent: dict[Key, float] = {}  # not in the cluster: not asked until then
        self.batches: dict[int, Batch] = {}
        self.next_batch = 1
        self.connected = False
        self.error: str | None = "sidecar not started"
        self.last_failure: str | None = None  # the last failed batch's error
        self.counts = dict.fromkeys(COUNTS, 0)
        self.link: Link | None = None
        self.proc: subprocess.Popen | None = None
        self.started = self.checked = 0.0
        self.answered = 0.0  # when the sidecar last answered a batch (`housekeeping`'s stall)
        self.start()

    # -- the sidecar -------------------------------------------------------------------------

    def start(self) -> None:
        """A fresh channel and sidecar (the old ones closed: an old reply is never taken for a
        new one's). One that cannot start (no descriptor, no memory) is logged, and started
        again by `housekeeping`: the server goes on without it."""
        self.close()
        self.started = time.monotonic()
        cmd = [sys.executable, "-m", "maru.server.cluster.sidecar"]
        cmd += ["--device-bytes", str(self.registry.pool.file_bytes)]
        cmd += ["--pool-file", self.registry.pool.path, "--config", self.config_path]
        try:
            self.link, theirs = Link.pair()
            with theirs:  # (the sidecar's end, open in the sidecar alone once it started)
                fds = [theirs.fileno()]
                cmd += ["--fd", str(fds[0]), *self.sidecar_flags]
                self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, pass_fds=fds)
        except OSError as exc:
            self.error = f"sidecar not started: {exc}"
            log.error("cluster tier: %s; trying again in %.0f s", self.error, RESTART_S)
            self.close()
            return
        self.counts["sidecar_starts"] += 1
        self.error = "connecting"
        log.info("cluster tier: sidecar %d started (Mooncake %s)", self.proc.pid, self.config_path)

    def close(self) -> None:
        """Stop the sidecar (SIGKILL, reaped), then release what its batches held (readers
        miss at once): only once it is gone (`Lingering`) can nothing touch their pages."""
        self.connected = False
        if self.link is not None:
            self.link.close()
            self.link = None
        proc, batches = self.proc, list(self.batches.values())
        self.proc = None
        self.batches.clear()
        self.pulling.difference_update(k for b in batches if b.op != "publish" for k in b.keys)
        self._fail(self.lingering.stop(proc, batches), "the sidecar stopped")

    def attach(self, poller: zmq.Poller) -> None:
        """The loop polls the sidecar's channel with its own sockets (`Link.watch`)."""
        if self.link is not None:
            self.link.watch(poller)

    def housekeeping(self, poller: zmq.Poller, now: float) -> None:
        """At most every CHECK_S: keep the tier's instance alive, take its freed pages back,
        and start again (at most every RESTART_S) a sidecar that exited, stalled or broke its
        channel."""
        if now - self.checked < CHECK_S:
            return
        self.checked = now
        self.pages.touch()
        self.pages.take_freed()
        self._fail(self.lingering.reaped(now), "its sidecar was reaped")
        if self.retry:  # (failed publishes whose time to go again came)
            self.pump()
        proc = self.proc
        # (the sidecar answers in order: a batch's wait counts from its send or the last answer)
        stalled = any(now - max(b.sent, self.answered) > STALL_S for b in self.batches.values())
        running = proc is not None and proc.poll() is None
        broken = self.link is None or self.link.closed
        if (running and not stalled and not broken) or now - self.started < RESTART_S:
            return
        why = "stalled" if stalled else "closed its channel"
        if not running:
            why = f"exited with status {proc.returncode}" if proc else "not running"
        log.error("cluster tier: sidecar %s; starting it again", why)
        if self.link is not None:  # (no longer watched)
            self.link.close()
            self.link.watch(poller)
        self.start()
        self.attach(poller)

    # -- the loop's side ---------------------------------------------------------------------

    def sealed(self, keys: list[Key], statuses: list[int], registered: int) -> None:
        """REGISTER_KV's keys whose status is `registered` go to the publish queue
        (write-through; with spill, keys are published when evicted)."""
        if self.publish_mode != "write-through":
            return
        room = max(QUEUE_KEYS - len(self.queue), 0)
        new = [k for k, s in zip(keys, statuses) if s == registered]
        if len(new) > room:
            self.counts["publish_drops"] += len(new) - room
            new = new[:room]
        self.queue.extend(new)
        self.pump()

    def spill(
        self, keys: list[Key], entries: list[KeyEntry], hold: bool, room_for: str
    ) -> tuple[list, list]:
        """An eviction's victims (`Eviction.spill`). With `hold` (a watermark round, or one
        asked ahead for `room_for`'s next writes: nobody waits on it), those the tier can
        publish now stay registered and held (no copy: nothing can write their pages before
        the publish) until the sidecar has read them, then are dropped. Returns the victims
        to drop now: all when the tier cannot take them or a writer waits for their room
        (counted as drops), else those it pulled (already in the cluster)."""
        pulled = self.pages.pulled_into
        mine = [i for i, e in enumerate(entries) if not pulled(e.region_id)]
        if not (hold and self.connected and len(self.batches) < IN_FLIGHT):
            self.counts["publish_drops"] += len(mine)
            return keys, entries
        held: set[int] = set()  # (in batches: one of a round could outgrow the frame, STALL_S)
        for at in range(0, len(mine), BATCH_KEYS):
            part = mine[at : at + BATCH_KEYS]
            sent = self._publish([keys[i] for i in part], True, room_for)
            held.update(part if sent else ())
            if sent is None:  # (False: `_publish` counted them)
                self.counts["publish_drops"] += len(part)
        now = [i for i in range(len(keys)) if i not in held]
        return [keys[i] for i in now], [entries[i] for i in now]

    def want(self, missing: list[Key]) -> int:
        """Pull the missed keys the cluster may hold; returns how many are being pulled (0
        while the sidecar is not connected or sits on a lookup past the clients' budget, so
        readers miss at once rather than each wait the budget out)."""
        now, budget = time.monotonic(), self.lookup_ms / 1000
        late = any(b.op != "publish" and now - b.sent > budget for b in self.batches.values())
        if not self.connected or late:
            return 0
        absent, pulling = self.absent, self.pulling
        if len(absent) > QUEUE_KEYS:
            self.absent = absent = {k: t for k, t in absent.items() if t > now}
        waiting = 0
        for key in missing:
            if key in pulling:
                waiting += 1
            elif absent.get(key, 0.0) <= now and len(self.wanted) < QUEUE_KEYS:
                self.wanted.append(key)
                pulling.add(key)
                waiting += 1
        self.pump()
        return waiting

    def serve(self, events: dict, poller: zmq.Poller) -> None:
        """Every turn of the loop: apply every reply the sidecar has sent (each result bound
        to its job: `unbind`), send what waits, and watch the channel (`attach`)."""
        link = self.link
        if link is None:
            return
        link.flush()
        if link.ready(events):
            for message in link.receive():
                try:
                    self._apply(unbind(self.batches, message))
                except (ValueError, KeyError, TypeError) as exc:  # (applied in no part)
                    log.error("cluster tier: a bad reply from the sidecar (%s): restarting it", exc)
                    link.close()  # (broken: `housekeeping` starts it again)
                    break
            self.pump()
        link.watch(poller)

    def _apply(self, message: dict[str, Any]) -> None:
        op = message["op"]
        if op == "state":
            self.connected, self.error = bool(message["connected"]), message.get("error")
            return
        batch = self.batches.get(batch_id(message))
        if batch is None:  # (one failed already: ids are never reused; no sign of progress)
            return
        self.answered = time.monotonic()
        if op != f"{batch.op}-done" or not fits(batch, message["results"]):
            raise ValueError(f"{op} results that do not fit batch {message['batch']}")
        del self.batches[message["batch"]]
        if message.get("error"):
            self.last_failure = message["error"]
            log.warning("cluster tier: %s: %s", batch.op, message["error"])
        done = {"publish": self._published, "probe": self._probed, "pull": self._pulled}
        done["remove"] = lambda _, results: removal_answered(self.counts, results)
        done[batch.op](batch, message["results"])

    def _published(self, batch: Batch, results: list[int]) -> None:
        release_entries(batch.held)
        if batch.spill:
            drop_spilled(self.registry, batch)
        counts = self.counts
        for key, nbytes, result in zip(batch.keys, batch.nbytes, results):
            if result == PUBLISHED:
                counts["published"] += 1
                counts["published_bytes"] += nbytes
                self.guess = nbytes
                self.retry.done(key)
            elif result == REFUSED:
                counts["publish_refused"] += 1
                self.retry.done(key)
            elif batch.spill or not self.retry.again(key):  # (write-through goes again)
                counts["publish_failures"] += 1
        if REFUSED in results:
            log.error(
                "cluster tier: %d values' pages do not match their writer's checksum: not "
                "published",
                results.count(REFUSED),
            )

    def _probed(self, batch: Batch, lengths: list[Any]) -> None:
        """Pull the keys the cluster holds (each value's length, from the master)."""
        absent_until = time.monotonic() + ABSENT_S
        found = [(k, n) for k, n in zip(batch.keys, lengths) if type(n) is int and n > 0]
        for key in set(batch.keys).difference(k for k, _ in found):
            self.counts["pull_misses"] += 1
            self.absent[key] = absent_until
            self.pulling.discard(key)
        self._pull(found, guessed=False)

    def _pull(self, wanted: list[tuple[Key, int]], guessed: bool) -> None:
        """Reserve pages for each (key, length) and pull them (`guessed`: lengths not probed)."""
        jobs, pull = [], Batch("pull", [])
        no_room = 1 << 62  # the least length found no room in this batch: not asked again
        for key, length in wanted:
            place = None
            if key not in self.registry.keys and length < no_room:
                place = self.pages.reserve(length)
                no_room = length if place is None else no_room
            if place is None:  # stored here meanwhile, or no room (a miss: its readers stop
                self.pulling.discard(key)  # waiting, and do not ask again at once)
                self.absent[key] = time.monotonic() + ABSENT_S
                continue
            region_id, offset, path, file_offset = place
            name = object_name(self.config.tenant_id, key)
            jobs.append([name, path, file_offset, length, guessed])
            pull.keys.append(key)
            pull.nbytes.append(length)
            pull.places.append((region_id, offset))
            self.guess = length
        if jobs and not self._send(pull, jobs):
            self._undo_pull(pull)
            self.counts["pull_failures"] += len(pull.keys)
        elif jobs:  # (while the sidecar pulls: room for the next batch, ahead)
            self.pages.ready(sum(pull.nbytes))

    def _pulled(self, batch: Batch, proven: list[Any]) -> None:
        """Register the values proven in their pages (with their proven maru64); free the
        pages of the others."""
        counts, pages = self.counts, self.pages
        results = [outcome(p) for p in proven]
        for i, result in enumerate(results):  # (found with the length pulled: no misfit, the
            if result == LENGTH and proven[i][1] == batch.nbytes[i]:  # transfer itself failed
                results[i] = FAILED  # and may still land: its pages doubted)
        good = [i for i, result in enumerate(results) if result == PUBLISHED]
        absent_until = time.monotonic() + ABSENT_S
        again: list[tuple[Key, int]] = []  # a guessed length that was not the value's
        for i, result in enumerate(results):
            if result == PUBLISHED:
                continue
            if result in (ABSENT, LENGTH):  # (found no object of that length: no transfer)
                pages.release(*batch.places[i])
            else:  # (a transfer that failed may go on)
                self.lingering.doubt(batch.places[i])
            key, length = batch.keys[i], proven[i][1] if result == LENGTH else 0
            if type(length) is int and length > 0:
                again.append((key, length))
                continue
            counts[FAILURES.get(result, "pull_failures")] += 1
            self.absent[key] = absent_until  # (not asked again at once: a reader's every ask)
        if REFUSED in results:
            log.error(
                "cluster tier: %d pulled values do not match their proof: dropped, not registered",
                results.count(REFUSED),
            )
        self.pulling.difference_update(batch.keys)
        if again:  # (pulled again, into pages of their length)
            self.pulling.update(key for key, _ in again)
            self._pull(again, guessed=False)
        if not good:
            return
        keys = [batch.keys[i] for i in good]
        columns = [[batch.places[i][0] for i in good], [batch.places[i][1] for i in good]]
        lengths, sums = [batch.nbytes[i] for i in good], [proven[i][1] for i in good]
        try:
            statuses = self.registry.register(self.pages.instance_id, keys, *columns, lengths, sums)
        except JournalWriteError as exc:
            log.error("cluster tier: %d pulled values not registered: %s", len(keys), exc)
            statuses = [RegisterStatus.REJECTED] * len(keys)
        for i, status in zip(good, statuses):
            if status == RegisterStatus.REGISTERED:
                counts["pulled"] += 1
                counts["pulled_bytes"] += batch.nbytes[i]
            else:  # stored here meanwhile (the first writer wins), or refused
                pages.release(*batch.places[i])

    def pump(self) -> None:
        """Send batches while the sidecar is connected and has room (never blocks): probes
        first (a reader waits on them), then publishes."""
        while self.wanted and self.connected and len(self.batches) < IN_FLIGHT:
            keys = [self.wanted.popleft() for _ in range(min(BATCH_KEYS, len(self.wanted)))]
            if self.guess:  # (a pull at once, its length guessed: one round trip, not two)
                self._pull([(key, self.guess) for key in keys], guessed=True)
                continue
            tenant = self.config.tenant_id
            if not self._send(Batch("probe", keys), [object_name(tenant, k) for k in keys]):
                self.pulling.difference_update(keys)
        now = time.monotonic()
        for key in self.retry.take(now, QUEUE_KEYS - len(self.queue)):
            if key in self.registry.keys:
                self.queue.append(key)
            else:  # (deleted or evicted meanwhile)
                self.retry.done(key)
        while self.queue and self.connected and len(self.batches) < IN_FLIGHT:
            keys = [self.queue.popleft() for _ in range(min(BATCH_KEYS, len(self.queue)))]
            if self._publish(keys) is False:
                return

    def clear(self, prefix: Key | None) -> bool:
        """Remove the cluster's objects of the keys starting with `prefix` (None: all of the
        tenant's), sent now behind every batch sent before: whether it was (`removal_sent`)."""
        pattern = name_pattern(self.config.tenant_id, prefix)
        sent = self.connected and self._send(Batch("remove", [], patterns=[pattern]), [pattern])
        return removal_sent(prefix, sent, self.connected, self.error)

    def _publish(self, keys: list[Key], spill: bool = False, room_for: str = "") -> bool | None:
        """Publish the registered ones of `keys`, each held until the reply: True once sent,
        None when none is registered, False (nothing held; counted as drops) when the sidecar
        cannot take it. `spill`: evicted keys (for `room_for`'s room, if given)."""
        held, rids, offsets, lengths, sums = self.registry.keys.lookup_columns(keys, True)
        if not held:
            return None  # deleted or evicted meanwhile: nothing to publish
        batch, jobs = Batch("publish", [], held, spill=spill, room_for=room_for), []
        regions, tenant = self.registry.regions, self.config.tenant_id
        columns = (memoryview(c).cast("q") for c in (rids, offsets, lengths, sums))
        for key, rid, offset, length, checksum in zip(keys, *columns):
            if rid:
                region = regions[rid]
                name = object_name(tenant, key)
                jobs.append([name, region.path, region.offset + offset, length, checksum])
                batch.keys.append(key)
                batch.nbytes.append(length)
        if not self._send(batch, jobs):
            release_entries(held)
            self.counts["publish_drops"] += len(batch.keys)
            return False
        if spill:  # (undone by `unspill`)
            eviction, nbytes = self.registry.eviction, sum(batch.nbytes)
            eviction.spilling += nbytes
            if room_for:
                eviction.coming[room_for] += nbytes
        return True

    def _send(self, batch: Batch, jobs: list[Any]) -> bool:
        """Send without blocking (False: the sidecar cannot take it now); id: its first job's."""
        batch_id, self.next_batch = self.next_batch, self.next_batch + max(len(jobs), 1)
        message = {"op": batch.op, "batch": batch_id, "jobs": numbered(batch_id, batch.op, jobs)}
        if self.link is None or not self.link.send(message):
            return False
        self.batches[batch_id] = batch
        return True

    def _undo_pull(self, batch: Batch) -> None:
        for place in batch.places:
            self.pages.release(*place)
        self.pulling.difference_update(batch.keys)

    def _fail(self, batches: list[Batch], why: str) -> None:
        """Release what `batches` held, no sidecar being able to touch their pages any more:
        publishes' holds (evicted keys: left registered, for a later round), pulls' pages."""
        for batch in batches:
            if batch.op == "publish":
                release_entries(batch.held)
                if batch.spill:
                    unspill(self.registry, batch)
                self.counts["publish_failures"] += len(batch.keys)
            else:  # (a removal's: Mooncake may have made it, not known)
                for place in batch.places:
                    self.pages.release(*place)
                self.counts["pull_failures"] += len(batch.keys) if batch.op == "pull" else 0
                self.counts["remove_failures"] += len(batch.patterns)
        if any(batch.keys or batch.patterns for batch in batches):  # (failed pulls' pages: none)
            log.warning("cluster tier: %d batches not finished: %s", len(batches), why)

    def announce(self) -> dict[str, Any]:
        """What HANDSHAKE tells clients: a miss may be pulled, within this budget."""
        return {"kind": "mooncake", "lookup_ms": self.lookup_ms}

    def stats(self) -> dict[str, Any]:
        """The tier in the server's `stats` document (`maru stats`, Prometheus)."""
        return tier_stats(self)


def tier_stats(tier: ClusterTier) -> dict[str, Any]:
    """`ClusterTier.stats`: its settings, its state and what it counted."""
    batches = list(tier.batches.values())
    return {
        "kind": "mooncake",
        "publish": tier.publish_mode,
        "lookup_ms": tier.lookup_ms,
        "master": tier.config.master_server_address,
        "connected": tier.connected,
        "error": tier.error,
        "last_failure": tier.last_failure,
        "instance": tier.pages.instance_id,
        "queue_depth": len(tier.queue) + len(tier.retry),  # (failed ones going again too)
        "pull_queue_depth": len(tier.wanted),
        "pulling": len(tier.pulling),
        "in_flight": sum(len(b.keys) for b in batches),
        "removing": sum(b.op == "remove" for b in batches),  # (clears' removals, a batch each)
        "sidecar_pid": tier.proc.pid if tier.proc is not None else None,
        **tier.counts,
    }


def removal_sent(prefix: Key | None, sent: bool, connected: bool, error: str | None) -> bool:
    """What became of a clear's removal (`ClusterTier.clear`), logged; returns `sent`. It
    removes the objects of the keys of `prefix` (or every object of the tier's tenant),
    values only the cluster holds too (spilled, published by other nodes). The sidecar
    answers batches in order: it removes what every publish sent before it put, and nothing
    a publish sent after it puts (a value sealed after the clear). Not sent while the sidecar
    is not connected (`error`: why) or its channel cannot take it."""
    what = "every key" if prefix is None else f"prefix {prefix!r:.200}"
    if sent:
        log.info("cluster tier: removing the cluster's objects of %s", what)
    else:
        why = "its channel is full or closed" if connected else error or "not connected"
        log.warning("cluster tier: %s not removed from the cluster: %s", what, why)
    return sent


def removal_answered(counts: dict[str, int], results: list[int]) -> None:
    """A clear's removal answered: the objects Mooncake removed (`removed`), or a failure
    (`remove_failures`; its error logged with the reply)."""
    removed = sum(n for n in results if n >= 0)
    failed = sum(1 for n in results if n < 0)
    counts["removed"] += removed
    counts["remove_failures"] += failed
    if failed:
        log.error("cluster tier: a clear's removal from the cluster failed: %s", results)
    else:
        log.info("cluster tier: %d objects removed from the cluster (a clear)", removed)
