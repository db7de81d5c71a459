"""Tokens the server signs with a secret only it knows (`secret.key` in its state dir, 0600, so
they stay valid across a restart).

- Region tokens: an HMAC over a region handle's fields and the pool's generation: a client can
  only present a token the server gave it, and a recreated pool's region never has the token
  (so the handle) of an earlier one, so its client maps it again.
- Session credentials: the server picks each instance's id at handshake (the client's name and
  a random suffix) and hands its process `session(instance_id)`, which every later request
  carries: identity is never a string a client picks. The credential embeds the id, so a
  restarted server verifies it (`session_owner`) without having kept it.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import secrets
from pathlib import Path

from maru.server.journal import write_private

SECRET_FILE = "secret.key"
CURVE_SECRET_FILE = "curve.key"  # the server's CURVE secret key (Z85), 0600
CURVE_PUBLIC_FILE = "curve.pub"  # its public key, for the operator to hand to clients


def load_or_create_secret(state_dir: Path) -> bytes:
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / SECRET_FILE
    with contextlib.suppress(FileNotFoundError):
        secret = path.read_bytes()
        if len(secret) >= 32:
            return secret
    secret = secrets.token_bytes(32)
    write_private(path, secret)
    return secret


def load_or_create_curve_keys(state_dir: Path) -> tuple[bytes, bytes]:
    """The server's CURVE keypair (public, secret; Z85), made on the first `--curve` start and
    kept, so clients keep working across restarts; the public key also goes to `curve.pub`."""
    import zmq  # only the server's CLI needs it here

    path = state_dir / CURVE_SECRET_FILE
    try:
        secret = path.read_bytes().strip()
        public = zmq.curve_public(secret)
    except (FileNotFoundError, ValueError, zmq.ZMQError):
        public, secret = zmq.curve_keypair()
        write_private(path, secret + b"\n")
    write_private(state_dir / CURVE_PUBLIC_FILE, public + b"\n")
    return public, secret


class TokenSigner:
    def __init__(self, secret: bytes, generation: str = ""):
        """`generation`: the pool's (`maru.server.state_dir.pool_generation`); "" for a pool
        recorded before generations existed, whose tokens are signed as they were then."""
        self._secret = secret
        self.generation = generation

    def sign(self, region_id: int, path: str, offset: int, length: int) -> str:
        msg = f"{region_id}|{path}|{offset}|{length}"
        if self.generation:
            msg += f"|{self.generation}"
        return hmac.new(self._secret, msg.encode(), hashlib.sha256).hexdigest()[:32]

    def session(self, instance_id: str) -> str:
        """The credential of `instance_id`: the id, "~", and an HMAC of it."""
        mac = hmac.new(self._secret, b"session|" + instance_id.encode(), hashlib.sha256)
        return f"{instance_id}~{mac.hexdigest()[:32]}"

    def session_owner(self, credential: object) -> str | None:
        """The instance id a credential was issued to, or None if this server did not issue it."""
        if not isinstance(credential, str) or not credential.isascii():
            return None
        instance_id, _, _ = credential.rpartition("~")
        if not instance_id or not hmac.compare_digest(credential, self.session(instance_id)):
            return None
        return instance_id

    def server_tag(self) -> str:
        """A short name for this server: the same across its restarts (same secret, same state
        dir), different for any other server. Reveals nothing about the secret."""
        return hmac.new(self._secret, b"maru-server-tag", hashlib.sha256).hexdigest()[:12]

    def verify(self, token: object, region_id: int, path: str, offset: int, length: int) -> bool:
        if not isinstance(token, str) or not token.isascii():
            return False  # (compare_digest raises TypeError on non-ASCII str)
        return hmac.compare_digest(token, self.sign(region_id, path, offset, length))
