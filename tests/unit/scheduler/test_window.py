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


# --------------------------------------------------------------------------- sub-window


def test_a_60_rpm_key_is_paced_at_one_request_per_sub_window() -> None:
    # Given a 60 RPM key (the provider may enforce it as 1 request per second), the default 5 % sub-window
    # margin and the default headroom
    limits = ProviderLimits(tokens_per_minute=10**9, requests_per_minute=60)
    limiter = ProviderLimiter(limits, FeedbackConfig(), 0.0)
    limiter.advance(600.0)  # a full bucket: only the ledgers can hold a burst back
    # When one request is admitted
    limiter.admit(1, 600.0)
    # Then the next waits one sub-window plus the margin in time (1.05 s), not a minute's share
    assert not limiter.can_admit(1, 600.5)
    assert limiter.ready_at(1, 600.5) == pytest.approx(601.05)
    assert limiter.can_admit(1, 601.05)


def test_a_token_charge_larger_than_the_sub_share_goes_alone() -> None:
    # Given 6,000 TPM metered per sub-window too: 100 tokens per sub-window
    limits = ProviderLimits(
        tokens_per_minute=6_000, requests_per_minute=10**6, headroom=0.0, sub_window_tokens=True
    )
    limiter = ProviderLimiter(limits, FeedbackConfig(), 0.0)
    limiter.advance(600.0)
    # When a 500-token turn is admitted in an empty sub-window
    assert limiter.can_admit(500, 600.0)
    ledger_id = limiter.admit(500, 600.0)
    # Then a small one waits for the sub-window to empty, or for the big one's settlement to make room
    assert not limiter.can_admit(10, 600.2)
    limiter.settle(500, 50, 600.2, ledger_id)
    assert limiter.can_admit(10, 600.2)


@settings(max_examples=80)
@given(
    st.lists(st.tuples(st.floats(0, 1.5, allow_nan=False), st.integers(1, 400)), max_size=80),
    st.integers(60, 900),
    st.integers(6_000, 90_000),
    st.sampled_from([0.0, 0.02, 0.05]),
    st.sampled_from([0.0, 0.02, 0.05]),
)
def test_no_sub_window_is_ever_above_the_providers_share(
    arrivals: list[tuple[float, int]], rpm: int, tpm: int, headroom: float, margin: float
) -> None:
    # Given any greedy arrival pattern against a full limiter
    limits = ProviderLimits(
        tokens_per_minute=tpm,
        requests_per_minute=rpm,
        headroom=headroom,
        sub_window_tokens=True,
        sub_window_margin=margin,
    )
    limiter = ProviderLimiter(limits, FeedbackConfig(), 0.0)
    now = 600.0
    admitted: list[tuple[float, int]] = []
    for gap, cost in arrivals:
        now += gap
        if limiter.can_admit(cost, now):
            limiter.admit(cost, now)
            admitted.append((now, cost))
    # Then every window of sub * (1 + margin) holds at most the provider's per-second share (tokens
    # beyond it only as a single charge), so arrivals shifted by up to the margin still fit its 1 s window
    span = 1.0 * (1 + margin)
    for t, _ in admitted:
        inside = [c for s, c in admitted if t - span < s <= t]
        assert len(inside) <= math.ceil(rpm / 60)
        assert sum(inside) <= math.ceil(tpm / 60) or len(inside) == 1
