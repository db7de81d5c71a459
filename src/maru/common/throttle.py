"""At most one log line per key every so often, for events that can repeat on every request
or every value under load (the server's refusals and evictions, a client's "no room")."""

from __future__ import annotations

import time


class Throttle:
    """At most one log line per key every `interval` seconds, for events that can repeat on
    every request under load; lines held back are counted in the next line of that key."""

    def __init__(self, interval: float = 10.0):
        self.interval = interval
        self._next: dict[object, float] = {}
        self._held: dict[object, int] = {}

    def allow(self, key: object, now: float | None = None) -> int | None:
        """None: do not log this one (it is counted). Otherwise log it, with the returned
        number of lines held back since the last one."""
        now = time.monotonic() if now is None else now
        if now < self._next.get(key, 0.0):
            self._held[key] = self._held.get(key, 0) + 1
            return None
        if len(self._next) > 4096:  # keys are instance ids, which come and go
            self._next = {k: t for k, t in self._next.items() if t > now}
        self._next[key] = now + self.interval
        return self._held.pop(key, 0)

    def note(self, held: int) -> str:
        """A suffix for the line: how many like it were not logged."""
        return f" (+{held} like it in the last {self.interval:g}s, not logged)" if held else ""
