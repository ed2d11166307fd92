"""Weighted deficit round-robin: shares follow weights, an emptied class banks nothing, big turns do
not starve small ones, and the arithmetic fast-forward matches visiting round by round."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.drr import DeficitRoundRobin

WEIGHTS = {"interactive": 4.0, "standard": 2.0, "batch": 1.0}


def backlogged(
    weights: dict[str, float], cost_of: dict[str, int], quantum: int = 1000
) -> DeficitRoundRobin[int]:
    drr: DeficitRoundRobin[int] = DeficitRoundRobin(weights, quantum)
    keys = itertools.count()
    for name in weights:
        for _ in range(3_000_000 // cost_of[name] + 1):  # more than the test will dispatch
            drr.push(name, next(keys), cost_of[name])
    return drr


@pytest.mark.parametrize(
    ("weights", "cost_of"),
    [
        (WEIGHTS, {"interactive": 1_000, "standard": 1_000, "batch": 1_000}),
        (WEIGHTS, {"interactive": 300, "standard": 2_500, "batch": 8_000}),  # sizes differ by 25x
        ({"a": 1.0, "b": 1.0}, {"a": 100, "b": 4_000}),
        ({"gold": 9.0, "bronze": 1.0}, {"gold": 700, "bronze": 700}),
    ],
)
def test_token_shares_converge_to_weights_when_every_class_is_backlogged(
    weights: dict[str, float], cost_of: dict[str, int]
) -> None:
    # Given every class with a deep backlog
    drr = backlogged(weights, cost_of)
    tokens = dict.fromkeys(weights, 0)
    # When 2 M tokens' worth of turns are dispatched
    while sum(tokens.values()) < 2_000_000:
        name, _, cost = drr.pop()
        tokens[name] += cost
    # Then each class's share of tokens is its weight's share, within half a percentage point
    total = sum(tokens.values())
    for name, w in weights.items():
        assert tokens[name] / total == pytest.approx(w / sum(weights.values()), abs=0.005)


def test_one_large_batch_turn_does_not_starve_a_small_interactive_one() -> None:
    # Given a queued 50k-token batch turn and, behind it in time, a 500-token interactive turn
    drr: DeficitRoundRobin[str] = DeficitRoundRobin(WEIGHTS, 1000)
    drr.push("batch", "big", 50_000)
    drr.push("interactive", "small", 500)
    # Then the interactive turn goes first
    assert drr.pop()[1] == "small"
    assert drr.pop()[1] == "big"


def test_an_emptied_class_does_not_bank_credit() -> None:
    # Given batch alone earned a large deficit while waiting for a big turn that then left the queue
    drr: DeficitRoundRobin[str] = DeficitRoundRobin(WEIGHTS, 1000)
    drr.push("batch", "huge", 40_000)
    drr.push("standard", "s0", 39_000)
    drr.pop()  # standard wins the race; batch has meanwhile earned ~19 quanta
    assert drr.deficits()["batch"] > 10_000
    drr.remove("huge")  # deadline passed: batch's queue is now empty
    # Then batch's credit is gone
    assert drr.deficits()["batch"] == 0.0
    # And when batch returns next to a backlogged interactive class it does not monopolise: with
    # equal turn sizes it gets 1 turn in 5, exactly as if it had never been away
    keys = itertools.count()
    for _ in range(40):
        drr.push("batch", f"b{next(keys)}", 1_000)
        drr.push("interactive", f"i{next(keys)}", 1_000)
    first_ten = [drr.pop()[0] for _ in range(10)]
    assert first_ten.count("batch") == 2


def test_a_class_emptied_by_dispatch_loses_its_leftover_deficit() -> None:
    drr: DeficitRoundRobin[str] = DeficitRoundRobin(WEIGHTS, 1000)
    drr.push("interactive", "i", 100)  # earns 4000, spends 100
    drr.pop()
    assert drr.deficits()["interactive"] == 0.0


def test_fifo_within_a_class_and_remove_of_unknown_is_false() -> None:
    drr: DeficitRoundRobin[str] = DeficitRoundRobin(WEIGHTS, 1000)
    for key in ("a", "b", "c"):
        drr.push("standard", key, 10)
    drr.remove("b")
    assert [drr.pop()[1], drr.pop()[1]] == ["a", "c"]
    assert drr.remove("zzz") is False
    assert drr.peek() is None
    with pytest.raises(LookupError):
        drr.pop()


def test_peek_is_idempotent_until_pop() -> None:
    drr: DeficitRoundRobin[str] = DeficitRoundRobin(WEIGHTS, 1000)
    drr.push("batch", "b", 3_000)
    drr.push("standard", "s", 9_000)
    first = drr.peek()
    assert [drr.peek() for _ in range(5)] == [first] * 5
    assert drr.deficits() == drr.deficits()


def test_duplicate_keys_and_bad_parameters_are_rejected() -> None:
    drr: DeficitRoundRobin[str] = DeficitRoundRobin(WEIGHTS, 1000)
    drr.push("batch", "x", 1)
    with pytest.raises(ValueError, match="already queued"):
        drr.push("batch", "x", 1)
    with pytest.raises(ValueError, match="positive"):
        DeficitRoundRobin({"a": 0.0}, 10)


def naive_order(
    weights: dict[str, float], quantum: int, queues: dict[str, list[int]]
) -> list[tuple[str, int]]:
    """Reference DRR visiting one class at a time, one quantum per visit: no fast-forward."""
    deficit = dict.fromkeys(weights, 0.0)
    pending = {name: list(costs) for name, costs in queues.items()}
    ring = [name for name in weights if pending[name]]
    out: list[tuple[str, int]] = []
    i = 0
    while ring:
        name = ring[i % len(ring)]
        deficit[name] += weights[name] * quantum
        while pending[name] and pending[name][0] <= deficit[name]:
            cost = pending[name].pop(0)
            deficit[name] -= cost
            out.append((name, cost))
        if not pending[name]:
            deficit[name] = 0.0
            ring.remove(name)
            continue  # the next class slides into this index
        i += 1
        i %= len(ring)
    return out


@settings(max_examples=200, deadline=None)
@given(
    queues=st.fixed_dictionaries({name: st.lists(st.integers(1, 30_000), max_size=12) for name in WEIGHTS}),
    quantum=st.integers(50, 3_000),
)
def test_fast_forward_dispatches_in_the_same_order_as_round_by_round_drr(
    queues: dict[str, list[int]], quantum: int
) -> None:
    drr: DeficitRoundRobin[int] = DeficitRoundRobin(WEIGHTS, quantum)
    keys = itertools.count()
    for name in WEIGHTS:
        for cost in queues[name]:
            drr.push(name, next(keys), cost)
    got = [(name, cost) for name, _, cost in iter(lambda: drr.peek() and drr.pop(), None)]
    assert got == naive_order(WEIGHTS, quantum, queues)
    assert len(got) == sum(len(costs) for costs in queues.values())
    assert not math.isnan(sum(drr.deficits().values()))
