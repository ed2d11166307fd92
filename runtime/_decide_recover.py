"""Recovery: what an incarnation decides when it folds the log of a trajectory whose actor went away.

Nothing the previous incarnation launched is still running for this one: admission requests, model calls,
dispatched tool calls, probes and local timers died with it. Durable timers (the deadline, an approval's
expiry) are still in the cluster's timer store. The rules, one row per state the log can be in:

- READY: an admission request or a backoff was in flight. The request is abandoned; the next turn asks again.
- CALLING_MODEL: a model call's intent is durable and its outcome is not. It is charged its whole
  reservation (prompt estimate + output ceiling: the most the provider can have billed); back to READY.
- WAITING_TOOL, dispatched calls without results: each is cancelled into *in doubt*; re-sent under the same
  effect key only if its repeat contract is repeat-safe (idempotent, deduplicated); probed under
  probe-then-retry; else left unknown with the trajectory as owner.
- WAITING_TOOL, queued calls (not yet sent): they ask for their permits again; a probe is asked again; a
  retry's backoff resumes with its timer.
- AWAITING_APPROVAL: nothing was in flight; the held call stays held and its expiry timer decides.
- PAUSED: nothing was in flight; still paused, and the deadline still ends it.
- FINALIZING: finalization runs again from the record: its timers are armed again (a dispatched
  compensation's deadline, a verification's, a pause before asking again), and a compensation that was
  waiting for its permits asks for them again.

Every armed timer is started again (the local ones died with the actor; durable ones are re-stored, which
is idempotent), and the deadline timer is armed if the log predates it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from runtime._decide_cleanup import readmit
from runtime._decide_dispatch import queue_for_permit
from runtime._decide_finalize import enter_finalizing
from runtime._step import Step
from runtime.effects import ProbeTool, SettleAdmission, StartTimer
from runtime.events import (
    LeaseAcquired,
    ModelCallFailed,
    OperationMarkedInDoubt,
    StateChanged,
    ToolCallCancelled,
    ToolCallQueued,
    TurnAbandoned,
)
from runtime.inputs import Recovered, Started
from runtime.ports import Usage
from runtime.record import JsonValue, LeaseKind, ModelOutcome, QueueStage, TimerKind
from runtime.states import ExitReason, TrajectoryState

__all__ = ["RECOVERY", "on_recovered", "on_started"]

S = TrajectoryState


def _ready(step: Step) -> None:
    request = step.record.turn_request
    if request is not None:
        step.emit(TurnAbandoned(request.request_id, "actor restarted"))


def _calling_model(step: Step) -> None:
    call = step.record.model_call
    if call is not None and call.outcome is None:
        reserved = Usage(uncached_input=call.prompt_tokens, cached_input=0, output=call.max_tokens)
        step.do(SettleAdmission(call.grant_id, reserved.total))
        cost = step.policy.prices.cost(reserved)
        step.emit(ModelCallFailed("the actor restarted during the call", True, reserved, cost))
        step.emit(StateChanged(S.CALLING_MODEL, S.READY, "recovered: call outcome lost"))
        return
    # A log written before replies were recorded in one batch: the outcome landed, its consequences not.
    if call is not None and call.outcome is ModelOutcome.END_TURN:
        enter_finalizing(step, ExitReason.COMPLETED, "the model ended its turn")
        return
    step.emit(StateChanged(S.CALLING_MODEL, S.READY, "recovered: reply not processed"))


def _waiting_tool(step: Step) -> None:
    registry = step.policy.registry
    queued_before = list(step.record.queued.values())  # what was queued by the lost incarnation
    for pending in list(step.record.pending_calls.values()):
        step.emit(ToolCallCancelled(pending.call_id, "actor restarted: outcome unknown"))
        step.disarm(step.record.timer_of(TimerKind.CALL_DEADLINE, pending.call_id))
        op = step.record.operations[pending.operation_id]
        if op.settled:
            continue
        contract = registry.get(pending.tool) if pending.tool in registry else None
        args: dict[str, JsonValue] = dict(op.arguments)  # type: ignore[arg-type]
        if op.repeat_safe:
            queue_for_permit(step, pending.call_id, pending.tool, args, operation_id=op.operation_id)
        elif contract is not None and contract.probe:
            request_id = step.new_id("probe")
            step.emit(
                ToolCallQueued(
                    pending.call_id, pending.tool, args, QueueStage.PROBING, request_id, op.operation_id
                )
            )
            deadline = step.now + step.policy.probe_timeout_s
            step.do(ProbeTool(op.operation_id, pending.tool, op.effect_key, deadline, request_id))
        else:
            owner = step.record.trajectory_id
            step.emit(OperationMarkedInDoubt(op.operation_id, "never repeat: left unknown", owner))
    for queued in queued_before:
        if queued.stage is QueueStage.PERMIT:
            queue_for_permit(
                step,
                queued.call_id,
                queued.tool,
                queued.arguments,
                operation_id=queued.operation_id,
                approval_digest=queued.approval_digest,
            )
        elif queued.stage is QueueStage.PROBING and queued.operation_id is not None:
            op = step.record.operations[queued.operation_id]
            deadline = step.now + step.policy.probe_timeout_s
            step.do(ProbeTool(op.operation_id, queued.tool, op.effect_key, deadline, queued.request_id))
        # BACKOFF: its retry timer is armed again below, with every other timer


def _nothing(step: Step) -> None:
    return None


RECOVERY: Mapping[TrajectoryState, Callable[[Step], None]] = {
    S.READY: _ready,
    S.CALLING_MODEL: _calling_model,
    S.WAITING_TOOL: _waiting_tool,
    S.AWAITING_APPROVAL: _nothing,
    S.PAUSED: _nothing,
    S.FINALIZING: readmit,
}
"""The recovery decision per state (the table in this module's docstring)."""


def _ensure_deadline(step: Step) -> None:
    deadline = step.record.deadline
    if deadline is None:
        return
    if step.record.timer_of(TimerKind.DEADLINE) is None:
        step.arm(TimerKind.DEADLINE, deadline)
    forward = step.forward_deadline
    armed = step.record.timer_of(TimerKind.RESERVE) is not None
    if forward is not None and forward < deadline and not armed and step.record.state is not S.FINALIZING:
        step.arm(TimerKind.RESERVE, forward)


def _acquire_leases(step: Step) -> None:
    """The workspace and credentials the trajectory holds, as leases FINALIZING gives back."""
    until = step.record.deadline if step.record.deadline is not None else step.now + 86_400.0
    wanted = []
    if step.policy.workspace:
        wanted.append(("lease-workspace", LeaseKind.WORKSPACE, step.policy.workspace))
    wanted += [(f"lease-credential-{name}", LeaseKind.CREDENTIAL, name) for name in step.policy.credentials]
    for lease_id, kind, resource in wanted:
        if lease_id not in step.record.leases:
            step.emit(LeaseAcquired(lease_id, kind, resource, until))


def on_started(step: Step, inp: Started) -> None:
    if not step.record.is_terminal:
        _acquire_leases(step)
        _ensure_deadline(step)


def on_recovered(step: Step, inp: Recovered) -> None:
    if step.record.is_terminal:
        return
    for timer in list(step.record.timers.values()):
        step.do(StartTimer(timer))  # local timers died with the actor; durable ones are stored again
    _ensure_deadline(step)
    RECOVERY[step.record.state](step)
    from runtime._decide_children import reattach

    reattach(step)  # issue 12: a restarted parent waits for its live children again
