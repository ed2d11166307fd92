"""The harness chapter's four invariants, PAUSED-only-from-READY, and the retry rule, one test each
(plus the guards that make each one hold)."""

from __future__ import annotations

import pytest

from runtime import (
    AFTER_TERMINAL_KINDS,
    EVENT_TYPES,
    ApprovalDecided,
    ApprovalDecision,
    AuditKind,
    CompletionChecked,
    ControlAction,
    ControlApplied,
    ControlRejected,
    ControlRequested,
    Event,
    ExitReason,
    IllegalEvent,
    IllegalTransition,
    LateResultDropped,
    ModelCallCancelled,
    ModelCallIntent,
    ObservationAppended,
    ObservationKind,
    OperationSettled,
    StateChanged,
    ToolCallCancelled,
    ToolResultAccepted,
    TrajectoryState,
    TurnStarted,
    expired_calls,
    fold,
    on_control,
    on_tool_result,
    retry_of,
    start,
)
from runtime.ports import OutcomeClass, Settlement, StopReason, ToolCallProposal, ToolOutcome, Usage
from tests.unit.runtime.scenario import DIGEST, T0, examples, held_dispatch, in_state, intent

S = TrajectoryState
OK = ToolOutcome(Settlement.ESTABLISHED, OutcomeClass.SUCCESS, result={"passed": 12})


# --------------------------------------------------------------------------- invariant 1: late results


def test_a_result_after_its_deadline_is_dropped_and_audited_not_appended() -> None:
    # Given a call dispatched with a deadline, and the deadline has passed
    log = in_state(S.WAITING_TOOL)
    deadline = log.record.pending_calls["c1"].deadline
    timeouts = expired_calls(log.record, now=deadline)
    assert [t.call_id for t in timeouts] == ["c1"]
    log.add(*timeouts)  # the id leaves the pending set before anything else can happen
    # When the original result finally arrives
    decision = on_tool_result(log.record, "c1", OK)
    log.add(decision)
    # Then it is an audit entry, never an accepted result; the operation stays unknown and owned
    assert isinstance(decision, LateResultDropped)
    assert not any(isinstance(e, ToolResultAccepted) for e in log.events)
    assert [(a.kind, a.subject) for a in log.record.audit] == [(AuditKind.LATE_RESULT_DROPPED, "c1")]
    op = log.record.operations["op-c1"]
    assert (op.settlement, op.in_doubt, op.owner) == (Settlement.UNKNOWN, True, "traj-1")


def test_an_accepted_result_event_for_a_non_pending_call_is_refused() -> None:
    # Given the call timed out, when a caller bypasses on_tool_result, then apply refuses the event
    log = in_state(S.WAITING_TOOL)
    log.add(*expired_calls(log.record, now=T0 + 10_000))
    with pytest.raises(IllegalEvent) as info:
        log.add(ToolResultAccepted("c1", Settlement.ESTABLISHED, OutcomeClass.SUCCESS, "late", None))
    assert info.value.rule == "call_not_pending"


def test_a_result_outside_waiting_tool_is_dropped() -> None:
    # Given a trajectory that is finalizing with the call still pending (e.g. after a cancel)
    log = in_state(S.WAITING_TOOL)
    log.finalize(ExitReason.CANCELED)
    # When the result arrives, then it is dropped: only WAITING_TOOL accepts results
    decision = on_tool_result(log.record, "c1", OK)
    assert isinstance(decision, LateResultDropped)
    log.add(decision)
    assert "c1" in log.record.pending_calls  # still owed: FINALIZING must cancel it
    with pytest.raises(IllegalEvent):
        log.add(ToolResultAccepted("c1", Settlement.ESTABLISHED, OutcomeClass.SUCCESS, "x", None))


def test_dropping_an_acceptable_result_is_refused() -> None:
    log = in_state(S.WAITING_TOOL)
    with pytest.raises(IllegalEvent) as info:
        log.add(LateResultDropped("c1", "lost"))
    assert info.value.rule == "result_was_acceptable"


def test_a_pending_result_is_accepted_and_settles_its_operation() -> None:
    log = in_state(S.WAITING_TOOL)
    decision = on_tool_result(log.record, "c1", OK, charge=0.25)
    assert isinstance(decision, ToolResultAccepted)
    record = log.add(decision)
    assert record.pending_calls == {}
    assert record.operations["op-c1"].settlement is Settlement.ESTABLISHED
    assert record.spend.get("dollars") == pytest.approx(0.006 + 0.25)


# --------------------------------------------------------------------------- invariant 2: the approval gate


def test_a_held_call_reaches_dispatch_only_through_a_rechecked_approval() -> None:
    # Given an irreversible call held in AWAITING_APPROVAL
    log = in_state(S.AWAITING_APPROVAL)
    # Then no path dispatches it before an approval passes the re-check
    for attempt in (
        StateChanged(S.AWAITING_APPROVAL, S.WAITING_TOOL, "retry path", approval_digest=DIGEST),
        StateChanged(S.AWAITING_APPROVAL, S.WAITING_TOOL, "retry path"),
        held_dispatch(),
    ):
        with pytest.raises(IllegalEvent):
            log.add(attempt)
    # When it is approved but the re-check fails, it still cannot leave for dispatch
    log.approve(recheck=False)
    with pytest.raises(IllegalTransition) as info:
        log.to(S.WAITING_TOOL, approval_digest=DIGEST)
    assert info.value.rule == "approval_not_cleared"


def test_an_approved_and_rechecked_call_is_dispatched_exactly_as_approved() -> None:
    log = in_state(S.AWAITING_APPROVAL)
    log.approve()
    log.to(S.WAITING_TOOL, "approved", approval_digest=DIGEST)
    # A different argument is a different call: the approval does not apply
    with pytest.raises(IllegalEvent) as info:
        log.add(
            intent(
                "c-drop", "drop_table", arguments={"db": "prod", "table": "orders"}, approval_digest=DIGEST
            )
        )
    assert info.value.rule == "call_differs_from_approved"
    record = log.add(held_dispatch())
    assert "c-drop" in record.pending_calls and record.held is None


def test_the_retry_path_that_finds_the_trajectory_idle_cannot_dispatch_a_gated_call() -> None:
    # Given the held call was denied and the trajectory went back to READY
    log = in_state(S.AWAITING_APPROVAL)
    log.add(ApprovalDecided(DIGEST, ApprovalDecision.DENIED, ("bob",), "no", T0 + 5))
    log.add(ObservationAppended(ObservationKind.REFUSAL, '{"status": "REFUSED"}', call_id="c-drop"))
    log.to(S.READY, "denied")
    assert log.record.held is None
    # When a retry path calls the model again and tries to dispatch the same irreversible call
    log.call_model()
    log.to(S.WAITING_TOOL, "dispatch")
    # Then the gated tool is refused without an approval, with or without a made-up digest
    for attempt in (intent("c-drop", "drop_table"), held_dispatch()):
        with pytest.raises(IllegalEvent) as info:
            log.add(attempt)
        assert info.value.rule == "approval_not_cleared"


def test_an_approval_after_expiry_is_refused_silence_is_denial() -> None:
    log = in_state(S.AWAITING_APPROVAL)
    expires = log.record.held.expires_at  # type: ignore[union-attr]
    with pytest.raises(IllegalEvent) as info:
        log.add(ApprovalDecided(DIGEST, ApprovalDecision.APPROVED, ("alice",), "late", expires + 1))
    assert info.value.rule == "approval_expired"


def test_a_decision_for_another_digest_is_refused() -> None:
    log = in_state(S.AWAITING_APPROVAL)
    with pytest.raises(IllegalEvent) as info:
        log.add(ApprovalDecided("sha256:other", ApprovalDecision.APPROVED, ("alice",), "ok", T0))
    assert info.value.rule == "digest_mismatch"


def test_a_truncated_reply_is_never_dispatched() -> None:
    log = in_state(S.READY)
    log.call_model(StopReason.MAX_TOKENS)
    with pytest.raises(IllegalTransition) as info:
        log.to(S.WAITING_TOOL)
    assert info.value.rule == "reply_has_no_tool_calls"
    with pytest.raises(IllegalEvent):
        log.add(
            ObservationAppended(
                ObservationKind.ASSISTANT,
                "",
                tool_calls=(ToolCallProposal("c9", "drop_table", '{"db": "pr'),),
            )
        )


def test_an_aborted_stream_is_not_appended_as_a_reply() -> None:
    log = in_state(S.READY)
    log.add(TurnStarted(1))
    log.to(S.CALLING_MODEL)
    log.add(ModelCallIntent("g", "m-1", 512, T0 + 30))
    log.add(ModelCallCancelled("kill", Usage(900, 0, 40), 0.004))
    with pytest.raises(IllegalEvent) as info:
        log.add(ObservationAppended(ObservationKind.ASSISTANT, '{"action": "drop_table", "target": "cust'))
    assert info.value.rule == "reply_not_parseable"
    assert log.record.spend.get("tokens") == 940  # tokens billed before the abort are charged


# --------------------------------------------------------------------------- invariant 3: FINALIZING


@pytest.mark.parametrize("src", [S.READY, S.CALLING_MODEL, S.WAITING_TOOL, S.AWAITING_APPROVAL, S.PAUSED])
@pytest.mark.parametrize("terminal", [S.COMPLETED, S.FAILED, S.CANCELED])
def test_no_live_state_reaches_a_terminal_state_directly(
    src: TrajectoryState, terminal: TrajectoryState
) -> None:
    log = in_state(src)
    with pytest.raises(IllegalTransition):
        log.to(terminal)


def test_finalizing_is_a_cleanup_barrier() -> None:
    # Given a kill while a tool call is in flight
    log = in_state(S.WAITING_TOOL)
    log.finalize(ExitReason.KILLED)
    # Then the trajectory cannot settle while the call is pending, nor in a state its exit reason forbids
    with pytest.raises(IllegalTransition) as info:
        log.to(S.FAILED)
    assert info.value.rule == "calls_pending"
    log.add(ToolCallCancelled("c1", "kill"))
    with pytest.raises(IllegalTransition) as info:
        log.to(S.CANCELED)
    assert info.value.rule == "exit_reason_mismatch"
    record = log.to(S.FAILED)
    # And the interrupted call is in doubt with an owner, not failed
    op = record.operations["op-c1"]
    assert (record.exit_reason, op.settlement, op.in_doubt) == (ExitReason.KILLED, Settlement.UNKNOWN, True)


def test_completed_needs_a_passed_completion_check() -> None:
    log = in_state(S.READY)
    log.call_model(StopReason.END_TURN)
    log.finalize(ExitReason.COMPLETED)
    with pytest.raises(IllegalTransition) as info:
        log.to(S.COMPLETED)
    assert info.value.rule == "completion_check_not_passed"
    record = log.add(CompletionChecked("pytest", False, "2 failed"))
    assert record.exit_reason is ExitReason.COMPLETION_CHECK_FAILED
    with pytest.raises(IllegalTransition):
        log.to(S.COMPLETED)
    assert log.to(S.FAILED).state is S.FAILED


def test_budget_exceeded_needs_the_halt_stage() -> None:
    log = in_state(S.READY)
    with pytest.raises(IllegalTransition) as info:
        log.to(S.FINALIZING, exit_reason=ExitReason.BUDGET_EXCEEDED)
    assert info.value.rule == "budget_not_exhausted"
    record = log.finalize(ExitReason.BUDGET_EXCEEDED)
    assert (record.exit_reason, record.binding_dimension) == (ExitReason.BUDGET_EXCEEDED, "turns")


# --------------------------------------------------------------------------- invariant 4: absorbing


def _every_event_kind_example() -> list[Event]:
    return examples()


@pytest.mark.parametrize("terminal", [S.COMPLETED, S.FAILED, S.CANCELED])
def test_terminal_states_are_absorbing(terminal: TrajectoryState) -> None:
    # Given an ended trajectory
    log = in_state(terminal)
    before = log.record
    # When any event of any kind arrives (state changes, results, control, retries of the loop)
    for event in _every_event_kind_example():
        try:
            after = log.add(event)
        except IllegalEvent:
            continue
        # Then only audit/settlement evidence is accepted, and nothing revives the trajectory
        assert event.kind in AFTER_TERMINAL_KINDS
        assert after.state is terminal
    for to_state in S:
        with pytest.raises(IllegalTransition):
            log.to(to_state)
    assert log.record.state is before.state and log.record.history == before.history


def test_a_control_message_to_an_ended_trajectory_is_rejected_and_audited() -> None:
    log = in_state(S.CANCELED)
    decision = on_control(log.record, "1-0", ControlAction.RESUME, "op:alice", "resume")
    assert isinstance(decision, ControlRejected)
    log.add(decision)
    assert log.record.audit[-1].kind is AuditKind.CONTROL_REJECTED
    assert on_control(log.record, "1-0", ControlAction.RESUME, "op:alice", "again") is None  # idempotent


def test_settlement_evidence_still_lands_after_the_end() -> None:
    log = in_state(S.WAITING_TOOL)
    log.finalize(ExitReason.KILLED)
    log.add(ToolCallCancelled("c1", "kill"))
    log.to(S.FAILED)
    record = log.add(OperationSettled("op-c1", Settlement.ESTABLISHED_ABSENT, "probe: no effect for ek-c1"))
    assert record.operations["op-c1"].settlement is Settlement.ESTABLISHED_ABSENT
    assert record.state is S.FAILED


def test_a_retry_is_a_new_trajectory_that_names_its_parent() -> None:
    # Given a failed trajectory
    parent = in_state(S.FAILED)
    # When it is retried
    created = retry_of(parent.record, "traj-2", T0 + 1000, deadline=T0 + 1900, context_ref="ctx://traj-2")
    child = start(created)
    # Then the retry is a fresh READY record that names its parent; the parent is untouched
    assert (child.trajectory_id, child.parent_id, child.state) == ("traj-2", "traj-1", S.READY)
    assert child.contract == parent.record.contract and child.history == ()
    assert fold(parent.events) == parent.record
    with pytest.raises(IllegalEvent) as info:
        retry_of(in_state(S.READY).record, "traj-3", T0, deadline=None, context_ref="ctx://3")
    assert info.value.rule == "retry_of_live"


# --------------------------------------------------------------------------- PAUSED only from READY


@pytest.mark.parametrize("src", [s for s in S if s is not S.READY])
def test_paused_is_entered_only_from_ready(src: TrajectoryState) -> None:
    log = in_state(src)
    with pytest.raises(IllegalTransition):
        log.to(S.PAUSED)


def test_control_requests_are_recorded_once_and_applied_once() -> None:
    log = in_state(S.READY)
    request = on_control(log.record, "7-0", ControlAction.PAUSE, "op:alice", "maintenance")
    assert isinstance(request, ControlRequested)
    log.add(request)
    assert on_control(log.record, "7-0", ControlAction.PAUSE, "op:alice", "redelivered") is None
    with pytest.raises(IllegalEvent) as info:
        log.add(request)
    assert info.value.rule == "duplicate_message"
    record = log.add(ControlApplied("7-0"), StateChanged(S.READY, S.PAUSED, "pause 7-0"))
    assert record.pending_control == () and record.applied_control_ids == {"7-0"}
    assert record.state is S.PAUSED


def test_every_event_kind_is_covered_by_the_examples() -> None:
    assert {e.kind for e in _every_event_kind_example()} == set(EVENT_TYPES)
