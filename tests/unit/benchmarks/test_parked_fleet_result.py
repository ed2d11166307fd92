"""The parked fleet's result: each repetition keeps its own percentiles and commit, so repetitions measured
in separate invocations (``--append``) summarise honestly together."""

from __future__ import annotations

import pytest

from benchmarks.control_latency import append_parked, summarise_parked


def _repetition(approve_s: float, p50: float, p99: float, at: str) -> dict[str, object]:
    return {
        "n": 300,
        "approve_all_s": approve_s,
        "interrupts": 100,
        "interrupt_ms": {"p50": p50, "p99": p99},
        "interrupt_idle_ms": {"p50": 5.0, "p99": p99 / 2},
        "commit": at,
    }


def _setup(woken: int, slots: int = 24) -> dict[str, object]:
    return {"trajectory_slots": slots, "woken_by_relays": woken}


def test_the_summary_is_the_median_p50_and_the_worst_p99_over_repetitions() -> None:
    reps = [
        _repetition(500.0, 20.0, 60.0, "a"),
        _repetition(520.0, 30.0, 90.0, "a"),
        _repetition(510.0, 25.0, 70.0, "a"),
    ]
    result = summarise_parked(reps, stuck={"entries": 51}, setup=_setup(900))
    assert result["approve_all_s"] == 510.0 and result["approve_all_s_each"] == [500.0, 520.0, 510.0]
    assert result["interrupt_ms"] == {"p50": 25.0, "p99": 90.0}
    assert result["interrupt_idle_ms"] == {"p50": 5.0, "p99": 45.0}
    assert result["interrupt_samples"] == 300 and result["commits_per_repetition"] == ["a", "a", "a"]
    with pytest.raises(ValueError, match="no parked-fleet repetitions"):
        summarise_parked([], stuck={}, setup=_setup(0))


def test_appending_to_a_one_repetition_result_written_before_repetitions_kept_their_own_figures() -> None:
    old_rep = {"n": 300, "approve_all_s": 519.2, "interrupts": 1772, "park_s": 500.9}
    previous = {
        "n": 300,
        "approve_all_s_each": [519.2],
        "interrupt_ms": {"p50": 27.0, "p99": 71.16},
        "interrupt_idle_ms": {"p50": 6.0, "p99": 31.83},
        "repetitions": [old_rep],
        "commit": "old+dirty",
        "setup": _setup(300),
    }
    new = summarise_parked(
        [_repetition(480.0, 20.0, 50.0, "new"), _repetition(490.0, 22.0, 65.0, "new")],
        stuck={"entries": 51, "from": "new"},
        setup=_setup(600),
    )
    merged = append_parked(previous, new)
    assert merged["approve_all_s_each"] == [519.2, 480.0, 490.0] and merged["approve_all_s"] == 490.0
    assert merged["interrupt_ms"] == {"p50": 22.0, "p99": 71.16}  # the old repetition's p99 is the worst
    assert merged["commits_per_repetition"] == ["old+dirty", "new", "new"] and merged["commit"] == "new"
    assert merged["setup"]["woken_by_relays"] == 900 and merged["stuck"]["from"] == "new"
    assert merged["interrupt_samples"] == 1972
    assert "interrupt_ms" not in old_rep  # the stored result is not modified


def test_appending_refuses_a_different_fleet() -> None:
    base = summarise_parked([_repetition(500.0, 20.0, 60.0, "a")], stuck={}, setup=_setup(300))
    other_n = summarise_parked([{**_repetition(500.0, 20.0, 60.0, "b"), "n": 50}], stuck={}, setup=_setup(50))
    with pytest.raises(ValueError, match="50 parked trajectories, the stored result has 300"):
        append_parked(base, other_n)
    other_slots = summarise_parked(
        [_repetition(500.0, 20.0, 60.0, "b")], stuck={}, setup=_setup(300, slots=8)
    )
    with pytest.raises(ValueError, match="trajectory_slots 8 differs from 24"):
        append_parked(base, other_slots)
