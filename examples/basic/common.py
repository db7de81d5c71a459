"""What writer.py stores and reader.py expects: the same keys and bytes, derived from the key."""

from __future__ import annotations

import hashlib
import os
import sys

SIZES = [4096, 10_000, 65_536, 300_000, 1 << 20, 3 * (1 << 20) + 17]  # bytes
KEYS = [f"example/value-{i}-{size}" for i, size in enumerate(SIZES)]
ZERO_COPY_KEY = "example/zero-copy"
ZERO_COPY_SIZE = 2 * (1 << 20) + 5


def value_for(key: str, size: int) -> bytes:
    """Deterministic pseudo-random bytes: the reader can check them without a copy."""
    return hashlib.shake_256(key.encode()).digest(size)


def server_url() -> str:
    if len(sys.argv) > 1:
        return sys.argv[1]
    return os.environ.get("MARU_SERVER_URL", "tcp://127.0.0.1:5555")
