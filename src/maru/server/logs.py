"""Log setup for `maru-server`: one line per event, as text or as JSON (`--log-format json`,
whose fields docs/configuration.md lists)."""

from __future__ import annotations

import json
import logging
import sys
import time
from datetime import datetime, timezone
from typing import IO

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
EXTRA_FIELDS = ("instance", "region")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.fromtimestamp(record.created, tz=timezone.utc)
        out: dict[str, object] = {
            "ts": ts.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for name in EXTRA_FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                out[name] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False)


def configure_logging(
    level: str = "INFO", fmt: str = "text", stream: IO[str] | None = None
) -> None:
    """Replace the root logger's handlers with one writing `fmt` ("text" or "json") lines."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)


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
