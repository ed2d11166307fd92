"""The admission check: one pure predicate set every candidate operation passes before dispatch.

Recovery chapter §12.2 ("The admission check governs what the runtime may do next"): forward progress,
a retry, a repair, a status probe and a cleanup action all pass the same predicates — valid authority and
approval, satisfied dependencies, available capacity, enough time before the deadline, and a reservation
whose *bounded liability* fits beside actual consumption, the outstanding liability of unsettled
operations, and the protected finalization reserve. Recovery operations get no exemption. The check is
re-evaluated at the dispatch boundary, so it is a pure function of facts the caller gathers right then.

The predicates are evaluated in that order and the decision names the first one that fails (every
failure is kept as well, for the audit record).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType

from runtime.budget import BudgetCeilings, Spend
from runtime.deadline import Deadline
from runtime.errors import AdmissionRefused

__all__ = [
    "AdmissionCandidate",
    "AdmissionContext",
    "AdmissionDecision",
    "AdmissionFailure",
    "AdmissionPredicate",
    "OperationKind",
    "check_admission",
]

# Dollar sums such as 0.1 + 0.2 are not exact in binary floating point; a liability that fits exactly on
# paper must not be refused by the last bit. The slack is relative to the ceiling and far below a cent.
_RELATIVE_SLACK = 1e-9


class AdmissionPredicate(StrEnum):
    """The admission predicates, in evaluation order."""

    AUTHORITY = "authority"  # grant held, approval valid if required, no admission hold
    DEPENDENCIES = "dependencies"  # every operation this one presupposes is settled
    CAPACITY = "capacity"  # scheduler / bulkhead / sandbox permits granted
    DEADLINE = "deadline"  # the work ends before the applicable deadline
    LIABILITY = "liability"  # bounded liability fits beside consumption, outstanding and reserve


class OperationKind(StrEnum):
    """What the candidate is for. Model-directed kinds stop at an admission hold; probes and cleanup
    (observation queries, compensation) proceed under their own grants (recovery chapter §12.6.3)."""

    FORWARD = "forward"
    RETRY = "retry"
    REPAIR = "repair"
    PROBE = "probe"
    CLEANUP = "cleanup"

    @property
    def model_directed(self) -> bool:
        return self in (OperationKind.FORWARD, OperationKind.RETRY, OperationKind.REPAIR)


@dataclass(frozen=True, slots=True)
class AdmissionCandidate:
    """One operation asking to be dispatched, described by its worst case."""

    operation_id: str
    kind: OperationKind
    required_grants: frozenset[str] = frozenset()
    needs_approval: bool = False
    approval_valid: bool = False  # result of the approval re-check (digest, preconditions, expiry)
    depends_on: frozenset[str] = frozenset()  # operation ids that must be settled first
    capacity: frozenset[str] = frozenset()  # permits needed, e.g. "turn", "guard:test-service"
    duration_s: float = 0.0  # worst-case time the operation may take (its clamped timeout)
    liability: Spend = field(default_factory=Spend)  # maximum charge per dimension


@dataclass(frozen=True, slots=True)
class AdmissionContext:
    """The trajectory's facts at the dispatch boundary."""

    now: float  # epoch seconds (Clock.wall())
    deadline: Deadline
    ceilings: BudgetCeilings
    consumed: Spend  # metered spend so far
    outstanding: Spend  # liability still reserved by dispatched-but-unsettled operations
    grants: frozenset[str] = frozenset()
    settled: frozenset[str] = frozenset()  # operation ids whose outcome is established (or absent)
    capacity_granted: frozenset[str] = frozenset()
    hold: bool = False  # the pending_control hold (control, watchdog or incident)
    finalizing: bool = False  # the trajectory is in FINALIZING: the reserve is what funds it now


@dataclass(frozen=True, slots=True)
class AdmissionFailure:
    """One failed predicate with the facts that made it fail."""

    predicate: AdmissionPredicate
    message: str
    details: Mapping[str, object]


@dataclass(frozen=True, slots=True)
class AdmissionDecision:
    """The structured result. ``failed`` names the first failing predicate (None when admitted)."""

    operation_id: str
    failures: tuple[AdmissionFailure, ...]

    @property
    def admitted(self) -> bool:
        return not self.failures

    @property
    def failed(self) -> AdmissionPredicate | None:
        return self.failures[0].predicate if self.failures else None

    @property
    def first_failure(self) -> AdmissionFailure | None:
        return self.failures[0] if self.failures else None

    def raise_if_refused(self) -> None:
        """Raise :class:`~runtime.errors.AdmissionRefused` naming the first failing predicate."""
        first = self.first_failure
        if first is not None:
            raise AdmissionRefused(first.predicate.value, f"{self.operation_id}: {first.message}")


def _failure(predicate: AdmissionPredicate, message: str, **details: object) -> AdmissionFailure:
    return AdmissionFailure(predicate, message, MappingProxyType(details))


def _uses_reserve(candidate: AdmissionCandidate, ctx: AdmissionContext) -> bool:
    # The reserve exists to fund finalization on every exit path; cleanup (compensation) is part of it.
    return ctx.finalizing or candidate.kind is OperationKind.CLEANUP


def _authority(c: AdmissionCandidate, ctx: AdmissionContext) -> AdmissionFailure | None:
    missing = sorted(c.required_grants - ctx.grants)
    if missing:
        return _failure(
            AdmissionPredicate.AUTHORITY, f"grant not held: {', '.join(missing)}", missing=missing
        )
    if c.needs_approval and not c.approval_valid:
        return _failure(AdmissionPredicate.AUTHORITY, "approval required and not valid", approval=False)
    if ctx.hold and c.kind.model_directed:
        return _failure(
            AdmissionPredicate.AUTHORITY, f"admission hold withholds {c.kind} work", hold=True, kind=c.kind
        )
    return None


def _dependencies(c: AdmissionCandidate, ctx: AdmissionContext) -> AdmissionFailure | None:
    unsettled = sorted(c.depends_on - ctx.settled)
    if unsettled:
        return _failure(
            AdmissionPredicate.DEPENDENCIES,
            f"unsettled dependencies: {', '.join(unsettled)}",
            unsettled=unsettled,
        )
    return None


def _capacity(c: AdmissionCandidate, ctx: AdmissionContext) -> AdmissionFailure | None:
    missing = sorted(c.capacity - ctx.capacity_granted)
    if missing:
        return _failure(
            AdmissionPredicate.CAPACITY, f"capacity not granted: {', '.join(missing)}", missing=missing
        )
    return None


def _deadline(c: AdmissionCandidate, ctx: AdmissionContext) -> AdmissionFailure | None:
    finalizing = _uses_reserve(c, ctx)
    limit = ctx.deadline.at if finalizing else ctx.deadline.forward_at
    if ctx.deadline.fits(ctx.now, c.duration_s, finalizing=finalizing):
        return None
    return _failure(
        AdmissionPredicate.DEADLINE,
        f"needs {c.duration_s:g}s but only {max(0.0, limit - ctx.now):g}s remain"
        + ("" if finalizing else f" before the {ctx.deadline.reserve.seconds:g}s finalization reserve"),
        now=ctx.now,
        limit=limit,
        duration_s=c.duration_s,
    )


def _liability(c: AdmissionCandidate, ctx: AdmissionContext) -> AdmissionFailure | None:
    reserve = Spend() if _uses_reserve(c, ctx) else ctx.deadline.reserve.as_spend()
    for dim, ceiling in ctx.ceilings.limits.items():
        parts = (ctx.consumed.get(dim), ctx.outstanding.get(dim), reserve.get(dim), c.liability.get(dim))
        total = math.fsum(parts)
        if total - ceiling > _RELATIVE_SLACK * max(1.0, ceiling):
            consumed, outstanding, reserved, liability = parts
            return _failure(
                AdmissionPredicate.LIABILITY,
                f"{dim}: consumed {consumed:g} + outstanding {outstanding:g} + reserve {reserved:g}"
                f" + liability {liability:g} = {total:g} exceeds ceiling {ceiling:g}",
                dimension=dim,
                consumed=consumed,
                outstanding=outstanding,
                reserve=reserved,
                liability=liability,
                ceiling=ceiling,
                shortfall=total - ceiling,
            )
    return None


_PREDICATES = (_authority, _dependencies, _capacity, _deadline, _liability)


def check_admission(candidate: AdmissionCandidate, context: AdmissionContext) -> AdmissionDecision:
    """Evaluate every predicate in order; the decision's ``failed`` is the first that fails."""
    failures = tuple(f for check in _PREDICATES if (f := check(candidate, context)) is not None)
    return AdmissionDecision(operation_id=candidate.operation_id, failures=failures)
