"""``fold`` rebuilds the live record exactly: random legal event sequences, pushed through the codec and
folded, equal the record the live harness built by applying the same events one at a time."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from runtime import (
    LEGAL_TRANSITIONS,
    TERMINAL_STATES,
    ApprovalDecided,
    ApprovalDecision,
    ApprovalRechecked,
    BudgetCharged,
    BudgetStage,
    BudgetStageChanged,
    CompletionChecked,
    ControlAction,
    ControlApplied,
    ControlRejected,
    Event,
    ExitReason,
    GrantNarrowed,
    IllegalEvent,
    InvalidLog,
    LeaseAcquired,
    LeaseKind,
    LeaseReleased,
    ModelCallCancelled,
    ModelCallFailed,
    ModelCallIntent,
    ModelCallSettled,
    ObservationAppended,
    ObservationKind,
    OperationMarkedInDoubt,
    OperationSettled,
    PointerMoved,
    PointerName,
    StateChanged,
    ToolCallCancelled,
    ToolCallHeld,
    ToolJobStarted,
    TrajectoryRecord,
    TrajectoryState,
    TurnStarted,
    WallClockMeasured,
    apply,
    decode,
    encode,
    expired_calls,
    fold,
    on_control,
    on_tool_result,
    terminal_state_for,
)
from runtime.ports import OutcomeClass, Settlement, StopReason, ToolCallProposal, ToolOutcome, Usage
from tests.unit.runtime.scenario import DIGEST, DROP_ARGS, T0, Log, created, held_dispatch, in_state, intent

S = TrajectoryState
Draw = st.DataObject
Builder = Callable[[TrajectoryRecord, Draw], Event | None]

_small_float = st.floats(0.0, 5.0, allow_nan=False)
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | _small_float | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)


def _fresh(record: TrajectoryRecord, prefix: str) -> str:
    return f"{prefix}{record.log_position}"


# Each builder proposes one event from the current record; ``apply`` decides whether it is legal, so the
# generated log contains only events the live harness could have written.
def _state_change(r: TrajectoryRecord, d: Draw) -> Event:
    legal_next = sorted(b for a, b in LEGAL_TRANSITIONS if a is r.state)
    onward = [b for b in legal_next if b is not S.FINALIZING] or legal_next
    # Mostly a legal target other than the exit (its guard may still refuse it), so logs get long;
    # sometimes the exit; sometimes any state at all, to probe refusals.
    roll = d.draw(st.integers(0, 19))
    to_state = (
        d.draw(st.sampled_from(list(S))) if roll == 19 or not onward else d.draw(st.sampled_from(onward))
    )
    if roll == 18 and r.state is not S.FINALIZING and r.state not in TERMINAL_STATES:
        to_state = S.FINALIZING
    if r.state is S.FINALIZING and r.exit_reason is not None and d.draw(st.booleans()):
        to_state = terminal_state_for(r.exit_reason)
    # The two exits with their own terminal state are drawn more often than the seven that end FAILED.
    exit_reasons = [ExitReason.COMPLETED, ExitReason.CANCELED, *ExitReason]
    exit_reason = d.draw(st.sampled_from(exit_reasons)) if to_state is S.FINALIZING else None
    digest = r.held.digest if r.held is not None and to_state is S.WAITING_TOOL else None
    return StateChanged(r.state, to_state, "gen", exit_reason=exit_reason, approval_digest=digest)


def _model(r: TrajectoryRecord, d: Draw) -> Event:
    if r.model_call is None:
        return ModelCallIntent("g", "m-1", d.draw(st.integers(1, 1024)), T0 + 60)
    usage = Usage(*(d.draw(st.integers(0, 5000)) for _ in range(3)))
    dollars = d.draw(_small_float)
    choice = d.draw(st.integers(0, 5))
    if choice == 4:
        return ModelCallCancelled("pause", usage, dollars)
    if choice == 5:
        return ModelCallFailed("HTTP 500", d.draw(st.booleans()), usage, dollars)
    stops = [StopReason.TOOL_USE, StopReason.END_TURN, StopReason.MAX_TOKENS, StopReason.REFUSAL]
    return ModelCallSettled(stops[0] if choice < 2 else d.draw(st.sampled_from(stops)), usage, dollars)


def _observation(r: TrajectoryRecord, d: Draw) -> Event:
    kind = d.draw(st.sampled_from(list(ObservationKind)))
    calls = (ToolCallProposal("c1", "read_file", "{}"),) if kind is ObservationKind.ASSISTANT else ()
    return ObservationAppended(
        kind, d.draw(st.text(max_size=10)), "c-drop" if kind is ObservationKind.REFUSAL else None, calls
    )


def _hold(r: TrajectoryRecord, d: Draw) -> Event:
    return ToolCallHeld("c-drop", "drop_table", dict(DROP_ARGS), DIGEST, T0 + d.draw(st.integers(50, 500)))


def _approval(r: TrajectoryRecord, d: Draw) -> Event:
    at = T0 + d.draw(st.integers(0, 600))
    if d.draw(st.booleans()):
        return ApprovalDecided(DIGEST, d.draw(st.sampled_from(list(ApprovalDecision))), ("alice",), "r", at)
    passed = d.draw(st.booleans())
    return ApprovalRechecked(DIGEST, passed, None if passed else "stale", at)


def _dispatch(r: TrajectoryRecord, d: Draw) -> Event:
    if r.held is not None and d.draw(st.booleans()):
        return held_dispatch()
    # Mostly fresh calls; sometimes a retry of an existing operation (settlement before retry decides).
    ops = sorted(r.operations)
    if ops and d.draw(st.booleans()):
        op = r.operations[d.draw(st.sampled_from(ops))]
        return intent(op.call_id, op.tool, effect_key=op.effect_key, operation_id=op.operation_id,
                      attempt_id=_fresh(r, "at"), arguments={"path": "a"})  # fmt: skip
    call_id = _fresh(r, "c")
    tool = d.draw(st.sampled_from(["read_file", "write_file"]))
    return intent(call_id, tool, deadline=T0 + d.draw(st.integers(10, 800)), arguments=d.draw(
        st.dictionaries(st.text(max_size=4), _json, max_size=3)), repeat_safe=d.draw(st.booleans()),
        liability=d.draw(_small_float))  # fmt: skip


def _pending_call(r: TrajectoryRecord, d: Draw) -> Event | None:
    if not r.pending_calls:
        return None
    call_id = d.draw(st.sampled_from(sorted(r.pending_calls)))
    choice = d.draw(st.integers(0, 3))
    if choice == 0:
        outcome = ToolOutcome(d.draw(st.sampled_from(list(Settlement))), OutcomeClass.SUCCESS, d.draw(_json))
        return on_tool_result(r, call_id, outcome, d.draw(_small_float))
    if choice == 1:
        due = expired_calls(r, now=T0 + d.draw(st.integers(0, 900)))
        return due[0] if due else None
    if choice == 2:
        return ToolCallCancelled(call_id, "finalizing")
    return ToolJobStarted(call_id, _fresh(r, "job"))


def _late(r: TrajectoryRecord, d: Draw) -> Event:
    return on_tool_result(
        r, d.draw(st.sampled_from(["ghost", "c1"])), ToolOutcome(Settlement.ESTABLISHED, OutcomeClass.SUCCESS)
    )


def _settlement(r: TrajectoryRecord, d: Draw) -> Event | None:
    if not r.operations:
        return None
    op_id = d.draw(st.sampled_from(sorted(r.operations)))
    if d.draw(st.booleans()):
        return OperationMarkedInDoubt(op_id, "probe inconclusive", "operator:oncall")
    return OperationSettled(
        op_id, d.draw(st.sampled_from([Settlement.ESTABLISHED, Settlement.ESTABLISHED_ABSENT])), "probe"
    )


def _control(r: TrajectoryRecord, d: Draw) -> Event | None:
    if r.pending_control and d.draw(st.booleans()):
        return ControlApplied(r.pending_control[0].message_id)
    if d.draw(st.booleans()):
        return ControlRejected(_fresh(r, "m"), "bad_signature")
    return on_control(
        r, _fresh(r, "m"), d.draw(st.sampled_from(list(ControlAction))), "op:alice", "gen", {"k": 1}
    )


def _budget(r: TrajectoryRecord, d: Draw) -> Event:
    choice = d.draw(st.integers(0, 2))
    if choice == 0:
        return BudgetCharged(
            {d.draw(st.sampled_from(["dollars", "sandbox_seconds"])): d.draw(_small_float)}, "tool"
        )
    if choice == 1:
        return WallClockMeasured(r.spend.get("wall_seconds") + d.draw(_small_float))
    return BudgetStageChanged(d.draw(st.sampled_from(list(BudgetStage))), d.draw(_small_float), "dollars")


def _misc(r: TrajectoryRecord, d: Draw) -> Event | None:
    choice = d.draw(st.integers(0, 5))
    if choice == 0:
        return TurnStarted(r.turn_count + 1)
    if choice == 1:
        return GrantNarrowed(
            frozenset(t for t in r.grants.tools if d.draw(st.booleans())),
            d.draw(st.booleans()),
            False,
            "restrict",
        )
    if choice == 2:
        return LeaseAcquired(_fresh(r, "lease"), d.draw(st.sampled_from(list(LeaseKind))), "ws://1", T0 + 900)
    if choice == 3:
        return LeaseReleased(d.draw(st.sampled_from(sorted(r.leases)))) if r.leases else None
    if choice == 4:
        return CompletionChecked("pytest", d.draw(st.booleans()))
    return PointerMoved(d.draw(st.sampled_from(list(PointerName))), _fresh(r, "ref://"))


def _finish(r: TrajectoryRecord, d: Draw) -> Event:
    """FINALIZING's own work, in the order a harness does it: cancel, release, check, settle."""
    if r.pending_calls:
        return ToolCallCancelled(sorted(r.pending_calls)[0], "finalizing")
    if r.leases:
        return LeaseReleased(sorted(r.leases)[0])
    if r.check_passed is None:
        return CompletionChecked("pytest", d.draw(st.booleans()))
    assert r.exit_reason is not None
    return StateChanged(r.state, terminal_state_for(r.exit_reason), "settled")


ANYWHERE: list[Builder] = [_budget, _control, _settlement, _late, _observation]
BY_STATE: dict[TrajectoryState, list[Builder]] = {
    S.READY: [_state_change, _state_change, _misc],
    S.CALLING_MODEL: [_model, _model, _hold, _state_change, _state_change],
    S.WAITING_TOOL: [_dispatch, _dispatch, _pending_call, _pending_call, _state_change],
    S.AWAITING_APPROVAL: [_approval, _approval, _state_change],
    S.PAUSED: [_state_change],
    S.FINALIZING: [_finish, _finish, _pending_call, _misc, _state_change],
    S.COMPLETED: [],
    S.FAILED: [],
    S.CANCELED: [],
}


@st.composite
def legal_logs(draw: Callable[..., Any], max_events: int = 40) -> tuple[list[Event], list[TrajectoryRecord]]:
    """A log the live harness could have written, with the live record after every event."""
    data: Draw = draw(st.data())
    first = created()
    events: list[Event] = [first]
    records = [Log().record]
    for _ in range(max_events * 3):
        if len(events) > max_events:
            break
        local = BY_STATE[records[-1].state]
        pool = local if local and data.draw(st.integers(0, 3)) != 3 else ANYWHERE
        builder = data.draw(st.sampled_from(pool))
        event = builder(records[-1], data)
        if event is None:
            continue
        try:
            records.append(apply(records[-1], event))
        except IllegalEvent:
            continue  # not legal here: the harness would not have written it
        events.append(event)
    return events, records


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
@given(legal_logs())
def test_fold_of_the_decoded_log_equals_the_live_record(
    log: tuple[list[Event], list[TrajectoryRecord]],
) -> None:
    events, records = log
    # Given the live record built event by event, when the log is encoded, decoded and folded
    folded = fold(decode(encode(e)) for e in events)
    # Then the folded record is exactly the live one
    assert folded == records[-1]
    assert folded.log_position == len(events)
    # And the invariants held all along: once terminal, the state never changed again
    ended = [r.state for r in records if r.state in TERMINAL_STATES]
    assert len(set(ended)) <= 1
    for before, after in itertools.pairwise(records):
        if before.state in TERMINAL_STATES:
            assert after.state is before.state and after.history == before.history


class _EveryStateSeen(Exception):
    """Ends the generator check as soon as the generated logs have covered every state."""


# Hypothesis prints the log that ended the run, which is long; its warning about that is noise here
@pytest.mark.filterwarnings("ignore:Generating overly large repr")
def test_generated_logs_reach_every_state() -> None:
    """Guards against a generator that never leaves READY (the property test would then prove little).

    Stops at the first log that completes the set, so the example budget is a ceiling, not a cost; without
    the shrink phase the stop is reported at once instead of being minimised.
    """
    seen: set[TrajectoryState] = set()

    @settings(
        max_examples=1000,
        deadline=None,
        derandomize=True,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(legal_logs())
    def collect(log: tuple[list[Event], list[TrajectoryRecord]]) -> None:
        seen.update(r.state for r in log[1])
        if seen == set(S):
            raise _EveryStateSeen

    with pytest.raises(_EveryStateSeen):
        collect()
    assert seen == set(S)


def test_fold_of_a_scripted_log_matches_the_live_record() -> None:
    # Given a realistic trajectory: a read, an approval-gated drop, an end_turn claim and a passed check
    log = in_state(S.READY)
    log.call_model()
    log.dispatch("c1")
    log.add(on_tool_result(log.record, "c1", ToolOutcome(Settlement.ESTABLISHED, OutcomeClass.SUCCESS, "ok")))
    log.to(S.READY)
    log.call_model()
    log.hold()
    log.approve()
    log.to(S.WAITING_TOOL, approval_digest=DIGEST)
    log.add(held_dispatch())
    log.add(
        on_tool_result(log.record, "c-drop", ToolOutcome(Settlement.ESTABLISHED, OutcomeClass.SUCCESS, None))
    )
    log.to(S.READY)
    log.call_model(StopReason.END_TURN)
    log.finalize(ExitReason.COMPLETED)
    log.add(CompletionChecked("pytest", True))
    record = log.to(S.COMPLETED)
    # When folded from bytes / Then identical, with the exact history
    assert fold(decode(encode(e)) for e in log.events) == record
    assert [t.to_state for t in record.history] == [
        S.CALLING_MODEL, S.WAITING_TOOL, S.READY, S.CALLING_MODEL, S.AWAITING_APPROVAL, S.WAITING_TOOL,
        S.READY, S.CALLING_MODEL, S.FINALIZING, S.COMPLETED,
    ]  # fmt: skip
    assert record.turn_count == 3 and record.spend.get("turns") == 3
    assert record.contract.goal == created().contract.goal  # kept verbatim


@pytest.mark.parametrize(
    ("events", "where"),
    [
        ([], "event[0]"),
        ([TurnStarted(1)], "event[0]"),
        ([created(), TurnStarted(2)], "event[1]"),
        ([created(), created()], "event[1]"),
    ],
)
def test_fold_of_an_impossible_log_names_the_entry(events: list[Event], where: str) -> None:
    with pytest.raises(InvalidLog) as info:
        fold(events)
    assert info.value.where == where
