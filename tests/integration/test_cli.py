"""The `maru` CLI against a real maru-server: every command's output parsed and checked.

Most commands run in-process (`maru.client.cli.main`, same code as the console script, quicker);
a few run the installed `maru` console script to cover the entry point, exit codes and
$MARU_SERVER_URL.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from maru import MaruAdmin, MaruHandler
from maru.client.cli import (
    MonitorFrame,
    Rows,
    build_parser,
    cmd_monitor,
    main,
    render_instances,
    render_status,
    rich_frame,
)
from maru.common import hugepages

WRITER = "cli-writer"
NS1 = [f"ns1:{i}" for i in range(10)]  # 100000 bytes each: 2 pages of 64 KiB
NS2 = [f"ns2:{i}" for i in range(3)]  # 5000 bytes each: 1 page
STORED = 10 * 100000 + 3 * 5000
GiB = 1 << 30


def maru_command() -> list[str]:
    beside = Path(sys.executable).parent / "maru"
    if beside.exists():
        return [str(beside)]
    found = shutil.which("maru")
    return [found] if found else [sys.executable, "-m", "maru"]


def run(url: str, *args: str) -> tuple[int, str]:
    """`maru ARGS --server URL` in-process; returns (exit code, stdout)."""
    out = io.StringIO()
    rc = main([*args, "--server", url], out=out)
    return rc, out.getvalue()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def writer(maru_server):
    """An instance that stored NS1 and NS2, looked up 4 keys (3 hits, 1 miss) and checked 3
    (2 found)."""
    h = MaruHandler(
        server_url=maru_server.url,
        instance_id=WRITER,
        pool_size="16M",
        expand_size="16M",  # one region of the whole cap: the numbers below
        chunk_size_bytes="64K",
    )
    try:
        assert all(h.batch_store(NS1, [b"a" * 100000] * len(NS1)))
        assert all(h.batch_store(NS2, [b"b" * 5000] * len(NS2)))
        found = h.batch_retrieve(["ns1:0", "ns1:1", "ns1:2", "missing"])
        assert [f is not None for f in found] == [True, True, True, False]
        assert h.batch_exists(["ns2:0", "ns2:9", "ns1:9"]) == [True, False, True]
        h._beat()  # (the heartbeat reports the checks its local index answered)
        yield h
    finally:
        h.close()


def fields(text: str) -> dict[str, str]:
    """`name:  value` lines of `maru status` as a dict."""
    return {
        m.group(1): m.group(2) for m in re.finditer(r"^(\w+):\s+(.*)$", text, flags=re.MULTILINE)
    }


def table_rows(text: str, header_first: str) -> list[list[str]]:
    """Rows (split on runs of 2+ spaces) of the table whose header starts with `header_first`,
    up to the next blank line."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:1] == [header_first])
    rows = []
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        rows.append(re.split(r"\s{2,}", line.strip()))
    return rows


# -- status ----------------------------------------------------------------------------------


def test_status_reports_the_pool_and_usage(maru_server, writer):
    rc, text = run(maru_server.url, "status")
    assert rc == 0
    first = text.splitlines()[0]
    assert first.startswith(f"maru-server {maru_server.url} is up")
    assert f"pid {maru_server.pid}" in first
    f = fields(text)
    assert f["pool"] == f"shm:{maru_server.pool_path}"
    assert re.fullmatch(r"[0-9a-f]{16}", f["generation"])  # this life of the pool
    assert f["capacity"] == f"1.0 GiB ({GiB} bytes)"
    assert f["regions"].startswith("16.0 MiB in 1 regions (1.6% of the pool), 1008.0 MiB free")
    assert f["stored"].startswith(f"{STORED / 1024:.1f} KiB in 13 keys")
    assert "evicts above 95% down to 85%" in f["stored"]
    assert f["instances"].startswith("1 connected")
    assert f["lookups"] == "4 keys, hit rate 75.0%, 0 keys evicted"
    assert f["exists"] == "3 keys, hit rate 66.7%"
    assert f["metrics"].startswith("off")
    pages = hugepages.describe(hugepages.tmpfs_huge_option(maru_server.pool_path))
    assert f["pages"] == pages  # on /dev/shm as mounted here: "4 KiB pages (tmpfs huge=never..."
    index = rf"{re.escape(maru_server.pool_path)}\.index\.\d+, 13 keys in 65536 slots, "
    assert re.fullmatch(index + re.escape(pages), f["index"])
    local = r"@maru:tcp://127\.0\.0\.1:\d+:[0-9a-f]{12}, [1-9]\d* connections"
    assert re.fullmatch(local, f["local"])


def test_status_when_the_server_is_down_exits_nonzero(tmp_path):
    url = f"tcp://127.0.0.1:{free_port()}"
    env = {**os.environ, "MARU_SERVER_URL": url}
    proc = subprocess.run(
        [*maru_command(), "--timeout-ms", "300", "status"],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert "maru-server is down or unreachable" in proc.stderr
    assert url in proc.stderr


@pytest.mark.parametrize("command", ["status", "stats", "keys", "clear --yes"])
def test_a_stopped_server_is_connection_refused_at_once(command):
    """The library's probe: "connection refused", not a request that waits out its deadline
    (one far beyond the subprocess's timeout here) and says "send timed out"."""
    url = f"tcp://127.0.0.1:{free_port()}"
    proc = subprocess.run(
        [*maru_command(), "--server", url, "--timeout-ms", "600000", *command.split()],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr == (
        f"maru: {url}: maru-server is down or unreachable (connection refused: is maru-server "
        "running on that port?)\n"
    )


def test_something_else_on_the_port_is_said(tmp_path):
    """An HTTP server where maru-server was expected: said at once, not "down"."""
    http = subprocess.Popen(
        [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", "0"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        port = re.search(r"port (\d+)", http.stdout.readline()).group(1)
        proc = subprocess.run(
            [*maru_command(), "--server", f"127.0.0.1:{port}", "--timeout-ms", "600000", "status"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        http.kill()
        http.wait(10)
    assert proc.returncode == 1
    assert "something other than maru-server answered on that port" in proc.stderr


def test_console_script_uses_maru_server_url(maru_server, writer):
    env = {**os.environ, "MARU_SERVER_URL": maru_server.url}
    proc = subprocess.run(
        [*maru_command(), "status"],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stderr
    assert fields(proc.stdout)["stored"].startswith(f"{STORED / 1024:.1f} KiB in 13 keys")
    # --server before the subcommand, and host:port without the scheme
    rc = main(["--server", maru_server.url.removeprefix("tcp://"), "status"], out=io.StringIO())
    assert rc == 0


# -- stats -----------------------------------------------------------------------------------


def test_stats_json_has_pool_instances_and_histograms(maru_server, writer):
    rc, text = run(maru_server.url, "stats", "--json")
    assert rc == 0
    s = json.loads(text)
    assert s["pool"]["capacity"] == GiB and s["pool"]["used"] == 16 << 20
    assert s["pool"]["free"] == GiB - (16 << 20) and s["pool"]["fragmentation"] == 0
    assert s["keys"] == 13 and s["live_bytes"] == STORED
    inst = s["instances"][writer.instance_id]
    assert inst["regions"] == 1 and inst["region_bytes"] == 16 << 20
    assert inst["keys"] == 13 and inst["bytes_stored"] == STORED
    assert inst["page_size"] == 64 << 10
    assert inst["pages"] == 10 * 2 + 3 and inst["pages_total"] == 256
    assert (inst["hits"], inst["misses"], inst["evicted"]) == (3, 1, 0)
    assert (inst["exists_hits"], inst["exists_misses"]) == (2, 1)
    ops = s["operations"]
    bounds = s["latency_buckets"]
    assert bounds == sorted(bounds) and bounds[0] == pytest.approx(10e-6) and bounds[-1] == 1.0
    assert ops["lookup_kv"]["count"] == 1 and ops["register_kv"]["count"] == 2
    assert ops["handshake"]["count"] == 2  # over TCP, then on the Unix socket for the index
    for name, op in ops.items():
        assert len(op["buckets"]) == len(bounds) + 1, name
        assert sum(op["buckets"]) == op["count"], name
        assert op["errors"] == 0
        assert op["total_seconds"] > 0 or op["count"] == 0
    assert s["counters"]["lookups"] == 4 and s["counters"]["bytes_registered"] == STORED
    assert (s["counters"]["exists"], s["counters"]["exists_hits"]) == (3, 2)


def test_stats_text_tables(maru_server, writer):
    rc, text = run(maru_server.url, "stats")
    assert rc == 0
    rows = {r[0]: r for r in table_rows(text, "INSTANCE")}
    pid, regions, keys, stored, pages, hit, exist, evicted = rows[writer.instance_id][1:9]
    assert (pid, regions, keys, pages, hit, exist, evicted) == (
        str(os.getpid()),
        "1",
        "13",
        "23/256",
        "75.0%",
        "66.7%",
        "0",
    )
    assert stored == f"{STORED / 1024:.1f} KiB"
    ops = {r[0]: r for r in table_rows(text, "OP")}
    count, errors, _mean, p50, p99 = ops["lookup_kv"][1:6]
    assert (count, errors) == ("1", "0")
    assert p50.startswith("<=") and p99.startswith("<=")
    counters = {
        line.split()[0]: line.split()[1]
        for line in text.split("COUNTERS\n", 1)[1].splitlines()
        if line.strip()
    }
    assert counters["hits"] == "3" and counters["misses"] == "1"
    assert counters["keys_registered"] == "13"


# -- keys ------------------------------------------------------------------------------------


def test_keys_by_prefix_with_sizes_and_owner(maru_server, writer, capsys):
    rc, text = run(maru_server.url, "keys", "--prefix", "ns2:")
    assert rc == 0
    lines = text.splitlines()
    assert lines[0].split() == ["BYTES", "OWNER", "KEY"]
    rows = [line.split() for line in lines[1:]]
    assert sorted(rows) == [["5000", writer.instance_id, repr(k)] for k in NS2]

    rc, text = run(maru_server.url, "keys", "--prefix", "ns1:", "--json")
    doc = json.loads(text)
    assert doc["truncated"] is False
    assert {k["key"]: k["bytes"] for k in doc["keys"]} == dict.fromkeys(NS1, 100000)
    # most recently used first: lookups touched ns1:0, ns1:1, ns1:2, then exists ns1:9
    assert [k["key"] for k in doc["keys"][:4]] == ["ns1:9", "ns1:2", "ns1:1", "ns1:0"]
    assert {k["owner"] for k in doc["keys"]} == {writer.instance_id}


def test_keys_limit_is_applied_and_reported(maru_server, writer, capsys):
    capsys.readouterr()
    rc, text = run(maru_server.url, "keys", "--limit", "4")
    assert rc == 0
    assert len(text.splitlines()) == 1 + 4
    assert "more match" in capsys.readouterr().err
    rc, text = run(maru_server.url, "keys", "--limit", "13")
    assert len(text.splitlines()) == 1 + 13
    assert "more match" not in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:  # argparse's usage error
        run(maru_server.url, "keys", "--limit", "0")
    assert usage.value.code == 2
    assert "--limit: must be from 1 to 10000, got 0" in capsys.readouterr().err
    rc, text = run(maru_server.url, "keys", "--prefix", "nothing-here")
    assert rc == 0 and text == ""
    assert "no keys with prefix 'nothing-here'" in capsys.readouterr().err


def test_keys_tells_a_str_key_from_the_same_bytes(maru_server, writer):
    assert writer.store("bk", b"1") and writer.store(b"bk", b"22")
    rc, text = run(maru_server.url, "keys", "--prefix", "bk")
    assert rc == 0
    rows = [re.split(r"\s{2,}", line.strip()) for line in text.splitlines()[1:]]
    assert sorted((r[0], r[2]) for r in rows) == [("1", "'bk'")]  # --prefix is a str prefix
    rc, text = run(maru_server.url, "keys")
    shown = {re.split(r"\s{2,}", line.strip())[2] for line in text.splitlines()[1:]}
    assert {"'bk'", "b'bk'"} <= shown
    rc, text = run(maru_server.url, "keys", "--json")
    docs = [k for k in json.loads(text)["keys"] if k["key"] == "bk"]
    assert sorted((d["type"], d["bytes"], d.get("key_hex")) for d in docs) == [
        ("bytes", 2, "626b"),
        ("str", 1, None),
    ]


def test_status_shows_an_instance_that_stopped_sending_as_gone(maru_server):
    """A process that exits without close() stops its heartbeats: `maru status` says so and
    when the server will reap it (a clean close() ends the instance at once: see
    tests/integration/test_handler_lifecycle.py)."""
    with MaruAdmin(maru_server.url) as admin:
        stats = admin.stats()
    assert stats["heartbeat_timeout"] == 15.0  # the fixture's server runs with the default
    iid = "dead-instance"
    stats["instances"] = {iid: {**_instance_row(), "idle_seconds": 12.2}}
    text = render_status(maru_server.url, stats)
    assert fields(text)["instances"].startswith("1 connected (1 gone, reaping in 3 s)")
    row = render_instances(stats)[1]
    assert row.endswith("12s (gone, reaping in 3 s)")
    stats["instances"][iid]["idle_seconds"] = 4.0  # heartbeats every 5 s: alive
    assert fields(render_status(maru_server.url, stats))["instances"].startswith("1 connected,")


def test_status_counts_a_closed_handler_out_at_once(maru_server):
    h = MaruHandler(server_url=maru_server.url, pool_size="1M")
    assert h.store("k", b"v")
    _, text = run(maru_server.url, "status")
    assert fields(text)["instances"].startswith("1 connected,")
    h.close()  # DISCONNECT: no wait for the heartbeat timeout
    rc, text = run(maru_server.url, "status")
    assert rc == 0 and fields(text)["instances"].startswith("0 connected,")


def _instance_row() -> dict:
    keys = ["regions", "keys", "bytes_stored", "pages", "hits", "misses", "evicted"]
    return {"pid": 1, **dict.fromkeys(keys, 0)}


# -- bad input: one line and an exit code, never a traceback ----------------------------------


@pytest.mark.parametrize(
    ("args", "rc", "message"),
    [
        (["--server", "http://localhost:5555", "status"], 2, "--server: expected 'tcp://"),
        (["--server", "tcp://localhost:99999", "status"], 2, "port from 1 to 65535"),
        (["--timeout-ms", "-5", "status"], 2, "--timeout-ms: must be from 1 to 2147483647, got -5"),
        (["status", "--timeout-ms", "0"], 2, "--timeout-ms: must be from 1 to 2147483647, got 0"),
        (["--timeout-ms", "soon", "status"], 2, "--timeout-ms: expected milliseconds"),
        (["evict", "--prefix", ""], 2, "maru clear --yes"),
        # (a traceback before: OverflowError, time_t; ValueError, an empty name)
        (
            ["--timeout-ms", "99999999999999", "status"],
            2,
            "--timeout-ms: must be from 1 to 2147483647",
        ),
        (["curve-keypair", ""], 2, "curve-keypair: NAME '' names no file"),
        # (a traceback before: UnicodeEncodeError in msgpack; UnicodeError, idna; OverflowError)
        (["keys", "--prefix", b"\xff"], 2, "--prefix: expected text (UTF-8)"),
        (["evict", "--prefix", b"ns\xfe:"], 2, "--prefix: expected text (UTF-8)"),
        (["--server", b"\xff:5555", "status"], 2, "--server: '\\udcff' is not a valid host"),
        (["--server", "a..b:5555", "status"], 2, "--server: 'a..b' is not a valid host name"),
        (["monitor", "--once", "--interval", "1e12"], 2, "--interval: must be from 0 to 86400"),
        (["monitor", "--once", "--interval", "-1"], 2, "--interval: must be from 0 to 86400"),
    ],
)
def test_bad_input_is_one_line_and_an_exit_code(args, rc, message):
    proc = subprocess.run(
        [*maru_command(), *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == rc, proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_bad_server_url_in_the_environment_names_the_variable():
    env = {**os.environ, "MARU_SERVER_URL": "http://x:1"}
    proc = subprocess.run(
        [*maru_command(), "status"], env=env, capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("maru: $MARU_SERVER_URL: expected")


# -- evict / clear ---------------------------------------------------------------------------


def test_evict_prefix_drops_one_namespace_and_keeps_pinned(maru_server, writer):
    assert writer.pin("ns1:5")
    rc, text = run(maru_server.url, "evict", "--prefix", "ns1:")
    assert rc == 0
    assert text.strip() == "deleted 9 keys with prefix 'ns1:' (1 pinned or leased, kept)"
    _, text = run(maru_server.url, "keys", "--json")
    assert sorted(k["key"] for k in json.loads(text)["keys"]) == ["ns1:5", *NS2]
    assert writer.batch_exists(["ns1:0", "ns1:5", "ns2:0"]) == [False, True, True]
    with MaruAdmin(maru_server.url) as admin:
        inst = admin.stats()["instances"][writer.instance_id]
    assert (inst["keys"], inst["pages"]) == (4, 2 + 3)


def test_clear_needs_confirmation_then_deletes_everything(maru_server, writer):
    proc = subprocess.run(
        [*maru_command(), "--server", maru_server.url, "clear"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2
    assert "--yes" in proc.stderr
    with MaruAdmin(maru_server.url) as admin:
        assert admin.stats()["keys"] == 13  # nothing deleted
    rc, text = run(maru_server.url, "clear", "--yes")
    assert rc == 0
    assert text.strip() == "deleted 13 keys (0 pinned or leased, kept)"
    with MaruAdmin(maru_server.url) as admin:
        s = admin.stats()
    assert s["keys"] == 0 and s["live_bytes"] == 0
    assert s["counters"]["keys_deleted"] == 13


# -- monitor ---------------------------------------------------------------------------------


def test_monitor_once_renders_pool_hit_rate_and_throughput(maru_server, writer):
    stop = threading.Event()
    lookups = [0]

    def traffic() -> None:  # each lookup: exactly one hit and one miss
        for _ in range(100000):
            if stop.is_set():
                return
            writer.batch_retrieve(["ns2:0", "absent"])
            lookups[0] += 1

    thread = threading.Thread(target=traffic, daemon=True)
    thread.start()
    try:
        while lookups[0] == 0:  # traffic flows before the first sample
            thread.join(0.01)
        rc, frame = run(maru_server.url, "monitor", "--once", "--interval", "0.3")
    finally:
        stop.set()
        thread.join(10)
    assert rc == 0
    assert "\x1b[" not in frame  # --once prints plain text
    assert "Ctrl-C" not in frame  # it exits by itself
    assert re.search(r"\(rates over \d+\.\d+s\)$", frame.splitlines()[0])
    lines = {line.split()[0]: line for line in frame.splitlines() if line.strip()}
    assert lines["maru"].startswith(f"maru monitor  {maru_server.url}  up ")
    assert "16.0 MiB of 1.0 GiB" in lines["POOL"] and "1.6% in regions" in lines["POOL"]
    assert f"{STORED / 1024:.1f} KiB in 13 keys" in lines["STORED"]
    assert "evict above 95% down to 85%" in lines["STORED"]
    # every lookup in the interval was one hit and one miss
    assert re.search(r"HITS\s+50\.0% in the last \d+\.\d+s \((\d+) of (\d+) keys\)", frame)
    n_hit, n_all = map(int, re.search(r"\((\d+) of (\d+) keys\)", lines["HITS"]).groups())
    assert n_hit > 0 and n_all == 2 * n_hit
    lookup_rate = float(re.search(r"lookups ([\d.]+) keys/s", lines["RATE"]).group(1))
    assert lookup_rate > 0
    assert "stores 0.0 keys/s" in lines["RATE"]
    assert lines["STATE"].startswith("STATE   1 instances, 1 regions")
    instances = {r[0]: r for r in table_rows(frame, "INSTANCE")}
    assert instances[writer.instance_id][3] == "13"
    ops = {r[0]: r for r in table_rows(frame, "OP")}
    assert float(ops["lookup_kv"][1]) > 0  # REQ/S
    assert int(ops["lookup_kv"][2]) > 1  # COUNT: the writer's first lookup and the traffic


def test_monitor_loop_redraws_until_interrupted(maru_server, writer):
    args = build_parser().parse_args(["monitor", "--server", maru_server.url, "--interval", "0"])
    frames = []

    def fake_sleep(_seconds: float) -> None:
        frames.append(out.getvalue())
        if len(frames) == 2:
            raise KeyboardInterrupt

    out = io.StringIO()
    assert cmd_monitor(args, out, sleep=fake_sleep) == 0
    first, second = out.getvalue().split("maru monitor  ")[1:]  # not a tty: no ANSI codes
    assert "\x1b[" not in first + second
    assert "HITS    - (first sample)" in first
    assert "RATE    lookups - keys/s" in first
    assert re.search(r"HITS    no lookups in the last \d+\.\d+s", second)  # rates from frame 2
    assert "RATE    lookups 0.0 keys/s" in second


# -- help ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        ([], ["status", "stats", "keys", "monitor", "evict", "clear", "--server"]),
        (["status"], ["--server", "--timeout-ms"]),
        (["stats"], ["--json"]),
        (["keys"], ["--prefix", "--limit", "--json"]),
        (["monitor"], ["--interval", "--once"]),
        (["evict"], ["--prefix"]),
        (["clear"], ["--yes"]),
    ],
)
def test_help_everywhere(command, expected, capsys):
    with pytest.raises(SystemExit) as exc:
        main([*command, "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: maru")
    for word in expected:
        assert word in text


def test_console_script_help():
    proc = subprocess.run([*maru_command(), "--help"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and "monitor" in proc.stdout
    proc = subprocess.run([*maru_command()], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "usage: maru" in proc.stderr


def _monitor_on_a_terminal(url: str, env: dict[str, str]) -> tuple[int, str, str]:
    """`maru monitor` with its output on a pseudo-terminal (as an operator runs it), stopped
    with Ctrl-C (SIGINT) once a frame with the pool line was drawn, or at once if it exits."""
    import pty
    import select
    import signal
    import time

    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [*maru_command(), "--server", url, "monitor", "--interval", "0.2"],
        stdin=subprocess.DEVNULL,
        stdout=follower,
        stderr=subprocess.PIPE,
        env={**os.environ, **env, "TERM": "xterm", "COLUMNS": "160", "LINES": "60"},
        text=True,
    )
    os.close(follower)
    seen = b""
    deadline = time.monotonic() + 30
    try:
        while proc.poll() is None and b"POOL" not in seen and time.monotonic() < deadline:
            if select.select([leader], [], [], 0.5)[0]:
                try:
                    seen += os.read(leader, 65536)
                except OSError:  # (the process closed the terminal)
                    break
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        rc = proc.wait(30)
        while select.select([leader], [], [], 0.2)[0]:
            try:
                chunk = os.read(leader, 65536)
            except OSError:
                break
            if not chunk:
                break
            seen += chunk
    finally:
        os.close(leader)
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    return rc, seen.decode(errors="replace"), proc.stderr.read()


def test_monitor_on_a_terminal_is_drawn_by_rich(maru_server, writer):
    rc, screen, err = _monitor_on_a_terminal(maru_server.url, {})
    assert rc == 0, err
    assert "POOL" in screen and "Ctrl-C quits" in screen
    assert "\x1b[?1049h" in screen and "\x1b[?1049l" in screen  # its own screen, given back
    # its tables are rich tables: box-drawn borders around the columns, the writer a row
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen)  # (colours and cursor moves)
    assert re.search(r"┃ INSTANCE +┃ +PID ┃ +REGIONS ┃", text), text
    assert re.search(r"┃ OP +┃", text), text
    assert "┏━" in text and "┡━" in text and "└─" in text
    assert re.search(rf"│ {re.escape(writer.instance_id)} +│ +{os.getpid()} │", text), text


def test_monitor_live_view_draws_instance_ids_as_given_not_as_markup():
    """Instance ids are the clients' strings: rich must not read `[/x]` as markup (a
    MarkupError would end the live view)."""
    console_mod = pytest.importorskip("rich.console")
    ids = ["[/x]", "[bold]y"]
    frame = MonitorFrame(
        "maru monitor", tables=[Rows(["INSTANCE", "PID"], [[i, "1"] for i in ids], {1}, "-")]
    )
    console = console_mod.Console(file=io.StringIO(), width=80, color_system=None)
    console.print(rich_frame(frame))
    drawn = console.file.getvalue()
    assert all(re.search(rf"│ {re.escape(i)} +│ +1 │", drawn) for i in ids), drawn


def test_monitor_on_a_terminal_without_rich_names_the_extra(maru_server, tmp_path):
    blocker = tmp_path / "rich"
    blocker.mkdir()
    (blocker / "__init__.py").write_text("raise ImportError('rich is not installed here')\n")
    rc, screen, err = _monitor_on_a_terminal(maru_server.url, {"PYTHONPATH": str(tmp_path)})
    assert rc == 1 and "POOL" not in screen
    assert "needs the 'rich' package: pip install 'maru-kvcache[monitor]'" in err
