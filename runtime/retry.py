"""The single retry owner's rule, as pure logic: after an attempt, what happens to the logical operation.

Recovery chapter §12.7.2, reliability guide §5.1, §5.4, §6.7, §7.2:

- One attempt budget per logical operation, shared by every layer. Layers below (SDK, client, gateway)
  never retry on their own allowance, so 3 layers x 3 attempts is 3 attempts, not 27.
- Capped exponential backoff with full jitter (equation 8): ``ceiling_j = min(cap, base * 2**j)`` and the
  delay is drawn uniformly from ``[0, ceiling_j]``; ``j = 0`` is the first retry. A server's ``Retry-After``
  is a floor: it overrides any shorter delay drawn locally.
- Settlement before repetition: an unknown outcome (a timeout) is repeated only under an idempotent or
  effect-key-deduplicated contract; under probe-then-retry the endpoint is asked first; under never-repeat
  it stays unknown with a named owner. A client/domain rejection is not retried: the same arguments get the
  same answer, so changing them is a new logical operation (re-decide, guide §5.2).

The trajectory's decider applies this rule to every tool operation (``runtime.decide``), drawing the jitter
from the record's seed; ``breakers.RetryOwner`` applies the same rule for callers outside a trajectory.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, model_validator

from runtime.ports import OutcomeClass, Settlement
from runtime.tools import RepeatContract

__all__ = [
    "RETRY_SAFE_WHEN_UNKNOWN",
    "RetryAction",
    "RetryDecision",
    "RetryPolicy",
    "after_probe",
    "backoff_ceiling",
    "decide_retry",
    "full_jitter",
]

RETRY_SAFE_WHEN_UNKNOWN = frozenset({RepeatContract.IDEMPOTENT, RepeatContract.DEDUPLICATED})


class RetryPolicy(BaseModel):
    """The one attempt budget and backoff shape of a logical operation."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_attempts: int = Field(3, ge=1, description="attempts in total across all layers (first try included)")
    base_backoff_s: float = Field(0.5, gt=0.0, description="ceiling of the first retry's jitter span")
    max_backoff_s: float = Field(30.0, gt=0.0, description="cap on any one retry's jitter span")

    @model_validator(mode="after")
    def _consistent(self) -> RetryPolicy:
        if self.max_backoff_s < self.base_backoff_s:
            raise ValueError(
                f"max_backoff_s ({self.max_backoff_s}) is below base_backoff_s ({self.base_backoff_s})"
            )
        return self


class RetryAction(StrEnum):
    """What the owner decided after an attempt."""

    DONE = "done"  # the operation settled established
    RETRY = "retry"  # send another attempt after ``delay_s`` (it passes admission again)
    PROBE = "probe"  # ask the endpoint what happened before deciding (probe-then-retry)
    LEAVE_UNKNOWN = "leave_unknown"  # the effect stays unknown, owned by ``owner``; never guessed
    GIVE_UP = "give_up"  # settled absent or rejected: no further attempt


@dataclass(frozen=True, slots=True)
class RetryDecision:
    action: RetryAction
    reason: str
    delay_s: float = 0.0


def backoff_ceiling(policy: RetryPolicy, retry_index: int) -> float:
    """Equation 8's ``min(cap, base * 2**j)``; ``retry_index`` 0 is the first retry."""
    if retry_index < 0:
        raise ValueError(f"retry_index must be >= 0, got {retry_index}")
    exponent = min(retry_index, 1023)  # past the cap the power no longer matters; avoid overflow
    return min(policy.max_backoff_s, policy.base_backoff_s * 2.0**exponent)


def full_jitter(policy: RetryPolicy, retry_index: int, u: float, retry_after: float | None = None) -> float:
    """Full jitter: ``u`` (uniform on [0, 1)) scaled to ``[0, ceiling]``, raised to ``retry_after`` when the
    server asked for a minimum wait."""
    drawn = u * backoff_ceiling(policy, retry_index)
    return max(drawn, retry_after) if retry_after is not None and retry_after > 0 else drawn


def decide_retry(
    *,
    contract: RepeatContract,
    policy: RetryPolicy,
    attempts_used: int,
    settlement: Settlement,
    outcome_class: OutcomeClass,
    retry_after: float | None,
    non_retryable: bool,
    now: float,
    deadline: float,
    u: float,
) -> RetryDecision:
    """What to do after attempt number ``attempts_used`` of an operation ended as described."""
    if settlement is Settlement.ESTABLISHED and outcome_class is OutcomeClass.SUCCESS:
        return RetryDecision(RetryAction.DONE, "established")
    if outcome_class is OutcomeClass.CLIENT_REJECTION:
        return RetryDecision(RetryAction.GIVE_UP, "client_rejection: same arguments, same answer")
    unknown = settlement is Settlement.UNKNOWN
    if non_retryable:
        return _stop(unknown, "non_retryable")
    if unknown and contract not in RETRY_SAFE_WHEN_UNKNOWN:
        if contract is RepeatContract.PROBE_THEN_RETRY:
            return RetryDecision(RetryAction.PROBE, "unknown outcome: probe before any repeat")
        return _stop(True, f"unknown outcome under {contract.value}: not repeated")
    return _schedule(policy, attempts_used, unknown, retry_after, now, deadline, u)


def after_probe(
    *,
    policy: RetryPolicy,
    attempts_used: int,
    settlement: Settlement,
    now: float,
    deadline: float,
    u: float,
    retry_after: float | None = None,
) -> RetryDecision:
    """Decide from what the endpoint's probe (result recovery) established."""
    if settlement is Settlement.ESTABLISHED:
        return RetryDecision(RetryAction.DONE, "established by probe")
    if settlement is Settlement.UNKNOWN:
        return _stop(True, "probe could not settle the outcome")
    return _schedule(policy, attempts_used, False, retry_after, now, deadline, u)


def _schedule(
    policy: RetryPolicy,
    used: int,
    unknown: bool,
    retry_after: float | None,
    now: float,
    deadline: float,
    u: float,
) -> RetryDecision:
    if used >= policy.max_attempts:
        return _stop(unknown, f"attempt budget of {policy.max_attempts} used")
    delay = full_jitter(policy, max(0, used - 1), u, retry_after)
    if now + delay >= deadline:
        return _stop(unknown, "deadline: no time for another attempt")
    return RetryDecision(RetryAction.RETRY, "retry", delay_s=delay)


def _stop(unknown: bool, reason: str) -> RetryDecision:
    return RetryDecision(RetryAction.LEAVE_UNKNOWN if unknown else RetryAction.GIVE_UP, reason)
