"""``transition``: the one function that changes a trajectory's ``state`` (harness chapter, Listing 2).

Legality (``runtime.states.LEGAL_TRANSITIONS``) says which pairs may ever follow each other; the guards
here say when a legal pair is allowed for this record. Each guard returns ``None`` when it passes, or the
name of the rule that failed, which ``IllegalTransition`` carries. ``_GUARDS`` attaches them to the pairs
they govern; these are the state-changing consequences of the harness chapter's invariants:

2. A held call is dispatched only through AWAITING_APPROVAL -> WAITING_TOOL carrying the digest of an approval
   that passed its re-check; nothing leaves CALLING_MODEL for WAITING_TOOL while a call is held.
3. Every exit passes through FINALIZING, which records the exit reason; the terminal state must match it,
   nothing may still be pending or leased, and COMPLETED needs a passed completion check.

Invariant 4 (terminal states are absorbing) is enforced before any rule runs, in ``runtime.fold.apply``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from runtime._handlers_common import appended
from runtime._replace import replace
from runtime.budget import BudgetStage
from runtime.errors import IllegalTransition
from runtime.events import StateChanged
from runtime.record import ModelOutcome, TrajectoryRecord, Transition
from runtime.states import (
    TERMINAL_STATES,
    ExitReason,
    TrajectoryState,
    check_legal,
    terminal_state_for,
)

__all__ = ["transition"]

S = TrajectoryState

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
    if rec.pending_calls:
        return "calls_pending"
    return "calls_queued" if rec.queued else None


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
    if any(o.state.value in ("admitting", "running", "verifying") for o in rec.obligations.values()):
        return "cleanup_in_flight"
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
        "history": appended(record.history, Transition(record.log_position, src, dst, event.reason)),
    }
    if src is S.CALLING_MODEL or dst is S.CALLING_MODEL:
        changes["model_call"] = None  # one call per CALLING_MODEL episode
    if src in (S.AWAITING_APPROVAL, S.WAITING_TOOL) and dst is not S.WAITING_TOOL:
        changes["held"] = None  # withdrawn: it can only come back through a new hold and approval
        changes["queued"] = {}  # nothing queued was sent: it can only come back as a new proposal
    if dst is S.FINALIZING:
        changes["exit_reason"] = event.exit_reason
        changes["check_passed"] = None
    return replace(record, **changes)
