"""How a Maru key and its proof are named and laid out in Mooncake Store.

One Mooncake object per key, `object_name(tenant, key)`: the value's bytes, then a trailer
of `TRAILER_BYTES` (`encode_trailer`) that binds the object's name, the value's length and
its maru64. The tier publishes both from where they lie (the pool's pages and a trailer
slot) in one put, and pulls both in one get (the value straight into pool pages, the
trailer into a slot beside them); a reader trusts the bytes only when the trailer decodes
for that very name, states the length read, and the bytes have its maru64 (the first rule:
a wrong value is a miss, never a hit). Mooncake itself never checks the bytes it serves.

One object rather than a value and a proof beside it: a pull costs one read, and its length
comes from the master's metadata (the object's size) without a transfer.
"""

from __future__ import annotations

import hashlib
import struct

from maru.common.protocol import Key

# What the sidecar answers per value of a publish or a pull batch (REFUSED: the bytes do not
# match their checksum; ABSENT: the cluster holds no such object; LENGTH: the object's value
# is not of the length a pull guessed).
PUBLISHED, REFUSED, FAILED, ABSENT, LENGTH = 0, 1, 2, 3, 4

TRAILER_MAGIC = b"maru64t2"
_TRAILER = struct.Struct("<8sqq16s")  # magic, length, maru64, blake2b-128 of the object name
TRAILER_BYTES = _TRAILER.size


def object_name(tenant: str, key: Key) -> str:
    """Mooncake's (str) name for a Maru key of `tenant`: the tenant after its length (a
    tenant id may hold "/": without the length, tenant "t" and key "s/k" would be named as
    tenant "t/s" and key "k", and one tenant would read the other's values as proven), then
    str keys as they are and bytes keys in hex, tagged so that the two never meet. "maru3":
    the one-object format, named so."""
    kind, text = ("b", key.hex()) if isinstance(key, bytes) else ("s", key)
    return f"maru3/{len(tenant)}/{tenant}/{kind}/{text}"


def name_pattern(tenant: str, prefix: Key | None) -> str:
    """The regex (Mooncake's `remove_by_regex`: ECMAScript, searched anywhere in a name, so
    anchored) of exactly the names `object_name(tenant, key)` gives the keys starting with
    `prefix`: a str prefix's "s" names, a bytes prefix's "b" names (its hex starts theirs);
    None: every object of `tenant`, both kinds. Every character of the name's start taken
    literally (`regex_literal`): a key's "." or "(" never widens what is removed."""
    root = f"maru3/{len(tenant)}/{tenant}/"
    if prefix is not None:
        root = object_name(tenant, prefix)
    return "^" + regex_literal(root)


def regex_literal(text: str) -> str:
    """`text` as an ECMAScript regex matching exactly it: ASCII punctuation escaped by a
    backslash (an identity escape: always that character), control characters as \\xHH (a NUL
    or a newline literal in a pattern is read differently by regex engines), letters, digits
    and non-ASCII characters as they are (never special; an escaped letter would be a class
    such as \\d). Python's `re` reads the result alike."""
    out = []
    for ch in text:
        code = ord(ch)
        if code < 0x20 or code == 0x7F:
            out.append(f"\\x{code:02x}")
        elif code < 0x80 and not ch.isalnum():
            out.append("\\" + ch)
        else:
            out.append(ch)
    return "".join(out)


def value_length(object_size: int) -> int | None:
    """The value's length in an object of `object_size` bytes (None: too short to hold one
    and its trailer)."""
    length = object_size - TRAILER_BYTES
    return length if length > 0 else None


def encode_trailer(name: str, length: int, checksum: int) -> bytes:
    return _TRAILER.pack(TRAILER_MAGIC, length, checksum, _digest(name))


def decode_trailer(name: str, trailer: bytes) -> tuple[int, int] | None:
    """(length, maru64) that `trailer` states for the object `name`, or None when it is not
    a trailer, or is the trailer of another name."""
    if len(trailer) != TRAILER_BYTES:
        return None
    magic, length, checksum, digest = _TRAILER.unpack(trailer)
    if magic != TRAILER_MAGIC or digest != _digest(name) or length <= 0 or checksum == 0:
        return None
    return length, checksum


def _digest(name: str) -> bytes:
    return hashlib.blake2b(name.encode(), digest_size=16).digest()
