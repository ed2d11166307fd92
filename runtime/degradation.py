"""The degradation ladder and honest partial results (reliability guide §9).

Rungs are declared per workload, in order: full autonomy, constrained (read-only tools, a smaller budget),
assisted (plan only: the agent prepares, a person applies), deterministic (a non-agentic answer covering the
common case), honest refusal (the only rung guaranteed to be available, so a declared ladder always ends
with it). Policy triggers move a trajectory down: a dependency's breaker open, entering the finalization
reserve, the budget's restrict stage. Each trigger names the rung it asks for; the trajectory moves to that
rung, or the next declared one below it, and never back up by itself (a degraded answer that silently
becomes a full one is the hazard §9.4 warns about).

The rung is recorded on every result (``result_of``), and a result that is not the full answer carries
machine-readable completeness (§9.3): ``status`` (``complete``, ``partial``, ``refused``), what was done and
what was not, in the request's terms (operations by tool), and the next action.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from runtime.errors import InputError

if TYPE_CHECKING:
    from runtime.record import TrajectoryRecord

__all__ = [
    "DegradationPolicy",
    "DegradationPolicyError",
    "DegradeTrigger",
    "Rung",
    "result_of",
]


class Rung(StrEnum):
    """Capability rungs, from the top (guide §9.2)."""

    FULL = "full"
    CONSTRAINED = "constrained"
    ASSISTED = "assisted"
    DETERMINISTIC = "deterministic"
    REFUSAL = "refusal"

    @property
    def level(self) -> int:
        return _ORDER.index(self)


_ORDER = (Rung.FULL, Rung.CONSTRAINED, Rung.ASSISTED, Rung.DETERMINISTIC, Rung.REFUSAL)


class DegradeTrigger(StrEnum):
    BREAKER_OPEN = "breaker_open"  # a dependency's breaker refused a call
    FINALIZATION_RESERVE = "finalization_reserve"  # forward work reached the reserve (time or dollars)
    RESTRICT_STAGE = "restrict_stage"  # the budget entered its restrict stage


class DegradationPolicyError(InputError):
    """A degradation ladder is malformed (names the field)."""


_DEFAULT_TRIGGERS: Mapping[DegradeTrigger, Rung] = {
    DegradeTrigger.BREAKER_OPEN: Rung.CONSTRAINED,
    DegradeTrigger.RESTRICT_STAGE: Rung.CONSTRAINED,
    DegradeTrigger.FINALIZATION_RESERVE: Rung.ASSISTED,
}


@dataclass(frozen=True, slots=True)
class DegradationPolicy:
    """A workload's ladder. ``rungs`` are the declared rungs in order (``(FULL,)``: no ladder, nothing
    degrades); ``triggers`` the rung each trigger asks for; ``constrained_turns`` the smaller budget of the
    constrained rung (turns left once it is entered); ``deterministic_answer`` the deterministic rung's
    answer (a template), required when that rung is declared."""

    rungs: tuple[Rung, ...] = (Rung.FULL,)
    triggers: Mapping[DegradeTrigger, Rung] = field(default_factory=lambda: dict(_DEFAULT_TRIGGERS))
    constrained_turns: int | None = 3
    deterministic_answer: str | None = None

    def __post_init__(self) -> None:
        if not self.rungs or self.rungs[0] is not Rung.FULL:
            raise DegradationPolicyError("the ladder starts at full", where="degradation.rungs")
        if list(self.rungs) != sorted(set(self.rungs), key=lambda r: r.level):
            raise DegradationPolicyError("rungs are distinct and in ladder order", where="degradation.rungs")
        if len(self.rungs) > 1 and self.rungs[-1] is not Rung.REFUSAL:
            raise DegradationPolicyError(
                "a declared ladder ends with refusal: the one rung that is always available",
                where="degradation.rungs",
            )
        if Rung.DETERMINISTIC in self.rungs and not self.deterministic_answer:
            raise DegradationPolicyError(
                "the deterministic rung needs its answer", where="degradation.deterministic_answer"
            )
        if self.constrained_turns is not None and self.constrained_turns < 1:
            raise DegradationPolicyError("must be >= 1", where="degradation.constrained_turns")

    @property
    def enabled(self) -> bool:
        return len(self.rungs) > 1

    def target(self, trigger: DegradeTrigger, current: Rung) -> Rung | None:
        """The rung ``trigger`` moves a trajectory on ``current`` to, or None (no move: not declared, or
        already at or below it)."""
        if not self.enabled:
            return None
        wanted = self.triggers.get(trigger)
        if wanted is None:
            return None
        below = [r for r in self.rungs if r.level >= wanted.level]
        rung = below[0] if below else self.rungs[-1]
        return rung if rung.level > current.level else None

    def next_below(self, current: Rung) -> Rung:
        """The declared rung after ``current`` (refusal at the bottom)."""
        below = [r for r in self.rungs if r.level > current.level]
        return below[0] if below else Rung.REFUSAL


def _progress(record: TrajectoryRecord) -> tuple[list[str], list[str]]:
    """(done, not done), one line per call the model proposed, in the request's terms."""
    from runtime.events import (
        ChildCancelled,
        ChildSettled,
        ObservationAppended,
        ObservationKind,
        ToolCallCancelled,
        ToolCallTimedOut,
        ToolResultAccepted,
    )
    from runtime.ports import Settlement

    proposed: dict[str, str] = {}
    why: dict[str, str | None] = {}  # call id -> None when done, else why not
    for ev in record.transcript:
        if isinstance(ev, ObservationAppended) and ev.observation is ObservationKind.ASSISTANT:
            for call in ev.tool_calls:
                proposed[call.call_id] = call.tool
        elif isinstance(ev, ToolResultAccepted):
            ok = ev.settlement is Settlement.ESTABLISHED and ev.error is None
            why[ev.call_id] = None if ok else f"{ev.settlement.value}: {ev.error or 'no effect'}"[:160]
        elif isinstance(ev, ObservationAppended) and ev.call_id is not None:
            try:
                body = json.loads(ev.content)
            except ValueError:
                body = {}
            reason = body.get("reason", "refused") if isinstance(body, dict) else "refused"
            why.setdefault(ev.call_id, f"not run: {reason}")
        elif isinstance(ev, ToolCallTimedOut | ToolCallCancelled):
            why.setdefault(ev.call_id, "in doubt: no result")
        elif isinstance(ev, ChildSettled):
            why[ev.call_id] = None if ev.verified else f"child failed its check: {ev.detail}"[:160]
        elif isinstance(ev, ChildCancelled):
            why.setdefault(ev.call_id, "child cancelled")
    done = [f"{tool} ({cid})" for cid, tool in proposed.items() if cid in why and why[cid] is None]
    not_done = [
        f"{tool} ({cid}): {why.get(cid) or 'not executed'}"
        for cid, tool in proposed.items()
        if why.get(cid, "x") is not None
    ]
    return done, not_done


def result_of(record: TrajectoryRecord) -> dict[str, Any]:
    """The trajectory's result with its rung and machine-readable completeness (§9.3)."""
    from runtime.states import ExitReason, TrajectoryState

    rung = record.supervision.rung
    done, not_done = _progress(record)
    completed = record.state is TrajectoryState.COMPLETED
    if not record.is_terminal:
        status, next_action = "in_progress", "wait for the trajectory to end"
    elif rung is Rung.REFUSAL:
        status, next_action = "refused", "a person takes the request (see its escalation)"
    elif rung is Rung.ASSISTED:
        status, next_action = "partial", "a person applies the plan the agent prepared (see its escalation)"
    elif rung is Rung.DETERMINISTIC:
        status, next_action = "partial", "the deterministic answer covers the common case only"
    elif completed and rung is Rung.FULL and not not_done:
        status, next_action = "complete", "none"
    elif completed:
        status, next_action = "partial", "review what was not done: it will not be retried automatically"
    else:
        status = "partial" if done else "failed"
        reason = record.exit_reason.value if record.exit_reason is not None else "unknown"
        queued = any(e.status.value != "resolved" for e in record.supervision.escalations.values())
        next_action = "queued for a person (see its escalation)" if queued else f"abandoned: ended {reason}"
        if record.exit_reason in (ExitReason.KILLED, ExitReason.CANCELED):
            next_action = "abandoned by an operator"
    out: dict[str, Any] = {
        "status": status,
        "rung": rung.value,
        "done": done,
        "not_done": not_done,
        "next_action": next_action,
    }
    if rung is Rung.DETERMINISTIC and record.supervision.answer is not None:
        out["answer"] = record.supervision.answer
    return out
