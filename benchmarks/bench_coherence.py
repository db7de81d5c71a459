"""What software coherence costs (issue 43): MaruStorage's set and get, hardware vs software.

    .venv/bin/python benchmarks/bench_coherence.py            # ~2 minutes
    .venv/bin/python benchmarks/bench_coherence.py --reps 3   # quicker, noisier

One run, one `maru-server`: a writer process and a reader process (bench_hicache.py's
`Instance`: a real SGLang host pool and MaruStorage through SGLang's backend factory) move
the same pages with `batch_set_v1` and `batch_get_v1`, MHA `page_first_direct` at 64 KiB and
1 MiB pages. Each repetition measures, in an order shuffled per repetition, Maru in hardware
mode, Maru in software mode, and the floor: Maru's own streaming copy loop alone between the
host pool and a warm /dev/shm mapping (`stream`). The mode is switched in both processes with
`maru.common._memcopy.coherence`, the process-wide switch a HANDSHAKE sets (a handler whose
server runs `--coherence software` sets exactly this), so that both modes run against the
same server, pool and pages. Every page read is checked (CRC) in both modes. Ratios are
medians of per-repetition ratios (software / hardware, each / stream).

This machine's caches are coherent: the flushes are needed on a CXL 2.0 pod, here they only
cost. A reader here reads pages its own host wrote a moment before, some still in its cache
in hardware mode; on another host they are not: the software/hardware ratio of a get here is
an upper bound of what it costs there.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile

import bench_hicache as hc  # (same dir)

KiB, MiB = 1 << 10, 1 << 20
CASES = [c for c in hc.CASES if c.name in ("mha-64K", "mha-1M")]
MODES = ("hardware", "software")


class CoherentInstance(hc.Instance):
    """bench_hicache's Instance that can switch its process's copies' coherence mode."""

    def coherence(self, mode: str) -> str:
        from maru.common import _memcopy

        return _memcopy.coherence(mode)

    def lines_flushed(self) -> tuple[int, int]:
        from maru.client.coherence import lines_flushed

        return lines_flushed()


def gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / sum(seconds) / 1e9


def bench_case(url: str, case: hc.Case, reps: int, batch: int, calls: int, file_dir: str) -> dict:
    """`reps` timed repetitions (after one untimed, which faults the pool's pages in) of
    `calls` batch_*_v1 calls of `batch` pages each way, per method."""
    pages = batch * calls
    writer = hc.Worker(CoherentInstance, url, case, pages, file_dir, "writer")
    reader = hc.Worker(CoherentInstance, url, case, pages, file_dir, "reader")
    both = (writer, reader)
    try:
        info = writer.call("info")
        crcs = writer.call("fill", 1)
        figures: dict[str, list[float]] = {
            f"{m}_{op}": [] for m in (*MODES, "stream") for op in ("set", "get")
        }
        flushed = {m: [0, 0] for m in MODES}
        for rep in range(-1, reps):  # (-1: the warm-up, not kept)
            order = list((*MODES, "stream"))
            random.Random(rep).shuffle(order)
            for method in order:
                mode = "hardware" if method == "stream" else method
                for w in both:
                    w.call("coherence", mode)
                if method == "stream":
                    set_t = writer.call("run", "stream_set", "-", batch)[0]
                    get_t = reader.call("run", "stream_get", "-", batch)[0]
                else:
                    tag = f"{method}-{rep}"
                    before = [w.call("lines_flushed") for w in both]
                    set_t, ok, *_ = writer.call("run", "maru_set", tag, batch)
                    reader.call("wipe")
                    get_t, got, *_ = reader.call("run", "maru_get", tag, batch)
                    after = [w.call("lines_flushed") for w in both]
                    if ok != pages or got != pages or reader.call("crcs") != crcs:
                        raise SystemExit(
                            f"{case.name} {method}: {ok}/{got} of {pages} pages, or bytes differ"
                        )
                    if rep >= 0:
                        flushed[method][0] += after[0][0] - before[0][0]  # the writer's
                        flushed[method][1] += after[1][1] - before[1][1]  # the reader's
                    writer.call("maru_delete", tag)
                if rep >= 0:
                    figures[f"{method}_set"].append(gbps(info["bytes"], set_t))
                    figures[f"{method}_get"].append(gbps(info["bytes"], get_t))
        for w in both:
            w.call("coherence", "hardware")
        return {"case": case, "info": info, "figures": figures, "flushed": flushed, "reps": reps}
    finally:
        for w in both:
            w.close()


def ratio(a: list[float], b: list[float]) -> float:
    return statistics.median(x / y for x, y in zip(a, b))


def render(results: list[dict]) -> str:
    lines = [
        "| page | op | stream GB/s | hardware GB/s | software GB/s | software / hardware | "
        "hardware / stream | software / stream | lines flushed per page (sw) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        f, pages = r["figures"], r["info"]["pages"] * r["reps"]
        for op, side in (("set", 0), ("get", 1)):
            med = {m: statistics.median(f[f"{m}_{op}"]) for m in (*MODES, "stream")}
            per_page = r["flushed"]["software"][side] / pages
            what = "written back" if op == "set" else "invalidated"
            lines.append(
                f"| {hc.size_label(r['info']['page_bytes'])} | {op} | {med['stream']:.2f} | "
                f"{med['hardware']:.2f} | {med['software']:.2f} | "
                f"{ratio(f[f'software_{op}'], f[f'hardware_{op}']):.3f} | "
                f"{ratio(f[f'hardware_{op}'], f[f'stream_{op}']):.3f} | "
                f"{ratio(f[f'software_{op}'], f[f'stream_{op}']):.3f} | {per_page:.0f} {what} |"
            )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=7, help="repetitions (default: 7)")
    parser.add_argument(
        "--calls", type=int, default=4, help="batch_*_v1 calls per repetition (default: 4)"
    )
    parser.add_argument(
        "--batch-bytes",
        type=int,
        default=16 * MiB,
        help="bytes per batch_*_v1 call (default: 16 MiB)",
    )
    args = parser.parse_args()
    import sglang_cpu

    sglang_cpu.apply()  # before SGLang is imported
    hc.preload_sglang()
    results = []
    with hc.maru_server("1G") as url, tempfile.TemporaryDirectory() as file_dir:
        for case in CASES:
            batch = max(1, min(128, args.batch_bytes // case.page_bytes))
            results.append(bench_case(url, case, args.reps, batch, args.calls, file_dir))
            print(f"{case.name}: done", file=sys.stderr)
    from maru.common import _memcopy

    print(
        f"{len(results)} cases, {args.reps} repetitions, flushes: write-back "
        f"{_memcopy.FLUSH_WRITE_BACK or 'none'}, invalidate {_memcopy.FLUSH_INVALIDATE or 'none'}"
    )
    print(render(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
