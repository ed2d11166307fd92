"""Budgets: the harness chapter's Napkin Math 0.1, the recovery chapter's loop-cost example, Table 12."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from runtime.budget import (
    BudgetCeilings,
    BudgetConfigError,
    BudgetStage,
    Dimension,
    PriceTable,
    Spend,
    StageThresholds,
    assess,
    meter_model_call,
    meter_tool_call,
    meter_turn,
    stage_for,
)
from runtime.clock import FakeClock
from runtime.deadline import Deadline
from runtime.ports import Usage

# Napkin Math 0.1 prices: $3 / $0.30 / $15 per million uncached input / cached input / output tokens.
PRICES = PriceTable(uncached_input_per_million=3.0, cached_input_per_million=0.30, output_per_million=15.0)
CEILINGS = BudgetCeilings.of(turns=40, tokens=2_000_000, wall_seconds=900, dollars=3.50)

# The chapter takes its token counts from notebook nbk-02 ("price of a trajectory"), which is not among
# the seeds. The append-only mix below is the one that reproduces all three stated meter readings
# (898,500 tokens, $0.50 cached, $2.77 uncached): a first prompt of 8,000 tokens, each turn appending
# 1,500 tokens (its output plus the tool observation) to the next prompt, and 200 output tokens per turn.
# Derivation: 30*P + 435*A + 30*O = 898,500 and the uncached price gives O = 200 (to rounding); the cached
# price then fixes A = 1,500, P = 8,000. The test meters turn by turn; only the mix is reconstructed.
FIRST_PROMPT, APPEND, OUTPUT, TURNS = 8_000, 1_500, 200, 30


def turn_usage(k: int, *, cache_hits: bool) -> Usage:
    """Usage of turn k (1-based) of the append-only trajectory."""
    prompt = FIRST_PROMPT + APPEND * (k - 1)
    if not cache_hits or k == 1:
        return Usage(uncached_input=prompt, cached_input=0, output=OUTPUT)
    # Only the tokens appended since the previous turn miss the prefix cache.
    return Usage(uncached_input=APPEND, cached_input=prompt - APPEND, output=OUTPUT)


def run_trajectory(*, cache_hits: bool) -> Spend:
    clock = FakeClock()
    deadline = Deadline.admit(clock, 900)
    spend = Spend.zero()
    for k in range(1, TURNS + 1):
        spend = spend + meter_turn() + meter_model_call(turn_usage(k, cache_hits=cache_hits), PRICES)
    clock.advance(460)  # the harness's clock reads 460 s
    return spend.with_value(Dimension.WALL_SECONDS, deadline.elapsed(clock))


def test_napkin_math_0_1_with_prefix_cache_turns_bind() -> None:
    # Given the 30-turn trajectory with a working prefix cache
    spend = run_trajectory(cache_hits=True)
    # When it is assessed against 40 turns / 2M tokens / 900 s / $3.50
    result = assess(CEILINGS, spend)
    # Then the meter readings and shares are the chapter's
    assert spend[Dimension.TOKENS] == 898_500
    assert round(spend[Dimension.DOLLARS], 2) == 0.50
    assert round(result.shares[Dimension.TURNS] * 100, 1) == 75.0
    assert round(result.shares[Dimension.TOKENS] * 100, 1) == 44.9
    assert round(result.shares[Dimension.WALL_SECONDS] * 100, 1) == 51.1
    assert round(result.shares[Dimension.DOLLARS] * 100, 1) == 14.2
    assert result.binding_dimension == Dimension.TURNS
    assert result.rho == 0.75
    assert result.stage is BudgetStage.STEER


def test_napkin_math_0_1_without_prefix_cache_dollars_bind() -> None:
    # Given the same trajectory with every turn missing the cache
    spend = run_trajectory(cache_hits=False)
    # When assessed
    result = assess(CEILINGS, spend)
    # Then the token share is unchanged, dollars jump to 79.1 % and bind
    assert spend[Dimension.TOKENS] == 898_500
    assert round(spend[Dimension.DOLLARS], 2) == 2.77
    assert round(result.shares[Dimension.TOKENS] * 100, 1) == 44.9
    assert round(result.shares[Dimension.DOLLARS] * 100, 1) == 79.1
    assert result.binding_dimension == Dimension.DOLLARS
    assert result.stage is BudgetStage.STEER


def loop_cost(turns: int) -> float:
    """Napkin Math 12.3: first input 1,000 tokens, each turn appends 300 output + 800 observation
    tokens, no cache; $3 / $15 per million input / output."""
    prices = PriceTable(uncached_input_per_million=3.0, cached_input_per_million=3.0, output_per_million=15.0)
    spend = Spend.zero()
    for k in range(1, turns + 1):
        prompt = 1_000 + 1_100 * (k - 1)
        spend = spend + meter_model_call(Usage(uncached_input=prompt, output=300), prices)
    return spend[Dimension.DOLLARS]


def test_recovery_chapter_loop_cost_88_7x() -> None:
    # Given the looping trajectory of notebook 12.3
    # When it is stopped at the 50-turn ceiling versus by a watchdog at turn 4
    ceiling, early = loop_cost(50), loop_cost(4)
    # Then the costs and their ratio are the chapter's
    assert round(ceiling, 2) == 4.42
    assert round(early, 3) == 0.050
    assert round(ceiling / early, 1) == 88.7
    assert round(ceiling - early, 2) == 4.37


def test_retries_and_tool_charges_are_all_charged() -> None:
    # Given one turn whose model call needed three attempts and one paid tool call
    attempt = meter_model_call(Usage(uncached_input=1_000, output=100), PRICES)
    # When every attempt and the tool charge are metered
    spend = Spend.total(
        [meter_turn(), attempt, attempt, attempt, meter_tool_call(0.25, sandbox_seconds=12.0)]
    )
    # Then tokens and dollars count three attempts, the turn counts once
    assert spend[Dimension.TURNS] == 1
    assert spend[Dimension.TOKENS] == 3 * 1_100
    assert spend[Dimension.DOLLARS] == pytest.approx(3 * (0.003 + 0.0015) + 0.25)
    assert spend["sandbox_seconds"] == 12.0


@pytest.mark.parametrize(
    ("rho", "stage"),
    [
        (0.0, BudgetStage.NOMINAL),
        (0.6999, BudgetStage.NOMINAL),
        (0.70, BudgetStage.STEER),
        (0.8999, BudgetStage.STEER),
        (0.90, BudgetStage.RESTRICT),
        (0.9999, BudgetStage.RESTRICT),
        (1.0, BudgetStage.HALT),
        (1.5, BudgetStage.HALT),
    ],
)
def test_stage_bands_are_inclusive_from_below(rho: float, stage: BudgetStage) -> None:
    # Given a 10 000-dollar ceiling and spend at rho of it; When assessed; Then the Table 12 stage
    result = assess(BudgetCeilings.of(dollars=10_000), Spend.of(dollars=rho * 10_000))
    assert result.rho == pytest.approx(rho)
    assert result.stage is stage
    assert stage_for(rho) is stage


def test_exact_boundary_turn_counts_hit_the_boundary_stage() -> None:
    # Given 40 turns: 28 is exactly 0.70, 36 exactly 0.90, 40 exactly 1.00
    ceilings = BudgetCeilings.of(turns=40)
    stages = [assess(ceilings, Spend.of(turns=n)).stage for n in (27, 28, 35, 36, 39, 40)]
    assert stages == [
        BudgetStage.NOMINAL,
        BudgetStage.STEER,
        BudgetStage.STEER,
        BudgetStage.RESTRICT,
        BudgetStage.RESTRICT,
        BudgetStage.HALT,
    ]


def test_custom_thresholds_and_extensible_dimension() -> None:
    # Given a sandbox-seconds ceiling and tighter thresholds
    thresholds = StageThresholds(steer=0.5, restrict=0.6, halt=0.8)
    ceilings = BudgetCeilings({Dimension.TURNS: 100, "sandbox_seconds": 600})
    # When sandbox time is the largest share
    result = assess(ceilings, Spend.of(turns=10, sandbox_seconds=480), thresholds)
    # Then it binds and the custom halt threshold applies
    assert result.binding_dimension == "sandbox_seconds"
    assert result.stage is BudgetStage.HALT
    assert result.remaining["sandbox_seconds"] == 120


def test_unbounded_dimension_does_not_count_and_ties_are_deterministic() -> None:
    ceilings = BudgetCeilings.of(turns=10, dollars=1.0)
    result = assess(ceilings, Spend.of(turns=5, dollars=0.5, tokens=10**9))
    assert result.binding_dimension == Dimension.TURNS  # tie at 0.5: standard order wins
    assert Dimension.TOKENS not in result.shares


@pytest.mark.parametrize(
    ("kwargs", "where"),
    [
        ({"steer": 0.9, "restrict": 0.7, "halt": 1.0}, "thresholds"),
        ({"steer": 0.7, "restrict": 0.9, "halt": 0.9}, "thresholds"),
        ({"steer": 0.0}, "thresholds"),
        ({"halt": float("nan")}, "thresholds.halt"),
    ],
)
def test_bad_thresholds_are_rejected(kwargs: dict[str, float], where: str) -> None:
    with pytest.raises(BudgetConfigError) as err:
        StageThresholds(**kwargs)
    assert err.value.where == where


@pytest.mark.parametrize(
    ("limits", "where"),
    [
        ({}, "budget.ceilings"),
        ({"turns": 0}, "budget.ceilings.turns"),
        ({"dollars": -1.0}, "budget.ceilings.dollars"),
        ({"tokens": float("inf")}, "budget.ceilings.tokens"),
        ({"turns": "40"}, "budget.ceilings.turns"),
    ],
)
def test_bad_ceilings_name_the_field(limits: dict[str, object], where: str) -> None:
    with pytest.raises(BudgetConfigError) as err:
        BudgetCeilings(limits)  # type: ignore[arg-type]
    assert err.value.where == where


def test_price_table_rejects_negative_price() -> None:
    with pytest.raises(BudgetConfigError, match="output_per_million"):
        PriceTable(uncached_input_per_million=3, cached_input_per_million=0.3, output_per_million=-1)


def test_values_are_frozen_hashable_and_keyed_by_plain_str() -> None:
    spend = Spend({Dimension.TOKENS: 5})
    assert spend == Spend.of(tokens=5)
    assert hash(spend) == hash(Spend.of(tokens=5))
    assert list(spend.as_dict()) == ["tokens"] and type(next(iter(spend))) is str
    with pytest.raises(TypeError):
        spend.amounts["tokens"] = 6  # type: ignore[index]


amounts = st.dictionaries(
    st.sampled_from(["turns", "tokens", "dollars", "sandbox_seconds"]),
    st.floats(min_value=0, max_value=1e6, allow_nan=False),
)


@given(amounts, amounts)
def test_add_is_commutative_and_element_wise(a: dict[str, float], b: dict[str, float]) -> None:
    left, right = Spend(a), Spend(b)
    assert left.add(right) == right.add(left)
    for dim in set(a) | set(b):
        assert left.add(right)[dim] == a.get(dim, 0.0) + b.get(dim, 0.0)
    # the sum is the spend a validated construction gives, dimensions in the same order
    checked = Spend({dim: a.get(dim, 0.0) + b.get(dim, 0.0) for dim in set(a) | set(b)})
    assert left.add(right) == checked and list(left.add(right)) == list(checked)


def test_a_sum_that_overflows_is_refused_as_the_constructor_refuses_it() -> None:
    huge = Spend.of(tokens=1e308)
    with pytest.raises(BudgetConfigError, match="must be finite"):
        huge.add(huge)


@given(amounts.filter(bool))
def test_rho_is_the_maximum_share(a: dict[str, float]) -> None:
    ceilings = BudgetCeilings(dict.fromkeys(a, 100.0))
    result = assess(ceilings, Spend(a))
    assert result.rho == max(result.shares.values()) == result.shares[result.binding_dimension]
