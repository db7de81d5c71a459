"""Spin-waiting for a reply on a non-blocking socket: `recv_spin(fd, max_bytes, spin_ns)`.

The loop runs in C (`maru.client._busypoll`, built by `pip install -e .` when a compiler is
present) without the GIL, yielding the CPU between tries. Without the extension `recv_spin` is
None and the RPC client awaits replies in poll() only (round trips about 3x slower on a VM).
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

try:
    from maru.client._busypoll import recv_spin
except ImportError:  # built without a C compiler
    recv_spin = None
    log.debug("maru.client._busypoll not built: replies are awaited in poll()")

COMPILED = recv_spin is not None
