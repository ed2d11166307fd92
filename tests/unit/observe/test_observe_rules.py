"""The pure rules under MetricsHooks: watchdog detail parsing, outcomes, the state census, rejection guards,
hook chaining, and that a failing backend never fails the harness's append."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from runtime.clock import FakeClock
from runtime.events import ControlApplied, ObservationAppended, ObservationKind, StateChanged
from runtime.fold import start
from runtime.metrics import InMemoryBackend, Metrics, MetricSpec, Outcome
from runtime.observe import HookChain, MetricsHooks, StateCensus, outcome_of, watchdog_guard
from runtime.operations import Operation
from runtime.ports import Settlement
from runtime.record import TrajectoryRecord
from runtime.states import TERMINAL_STATES, ExitReason, TrajectoryState
from tests.unit.trajectory.sim import created

S = TrajectoryState


def record(**changes: object) -> TrajectoryRecord:
    return replace(start(created(FakeClock())), **changes)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("event", "guard"),
    [
        (StateChanged(S.READY, S.FINALIZING, "watchdog cycle stopped a loop", ExitReason.ERROR), "cycle"),
        (
            StateChanged(S.READY, S.FINALIZING, "watchdog exact_repeat stopped a loop", ExitReason.ERROR),
            "exact_repeat",
        ),
        (StateChanged(S.READY, S.FINALIZING, "watchdog fancy stopped a loop", ExitReason.ERROR), "watchdog"),
        (StateChanged(S.READY, S.FINALIZING, "admission refused: x", ExitReason.ERROR), None),
        (StateChanged(S.READY, S.FINALIZING, "watchdog cycle stopped a loop", ExitReason.KILLED), None),
        (StateChanged(S.CALLING_MODEL, S.READY, "watchdog: cycle"), None),
    ],
)
def test_watchdog_guard_is_read_only_from_a_watchdog_finalization(
    event: StateChanged, guard: str | None
) -> None:
    assert watchdog_guard(event) == guard


def _op(settlement: Settlement) -> Operation:
    return Operation("op1", "c1", "run_tests", "k1", 1, "a1", settlement)


@pytest.mark.parametrize(
    ("state", "exit_reason", "settlements", "outcome"),
    [
        (S.COMPLETED, ExitReason.COMPLETED, [Settlement.ESTABLISHED], Outcome.COMPLETED),
        (S.CANCELED, ExitReason.CANCELED, [Settlement.ESTABLISHED], Outcome.CANCELED),
        (S.FAILED, ExitReason.KILLED, [], Outcome.KILLED),
        (S.FAILED, ExitReason.KILLED, [Settlement.ESTABLISHED], Outcome.PARTIAL),
        (S.FAILED, ExitReason.BUDGET_EXCEEDED, [Settlement.ESTABLISHED_ABSENT], Outcome.FAILED),
        (S.FAILED, ExitReason.ERROR, [Settlement.UNKNOWN], Outcome.FAILED),
        (S.FAILED, ExitReason.MODEL_ERROR, [Settlement.UNKNOWN, Settlement.ESTABLISHED], Outcome.PARTIAL),
    ],
)
def test_outcome_partial_means_failed_with_an_established_effect(
    state: TrajectoryState, exit_reason: ExitReason, settlements: list[Settlement], outcome: Outcome
) -> None:
    ops = {f"op{i}": replace(_op(s), operation_id=f"op{i}") for i, s in enumerate(settlements)}
    assert outcome_of(record(state=state, exit_reason=exit_reason, operations=ops)) is outcome


@given(st.lists(st.sampled_from(list(TrajectoryState)), min_size=1, max_size=40))
def test_census_holds_each_trajectory_once_in_its_unfinished_state(path: list[TrajectoryState]) -> None:
    # Given one trajectory walking through any sequence of states
    census = StateCensus()
    previous: TrajectoryState | None = None
    for state in path:
        # When each move is applied
        changed = census.move(previous, state)
        previous = state
        # Then the reported counts are the census's own
        assert all(census.count(s) == n for s, n in changed.items())
    # and the trajectory is counted exactly where it ended (nowhere once it is terminal)
    totals = {s: census.count(s) for s in TrajectoryState}
    expected = {s: int(s is path[-1] and s not in TERMINAL_STATES) for s in TrajectoryState}
    assert totals == expected


def test_census_never_goes_below_zero_for_a_trajectory_first_seen_mid_flight() -> None:
    census = StateCensus()
    assert census.move(S.WAITING_TOOL, S.READY) == {S.WAITING_TOOL: 0, S.READY: 1}


@pytest.mark.parametrize(
    ("content", "counted"),
    [
        ({"status": "REJECTED", "reason": "INVALID_ARGUMENTS"}, {"schema": 1.0}),
        ({"status": "REJECTED", "reason": "BreakerOpen", "message": "open"}, {"breaker_open": 1.0}),
        ({"status": "REJECTED", "reason": "BulkheadFull"}, {"bulkhead_full": 1.0}),
        ({"status": "REJECTED", "reason": "SomethingElse"}, {}),
        ({"status": "REFUSED", "reason": "DEFERRED"}, {}),
        ({"status": "REFUSED", "reason": "APPROVAL_DENIED"}, {}),
        ("not json {", {}),
    ],
)
def test_refusal_observations_count_only_known_rejecting_guards(
    content: Mapping[str, str] | str, counted: dict[str, float]
) -> None:
    # Given metrics hooks and a refusal observation the harness appended
    backend = InMemoryBackend()
    hooks = MetricsHooks(Metrics(backend), FakeClock())
    text = content if isinstance(content, str) else json.dumps(content)
    # When it is observed
    hooks.on_event(record(), ObservationAppended(ObservationKind.REFUSAL, text, call_id="c1"))
    # Then only a known guard's rejection is counted, under that guard
    fired = {dict(k)["guard"]: v for (n, k), v in backend.counters.items() if n == "tether_guard_fired"}
    assert fired == counted


def test_applied_control_never_seen_requested_is_not_timed() -> None:
    # Given hooks that never saw the request (it was recorded before an actor restart)
    backend = InMemoryBackend()
    hooks = MetricsHooks(Metrics(backend), FakeClock())
    # When only its application is observed
    hooks.on_event(record(), ControlApplied("m1"))
    # Then no latency is made up
    assert backend.observations == {}


class ExplodingBackend(InMemoryBackend):
    def inc(self, spec: MetricSpec, labels: Mapping[str, str], amount: float) -> None:
        raise RuntimeError("exporter down")


def test_a_failing_backend_never_fails_the_append_it_observes() -> None:
    # Given hooks over a backend that raises on every counter
    hooks = MetricsHooks(Metrics(ExplodingBackend()), FakeClock())
    rejected = json.dumps({"status": "REJECTED", "reason": "NOT_GRANTED"})
    # When an event that increments a counter is observed
    hooks.on_event(record(), ObservationAppended(ObservationKind.REFUSAL, rejected, call_id="c1"))
    # Then nothing is raised, and the failure is counted for whoever looks
    assert hooks.failures == 1


class Recording:
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def on_event(self, record: TrajectoryRecord, event: object) -> None:
        self.log.append(f"{self.name}:event")

    async def on_kill(self, record: TrajectoryRecord) -> None:
        self.log.append(f"{self.name}:kill")


async def test_hook_chain_calls_every_hook_in_order() -> None:
    log: list[str] = []
    chain = HookChain(Recording("status", log), Recording("metrics", log))
    chain.on_event(record(), ControlApplied("m1"))
    await chain.on_kill(record())
    assert log == ["status:event", "metrics:event", "status:kill", "metrics:kill"]


def test_steps_to_completion_only_counts_completed_trajectories() -> None:
    backend = InMemoryBackend()
    metrics = Metrics(backend)
    for outcome in Outcome:
        metrics.trajectory_finished(outcome, 7)
    assert backend.observations == {("tether_steps_to_completion", ()): [7.0]}
    assert sum(v for (n, _), v in backend.counters.items() if n == "tether_trajectories_finished") == len(
        Outcome
    )
