"""Absolute deadlines and the finalization reserve.

Reliability guide §7.2: *propagate an absolute deadline, not a duration*. The deadline is computed once
when the trajectory is admitted and every inner layer (turn, model call, tool call, retry backoff) clamps
its own timeout to it, so nesting composes and no inner layer outlives the task. It is epoch seconds
(``Clock.wall()``) because it crosses processes and is persisted in the log (see ``runtime/ports.py``).

"Reserve time for the ending": a slice at the end of the deadline, and a slice of the dollar ceiling, are
the *finalization reserve* (recovery chapter §12.5.4; harness "Finalization and remaining duties"). Forward
work cannot consume it; only finalization and cleanup may. Entering the reserve is the trigger for the
wind-down, not an emergency.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from runtime.budget import BudgetCeilings, Dimension, Spend
from runtime.clock import Clock
from runtime.errors import InputError

__all__ = ["Deadline", "DeadlineConfigError", "FinalizationReserve"]


class DeadlineConfigError(InputError):
    """A deadline or reserve was malformed (names the field)."""


def _finite(value: float, where: str, *, minimum: float | None = None, strict: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise DeadlineConfigError(f"must be a finite number, got {value!r}", where=where)
    if minimum is not None and (value < minimum or (strict and value == minimum)):
        raise DeadlineConfigError(f"must be {'>' if strict else '≥'} {minimum}, got {value!r}", where=where)
    return float(value)


@dataclass(frozen=True, slots=True)
class FinalizationReserve:
    """Time (seconds before the deadline) and dollars held back for FINALIZING on every exit path."""

    seconds: float = 0.0
    dollars: float = 0.0

    def __post_init__(self) -> None:
        _finite(self.seconds, "reserve.seconds", minimum=0.0)
        _finite(self.dollars, "reserve.dollars", minimum=0.0)

    def as_spend(self) -> Spend:
        """The dollar part as a spend vector, to stand beside consumption in the liability check."""
        return Spend({Dimension.DOLLARS: self.dollars}) if self.dollars else Spend()

    def forward_dollars(self, ceilings: BudgetCeilings, spend: Spend) -> float:
        """Dollars forward work may still spend: the ceiling minus spend minus this reserve (≥ 0).
        ``math.inf`` when the budget has no dollar ceiling."""
        if Dimension.DOLLARS not in ceilings:
            return math.inf
        return max(0.0, ceilings[Dimension.DOLLARS] - spend.get(Dimension.DOLLARS) - self.dollars)


@dataclass(frozen=True, slots=True)
class Deadline:
    """An absolute deadline (epoch seconds) fixed at admission, with its finalization reserve.

    ``at`` is the hard end: finalization itself must be done by then. ``forward_at`` (``at`` minus the
    reserve) is the end for forward work: a model call or tool call clamps to it, so the reserve survives.
    """

    started_at: float
    at: float
    reserve: FinalizationReserve = FinalizationReserve()

    def __post_init__(self) -> None:
        _finite(self.started_at, "deadline.started_at")
        _finite(self.at, "deadline.at")
        if self.at <= self.started_at:
            raise DeadlineConfigError(
                f"deadline {self.at} is not after its start {self.started_at}", where="deadline.at"
            )
        if self.reserve.seconds >= self.at - self.started_at:
            raise DeadlineConfigError(
                f"reserve of {self.reserve.seconds}s leaves no time for forward work in a "
                f"{self.at - self.started_at}s deadline",
                where="deadline.reserve.seconds",
            )

    @classmethod
    def admit(
        cls, clock: Clock, seconds: float, reserve: FinalizationReserve = FinalizationReserve()
    ) -> Deadline:
        """Fix the deadline once, at admission: ``now + seconds`` on the wall clock."""
        _finite(seconds, "deadline.seconds", minimum=0.0, strict=True)
        now = clock.wall()
        return cls(started_at=now, at=now + seconds, reserve=reserve)

    @property
    def forward_at(self) -> float:
        """The last instant forward work may run to; the reserve starts here."""
        return self.at - self.reserve.seconds

    def remaining(self, clock: Clock) -> float:
        """Seconds until the hard deadline (never negative)."""
        return max(0.0, self.at - clock.wall())

    def forward_remaining(self, clock: Clock) -> float:
        """Seconds forward work may still use without touching the reserve (never negative)."""
        return max(0.0, self.forward_at - clock.wall())

    def expired(self, clock: Clock) -> bool:
        """The hard deadline has passed (the instant ``at`` itself counts as expired)."""
        return clock.wall() >= self.at

    def in_reserve(self, clock: Clock) -> bool:
        """Forward time is used up: time to wind down (degrade/finalize), not to start new work."""
        return clock.wall() >= self.forward_at

    def elapsed(self, clock: Clock) -> float:
        """Wall-clock seconds since admission: the WALL_SECONDS budget dimension."""
        return max(0.0, clock.wall() - self.started_at)

    def clamp_at(self, requested_at: float, *, finalizing: bool = False) -> float:
        """Clamp an inner layer's absolute deadline so it never outlives this one.

        Forward work clamps to :attr:`forward_at`; finalization work (``finalizing=True``) may use the
        reserve and clamps to :attr:`at`.
        """
        _finite(requested_at, "requested_at")
        return min(requested_at, self.at if finalizing else self.forward_at)

    def clamp(self, clock: Clock, requested_seconds: float, *, finalizing: bool = False) -> float:
        """Absolute deadline for an inner layer that would like ``requested_seconds`` from now."""
        _finite(requested_seconds, "requested_seconds", minimum=0.0)
        return self.clamp_at(clock.wall() + requested_seconds, finalizing=finalizing)

    def fits(self, now: float, duration: float, *, finalizing: bool = False) -> bool:
        """Would work of ``duration`` seconds started at ``now`` (epoch) end by the applicable limit?"""
        limit = self.at if finalizing else self.forward_at
        return now + duration <= limit
