"""Which coherence the copies keep with the other hosts of a CXL pod (who flushes what, when:
docs/architecture.md, "Coherence").

Each handler agrees the server's mode (`maru-server --coherence`, in HANDSHAKE) with its own
`maru_coherence`; where they differ software wins (one WARNING). The mode is applied once per
process to the C copy loops: software while any handler of the process agreed on it (a flush
where none was needed costs time, never bytes). Bytes the copy loops do not move are flushed
where they are handed over, one C call per batch (`write_back_handles`, `invalidate_ranges`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from maru.common._memcopy import coherence as _c_coherence
from maru.common._memcopy import coherence_counts as _c_coherence_counts
from maru.common._memcopy import flush_ranges as _c_flush_ranges
from maru.common.config import COHERENCE_MODES
from maru.common.memcopy import CopyFaultError, faulted

log = logging.getLogger(__name__)

HARDWARE, SOFTWARE = COHERENCE_MODES

_lock = threading.Lock()
_software: set[int] = set()  # the agreements (id) in software mode now, in this process


class CoherenceUnavailable(Exception):
    """Software coherence was agreed but this CPU has no cache-line flushes (not x86-64)."""


def process_mode() -> str:
    """The mode the copy loops of this process run in now."""
    return str(_c_coherence())


def software() -> bool:
    """Whether this process's copies run in software mode now (no call into C)."""
    return bool(_software)


def invalidate_ranges(addresses: np.ndarray, lengths: np.ndarray) -> np.ndarray | None:
    """In software mode, invalidate the lines of values about to be read in place (views, a
    GPU's DMA: not a copy loop). Returns None, or a bool per range: True (a miss) if it faulted."""
    if not _software:
        return None
    try:
        _c_flush_ranges(
            np.ascontiguousarray(addresses, np.int64), np.ascontiguousarray(lengths, np.int64), True
        )
    except CopyFaultError as exc:
        return faulted(exc)
    return None


def write_back_handles(handles: Any, lengths: int | Sequence[int] | None) -> None:
    """In software mode, write back `MaruHandler.seal`'s values (written in place) before they
    are registered, or `free`'s before they go back; `handles` and `lengths` as `seal` takes
    them (`Any`: importing `maru.client.chunks` here would be a cycle). Every line of each
    handle's `buf` is written back, whatever `lengths` says: the caller may have written past
    the length it seals (or into a run's gaps), and a dirty line of ours left there would be
    evicted, later, onto what another host writes into those chunks. Raises `CopyFaultError`
    if one faults."""
    if not _software:
        return
    if hasattr(handles, "stride"):  # (one run)
        handles = [handles]
    # (a handle's `buf`: its first value's start to its last value's end)
    addresses = np.array([h.address if h else 0 for h in handles], np.int64)
    sizes = [h.stride * (h.count - 1) + h.size if h else 0 for h in handles]
    write_back_ranges(addresses, sizes)


def write_back_ranges(addresses: np.ndarray, lengths: int | Sequence[int] | np.ndarray) -> None:
    """In software mode, write back values written into the pool by something else than a
    copy loop (a device's kernel) before they are registered: `lengths` one for all or one per
    address (address 0: none). A value whose memory faults raises `CopyFaultError`."""
    if not _software:
        return
    addresses = np.ascontiguousarray(addresses, np.int64)
    sizes = np.broadcast_to(np.asarray(lengths, np.int64), addresses.shape)
    _c_flush_ranges(addresses, np.ascontiguousarray(sizes), False)


def lines_flushed() -> tuple[int, int]:
    """Cache lines this process's copies have written back and invalidated in software mode
    (tests: the flushes cannot be seen in the bytes on a coherent machine)."""
    written_back, invalidated = _c_coherence_counts()
    return int(written_back), int(invalidated)


class Coherence:
    """One handler's coherence: `configured` (the `coherence` key; None: the server's) agreed
    with the server's mode at every HANDSHAKE (`agree`), given up at close (`release`)."""

    def __init__(self, configured: str | None):
        self.configured = configured
        self.mode: str | None = None  # agreed at the last HANDSHAKE (None: none yet)
        self._warned: tuple[str, str] | None = None  # (ours, the server's) said once

    def agree(self, announced: Any, server_url: str) -> str:
        """The mode for the server's `announced` one (HANDSHAKE's `coherence`; absent from an
        older server: hardware), applied to this process's copies. Raises
        `CoherenceUnavailable` where software cannot run here."""
        if announced is None:
            server = HARDWARE
        elif announced in COHERENCE_MODES:
            server = str(announced)
        else:  # (never from a maru-server: the safe side)
            log.warning(
                "maru-server at %s announced coherence %r: taken as software", server_url, announced
            )
            server = SOFTWARE
        mine = self.configured or server
        mode = SOFTWARE if SOFTWARE in (mine, server) else HARDWARE
        if mine != server and self._warned != (mine, server):
            self._warned = (mine, server)
            log.warning(
                "coherence: this client is configured for %s, maru-server at %s runs %s: "
                "software coherence is used (every copy into and out of the pool flushes its "
                "cache lines; docs/operations.md)",
                mine,
                server_url,
                server,
            )
        self._apply(mode)
        return mode

    def release(self) -> None:
        """This handler no longer copies: the process's mode without it."""
        self._apply(None)

    def _apply(self, mode: str | None) -> None:
        with _lock:
            before = set(_software)
            if mode == SOFTWARE:
                _software.add(id(self))
            else:
                _software.discard(id(self))
            try:
                _c_coherence(SOFTWARE if _software else HARDWARE)
            except OSError as exc:
                _software.clear()
                _software.update(before - {id(self)})
                raise CoherenceUnavailable(str(exc)) from None
            self.mode = mode
