"""The closed state machine (harness chapter, Table 5 and Listing 2): every ordered pair of the nine states is
either legal, and succeeds on a record that satisfies its guard, or raises ``IllegalTransition``."""

from __future__ import annotations

import itertools

import pytest

from runtime import (
    LEGAL_TRANSITIONS,
    LIVE_STATES,
    TERMINAL_STATES,
    CompletionChecked,
    ExitReason,
    IllegalTransition,
    StateChanged,
    ToolCallHeld,
    ToolResultAccepted,
    TrajectoryState,
    apply,
    check_legal,
    terminal_state_for,
    transition,
)
from runtime.ports import OutcomeClass, Settlement
from tests.unit.runtime.scenario import DIGEST, Log, in_state

S = TrajectoryState
ALL_PAIRS = list(itertools.product(S, S))

# The chapter's Listing 2, written out literally rather than derived, so the test cannot share a bug with it.
CHAPTER_LEGAL = {
    ("READY", "CALLING_MODEL"), ("READY", "PAUSED"),
    ("CALLING_MODEL", "READY"), ("CALLING_MODEL", "WAITING_TOOL"),
    ("CALLING_MODEL", "AWAITING_APPROVAL"),
    ("WAITING_TOOL", "READY"), ("AWAITING_APPROVAL", "WAITING_TOOL"),
    ("AWAITING_APPROVAL", "READY"), ("PAUSED", "READY"),
    ("READY", "FINALIZING"), ("CALLING_MODEL", "FINALIZING"), ("WAITING_TOOL", "FINALIZING"),
    ("AWAITING_APPROVAL", "FINALIZING"), ("PAUSED", "FINALIZING"),
    ("FINALIZING", "COMPLETED"), ("FINALIZING", "FAILED"), ("FINALIZING", "CANCELED"),
}  # fmt: skip


def test_legal_set_is_exactly_the_chapters() -> None:
    assert {(str(a), str(b)) for a, b in LEGAL_TRANSITIONS} == CHAPTER_LEGAL
    assert len(LEGAL_TRANSITIONS) == 17
    assert {str(s) for s in LIVE_STATES} == {
        "READY",
        "CALLING_MODEL",
        "WAITING_TOOL",
        "AWAITING_APPROVAL",
        "PAUSED",
    }
    assert {str(s) for s in TERMINAL_STATES} == {"COMPLETED", "FAILED", "CANCELED"}


def _prepared(src: TrajectoryState, dst: TrajectoryState) -> tuple[Log, StateChanged]:
    """A log in ``src`` whose record satisfies the guard of ``src -> dst``, and the event asking for it."""
    if src is S.FINALIZING:
        exit_reason = {S.COMPLETED: ExitReason.COMPLETED, S.CANCELED: ExitReason.CANCELED}.get(
            dst, ExitReason.ERROR
        )
        log = Log()
        log.finalize(exit_reason)
        if dst is S.COMPLETED:
            log.add(CompletionChecked("pytest", True))
        return log, StateChanged(src, dst, "settle")
    log = in_state(src)
    extra: dict[str, object] = {}
    if (src, dst) == (S.CALLING_MODEL, S.AWAITING_APPROVAL):
        log.add(ToolCallHeld("c-drop", "drop_table", {"db": "prod"}, DIGEST, 2e9))
    if (src, dst) == (S.WAITING_TOOL, S.READY):
        log.add(ToolResultAccepted("c1", Settlement.ESTABLISHED, OutcomeClass.SUCCESS, "ok", None))
    if (src, dst) == (S.AWAITING_APPROVAL, S.WAITING_TOOL):
        log.approve()
        extra["approval_digest"] = DIGEST
    if dst is S.FINALIZING:
        extra["exit_reason"] = ExitReason.ERROR
    return log, StateChanged(src, dst, "test", **extra)  # type: ignore[arg-type]


@pytest.mark.parametrize(("src", "dst"), ALL_PAIRS, ids=[f"{a}->{b}" for a, b in ALL_PAIRS])
def test_every_ordered_pair_is_legal_or_refused(src: TrajectoryState, dst: TrajectoryState) -> None:
    # Given a record in src that satisfies every guard of src -> dst (where the pair is legal)
    if (src, dst) in LEGAL_TRANSITIONS:
        log, event = _prepared(src, dst)
        # When the transition is applied / Then it succeeds and is recorded in the history
        record = log.add(event)
        assert record.state is dst
        assert (record.history[-1].from_state, record.history[-1].to_state) == (src, dst)
    else:
        log = in_state(src)
        event = StateChanged(src, dst, "test", exit_reason=ExitReason.ERROR if dst is S.FINALIZING else None)
        # When an illegal pair is asked for / Then IllegalTransition names it and nothing changes
        with pytest.raises(IllegalTransition) as info:
            transition(log.record, event)
        assert (info.value.from_state, info.value.to_state, info.value.rule) == (src, dst, "not_legal")
        with pytest.raises(IllegalTransition):
            apply(log.record, event)
        assert log.record.state is src


@pytest.mark.parametrize(("src", "dst"), sorted(LEGAL_TRANSITIONS))
def test_check_legal_accepts_exactly_the_legal_set(src: TrajectoryState, dst: TrajectoryState) -> None:
    check_legal(src, dst, "probe")  # no exception


def test_a_stale_from_state_is_refused() -> None:
    # Given a READY record, when an event claims it is leaving PAUSED, then it is refused
    log = in_state(S.READY)
    with pytest.raises(IllegalTransition) as info:
        log.add(StateChanged(S.PAUSED, S.READY, "resume"))
    assert info.value.rule == "stale_from_state"


@pytest.mark.parametrize(
    ("reason", "terminal"),
    [
        (ExitReason.COMPLETED, S.COMPLETED),
        (ExitReason.CANCELED, S.CANCELED),
        (ExitReason.KILLED, S.FAILED),
        (ExitReason.BUDGET_EXCEEDED, S.FAILED),
        (ExitReason.COMPLETION_CHECK_FAILED, S.FAILED),
        (ExitReason.DEADLINE_EXCEEDED, S.FAILED),
    ],
)
def test_exit_reason_decides_the_terminal_state(reason: ExitReason, terminal: TrajectoryState) -> None:
    assert terminal_state_for(reason) is terminal
