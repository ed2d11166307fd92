"""Operations and the settlement rule (recovery chapter, "settlement rule"; harness chapter, kill and waits).

Every dispatched tool call is an *operation* with a stable logical identity (``operation_id``, the same across
retries) and an effect key derived from intent. Its outcome is in one of three mutually exclusive evidence
states (``runtime.ports.Settlement``): it begins UNKNOWN, and only evidence correlated with that operation can
move it to ESTABLISHED or ESTABLISHED_ABSENT. A timeout, a cancel request or a kill settles nothing: the
operation stays UNKNOWN, becomes *in doubt* (nobody is awaiting its answer any more) and gets a named owner.
Settled is final. A dispatch may be repeated only when the evidence or the endpoint's repeat contract makes
re-execution safe (settlement before retry).

These are pure values and rules; ``runtime.fold.apply`` is the only place that changes the operation table.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from runtime._replace import replace
from runtime.ports import Settlement

__all__ = [
    "Operation",
    "may_redispatch",
    "outstanding_liability",
    "settle",
    "unsettled",
]


@dataclass(frozen=True, slots=True)
class Operation:
    """One logical operation in the record's operation table.

    ``attempts`` counts dispatches (every attempt is charged and counted; none resets it).
    ``liability`` is the bounded dollar liability reserved at admission; it stays reserved while the outcome
    is UNKNOWN. ``compensation`` names the cleanup template registered before dispatch, if any.
    ``owner`` is who must resolve an in-doubt outcome (the trajectory itself until it is handed off).
    """

    operation_id: str
    call_id: str
    tool: str
    effect_key: str
    attempts: int
    last_attempt_id: str
    settlement: Settlement = Settlement.UNKNOWN
    in_doubt: bool = False
    owner: str | None = None
    liability: float = 0.0
    compensation: str | None = None
    repeat_safe: bool = False
    arguments: Mapping[str, object] = field(default_factory=dict)  # as dispatched (canonical JSON)
    result: object = None  # the established result (a reply, or recovered by a probe)
    cleanup_of: str | None = None  # the obligation this operation is the compensation of
    dispatched_at: float = 0.0  # when its latest attempt was decided (epoch seconds)

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError("an operation exists only once it has been dispatched (attempts >= 1)")
        if not math.isfinite(self.liability) or self.liability < 0:
            raise ValueError(f"liability must be finite and >= 0, got {self.liability!r}")

    @property
    def settled(self) -> bool:
        return self.settlement is not Settlement.UNKNOWN


def settle(op: Operation, settlement: Settlement) -> Operation:
    """Record correlated evidence for ``op``.

    UNKNOWN evidence leaves an unsettled operation unsettled; a settled operation accepts only the same
    settlement again (idempotent re-delivery). Raises ``ValueError`` when evidence would change a settled
    outcome: settlement is final, and contradicting evidence is an incident, not an update.
    """
    if op.settled:
        if settlement is op.settlement:
            return op
        raise ValueError(
            f"operation {op.operation_id} is already {op.settlement}; cannot become {settlement}"
        )
    if settlement is Settlement.UNKNOWN:
        return op
    return replace(op, settlement=settlement, in_doubt=False)


def may_redispatch(op: Operation) -> bool:
    """Settlement before retry: a new attempt is allowed only if the effect is known absent, or the outcome
    is unknown but the endpoint's verified repeat contract makes re-execution safe. An established effect is
    never re-executed."""
    if op.settlement is Settlement.ESTABLISHED_ABSENT:
        return True
    return op.settlement is Settlement.UNKNOWN and op.repeat_safe


def unsettled(ops: Iterable[Operation]) -> tuple[Operation, ...]:
    """Operations whose outcome is still UNKNOWN (in flight or in doubt)."""
    return tuple(op for op in ops if not op.settled)


def outstanding_liability(ops: Iterable[Operation]) -> float:
    """Dollar liability still reserved by unsettled operations (an input to the admission check)."""
    # most operations reserve nothing: the liability is tested first, the settlement only when it counts
    return sum((op.liability for op in ops if op.liability and not op.settled), 0.0)
