"""bench_regimes' verdicts and table (issue 42's targets), on made-up figures: no server, no
SGLang, no timing."""

from __future__ import annotations

import sys
from pathlib import Path

from pytest import approx

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_regimes as R


def _round(full: float, never: float, first: float) -> dict[str, float]:
    """One round's figures: the copies at 20 GB/s, touched sets and second reads at 10;
    `full`, `never` and `first` the ratios the targets judge."""
    out = {"stream_set": 20.0, "stream_get": 20.0, "touched_set": 10.0, "second_get": 10.0}
    out |= {"full_stream_set": 20.0, "full_set": 20.0 * full, "full_vs_stream": full}
    out |= {"never_set": 10.0 * never, "never_vs_touched": never}
    out |= {"first_get": 10.0 * first, "first_vs_second": first}
    out |= {"early_first_vs_second": 0.5, "connect_ms": 12.0}
    out |= {f"{f}_faults_per_mib": 0.0 for f in R.FAULTS}
    return out


def test_each_page_size_is_judged_against_its_own_goal():
    summary = {
        "64 KiB": _round(full=0.76, never=0.49, first=0.61),  # 75%: PASS, 0.50: MISS, PASS
        "1 MiB": _round(full=0.84, never=0.51, first=0.59),  # 85%: MISS, PASS, 0.60: MISS
    }
    got = {(key, size): (v, ok) for key, size, v, _goal, ok in R.evaluate(summary)}
    assert got == {
        ("full_vs_stream", "64 KiB"): (approx(0.76), True),
        ("full_vs_stream", "1 MiB"): (approx(0.84), False),
        ("never_vs_touched", "64 KiB"): (approx(0.49), False),
        ("never_vs_touched", "1 MiB"): (approx(0.51), True),
        ("first_vs_second", "64 KiB"): (approx(0.61), True),
        ("first_vs_second", "1 MiB"): (approx(0.59), False),
    }


def test_the_table_shows_gbps_the_share_of_the_copy_and_the_verdicts():
    summary = {"64 KiB": _round(0.05, 0.12, 0.44), "1 MiB": _round(0.9, 0.6, 0.7)}
    lines = R.render(summary)
    assert lines[0] == "| regime | 64 KiB | 1 MiB | target | result |"
    rows = {line.split(" | ")[0].lstrip("| "): line for line in lines[2:]}
    assert len(rows) == len(R.ROWS)
    full = rows["`batch_set_v1`, the instance's `maru_pool_size` full (every write needs room)"]
    assert full.endswith(
        "| 1.0 GB/s (5%) | 18.0 GB/s (90%) | >= 75% / 85% of the copy | MISS / PASS |"
    )
    never = rows["`batch_set_v1` into pages this process never touched (cap not reached)"]
    assert "| 1.2 GB/s (6%) | 6.0 GB/s (30%) |" in never  # of the stream copy's 20
    assert rows["never-touched / touched"].endswith(
        "| 0.12 | 0.60 | >= 0.50 of touched | MISS / PASS |"
    )
    assert rows["first / second"].endswith("| 0.44 | 0.70 | >= 0.60 of the second | MISS / PASS |")
    # figures beside the targets are shown and never judged
    early = rows["first / second, the reader connected before the writer took its regions"]
    assert early.endswith("| 0.50 | 0.50 |  |  |")


def test_one_page_size_alone_and_medians_over_rounds():
    rounds = [_round(0.7, 0.4, 0.5), _round(0.8, 0.6, 0.9), _round(0.9, 0.5, 0.1)]
    summary = {"1 MiB": R.summarize(rounds)}
    assert summary["1 MiB"]["full_vs_stream"] == approx(0.8)
    assert summary["1 MiB"]["never_vs_touched"] == approx(0.5)
    assert summary["1 MiB"]["first_vs_second"] == approx(0.5)
    lines = R.render(summary)
    assert lines[0] == "| regime | 1 MiB | target | result |"
    assert [size for _key, size, *_ in R.evaluate(summary)] == ["1 MiB"] * 3


def test_before_and_after_side_by_side(tmp_path):
    """`--before` / `--after`: the median of each side's runs, and each verdict's change."""
    paths = {}
    for name, ratios in (
        ("b1", (0.02, 0.05, 0.30)),
        ("b2", (0.04, 0.07, 0.40)),
        ("a1", (0.80, 0.60, 0.90)),
    ):
        run = {size: _round(*ratios) for size in R.CASES}
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(R.json.dumps({"summary": run}))
    before = R.load_summaries([str(paths["b1"]), str(paths["b2"])])
    after = R.load_summaries([str(paths["a1"])])
    assert before["1 MiB"]["first_vs_second"] == approx(0.35)
    lines = R.render_compare(before, after)
    assert lines[0] == (
        "| regime | 64 KiB before | 64 KiB after | 1 MiB before | 1 MiB after | target | result |"
    )
    (full,) = [line for line in lines if "`maru_pool_size` full" in line]
    assert full.endswith(
        "| 0.6 GB/s (3%) | 16.0 GB/s (80%) | 0.6 GB/s (3%) | 16.0 GB/s (80%) "
        "| >= 75% / 85% of the copy | MISS -> PASS / MISS -> MISS |"
    )


def test_the_idle_memory_probe_measures_each_sleep_and_says_its_verdict():
    import probe_idle_memory as P

    speeds = P.write_speeds(mib=8, sleeps=(0.0, 0.01))
    assert list(speeds) == [0.0, 0.01]
    assert all(first > 0 and again > 0 for first, again in speeds.values())
    assert P.idle_verdict(mib=8).startswith("idle-memory probe: ")
