"""Token buckets and the per-provider limiter: refill, capacity below the limit, settlement, 429 feedback."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.bucket import ProviderLimiter, TokenBucket
from scheduler.config import FeedbackConfig, ProviderLimits

LIMITS = ProviderLimits(tokens_per_minute=60_000, requests_per_minute=600, headroom=0.05)
FEEDBACK = FeedbackConfig(decrease_factor=0.5, floor=0.1, recovery_per_s=0.01, decrease_cooldown_s=1.0)
T0 = 100.0


def full_limiter() -> ProviderLimiter:
    """A limiter whose buckets have had a full minute to fill."""
    limiter = ProviderLimiter(LIMITS, FEEDBACK, T0)
    limiter.advance(T0 + 60.0)
    return limiter


def test_capacity_is_the_limit_less_headroom_and_refill_spreads_it_over_a_minute() -> None:
    # Given a provider allowing 60k tokens and 600 requests a minute, 5 % headroom
    limiter = ProviderLimiter(LIMITS, FEEDBACK, T0)
    # Then the buckets hold 57k tokens / 570 requests and refill that much per minute
    assert limiter.tokens.capacity == pytest.approx(57_000)
    assert limiter.requests.capacity == pytest.approx(570)
    assert limiter.tokens.rate == pytest.approx(57_000 / 60)


def test_a_new_limiter_starts_empty_and_refills_continuously() -> None:
    # Given a fresh limiter (as after a scheduler restart)
    limiter = ProviderLimiter(LIMITS, FEEDBACK, T0)
    # Then it holds nothing at first, half after 30 s, and never more than capacity
    assert limiter.tokens.level(T0) == 0.0
    assert limiter.tokens.level(T0 + 30.0) == pytest.approx(28_500)
    assert limiter.tokens.level(T0 + 600.0) == pytest.approx(57_000)


def test_admission_needs_both_buckets() -> None:
    # Given plenty of tokens but the request bucket drained
    limiter = full_limiter()
    now = T0 + 60.0
    for _ in range(570):
        limiter.admit(1, now)
    # When a small turn asks, Then it is refused although tokens are plentiful
    assert limiter.tokens.level(now) > 50_000
    assert not limiter.can_admit(10, now)
    # And it fits only once the first of those requests leaves the one-minute window
    assert limiter.requests.ready_at(1, now) == pytest.approx(now + 60.0 / 570)
    assert limiter.ready_at(10, now) == pytest.approx(now + 60.0)


@pytest.mark.parametrize(
    ("reserved", "actual", "expected_level"),
    [
        (5_000, 5_000, 20_000.0),  # exact estimate: nothing moves
        (5_000, 3_200, 21_800.0),  # over-reserved: refund 1 800
        (5_000, 7_500, 17_500.0),  # under-reserved: debit 2 500
        (5_000, 0, 25_000.0),  # unused: refund everything
    ],
)
def test_settlement_refunds_or_debits_exactly(reserved: int, actual: int, expected_level: float) -> None:
    # Given a bucket at 25k tokens and a turn that reserved `reserved`
    limiter = ProviderLimiter(LIMITS, FEEDBACK, T0)
    limiter.advance(T0 + 25_000 / (57_000 / 60))
    now = limiter.tokens._at
    limiter.admit(reserved, now)
    # When the provider reports `actual` tokens
    limiter.settle(reserved, actual, now)
    # Then the level moved by exactly the difference
    assert limiter.tokens.level(now) == pytest.approx(expected_level)


def test_a_refund_never_lifts_the_level_above_capacity() -> None:
    limiter = full_limiter()
    now = T0 + 60.0
    limiter.admit(1_000, now)
    limiter.settle(reserved=1_000, actual=0, now=now)
    limiter.settle(reserved=5_000, actual=0, now=now)  # a late, inflated refund
    assert limiter.tokens.level(now) == pytest.approx(57_000)


def test_debt_is_paid_back_before_the_next_admission() -> None:
    # Given a turn that used 10k more tokens than the bucket held
    limiter = ProviderLimiter(LIMITS, FEEDBACK, T0)
    limiter.settle(reserved=0, actual=10_000, now=T0)
    # Then even a one-token turn waits until the debt is refilled
    assert limiter.tokens.level(T0) == pytest.approx(-10_000)
    assert limiter.ready_at(1, T0) == pytest.approx(T0 + 10_001 / (57_000 / 60))


def test_429_blocks_the_key_until_retry_after_even_with_tokens() -> None:
    limiter = full_limiter()
    now = T0 + 60.0
    # When the provider answers 429 with Retry-After 7
    limiter.on_rate_limited(7.0, now)
    # Then nothing is admitted until then, and the token view dropped to zero
    assert limiter.tokens.level(now) == 0.0
    assert not limiter.can_admit(1, now + 6.99)
    assert limiter.ready_at(1, now) >= now + 7.0


def test_429_without_retry_after_uses_the_default_pause() -> None:
    limiter = full_limiter()
    now = T0 + 60.0
    limiter.on_rate_limited(None, now)
    assert limiter.blocked_until == pytest.approx(now + FEEDBACK.default_retry_after_s)


def test_429_decreases_multiplicatively_once_per_cooldown_down_to_the_floor() -> None:
    limiter = full_limiter()
    now = T0 + 60.0
    # When a burst of 429s arrives at once, Then the rate halves once
    for _ in range(5):
        limiter.on_rate_limited(0.0, now)
    assert limiter.rate_factor == pytest.approx(0.5)
    # When 429s keep arriving a cooldown apart, Then the rate keeps halving but stops at the floor
    factors = []
    for i in range(1, 6):
        limiter.on_rate_limited(0.0, now + i * 1.0)
        factors.append(limiter.rate_factor)
    assert factors[0] < 0.5
    assert min(factors) >= FEEDBACK.floor
    assert limiter.tokens.rate == pytest.approx(57_000 / 60 * limiter.rate_factor)


def test_rate_recovers_additively_while_quiet_and_never_above_the_limit() -> None:
    limiter = full_limiter()
    now = T0 + 60.0
    limiter.on_rate_limited(0.0, now)  # factor 0.5
    limiter.advance(now + 10.0)
    assert limiter.rate_factor == pytest.approx(0.5 + 10 * 0.01)
    limiter.advance(now + 1_000.0)
    assert limiter.rate_factor == 1.0
    assert limiter.tokens.rate == pytest.approx(57_000 / 60)


@pytest.mark.parametrize(
    ("remaining", "tokens_after", "requests_after"),
    [
        ({"x-ratelimit-remaining-tokens": 10_000}, 10_000 - 3_000, 570),
        ({"tokens": 10_000, "requests": 100}, 7_000, 100 - 30),
        ({"x-ratelimit-remaining-tokens": 1e9}, 57_000, 570),  # never raises the local view
    ],
)
def test_remaining_headers_clamp_the_local_view(
    remaining: dict[str, float], tokens_after: float, requests_after: float
) -> None:
    limiter = full_limiter()
    now = T0 + 60.0
    limiter.observe_remaining(remaining, now)
    assert limiter.tokens.level(now) == pytest.approx(tokens_after)
    assert limiter.requests.level(now) == pytest.approx(requests_after)


def test_a_turn_larger_than_capacity_never_fits() -> None:
    limiter = ProviderLimiter(LIMITS, FEEDBACK, T0)
    assert not limiter.fits_ever(57_001)
    assert limiter.ready_at(57_001, T0) == math.inf


def test_bucket_rejects_nonsense_parameters() -> None:
    with pytest.raises(ValueError, match="capacity"):
        TokenBucket(0, 1.0, T0)


@settings(max_examples=150, deadline=None)
@given(
    steps=st.lists(
        st.tuples(st.floats(0.0, 5.0), st.integers(1, 20_000), st.integers(0, 20_000)),
        min_size=1,
        max_size=80,
    )
)
def test_admitted_usage_never_exceeds_capacity_plus_refill_in_any_window(
    steps: list[tuple[float, int, int]],
) -> None:
    """Greedy admission at random times of random turns, each settled at once with its actual usage
    (at most what it reserved). Over any window [a, b] the usage of turns admitted in it is at most
    capacity + rate * (b - a), and from the cold start at most rate * (b - start)."""
    limiter = ProviderLimiter(LIMITS, FEEDBACK, T0)
    rate, capacity = limiter.tokens.rate, limiter.tokens.capacity
    now = T0
    admitted: list[tuple[float, int]] = []
    for gap, cost, actual in steps:
        now += gap
        while limiter.can_admit(cost, now):
            limiter.admit(cost, now)
            used = min(actual, cost)
            limiter.settle(cost, used, now)
            admitted.append((now, used))
    for i, (start, _) in enumerate(admitted):
        total = 0
        for end, used in admitted[i:]:
            total += used
            assert total <= capacity + rate * (end - start) + 1e-6
    running = 0
    for end, used in admitted:
        running += used
        assert running <= rate * (end - T0) + 1e-6
