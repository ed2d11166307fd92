"""Handlers for tool calls and what they leave behind: holds and approvals, dispatch, results, timeouts and
cancels, and the operations table that tracks each call's effect until it is settled.

The harness chapter's invariants as they apply here:

1. A tool result is accepted only in WAITING_TOOL for a still-pending call id; dropping a result that was
   acceptable is refused. A timeout or cancel removes the id without settling anything: the operation is
   then in doubt and owned by the trajectory.
2. A tool that requires approval is dispatched only as the exact call that was held, approved and re-checked,
   carrying the approval's digest; there is no other way to dispatch it.

Settlement rules (recovery chapter): a retry keeps the call, tool and effect key, needs a fresh attempt id
and is allowed only where ``may_redispatch`` says so; a settled operation stays settled.
"""

from __future__ import annotations

from collections.abc import Mapping

from runtime._handlers_common import (
    Handler,
    appended,
    audit,
    charged,
    refuse,
    require_state,
    with_item,
    without_item,
)
from runtime._replace import replace
from runtime.budget import meter_tool_call
from runtime.events import (
    ApprovalDecided,
    ApprovalRechecked,
    ApprovalVoted,
    CallObserved,
    Event,
    LateResultDropped,
    OperationMarkedInDoubt,
    OperationSettled,
    ToolCallCancelled,
    ToolCallHeld,
    ToolCallQueued,
    ToolCallTimedOut,
    ToolCallWithdrawn,
    ToolDispatchIntent,
    ToolJobStarted,
    ToolResultAccepted,
)
from runtime.operations import Operation, may_redispatch, settle
from runtime.ports import Settlement
from runtime.record import (
    ApprovalDecision,
    AuditKind,
    HeldCall,
    HeldVote,
    ModelOutcome,
    PendingCall,
    QueuedCall,
    TrajectoryRecord,
)
from runtime.states import TrajectoryState
from runtime.watchdog import WatchdogStep

S = TrajectoryState


def _pending(record: TrajectoryRecord, event: Event, call_id: str) -> PendingCall:
    pending = record.pending_calls.get(call_id)
    if pending is None:
        refuse(record, event, "call_not_pending", f"call {call_id!r} is not pending")
    return pending


def _abandon(record: TrajectoryRecord, event: Event, call_id: str) -> TrajectoryRecord:
    """The call's id leaves the pending set without a result: its outcome is in doubt (a timeout or a
    cancel request settles nothing) and the trajectory owns resolving it."""
    pending = _pending(record, event, call_id)
    op = record.operations[pending.operation_id]
    if not op.settled:
        op = replace(op, in_doubt=True, owner=record.trajectory_id)
    return replace(
        record,
        pending_calls=without_item(record.pending_calls, call_id),
        operations=with_item(record.operations, op.operation_id, op),
        transcript=appended(record.transcript, event),
    )


def _observed(rec: TrajectoryRecord, ev: CallObserved) -> TrajectoryRecord:
    require_state(rec, ev, S.CALLING_MODEL, S.WAITING_TOOL)
    step = WatchdogStep(ev.call_fingerprint, ev.coarse_fingerprint, ev.state_digest, ev.waiting_on_job)
    watchdog, _ = rec.watchdog.observe(step)
    return replace(rec, watchdog=watchdog)


def _held(rec: TrajectoryRecord, ev: ToolCallHeld) -> TrajectoryRecord:
    require_state(rec, ev, S.CALLING_MODEL)
    if rec.model_call is None or rec.model_call.outcome is not ModelOutcome.TOOL_USE:
        refuse(rec, ev, "reply_has_no_tool_calls", "only a tool_use reply proposes calls")
    if rec.held is not None:
        refuse(rec, ev, "one_held_call", "a call is already held this turn")
    if not rec.grants.allows(ev.tool):
        refuse(rec, ev, "tool_not_granted", f"{ev.tool!r} is outside the grant")
    held = HeldCall(
        ev.call_id,
        ev.tool,
        ev.arguments,
        ev.digest,
        ev.expires_at,
        ev.preconditions,
        requested_at=ev.requested_at,
        quorum=ev.quorum,
        required_roles=ev.required_roles,
    )
    return replace(rec, held=held)


def _held_for(rec: TrajectoryRecord, ev: Event, digest: str) -> HeldCall:
    require_state(rec, ev, S.AWAITING_APPROVAL)
    if rec.held is None or rec.held.digest != digest:
        refuse(rec, ev, "digest_mismatch", "the decision does not bind to the held call")
    return rec.held


def _approval_voted(rec: TrajectoryRecord, ev: ApprovalVoted) -> TrajectoryRecord:
    held = _held_for(rec, ev, ev.digest)
    if held.decision is not None:
        refuse(rec, ev, "already_decided", f"the held call was already {held.decision}")
    if ev.at > held.expires_at:
        refuse(rec, ev, "approval_expired", "a vote after expiry counts for nothing")
    if any(v.issuer == ev.issuer for v in held.votes):
        refuse(rec, ev, "signer_already_voted", f"{ev.issuer!r} already approved (signer uniqueness)")
    votes = (*held.votes, HeldVote(ev.issuer, ev.roles, ev.at))
    return replace(rec, held=replace(held, votes=votes))


def _approval_decided(rec: TrajectoryRecord, ev: ApprovalDecided) -> TrajectoryRecord:
    held = _held_for(rec, ev, ev.digest)
    if held.decision is not None:
        refuse(rec, ev, "already_decided", f"the held call was already {held.decision}")
    if ev.decision is ApprovalDecision.APPROVED and ev.decided_at > held.expires_at:
        refuse(rec, ev, "approval_expired", "silence until expiry is denial")
    # Time awaiting a person counts against the request's expiry, not the trajectory's compute budget.
    waited = max(0.0, ev.decided_at - held.requested_at) if held.requested_at > 0 else 0.0
    return replace(
        rec,
        held=replace(held, decision=ev.decision, issuers=ev.issuers),
        excluded_wait_s=rec.excluded_wait_s + waited,
    )


def _approval_rechecked(rec: TrajectoryRecord, ev: ApprovalRechecked) -> TrajectoryRecord:
    held = _held_for(rec, ev, ev.digest)
    if held.decision is not ApprovalDecision.APPROVED or held.recheck_passed is not None:
        refuse(rec, ev, "nothing_to_recheck", "only an approved, not yet re-checked call is re-checked")
    if ev.passed and ev.at > held.expires_at:
        refuse(rec, ev, "approval_expired", "the re-check ran after the approval expired")
    if ev.passed and not rec.grants.allows(held.tool):
        refuse(rec, ev, "grant_revoked", f"{held.tool!r} is no longer granted")
    return replace(rec, held=replace(held, recheck_passed=ev.passed))


def _queued(rec: TrajectoryRecord, ev: ToolCallQueued) -> TrajectoryRecord:
    require_state(rec, ev, S.WAITING_TOOL)
    if ev.call_id in rec.pending_calls:
        refuse(rec, ev, "already_pending", f"call {ev.call_id!r} is in flight")
    if not rec.grants.allows(ev.tool):
        refuse(rec, ev, "tool_not_granted", f"{ev.tool!r} is outside the grant")
    if ev.operation_id is not None and ev.operation_id not in rec.operations:
        refuse(rec, ev, "unknown_operation", f"no operation {ev.operation_id!r} to continue")
    call = QueuedCall(
        ev.call_id, ev.tool, ev.arguments, ev.stage, ev.request_id, ev.operation_id, ev.approval_digest
    )
    return replace(rec, queued=with_item(rec.queued, ev.call_id, call))


def _withdrawn(rec: TrajectoryRecord, ev: ToolCallWithdrawn) -> TrajectoryRecord:
    if ev.call_id not in rec.queued:
        refuse(rec, ev, "not_queued", f"call {ev.call_id!r} is not waiting to be sent")
    held = None if rec.held is not None and rec.held.call_id == ev.call_id else rec.held
    return replace(rec, queued=without_item(rec.queued, ev.call_id), held=held)


def _dispatch(rec: TrajectoryRecord, ev: ToolDispatchIntent) -> TrajectoryRecord:
    require_state(rec, ev, S.WAITING_TOOL)
    if ev.call_id in rec.pending_calls:
        refuse(rec, ev, "already_pending", f"call {ev.call_id!r} is already in flight")
    if not rec.grants.allows(ev.tool):
        refuse(rec, ev, "tool_not_granted", f"{ev.tool!r} is outside the grant")
    if rec.deadline is not None and ev.deadline > rec.deadline:
        refuse(rec, ev, "deadline_beyond_trajectory", "inner deadlines are clamped to the trajectory's")
    held = rec.held
    gated = (
        ev.tool in rec.grants.approval_required
        or ev.approval_digest is not None
        or (held is not None and held.call_id == ev.call_id)
    )
    if gated:
        # Invariant 2: the only way to dispatch a gated call is as the exact call that was approved.
        if held is None or not held.cleared_for_dispatch or ev.approval_digest != held.digest:
            refuse(rec, ev, "approval_not_cleared", "a gated call needs an approval that passed re-check")
        if (held.call_id, held.tool, held.arguments) != (ev.call_id, ev.tool, ev.arguments):
            refuse(rec, ev, "call_differs_from_approved", "the approval binds to one exact call")
        held = None

    existing = rec.operations.get(ev.operation_id)
    if existing is None:
        if any(op.effect_key == ev.effect_key for op in rec.operations.values()):
            refuse(rec, ev, "effect_key_reused", "another operation already owns this effect key")
        op = Operation(
            operation_id=ev.operation_id,
            call_id=ev.call_id,
            tool=ev.tool,
            effect_key=ev.effect_key,
            attempts=1,
            last_attempt_id=ev.attempt_id,
            liability=ev.liability,
            compensation=ev.compensation,
            repeat_safe=ev.repeat_safe,
            arguments=ev.arguments,
            dispatched_at=ev.at,
        )
    else:
        if (existing.call_id, existing.tool, existing.effect_key) != (ev.call_id, ev.tool, ev.effect_key):
            refuse(rec, ev, "operation_identity_changed", "a retry keeps call, tool and effect key")
        if not may_redispatch(existing):
            refuse(rec, ev, "settlement_before_retry", f"operation is {existing.settlement}")
        if ev.attempt_id == existing.last_attempt_id:
            refuse(rec, ev, "attempt_id_reused", "every attempt has a fresh attempt id")
        op = replace(
            existing,
            attempts=existing.attempts + 1,
            last_attempt_id=ev.attempt_id,
            settlement=Settlement.UNKNOWN,  # a new attempt's outcome starts unknown
            in_doubt=False,
            owner=None,
            liability=ev.liability,
            compensation=ev.compensation,
            repeat_safe=ev.repeat_safe,
            dispatched_at=ev.at or existing.dispatched_at,
        )
    pending = PendingCall(
        ev.call_id,
        ev.tool,
        ev.operation_id,
        ev.attempt_id,
        ev.deadline,
        guard_permit=ev.guard_permit,
        sandbox_permit=ev.sandbox_permit,
    )
    return replace(
        rec,
        held=held,
        pending_calls=with_item(rec.pending_calls, ev.call_id, pending),
        operations=with_item(rec.operations, op.operation_id, op),
        queued=without_item(rec.queued, ev.call_id),
    )


def _job_started(rec: TrajectoryRecord, ev: ToolJobStarted) -> TrajectoryRecord:
    pending = _pending(rec, ev, ev.call_id)
    if pending.job_handle is not None:
        refuse(rec, ev, "job_already_started", f"call {ev.call_id!r} has job {pending.job_handle!r}")
    return replace(
        rec,
        pending_calls=with_item(rec.pending_calls, ev.call_id, replace(pending, job_handle=ev.job_handle)),
    )


def _result_accepted(rec: TrajectoryRecord, ev: ToolResultAccepted) -> TrajectoryRecord:
    # Invariant 1: accepted only in WAITING_TOOL for a pending id; on_tool_result turns the rest into audits.
    require_state(rec, ev, S.WAITING_TOOL)
    pending = _pending(rec, ev, ev.call_id)
    op = settle(rec.operations[pending.operation_id], ev.settlement)
    if not op.settled:
        op = replace(op, in_doubt=True, owner=rec.trajectory_id)
    elif ev.settlement is Settlement.ESTABLISHED and ev.error is None:
        op = replace(op, result=ev.result)
    return replace(
        rec,
        pending_calls=without_item(rec.pending_calls, ev.call_id),
        operations=with_item(rec.operations, op.operation_id, op),
        spend=charged(rec, meter_tool_call(ev.charge).as_dict()),
        transcript=appended(rec.transcript, ev),
    )


def _timed_out(rec: TrajectoryRecord, ev: ToolCallTimedOut) -> TrajectoryRecord:
    return _abandon(rec, ev, ev.call_id)


def _cancelled(rec: TrajectoryRecord, ev: ToolCallCancelled) -> TrajectoryRecord:
    return _abandon(rec, ev, ev.call_id)


def _operation(rec: TrajectoryRecord, ev: Event, operation_id: str) -> Operation:
    op = rec.operations.get(operation_id)
    if op is None:
        refuse(rec, ev, "unknown_operation", f"no operation {operation_id!r}")
    awaited = rec.pending_calls.get(op.call_id)
    if awaited is not None and awaited.operation_id == operation_id:
        refuse(rec, ev, "still_awaited", "the call is pending: its result or deadline settles it first")
    return op


def _marked_in_doubt(rec: TrajectoryRecord, ev: OperationMarkedInDoubt) -> TrajectoryRecord:
    op = _operation(rec, ev, ev.operation_id)
    if op.settled:
        refuse(rec, ev, "already_settled", f"operation is {op.settlement}")
    op = replace(op, in_doubt=True, owner=ev.owner)
    return replace(rec, operations=with_item(rec.operations, op.operation_id, op))


def _operation_settled(rec: TrajectoryRecord, ev: OperationSettled) -> TrajectoryRecord:
    op = _operation(rec, ev, ev.operation_id)
    try:
        op = settle(op, ev.settlement)
    except ValueError as exc:
        refuse(rec, ev, "settled_is_final", str(exc))
    if ev.result is not None and op.settlement is Settlement.ESTABLISHED:
        op = replace(op, result=ev.result)
    transcript = appended(rec.transcript, ev) if ev.call_id is not None else rec.transcript
    return replace(rec, operations=with_item(rec.operations, op.operation_id, op), transcript=transcript)


def _late_result(rec: TrajectoryRecord, ev: LateResultDropped) -> TrajectoryRecord:
    if rec.state is S.WAITING_TOOL and ev.call_id in rec.pending_calls:
        refuse(rec, ev, "result_was_acceptable", "a result for a pending call must be accepted")
    return replace(rec, audit=audit(rec, AuditKind.LATE_RESULT_DROPPED, ev.call_id, ev.reason))


HANDLERS: Mapping[type, Handler] = {
    CallObserved: _observed,
    ToolCallHeld: _held,
    ApprovalVoted: _approval_voted,
    ApprovalDecided: _approval_decided,
    ApprovalRechecked: _approval_rechecked,
    ToolCallQueued: _queued,
    ToolCallWithdrawn: _withdrawn,
    ToolDispatchIntent: _dispatch,
    ToolJobStarted: _job_started,
    ToolResultAccepted: _result_accepted,
    ToolCallTimedOut: _timed_out,
    ToolCallCancelled: _cancelled,
    LateResultDropped: _late_result,
    OperationMarkedInDoubt: _marked_in_doubt,
    OperationSettled: _operation_settled,
}
"""The tool-call and operation rules, by event type, for ``runtime.fold.apply``."""
