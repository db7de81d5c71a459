"""Issue 13, P8: end-to-end page checksums (`maru_checksums`). The writer hashes each value as
stored (after its copy) and the server keeps the hash with the key; a reader hashes the value
after its copy and takes a mismatch as a miss. Real processes, a real server, and the fault
made for real: bytes of a sealed page overwritten in the pool file itself."""

from __future__ import annotations

import logging
import signal

from maru import MaruHandler

from .workers import digest, flip_byte, run_processes, store_keys

KiB = 1 << 10
KEYS = [f"sum-{i}" for i in range(24)]
SIZES = [(i % 4 + 1) * 60 * KiB + i for i in range(len(KEYS))]  # not page multiples, some runs
SEED = 700


def write_in_another_process(url: str, **handler_kw) -> list[str]:
    """The writer: its own process and handler; its keys stay readable after it closes."""
    (result,) = run_processes(
        [(store_keys, (url, KEYS, SIZES, SEED, 8, {"pool_size": "64M", **handler_kw}))], 120
    )
    assert result["ok"] == [True] * len(KEYS), result
    return result["digests"]


def wrong_hits(handler: MaruHandler, digests: list[str]) -> tuple[int, int]:
    """(hits, hits whose bytes are not the written ones) of a leased copy of every key, the
    copy checked after it was made (`Lookup.corrupt`)."""
    with handler.lookup(KEYS, lease=True) as found:
        copies = [bytes(info.view) if info else None for info in found.infos()]
        bad = found.corrupt()
        assert found.release(confirm=True)
    hits = [c is not None and not b for c, b in zip(copies, bad)]
    wrong = sum(h and digest(c) != d for h, c, d in zip(hits, copies, digests))
    return sum(hits), wrong


def test_a_page_corrupted_after_sealing_is_a_miss_with_checksums(maru_server, caplog):
    digests = write_in_another_process(maru_server.url, checksums=True)
    reader = MaruHandler(server_url=maru_server.url, pool_size="4M", checksums=True)
    plain = MaruHandler(server_url=maru_server.url, pool_size="4M")  # checksums off
    assert wrong_hits(reader, digests) == (len(KEYS), 0)
    victims = [KEYS[3], KEYS[17]]
    for key in victims:
        flip_byte(reader, key, at=SIZES[KEYS.index(key)] - 1)  # the last byte
    # Without checksums the reads are hits on the wrong bytes: the fault is real.
    assert wrong_hits(plain, digests) == (len(KEYS), 2)
    assert plain.checksum_mismatches == 0

    with caplog.at_level(logging.ERROR, logger="maru.client.requests"):
        assert wrong_hits(reader, digests) == (len(KEYS) - 2, 0)
        infos = reader.batch_retrieve(KEYS)  # views: checked when handed out
    assert [KEYS[i] for i, info in enumerate(infos) if info is None] == victims
    assert all(digest(i.view) == d for i, d in zip(infos, digests) if i is not None)
    # The first read reported them and the server dropped them (CORRUPT_KV): the second
    # finds them gone, a miss without a mismatch, for readers without checksums too.
    assert reader.checksum_mismatches == 2
    assert all(repr(key) in caplog.text for key in victims)
    assert wrong_hits(plain, digests) == (len(KEYS) - 2, 0)
    reader.close()
    plain.close()


def test_keys_stored_without_a_checksum_read_as_before(maru_server):
    digests = write_in_another_process(maru_server.url)  # checksums off
    reader = MaruHandler(server_url=maru_server.url, pool_size="4M", checksums=True)
    flip_byte(reader, KEYS[5], at=100)
    assert wrong_hits(reader, digests) == (len(KEYS), 1)  # nothing to check them against
    assert reader.checksum_mismatches == 0
    reader.close()


def test_a_restart_keeps_the_checksums(maru_server_factory, tmp_path):
    """SIGKILL, restart: the keys come back from the journal (and the restarted server writes
    a snapshot of them at start); SIGKILL, restart again: from that snapshot. Both times a
    page corrupted meanwhile is a miss."""
    server = maru_server_factory(tmp_path / "srv", pool_size="256M")
    digests = write_in_another_process(server.url, checksums=True)
    for round_, victim in enumerate((KEYS[2], KEYS[9]), 1):  # from the journal, the snapshot
        server.proc.send_signal(signal.SIGKILL)
        assert server.proc.wait(10) == -signal.SIGKILL
        server.restart()
        reader = MaruHandler(server_url=server.url, pool_size="4M", checksums=True)
        flip_byte(reader, victim, at=100)
        hits, wrong = wrong_hits(reader, digests)  # every page corrupted so far is a miss
        # (the first victim was dropped on its report: the second round misses it as gone)
        assert (hits, wrong, reader.checksum_mismatches) == (len(KEYS) - round_, 0, 1)
        reader.close()
    log = server.read_log()  # restored twice: all, then all but the dropped one
    assert log.count(" and 24 keys (") == 1 and log.count(" and 23 keys (") == 1, log[-3000:]
