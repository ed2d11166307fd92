"""The scheduler learns a provider key's real limit when the configured one is 10x too high.

A simulated provider (pure, in this file) enforces its real limit and answers each admitted call after a
latency with what real servers send: the stated limit and remaining count, only a 429 with a retry hint,
a bare 429, or LiteLLM's router (calendar minutes, states ``rpm`` but rejects the call that would reach it,
``llm_provider-retry-after: 60`` on every 429). Closed-loop clients keep the key saturated. The judge is
the provider's count of 429s after its first full window, and the goodput kept once the limit is learned;
the control runs switch learning off and show the same judge fails.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass, field

import pytest

from runtime.clock import FakeClock
from runtime.ports import RateLimitInfo, TurnRequest
from scheduler.config import FeedbackConfig, ProviderLimits, SchedulerConfig
from scheduler.core import Admitted, SchedulerCore
from scheduler.learning import LearnedLimit, LimitSource, capacity_below

KEY = "http://gateway/v1|model"
WINDOW = 60.0
REAL_RPM = 8
CONFIGURED_RPM = 10 * REAL_RPM  # the workload's belief: 10x too high


@dataclass
class SimProvider:
    """Enforces ``limit`` requests per window; ``style`` decides what its responses say."""

    style: str  # "states_limit" | "retry_hint_only" | "bare_429" | "litellm_router"
    limit: int = REAL_RPM
    accepted: deque[float] = field(default_factory=deque)  # sliding window styles
    calendar: dict[int, int] = field(default_factory=dict)  # litellm_router: accepted per minute
    rejected_at: list[float] = field(default_factory=list)

    def call(self, now: float) -> tuple[bool, RateLimitInfo | None]:
        if self.style == "litellm_router":
            minute = math.floor(now / WINDOW)
            current = self.calendar.get(minute, 0)
            if current + 1 >= self.limit:  # what LiteLLM 1.108's router does: one below its stated rpm
                self.rejected_at.append(now)
                return False, RateLimitInfo(retry_after_s=60.0, hint_source="llm_provider-retry-after")
            self.calendar[minute] = current + 1
            return True, RateLimitInfo(limit_requests=self.limit, remaining_requests=self.limit - current - 1)
        while self.accepted and self.accepted[0] <= now - WINDOW:
            self.accepted.popleft()
        if len(self.accepted) >= self.limit:
            self.rejected_at.append(now)
            retry_after = self.accepted[0] + WINDOW - now
            if self.style == "bare_429":
                return False, None
            if self.style == "retry_hint_only":
                return False, RateLimitInfo(retry_after_s=math.ceil(retry_after), hint_source="retry-after")
            return False, RateLimitInfo(
                retry_after_s=retry_after,
                hint_source="retry-after-ms",
                limit_requests=self.limit,
                remaining_requests=0,
                reset_requests_s=retry_after,
            )
        self.accepted.append(now)
        if self.style == "states_limit":
            return True, RateLimitInfo(
                limit_requests=self.limit, remaining_requests=self.limit - len(self.accepted)
            )
        return True, None

    def accepted_between(self, start: float, end: float, admitted_at: list[float]) -> int:
        return sum(1 for t in admitted_at if start <= t < end) - sum(
            1 for t in self.rejected_at if start <= t < end
        )


@dataclass
class Run:
    provider: SimProvider
    core: SchedulerCore
    started: float
    admitted_at: list[float]

    @property
    def first_window_end(self) -> float:
        """The end of the provider's first full window: a minute after the start on a sliding window; on
        calendar minutes (LiteLLM), the end of the first minute that began after the start (a run that
        starts mid-minute meets the real limit only in a full minute)."""
        if self.provider.style == "litellm_router":
            return (math.floor(self.started / WINDOW) + 2) * WINDOW
        return self.started + WINDOW

    def rejections_after_first_window(self) -> int:
        return sum(1 for t in self.provider.rejected_at if t >= self.first_window_end)


def saturate(style: str, *, learn: bool, headroom: float = 0.05, windows: int = 5) -> Run:
    """Six closed-loop clients on one key for ``windows`` windows; each call is answered 0.5 s after its
    admission with the provider's verdict, fed back as the interpreter does (``report_limits``)."""
    clock = FakeClock(start=1_010.0)  # 10 s into a calendar minute: the first window straddles two
    limits = ProviderLimits(
        tokens_per_minute=10_000_000, requests_per_minute=CONFIGURED_RPM, headroom=headroom, window_s=WINDOW
    )
    config = SchedulerConfig(providers={KEY: limits}, feedback=FeedbackConfig(learn_limits=learn))
    core = SchedulerCore(config, clock, id_prefix="sim")
    provider = SimProvider(style)
    started, end = clock.now(), clock.now() + windows * WINDOW
    ids = itertools.count()
    responses: list[tuple[float, int, str, bool, RateLimitInfo | None]] = []
    admitted_at: list[float] = []

    def submit() -> None:
        core.submit_turn(TurnRequest(f"t{next(ids)}", "standard", KEY, 100, clock.wall() + 10 * 3600))

    for _ in range(6):
        submit()
    while clock.now() < end:
        for decision in core.tick():
            assert isinstance(decision, Admitted)
            admitted_at.append(clock.now())
            ok, info = provider.call(clock.now())
            heapq.heappush(responses, (clock.now() + 0.5, next(ids), decision.grant.grant_id, ok, info))
        while responses and responses[0][0] <= clock.now():
            _, _, grant_id, ok, info = heapq.heappop(responses)
            if info is not None or not ok:
                core.report_limits(KEY, info or RateLimitInfo(), rate_limited=not ok)
            core.settle_turn(grant_id, 100 if ok else 0)
            submit()
        wake = [t for t in (core.next_wakeup(), responses[0][0] if responses else None) if t is not None]
        clock.advance(max(0.0, min(wake) - clock.now()) if wake else WINDOW)
    return Run(provider, core, started, admitted_at)


STYLES = ["states_limit", "retry_hint_only", "bare_429", "litellm_router"]


@pytest.mark.parametrize("style", STYLES)
def test_after_the_first_window_the_429s_stop_and_the_real_limit_is_used(style: str) -> None:
    # Given a workload whose configured rpm is 10x the provider's real one (LiteLLM: headroom 0, as a
    # workload that trusts the limit it states would run)
    headroom = 0.0 if style == "litellm_router" else 0.05
    # When six trajectories keep the key saturated for five windows
    run = saturate(style, learn=True, headroom=headroom)
    # Then the provider rejects nothing after the first window
    assert run.rejections_after_first_window() == 0, run.provider.rejected_at
    # And every later window still gets most of the real limit (it was not learned too low), once the
    # pause the last 429's retry hint asked for is over
    start = max([run.first_window_end, *(t + WINDOW for t in run.provider.rejected_at)])
    while start + WINDOW <= run.started + 5 * WINDOW:
        assert run.provider.accepted_between(start, start + WINDOW, run.admitted_at) >= 0.75 * REAL_RPM
        start += WINDOW
    # And the scheduler holds the learned limit, never above the real one
    lane = run.core.snapshot().lanes[KEY]
    assert lane.limit_requests <= REAL_RPM
    assert lane.limit_sources["requests"] in {"stated", "inferred"}
    # And once learned, its window ledger keeps every window within the learned limit less the headroom
    cap = capacity_below(lane.limit_requests, headroom)
    later = [t for t in run.admitted_at if t >= run.first_window_end]
    assert all(sum(1 for b in later if a <= b < a + WINDOW) <= cap for a in later)


@pytest.mark.parametrize("style", STYLES)
def test_control_without_learning_the_429s_go_on_after_the_first_window(style: str) -> None:
    """The control run of the test above: the same provider and workload with learning switched off."""
    headroom = 0.0 if style == "litellm_router" else 0.05
    run = saturate(style, learn=False, headroom=headroom)
    assert run.rejections_after_first_window() > 0


def test_retry_hints_are_honoured_and_counted_by_the_header_that_carried_them() -> None:
    # Given LiteLLM's router answering 429 with llm_provider-retry-after: 60
    run = saturate("litellm_router", learn=True, headroom=0.0, windows=2)
    lane = run.core.snapshot().lanes[KEY]
    # Then every 429 reported paused the key and is counted under that header
    assert lane.rate_limited == len(run.provider.rejected_at) >= 1
    assert lane.retry_hints_honoured == {"llm_provider-retry-after": lane.rate_limited}
    # And nothing was admitted during the 60 s pause that followed the first 429
    first = run.provider.rejected_at[0]
    assert not [t for t in run.admitted_at if first < t < first + 60.0]


@pytest.mark.parametrize(
    ("evidence", "expected", "source"),
    [
        ([("state", 100.0)], 100.0, LimitSource.STATED),
        ([("state", 900.0)], 600.0, LimitSource.CONFIGURED),  # never above what the workload allows
        ([("bound", 50.0), ("bound", 80.0)], 50.0, LimitSource.INFERRED),  # inferred only goes down
        ([("bound", 0.5)], 600.0, LimitSource.CONFIGURED),  # nonsense evidence is ignored
        ([("state", 100.0), ("bound", 40.0)], 40.0, LimitSource.INFERRED),  # a server below its word
        ([("bound", 40.0), ("state", 100.0)], 100.0, LimitSource.STATED),  # a new word supersedes
    ],
)
def test_learned_limit_table(evidence: list[tuple[str, float]], expected: float, source: LimitSource) -> None:
    learned = LearnedLimit(600.0)
    for kind, value in evidence:
        learned.state(value) if kind == "state" else learned.bound(value)
    assert (learned.effective, learned.source) == (expected, source)


@pytest.mark.parametrize(
    ("limit", "headroom", "capacity"), [(100.0, 0.05, 95.0), (1.0, 0.05, 1.0), (4.0, 0.0, 4.0)]
)
def test_capacity_keeps_the_headroom_but_never_below_one_request(
    limit: float, headroom: float, capacity: float
) -> None:
    assert capacity_below(limit, headroom) == pytest.approx(capacity)


def test_a_token_429_pauses_the_key_but_never_shrinks_the_token_limit() -> None:
    """Providers count tokens their own way (prompt + max_tokens on arrival), so our settled usage bounds
    nothing: a token 429 must not turn queued turns into ones that can never fit."""
    clock = FakeClock()
    limits = ProviderLimits(tokens_per_minute=6_000, requests_per_minute=600, headroom=0.05)
    core = SchedulerCore(SchedulerConfig(providers={KEY: limits}), clock, id_prefix="tok")
    clock.advance(60.0)
    core.submit_turn(TurnRequest("a", "standard", KEY, 100, clock.wall() + 600))
    [grant] = core.tick()
    assert isinstance(grant, Admitted)
    core.settle_turn(grant.grant.grant_id, 40)
    # When the provider answers 429 saying its tokens ran out
    core.report_limits(KEY, RateLimitInfo(retry_after_s=0.5, remaining_tokens=0), rate_limited=True)
    big = core.submit_turn(TurnRequest("b", "standard", KEY, 5_000, clock.wall() + 600))
    # Then the token limit is still the configured one, and the big turn waits and is admitted
    assert core.snapshot().lanes[KEY].limit_tokens == 6_000
    while not (decisions := core.tick()):
        clock.advance(1.0)
    assert [(type(d), d.ticket) for d in decisions] == [(Admitted, big)]


def test_a_sub_window_429_with_requests_left_teaches_no_request_limit() -> None:
    """OpenAI enforces a 600 RPM limit over shorter periods too (10 requests in a second) and its
    ``remaining`` counts only the minute. A 429 that says requests remain came from the shorter window: the
    minute's limit stays the configured one (learning "accepted so far" there made a 600 RPM key a 10 RPM
    one: a 50 s stall of a ``tether run`` after one 429 at its start)."""
    clock = FakeClock()
    limits = ProviderLimits(tokens_per_minute=10_000_000, requests_per_minute=600, headroom=0.02)
    core = SchedulerCore(SchedulerConfig(providers={KEY: limits}), clock, id_prefix="sub")
    clock.advance(60.0)
    for i in range(10):
        core.submit_turn(TurnRequest(f"t{i}", "standard", KEY, 100, clock.wall() + 600))
    granted = []
    while len(granted) < 10:
        granted += [d for d in core.tick() if isinstance(d, Admitted)]
        clock.advance(0.05)
    # When the provider refuses the next request with 590 of its 600 requests left this minute
    info = RateLimitInfo(retry_after_s=1.0, limit_requests=600, remaining_requests=590)
    core.report_limits(KEY, info, rate_limited=True)
    # Then the request limit is still 600 a minute, and the key admits again once the hint has passed
    assert core.snapshot().lanes[KEY].limit_requests == 600
    clock.advance(1.5)
    core.submit_turn(TurnRequest("next", "standard", KEY, 100, clock.wall() + 600))
    assert [type(d) for d in core.tick()] == [Admitted]
