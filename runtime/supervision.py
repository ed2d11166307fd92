"""Supervision of one trajectory: its policy (what the workload declares) and its state (what the log folds).

One trajectory is supervised along five lines (issue 12); each has its own module of pure values, and the
rules that use them live in ``runtime._decide_supervise`` and ``runtime._decide_children``:

- the **watchdog ladder** (recovery chapter §12.6, reliability guide §4.4): every detector escalates
  inform -> constrain -> hold (``WatchdogLadder``); the turn-level detectors (cycle, stagnation) watch the
  declared task-state projection (``runtime.progress``);
- **holds and incidents** (§12.8, ``runtime.incident``): one hold flag, disclosure rules;
- **escalations** (guide §8, ``runtime.escalation``): an owner and an SLA per trigger;
- the **degradation ladder** (guide §9, ``runtime.degradation``);
- **delegation** (guide §11, ``runtime.delegation``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from runtime.degradation import DegradationPolicy, Rung
from runtime.delegation import DelegationPolicy
from runtime.errors import InputError
from runtime.escalation import Escalation, EscalationPolicy
from runtime.incident import DisclosureRule
from runtime.progress import ProgressSpec
from runtime.watchdog import Guard, WatchdogConfig, WatchdogState

__all__ = [
    "KNOWN_ERROR_CODES",
    "ChildState",
    "LadderRung",
    "OnHold",
    "SupervisionPolicy",
    "SupervisionPolicyError",
    "SupervisionState",
    "WatchdogLadder",
]


class SupervisionPolicyError(InputError):
    """A supervision setting is malformed (names the field)."""


class LadderRung(StrEnum):
    """The graduated response to a detector (guide §4.4)."""

    INFORM = "inform"  # a factual observation the model sees; the repeated call is withheld
    CONSTRAIN = "constrain"  # the grant narrows (the looping tool, or to read-only tools)
    HOLD = "hold"  # the hold flag: no new model-directed work; an escalation with the evidence


class OnHold(StrEnum):
    """What the policy does once a watchdog holds a trajectory."""

    WAIT = "wait"  # stay held (READY, nothing admitted) until a person resumes, kills or the deadline
    END = "end"  # end it at once: FAILED with the detector's own exit reason (a loop is not an ERROR)


@dataclass(frozen=True, slots=True)
class WatchdogLadder:
    """``rungs[n-1]`` answers a detector's n-th firing (the last rung repeats); the last rung is the hold.
    ``hold_timeout_s``: a held trajectory nobody resumed by then is ended by the policy."""

    rungs: tuple[LadderRung, ...] = (LadderRung.INFORM, LadderRung.CONSTRAIN, LadderRung.HOLD)
    on_hold: OnHold = OnHold.WAIT
    hold_timeout_s: float | None = None

    def __post_init__(self) -> None:
        if not self.rungs or self.rungs[-1] is not LadderRung.HOLD:
            raise SupervisionPolicyError("the ladder ends with hold", where="watchdog.ladder")
        if len(set(self.rungs)) != len(self.rungs):
            raise SupervisionPolicyError("each rung appears once", where="watchdog.ladder")
        if self.hold_timeout_s is not None and not self.hold_timeout_s > 0:
            raise SupervisionPolicyError("must be > 0 when set", where="watchdog.hold_timeout_s")

    def rung(self, firing: int) -> LadderRung:
        """The response to the ``firing``-th firing of one detector (1-based)."""
        return self.rungs[min(max(firing, 1), len(self.rungs)) - 1]


KNOWN_ERROR_CODES: frozenset[str] = frozenset(
    {
        # gRPC status names (the tool protocol), and what the runtime's own adapters say
        "CANCELLED",
        "UNKNOWN",
        "INVALID_ARGUMENT",
        "DEADLINE_EXCEEDED",
        "NOT_FOUND",
        "ALREADY_EXISTS",
        "PERMISSION_DENIED",
        "RESOURCE_EXHAUSTED",
        "FAILED_PRECONDITION",
        "ABORTED",
        "OUT_OF_RANGE",
        "UNIMPLEMENTED",
        "INTERNAL",
        "UNAVAILABLE",
        "DATA_LOSS",
        "UNAUTHENTICATED",
        "QUARANTINED",
    }
)
"""Error codes a tool result may carry without counting as novelty (``CODE: message``)."""


@dataclass(frozen=True, slots=True)
class SupervisionPolicy:
    """Everything supervision reads from the workload, beside the record (defaults: the watchdog ladder
    over call-level detectors, no projection, no disclosure rules, no degradation, no delegation)."""

    ladder: WatchdogLadder = field(default_factory=WatchdogLadder)
    progress: ProgressSpec = field(default_factory=ProgressSpec)
    progress_watch: WatchdogConfig = field(default_factory=lambda: WatchdogConfig(stagnation_steps=5))
    disclosure: tuple[DisclosureRule, ...] = ()
    escalations: EscalationPolicy = field(default_factory=EscalationPolicy)
    degradation: DegradationPolicy = field(default_factory=DegradationPolicy)
    delegation: DelegationPolicy = field(default_factory=DelegationPolicy)
    known_error_codes: frozenset[str] = KNOWN_ERROR_CODES
    verification_repeats: int = 3  # the same failure this many times is a verification escalation

    def __post_init__(self) -> None:
        if self.verification_repeats < 2:
            raise SupervisionPolicyError("must be >= 2", where="supervision.verification_repeats")


@dataclass(frozen=True, slots=True)
class ChildState:
    """A child as its parent's record sees it."""

    child_id: str
    call_id: str
    goal: str
    allocation: Mapping[str, float]
    status: str = "running"  # running | settled | cancelled
    verified: bool | None = None
    spent: Mapping[str, float] = field(default_factory=dict)
    deadline: float = 0.0

    @property
    def live(self) -> bool:
        return self.status == "running"


@dataclass(frozen=True, slots=True)
class SupervisionState:
    """What supervision folds from the log (``runtime._handlers_supervise``)."""

    ladder: Mapping[str, int] = field(default_factory=dict)  # detector -> firings since the last release
    progress: WatchdogState = field(
        default_factory=WatchdogState
    )  # the turn-level window (task-state digests)
    progress_turn: int = 0  # the last turn whose progress was observed
    results_seen: int = 0  # accepted results counted by the last observation
    escalations: Mapping[str, Escalation] = field(default_factory=dict)
    rung: Rung = Rung.FULL
    rung_turn: int = 0  # the turn at which the current rung was entered
    answer: str | None = None  # the deterministic rung's answer
    incidents: tuple[str, ...] = ()
    children: Mapping[str, ChildState] = field(default_factory=dict)
    withheld: tuple[str, ...] = ()  # proposals supervision withheld (what was not done, for the result)
    constrained: Mapping[str, str] = field(default_factory=dict)  # tool a constrain rung removed -> detector

    def live_children(self) -> list[ChildState]:
        return [c for c in self.children.values() if c.live]

    def open_escalations(self) -> list[Escalation]:
        from runtime.escalation import EscalationStatus

        return [e for e in self.escalations.values() if e.status is not EscalationStatus.RESOLVED]


def guard_of(name: str) -> Guard | None:
    """The watchdog detector named ``name``, if it is one."""
    try:
        return Guard(name)
    except ValueError:
        return None


def json_safe(value: Any) -> Any:
    """``value`` with tuples as lists and sets sorted, for JSON fields of events."""
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    if isinstance(value, frozenset | set):
        return sorted(json_safe(v) for v in value)
    return value
