"""Dispatch: an accepted call's way from the queue to the dependency.

A queued call waits for its permits (the dependency's guard, then a sandbox permit when the tool needs
one). Nothing is sent while a stop request (pause, cancel, kill) is pending: the call is withdrawn and the
model is told why. Every dispatch passes the admission check (``runtime.admission``: grant, deadline, and a
bounded liability that fits beside consumption, the outstanding liability of unsettled operations and the
finalization reserve). Then intent before effect: the attempt is recorded with an effect key derived from
intent and a fresh attempt id, and only then sent. A retry waits out its backoff and asks for its permits
again like fresh work.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from runtime._decide_cleanup import (
    cleanup_retry_due,
    is_cleanup,
    on_cleanup_permit,
    on_cleanup_permit_refused,
    register,
)
from runtime._decide_commit import pivot_refusal
from runtime._decide_finalize import withdraw
from runtime._step import STOPS, Step
from runtime.admission import AdmissionCandidate, AdmissionContext, OperationKind, check_admission
from runtime.budget import Dimension, Spend
from runtime.deadline import Deadline, DeadlineConfigError
from runtime.effects import AcquirePermit, DispatchTool, ReleasePermit
from runtime.events import ObservationAppended, ObservationKind, ToolCallQueued, ToolDispatchIntent
from runtime.fingerprint import effect_key
from runtime.inputs import PermitGranted, PermitRefused
from runtime.operations import outstanding_liability
from runtime.ports import GuardPermit, SandboxPermit, ToolInvocation
from runtime.record import QueuedCall, QueueStage, TimerKind
from runtime.states import TrajectoryState
from runtime.tools import RepeatContract

__all__ = [
    "dispatch",
    "on_permit_granted",
    "on_permit_refused",
    "queue_for_permit",
    "refusal",
    "refuse_call",
    "retry_due",
    "stop_requested",
]

S = TrajectoryState


def stop_requested(step: Step) -> str | None:
    """The pending stop request (pause, cancel, kill), if any: nothing not yet sent is sent while it is."""
    pending = step.pending(*STOPS)
    if pending is None and step.record.hold is not None and step.record.state is not S.FINALIZING:
        return "hold"  # issue 12: a held trajectory sends no model-directed work (cleanup is not held)
    return None if pending is None else pending.action.value


def refusal(reason: str, message: str, **extra: Any) -> dict[str, Any]:
    return {"status": "REJECTED", "reason": reason, "message": message, **extra}


def refuse_call(step: Step, call_id: str, body: Mapping[str, Any]) -> None:
    content = json.dumps(dict(body), sort_keys=True, default=str)
    step.emit(ObservationAppended(ObservationKind.REFUSAL, content, call_id=call_id))


def queue_for_permit(
    step: Step,
    call_id: str,
    tool: str,
    args: Mapping[str, Any],
    *,
    operation_id: str | None = None,
    approval_digest: str | None = None,
) -> None:
    """Queue a call for its permits and ask for them."""
    if not step.record.grants.allows(tool):
        # issue 12: the grant narrowed while this call waited (a hold's revocation, a degraded rung, a
        # watchdog's constraint): it is not sent, and the model is told
        refuse_call(step, call_id, refusal("NOT_GRANTED", f"{tool} is no longer granted; not sent"))
        return
    contract = step.policy.registry.get(tool)
    request_id = step.new_id("permit")
    queued = ToolCallQueued(
        call_id, tool, dict(args), QueueStage.PERMIT, request_id, operation_id, approval_digest
    )
    step.emit(queued)
    deadline = step.forward_deadline
    deadline = deadline if deadline is not None else step.now + step.policy.tool_timeout_s
    step.do(
        AcquirePermit(
            call_id,
            request_id,
            contract.dependency_scope,
            contract.sandbox_pool,
            step.record.priority_class,
            deadline,
        )
    )


def _waiting(step: Step, call_id: str, stage: QueueStage, request_id: str) -> QueuedCall | None:
    q = step.record.queued.get(call_id)
    if step.record.state is not S.WAITING_TOOL or q is None:
        return None
    return q if q.stage is stage and q.request_id == request_id else None


def _admissionrefusal(step: Step, q: QueuedCall) -> str | None:
    """The admission check (recovery chapter §12.2) at the dispatch boundary; the failed predicate's
    message, or None when admitted. Forward work cannot spend the finalization reserve."""
    rec = step.record
    contract = step.policy.registry.get(q.tool)
    blocked = pivot_refusal(step, contract, q.operation_id)
    if blocked is not None:
        return blocked
    deadline = None
    if rec.deadline is not None:
        try:
            deadline = Deadline(rec.created_at, rec.deadline, step.policy.reserve)
        except DeadlineConfigError:
            deadline = None  # a reserve as long as the whole deadline: the deadline predicate decides alone
    if deadline is None:
        return None
    outstanding = outstanding_liability(rec.operations.values())
    candidate = AdmissionCandidate(
        operation_id=q.operation_id or q.call_id,
        kind=OperationKind.RETRY if q.operation_id else OperationKind.FORWARD,
        required_grants=frozenset({q.tool}),
        needs_approval=q.approval_digest is not None,
        approval_valid=q.approval_digest is not None,
        liability=Spend({Dimension.DOLLARS: contract.charge}) if contract.charge else Spend(),
    )
    context = AdmissionContext(
        now=step.now,
        deadline=deadline,
        ceilings=rec.ceilings,
        consumed=rec.spend,
        outstanding=Spend({Dimension.DOLLARS: outstanding}) if outstanding else Spend(),
        grants=frozenset(t for t in rec.grants.tools if rec.grants.allows(t)),
    )
    decision = check_admission(candidate, context)
    first = decision.first_failure
    return None if first is None else f"{first.predicate.value}: {first.message}"


def on_permit_granted(step: Step, inp: PermitGranted) -> None:
    if is_cleanup(inp.call_id):
        on_cleanup_permit(step, inp)
        return
    q = _waiting(step, inp.call_id, QueueStage.PERMIT, inp.request_id)
    if q is None:  # no longer wanted (withdrawn, recovered, answered twice): give the permits back
        step.do(ReleasePermit(inp.guard, inp.sandbox, None))
        return
    stop = stop_requested(step)
    refused = None if stop is not None else _admissionrefusal(step, q)
    if stop is not None or refused is not None:
        step.do(ReleasePermit(inp.guard, inp.sandbox, None))
        if stop is not None:
            body = {"status": "REFUSED", "reason": "DEFERRED", "message": f"A {stop} request is pending."}
        else:
            body = refusal("NOT_ADMITTED", f"The call was not admitted ({refused}); nothing was sent.")
        withdraw(step, q.call_id, f"not sent: {stop or refused}", body)
        return
    dispatch(step, q, inp.guard, inp.sandbox)


def on_permit_refused(step: Step, inp: PermitRefused) -> None:
    if is_cleanup(inp.call_id):
        on_cleanup_permit_refused(step, inp)
        return
    q = _waiting(step, inp.call_id, QueueStage.PERMIT, inp.request_id)
    if q is None:
        return
    # breaker open or bulkhead full: the trajectory is told why; nothing was dispatched
    body = refusal(inp.reason, inp.message)
    if inp.retry_after is not None:
        body["retry_after_s"] = round(inp.retry_after, 3)
    withdraw(step, q.call_id, f"permit refused: {inp.reason}", body)
    from runtime._decide_supervise import on_dependency_refused

    on_dependency_refused(step, inp.reason, inp.message, q.tool)  # issue 12: a breaker open degrades


def dispatch(step: Step, q: QueuedCall, guard: GuardPermit | None, sandbox: SandboxPermit | None) -> None:
    """Intent before effect: the attempt is recorded (effect key from intent, a fresh attempt id) and only
    then sent."""
    rec = step.record
    contract = step.policy.registry.get(q.tool)
    if q.operation_id is not None:
        op = rec.operations[q.operation_id]
        key, operation_id, attempt = op.effect_key, op.operation_id, op.attempts + 1
    else:
        position = rec.turn_count * 1000 + len(rec.operations)
        key = effect_key(rec.trajectory_id, position, q.tool, q.arguments)
        operation_id, attempt = f"op-{key[:16]}", 1
    deadline = step.now + step.policy.tool_timeout_s
    forward = step.forward_deadline
    if forward is not None:
        deadline = min(deadline, max(forward, step.now))
    compensation = contract.compensation.tool if contract.compensation else None
    repeat_safe = contract.repeat in (RepeatContract.IDEMPOTENT, RepeatContract.DEDUPLICATED)
    attempt_id = f"{operation_id}#a{attempt}"
    step.emit(
        ToolDispatchIntent(
            call_id=q.call_id,
            tool=q.tool,
            arguments=q.arguments,
            effect_key=key,
            operation_id=operation_id,
            attempt_id=attempt_id,
            deadline=deadline,
            liability=contract.charge,
            compensation=compensation,
            repeat_safe=repeat_safe,
            approval_digest=q.approval_digest,
            guard_permit=guard,
            sandbox_permit=sandbox,
            at=step.now,
        )
    )
    if q.operation_id is None:
        register(step, contract, operation_id, dict(q.arguments))  # the cleanup template, before dispatch
    step.arm(TimerKind.CALL_DEADLINE, deadline, subject=q.call_id)
    invocation = ToolInvocation(
        rec.trajectory_id, q.call_id, q.tool, dict(q.arguments), key, operation_id, attempt_id, deadline
    )
    step.do(DispatchTool(invocation, guard, sandbox))


def retry_due(step: Step, call_id: str) -> None:
    """A retry's backoff ended: it asks for its permits again (a retry passes admission like fresh work)."""
    if is_cleanup(call_id):
        cleanup_retry_due(step, call_id)
        return
    q = step.record.queued.get(call_id)
    if step.record.state is not S.WAITING_TOOL or q is None or q.stage is not QueueStage.BACKOFF:
        return
    stop = stop_requested(step)
    if stop is not None:
        withdraw(step, call_id, f"retry not sent: {stop} requested")
        return
    queue_for_permit(step, q.call_id, q.tool, q.arguments, operation_id=q.operation_id)
