"""The closed trajectory state set and its legal transitions (harness chapter, Table 5 and Listing 2).

Six states are live and three terminal. ``LEGAL_TRANSITIONS`` is exactly the chapter's ``LEGAL`` set: the
nine listed pairs, every live state to FINALIZING, and FINALIZING to each terminal state. Nothing else is
legal, so a terminal state has no way out (invariant 4) and a live state reaches a terminal state only
through FINALIZING (invariant 3). The guards that sit on top of legality live in ``runtime.transitions``.
"""

from __future__ import annotations

from enum import StrEnum

from runtime.errors import IllegalTransition

__all__ = [
    "LEGAL_TRANSITIONS",
    "LIVE_STATES",
    "TERMINAL_STATES",
    "ExitReason",
    "TrajectoryState",
    "check_legal",
    "terminal_state_for",
]


class TrajectoryState(StrEnum):
    """Where a trajectory is in its loop. The main table of the harness chapter wins over its sidebars."""

    READY = "READY"  # queued for its next model call; holds the record only
    CALLING_MODEL = "CALLING_MODEL"  # one model call in flight
    WAITING_TOOL = "WAITING_TOOL"  # tool calls dispatched, results outstanding
    AWAITING_APPROVAL = "AWAITING_APPROVAL"  # an irreversible call held in escrow
    PAUSED = "PAUSED"  # held at a turn boundary for a person
    FINALIZING = "FINALIZING"  # cleanup barrier before exit
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELED = "CANCELED"


S = TrajectoryState

LIVE_STATES: frozenset[TrajectoryState] = frozenset(
    {S.READY, S.CALLING_MODEL, S.WAITING_TOOL, S.AWAITING_APPROVAL, S.PAUSED}
)
"""States a trajectory can work from. FINALIZING is neither live nor terminal: it is the exit barrier."""

TERMINAL_STATES: frozenset[TrajectoryState] = frozenset({S.COMPLETED, S.FAILED, S.CANCELED})
"""Absorbing states: no transition leaves them."""

_LISTED: frozenset[tuple[TrajectoryState, TrajectoryState]] = frozenset(
    {
        (S.READY, S.CALLING_MODEL),
        (S.READY, S.PAUSED),
        (S.CALLING_MODEL, S.READY),
        (S.CALLING_MODEL, S.WAITING_TOOL),
        (S.CALLING_MODEL, S.AWAITING_APPROVAL),
        (S.WAITING_TOOL, S.READY),
        (S.AWAITING_APPROVAL, S.WAITING_TOOL),
        (S.AWAITING_APPROVAL, S.READY),
        (S.PAUSED, S.READY),
    }
)

LEGAL_TRANSITIONS: frozenset[tuple[TrajectoryState, TrajectoryState]] = (
    _LISTED
    | frozenset((live, S.FINALIZING) for live in LIVE_STATES)
    | frozenset((S.FINALIZING, terminal) for terminal in TERMINAL_STATES)
)
"""Every ``(from, to)`` pair the machine permits: 9 listed + 5 into FINALIZING + 3 out of it = 17."""


class ExitReason(StrEnum):
    """Why a trajectory entered FINALIZING. Recorded on entry; the terminal state follows from it.

    ``COMPLETED`` on entry means the model claimed it was done (stop reason ``end_turn``): it is a request
    to run the completion check, and becomes ``COMPLETION_CHECK_FAILED`` if the check does not pass.
    """

    COMPLETED = "COMPLETED"
    COMPLETION_CHECK_FAILED = "COMPLETION_CHECK_FAILED"
    BUDGET_EXCEEDED = "BUDGET_EXCEEDED"  # halt stage (Table 12)
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    CANCELED = "CANCELED"  # cancel request (Table 6)
    KILLED = "KILLED"  # kill request (Table 6): FINALIZING, then FAILED
    REFUSED = "REFUSED"  # the provider refused and the task policy finalizes refusals
    MODEL_ERROR = "MODEL_ERROR"  # model calls failed and the budget allows no more retries
    ERROR = "ERROR"  # anything else the harness could not continue from
    # issue 12: a loop is not an error; these end a trajectory only by a supervision policy
    REPEATED_ACTION = "REPEATED_ACTION"  # a watchdog held exact or trivially varied repetition: ended
    CYCLING = "CYCLING"  # the task state kept returning to earlier states: ended by policy
    STAGNATED = "STAGNATED"  # no progress in the declared task state for K turns: ended by policy
    DEGRADED = "DEGRADED"  # ended on a degraded rung (assisted, deterministic, refusal): partial result
    DELEGATION_FAILED = "DELEGATION_FAILED"  # a child failed the parent's check and on_failure aborts


_TERMINAL_FOR: dict[ExitReason, TrajectoryState] = {
    ExitReason.COMPLETED: S.COMPLETED,
    ExitReason.CANCELED: S.CANCELED,
}


def terminal_state_for(reason: ExitReason) -> TrajectoryState:
    """The only terminal state a trajectory that exits for ``reason`` may settle in.

    Cancel ends CANCELED, a completion whose check passed ends COMPLETED, everything else (kill and
    budget exhaustion included, per Table 6) ends FAILED.
    """
    return _TERMINAL_FOR.get(reason, S.FAILED)


def check_legal(from_state: TrajectoryState, to_state: TrajectoryState, event: str) -> None:
    """Raise ``IllegalTransition`` unless ``(from_state, to_state)`` is in ``LEGAL_TRANSITIONS``."""
    if (from_state, to_state) not in LEGAL_TRANSITIONS:
        raise IllegalTransition(from_state, to_state, event)
