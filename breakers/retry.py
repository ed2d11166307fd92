"""The single retry owner: one place per logical operation decides whether another attempt is sent.

Rules (recovery chapter §12.7.2, reliability guide §5.1, §5.4, §6.7, §7.2):

- One attempt budget per logical operation, shared by every layer. Layers below (SDK, client, gateway)
  never retry on their own allowance; they ask the owner, so 3 layers x 3 attempts is 3 attempts, not 27.
- Capped exponential backoff with full jitter (equation 8): ``ceiling_j = min(cap, base * 2**j)`` and the
  delay is drawn uniformly from ``[0, ceiling_j]``; ``j = 0`` is the first retry. A server's ``Retry-After``
  is a floor: it overrides any shorter delay drawn locally.
- A retry keeps the logical operation id and gets a fresh attempt id. Every attempt (the first included)
  passes admission again (budget, deadline, breaker, bulkhead) through a callback, and is charged against
  the budget only once admitted: a refused attempt was never dispatched.
- Settlement before repetition: a call whose outcome is unknown (e.g. a timeout) is repeated only under an
  idempotent or effect-key-deduplicated contract; under probe-then-retry the endpoint is asked first; under
  never-repeat it is left unknown with a named owner. A client/domain rejection is not retried: the same
  arguments get the same answer, so changing them is a new logical operation (re-decide, guide §5.2).
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from runtime.clock import Clock
from runtime.errors import DependencyError, PolicyRefusal
from runtime.ports import OutcomeClass, Settlement, ToolOutcome
from runtime.retry import RetryAction, RetryPolicy, after_probe, backoff_ceiling, decide_retry, full_jitter
from runtime.retry import RetryDecision as PureDecision
from runtime.tools import RepeatContract

from .errors import AttemptBudgetExhausted

__all__ = [
    "Attempt",
    "AttemptResult",
    "OperationBudget",
    "OperationReport",
    "RepeatContract",
    "RetryAction",
    "RetryDecision",
    "RetryOwner",
    "RetryPolicy",
    "backoff_ceiling",
    "full_jitter_delay",
]


def full_jitter_delay(
    policy: RetryPolicy, retry_index: int, rng: random.Random, retry_after: float | None = None
) -> float:
    """Full jitter: uniform on ``[0, ceiling]``, then raised to ``retry_after`` when the server asked."""
    return full_jitter(policy, retry_index, rng.random(), retry_after)


@dataclass(frozen=True, slots=True)
class Attempt:
    """One transport attempt of a logical operation."""

    operation_id: str  # the same across retries
    attempt_id: str  # fresh per attempt
    index: int  # 1-based


@dataclass(frozen=True, slots=True)
class AttemptResult:
    """What one attempt established, as the retry owner needs it."""

    settlement: Settlement
    outcome_class: OutcomeClass
    retry_after: float | None = None
    non_retryable: bool = False
    error: str | None = None
    result: object = None

    @classmethod
    def from_outcome(cls, outcome: ToolOutcome) -> AttemptResult:
        return cls(
            outcome.settlement,
            outcome.outcome_class,
            outcome.retry_after,
            error=outcome.error,
            result=outcome.result,
        )

    @classmethod
    def from_error(cls, error: DependencyError) -> AttemptResult:
        """A dependency error says nothing about the effect: its settlement is unknown."""
        return cls(
            Settlement.UNKNOWN,
            OutcomeClass.INFRASTRUCTURE_FAILURE,
            error.retry_after,
            error.non_retryable,
            str(error),
        )


@dataclass(frozen=True, slots=True)
class RetryDecision:
    action: RetryAction
    reason: str
    delay_s: float = 0.0
    owner: str | None = None  # set for LEAVE_UNKNOWN: who keeps the unknown outcome

    @classmethod
    def of(cls, pure: PureDecision, owner: str) -> RetryDecision:
        leave = pure.action is RetryAction.LEAVE_UNKNOWN
        return cls(pure.action, pure.reason, pure.delay_s, owner if leave else None)


class OperationBudget:
    """The single attempt budget of one logical operation, shared by every layer that touches it."""

    def __init__(
        self,
        operation_id: str,
        contract: RepeatContract,
        deadline: float,
        policy: RetryPolicy,
        new_attempt_id: Callable[[], str],
    ) -> None:
        self.operation_id = operation_id
        self.contract = contract
        self.deadline = deadline
        self.policy = policy
        self._new_attempt_id = new_attempt_id
        self._attempts: list[Attempt] = []

    @property
    def attempts(self) -> tuple[Attempt, ...]:
        return tuple(self._attempts)

    @property
    def used(self) -> int:
        return len(self._attempts)

    @property
    def remaining(self) -> int:
        return self.policy.max_attempts - len(self._attempts)

    def next_attempt(self) -> Attempt:
        """The identity the next attempt would carry (not yet charged: it must pass admission first)."""
        return Attempt(self.operation_id, self._new_attempt_id(), len(self._attempts) + 1)

    def charge(self, attempt: Attempt) -> None:
        """Count an admitted attempt; raises ``AttemptBudgetExhausted`` when none is left."""
        if self.remaining <= 0:
            raise AttemptBudgetExhausted(self.operation_id, self.policy.max_attempts)
        if attempt.operation_id != self.operation_id or attempt.index != len(self._attempts) + 1:
            raise ValueError(f"attempt {attempt} does not follow {self.operation_id!r} attempt {self.used}")
        self._attempts.append(attempt)


@dataclass(frozen=True, slots=True)
class OperationReport:
    """How a logical operation ended under the owner."""

    operation_id: str
    action: RetryAction  # DONE, LEAVE_UNKNOWN or GIVE_UP
    settlement: Settlement
    attempts: tuple[Attempt, ...]
    reason: str
    owner: str | None = None
    result: object = None
    refusal: PolicyRefusal | None = None  # set when admission refused the next attempt


Admit = Callable[[Attempt], Awaitable[None]]
Call = Callable[[Attempt], Awaitable[AttemptResult]]
Probe = Callable[[], Awaitable[Settlement]]


class RetryOwner:
    """Decides every retry of the logical operations it owns. ``owner`` names who keeps unknown outcomes
    (e.g. the trajectory id), so an unknown never ends up unowned."""

    def __init__(
        self,
        owner: str,
        policy: RetryPolicy,
        clock: Clock,
        rng: random.Random,
        new_attempt_id: Callable[[], str] | None = None,
    ) -> None:
        self.owner = owner
        self.policy = policy
        self._clock = clock
        self._rng = rng
        self._new_attempt_id = new_attempt_id or (lambda: uuid.uuid4().hex)
        self._operations: dict[str, OperationBudget] = {}

    def begin(self, operation_id: str, contract: RepeatContract, deadline: float) -> OperationBudget:
        """The budget of ``operation_id``; every layer asking for the same id gets the same budget."""
        budget = self._operations.get(operation_id)
        if budget is None:
            budget = OperationBudget(operation_id, contract, deadline, self.policy, self._new_attempt_id)
            self._operations[operation_id] = budget
        return budget

    def budget(self, operation_id: str) -> OperationBudget:
        try:
            return self._operations[operation_id]
        except KeyError:
            raise KeyError(f"operation {operation_id!r} was never begun with this retry owner") from None

    def forget(self, operation_id: str) -> None:
        """Drop a finished operation's budget (its attempts are in the durable log by now)."""
        self._operations.pop(operation_id, None)

    # ------------------------------------------------------------------ pure decisions

    def decide(self, operation_id: str, result: AttemptResult) -> RetryDecision:
        """What to do after an attempt of ``operation_id`` ended with ``result`` (``runtime.retry``)."""
        budget = self.budget(operation_id)
        pure = decide_retry(
            contract=budget.contract,
            policy=budget.policy,
            attempts_used=budget.used,
            settlement=result.settlement,
            outcome_class=result.outcome_class,
            retry_after=result.retry_after,
            non_retryable=result.non_retryable,
            now=self._clock.wall(),
            deadline=budget.deadline,
            u=self._rng.random(),
        )
        return RetryDecision.of(pure, self.owner)

    def after_probe(
        self, operation_id: str, settlement: Settlement, retry_after: float | None = None
    ) -> RetryDecision:
        """Decide from what the endpoint's probe (result recovery) established."""
        budget = self.budget(operation_id)
        pure = after_probe(
            policy=budget.policy,
            attempts_used=budget.used,
            settlement=settlement,
            now=self._clock.wall(),
            deadline=budget.deadline,
            u=self._rng.random(),
            retry_after=retry_after,
        )
        return RetryDecision.of(pure, self.owner)

    def _stop(self, unknown: bool, reason: str) -> RetryDecision:
        if unknown:
            return RetryDecision(RetryAction.LEAVE_UNKNOWN, reason, owner=self.owner)
        return RetryDecision(RetryAction.GIVE_UP, reason)

    # ------------------------------------------------------------------ driver

    async def run(
        self,
        operation_id: str,
        contract: RepeatContract,
        deadline: float,
        call: Call,
        admit: Admit,
        probe: Probe | None = None,
    ) -> OperationReport:
        """Drive one logical operation to an end: admit, charge, call, decide, back off, repeat.

        ``admit`` raises a ``PolicyRefusal`` (breaker open, bulkhead full, budget, deadline) to stop the
        operation cleanly instead of spinning; ``call`` must not retry by itself.
        """
        budget = self.begin(operation_id, contract, deadline)
        settlement = Settlement.ESTABLISHED_ABSENT  # nothing dispatched yet
        while True:
            attempt = budget.next_attempt()
            try:
                await admit(attempt)
                budget.charge(attempt)
            except PolicyRefusal as refusal:
                stop = self._stop(settlement is Settlement.UNKNOWN, f"refused: {refusal}")
                return OperationReport(
                    operation_id,
                    stop.action,
                    settlement,
                    budget.attempts,
                    stop.reason,
                    stop.owner,
                    refusal=refusal,
                )
            result = await call(attempt)
            settlement = result.settlement
            decision = self.decide(operation_id, result)
            if decision.action is RetryAction.PROBE:
                if probe is None:
                    decision = self._stop(True, "probe-then-retry without a probe")
                else:
                    settlement = await probe()
                    decision = self.after_probe(operation_id, settlement, result.retry_after)
            if decision.action is not RetryAction.RETRY:
                final = Settlement.ESTABLISHED if decision.action is RetryAction.DONE else settlement
                return OperationReport(
                    operation_id,
                    decision.action,
                    final,
                    budget.attempts,
                    decision.reason,
                    decision.owner,
                    result.result if decision.action is RetryAction.DONE else None,
                )
            await self._clock.sleep(decision.delay_s)
