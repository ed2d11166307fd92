"""The on-time sweep's arithmetic (``benchmarks/_on_time.py``): turn periods inside the window, lateness,
silent trajectories, and the largest count that was on time."""

from __future__ import annotations

import pytest

from benchmarks._on_time import (
    ON_TIME_S,
    SCRIPT_TURNS,
    entry_ms,
    largest_on_time,
    summarise_step,
    sweep_scenario,
    tolerant_supervision,
    turn_parts_s,
    turn_periods_s,
)


def test_a_stream_id_gives_the_server_time_in_ms() -> None:
    assert entry_ms(b"1796694757597-3") == 1796694757597
    assert entry_ms("17-0") == 17


def test_only_turns_that_both_start_inside_the_window_make_a_period() -> None:
    # turn starts at 0, 20.5, 41, 61.2 s; the window holds the middle two and the last
    starts = [0, 20_500, 41_000, 61_200]
    assert turn_periods_s(starts, 10_000, 70_000) == [20.5, 20.2]
    assert turn_periods_s(starts, 10_000, 30_000) == []


def _turns(starts_ms: list[int]) -> list[tuple[str, int]]:
    """A log whose turns start at ``starts_ms``: each a 40 ms model call, then its sleep dispatched."""
    log: list[tuple[str, int]] = []
    for ms in starts_ms:
        if log:
            log.append(("tool_result_accepted", ms))
        log += [("turn_started", ms), ("model_call_intent", ms), ("model_call_settled", ms + 40)]
        log.append(("tool_dispatch_intent", ms + 40))
    return log


def test_a_step_counts_lateness_beyond_the_sleep_and_the_silent_ones() -> None:
    logs = {
        "on-time": _turns([0, 20_100, 40_150, 60_200]),
        "late": _turns([0, 22_000, 44_000]),
        "silent": _turns([-5_000]),  # its last turn began before the window
    }
    row = summarise_step(3, logs, (0, 60_200), 20.0, [0.001, 0.002])
    assert row["periods"] == 5
    assert row["silent"] == 1
    assert row["lateness_s"]["max"] == pytest.approx(2.0)
    assert row["lateness_s"]["p50"] == pytest.approx(0.1)
    assert row["on_time"] is False  # one silent, and a turn 2 s late


def test_the_parts_say_where_a_late_turn_waited() -> None:
    # a 20 s sleep whose result came 1.5 s late, a next turn 0.2 s after it, a model call of 2.5 s
    log = [
        ("tool_dispatch_intent", 0),
        ("tool_result_accepted", 21_500),
        ("turn_started", 21_700),
        ("model_call_intent", 21_700),
        ("model_call_settled", 24_200),
        ("tool_dispatch_intent", 24_200),
    ]
    parts = turn_parts_s(log, 0, 30_000, 20.0)
    assert parts["sleep_overrun"] == [pytest.approx(1.5)]
    assert parts["next_turn"] == [pytest.approx(0.2)]
    assert parts["model"] == [pytest.approx(2.5)]
    assert turn_parts_s(log, 25_000, 30_000, 20.0) == {name: [] for name in parts}  # all before the window


def test_a_step_is_on_time_when_its_p99_is_within_the_bound_and_none_is_silent() -> None:
    logs = {f"t{i}": _turns([0, 20_050, 40_100]) for i in range(4)}
    assert summarise_step(4, logs, (0, 40_100), 20.0, [])["on_time"] is True
    late = {**logs, "t0": _turns([0, int((20.0 + ON_TIME_S + 0.5) * 1000)])}
    assert summarise_step(4, late, (0, 40_100), 20.0, [])["on_time"] is False


def test_a_step_with_no_periods_is_not_on_time() -> None:
    row = summarise_step(2, {"a": _turns([10]), "b": _turns([20])}, (0, 100), 20.0, [])
    assert row["lateness_s"]["p99"] is None and row["on_time"] is False


def test_the_largest_on_time_count_stops_at_the_first_late_step() -> None:
    rows = [
        {"live": 32, "on_time": True},
        {"live": 64, "on_time": True},
        {"live": 96, "on_time": False},
        {"live": 128, "on_time": True},  # on time again after a late step: not counted
    ]
    assert largest_on_time(rows) == 64
    assert largest_on_time([{"live": 32, "on_time": False}]) == 0


def test_the_scenario_and_the_watchdogs_let_every_scripted_turn_run() -> None:
    assert sweep_scenario(20.0).count('"sleep"') == SCRIPT_TURNS
    watchdog = tolerant_supervision().call_watchdog()
    assert watchdog.exact_limit == SCRIPT_TURNS and watchdog.coarse_limit == SCRIPT_TURNS


def test_the_readme_row_gives_each_step_over_runs_and_the_largest_on_time() -> None:
    from benchmarks.readme_table import node_capacity_on_time

    def row(live: int, p99: float | None, silent: int = 0) -> dict[str, object]:
        return {
            "live": live,
            "silent": silent,
            "lateness_s": {"p99": p99},
            "floor_late_s": {"p99": 0.004},
        }

    data = {
        "settings": {"sleep_s": 20.0},
        "on_time": {
            "on_time_s": 1.0,
            "default_trajectory_slots": 128,
            "largest_on_time": {"min": 32, "median": 64, "max": 64, "runs": 2},
            "runs": [
                {"rows": [row(32, 0.2), row(64, 0.9)]},
                {"rows": [row(32, 0.4), row(64, 3.5, silent=2)]},
            ],
        },
    }
    text = node_capacity_on_time(data)
    assert "**64 [32-64]**" in text
    assert "32: 0.30 s [0.20-0.40] (floor 0.004 s)" in text
    assert "64: 2.20 s [0.90-3.50], 2 silent" in text
