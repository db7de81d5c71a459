"""How a Maru key and its proof are named and laid out in Mooncake Store.

A key's bytes go under `object_name(tenant, key)`; its proof under `proof_name(...)`: a
small value that binds the object's name, its length and its maru64 (`encode_proof`). A
reader (a pulling tier, or a test with a plain Mooncake client) trusts the bytes only when
the proof decodes for that very name and the bytes it read have that length and maru64 (the
first rule: a wrong value is a miss, never a hit). Mooncake itself never checks the bytes it
serves. The proof is published after the bytes, so a proof seen means its bytes were put.
"""

from __future__ import annotations

import hashlib
import struct

from maru.common.protocol import Key

# What the sidecar answers per value of a publish or a pull batch.
PUBLISHED, REFUSED, FAILED = 0, 1, 2  # (REFUSED: the bytes do not match their checksum)

PROOF_MAGIC = b"maru64p1"
_PROOF = struct.Struct("<8sqq16s")  # magic, length, maru64, blake2b-128 of the object name
PROOF_BYTES = _PROOF.size


def object_name(tenant: str, key: Key) -> str:
    """Mooncake's (str) name for a Maru key of `tenant`: str keys as they are, bytes keys in
    hex, tagged so that the two never meet."""
    if isinstance(key, bytes):
        return f"maru/{tenant}/b/{key.hex()}"
    return f"maru/{tenant}/s/{key}"


def proof_name(name: str) -> str:
    return f"{name}#maru64"


def encode_proof(name: str, length: int, checksum: int) -> bytes:
    return _PROOF.pack(PROOF_MAGIC, length, checksum, _digest(name))


def decode_proof(name: str, proof: bytes) -> tuple[int, int] | None:
    """(length, maru64) that `proof` states for the object `name`, or None when it is not a
    proof, or is the proof of another name."""
    if len(proof) != PROOF_BYTES:
        return None
    magic, length, checksum, digest = _PROOF.unpack(proof)
    if magic != PROOF_MAGIC or digest != _digest(name) or length <= 0 or checksum == 0:
        return None
    return length, checksum


def _digest(name: str) -> bytes:
    return hashlib.blake2b(name.encode(), digest_size=16).digest()
