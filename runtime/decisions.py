"""Decisions the harness asks of the record: what an incoming result or message becomes, before anything is
appended.

Each helper reads the record and returns the event to append (or ``None``); none of them changes anything, so
the caller still passes the event through ``runtime.fold.apply``. They are where the harness chapter's
invariants meet input that arrives from outside the loop:

1. A tool result is accepted only in WAITING_TOOL for a still-pending call id (``ToolResultAccepted``);
   anything else is a ``LateResultDropped`` audit entry (``on_tool_result``). A passed deadline removes the
   id (``ToolCallTimedOut``, from ``expired_calls``) before any later result can be considered.
4. Terminal states are absorbing: a control message for an ended trajectory is only audited
   (``on_control``), and a retry is a new trajectory (``retry_of``) whose ``parent_id`` names this one.
"""

from __future__ import annotations

from collections.abc import Mapping

from runtime.errors import IllegalEvent
from runtime.events import (
    ControlRejected,
    ControlRequested,
    LateResultDropped,
    ToolCallTimedOut,
    ToolResultAccepted,
    TrajectoryCreated,
)
from runtime.ports import ToolOutcome
from runtime.record import ControlAction, Grants, JsonValue, TrajectoryRecord
from runtime.states import TrajectoryState

__all__ = ["expired_calls", "on_control", "on_tool_result", "retry_of"]

S = TrajectoryState


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
        return ControlRejected(
            message_id, "trajectory_terminal", f"trajectory ended {record.state}", verified=True
        )
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
