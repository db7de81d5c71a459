"""A handler's side of the server's cluster tier: a miss is not final while the tier may pull
the key. The handler asks once (EXISTS with "pull" and "wait_ms", the budget HANDSHAKE
announced), answered when the pulls land or the wait ends; a pull past the budget, or a failed
request, is a miss, never an error. Without a tier, nothing here sends.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from maru.client.localindex import Prefix, joined
from maru.common.errors import MaruError
from maru.common.protocol import Key, MsgType

log = logging.getLogger(__name__)

POLL_S = 0.002  # between two asks while pulls are on their way (a server that does not wait)
REPLY_SLACK_MS = 2000  # a kept EXISTS's reply may come this long after the wait it asked for

Request = Callable[[MsgType, dict[str, Any]], Any]
PerKey = Callable[[MsgType, Sequence[Key], Callable[[Any], bool]], list[bool]]


class ClusterPulls:
    """The handler's existence answers (`batch_exists`, `leading_hits`) and the pulls its
    lookups and reads wait for, within the budget the server announced."""

    def __init__(self, request: Request, per_key: PerKey):
        self.request = request  # the handler's, as its instance
        self.per_key = per_key  # the handler's one EXISTS of a batch, as it always asked
        self.budget_s = 0.0  # 0: no tier behind the pool (or one that waits for nothing)

    def handshake(self, reply: dict[str, Any]) -> None:
        """What HANDSHAKE said of the tier ("cluster": {"lookup_ms": N} or None)."""
        tier = reply.get("cluster")
        ms = tier.get("lookup_ms") if isinstance(tier, dict) else None
        self.budget_s = ms / 1000 if type(ms) is int and 0 < ms <= 60_000 else 0.0

    def pull(self, keys: Sequence[Key], prefix: Prefix, index: Any) -> None:
        """Before a lookup or a read: pull the misses within the budget. `index`: the local
        index, to tell the misses (None: the server is asked)."""
        if self.budget_s:
            self.fill(keys, prefix, index.exists(keys, prefix) if index is not None else None)

    def exists(self, keys: Sequence[Key], prefix: Prefix, found: list[bool] | None) -> list[bool]:
        """Whether each key is registered, as `found` by the local index (None: not known,
        the server is asked), with the misses pulled within the budget."""
        if found is None:
            found = self.per_key(MsgType.EXISTS, joined(keys, prefix), bool)
        return self.fill(keys, prefix, found)

    def leading(self, keys: Sequence[Key], prefix: Prefix, counted: int | None) -> int:
        """How many of `keys` from the start are registered, `counted` of them by the local
        index (None: not known, the server is asked), with the misses pulled."""
        if counted is None:
            found = self.exists(keys, prefix, None)
        elif counted == len(keys) or not self.budget_s:
            return counted
        else:
            found = self.fill(keys, prefix, [i < counted for i in range(len(keys))])
        return next((i for i, hit in enumerate(found) if not hit), len(found))

    def fill(self, keys: Sequence[Key], prefix: Prefix, found: list[bool] | None) -> list[bool]:
        """`found` (per key, whether it hit; None: all missed) with the misses the tier pulled
        within the budget now hits."""
        found = [False] * len(keys) if found is None else found
        if not self.budget_s:  # (the usual case: no Python per key)
            return found
        missing = [i for i, hit in enumerate(found) if not hit]
        if not missing:
            return found
        names = joined(keys, prefix)
        out = list(found)
        for i, hit in zip(missing, self.wait([names[i] for i in missing])):
            out[i] = hit
        return out

    def wait(self, missing: Sequence[Key]) -> list[bool]:
        """Which of `missing` (keys with their prefixes) exist once the tier pulled what it
        could within the budget."""
        deadline = time.monotonic() + self.budget_s
        keys = list(missing)
        while True:
            wait_ms = int((deadline - time.monotonic()) * 1000)
            body = {"keys": keys, "pull": True, "wait_ms": max(1, wait_ms)}
            try:
                reply = self.request(MsgType.EXISTS, body).result(wait_ms + REPLY_SLACK_MS)
                found = [bool(hit) for hit in reply["results"]]
                if len(found) != len(keys):
                    raise ValueError(f"{len(found)} results for {len(keys)} keys")
                pulling = int(reply.get("pulling") or 0)
            except (MaruError, KeyError, TypeError, ValueError) as exc:
                log.warning("cluster pull of %d keys: %s; taken as misses", len(keys), exc)
                return [False] * len(keys)
            left = deadline - time.monotonic()
            if all(found) or not pulling or left <= 0:
                return found
            time.sleep(min(POLL_S, left))
