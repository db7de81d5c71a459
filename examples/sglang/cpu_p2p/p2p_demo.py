"""Maru P2P KV sharing between two real SGLang servers, on this CPU-only machine.

    bash examples/sglang/cpu_p2p/run.sh      # or: python examples/sglang/cpu_p2p/p2p_demo.py

Builds a tiny random Qwen2 model locally (no downloads), starts `maru-server` and two
`sglang.launch_server` processes on CPU (with the test-only CPU shims of tests/sglang_cpu)
that load MaruStorage through the documented contract JSON, sends one prompt to instance 1,
waits until its pages are in Maru, sends the same prompt to instance 2, and prints how many
prompt tokens instance 2 took from Maru and whether both generated the same tokens.
Everything it started is stopped and its files removed at the end (also on Ctrl-C).
Exit code 0 if instance 2 hit every reusable page and the outputs match.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests"))


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--keep-logs", action="store_true", help="keep the server logs")
    args = ap.parse_args(argv)

    try:
        import sglang_cpu

        sglang_cpu.apply()  # before anything imports torchvision / sglang
        import maru_sglang.maru_storage  # noqa: F401
        import sglang  # noqa: F401
    except ImportError as exc:
        print(
            f"missing package: {exc}\nRun `make install` in {ROOT} (it makes .venv with Maru and "
            "SGLang for CPU), then run this again (run.sh picks .venv/bin/python).",
            file=sys.stderr,
        )
        return 2
    from sglang_cpu import p2p
    from sglang_cpu.tiny_model import build_tiny_model, make_prompt

    # SIGTERM as Ctrl-C: the `finally` blocks below stop every process and remove every file.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    work = Path(tempfile.mkdtemp(prefix="maru-cpu-p2p-"))
    ok = False
    try:
        say("[1/4] building a tiny random Qwen2 model (local, no downloads)")
        model = build_tiny_model(work / "model")
        say("[2/4] starting maru-server (pool of 1 GiB in /dev/shm)")
        with p2p.maru_server("1G") as url:
            say(f"maru-server at {url}")
            say("[3/4] starting two SGLang servers with Maru as HiCache L3 (~25 s each)")
            prompt = make_prompt(args.prompt_tokens, seed=int(time.time()))
            run = p2p.run_p2p(
                model,
                url,
                [prompt],
                log_dir=work / "logs",
                max_new_tokens=args.max_new_tokens,
                say=lambda m: say("      " + m),
            )
        o = run.outcomes[0]
        say("[4/4] result")
        print()
        print(f"  prompt tokens:                 {o.tokens}")
        print(f"  instance 1 cached tokens:      {o.first['meta_info']['cached_tokens']}")
        print(f"  instance 2 storage hits:       {o.storage} (expected {o.expected_storage})")
        print(f"  instance 2 log:                {', '.join(o.hits_lines)}: {o.hits_logged}")
        print(f"  outputs identical:             {o.same_output}")
        print(f"  instance 1 output ids:         {o.first['output_ids']}")
        print(f"  instance 2 output ids:         {o.second['output_ids']}")
        print()
        ok = o.storage == o.expected_storage and o.same_output and o.hits_logged
        say("OK: instance 2 reused instance 1's KV from Maru" if ok else "FAILED (see logs)")
    except KeyboardInterrupt:
        say("interrupted; cleaning up")
        return 130
    finally:
        if args.keep_logs or not ok:
            shutil.rmtree(work / "model", ignore_errors=True)
            say(f"server logs kept in {work / 'logs'}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
