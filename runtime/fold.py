"""``apply``: the single place the trajectory record changes; ``fold``: the record rebuilt from its log.

The live harness and recovery use the same ``apply``: the live actor calls ``apply(record, event)`` to
validate an event and compute the next record, appends the encoded event to the log, then keeps the new
record. A restarted actor calls ``fold(events)``. Live and folded records are therefore equal by construction.

``apply`` refuses an event whose guard fails with ``IllegalEvent`` (``IllegalTransition`` for state changes)
before anything is written. The guards are the harness chapter's four invariants and their consequences:

1. A tool result is accepted only in WAITING_TOOL for a still-pending call id (``ToolResultAccepted``);
   anything else is a ``LateResultDropped`` audit entry. ``on_tool_result`` makes that decision. A passed
   deadline removes the id (``ToolCallTimedOut``) before any later result can be considered.
2. A held call is dispatched only after an approval that passed its re-check, through
   AWAITING_APPROVAL -> WAITING_TOOL carrying the approval's digest; a tool that requires approval cannot be
   dispatched any other way, and nothing can leave CALLING_MODEL for WAITING_TOOL while a call is held.
3. Every exit passes through FINALIZING (the legal set), which records the exit reason; the terminal state
   must match it, nothing may still be pending or leased, and COMPLETED needs a passed completion check.
4. Terminal states are absorbing: only audit and settlement-machinery events (which change no state) are
   accepted after the end. A retry is a new trajectory (``retry_of``) whose ``parent_id`` names this one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any, NoReturn, TypeVar

from runtime.budget import BudgetCeilings, BudgetStage, Dimension, Spend
from runtime.errors import IllegalEvent, IllegalTransition, InvalidLog
from runtime.events import (
    ApprovalDecided,
    ApprovalRechecked,
    BudgetCharged,
    BudgetStageChanged,
    CompletionChecked,
    ControlApplied,
    ControlRejected,
    ControlRequested,
    Event,
    GrantNarrowed,
    LateResultDropped,
    LeaseAcquired,
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
    ToolCallTimedOut,
    ToolDispatchIntent,
    ToolJobStarted,
    ToolResultAccepted,
    TrajectoryCreated,
    TurnStarted,
    WallClockMeasured,
)
from runtime.operations import Operation, may_redispatch, settle
from runtime.ports import Settlement, ToolOutcome, Usage
from runtime.record import (
    ApprovalDecision,
    AuditEntry,
    AuditKind,
    ControlAction,
    Grants,
    HeldCall,
    JsonValue,
    Lease,
    ModelCall,
    ModelOutcome,
    PendingCall,
    PendingControl,
    Pointers,
    TrajectoryRecord,
    Transition,
)
from runtime.states import (
    TERMINAL_STATES,
    ExitReason,
    TrajectoryState,
    check_legal,
    terminal_state_for,
)

__all__ = [
    "AFTER_TERMINAL_KINDS",
    "apply",
    "expired_calls",
    "fold",
    "on_control",
    "on_tool_result",
    "retry_of",
    "start",
    "transition",
]

S = TrajectoryState
E = TypeVar("E")

AFTER_TERMINAL_KINDS: frozenset[str] = frozenset(
    {LateResultDropped.kind, ControlRejected.kind, OperationMarkedInDoubt.kind, OperationSettled.kind}
)
"""Events a terminal record still accepts. They record audit or settlement evidence and change no state:
liability for an effect outlives the loop that caused it (recovery chapter), but nothing revives the loop."""


# --------------------------------------------------------------------------- entry points


def start(event: TrajectoryCreated) -> TrajectoryRecord:
    """The record of a newly created trajectory, in READY."""
    return TrajectoryRecord(
        trajectory_id=event.trajectory_id,
        parent_id=event.parent_id,
        tenant=event.tenant,
        contract=event.contract,
        priority_class=event.priority_class,
        created_at=event.created_at,
        deadline=event.deadline,
        state=S.READY,
        exit_reason=None,
        check_passed=None,
        turn_count=0,
        history=(),
        limits=event.limits,
        ceilings=BudgetCeilings(event.ceilings),
        spend=Spend(),
        budget_stage=BudgetStage.NOMINAL,
        rho=0.0,
        binding_dimension=None,
        grants=event.grants,
        leases={},
        model_call=None,
        pending_calls={},
        held=None,
        pending_control=(),
        pointers=Pointers(context_ref=event.context_ref, workspace_ref=event.workspace_ref),
        log_position=1,
        operations={},
        audit=(),
        seen_control_ids=frozenset(),
        applied_control_ids=frozenset(),
    )


def apply(record: TrajectoryRecord, event: Event) -> TrajectoryRecord:
    """Validate ``event`` against ``record`` and return the next record. Pure: ``record`` is unchanged.

    Raises ``IllegalEvent`` (or its subclass ``IllegalTransition``) when the event's guard fails.
    """
    if record.state in TERMINAL_STATES and event.kind not in AFTER_TERMINAL_KINDS:
        if isinstance(event, StateChanged):
            raise IllegalTransition(record.state, event.to_state, event.reason, rule="terminal_is_absorbing")
        _refuse(record, event, "terminal_is_absorbing", "the trajectory has ended")
    handler = _HANDLERS.get(type(event))
    if handler is None:
        _refuse(record, event, "unknown_event", f"no rule applies {type(event).__name__}")
    updated = handler(record, event)
    return replace(updated, log_position=record.log_position + 1)


def fold(events: Iterable[Event]) -> TrajectoryRecord:
    """Rebuild the record from a log. Raises ``InvalidLog`` (an ``InputError``) naming the entry index when
    the log does not start with ``TrajectoryCreated`` or holds an event ``apply`` refuses."""
    record: TrajectoryRecord | None = None
    for index, event in enumerate(events):
        if record is None:
            if not isinstance(event, TrajectoryCreated):
                raise InvalidLog(
                    f"the first event must be trajectory_created, got {event.kind}", where="event[0]"
                )
            record = start(event)
            continue
        try:
            record = apply(record, event)
        except IllegalEvent as exc:
            raise InvalidLog(str(exc), where=f"event[{index}]") from exc
    if record is None:
        raise InvalidLog("the log is empty", where="event[0]")
    return record


# --------------------------------------------------------------------------- transitions


_Guard = Callable[[TrajectoryRecord, StateChanged], str | None]


def _call_settled(rec: TrajectoryRecord, _: StateChanged) -> str | None:
    in_flight = rec.model_call is not None and rec.model_call.outcome is None
    return "model_call_in_flight" if in_flight else None


def _to_dispatch(rec: TrajectoryRecord, ev: StateChanged) -> str | None:
    if rec.model_call is None or rec.model_call.outcome is not ModelOutcome.TOOL_USE:
        return "reply_has_no_tool_calls"  # truncated, refused or aborted replies are never dispatched
    return "held_call_needs_approval" if rec.held is not None else None


def _to_approval(rec: TrajectoryRecord, ev: StateChanged) -> str | None:
    if rec.model_call is None or rec.model_call.outcome is not ModelOutcome.TOOL_USE:
        return "reply_has_no_tool_calls"
    return "nothing_held" if rec.held is None else None


def _release_approved(rec: TrajectoryRecord, ev: StateChanged) -> str | None:
    held = rec.held
    if held is None or not held.cleared_for_dispatch or ev.approval_digest != held.digest:
        return "approval_not_cleared"
    return None


def _nothing_pending(rec: TrajectoryRecord, _: StateChanged) -> str | None:
    return "calls_pending" if rec.pending_calls else None


def _budget_left(rec: TrajectoryRecord, _: StateChanged) -> str | None:
    return "budget_exhausted" if rec.budget_stage is BudgetStage.HALT else None


def _enter_finalizing(rec: TrajectoryRecord, ev: StateChanged) -> str | None:
    if ev.exit_reason is None:
        return "exit_reason_required"
    if ev.exit_reason is ExitReason.BUDGET_EXCEEDED and rec.budget_stage is not BudgetStage.HALT:
        return "budget_not_exhausted"  # the halt stage is the meter's decision, not the caller's
    return None


def _settle_terminal(rec: TrajectoryRecord, ev: StateChanged) -> str | None:
    if rec.exit_reason is None or terminal_state_for(rec.exit_reason) is not ev.to_state:
        return "exit_reason_mismatch"
    if rec.pending_calls:
        return "calls_pending"
    if rec.leases:
        return "leases_held"
    if ev.to_state is S.COMPLETED and rec.check_passed is not True:
        return "completion_check_not_passed"
    return None


_GUARDS: Mapping[tuple[TrajectoryState, TrajectoryState], tuple[_Guard, ...]] = {
    (S.READY, S.CALLING_MODEL): (_budget_left,),
    (S.CALLING_MODEL, S.READY): (_call_settled,),
    (S.CALLING_MODEL, S.WAITING_TOOL): (_call_settled, _to_dispatch),
    (S.CALLING_MODEL, S.AWAITING_APPROVAL): (_call_settled, _to_approval),
    (S.CALLING_MODEL, S.FINALIZING): (_call_settled, _enter_finalizing),
    (S.WAITING_TOOL, S.READY): (_nothing_pending,),
    (S.AWAITING_APPROVAL, S.WAITING_TOOL): (_release_approved,),
    **{(live, S.FINALIZING): (_enter_finalizing,) for live in (S.READY, S.WAITING_TOOL, S.PAUSED)},
    (S.AWAITING_APPROVAL, S.FINALIZING): (_enter_finalizing,),
    **{(S.FINALIZING, terminal): (_settle_terminal,) for terminal in TERMINAL_STATES},
}


def transition(record: TrajectoryRecord, event: StateChanged) -> TrajectoryRecord:
    """The one function that changes ``state`` (harness chapter, Listing 2).

    Checks the pair against ``LEGAL_TRANSITIONS``, runs the guards attached to it, records the change in
    ``history`` and performs what leaving or entering a state implies (a held call is withdrawn when
    AWAITING_APPROVAL or WAITING_TOOL is left without dispatching it; the exit reason is recorded on entering
    FINALIZING). Raises ``IllegalTransition`` naming the failed rule.
    """
    src, dst = record.state, event.to_state
    if event.from_state is not src:
        raise IllegalTransition(src, dst, event.reason, rule="stale_from_state")
    check_legal(src, dst, event.reason)
    if event.exit_reason is not None and dst is not S.FINALIZING:
        raise IllegalTransition(src, dst, event.reason, rule="exit_reason_only_on_finalizing")
    if event.approval_digest is not None and (src, dst) != (S.AWAITING_APPROVAL, S.WAITING_TOOL):
        raise IllegalTransition(src, dst, event.reason, rule="approval_digest_only_on_release")
    for guard in _GUARDS.get((src, dst), ()):
        failed = guard(record, event)
        if failed is not None:
            raise IllegalTransition(src, dst, event.reason, rule=failed)

    changes: dict[str, Any] = {
        "state": dst,
        "history": (*record.history, Transition(record.log_position, src, dst, event.reason)),
    }
    if src is S.CALLING_MODEL or dst is S.CALLING_MODEL:
        changes["model_call"] = None  # one call per CALLING_MODEL episode
    if src in (S.AWAITING_APPROVAL, S.WAITING_TOOL) and dst is not S.WAITING_TOOL:
        changes["held"] = None  # withdrawn: it can only come back through a new hold and approval
    if dst is S.FINALIZING:
        changes["exit_reason"] = event.exit_reason
        changes["check_passed"] = None
    return replace(record, **changes)


# --------------------------------------------------------------------------- helpers


def _refuse(record: TrajectoryRecord, event: Event, rule: str, message: str) -> NoReturn:
    raise IllegalEvent(event.kind, record.state, rule, message)


def _require_state(record: TrajectoryRecord, event: Event, *states: TrajectoryState) -> None:
    if record.state not in states:
        allowed = ", ".join(states)
        _refuse(record, event, "wrong_state", f"accepted only in {allowed}")


def _charged(record: TrajectoryRecord, amounts: Mapping[str, float]) -> Spend:
    positive = {dim: amount for dim, amount in amounts.items() if amount > 0}
    return record.spend.add(Spend(positive)) if positive else record.spend


def _model_charge(usage: Usage, dollars: float) -> dict[str, float]:
    return {Dimension.TOKENS: float(usage.total), Dimension.DOLLARS: dollars}


def _without(mapping: Mapping[str, E], key: str) -> dict[str, E]:
    return {k: v for k, v in mapping.items() if k != key}


def _with(mapping: Mapping[str, E], key: str, value: E) -> dict[str, E]:
    return {**mapping, key: value}


def _pending(record: TrajectoryRecord, event: Event, call_id: str) -> PendingCall:
    pending = record.pending_calls.get(call_id)
    if pending is None:
        _refuse(record, event, "call_not_pending", f"call {call_id!r} is not pending")
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
        pending_calls=_without(record.pending_calls, call_id),
        operations=_with(record.operations, op.operation_id, op),
    )


def _audit(record: TrajectoryRecord, kind: AuditKind, subject: str, reason: str) -> tuple[AuditEntry, ...]:
    return (*record.audit, AuditEntry(record.log_position, kind, subject, reason))


# --------------------------------------------------------------------------- handlers


def _created(rec: TrajectoryRecord, ev: TrajectoryCreated) -> TrajectoryRecord:
    return _refuse(rec, ev, "already_created", "a log has exactly one trajectory_created, first")


def _completion_checked(rec: TrajectoryRecord, ev: CompletionChecked) -> TrajectoryRecord:
    _require_state(rec, ev, S.FINALIZING)
    if ev.check != rec.contract.completion_check.name:
        _refuse(rec, ev, "wrong_check", f"the contract names {rec.contract.completion_check.name!r}")
    if rec.check_passed is not None:
        _refuse(rec, ev, "already_checked", "the completion check has a verdict")
    exit_reason = rec.exit_reason
    if exit_reason is ExitReason.COMPLETED and not ev.passed:
        exit_reason = ExitReason.COMPLETION_CHECK_FAILED
    return replace(rec, check_passed=ev.passed, exit_reason=exit_reason)


def _turn_started(rec: TrajectoryRecord, ev: TurnStarted) -> TrajectoryRecord:
    _require_state(rec, ev, S.READY)
    if ev.turn != rec.turn_count + 1:
        _refuse(rec, ev, "turn_out_of_order", f"next turn is {rec.turn_count + 1}, got {ev.turn}")
    return replace(rec, turn_count=ev.turn, spend=_charged(rec, {Dimension.TURNS: 1.0}))


def _model_intent(rec: TrajectoryRecord, ev: ModelCallIntent) -> TrajectoryRecord:
    _require_state(rec, ev, S.CALLING_MODEL)
    if rec.model_call is not None:
        _refuse(rec, ev, "one_call_per_episode", "this CALLING_MODEL episode already made its call")
    if ev.model != rec.limits.model:
        _refuse(rec, ev, "model_mismatch", f"the per-call limits name {rec.limits.model!r}")
    if ev.max_tokens > rec.limits.max_output_tokens:
        _refuse(rec, ev, "max_tokens_above_limit", f"limit is {rec.limits.max_output_tokens}")
    if rec.deadline is not None and ev.deadline > rec.deadline:
        _refuse(rec, ev, "deadline_beyond_trajectory", "inner deadlines are clamped to the trajectory's")
    call = ModelCall(ev.grant_id, ev.model, ev.max_tokens, ev.deadline)
    return replace(rec, model_call=call)


def _model_ended(
    rec: TrajectoryRecord, ev: Event, outcome: ModelOutcome, usage: Usage, dollars: float
) -> TrajectoryRecord:
    _require_state(rec, ev, S.CALLING_MODEL)
    if rec.model_call is None or rec.model_call.outcome is not None:
        _refuse(rec, ev, "no_call_in_flight", "no model call is in flight")
    # Usage is metered from the provider's report; every attempt, aborted ones included, is charged.
    return replace(
        rec,
        model_call=replace(rec.model_call, outcome=outcome),
        spend=_charged(rec, _model_charge(usage, dollars)),
    )


def _model_settled(rec: TrajectoryRecord, ev: ModelCallSettled) -> TrajectoryRecord:
    return _model_ended(rec, ev, ModelOutcome(ev.stop_reason.value), ev.usage, ev.dollars)


def _model_cancelled(rec: TrajectoryRecord, ev: ModelCallCancelled) -> TrajectoryRecord:
    return _model_ended(rec, ev, ModelOutcome.CANCELED, ev.usage, ev.dollars)


def _model_failed(rec: TrajectoryRecord, ev: ModelCallFailed) -> TrajectoryRecord:
    return _model_ended(rec, ev, ModelOutcome.FAILED, ev.usage, ev.dollars)


_PARSED = frozenset(
    {ModelOutcome.END_TURN, ModelOutcome.MAX_TOKENS, ModelOutcome.TOOL_USE, ModelOutcome.REFUSAL}
)


def _observation(rec: TrajectoryRecord, ev: ObservationAppended) -> TrajectoryRecord:
    if ev.observation is ObservationKind.ASSISTANT:
        # Quarantine: only a reply that ended cleanly is appended, and only a tool_use reply carries calls.
        _require_state(rec, ev, S.CALLING_MODEL)
        if rec.model_call is None or rec.model_call.outcome not in _PARSED:
            _refuse(rec, ev, "reply_not_parseable", "an aborted or failed call has no reply to append")
        if ev.tool_calls and rec.model_call.outcome is not ModelOutcome.TOOL_USE:
            _refuse(rec, ev, "truncated_reply_not_parsed", "only a tool_use reply proposes calls")
    return rec


def _held(rec: TrajectoryRecord, ev: ToolCallHeld) -> TrajectoryRecord:
    _require_state(rec, ev, S.CALLING_MODEL)
    if rec.model_call is None or rec.model_call.outcome is not ModelOutcome.TOOL_USE:
        _refuse(rec, ev, "reply_has_no_tool_calls", "only a tool_use reply proposes calls")
    if rec.held is not None:
        _refuse(rec, ev, "one_held_call", "a call is already held this turn")
    if not rec.grants.allows(ev.tool):
        _refuse(rec, ev, "tool_not_granted", f"{ev.tool!r} is outside the grant")
    held = HeldCall(ev.call_id, ev.tool, ev.arguments, ev.digest, ev.expires_at, ev.preconditions)
    return replace(rec, held=held)


def _held_for(rec: TrajectoryRecord, ev: Event, digest: str) -> HeldCall:
    _require_state(rec, ev, S.AWAITING_APPROVAL)
    if rec.held is None or rec.held.digest != digest:
        _refuse(rec, ev, "digest_mismatch", "the decision does not bind to the held call")
    return rec.held


def _approval_decided(rec: TrajectoryRecord, ev: ApprovalDecided) -> TrajectoryRecord:
    held = _held_for(rec, ev, ev.digest)
    if held.decision is not None:
        _refuse(rec, ev, "already_decided", f"the held call was already {held.decision}")
    if ev.decision is ApprovalDecision.APPROVED and ev.decided_at > held.expires_at:
        _refuse(rec, ev, "approval_expired", "silence until expiry is denial")
    return replace(rec, held=replace(held, decision=ev.decision, issuers=ev.issuers))


def _approval_rechecked(rec: TrajectoryRecord, ev: ApprovalRechecked) -> TrajectoryRecord:
    held = _held_for(rec, ev, ev.digest)
    if held.decision is not ApprovalDecision.APPROVED or held.recheck_passed is not None:
        _refuse(rec, ev, "nothing_to_recheck", "only an approved, not yet re-checked call is re-checked")
    if ev.passed and ev.at > held.expires_at:
        _refuse(rec, ev, "approval_expired", "the re-check ran after the approval expired")
    if ev.passed and not rec.grants.allows(held.tool):
        _refuse(rec, ev, "grant_revoked", f"{held.tool!r} is no longer granted")
    return replace(rec, held=replace(held, recheck_passed=ev.passed))


def _dispatch(rec: TrajectoryRecord, ev: ToolDispatchIntent) -> TrajectoryRecord:
    _require_state(rec, ev, S.WAITING_TOOL)
    if ev.call_id in rec.pending_calls:
        _refuse(rec, ev, "already_pending", f"call {ev.call_id!r} is already in flight")
    if not rec.grants.allows(ev.tool):
        _refuse(rec, ev, "tool_not_granted", f"{ev.tool!r} is outside the grant")
    if rec.deadline is not None and ev.deadline > rec.deadline:
        _refuse(rec, ev, "deadline_beyond_trajectory", "inner deadlines are clamped to the trajectory's")
    held = rec.held
    gated = (
        ev.tool in rec.grants.approval_required
        or ev.approval_digest is not None
        or (held is not None and held.call_id == ev.call_id)
    )
    if gated:
        # Invariant 2: the only way to dispatch a gated call is as the exact call that was approved.
        if held is None or not held.cleared_for_dispatch or ev.approval_digest != held.digest:
            _refuse(rec, ev, "approval_not_cleared", "a gated call needs an approval that passed re-check")
        if (held.call_id, held.tool, held.arguments) != (ev.call_id, ev.tool, ev.arguments):
            _refuse(rec, ev, "call_differs_from_approved", "the approval binds to one exact call")
        held = None

    existing = rec.operations.get(ev.operation_id)
    if existing is None:
        if any(op.effect_key == ev.effect_key for op in rec.operations.values()):
            _refuse(rec, ev, "effect_key_reused", "another operation already owns this effect key")
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
        )
    else:
        if (existing.call_id, existing.tool, existing.effect_key) != (ev.call_id, ev.tool, ev.effect_key):
            _refuse(rec, ev, "operation_identity_changed", "a retry keeps call, tool and effect key")
        if not may_redispatch(existing):
            _refuse(rec, ev, "settlement_before_retry", f"operation is {existing.settlement}")
        if ev.attempt_id == existing.last_attempt_id:
            _refuse(rec, ev, "attempt_id_reused", "every attempt has a fresh attempt id")
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
        )
    pending = PendingCall(ev.call_id, ev.tool, ev.operation_id, ev.attempt_id, ev.deadline)
    return replace(
        rec,
        held=held,
        pending_calls=_with(rec.pending_calls, ev.call_id, pending),
        operations=_with(rec.operations, op.operation_id, op),
    )


def _job_started(rec: TrajectoryRecord, ev: ToolJobStarted) -> TrajectoryRecord:
    pending = _pending(rec, ev, ev.call_id)
    if pending.job_handle is not None:
        _refuse(rec, ev, "job_already_started", f"call {ev.call_id!r} has job {pending.job_handle!r}")
    return replace(
        rec, pending_calls=_with(rec.pending_calls, ev.call_id, replace(pending, job_handle=ev.job_handle))
    )


def _result_accepted(rec: TrajectoryRecord, ev: ToolResultAccepted) -> TrajectoryRecord:
    # Invariant 1: accepted only in WAITING_TOOL for a pending id; on_tool_result turns the rest into audits.
    _require_state(rec, ev, S.WAITING_TOOL)
    pending = _pending(rec, ev, ev.call_id)
    op = settle(rec.operations[pending.operation_id], ev.settlement)
    if not op.settled:
        op = replace(op, in_doubt=True, owner=rec.trajectory_id)
    return replace(
        rec,
        pending_calls=_without(rec.pending_calls, ev.call_id),
        operations=_with(rec.operations, op.operation_id, op),
        spend=_charged(rec, {Dimension.DOLLARS: ev.charge}),
    )


def _timed_out(rec: TrajectoryRecord, ev: ToolCallTimedOut) -> TrajectoryRecord:
    return _abandon(rec, ev, ev.call_id)


def _cancelled(rec: TrajectoryRecord, ev: ToolCallCancelled) -> TrajectoryRecord:
    return _abandon(rec, ev, ev.call_id)


def _operation(rec: TrajectoryRecord, ev: Event, operation_id: str) -> Operation:
    op = rec.operations.get(operation_id)
    if op is None:
        _refuse(rec, ev, "unknown_operation", f"no operation {operation_id!r}")
    awaited = rec.pending_calls.get(op.call_id)
    if awaited is not None and awaited.operation_id == operation_id:
        _refuse(rec, ev, "still_awaited", "the call is pending: its result or deadline settles it first")
    return op


def _marked_in_doubt(rec: TrajectoryRecord, ev: OperationMarkedInDoubt) -> TrajectoryRecord:
    op = _operation(rec, ev, ev.operation_id)
    if op.settled:
        _refuse(rec, ev, "already_settled", f"operation is {op.settlement}")
    op = replace(op, in_doubt=True, owner=ev.owner)
    return replace(rec, operations=_with(rec.operations, op.operation_id, op))


def _operation_settled(rec: TrajectoryRecord, ev: OperationSettled) -> TrajectoryRecord:
    op = _operation(rec, ev, ev.operation_id)
    try:
        op = settle(op, ev.settlement)
    except ValueError as exc:
        _refuse(rec, ev, "settled_is_final", str(exc))
    return replace(rec, operations=_with(rec.operations, op.operation_id, op))


def _control_requested(rec: TrajectoryRecord, ev: ControlRequested) -> TrajectoryRecord:
    if ev.message_id in rec.seen_control_ids:
        _refuse(rec, ev, "duplicate_message", f"message {ev.message_id!r} was already recorded")
    request = PendingControl(ev.message_id, ev.action, ev.issuer, ev.reason, ev.payload)
    return replace(
        rec,
        pending_control=(*rec.pending_control, request),
        seen_control_ids=rec.seen_control_ids | {ev.message_id},
    )


def _control_applied(rec: TrajectoryRecord, ev: ControlApplied) -> TrajectoryRecord:
    if all(p.message_id != ev.message_id for p in rec.pending_control):
        _refuse(rec, ev, "not_pending", f"no pending control message {ev.message_id!r}")
    return replace(
        rec,
        pending_control=tuple(p for p in rec.pending_control if p.message_id != ev.message_id),
        applied_control_ids=rec.applied_control_ids | {ev.message_id},
    )


def _control_rejected(rec: TrajectoryRecord, ev: ControlRejected) -> TrajectoryRecord:
    if any(p.message_id == ev.message_id for p in rec.pending_control):
        _refuse(rec, ev, "already_pending", "a recorded request is applied or superseded, not rejected")
    return replace(
        rec,
        audit=_audit(rec, AuditKind.CONTROL_REJECTED, ev.message_id, ev.reason),
        seen_control_ids=rec.seen_control_ids | {ev.message_id},
    )


def _late_result(rec: TrajectoryRecord, ev: LateResultDropped) -> TrajectoryRecord:
    if rec.state is S.WAITING_TOOL and ev.call_id in rec.pending_calls:
        _refuse(rec, ev, "result_was_acceptable", "a result for a pending call must be accepted")
    return replace(rec, audit=_audit(rec, AuditKind.LATE_RESULT_DROPPED, ev.call_id, ev.reason))


def _budget_charged(rec: TrajectoryRecord, ev: BudgetCharged) -> TrajectoryRecord:
    return replace(rec, spend=_charged(rec, ev.amounts))


def _wall_clock(rec: TrajectoryRecord, ev: WallClockMeasured) -> TrajectoryRecord:
    if ev.elapsed_s < rec.spend.get(Dimension.WALL_SECONDS):
        _refuse(rec, ev, "clock_went_backwards", "elapsed wall-clock time never decreases")
    return replace(rec, spend=rec.spend.with_value(Dimension.WALL_SECONDS, ev.elapsed_s))


def _stage_changed(rec: TrajectoryRecord, ev: BudgetStageChanged) -> TrajectoryRecord:
    return replace(rec, budget_stage=ev.stage, rho=ev.rho, binding_dimension=ev.binding_dimension)


def _grant_narrowed(rec: TrajectoryRecord, ev: GrantNarrowed) -> TrajectoryRecord:
    old = rec.grants
    if not ev.tools <= old.tools or (old.read_only and not ev.read_only):
        _refuse(rec, ev, "grant_widened", "grants only narrow")
    if ev.subagents_allowed and not old.subagents_allowed:
        _refuse(rec, ev, "grant_widened", "grants only narrow")
    grants = Grants(
        tools=ev.tools,
        read_only_tools=old.read_only_tools & ev.tools,
        approval_required=old.approval_required,
        read_only=ev.read_only,
        subagents_allowed=ev.subagents_allowed,
    )
    return replace(rec, grants=grants)


def _lease_acquired(rec: TrajectoryRecord, ev: LeaseAcquired) -> TrajectoryRecord:
    if rec.state is S.FINALIZING:
        _refuse(rec, ev, "wrong_state", "FINALIZING releases leases; it does not take new ones")
    if ev.lease_id in rec.leases:
        _refuse(rec, ev, "lease_held", f"lease {ev.lease_id!r} is already held")
    lease = Lease(ev.lease_id, ev.lease_kind, ev.resource, ev.expires_at)
    return replace(rec, leases=_with(rec.leases, ev.lease_id, lease))


def _lease_released(rec: TrajectoryRecord, ev: LeaseReleased) -> TrajectoryRecord:
    if ev.lease_id not in rec.leases:
        _refuse(rec, ev, "unknown_lease", f"lease {ev.lease_id!r} is not held")
    return replace(rec, leases=_without(rec.leases, ev.lease_id))


_POINTER_FIELD = {
    PointerName.CONTEXT: "context_ref",
    PointerName.WORKSPACE: "workspace_ref",
    PointerName.WORKSPACE_SNAPSHOT: "workspace_snapshot",
    PointerName.PLAN: "plan_ref",
}


def _pointer_moved(rec: TrajectoryRecord, ev: PointerMoved) -> TrajectoryRecord:
    pointers = replace(rec.pointers, **{_POINTER_FIELD[ev.pointer]: ev.ref})
    return replace(rec, pointers=pointers)


_HANDLERS: Mapping[type, Callable[[TrajectoryRecord, Any], TrajectoryRecord]] = {
    TrajectoryCreated: _created,
    StateChanged: transition,
    CompletionChecked: _completion_checked,
    TurnStarted: _turn_started,
    ModelCallIntent: _model_intent,
    ModelCallSettled: _model_settled,
    ModelCallCancelled: _model_cancelled,
    ModelCallFailed: _model_failed,
    ObservationAppended: _observation,
    ToolCallHeld: _held,
    ApprovalDecided: _approval_decided,
    ApprovalRechecked: _approval_rechecked,
    ToolDispatchIntent: _dispatch,
    ToolJobStarted: _job_started,
    ToolResultAccepted: _result_accepted,
    ToolCallTimedOut: _timed_out,
    ToolCallCancelled: _cancelled,
    OperationMarkedInDoubt: _marked_in_doubt,
    OperationSettled: _operation_settled,
    ControlRequested: _control_requested,
    ControlApplied: _control_applied,
    ControlRejected: _control_rejected,
    LateResultDropped: _late_result,
    BudgetCharged: _budget_charged,
    WallClockMeasured: _wall_clock,
    BudgetStageChanged: _stage_changed,
    GrantNarrowed: _grant_narrowed,
    LeaseAcquired: _lease_acquired,
    LeaseReleased: _lease_released,
    PointerMoved: _pointer_moved,
}


# --------------------------------------------------------------------------- decisions for the harness


def on_tool_result(
    record: TrajectoryRecord, call_id: str, outcome: ToolOutcome, charge: float = 0.0
) -> ToolResultAccepted | LateResultDropped:
    """Decide what a tool result becomes (harness chapter, Listing 2 ``on_tool_result``).

    Accepted only in WAITING_TOOL for a call id that is still pending; otherwise the result is dropped and
    audited, never appended. The caller appends whichever event this returns.
    """
    if record.state is not S.WAITING_TOOL:
        return LateResultDropped(call_id, f"not_waiting_tool:{record.state}")
    if call_id not in record.pending_calls:
        return LateResultDropped(call_id, "call_not_pending")
    return ToolResultAccepted(
        call_id=call_id,
        settlement=outcome.settlement,
        outcome_class=outcome.outcome_class,
        result=outcome.result,
        error=outcome.error,
        charge=charge,
    )


def expired_calls(record: TrajectoryRecord, now: float) -> tuple[ToolCallTimedOut, ...]:
    """Timeouts for every pending call whose absolute deadline (epoch seconds) is at or before ``now``,
    earliest first. Appending them removes the ids before any later result is considered."""
    due = sorted((p.deadline, p.call_id) for p in record.pending_calls.values() if p.deadline <= now)
    return tuple(ToolCallTimedOut(call_id) for _, call_id in due)


def on_control(
    record: TrajectoryRecord,
    message_id: str,
    action: ControlAction,
    issuer: str,
    reason: str,
    payload: Mapping[str, JsonValue] | None = None,
) -> ControlRequested | ControlRejected | None:
    """Decide what an authenticated control message becomes. ``None`` for a message id already recorded
    (delivery is at-least-once; re-delivery is a no-op), a ``ControlRejected`` audit for a trajectory that has
    ended (terminal states are absorbing), otherwise a ``ControlRequested`` to apply at a turn boundary."""
    if message_id in record.seen_control_ids:
        return None
    if record.is_terminal:
        return ControlRejected(message_id, "trajectory_terminal", f"trajectory ended {record.state}")
    return ControlRequested(message_id, action, issuer, reason, dict(payload or {}))


def retry_of(
    record: TrajectoryRecord,
    trajectory_id: str,
    created_at: float,
    *,
    deadline: float | None,
    context_ref: str,
    grants: Grants | None = None,
) -> TrajectoryCreated:
    """The creation event of a retry: a new trajectory whose ``parent_id`` names ``record`` (invariant 4).

    Only a finished trajectory is retried; the old record and its history stay intact.
    """
    if not record.is_terminal:
        raise IllegalEvent(
            TrajectoryCreated.kind, record.state, "retry_of_live", "only an ended trajectory is retried"
        )
    return TrajectoryCreated(
        trajectory_id=trajectory_id,
        parent_id=record.trajectory_id,
        tenant=record.tenant,
        contract=record.contract,
        limits=record.limits,
        ceilings=record.ceilings.as_dict(),
        grants=grants if grants is not None else record.grants,
        priority_class=record.priority_class,
        created_at=created_at,
        deadline=deadline,
        context_ref=context_ref,
    )
