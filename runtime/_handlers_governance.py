"""Handlers for what governs the loop from outside a turn: control messages, the budget meter, grants, leases
and the record's pointers.

A control message id is recorded once (delivery is at-least-once); a recorded request is applied or
superseded, not rejected. The budget stage is the meter's decision and is recorded as given; elapsed
wall-clock time never decreases. Grants only narrow, and FINALIZING releases leases without taking new ones.
"""

from __future__ import annotations

from collections.abc import Mapping

from runtime._handlers_common import Handler, audit, charged, refuse, with_item, without_item
from runtime._replace import replace
from runtime.budget import Dimension
from runtime.events import (
    BudgetCharged,
    BudgetStageChanged,
    ControlApplied,
    ControlRejected,
    ControlRequested,
    GrantNarrowed,
    LeaseAcquired,
    LeaseReleased,
    PointerMoved,
    PointerName,
    TimerCancelled,
    TimerFired,
    TimerStarted,
    WallClockMeasured,
)
from runtime.record import AuditKind, Grants, Lease, PendingControl, Timer, TrajectoryRecord
from runtime.states import TrajectoryState

S = TrajectoryState


def _control_requested(rec: TrajectoryRecord, ev: ControlRequested) -> TrajectoryRecord:
    if ev.message_id in rec.seen_control_ids:
        refuse(rec, ev, "duplicate_message", f"message {ev.message_id!r} was already recorded")
    request = PendingControl(ev.message_id, ev.action, ev.issuer, ev.reason, ev.payload)
    return replace(
        rec,
        pending_control=(*rec.pending_control, request),
        seen_control_ids=rec.seen_control_ids | {ev.message_id},
    )


def _control_applied(rec: TrajectoryRecord, ev: ControlApplied) -> TrajectoryRecord:
    if all(p.message_id != ev.message_id for p in rec.pending_control):
        refuse(rec, ev, "not_pending", f"no pending control message {ev.message_id!r}")
    trail = rec.audit
    if ev.refused is not None:
        trail = audit(rec, AuditKind.CONTROL_REFUSED, ev.message_id, ev.refused)
    return replace(
        rec,
        pending_control=tuple(p for p in rec.pending_control if p.message_id != ev.message_id),
        applied_control_ids=rec.applied_control_ids | {ev.message_id},
        audit=trail,
    )


def _timer_started(rec: TrajectoryRecord, ev: TimerStarted) -> TrajectoryRecord:
    if ev.timer_id in rec.timers:
        refuse(rec, ev, "timer_armed", f"timer {ev.timer_id!r} is already armed")
    timer = Timer(ev.timer_id, ev.timer_kind, ev.due_at, ev.subject)
    return replace(rec, timers=with_item(rec.timers, ev.timer_id, timer))


def _timer_gone(rec: TrajectoryRecord, ev: TimerFired | TimerCancelled) -> TrajectoryRecord:
    if ev.timer_id not in rec.timers:
        refuse(rec, ev, "unknown_timer", f"no armed timer {ev.timer_id!r}")
    return replace(rec, timers=without_item(rec.timers, ev.timer_id))


def _control_rejected(rec: TrajectoryRecord, ev: ControlRejected) -> TrajectoryRecord:
    if any(p.message_id == ev.message_id for p in rec.pending_control):
        refuse(rec, ev, "already_pending", "a recorded request is applied or superseded, not rejected")
    # Verify before dedupe: an unverified refusal never occupies its id, or a tampered copy that arrived
    # first would make the genuine message with the same id look like a duplicate.
    seen = rec.seen_control_ids | {ev.message_id} if ev.verified else rec.seen_control_ids
    return replace(
        rec, audit=audit(rec, AuditKind.CONTROL_REJECTED, ev.message_id, ev.reason), seen_control_ids=seen
    )


def _budget_charged(rec: TrajectoryRecord, ev: BudgetCharged) -> TrajectoryRecord:
    return replace(rec, spend=charged(rec, ev.amounts))


def _wall_clock(rec: TrajectoryRecord, ev: WallClockMeasured) -> TrajectoryRecord:
    if ev.elapsed_s < rec.spend.get(Dimension.WALL_SECONDS):
        refuse(rec, ev, "clock_went_backwards", "elapsed wall-clock time never decreases")
    return replace(rec, spend=rec.spend.with_value(Dimension.WALL_SECONDS, ev.elapsed_s))


def _stage_changed(rec: TrajectoryRecord, ev: BudgetStageChanged) -> TrajectoryRecord:
    return replace(rec, budget_stage=ev.stage, rho=ev.rho, binding_dimension=ev.binding_dimension)


def _grant_narrowed(rec: TrajectoryRecord, ev: GrantNarrowed) -> TrajectoryRecord:
    old = rec.grants
    if not ev.tools <= old.tools or (old.read_only and not ev.read_only):
        refuse(rec, ev, "grant_widened", "grants only narrow")
    if ev.subagents_allowed and not old.subagents_allowed:
        refuse(rec, ev, "grant_widened", "grants only narrow")
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
        refuse(rec, ev, "wrong_state", "FINALIZING releases leases; it does not take new ones")
    if ev.lease_id in rec.leases:
        refuse(rec, ev, "lease_held", f"lease {ev.lease_id!r} is already held")
    lease = Lease(ev.lease_id, ev.lease_kind, ev.resource, ev.expires_at)
    return replace(rec, leases=with_item(rec.leases, ev.lease_id, lease))


def _lease_released(rec: TrajectoryRecord, ev: LeaseReleased) -> TrajectoryRecord:
    if ev.lease_id not in rec.leases:
        refuse(rec, ev, "unknown_lease", f"lease {ev.lease_id!r} is not held")
    return replace(rec, leases=without_item(rec.leases, ev.lease_id))


_POINTER_FIELD = {
    PointerName.CONTEXT: "context_ref",
    PointerName.WORKSPACE: "workspace_ref",
    PointerName.WORKSPACE_SNAPSHOT: "workspace_snapshot",
    PointerName.PLAN: "plan_ref",
}


def _pointer_moved(rec: TrajectoryRecord, ev: PointerMoved) -> TrajectoryRecord:
    pointers = replace(rec.pointers, **{_POINTER_FIELD[ev.pointer]: ev.ref})
    return replace(rec, pointers=pointers)


HANDLERS: Mapping[type, Handler] = {
    ControlRequested: _control_requested,
    ControlApplied: _control_applied,
    ControlRejected: _control_rejected,
    BudgetCharged: _budget_charged,
    WallClockMeasured: _wall_clock,
    BudgetStageChanged: _stage_changed,
    GrantNarrowed: _grant_narrowed,
    LeaseAcquired: _lease_acquired,
    LeaseReleased: _lease_released,
    PointerMoved: _pointer_moved,
    TimerStarted: _timer_started,
    TimerFired: _timer_gone,
    TimerCancelled: _timer_gone,
}
"""The governance rules, by event type, for ``runtime.fold.apply``."""
