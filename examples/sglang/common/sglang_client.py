"""A small client for the SGLang examples (standard library only).

    python sglang_client.py query --url http://127.0.0.1:30000 [--words 3000] [--flush]
    python sglang_client.py bench --url URL [--url2 URL2 --hit-log FILE] [--words 3000] [--reps 3]

`query` sends one long prompt twice: once cold, once after the first instance's pages had time
to reach L3 -- on the same instance after `POST /flush_cache` (one URL), or on a second
instance (`--url2`) -- and prints what SGLang reports as cached, by tier.

`bench` measures time to first token (streaming `/generate`, `max_new_tokens` 1): cold, and
served from L3 (after `/flush_cache` on the same instance, or on `--url2` for P2P), for
`--reps` new prompts; prints the medians and the speed-up. With `--hit-log` it also checks that
the instance that loaded from L3 logged `batch_get_v1 result: N/N hits` (MaruStorage's log
line). Exit code 0 when the speed-up is at least `--min-speedup` (default 1.5) and, with
`--hit-log`, every logged batch was a full hit.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import re
import statistics
import sys
import time
import urllib.error
import urllib.request
import uuid
from urllib.parse import urlsplit

WORDS = [
    "cache", "memory", "page", "token", "layer", "tensor", "shared", "region", "server",
    "client", "prefix", "model", "decode", "prefill", "batch", "stream", "kernel", "device",
    "host", "storage", "tier", "latency", "bandwidth",
]  # fmt: skip
HITS_RE = re.compile(r"batch_get_v1 result: (\d+)/(\d+) hits")


def make_prompt(words: int, seed: int | None = None) -> str:
    """A prompt of about `words` words that no server has seen (a random nonce leads it)."""
    rng = random.Random(seed)
    body = " ".join(rng.choice(WORDS) for _ in range(words))
    return f"[{uuid.uuid4().hex}] Summarize the following notes. {body}"


def post(url: str, path: str, payload: dict | None, timeout: float = 600.0) -> dict:
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url + path, data=data, method="POST")
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read()
    except urllib.error.URLError as exc:
        sys.exit(f"cannot reach {url}{path}: {exc} (is the server running? see README)")
    try:
        return json.loads(body) if body.strip() else {}
    except json.JSONDecodeError:
        return {"raw": body.decode(errors="replace")}


def flush(url: str, timeout: float = 60.0) -> None:
    """POST /flush_cache: drop the device and host tiers (L3 is kept). Retried while busy."""
    deadline = time.monotonic() + timeout
    while True:
        req = urllib.request.Request(url + "/flush_cache?timeout=5", method="POST")
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                if resp.status == 200:
                    return
        except urllib.error.HTTPError:
            pass
        if time.monotonic() > deadline:
            sys.exit(f"{url}/flush_cache kept failing")
        time.sleep(0.5)


def generate(url: str, prompt: str, max_new_tokens: int = 16) -> dict:
    return post(
        url,
        "/generate",
        {"text": prompt, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}},
    )


def ttft(url: str, prompt: str, timeout: float = 600.0) -> tuple[float, dict]:
    """Seconds to the first streamed chunk, and the final chunk (with meta_info)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout)
    payload = {
        "text": prompt,
        "stream": True,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0},
    }
    try:
        t0 = time.perf_counter()
        conn.request("POST", "/generate", json.dumps(payload), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            sys.exit(f"{url}/generate returned {resp.status}: {resp.read()[:500]!r}")
        first, last = None, {}
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            if first is None:
                first = time.perf_counter() - t0
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            last = json.loads(data)
    finally:
        conn.close()
    if first is None:
        sys.exit(f"{url}/generate streamed nothing")
    return first, last


def cached(meta: dict) -> dict:
    details = meta.get("cached_tokens_details") or {}
    return {
        "prompt_tokens": meta.get("prompt_tokens"),
        "cached_tokens": meta.get("cached_tokens", 0),
        "device": details.get("device", 0),
        "host": details.get("host", 0),
        "storage": details.get("storage", 0),
        "storage_backend": details.get("storage_backend"),
    }


def wait_for_l3(seconds: float) -> None:
    """Write-through to L3 is asynchronous; give it a moment (seconds, default 2)."""
    time.sleep(seconds)


def cmd_query(args) -> int:
    prompt = make_prompt(args.words)
    first = generate(args.url, prompt, args.max_new_tokens)
    print(f"1st request on {args.url}: {cached(first['meta_info'])}")
    wait_for_l3(args.wait)
    if args.url2:
        target = args.url2
    else:
        flush(args.url)
        print(f"flushed the device and host caches of {args.url}")
        target = args.url
    second = generate(target, prompt, args.max_new_tokens)
    info = cached(second["meta_info"])
    print(f"2nd request on {target}: {info}")
    same = second.get("text") == first.get("text")
    print(f"same output: {same}")
    if not info["storage"]:
        print("no storage hits: see Troubleshooting in the README")
        return 1
    return 0 if same else 1


def log_hits(path: str, start: int) -> list[tuple[int, int]]:
    with open(path, errors="replace") as f:
        f.seek(start)
        return [(int(a), int(b)) for a, b in HITS_RE.findall(f.read())]


def cmd_bench(args) -> int:
    target = args.url2 or args.url
    where = f"P2P from {args.url} to {args.url2}" if args.url2 else f"local L3 on {args.url}"
    log_start = 0
    if args.hit_log:
        with open(args.hit_log, "rb") as f:
            log_start = f.seek(0, 2)
    # Warm-up (not counted): first requests after start are slow.
    warm = make_prompt(args.words)
    ttft(args.url, warm)
    wait_for_l3(args.wait)
    if not args.url2:
        flush(args.url)
    ttft(target, warm)
    if args.hit_log:
        with open(args.hit_log, "rb") as f:
            log_start = f.seek(0, 2)

    cold, hit, storage = [], [], []
    for rep in range(args.reps):
        prompt = make_prompt(args.words)
        t_cold, _ = ttft(args.url, prompt)
        wait_for_l3(args.wait)
        if not args.url2:
            flush(args.url)
        t_hit, r_hit = ttft(target, prompt)
        info = cached(r_hit.get("meta_info", {}))
        cold.append(t_cold)
        hit.append(t_hit)
        storage.append(info["storage"])
        print(
            f"rep {rep + 1}: {info['prompt_tokens']} prompt tokens, TTFT cold {t_cold:.3f} s, "
            f"from L3 {t_hit:.3f} s ({info['storage']} tokens from storage)"
        )
    a, c = statistics.median(cold), statistics.median(hit)
    speedup = a / c
    print(f"\n{where}: median TTFT cold {a:.3f} s, with L3 hits {c:.3f} s: {speedup:.2f}x")
    ok = speedup >= args.min_speedup and min(storage) > 0
    verdict = "PASS" if ok else "FAIL"
    print(f"speed-up >= {args.min_speedup}x and storage hits in every rep: {verdict}")
    if args.hit_log:
        hits = log_hits(args.hit_log, log_start)
        full = bool(hits) and all(h == n for h, n in hits)
        shown = ", ".join(f"{h}/{n}" for h, n in hits[:8]) + (" ..." if len(hits) > 8 else "")
        verdict = "PASS" if full else "FAIL"
        print(f"{args.hit_log}: batch_get_v1 results {shown or 'none'}: {verdict}")
        ok = ok and full
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("query", "bench"):
        p = sub.add_parser(name)
        p.add_argument("--url", required=True, help="the instance that computes the prompt")
        p.add_argument("--url2", help="a second instance that should load it from L3 (P2P)")
        p.add_argument("--words", type=int, default=3000, help="prompt length in words")
        p.add_argument("--wait", type=float, default=2.0, help="seconds for write-through")
    sub.choices["query"].add_argument("--max-new-tokens", type=int, default=16)
    bench = sub.choices["bench"]
    bench.add_argument("--reps", type=int, default=3)
    bench.add_argument("--min-speedup", type=float, default=1.5)
    bench.add_argument("--hit-log", help="log of the instance loading from L3, to check its hits")
    args = ap.parse_args(argv)
    return cmd_query(args) if args.cmd == "query" else cmd_bench(args)


if __name__ == "__main__":
    sys.exit(main())
