"""Semantic watchdogs: each detector fires on its pattern and stays quiet on healthy progress."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from runtime.fingerprint import call_fingerprint, coarse_fingerprint, state_digest
from runtime.watchdog import (
    Guard,
    WatchdogConfig,
    WatchdogConfigError,
    WatchdogState,
    WatchdogStep,
    WatchdogVerdict,
    inspect,
    recurrence_period,
)


def step(
    tool: str, args: dict[str, Any], workspace: dict[str, str], *, waiting: bool = False
) -> WatchdogStep:
    return WatchdogStep(
        call_fingerprint=call_fingerprint(tool, args),
        coarse_fingerprint=coarse_fingerprint(tool, args, ["path"]),
        state_digest=state_digest(workspace),
        waiting_on_job=waiting,
    )


def run(steps: Sequence[WatchdogStep], config: WatchdogConfig = WatchdogConfig()) -> list[WatchdogVerdict]:
    state = WatchdogState(config)
    verdicts = []
    for s in steps:
        state, verdict = state.observe(s)
        verdicts.append(verdict)
    return verdicts


def healthy(n: int) -> list[WatchdogStep]:
    """Each step edits a different file and the workspace advances."""
    return [step("edit", {"path": f"f{i}.py", "text": "x"}, {"rev": str(i)}) for i in range(n)]


def first_firing(verdicts: Sequence[WatchdogVerdict]) -> tuple[int, Guard | None]:
    for i, v in enumerate(verdicts):
        if v.fired:
            return i, v.guard
    return -1, None


def test_healthy_progress_never_fires() -> None:
    assert first_firing(run(healthy(40))) == (-1, None)


def test_exact_repeat_fires_on_the_third_identical_call() -> None:
    # Given the agent re-running the same failing test while the workspace still changes (a log file grows)
    steps = [step("run_tests", {"target": "db"}, {"rev": str(i)}) for i in range(5)]
    # When observed; Then the guard fires on the third identical call (§4.4: "made three times")
    index, guard = first_firing(run(steps))
    assert (index, guard) == (2, Guard.EXACT_REPEAT)


def test_exact_repeat_tolerates_spaced_repetition_outside_the_window() -> None:
    # Given the same poll every 6 steps with real work between
    steps = []
    for i in range(30):
        if i % 6 == 0:
            steps.append(step("poll_job", {"job": "j1"}, {"rev": str(i)}))
        else:
            steps.append(step("edit", {"path": f"f{i}.py"}, {"rev": str(i)}))
    # Then no more than two polls fall in any 10-step window: nothing fires
    assert first_firing(run(steps)) == (-1, None)


def test_trivial_variation_fires_where_the_exact_detector_is_evaded() -> None:
    # Given the same grep on one file, varied by a space, case or a comment each time (§4.5)
    variants = ["TODO", "TODO ", "todo", "TODO  ", "Todo", "TODO   "]
    steps = [
        step("grep", {"path": "src/app.py", "pattern": p, "n": i}, {"rev": str(i)})
        for i, p in enumerate(variants)
    ]
    # Then the coarse detector fires at the fifth variant
    index, guard = first_firing(run(steps))
    assert (index, guard) == (4, Guard.TRIVIAL_VARIATION)


def test_oscillation_between_two_states_fires_after_two_recurrences() -> None:
    # Given the agent toggling between two patches: A, B, A, B
    a, b = {"pool.py": "size=5"}, {"pool.py": "size=50"}
    steps = [step("edit", {"path": "pool.py", "v": i}, ws) for i, ws in enumerate([a, b, a, b, a])]
    # Then the cycle guard fires at the second recurrence (step 3)
    verdicts = run(steps, WatchdogConfig(coarse_limit=10, coarse_window=10))
    index, guard = first_firing(verdicts)
    assert (index, guard) == (3, Guard.CYCLE)
    assert verdicts[3].findings[0].step_indices == (2, 3)


def test_a_single_planned_backtrack_is_not_a_cycle() -> None:
    # Given A, B, back to A, then onward to C, D
    states = [{"r": "A"}, {"r": "B"}, {"r": "A"}, {"r": "C"}, {"r": "D"}, {"r": "E"}]
    steps = [step("edit", {"path": f"f{i}"}, ws) for i, ws in enumerate(states)]
    assert first_firing(run(steps)) == (-1, None)


def test_three_cycle_is_detected_within_the_history() -> None:
    states = [{"r": s} for s in "ABCABC"]
    steps = [step("edit", {"path": f"f{i}"}, ws) for i, ws in enumerate(states)]
    index, guard = first_firing(run(steps))
    assert (index, guard) == (4, Guard.CYCLE)


def test_stagnation_fires_when_state_does_not_advance() -> None:
    # Given different reads that change nothing in the tracked state
    steps = [step("read", {"path": f"doc{i}.md"}, {"rev": "r18"}) for i in range(8)]
    # Then the stagnation guard fires after five non-advancing steps
    index, guard = first_firing(run(steps))
    assert (index, guard) == (5, Guard.STAGNATION)


def test_polling_a_pending_job_is_not_stagnation() -> None:
    # Given the workspace unchanged while a background test runs and the agent polls different job pages
    steps = [step("edit", {"path": "a.py"}, {"rev": "r18"})]
    steps += [
        step("job_status", {"job": "test_r18", "page": i}, {"rev": "r18"}, waiting=True) for i in range(5)
    ]
    steps += [step("job_status", {"job": "test_r18"}, {"rev": "r18"}, waiting=True) for _ in range(5)]
    # Then nothing fires: not stagnation, not repetition, not variation
    assert first_firing(run(steps)) == (-1, None)
    # But the same steps without the pending job are flagged
    unmarked = [WatchdogStep(s.call_fingerprint, s.coarse_fingerprint, s.state_digest) for s in steps]
    assert first_firing(run(unmarked))[1] is not None


def test_a_stale_pattern_does_not_keep_firing_on_a_healthy_step() -> None:
    steps = [step("run_tests", {"target": "db"}, {"rev": str(i)}) for i in range(3)]
    steps.append(step("edit", {"path": "fix.py"}, {"rev": "fixed"}))
    verdicts = run(steps)
    assert verdicts[2].guard is Guard.EXACT_REPEAT
    assert not verdicts[3].fired


def test_findings_name_real_step_numbers_after_the_window_slides() -> None:
    steps = [*healthy(30), *[step("run_tests", {"target": "db"}, {"rev": f"x{i}"}) for i in range(3)]]
    verdict = run(steps)[-1]
    assert verdict.guard is Guard.EXACT_REPEAT
    assert verdict.findings[0].step_indices == (30, 31, 32)


def test_inspect_is_pure_and_empty_history_is_quiet() -> None:
    assert not inspect([]).fired
    history = [step("run_tests", {"target": "db"}, {"rev": str(i)}) for i in range(3)]
    assert inspect(history) == inspect(list(history))


def test_recurrence_period_matches_listing_1() -> None:
    assert recurrence_period(["a", "b", "c"], "c") == 1
    assert recurrence_period(["a", "b", "c"], "b") == 2
    assert recurrence_period(["a", "b", "c"], "z") is None


@pytest.mark.parametrize(
    ("overrides", "where"),
    [
        ({"exact_limit": 1}, "watchdog.exact_limit"),
        ({"exact_limit": 11}, "watchdog.exact_limit"),
        ({"coarse_window": 1}, "watchdog.coarse_window"),
        ({"stagnation_steps": 0}, "watchdog.stagnation_steps"),
    ],
)
def test_bad_thresholds_are_rejected(overrides: dict[str, int], where: str) -> None:
    with pytest.raises(WatchdogConfigError) as err:
        WatchdogConfig(**overrides)
    assert err.value.where == where
