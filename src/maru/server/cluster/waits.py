"""EXISTS requests kept until the cluster tier's pulls land (deferred replies): rather than
answer "still pulling" and be asked again every few milliseconds, the server answers on the
loop turn the request's last pull lands, or when its "wait_ms" ends. Nothing here blocks the
loop. A request whose client went away is answered into the void and forgotten by its
deadline at the latest; past MAX_WAITING, a request is answered at once (the client asks again).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from maru.common.protocol import Key

log = logging.getLogger(__name__)

MAX_WAITING = 4096  # requests kept at once; past it, answered at once

Exists = Callable[[list[Key]], list[bool]]


@dataclass(slots=True, eq=False)
class Waiting:
    """One kept EXISTS: its reply so far, the keys it waits for (and their indices in the
    reply), its deadline, and how to send the reply."""

    reply: dict[str, Any]
    keys: list[Key]
    index: list[int]
    deadline: float
    encode: Callable[[dict[str, Any]], bytes]
    send: Callable[[bytes], Any]


class PullWaits:
    """The EXISTS requests kept until the pulls they wait for land (`MaruService`)."""

    def __init__(self) -> None:
        self.waiting: list[Waiting] = []
        # kept_late: answered at their deadline with pulls still on their way
        self.counts = {"exists_kept": 0, "exists_kept_late": 0}

    def park(self, waiting: Waiting) -> bool:
        """Keep `waiting` until its pulls land or its deadline; False (answer it now) when
        too many wait already."""
        if len(self.waiting) >= MAX_WAITING:
            return False
        self.waiting.append(waiting)
        self.counts["exists_kept"] += 1
        return True

    def next_ms(self, now: float) -> int | None:
        """How long the loop may sleep before a deadline is due (None: nothing waits)."""
        if not self.waiting:
            return None
        return max(0, int((min(w.deadline for w in self.waiting) - now) * 1000) + 1)

    def settle(self, pulling: Collection[Key], exists: Exists, now: float | None = None) -> None:
        """Answer the kept requests none of whose keys is still `pulling`, and those whose
        deadline has passed, with which of their keys exist now."""
        if not self.waiting:
            return
        now = time.monotonic() if now is None else now
        kept: list[Waiting] = []
        for w in self.waiting:
            left = sum(1 for key in w.keys if key in pulling)
            if left and now < w.deadline:
                kept.append(w)
                continue
            results = w.reply["results"]
            for i, hit in zip(w.index, exists(w.keys)):
                results[i] = bool(hit)
            w.reply["pulling"] = left
            self.counts["exists_kept_late"] += left > 0
            try:
                w.send(w.encode(w.reply))
            except Exception:  # one client's reply never stops the loop
                log.exception("cluster tier: a kept EXISTS reply could not be sent")
        self.waiting = kept
