"""The single retry owner: one shared attempt budget, full jitter, Retry-After, repeat contracts."""

from __future__ import annotations

import itertools
import random
from collections.abc import Awaitable, Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from breakers.errors import AttemptBudgetExhausted
from breakers.retry import (
    Attempt,
    AttemptResult,
    OperationReport,
    RetryAction,
    RetryOwner,
    RetryPolicy,
    backoff_ceiling,
    full_jitter_delay,
)
from runtime.clock import FakeClock
from runtime.errors import BreakerOpen, DependencyError
from runtime.ports import OutcomeClass, Settlement
from runtime.tools import RepeatContract

POLICY = RetryPolicy(max_attempts=3, base_backoff_s=0.5, max_backoff_s=8.0)
TIMEOUT = AttemptResult(Settlement.UNKNOWN, OutcomeClass.INFRASTRUCTURE_FAILURE, error="deadline exceeded")
UNAVAILABLE = AttemptResult(Settlement.ESTABLISHED_ABSENT, OutcomeClass.INFRASTRUCTURE_FAILURE)
OK = AttemptResult(Settlement.ESTABLISHED, OutcomeClass.SUCCESS, result={"id": "env-1"})
REJECTED = AttemptResult(Settlement.ESTABLISHED_ABSENT, OutcomeClass.CLIENT_REJECTION, error="bad flag")


def _owner(clock: FakeClock | None = None, seed: int = 7) -> RetryOwner:
    ids = itertools.count(1)
    return RetryOwner("traj-1", POLICY, clock or FakeClock(), random.Random(seed), lambda: f"att-{next(ids)}")


# ----------------------------------------------------------------------------- one owner, three layers


class _FailingDependency:
    def __init__(self) -> None:
        self.calls = 0

    async def invoke(self) -> None:
        self.calls += 1
        raise DependencyError("unavailable", scope="test-service")


Layer = Callable[[], Awaitable[None]]


def _layer(inner: Layer, authority: Callable[[], Callable[[], bool]]) -> Layer:
    """A client, gateway or agent layer: calls the layer below and retries while the retry authority it
    gets for this call (``authority()``) says so."""

    async def call() -> None:
        may_retry = authority()
        while True:
            try:
                return await inner()
            except DependencyError:
                if not may_retry():
                    raise

    return call


async def test_three_layers_of_three_attempts_send_27_on_independent_allowances() -> None:
    # Given client, gateway and agent layers that each allow 3 attempts on their own allowance
    dependency = _FailingDependency()
    stack: Layer = dependency.invoke

    def own_allowance() -> Callable[[], bool]:  # a fresh 3-attempt allowance per call of the layer
        used = itertools.count(2)
        return lambda: next(used) <= 3

    for _ in range(3):
        stack = _layer(stack, own_allowance)
    # When one logical operation fails throughout
    with pytest.raises(DependencyError):
        await stack()
    # Then the dependency sees every path through the layers
    assert dependency.calls == 27


async def test_three_layers_under_one_retry_owner_send_3() -> None:
    # Given the same three layers, each asking the single owner of this logical operation
    owner = _owner()
    budget = owner.begin("op-1", RepeatContract.IDEMPOTENT, deadline=FakeClock().wall() + 3600)
    dependency = _FailingDependency()

    async def dispatch() -> None:  # the only place an attempt is charged: where it leaves the process
        budget.charge(budget.next_attempt())
        await dependency.invoke()

    def may_retry() -> bool:
        return (
            owner.decide("op-1", AttemptResult.from_error(DependencyError("x"))).action is RetryAction.RETRY
        )

    stack: Layer = dispatch
    for _ in range(3):
        stack = _layer(stack, lambda: may_retry)
    # When the operation fails throughout
    with pytest.raises(DependencyError):
        await stack()
    # Then the dependency sees the one shared budget: 3 attempts, not 27, all under one operation id
    assert dependency.calls == 3
    assert [a.index for a in budget.attempts] == [1, 2, 3]
    assert {a.operation_id for a in budget.attempts} == {"op-1"}
    with pytest.raises(AttemptBudgetExhausted):
        budget.charge(budget.next_attempt())


# ----------------------------------------------------------------------------- backoff


@given(
    retry_index=st.integers(min_value=0, max_value=2000),
    base=st.floats(min_value=0.001, max_value=10.0),
    cap_factor=st.floats(min_value=1.0, max_value=1000.0),
    seed=st.integers(min_value=0, max_value=2**32 - 1),
)
def test_full_jitter_is_uniform_between_zero_and_the_capped_ceiling(
    retry_index: int, base: float, cap_factor: float, seed: int
) -> None:
    policy = RetryPolicy(max_attempts=3, base_backoff_s=base, max_backoff_s=base * cap_factor)
    ceiling = backoff_ceiling(policy, retry_index)
    delay = full_jitter_delay(policy, retry_index, random.Random(seed))
    assert ceiling == pytest.approx(min(policy.max_backoff_s, base * 2.0 ** min(retry_index, 1023)))
    assert 0.0 <= delay <= ceiling <= policy.max_backoff_s


@given(
    retry_index=st.integers(min_value=0, max_value=20),
    retry_after=st.floats(min_value=0.0, max_value=120.0),
    seed=st.integers(min_value=0, max_value=2**32 - 1),
)
def test_retry_after_is_a_floor(retry_index: int, retry_after: float, seed: int) -> None:
    delay = full_jitter_delay(POLICY, retry_index, random.Random(seed), retry_after)
    assert retry_after <= delay <= max(retry_after, backoff_ceiling(POLICY, retry_index))


def test_full_jitter_spreads_over_the_whole_span() -> None:
    # Full jitter, not "equal jitter": draws reach both ends of [0, ceiling]
    rng = random.Random(1)
    draws = [full_jitter_delay(POLICY, 2, rng) for _ in range(2000)]
    assert min(draws) < 0.05 * 2.0 and max(draws) > 0.95 * 2.0


def test_retry_after_longer_than_the_draw_sets_the_delay() -> None:
    owner = _owner()
    owner.begin("op", RepeatContract.IDEMPOTENT, FakeClock().wall() + 3600)
    owner.budget("op").charge(owner.budget("op").next_attempt())
    throttled = AttemptResult(
        Settlement.ESTABLISHED_ABSENT, OutcomeClass.INFRASTRUCTURE_FAILURE, retry_after=30.0
    )
    decision = owner.decide("op", throttled)
    assert (decision.action, decision.delay_s) == (RetryAction.RETRY, 30.0)


# ----------------------------------------------------------------------------- decisions


@pytest.mark.parametrize(
    ("contract", "result", "action"),
    [
        (RepeatContract.IDEMPOTENT, TIMEOUT, RetryAction.RETRY),
        (RepeatContract.DEDUPLICATED, TIMEOUT, RetryAction.RETRY),
        (RepeatContract.PROBE_THEN_RETRY, TIMEOUT, RetryAction.PROBE),
        (RepeatContract.NEVER_REPEAT, TIMEOUT, RetryAction.LEAVE_UNKNOWN),
        (
            RepeatContract.NEVER_REPEAT,
            UNAVAILABLE,
            RetryAction.RETRY,
        ),  # established absent: nothing to repeat
        (RepeatContract.IDEMPOTENT, REJECTED, RetryAction.GIVE_UP),
        (RepeatContract.IDEMPOTENT, OK, RetryAction.DONE),
    ],
)
def test_decision_table(contract: RepeatContract, result: AttemptResult, action: RetryAction) -> None:
    owner = _owner()
    budget = owner.begin("op", contract, FakeClock().wall() + 3600)
    budget.charge(budget.next_attempt())
    decision = owner.decide("op", result)
    assert decision.action is action
    if action is RetryAction.LEAVE_UNKNOWN:
        assert decision.owner == "traj-1"


def test_no_retry_when_the_backoff_would_cross_the_deadline() -> None:
    clock = FakeClock()
    owner = RetryOwner("traj-1", POLICY.model_copy(update={"base_backoff_s": 5.0}), clock, random.Random(3))
    budget = owner.begin("op", RepeatContract.IDEMPOTENT, clock.wall() + 0.001)
    budget.charge(budget.next_attempt())
    decision = owner.decide("op", TIMEOUT)
    assert (decision.action, decision.owner) == (RetryAction.LEAVE_UNKNOWN, "traj-1")
    assert "deadline" in decision.reason


# ----------------------------------------------------------------------------- the driver


def _scripted(
    results: list[AttemptResult],
) -> tuple[list[Attempt], Callable[[Attempt], Awaitable[AttemptResult]]]:
    seen: list[Attempt] = []

    async def call(attempt: Attempt) -> AttemptResult:
        seen.append(attempt)
        return results[len(seen) - 1]

    return seen, call


async def _admit_all(_attempt: Attempt) -> None:
    return None


async def _run_stepping_clock(clock: FakeClock, coro: Awaitable[OperationReport]) -> OperationReport:
    """Run ``coro``, advancing the fake clock whenever it sleeps (no real waiting)."""
    import asyncio

    task = asyncio.ensure_future(coro)
    while not task.done():
        await asyncio.sleep(0)
        if clock.pending_sleepers:
            clock.advance(60.0)
    return task.result()


async def test_retry_keeps_operation_id_and_gets_fresh_attempt_ids() -> None:
    clock = FakeClock()
    owner = _owner(clock)
    seen, call = _scripted([TIMEOUT, UNAVAILABLE, OK])
    report = await _run_stepping_clock(
        clock, owner.run("op-7", RepeatContract.DEDUPLICATED, clock.wall() + 3600, call, _admit_all)
    )
    assert report.action is RetryAction.DONE and report.settlement is Settlement.ESTABLISHED
    assert report.result == {"id": "env-1"}
    assert {a.operation_id for a in seen} == {"op-7"}
    assert [a.attempt_id for a in seen] == ["att-1", "att-2", "att-3"]


async def test_every_retry_passes_admission_and_a_refusal_stops_cleanly() -> None:
    # Given an admission gate that refuses the second attempt (the breaker opened meanwhile)
    clock = FakeClock()
    owner = _owner(clock)
    admitted: list[int] = []

    async def admit(attempt: Attempt) -> None:
        if attempt.index == 2:
            raise BreakerOpen("test-service", 5.0, 1)
        admitted.append(attempt.index)

    seen, call = _scripted([TIMEOUT, OK])
    # When the first attempt times out
    report = await _run_stepping_clock(
        clock, owner.run("op", RepeatContract.IDEMPOTENT, clock.wall() + 3600, call, admit)
    )
    # Then the retry was asked to pass admission, refused, not charged, and the unknown stays owned
    assert admitted == [1] and len(seen) == 1 and len(report.attempts) == 1
    assert (report.action, report.settlement, report.owner) == (
        RetryAction.LEAVE_UNKNOWN,
        Settlement.UNKNOWN,
        "traj-1",
    )
    assert isinstance(report.refusal, BreakerOpen)


@pytest.mark.parametrize(
    ("probe_says", "action", "calls"),
    [
        (Settlement.ESTABLISHED, RetryAction.DONE, 1),
        (Settlement.ESTABLISHED_ABSENT, RetryAction.DONE, 2),
        (Settlement.UNKNOWN, RetryAction.LEAVE_UNKNOWN, 1),
    ],
)
async def test_probe_then_retry(probe_says: Settlement, action: RetryAction, calls: int) -> None:
    # Given a probe-then-retry tool whose first attempt timed out
    clock = FakeClock()
    owner = _owner(clock)
    seen, call = _scripted([TIMEOUT, OK])

    async def probe() -> Settlement:
        return probe_says

    # When the owner drives it
    report = await _run_stepping_clock(
        clock, owner.run("op", RepeatContract.PROBE_THEN_RETRY, clock.wall() + 3600, call, _admit_all, probe)
    )
    # Then it repeats only when the probe established the effect absent
    assert (report.action, len(seen)) == (action, calls)


async def test_never_repeat_timeout_is_left_unknown_with_an_owner() -> None:
    clock = FakeClock()
    owner = _owner(clock)
    seen, call = _scripted([TIMEOUT, OK])
    report = await _run_stepping_clock(
        clock, owner.run("op", RepeatContract.NEVER_REPEAT, clock.wall() + 3600, call, _admit_all)
    )
    assert (report.action, report.settlement, report.owner, len(seen)) == (
        RetryAction.LEAVE_UNKNOWN,
        Settlement.UNKNOWN,
        "traj-1",
        1,
    )


async def test_budget_exhaustion_ends_the_operation_after_max_attempts() -> None:
    clock = FakeClock()
    owner = _owner(clock)
    seen, call = _scripted([UNAVAILABLE] * 5)
    report = await _run_stepping_clock(
        clock, owner.run("op", RepeatContract.IDEMPOTENT, clock.wall() + 3600, call, _admit_all)
    )
    assert (report.action, len(seen)) == (RetryAction.GIVE_UP, 3)
    assert "budget" in report.reason


@pytest.mark.parametrize(
    ("fields", "message"),
    [({"max_attempts": 0}, "max_attempts"), ({"base_backoff_s": 5.0, "max_backoff_s": 1.0}, "max_backoff_s")],
)
def test_inconsistent_retry_policy_is_rejected(fields: dict[str, float], message: str) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=message):
        RetryPolicy(**fields)
