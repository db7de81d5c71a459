"""Which clients a `maru-server --curve` talks to. With `--curve` alone, any client that knows
the server's public key completes the CURVE handshake (with a throwaway keypair); with
`--curve-clients PATH` its public key must also be on the allowlist (`read_allowlist`), proven
by its secret key (`curve_client_key`, from `maru curve-keypair NAME`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import zmq

log = logging.getLogger(__name__)

KEY_CHARS = 40  # a 32-byte CURVE key in Z85
_Z85 = frozenset(
    "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"
)


def is_key(text: str) -> bool:
    """Whether `text` is a CURVE key as Z85 text (40 characters of its alphabet)."""
    return len(text) == KEY_CHARS and set(text) <= _Z85


def write_keypair(prefix: Path) -> tuple[str, Path, Path]:
    """A new client keypair: `<prefix>.key` (the secret key, 0600, created only if absent)
    and `<prefix>.pub` (the public key). Returns (public key, secret file, public file)."""
    public, secret = zmq.curve_keypair()
    secret_path = prefix.with_name(prefix.name + ".key")
    public_path = prefix.with_name(prefix.name + ".pub")
    for path in (secret_path, public_path):
        if path.exists():
            raise FileExistsError(f"{path} exists: not overwritten (remove it, or pick a name)")
    fd = os.open(secret_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secret + b"\n")
    public_path.write_bytes(public + b"\n")
    return public.decode(), secret_path, public_path


def read_allowlist(location: Path) -> set[str]:
    """The client public keys at `location` (every `*.pub` of a directory, or one file): each
    line's first word (a note may follow), but for blank lines and comments ("#" as a word of
    its own, since Z85 has "#"). A line that is no key is a ValueError naming its file and line."""
    files = sorted(location.glob("*.pub")) if location.is_dir() else [location]
    keys = set()
    for path in files:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            words = line.split()
            if not words or words[0] == "#":
                continue
            text = words[0]
            if not is_key(text):
                raise ValueError(f"{path}:{number}: not a CURVE public key (40 Z85 characters)")
            keys.add(text)
    return keys


class ClientAllowlist:
    """The server's CURVE client check: at connect (`callback`, the ZAP provider) a key must be
    listed at `location`; on every TCP request (`revoked`) a key removed since is refused, as
    ZeroMQ keeps an authenticated connection open. Changed files are read again (`refresh`: no
    restart needed); a refused key is logged once per version of the list."""

    def __init__(self, location: Path):
        self.location = location
        self._lock = threading.Lock()  # (the ZAP thread asks; tests read `keys`)
        self._stamp: tuple[float, ...] = ()
        self._looked = 0.0  # when the files were last checked (monotonic)
        self._refused: set[tuple[str, str]] = set()
        self.keys = self._load()

    def _stamps(self) -> tuple[float, ...]:
        paths = [self.location, *self.location.glob("*.pub")] if self.location.is_dir() else []
        return tuple(p.stat().st_mtime_ns for p in (paths or [self.location]))

    def _load(self) -> set[str]:
        self._stamp = self._stamps()
        keys = read_allowlist(self.location)
        self._refused = set()  # each refusal is news again under a new list
        log.info("CURVE clients: %d key(s) allowed (%s)", len(keys), self.location)
        return keys

    def refresh(self, every: float = 0.0) -> None:
        """Read the list again if its files changed (an unreadable list keeps the last); not
        if it was looked at less than `every` seconds ago."""
        with self._lock:
            now = time.monotonic()
            if now < self._looked + every:
                return
            self._looked = now
            try:
                if self._stamps() != self._stamp:
                    self.keys = self._load()
            except (OSError, ValueError) as exc:  # keep the last good list
                log.error("CURVE clients: %s unreadable, last list kept: %s", self.location, exc)

    def _refuse(self, text: str, why: str) -> None:
        with self._lock:  # (once per key and reason: "not in" at a reconnect does not
            # hide "removed from" for the connection that stayed open, or the other way)
            if (text, why) in self._refused or len(self._refused) >= 1000:
                return
            self._refused.add((text, why))
        log.warning(
            "refused a CURVE client with key %s: %s --curve-clients %s", text, why, self.location
        )

    def callback(self, domain: str, key: bytes) -> bool:
        text = key.decode("ascii", "replace")
        self.refresh()
        allowed = text in self.keys
        if not allowed:
            self._refuse(text, "not in")
        return allowed

    def revoked(self, user_id: str | None) -> str | None:
        """Why a request from the client that authenticated as `user_id` (its Z85 public key,
        ZeroMQ's User-Id) is refused, or None if its key is still listed."""
        if user_id in self.keys:
            return None
        self._refuse(str(user_id), "removed from")
        return f"this client's CURVE key {user_id} was removed from the server's --curve-clients"
