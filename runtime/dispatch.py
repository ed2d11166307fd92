"""Ports the harness uses to dispatch tool calls and admit turns, with in-process defaults.

``runtime`` cannot import ``breakers`` or ``scheduler`` (dependencies point one way), so the single retry
owner, the dependency guard and the scheduler reach the harness through these small interfaces. The
defaults here are the trivial policies a single in-process trajectory needs: one attempt, no guard,
unlimited admission. ``actors/`` wires the real ones.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol, runtime_checkable

from runtime.clock import Clock
from runtime.ports import (
    GuardPermit,
    OutcomeClass,
    RateLimitInfo,
    SandboxPermit,
    Settlement,
    ToolOutcome,
    TurnGrant,
    TurnRequest,
)
from runtime.tools import RepeatContract

__all__ = [
    "NoGuard",
    "RetryPort",
    "RetryVerdict",
    "SingleAttempt",
    "UnlimitedAdmission",
    "Verdict",
]


class Verdict(StrEnum):
    DONE = "done"
    RETRY = "retry"
    PROBE = "probe"
    LEAVE_UNKNOWN = "leave_unknown"
    GIVE_UP = "give_up"


@dataclass(frozen=True, slots=True)
class RetryVerdict:
    verdict: Verdict
    reason: str
    delay_s: float = 0.0


@runtime_checkable
class RetryPort(Protocol):
    """The single retry owner, per logical operation (one attempt budget across every layer)."""

    def begin(self, operation_id: str, repeat: RepeatContract, deadline: float) -> None: ...

    def next_attempt(self, operation_id: str) -> str:
        """Charge one attempt and return its fresh attempt id; raises ``PolicyRefusal`` when exhausted."""
        ...

    def decide(self, operation_id: str, outcome: ToolOutcome) -> RetryVerdict: ...

    def after_probe(self, operation_id: str, settlement: Settlement) -> RetryVerdict: ...

    def forget(self, operation_id: str) -> None: ...


class SingleAttempt:
    """No retries: one attempt, then done, given up, or left unknown with the trajectory as owner."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)

    def begin(self, operation_id: str, repeat: RepeatContract, deadline: float) -> None:
        return None

    def next_attempt(self, operation_id: str) -> str:
        return f"{operation_id}#a{next(self._ids)}"

    def decide(self, operation_id: str, outcome: ToolOutcome) -> RetryVerdict:
        if outcome.settlement is Settlement.ESTABLISHED and outcome.outcome_class is OutcomeClass.SUCCESS:
            return RetryVerdict(Verdict.DONE, "established")
        if outcome.settlement is Settlement.UNKNOWN:
            return RetryVerdict(Verdict.LEAVE_UNKNOWN, "single attempt: outcome unknown")
        return RetryVerdict(Verdict.GIVE_UP, "single attempt")

    def after_probe(self, operation_id: str, settlement: Settlement) -> RetryVerdict:
        if settlement is Settlement.ESTABLISHED:
            return RetryVerdict(Verdict.DONE, "established by probe")
        return RetryVerdict(Verdict.LEAVE_UNKNOWN, "single attempt")

    def forget(self, operation_id: str) -> None:
        return None


class NoGuard:
    """A GuardPort that admits everything (no bulkhead, no breaker)."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)

    async def admit(self, scope: str, call_id: str, deadline: float) -> GuardPermit:
        return GuardPermit(f"noguard-{next(self._ids)}", scope, 0, False)

    async def record(self, permit: GuardPermit, outcome: OutcomeClass) -> None:
        return None

    async def release(self, permit: GuardPermit) -> None:
        return None


class UnlimitedAdmission:
    """An AdmissionPort that admits every turn at once and every sandbox request (single trajectory)."""

    def __init__(self, clock: Clock, lease_s: float = 600.0) -> None:
        self._clock = clock
        self._lease_s = lease_s
        self._ids = itertools.count(1)
        self.settled: dict[str, int] = {}

    async def admit_turn(self, request: TurnRequest) -> TurnGrant:
        return TurnGrant(
            f"grant-{next(self._ids)}", request.estimated_tokens, self._clock.wall() + self._lease_s
        )

    async def settle_turn(self, grant_id: str, actual_tokens: int) -> None:
        self.settled[grant_id] = actual_tokens

    async def report_rate_limited(
        self, provider_key: str, retry_after: float | None, remaining: Mapping[str, float]
    ) -> None:
        return None

    async def report_limits(self, provider_key: str, info: RateLimitInfo, rate_limited: bool) -> None:
        return None

    async def acquire_sandbox(
        self, trajectory_id: str, pool: str, priority_class: str, deadline: float
    ) -> SandboxPermit:
        return SandboxPermit(f"sandbox-{next(self._ids)}", pool, self._clock.wall() + self._lease_s)

    async def release_sandbox(self, permit_id: str) -> None:
        return None
