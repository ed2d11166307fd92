"""The one-minute window ledger: what closes the gap between a token bucket and a sliding-window limit."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.bucket import ProviderLimiter
from scheduler.config import FeedbackConfig, ProviderLimits
from scheduler.window import WindowLedger


def test_a_full_bucket_after_an_idle_spell_cannot_double_the_minute() -> None:
    # Given a limiter idle long enough for its bucket to be full (60k tokens, 1000/s)
    limits = ProviderLimits(tokens_per_minute=60_000, requests_per_minute=10_000, headroom=0.0)
    limiter = ProviderLimiter(limits, FeedbackConfig(), 0.0)
    limiter.advance(600.0)
    # When turns are admitted greedily for the next minute
    admitted = 0
    now = 600.0
    while now < 659.9:
        while limiter.can_admit(1_000, now):
            limiter.admit(1_000, now)
            admitted += 1_000
        now += 0.1
    # Then the minute holds at most 60k (a bucket alone would allow its 60k burst plus ~60k refill)
    assert admitted == 60_000


def test_entries_leave_after_the_window_and_corrections_apply_only_inside_it() -> None:
    ledger = WindowLedger(capacity=10_000, window_s=60.0)
    first = ledger.add(6_000, 0.0)
    assert not ledger.covers(5_000, 30.0)
    assert ledger.ready_at(5_000, 30.0) == pytest.approx(60.0)
    ledger.correct(first, 2_000)  # the turn used less than it reserved
    assert ledger.covers(5_000, 30.0)
    assert ledger.used(60.0) == 0.0
    ledger.correct(first, 9_999)  # settled after leaving the window: nothing to correct
    assert ledger.used(60.0) == 0.0
    assert ledger.ready_at(10_001, 60.0) == math.inf


@settings(max_examples=150, deadline=None)
@given(
    steps=st.lists(st.tuples(st.floats(0.0, 30.0), st.integers(1, 10_000)), min_size=1, max_size=100),
)
def test_greedy_admission_never_puts_more_than_capacity_in_any_window(steps: list[tuple[float, int]]) -> None:
    ledger = WindowLedger(capacity=10_000, window_s=60.0)
    now = 0.0
    log: list[tuple[float, int]] = []
    for gap, amount in steps:
        now += gap
        if ledger.covers(amount, now):
            ledger.add(amount, now)
            log.append((now, amount))
    for i, (start, _) in enumerate(log):
        assert sum(a for t, a in log[i:] if t < start + 60.0) <= 10_000
