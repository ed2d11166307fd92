"""Sliding-window RPM/TPM limiter (minute window, no sub-window, rejections free) against a fake clock.

The sub-window, counted rejections and the token-bucket mode have their own tests in
``test_limiter_modes.py``; this file pins the minute window's own arithmetic.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.clock import FakeClock
from testbed.provider.limits import Admitted, LimitDimension, Rejected
from testbed.provider.sliding_window import SlidingWindowLimiter


def limiter(rpm: int | None = None, tpm: int | None = None) -> tuple[FakeClock, SlidingWindowLimiter]:
    clock = FakeClock()
    return clock, SlidingWindowLimiter(
        clock, rpm=rpm, tpm=tpm, window_s=60.0, sub_window_s=0, count_rejected=False
    )


def test_rpm_rejects_the_request_over_the_limit_until_the_oldest_leaves_the_window() -> None:
    # Given rpm=2 and two requests at t=0 and t=10
    clock, lim = limiter(rpm=2)
    assert isinstance(lim.try_admit(1), Admitted)
    clock.advance(10)
    assert isinstance(lim.try_admit(1), Admitted)
    # When a third arrives at t=20
    clock.advance(10)
    third = lim.try_admit(1)
    # Then it is rejected on requests, to be retried when the t=0 request expires (at t=60)
    assert isinstance(third, Rejected)
    assert third.dimension is LimitDimension.REQUESTS
    assert third.retry_after_s == pytest.approx(40.0)
    assert third.snapshot.remaining_requests == 0
    # And at exactly that time it fits
    clock.advance(40)
    assert isinstance(lim.try_admit(1), Admitted)


def test_tpm_retry_after_is_when_enough_tokens_have_expired() -> None:
    # Given tpm=100 with charges 50 (t=0), 30 (t=5), 20 (t=7)
    clock, lim = limiter(tpm=100)
    for charge, dt in ((50, 5), (30, 2), (20, 0)):
        assert isinstance(lim.try_admit(charge), Admitted)
        clock.advance(dt)
    # When a 60-token request arrives at t=7 (needs 60 freed: the 50 and the 30)
    rejected = lim.try_admit(60)
    # Then it must wait until the t=5 charge expires at t=65
    assert isinstance(rejected, Rejected)
    assert rejected.dimension is LimitDimension.TOKENS
    assert rejected.retry_after_s == pytest.approx(58.0)
    assert rejected.snapshot.remaining_tokens == 0


def test_settle_corrects_the_reservation_to_actual_usage() -> None:
    # Given a 90-token reservation (prompt 10 + max_tokens 80) under tpm=100
    _, lim = limiter(tpm=100)
    admitted = lim.try_admit(90)
    assert isinstance(admitted, Admitted)
    assert isinstance(lim.try_admit(20), Rejected)
    # When the request completes with 5 output tokens
    lim.settle(admitted.ticket, 15)
    # Then the freed tokens admit the next request
    assert lim.tokens_in_window == 15
    assert isinstance(lim.try_admit(20), Admitted)


def test_a_charge_larger_than_the_limit_is_reported_too_large() -> None:
    _, lim = limiter(tpm=100)
    decision = lim.try_admit(101)
    assert isinstance(decision, Rejected) and decision.too_large


def test_unlimited_dimensions_admit_everything_and_send_no_headers() -> None:
    _, lim = limiter()
    for _ in range(1000):
        assert isinstance(lim.try_admit(10_000), Admitted)
    assert lim.snapshot().headers() == {}


def test_headers_report_limits_remaining_and_reset() -> None:
    # Given rpm=10 tpm=1000 and one 100-token request 15s ago
    clock, lim = limiter(rpm=10, tpm=1000)
    lim.try_admit(100)
    clock.advance(15)
    # When the headers are taken
    headers = lim.snapshot().headers()
    # Then they carry the limit, the remaining and the time to a full reset
    assert headers == {
        "x-ratelimit-limit-requests": "10",
        "x-ratelimit-remaining-requests": "9",
        "x-ratelimit-reset-requests": "45.000s",
        "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "900",
        "x-ratelimit-reset-tokens": "45.000s",
    }


@pytest.mark.parametrize(("rpm", "tpm"), [(0, None), (None, 0), (-1, 5)])
def test_bad_limits_are_refused(rpm: int | None, tpm: int | None) -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        SlidingWindowLimiter(FakeClock(), rpm=rpm, tpm=tpm)


@settings(max_examples=60)
@given(
    st.lists(st.tuples(st.floats(0, 20, allow_nan=False), st.integers(0, 400)), max_size=60),
    st.integers(1, 20),
    st.integers(400, 2000),
)
def test_no_window_ever_holds_more_than_the_limits(
    arrivals: list[tuple[float, int]], rpm: int, tpm: int
) -> None:
    # Given any arrival sequence / When each is admitted or rejected
    clock, lim = limiter(rpm=rpm, tpm=tpm)
    admitted: list[tuple[float, int]] = []
    for gap, charge in arrivals:
        clock.advance(gap)
        if isinstance(lim.try_admit(charge), Admitted):
            admitted.append((clock.now(), charge))
    # Then every 60s window ending at an admission holds at most rpm requests and tpm tokens
    for t, _ in admitted:
        inside = [c for s, c in admitted if t - 60 < s <= t]
        assert len(inside) <= rpm
        assert sum(inside) <= tpm


@settings(max_examples=60)
@given(st.lists(st.tuples(st.floats(0, 30, allow_nan=False), st.integers(1, 300)), min_size=1, max_size=40))
def test_a_rejected_request_fits_exactly_after_retry_after(arrivals: list[tuple[float, int]]) -> None:
    # Given a loaded limiter and a request it rejects
    clock, lim = limiter(rpm=5, tpm=600)
    for gap, charge in arrivals:
        clock.advance(gap)
        decision = lim.try_admit(charge)
        if isinstance(decision, Rejected):
            # When nothing else arrives for retry_after seconds / Then the same request fits
            clock.advance(decision.retry_after_s)
            assert isinstance(lim.try_admit(charge), Admitted)
