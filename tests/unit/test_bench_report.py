"""bench_hicache's verdicts (issue 17's targets) and the result files every benchmark writes
(benchmarks/report.py), on made-up figures: no server, no SGLang."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from pytest import approx

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_hicache as H
from report import finish, paired_rounds, print_paired


def _result(case, gbps: dict[str, float]) -> dict:
    """One case's result as `bench_case` returns it, two repetitions of the same figures."""
    return {
        "case": case,
        "page_bytes": case.page_bytes,
        "parts": 2,
        "pages": 128,
        "batch": 128,
        "gbps": {k: [v, v] for k, v in gbps.items()},
        "lat": {},
    }


def _figures(maru_get: float, maru_set: float) -> dict[str, float]:
    """memcpy 10, shm 12, stream 20 GB/s both ways: the limit is the stream's 20."""
    out = {}
    for op in ("set", "get"):
        out |= {f"memcpy_{op}": 10.0, f"shm_{op}": 12.0, f"stream_{op}": 20.0}
        out |= {f"checked_{op}": 2.0, f"file_{op}": 1.0}
    out |= {"maru_get": maru_get, "maru_set": maru_set, "request_get": 5.0}
    return out


def _meta(batch_us: float, single_us: float) -> dict:
    return {"maru/exists128": [batch_us * 1e-6], "maru/exists1": [single_us * 1e-6]}


def _keys(ratio: float) -> list[dict]:
    rows = []
    for n, scale in ((10**3, 1.0), (10**6, ratio)):
        for path in ("maru", "request"):
            worse = 10.0 if path == "request" else 1.0  # the request path is not judged
            rows.append(
                {
                    "keys": n,
                    "path": path,
                    "exists_med_us": 1.0 * scale * worse,
                    "exists128_us_per_key": 0.04 * scale * worse,
                    "get_ms": 0.5 * scale * worse,
                }
            )
    return rows


def _verdicts(results, meta, keys) -> dict[str, tuple[float, bool]]:
    rows = H.build_rows(results)
    return {name: (v, ok) for name, v, _goal, ok in H.evaluate(rows, meta, keys)}


def test_throughput_is_judged_against_the_fastest_copy_and_by_page_size():
    small, big = H.CASES[0], H.CASES[1]  # 64 KiB, 1 MiB
    results = [
        _result(small, _figures(maru_get=19.2, maru_set=18.2)),  # 96%, 91%
        _result(big, _figures(maru_get=19.2, maru_set=17.8)),  # 96% (< 97%), 89%
    ]
    got = _verdicts(results, _meta(0.04, 1.5), _keys(1.1))
    assert got["mha-64K batch_get_v1 / limit"] == (approx(0.96), True)
    assert got["mha-64K batch_set_v1 / limit"] == (approx(0.91), True)
    assert got["mha-1M batch_get_v1 / limit"] == (approx(0.96), False)  # >= 97% from 1 MiB
    assert got["mha-1M batch_set_v1 / limit"] == (approx(0.89), False)
    # the old limit (faster of memcpy and shm) stays in the rows, not in the verdicts
    rows = {(r["case"], r["op"], r["backend"]): r for r in H.build_rows(results)}
    assert rows[("mha-64K", "get", "maru")]["vs_memcpy"] == approx(1.6)
    # the request path is shown (a get row, no set row) but not judged
    assert ("mha-64K", "get", "request") in rows and ("mha-64K", "set", "request") not in rows
    assert not [name for name in got if "request" in name]


def test_metadata_and_key_scaling_targets():
    results = [_result(H.CASES[0], _figures(19.2, 18.2))]
    met = _verdicts(results, _meta(0.04, 1.5), _keys(1.1))
    assert met["MaruStorage.batch_exists, 128 keys: us/key"] == (approx(0.04), True)
    assert met["MaruStorage.exists, one key (median): us"] == (approx(1.5), True)
    scaling = {k: v for k, v in met.items() if "at 1e+06 / at 1e+03 keys" in k}
    assert len(scaling) == 3 and all(ok for _, ok in scaling.values())
    missed = _verdicts(results, _meta(0.06, 2.5), _keys(1.3))
    assert not missed["MaruStorage.batch_exists, 128 keys: us/key"][1]
    assert not missed["MaruStorage.exists, one key (median): us"][1]
    assert not any(ok for k, (_, ok) in missed.items() if "at 1e+06" in k)


def test_back_to_back_is_shown_beside_the_after_idle_ratio_and_never_judged():
    small, big = H.CASES[0], H.CASES[1]
    measured = _result(small, _figures(maru_get=18.0, maru_set=12.0))  # after idle: 90%, 60%
    measured["back_to_back"] = {
        "maru_set": [19.0, 19.8],  # 95%, 99% of the stream's 20: median 97%
        "stream_set": [20.0, 20.0],
        "maru_get": [19.6, 19.6],
        "stream_get": [20.0, 20.0],
    }
    plain = _result(big, _figures(maru_get=19.2, maru_set=17.8))  # (not measured: no rows)
    assert H.back_to_back_ratios(measured) == {
        "set": (approx(0.97), approx(0.6)),
        "get": (approx(0.98), approx(0.9)),
    }
    assert H.back_to_back_ratios(plain) == {}
    lines = H.render_back_to_back([measured, plain])
    assert "| mha-64K | set | 97% | 60% |" in lines and "| mha-64K | get | 98% | 90% |" in lines
    assert not [line for line in lines if "mha-1M" in line]
    assert H.render_back_to_back([plain]) == []
    got = _verdicts([measured, plain], _meta(0.04, 1.5), _keys(1.1))
    assert got["mha-64K batch_set_v1 / limit"] == (approx(0.6), False)  # the target: after idle


def test_finish_writes_one_stem_of_files_and_the_footer(tmp_path, capsys):
    machine: dict = {"cpu": "x"}
    written = []

    def write_csv(path: Path) -> None:
        path.write_text("a,b\n")
        written.append(path)

    base = finish(
        "demo",
        tmp_path / "out",
        "TABLE",
        {"machine": machine, "rows": [1]},
        machine,
        0.0,
        write_csv=write_csv,
        plot=lambda path: False,  # no matplotlib
        quick=True,
        label="v1.2",  # a dot must not eat the stem
    )
    assert base.name.startswith("demo-") and base.name.endswith("-v1.2-quick")
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert names == sorted(f"{base.name}{ext}" for ext in (".csv", ".json", ".md"))
    assert written == [base.with_name(base.name + ".csv")]
    doc = json.loads(base.with_name(base.name + ".json").read_text())
    assert doc["rows"] == [1] and "load_after" in doc["machine"]
    md = base.with_name(base.name + ".md").read_text()
    assert md.startswith("TABLE\n\n1-min load at end ") and "run took" in md
    out = capsys.readouterr().out
    assert "TABLE" in out and "(no matplotlib: no PNG)" in out


def test_a_benchmark_run_leaves_its_plot_beside_its_tables(tmp_path, monkeypatch):
    """matplotlib is in the `dev` extra: a run draws its PNG, never "matplotlib not
    installed: no plot"."""
    import bench_sglang_ttft as T

    monkeypatch.setattr(T, "RESULTS", tmp_path)
    row = {"a": 1.0, "b": 0.2, "c": 0.3, "d": 0.35}
    summary = [{"backend": b, "tokens": 512, **row} for b in ("maru", "file")]
    png = T.plot(summary, [512])
    assert png == tmp_path / "sglang_ttft.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_hicache_plot_is_written_where_it_is_asked(tmp_path, monkeypatch):
    """`bench_hicache.plot` wrote its picture to `request.png` in the working directory (a
    loop variable of the key-scaling panel shadowed its `path`), not beside the tables."""
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    keys = [
        {"path": way, "keys": n, "exists_med_us": 1.0, "exists128_us_per_key": 0.1,
         "get_ms": 1.0, "rtt_med_us": 50.0}
        for way in ("maru", "request") for n in (1000, 10000)
    ]  # fmt: skip
    target = tmp_path / "out" / "hicache.png"
    target.parent.mkdir()
    assert H.plot(target, [], [], keys)
    assert target.exists() and not list(tmp_path.glob("request*"))


def test_paired_rounds_run_each_turn_once_a_round_in_varying_orders(capsys):
    order: list[str] = []
    seconds = {"A": 2.0, "B": 1.0, "stream": 0.5}

    def turn(name: str):
        def run() -> float:
            order.append(name)
            return seconds[name] + len(order) * 1e-6  # (a drift every version shares)

        return run

    times = paired_rounds({name: turn(name) for name in seconds}, rounds=6, warmup=2)
    assert {name: len(t) for name, t in times.items()} == {"A": 6, "B": 6, "stream": 6}
    rounds = [tuple(order[i : i + 3]) for i in range(0, len(order), 3)]
    assert len(rounds) == 8 and all(sorted(r) == ["A", "B", "stream"] for r in rounds)
    assert len(set(rounds)) > 1  # (the order is not fixed: drift would favour one version)
    print_paired(times, per=2)
    out = capsys.readouterr().out
    assert "| A | 1000.00" in out and "| B | 500.00" in out  # (ms a call: 2 calls a turn)
    assert "median 2.000" in out and "B faster in 6 of 6" in out
