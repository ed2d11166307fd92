"""Pacing within the sub-window (``ProviderLimits.sub_window_burst``): turns ready at once are granted at
most a burst at a time (5 % of the sub-window's share, at least one), the rest spaced evenly over it; the
sub-window and the minute hold as before. The controls switch pacing off and show the same judges fail."""

from __future__ import annotations

import itertools

import pytest
from pydantic import ValidationError

from runtime.clock import FakeClock
from runtime.ports import RateLimitInfo, TurnRequest
from scheduler.config import ProviderLimits, SchedulerConfig
from scheduler.core import Admitted, SchedulerCore

KEY = "http://provider/v1|model"
_ids = itertools.count()


def granted_times(limits: ProviderLimits, ready: int, until: float = 5.0) -> list[float]:
    """``ready`` turns submitted at once on a key idle for a minute (its buckets full, as when ``tether run``
    starts the scheduler before the trajectories); when each was granted (seconds from the submission)."""
    clock = FakeClock()
    core = SchedulerCore(SchedulerConfig(providers={KEY: limits}), clock, id_prefix="p")
    clock.advance(60.0)
    start = clock.now()
    for _ in range(ready):
        core.submit_turn(TurnRequest(f"t{next(_ids)}", "standard", KEY, 10, clock.wall() + 600))
    times: list[float] = []
    while clock.now() - start < until and len(times) < ready:
        times += [clock.now() - start for d in core.tick() if isinstance(d, Admitted)]
        wake = core.next_wakeup()
        if wake is None:
            break
        clock.advance(max(1e-6, wake - clock.now()))
    return times


def limits(rpm: int, burst: float | None = 0.05) -> ProviderLimits:
    return ProviderLimits(
        tokens_per_minute=10_000_000, requests_per_minute=rpm, headroom=0.0, sub_window_burst=burst
    )


@pytest.mark.parametrize(("burst", "spaced"), [(0.05, True), (None, False)])
def test_a_cold_start_is_granted_one_at_a_time_across_the_second(burst: float | None, spaced: bool) -> None:
    # Given 600 requests a minute (10 a second, counted over 1.05 s) and 20 turns ready at once
    times = granted_times(limits(600, burst), ready=20)
    # Then all are granted within about two seconds, and with pacing no two closer than 1.05 s / 10
    assert len(times) == 20 and times[-1] < 2.2
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert (min(gaps) >= 0.105 - 1e-6) is spaced, gaps
    # Control: without pacing the first ten go at the same instant, then the next ten 1.05 s later
    assert (times[:10] == [0.0] * 10) is not spaced
    # And either way, no 1.05 s holds more than the sub-window's share of 10
    assert all(sum(1 for t in times if a <= t < a + 1.05 - 1e-6) <= 10 for a in times)


def test_a_larger_share_is_paced_in_bursts_of_five_percent() -> None:
    # Given 60,000 requests a minute (1,000 a second): bursts of 50 per 52.5 ms
    times = granted_times(limits(60_000), ready=200)
    firsts = sorted(set(times))
    assert [times.count(t) for t in firsts] == [50] * 4
    assert [round(b - a, 4) for a, b in itertools.pairwise(firsts)] == [0.0525] * 3


def test_the_pace_follows_a_learned_limit() -> None:
    # Given a key configured at 600 a minute whose provider states 120 (2 a second)
    clock = FakeClock()
    core = SchedulerCore(SchedulerConfig(providers={KEY: limits(600)}), clock, id_prefix="p")
    clock.advance(60.0)
    core.report_limits(KEY, RateLimitInfo(limit_requests=120, remaining_requests=120), rate_limited=False)
    start = clock.now()
    for _ in range(4):
        core.submit_turn(TurnRequest(f"t{next(_ids)}", "standard", KEY, 10, clock.wall() + 600))
    times: list[float] = []
    while len(times) < 4:
        times += [round(clock.now() - start, 4) for d in core.tick() if isinstance(d, Admitted)]
        clock.advance(max(1e-6, (core.next_wakeup() or clock.now()) - clock.now()))
    # Then the turns are spaced over the learned share (1.05 s / 2), not the configured one (1.05 s / 10)
    assert times == [0.0, 0.525, 1.05, 1.575]


@pytest.mark.parametrize("burst", [0.0, -0.1, 1.5])
def test_a_burst_outside_its_range_is_refused_with_the_field_named(burst: float) -> None:
    with pytest.raises(ValidationError, match="sub_window_burst"):
        limits(600, burst)
