"""Leaving: how a trajectory enters FINALIZING, what becomes of work in flight, and how it ends.

Every exit passes through FINALIZING (harness chapter, invariant 3), which records the exit reason. Calls in
flight are not waited out: each is cancelled at its endpoint and its operation stays *in doubt* with the
trajectory as owner (a cancel settles nothing), and a probe is asked where the tool supports one, so its
answer can settle the operation later. Calls not yet sent are withdrawn. FINALIZING then releases leases,
runs the completion check on a completion claim, disarms every timer and settles in the terminal state the
exit reason implies.
"""

from __future__ import annotations

import json

from runtime._step import Step
from runtime.budget import BudgetStage, assess
from runtime.completion import evaluate_completion
from runtime.effects import CancelToolCall, ProbeTool, ReleaseLease
from runtime.events import (
    BudgetStageChanged,
    CompletionChecked,
    LeaseReleased,
    ObligationUpdated,
    ObservationAppended,
    ObservationKind,
    StateChanged,
    ToolCallCancelled,
    ToolCallWithdrawn,
    TurnAbandoned,
)
from runtime.obligations import ObligationState
from runtime.record import TimerKind
from runtime.states import ExitReason, TrajectoryState, terminal_state_for

__all__ = ["abandon_calls", "enter_finalizing", "finalize", "halt_unfundable", "withdraw"]

S = TrajectoryState


def withdraw(step: Step, call_id: str, reason: str, refusal: dict[str, str] | None = None) -> None:
    """A queued call will not be sent; the model is told why when ``refusal`` is given."""
    step.emit(ToolCallWithdrawn(call_id, reason))
    if refusal is not None:
        body = json.dumps(refusal, sort_keys=True)
        step.emit(ObservationAppended(ObservationKind.REFUSAL, body, call_id=call_id))


def abandon_calls(step: Step, reason: str) -> None:
    """Stop waiting for every call in flight and withdraw every call not yet sent (kill, cancel, deadline,
    finalizing). An abandoned operation is in doubt, owned by the trajectory; its endpoint is asked to stop
    it and, where the tool can be probed, what became of it (the answer settles it, whenever it comes, and
    binds its cleanup: FINALIZING waits for that answer before it hands anything off)."""
    rec = step.record
    for pending in list(rec.pending_calls.values()):
        op = rec.operations[pending.operation_id]
        step.emit(ToolCallCancelled(pending.call_id, reason))
        step.disarm(step.record.timer_of(TimerKind.CALL_DEADLINE, pending.call_id))
        step.do(CancelToolCall(pending.tool, op.effect_key))
        if pending.tool in step.policy.registry and step.policy.registry.get(pending.tool).probe:
            request_id = step.new_id("probe")
            obligation = step.record.obligations.get(f"obl-{op.operation_id}")
            if obligation is not None and obligation.state is ObligationState.PLANNED:
                step.emit(
                    ObligationUpdated(
                        obligation.obligation_id,
                        obligation.state,
                        f"probing after: {reason}",
                        request_id=request_id,
                    )
                )
            deadline = step.now + step.policy.probe_timeout_s
            step.do(ProbeTool(op.operation_id, pending.tool, op.effect_key, deadline, request_id))
    for queued in list(step.record.queued.values()):
        withdraw(
            step,
            queued.call_id,
            reason,
            {"status": "REFUSED", "reason": "NOT_DISPATCHED", "message": f"Not sent: {reason}."},
        )


def halt_unfundable(step: Step, detail: str = "the remaining budget cannot fund another call") -> None:
    """The meter's halt: record the HALT stage, then finalize with BUDGET_EXCEEDED."""
    rec = step.record
    a = assess(rec.ceilings, rec.spend, step.policy.thresholds)
    step.emit(BudgetStageChanged(BudgetStage.HALT, max(a.rho, 1.0), a.binding_dimension))
    enter_finalizing(step, ExitReason.BUDGET_EXCEEDED, detail)


def enter_finalizing(step: Step, reason: ExitReason, detail: str) -> None:
    """Move to FINALIZING with ``reason`` from any live state (a model call in flight is settled first)."""
    rec = step.record
    if rec.state is S.CALLING_MODEL and rec.model_call is not None and rec.model_call.outcome is None:
        raise RuntimeError("cannot finalize with a model call in flight")  # a rule bug, not an input
    if reason is ExitReason.BUDGET_EXCEEDED and rec.budget_stage is not BudgetStage.HALT:
        halt_unfundable(step, detail)
        return
    if rec.state is S.WAITING_TOOL and (rec.pending_calls or rec.queued):
        abandon_calls(step, "finalizing")
    if step.record.turn_request is not None:
        step.emit(TurnAbandoned(step.record.turn_request.request_id, f"finalizing: {reason.value}"))
    step.emit(StateChanged(step.record.state, S.FINALIZING, detail, exit_reason=reason))


def finalize(step: Step) -> bool:
    """FINALIZING: check a completion claim, unwind the cleanup graph (waiting for what is in flight, up to
    the hard deadline), release leases, write the handoff packet and hand off what is still owed, disarm
    every timer, settle terminal. True when it reached the terminal state."""
    from runtime._decide_cleanup import finish_cleanup, unwind

    rec = step.record
    if rec.exit_reason is ExitReason.COMPLETED and rec.check_passed is None:
        result = evaluate_completion(rec, rec.transcript)  # type: ignore[arg-type]
        step.emit(CompletionChecked(rec.contract.completion_check.name, result.passed, result.detail))
    if not unwind(step):
        return False
    for lease in list(step.record.leases.values()):  # before the packet: it lists only what is still held
        step.emit(LeaseReleased(lease.lease_id))
        step.do(ReleaseLease(lease))
    finish_cleanup(step)
    step.disarm_all()
    rec = step.record
    assert rec.exit_reason is not None
    target = terminal_state_for(rec.exit_reason)
    step.emit(StateChanged(S.FINALIZING, target, f"exit: {rec.exit_reason.value}"))
    return True
