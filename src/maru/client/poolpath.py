"""Where this client maps the server's pool, and the proof that it is the pool.

On another host of a CXL pod the pool may appear under another path (`pool_path`). A path
naming another device, or a stale file of the same name, would serve foreign bytes as hits: so
after every HANDSHAKE, before anything is mapped, the client reads the pool's mark
(`maru.common.poolmark`) through the path it will map and compares it with the server's, and
the live count the server wrote beside it for this handshake: a copy of the pool holds the mark
but not a count written after it was copied.
The mark's pool key, which never crosses a socket, makes this instance's `pool_proof`: what
it shows to take a region.
"""

from __future__ import annotations

import hmac
import logging
import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from maru.client.coherence import Coherence, CoherenceUnavailable
from maru.common.errors import MaruConnectRefused, MaruError
from maru.common.poolmark import (
    MARK_BYTES,
    parse_mark,
    pool_proof,
    read_live_window,
    read_mark_window,
    server_proof,
)
from maru.common.protocol import MsgType

if TYPE_CHECKING:
    from maru.client.rpc import RpcClient
    from maru.common.config import MaruConfig

log = logging.getLogger(__name__)


class PoolMismatch(Exception):
    """What this client would map is not the server's pool (missing, another file, no
    mark): the message says which path and what differs."""


@dataclass(frozen=True)
class PoolPlace:
    """The server's path of its pool and where this host maps it. `directory`: an fsdax pool,
    a directory of region files (mapped under the same names in `local`). `proof`: the
    instance's `pool_proof` (`prove` made it from the mark's key), sent with each
    REQUEST_REGION."""

    server: str
    local: str
    directory: bool
    proof: str = ""

    def local_path(self, path: str) -> str:
        """Where to open a region handle's `path` (the server's) on this host."""
        if self.local == self.server:
            return path
        if not self.directory and path == self.server:
            return self.local
        if self.directory and os.path.dirname(path) == self.server:
            return os.path.join(self.local, os.path.basename(path))
        return path  # (not in the pool: the server names no such region)

    def local_index_path(self, path: str) -> str:
        """Where to open, on this host, the local index table the server names `path`: one
        beside a pool file (`<pool>.index.<n>`) is beside it here too, where the pool is mapped
        at another path (a container's mount of the pool's volume)."""
        beside = self.server + ".index."
        if self.local == self.server or self.directory or not path.startswith(beside):
            return path
        return self.local + path[len(self.server) :]


def prove(
    pool: dict[str, Any], configured: str | None, instance_id: str = "", nonce: str | None = None
) -> PoolPlace:
    """The place to map the pool of a HANDSHAKE reply's `pool` map at, once its mark, read
    through that place, is the one the server says and the server has proven it holds the
    mark's pool key (its proof of the handshake's `nonce`; None: not checked, for tests that
    speak for a server), with `instance_id`'s proof of it; raises `PoolMismatch` otherwise."""
    server = str(pool.get("path", ""))
    mark = pool.get("mark") or {}
    place = PoolPlace(server, configured or server, pool.get("kind") == "fsdax")
    named = (
        f"pool_path {place.local}"
        if configured
        else f"the server's pool path {server} (pool_path unset)"
    )
    if not isinstance(mark, dict) or not mark:
        raise PoolMismatch(
            f"the server sends no pool mark to prove {named} by (a maru-server older than "
            "this client: upgrade them together)"
        )
    where = os.path.join(place.local, mark.get("file", "")) if mark.get("file") else place.local
    try:
        os.stat(place.local)
    except FileNotFoundError:
        raise PoolMismatch(f"{named} does not exist on this host") from None
    except OSError as exc:
        raise PoolMismatch(f"{named} cannot be reached ({exc.strerror or exc})") from None
    offset, span = mark.get("offset"), mark.get("span")
    try:
        if type(offset) is not int or type(span) is not int or offset < 0 or span < MARK_BYTES:
            raise ValueError(f"the server names no place for it: offset {offset!r}, span {span!r}")
        parsed = parse_mark(read_mark_window(where, offset, span))
        live, seen = mark.get("live"), None
        if type(live) is int and live > 0:
            seen = read_live_window(where, offset, span)
    except (OSError, ValueError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise PoolMismatch(
            f"cannot read the pool's mark at {where} through {named} ({why}): it cannot be "
            f"proven to be the server's pool {server}"
        ) from None
    expected = (str(mark.get("generation", "")), str(mark.get("epoch", "")))
    if parsed is None:
        raise PoolMismatch(
            f"{named} holds no pool mark at {where} (zeros or other bytes; the server's "
            f"pool {server} holds generation {expected[0]} epoch {expected[1]}): another "
            "file or device, not the server's pool"
        )
    generation, epoch, key = parsed
    if (generation, epoch) != expected:
        raise PoolMismatch(
            f"{named} holds the mark of generation {generation} epoch {epoch}, the server's "
            f"pool {server} generation {expected[0]} epoch {expected[1]}: a stale file or "
            "another server's pool, not the one this server serves"
        )
    if type(live) is int and live > 0 and (seen is None or seen < live):
        raise PoolMismatch(
            f"{named} holds the mark of the server's pool {server} but not what the server "
            f"wrote there for this handshake (live count {seen}, the server's {live}): a copy "
            "of the pool, its bytes frozen when it was copied, not the pool itself (what this "
            "host wrote there no other host would read)"
        )
    if not key:
        raise PoolMismatch(
            f"the mark at {where} through {named} holds no pool key (a maru-server older than "
            "this client wrote it: upgrade them together)"
        )
    if nonce is not None and not hmac.compare_digest(
        str(mark.get("proof", "")), server_proof(key, nonce)
    ):
        raise PoolMismatch(
            f"the process at this address cannot prove it holds the key in the mark of pool "
            f"{server}: it is not that pool's maru-server (a process that took the server's "
            "port while it was down?); nothing was sent to it"
        )
    if configured:
        log.info("pool %s is mapped at %s (its mark proves it)", server, place.local)
    return replace(place, proof=pool_proof(key, instance_id))


def prove_or_refuse(
    rpc: RpcClient, reply: dict[str, Any], config: MaruConfig, coherence: Coherence, nonce: str
) -> PoolPlace:
    """`prove` the pool of a HANDSHAKE `reply` (of a request with `nonce`) and `agree` on its
    coherence; on a mismatch (or software coherence on a CPU without cache-line flushes) end
    the instance the handshake made at once (best effort) and raise `MaruConnectRefused`
    saying why."""
    try:
        iid = str(reply.get("iid", ""))
        place = prove(reply.get("pool") or {}, config.pool_path, iid, nonce)
        coherence.agree(reply.get("coherence"), config.server_url)
        return place
    except (PoolMismatch, CoherenceUnavailable) as exc:
        ending = rpc.request(MsgType.DISCONNECT, {"session": reply["session"]})
        ending.retry = False
        try:
            ending.result()
        except MaruError as why:
            log.debug("ending the refused instance %s failed: %s", reply.get("iid"), why)
        raise MaruConnectRefused(config.server_url, str(exc)) from None
