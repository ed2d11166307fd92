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

Where the rules live: ``runtime.transitions`` (``transition`` and its guards, for ``StateChanged``), the
per-event handlers in ``runtime._handlers_turn`` (turn, model call, completion check), ``_handlers_tools``
(holds, approvals, dispatch, results, operations) and ``_handlers_governance`` (control, budget, grants,
leases, pointers), and ``runtime.decisions`` (what the harness appends for incoming results and messages).
This module is the entry point and re-exports the transition and the decisions, so callers import from here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from runtime._handlers_cleanup import HANDLERS as CLEANUP_HANDLERS
from runtime._handlers_common import Handler, refuse
from runtime._handlers_governance import HANDLERS as GOVERNANCE_HANDLERS
from runtime._handlers_supervise import HANDLERS as SUPERVISE_HANDLERS
from runtime._handlers_tools import HANDLERS as TOOLS_HANDLERS
from runtime._handlers_turn import HANDLERS as TURN_HANDLERS
from runtime._replace import replace
from runtime.budget import BudgetCeilings, BudgetStage, Spend
from runtime.decisions import expired_calls, on_control, on_tool_result, retry_of
from runtime.errors import IllegalEvent, IllegalTransition, InvalidLog
from runtime.events import (
    ChildCancelled,
    ChildSettled,
    CleanupSettled,
    ControlRejected,
    EscalationAcknowledged,
    EscalationOpened,
    EscalationResolved,
    Event,
    LateResultDropped,
    ObligationBound,
    ObligationUpdated,
    OperationMarkedInDoubt,
    OperationSettled,
    OperatorActed,
    StateChanged,
    TrajectoryCreated,
)
from runtime.policy import TrajectoryPolicy
from runtime.record import Pointers, TrajectoryRecord
from runtime.states import TERMINAL_STATES, TrajectoryState
from runtime.transitions import transition
from runtime.watchdog import WatchdogState

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

AFTER_TERMINAL_KINDS: frozenset[str] = frozenset(
    {
        LateResultDropped.kind,
        ControlRejected.kind,
        OperationMarkedInDoubt.kind,
        OperationSettled.kind,
        ObligationBound.kind,
        ObligationUpdated.kind,
        CleanupSettled.kind,
        OperatorActed.kind,
    }
) | frozenset(
    # issue 12: escalations outlive the loop (operations in doubt at the end, custody taken afterwards),
    # and a child's evidence settles what its parent was charged for it
    {
        EscalationOpened.kind,
        EscalationAcknowledged.kind,
        EscalationResolved.kind,
        ChildSettled.kind,
        ChildCancelled.kind,
    }
)
"""Events a terminal record still accepts. They record audit or settlement evidence and change no state:
liability for an effect outlives the loop that caused it (recovery chapter), but nothing revives the loop."""

# Each handler module claims a disjoint set of event types; StateChanged is the transition itself.
_HANDLERS: Mapping[type, Handler] = {
    StateChanged: transition,
    **TURN_HANDLERS,
    **TOOLS_HANDLERS,
    **GOVERNANCE_HANDLERS,
    **SUPERVISE_HANDLERS,  # issue 12
    **CLEANUP_HANDLERS,
}


def start(event: TrajectoryCreated, policy: TrajectoryPolicy | None = None) -> TrajectoryRecord:
    """The record of a newly created trajectory, in READY, governed by ``policy`` (defaults without one)."""
    policy = policy if policy is not None else TrajectoryPolicy()
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
        watchdog=WatchdogState(policy.watchdog),
        policy=policy,
    )


def apply(record: TrajectoryRecord, event: Event) -> TrajectoryRecord:
    """Validate ``event`` against ``record`` and return the next record. Pure: ``record`` is unchanged.

    Raises ``IllegalEvent`` (or its subclass ``IllegalTransition``) when the event's guard fails.
    """
    if record.state in TERMINAL_STATES and event.kind not in AFTER_TERMINAL_KINDS:
        if isinstance(event, StateChanged):
            raise IllegalTransition(record.state, event.to_state, event.reason, rule="terminal_is_absorbing")
        refuse(record, event, "terminal_is_absorbing", "the trajectory has ended")
    handler = _HANDLERS.get(type(event))
    if handler is None:
        refuse(record, event, "unknown_event", f"no rule applies {type(event).__name__}")
    updated = handler(record, event)
    return replace(updated, log_position=record.log_position + 1)


def fold(events: Iterable[Event], policy: TrajectoryPolicy | None = None) -> TrajectoryRecord:
    """Rebuild the record from a log. Raises ``InvalidLog`` (an ``InputError``) naming the entry index when
    the log does not start with ``TrajectoryCreated`` or holds an event ``apply`` refuses."""
    record: TrajectoryRecord | None = None
    for index, event in enumerate(events):
        if record is None:
            if not isinstance(event, TrajectoryCreated):
                raise InvalidLog(
                    f"the first event must be trajectory_created, got {event.kind}", where="event[0]"
                )
            record = start(event, policy)
            continue
        try:
            record = apply(record, event)
        except IllegalEvent as exc:
            raise InvalidLog(str(exc), where=f"event[{index}]") from exc
    if record is None:
        raise InvalidLog("the log is empty", where="event[0]")
    return record
