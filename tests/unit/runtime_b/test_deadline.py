"""Absolute deadlines and the finalization reserve (reliability guide §7.2)."""

from __future__ import annotations

import math

import pytest

from runtime.budget import BudgetCeilings, Spend
from runtime.clock import FakeClock
from runtime.deadline import Deadline, DeadlineConfigError, FinalizationReserve


def test_deadline_is_fixed_at_admission_on_the_wall_clock() -> None:
    # Given a trajectory admitted with 900 s and a 30 s reserve
    clock = FakeClock()
    deadline = Deadline.admit(clock, 900, FinalizationReserve(seconds=30))
    # When 460 s pass
    clock.advance(460)
    # Then remaining time counts down from the fixed instant
    assert deadline.at == deadline.started_at + 900
    assert deadline.remaining(clock) == 440
    assert deadline.forward_remaining(clock) == 410
    assert deadline.elapsed(clock) == 460
    assert not deadline.expired(clock)


def test_inner_layer_never_outlives_the_outer_and_forward_work_never_eats_the_reserve() -> None:
    # Given 60 s with a 10 s reserve, 45 s already used
    clock = FakeClock()
    deadline = Deadline.admit(clock, 60, FinalizationReserve(seconds=10))
    clock.advance(45)
    # When a tool call asks for a 30 s timeout
    forward = deadline.clamp(clock, 30)
    final = deadline.clamp(clock, 30, finalizing=True)
    # Then forward work ends where the reserve starts; finalization may use the reserve, not more
    assert forward == deadline.forward_at == deadline.at - 10
    assert final == deadline.at
    # And a short request is left alone
    assert deadline.clamp(clock, 1) == clock.wall() + 1


def test_nested_clamps_compose() -> None:
    # Given a step deadline clamped from the task deadline, and a call clamped from the step
    clock = FakeClock()
    task = Deadline.admit(clock, 100, FinalizationReserve(seconds=5))
    step = Deadline(started_at=clock.wall(), at=task.clamp(clock, 300))
    call_at = step.clamp(clock, 1_000)
    # Then the innermost deadline is the task's forward deadline
    assert call_at == task.forward_at


def test_expiry_and_reserve_entry_are_inclusive_at_the_instant() -> None:
    clock = FakeClock()
    deadline = Deadline.admit(clock, 10, FinalizationReserve(seconds=2))
    clock.advance(8)
    assert deadline.in_reserve(clock) and not deadline.expired(clock)
    clock.advance(2)
    assert deadline.expired(clock)
    assert deadline.remaining(clock) == 0
    assert deadline.clamp(clock, 5) < clock.wall()  # already past: inner layer gets a deadline in the past


def test_reserve_dollars_are_not_available_to_forward_work() -> None:
    reserve = FinalizationReserve(dollars=0.40)
    ceilings = BudgetCeilings.of(dollars=3.50)
    assert reserve.forward_dollars(ceilings, Spend.of(dollars=3.0)) == pytest.approx(0.10)
    assert reserve.forward_dollars(ceilings, Spend.of(dollars=3.2)) == 0
    assert reserve.forward_dollars(BudgetCeilings.of(turns=4), Spend()) == math.inf


@pytest.mark.parametrize(
    ("build", "where"),
    [
        (lambda c: Deadline.admit(c, 0), "deadline.seconds"),
        (lambda c: Deadline.admit(c, float("nan")), "deadline.seconds"),
        (lambda c: Deadline.admit(c, 10, FinalizationReserve(seconds=10)), "deadline.reserve.seconds"),
        (lambda c: FinalizationReserve(dollars=-1), "reserve.dollars"),
        (lambda c: Deadline(started_at=10.0, at=5.0), "deadline.at"),
    ],
)
def test_bad_deadlines_name_the_field(build: object, where: str) -> None:
    with pytest.raises(DeadlineConfigError) as err:
        build(FakeClock())  # type: ignore[operator]
    assert err.value.where == where
