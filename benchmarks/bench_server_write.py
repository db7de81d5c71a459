"""Server benchmark: the instructions `maru-server` spends on one full instance's write.

    .venv/bin/python benchmarks/bench_server_write.py                  # ~1 min, under callgrind
    .venv/bin/python benchmarks/bench_server_write.py --json after.json --compare before.json
    .venv/bin/python benchmarks/bench_server_write.py --no-valgrind    # in process, timed only

The steady state of an SGLang instance whose share of the pool is full (issue 42): every
16 MiB write is one REGISTER_KV of 256 new 64 KiB pages carrying `ahead` = 256 pages, so the
server evicts 256 of the instance's least recently used keys (journal "D", the local index's
remove, the owner's `freed` notice), then registers the batch (journal "K", the local index's
publish) and answers with the notice, whose pages the next write uses, as the client does.
A `MaruService` built as `maru-server` builds it (a real pool, the journal in a temporary
state directory, the local index published) answers the frames through `handle_frame`.

Wall clock on a shared VM moves by a third from run to run; instruction counts do not. The
script runs itself under `valgrind --tool=callgrind`, collecting only inside the measured
`handle_frame` calls (each made through `operator.call`, which nothing else in the process
calls: callgrind's `--toggle-collect`), so the harness's own work (keys, frames, decoding
replies) is not counted, and prints the instructions per call grouped by the shared object
that ran them: the interpreter, the key index (C; the journal's CRCs too, since they left zlib
on 2026-12-06) and the local index (C), msgpack, zlib (the journal's CRCs before), libc, the
rest. `--keep DIR` keeps the dump for `callgrind_annotate`.
"""

from __future__ import annotations

import argparse
import json
import operator
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_server import Server, batch_keys
from maru.common import protocol
from maru.common.protocol import MsgType, freed_columns

KiB, MiB = 1 << 10, 1 << 20
PAGE = 64 * KiB
BATCH = 256  # a 16 MiB call of 64 KiB pages
# (group, a pattern of the shared object's path): the first match names an object's group
GROUPS = [
    ("key index (C)", r"_keyindex"),
    ("local index (C)", r"_shmindex"),
    ("msgpack (C)", r"msgpack"),
    ("zlib (journal CRC)", r"libz\b|zlib"),
    ("libc (malloc, memcpy, syscalls)", r"libc[.-]|libm[.-]|ld-linux"),
    ("numpy", r"numpy"),
    ("Python interpreter", r"python|libpython"),
]


class FullWriter:
    """One instance at its full share, writing into the pages its last write's reply freed."""

    def __init__(self, work: Path, share: int):
        self.server = Server(work, 2 * share)  # (its region: half the pool, the share)
        registry = self.server.registry
        self.token = registry.regions[self.server.region_id].token
        pages = share // PAGE
        # full but for one write's pages: those the first write goes to
        self.free = [(self.server.region_id, i * PAGE) for i in range(pages)]
        self.calls = 0
        while len(self.free) > BATCH:
            self.write(min(BATCH, len(self.free) - BATCH), ahead=False)

    def frame(self, n: int, ahead: bool) -> bytes:
        """REGISTER_KV of `n` new keys at free pages, as a full writer seals (write-behind)."""
        places, self.free = self.free[:n], self.free[n:]
        body: dict[str, Any] = {
            "keys": batch_keys(f"w{self.calls}", n),
            "region_ids": protocol.pack_int64([p[0] for p in places]),
            "offsets": protocol.pack_int64([p[1] for p in places]),
            "lengths": protocol.pack_int64([PAGE] * n),
            "tokens": [[self.server.region_id, self.token]],
            "behind": True,
        }
        if ahead:
            body["ahead"] = BATCH * PAGE
        self.calls += 1
        return self.server.frame(MsgType.REGISTER_KV, body)

    def write(self, n: int = BATCH, ahead: bool = True, counted: bool = False) -> int:
        """One write's seal; the pages its reply freed (they become free pages). `counted`:
        served through `operator.call`, callgrind's collection toggle."""
        frame = self.frame(n, ahead)
        handle = self.server.service.handle_frame
        out = operator.call(handle, frame) if counted else handle(frame)
        _, reply = protocol.decode(out)
        if not reply.get("ok") or set(reply["results"]) != {0}:
            raise RuntimeError(f"REGISTER_KV failed: {reply}")
        freed = reply.get("freed")
        if freed is None:
            return 0
        region_ids, offsets, _ = freed_columns(freed)
        self.free += list(zip(region_ids.tolist(), offsets.tolist()))
        return len(region_ids)

    def close(self) -> None:
        self.server.close()


def run(calls: int, work: Path, share: int = 256 * MiB, warm: int = 8) -> list[int]:
    """`warm` writes, then `calls` measured ones (`counted`); the pages each one's reply
    freed."""
    writer = FullWriter(work, share)
    try:
        for _ in range(warm):
            writer.write()
        freed = [writer.write(counted=True) for _ in range(calls)]
    finally:
        writer.close()
    return freed


def group_of(obj: str) -> str:
    for name, pattern in GROUPS:
        if re.search(pattern, obj):
            return name
    return "other"


def self_costs(dump: Path) -> Counter[str]:
    """Instructions (self cost) per shared object in a callgrind dump written with
    `--compress-strings=no`: the cost lines after `fn=` are the function's own, the one after
    `calls=` its callee's (skipped)."""
    per_obj: Counter[str] = Counter()
    obj, skip = "", False
    for line in dump.read_text(errors="replace").splitlines():
        if not line:
            continue
        if line[0].isdigit() or line[0] in "+-*":
            parts = line.split()
            if not skip and len(parts) > 1:
                per_obj[obj] += int(parts[1])
            skip = False
        elif line.startswith("ob="):
            obj = line[3:]
        elif line.startswith("calls="):
            skip = True
    return per_obj


def measure(calls: int, share_mib: int, keep: str = "") -> dict[str, Any]:
    """Run this script's `--inner` under callgrind; instructions per call by group."""
    out = Path(keep or tempfile.mkdtemp(prefix="maru-bench-write-"))
    out.mkdir(parents=True, exist_ok=True)
    try:
        cmd = [
            "valgrind",
            "--tool=callgrind",
            "--collect-atstart=no",
            "--toggle-collect=_operator_call",
            "--compress-strings=no",
            f"--callgrind-out-file={out}/callgrind.out",
            sys.executable,
            __file__,
            "--inner",
            f"--calls={calls}",
            f"--share-mib={share_mib}",
        ]
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        subprocess.run(cmd, check=True, env=env, stderr=subprocess.DEVNULL)
        per_obj = self_costs(out / "callgrind.out")
    finally:
        if not keep:
            shutil.rmtree(out, ignore_errors=True)
    groups: Counter[str] = Counter()
    for obj, cost in per_obj.items():
        groups[group_of(obj)] += cost
    per_call = {g: c / calls for g, c in groups.most_common()}
    return {"calls": calls, "total": sum(per_call.values()), "groups": per_call}


def table(after: dict[str, Any], before: dict[str, Any] | None) -> str:
    rows = ["| group | " + ("before | after | saved |" if before else "instructions / call |")]
    rows.append("|---|" + ("---:|---:|---:|" if before else "---:|"))
    names = list(after["groups"])
    if before:
        names += [g for g in before["groups"] if g not in after["groups"]]
    for name in [*names, "total"]:
        a = after["total"] if name == "total" else after["groups"].get(name, 0)
        if before is None:
            rows.append(f"| {name} | {a:,.0f} |")
            continue
        b = before["total"] if name == "total" else before["groups"].get(name, 0)
        share = (b - a) / before["total"] * 100
        rows.append(f"| {name} | {b:,.0f} | {a:,.0f} | {b - a:,.0f} ({share:.1f}% of a call) |")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20, help="measured writes (20)")
    ap.add_argument("--share-mib", type=int, default=256, help="the instance's share (256)")
    ap.add_argument("--json", default="", help="write the counts here")
    ap.add_argument("--compare", default="", help="a --json file of an earlier run: before")
    ap.add_argument("--keep", default="", help="keep callgrind's dump in this folder")
    ap.add_argument("--no-valgrind", action="store_true", help="run the writes, count nothing")
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.inner or args.no_valgrind:
        work = Path(tempfile.mkdtemp(prefix="maru-bench-write-"))
        try:
            freed = run(args.calls, work, args.share_mib * MiB)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        if not args.inner:
            print(f"{args.calls} writes, pages freed per write: {sorted(set(freed))}")
        return 0
    if shutil.which("valgrind") is None:
        print("valgrind not found: --no-valgrind runs the writes without counting")
        return 1
    result = measure(args.calls, args.share_mib, args.keep)
    before = json.loads(Path(args.compare).read_text()) if args.compare else None
    print(
        f"maru-server, a full instance's write ({BATCH} x 64 KiB keys, `ahead` {BATCH} pages, "
        f"share {args.share_mib} MiB): instructions per call, {args.calls} calls, callgrind"
    )
    print()
    print(table(result, before))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
