"""In-process defaults for the guard and admission ports (``runtime.ports``).

``runtime`` cannot import ``breakers`` or ``scheduler`` (dependencies point one way), so the dependency
guard and the scheduler reach a trajectory through ports. The defaults here are the trivial policies a
single in-process trajectory needs: no guard, unlimited admission. ``actors/`` wires the real ones; the
single retry owner's rule is pure and lives in ``runtime.retry``.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

from runtime.clock import Clock
from runtime.ports import (
    GuardPermit,
    OutcomeClass,
    RateLimitInfo,
    SandboxPermit,
    TurnGrant,
    TurnRequest,
)

__all__ = [
    "NoGuard",
    "UnlimitedAdmission",
]


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

    async def settle(self, permit: GuardPermit, outcome: OutcomeClass | None) -> None:
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

    async def report_limits(
        self, provider_key: str, info: RateLimitInfo, rate_limited: bool, grant_id: str | None = None
    ) -> None:
        return None

    async def acquire_sandbox(
        self, trajectory_id: str, pool: str, priority_class: str, deadline: float
    ) -> SandboxPermit:
        return SandboxPermit(f"sandbox-{next(self._ids)}", pool, self._clock.wall() + self._lease_s)

    async def release_sandbox(self, permit_id: str) -> None:
        return None
