"""Benchmark hygiene: spreads over runs, quick runs never over headline files, the README table generated
from the headline JSON only."""

from __future__ import annotations

import json
import os
import py_compile
from pathlib import Path

import pytest

from benchmarks._common import bytecode_cached, result_path, spread
from benchmarks.readme_table import BEGIN, END, regenerate, table


def test_spread_is_min_median_max_over_runs() -> None:
    assert spread([3.0, 1.0, 2.0]) == {"min": 1.0, "median": 2.0, "max": 3.0, "runs": 3}
    with pytest.raises(ValueError, match="no runs"):
        spread([])


def test_a_quick_run_writes_next_to_the_headline_file(tmp_path: Path) -> None:
    assert result_path("rate_limit", quick=False, results_dir=tmp_path) == tmp_path / "rate_limit.json"
    assert result_path("rate_limit", quick=True, results_dir=tmp_path) == tmp_path / "rate_limit.quick.json"


def _turn_overhead(p50: float) -> dict[str, object]:
    return {
        "harness_ms": {"p50": p50, "p99": 2 * p50},
        "floor_ms": {"p50": 1.0, "p99": 2.0},
        "runs": {"ratio_p50": {"min": 2.0, "median": 3.0, "max": 4.0, "runs": 3}},
        "commit": {"sha": "0123456789abcdef", "dirty": False},
        "calibration": {"before": {"load_avg": [3.5, 1, 1], "busy": True, "cpu_loop_s": 0.126}},
        "environment": {"measured_at": "2026-11-30T12:00:00Z"},
    }


def test_the_table_reads_headline_files_only_and_says_what_is_missing(tmp_path: Path) -> None:
    # Given a headline turn_overhead result and a quick one with other numbers
    (tmp_path / "turn_overhead.json").write_text(json.dumps(_turn_overhead(9.0)))
    (tmp_path / "turn_overhead.quick.json").write_text(json.dumps(_turn_overhead(99.0)))
    # When the table is built
    text = table(tmp_path)
    # Then the headline numbers and their provenance are in it, the quick ones are not, and benchmarks
    # without a result say so
    row = next(line for line in text.splitlines() if "`turn_overhead`" in line)
    assert "9.0 ms" in row and "99.0" not in row
    assert "3.00 [2.00-4.00]" in row
    assert "`01234567`" in row and "busy machine (load 3.5, cpu loop 0.126 s)" in row
    assert "not measured yet" in next(line for line in text.splitlines() if "`rate_limit`" in line)


def test_the_readme_between_its_markers_is_replaced_and_nothing_else(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{BEGIN}\nold table\n{END}\nrest\n")
    new = regenerate(readme, tmp_path)
    assert new.startswith("intro\n") and new.endswith(f"{END}\nrest\n")
    assert "old table" not in new and "| benchmark |" in new


def test_the_chaos_row_shows_every_judge_and_says_when_seeds_ran_at_different_commits(tmp_path: Path) -> None:
    # Given a chaos result merged from two invocations at different commits, with one orphan
    seeds = [{"duration_s": s} for s in (200.0, 250.0, 300.0)]
    result = {
        "seeds": [0, 1, 2],
        "trajectories": 100,
        "terminal": 300,
        "handed_off": 0,
        "lost": 0,
        "duplicate_effects": 0,
        "orphaned": 1,
        "over_budget": 0,
        "lost_acked_entries": 0,
        "tether_run_survived": 3,
        "faults_injected": {"redis_restart": 3},
        "per_seed": seeds,
        "commit": "0123456789abcdef+dirty",
        "commits_per_chunk": ["0123456789abcdef+dirty", "fedcba9876543210"],
        "environment": {"measured_at": "2026-12-01T06:00:00Z"},
    }
    (tmp_path / "chaos.json").write_text(json.dumps(result))
    row = next(line for line in table(tmp_path).splitlines() if "`chaos`" in line)
    # Then the orphan, the mixed commits and the per-seed spread are in it, with the commit as provenance
    assert "orphaned 1" in row and "across 2 commits" in row and "250 s [200-300] per seed" in row
    assert "`01234567`+local changes" in row and "load not recorded" in row


def test_the_control_latency_row_says_whether_the_parked_fleet_was_measured(tmp_path: Path) -> None:
    live = {
        "trajectories": 100,
        "record_ms": {"p50": 8.0, "p99": 32.0},
        "kill_ms": {"p50": 45.0, "p99": 90.0},
        "kill_burst_ms": {"p50": 500.0, "p99": 700.0},
        "hibernated_bytes": {"mean": 8000},
    }
    (tmp_path / "control_latency.json").write_text(json.dumps(live))
    assert "parked fleet not measured" in table(tmp_path)
    parked = {
        "n": 300,
        "approve_all_s_each": [519.2, 480.0, 500.0],
        "interrupt_ms": {"p50": 27.0, "p99": 71.2},
        "stuck": {"entries": 51, "interrupt_ms": {"p50": 6.0, "p99": 11.0}},
        "commit": "0123456789abcdef",
    }
    (tmp_path / "control_latency.json").write_text(json.dumps({**live, "parked": parked}))
    row = next(line for line in table(tmp_path).splitlines() if "`control_latency`" in line)
    assert "300 parked trajectories" in row and "519, 480, 500 s (3 repetitions)" in row
    assert "p50/p99 27 / 71 ms meanwhile" in row and "11 ms p99 beside 51 stuck entries" in row
    assert "(01234567)" in row
    counted = {
        **live,
        "samples": {"kill": 200},
        "kill_p99_ms_over_rounds": {"min": 80, "median": 90, "max": 120},
    }
    (tmp_path / "control_latency.json").write_text(json.dumps(counted))
    row = next(line for line in table(tmp_path).splitlines() if "`control_latency`" in line)
    assert "45 / 90 ms one at a time (200 kills, p99 per round 90 [80-120] ms)" in row
    mixed = {**parked, "commits_per_repetition": ["fedcba9876+dirty", "0123456789abcdef", "0123456789abcdef"]}
    (tmp_path / "control_latency.json").write_text(json.dumps({**live, "parked": mixed}))
    row = next(line for line in table(tmp_path).splitlines() if "`control_latency`" in line)
    assert "parked fleet (fedcba98+local changes, 01234567)" in row


def test_bytecode_cached_is_the_share_of_product_modules_with_current_bytecode(tmp_path: Path) -> None:
    # Given two product modules and no compiled bytecode
    modules = [tmp_path / "runtime" / "a.py", tmp_path / "actors" / "b.py"]
    for module in modules:
        module.parent.mkdir()
        module.write_text("X = 1\n")
    assert bytecode_cached(tmp_path) == 0.0
    # When one is compiled, then both
    py_compile.compile(str(modules[0]))
    assert bytecode_cached(tmp_path) == 0.5
    py_compile.compile(str(modules[1]))
    assert bytecode_cached(tmp_path) == 1.0
    # Then a source edited after its bytecode was written no longer counts
    later = os.stat(modules[1]).st_mtime + 10
    os.utime(modules[1], (later, later))
    assert bytecode_cached(tmp_path) == 0.5


def test_the_model_path_row_lists_prompt_lengths_in_order_with_each_paths_spread(tmp_path: Path) -> None:
    def cpu(median: float) -> dict[str, object]:
        return {"cpu_ms_per_call": {"min": median - 1, "median": median, "max": median + 1, "runs": 3}}

    # Given a result whose prompt lengths come back from JSON sorted as text ("10" before "2")
    result = {
        "by_rounds": {
            str(rounds): {
                "messages": 2 * rounds + 2,
                "tether": cpu(t),
                "sdk_create": cpu(c),
                "aiohttp_floor": cpu(1),
            }
            for rounds, t, c in ((10, 4.0, 9.0), (2, 3.0, 6.0))
        },
        "commit": {"sha": "0123456789abcdef", "dirty": False},
    }
    (tmp_path / "model_path.json").write_text(json.dumps(result, sort_keys=True))
    row = next(line for line in table(tmp_path).splitlines() if "`model_path`" in line)
    # Then the shorter prompt comes first, and each figure carries its spread over runs
    assert row.index("6 messages") < row.index("22 messages")
    assert "**tether** 3.0 ms [2.0-4.0]" in row and "SDK `create` 9.0 ms [8.0-10.0]" in row
