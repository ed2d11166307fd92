"""The admission check (recovery chapter §12.2, §12.4.2): predicates in order, the first failure named."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from runtime.admission import (
    AdmissionCandidate,
    AdmissionContext,
    AdmissionPredicate,
    OperationKind,
    check_admission,
)
from runtime.budget import BudgetCeilings, Spend
from runtime.deadline import Deadline, FinalizationReserve
from runtime.errors import AdmissionRefused

START = 1_700_000_000.0


def context(**overrides: Any) -> AdmissionContext:
    base = AdmissionContext(
        now=START + 100,
        deadline=Deadline(
            started_at=START, at=START + 900, reserve=FinalizationReserve(seconds=30, dollars=0.40)
        ),
        ceilings=BudgetCeilings.of(turns=40, dollars=3.50),
        consumed=Spend.of(turns=10, dollars=1.00),
        outstanding=Spend.of(dollars=0.50),
        grants=frozenset({"env:provision"}),
        settled=frozenset({"op-1"}),
        capacity_granted=frozenset({"guard:env-service"}),
    )
    return replace(base, **overrides)


def candidate(**overrides: Any) -> AdmissionCandidate:
    base = AdmissionCandidate(
        operation_id="op-2",
        kind=OperationKind.FORWARD,
        required_grants=frozenset({"env:provision"}),
        depends_on=frozenset({"op-1"}),
        capacity=frozenset({"guard:env-service"}),
        duration_s=60,
        liability=Spend.of(dollars=1.00),
    )
    return replace(base, **overrides)


def test_a_candidate_that_fits_everything_is_admitted() -> None:
    decision = check_admission(candidate(), context())
    assert decision.admitted
    assert decision.failed is None
    decision.raise_if_refused()  # no exception


# Each row breaks one predicate and everything after it, so the row's predicate must be the first named.
@pytest.mark.parametrize(
    ("cand", "ctx", "first"),
    [
        ({"required_grants": frozenset({"db:drop"})}, {}, AdmissionPredicate.AUTHORITY),
        ({"needs_approval": True}, {}, AdmissionPredicate.AUTHORITY),
        ({}, {"hold": True}, AdmissionPredicate.AUTHORITY),
        ({"depends_on": frozenset({"op-1", "op-0"})}, {}, AdmissionPredicate.DEPENDENCIES),
        ({"capacity": frozenset({"sandbox:default"})}, {}, AdmissionPredicate.CAPACITY),
        ({"duration_s": 800}, {}, AdmissionPredicate.DEADLINE),
        ({"liability": Spend.of(dollars=1.61)}, {}, AdmissionPredicate.LIABILITY),
        ({"liability": Spend.of(turns=31)}, {}, AdmissionPredicate.LIABILITY),
    ],
)
def test_each_predicate_fails_first_in_order(
    cand: dict[str, Any], ctx: dict[str, Any], first: AdmissionPredicate
) -> None:
    # Given a candidate that breaks the row's predicate AND every later one
    later = list(AdmissionPredicate)[list(AdmissionPredicate).index(first) + 1 :]
    breakers: dict[AdmissionPredicate, dict[str, Any]] = {
        AdmissionPredicate.DEPENDENCIES: {"depends_on": frozenset({"op-9"})},
        AdmissionPredicate.CAPACITY: {"capacity": frozenset({"sandbox:gpu"})},
        AdmissionPredicate.DEADLINE: {"duration_s": 10_000},
        AdmissionPredicate.LIABILITY: {"liability": Spend.of(dollars=50)},
    }
    extra: dict[str, Any] = {}
    for p in later:
        extra.update(breakers[p])
    extra.update(cand)
    # When checked
    decision = check_admission(candidate(**extra), context(**ctx))
    # Then the row's predicate is named first, and the later failures are kept for the audit record
    assert not decision.admitted
    assert decision.failed is first
    named = [f.predicate for f in decision.failures]
    assert named == sorted(named, key=list(AdmissionPredicate).index)  # reported in evaluation order
    assert {f.predicate for f in decision.failures} >= set(later)
    with pytest.raises(AdmissionRefused) as err:
        decision.raise_if_refused()
    assert err.value.predicate == first.value


def test_liability_arithmetic_includes_outstanding_and_the_reserve() -> None:
    # Given $3.50: consumed 1.00 + outstanding 0.50 + reserve 0.40 leaves exactly 1.60 for new liability
    ctx = context()
    # Then 1.60 fits to the cent and 1.61 does not
    assert check_admission(candidate(liability=Spend.of(dollars=1.60)), ctx).admitted
    refused = check_admission(candidate(liability=Spend.of(dollars=1.61)), ctx)
    assert refused.failed is AdmissionPredicate.LIABILITY
    details = refused.failures[0].details
    assert details["dimension"] == "dollars"
    assert details["reserve"] == 0.40
    assert details["outstanding"] == 0.50
    assert details["shortfall"] == pytest.approx(0.01)


def test_settling_an_operation_frees_its_outstanding_liability() -> None:
    # Given a candidate refused while an earlier operation's $0.50 liability is unsettled
    big = candidate(liability=Spend.of(dollars=2.00))
    assert check_admission(big, context()).failed is AdmissionPredicate.LIABILITY
    # When that operation settles for $0.10
    settled = context(consumed=Spend.of(turns=10, dollars=1.10), outstanding=Spend())
    # Then the candidate fits
    assert check_admission(big, settled).admitted


def test_cleanup_may_draw_on_the_reserve_but_forward_work_may_not() -> None:
    # Given $3.05 consumed, $0.00 outstanding: only the $0.40 reserve is left (minus 0.05)
    ctx = context(consumed=Spend.of(turns=10, dollars=3.05), outstanding=Spend())
    release = candidate(kind=OperationKind.CLEANUP, liability=Spend.of(dollars=0.30))
    forward = candidate(kind=OperationKind.FORWARD, liability=Spend.of(dollars=0.30))
    assert check_admission(release, ctx).admitted
    assert check_admission(forward, ctx).failed is AdmissionPredicate.LIABILITY
    # And in FINALIZING every kind is funded by the reserve
    assert check_admission(forward, replace(ctx, finalizing=True)).admitted


def test_hold_stops_model_directed_work_but_not_probes_or_cleanup() -> None:
    ctx = context(hold=True)
    for kind in OperationKind:
        decision = check_admission(candidate(kind=kind), ctx)
        assert decision.admitted is (not kind.model_directed), kind


def test_exercise_7_support_agent_deadline() -> None:
    # Given an 8 s turn, 5 s used, a 0.4 s finalization reserve, and repair calls of 2 s + 0.5 s
    deadline = Deadline(started_at=0.0, at=8.0, reserve=FinalizationReserve(seconds=0.4))
    ctx = context(now=5.0, deadline=deadline)
    repair = candidate(kind=OperationKind.REPAIR, duration_s=2.5)
    # When one repair is considered, and then a second one after the first
    one = check_admission(repair, ctx)
    two = check_admission(repair, replace(ctx, now=7.5))
    # Then the turn can grant exactly one repair (R = 1)
    assert one.admitted
    assert two.failed is AdmissionPredicate.DEADLINE
    assert "finalization reserve" in two.failures[0].message


def test_approved_call_passes_authority() -> None:
    decision = check_admission(candidate(needs_approval=True, approval_valid=True), context())
    assert decision.admitted
