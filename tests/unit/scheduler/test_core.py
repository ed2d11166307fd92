"""SchedulerCore step by step on a fake clock: buckets in front of DRR, deadlines, leases, reclaim."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.clock import FakeClock
from runtime.ports import RateLimitInfo, TurnRequest
from scheduler.config import ProviderLimits, SandboxPoolConfig, SchedulerConfig
from scheduler.core import Admitted, PermitGranted, Refused, SchedulerCore, SettleResult
from scheduler.errors import Predicate, SchedulerInputError

KEY = "http://provider/v1|model-a"
LIMITS = ProviderLimits(tokens_per_minute=60_000, requests_per_minute=6_000, headroom=0.0)  # 1000 tok/s
CONFIG = SchedulerConfig(
    providers={KEY: LIMITS},
    pools={"default": SandboxPoolConfig(size=2, reserved=1)},
)
_ids = itertools.count()


def turn(
    clock: FakeClock,
    cls: str = "standard",
    tokens: int = 1_000,
    deadline_in: float = 3_600.0,
    trajectory: str | None = None,
    key: str = KEY,
) -> TurnRequest:
    return TurnRequest(trajectory or f"t{next(_ids)}", cls, key, tokens, clock.wall() + deadline_in)


def admitted(decisions: list) -> list[Admitted]:
    return [d for d in decisions if isinstance(d, Admitted)]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def core(clock: FakeClock) -> SchedulerCore:
    return SchedulerCore(CONFIG, clock, id_prefix="test")


def test_a_fresh_core_starts_empty_and_admits_as_the_bucket_refills(
    clock: FakeClock, core: SchedulerCore
) -> None:
    # Given a fresh scheduler and a 5000-token turn
    ticket = core.submit_turn(turn(clock, tokens=5_000))
    # Then nothing is admitted at once (no burst after a start), and it is due after 5 s of refill
    assert core.tick() == []
    assert core.next_wakeup() == pytest.approx(clock.now() + 5.0)
    clock.advance(5.0)
    [decision] = core.tick()
    assert isinstance(decision, Admitted) and decision.ticket == ticket
    assert decision.grant.reserved_tokens == 5_000
    assert decision.waited_s == pytest.approx(5.0)
    assert decision.grant.lease_expires_at == pytest.approx(clock.wall() + CONFIG.turn_lease_s)


def test_classes_share_the_bucket_by_weight_under_saturation(clock: FakeClock, core: SchedulerCore) -> None:
    # Given every class backlogged with turns of different sizes behind one 1000 tok/s bucket
    sizes = {"interactive": 800, "standard": 1_500, "batch": 4_000}
    tickets: dict[int, str] = {}
    for cls, size in sizes.items():
        for _ in range(600_000 // size + 1):  # each class alone could fill the whole run
            tickets[core.submit_turn(turn(clock, cls, size))] = cls
    # When 10 simulated minutes pass, ticking whenever the core asks to be woken
    tokens = dict.fromkeys(sizes, 0)
    end = clock.now() + 600.0
    while (wake := core.next_wakeup()) is not None and wake <= end:
        clock.advance(max(0.0, wake - clock.now()))
        for decision in admitted(core.tick()):
            tokens[tickets[decision.ticket]] += decision.grant.reserved_tokens
    # Then shares of tokens follow 4:2:1 within a percentage point, and the limit was used, never exceeded
    # (the one-minute window ledger can leave a few percent idle waiting for room for a large head turn)
    total = sum(tokens.values())
    assert 0.95 * 600_000 <= total <= 600_000
    for cls, weight in CONFIG.class_weights.items():
        assert tokens[cls] / total == pytest.approx(weight / 7.0, abs=0.01)


def test_a_request_whose_deadline_passes_while_queued_is_refused(
    clock: FakeClock, core: SchedulerCore
) -> None:
    # Given a turn that needs 50 s of refill but must start within 10 s
    ticket = core.submit_turn(turn(clock, tokens=50_000, deadline_in=10.0))
    assert core.next_wakeup() == pytest.approx(clock.now() + 10.0)
    # When 10 s pass
    clock.advance(10.0)
    [decision] = core.tick()
    # Then it is refused with the deadline predicate and nothing more is queued
    assert isinstance(decision, Refused) and decision.ticket == ticket
    assert decision.predicate == Predicate.DEADLINE
    assert decision.error().predicate == "deadline"
    assert core.snapshot().pending == 0
    # And the tokens it would have taken go to the next turn instead
    clock.advance(40.0)
    core.submit_turn(turn(clock, tokens=50_000))
    assert len(admitted(core.tick())) == 1


@pytest.mark.parametrize(
    ("tokens", "deadline_in", "predicate"),
    [
        (10, 0.0, Predicate.DEADLINE),
        (10, -5.0, Predicate.DEADLINE),
        (60_001, 3_600.0, Predicate.EXCEEDS_CAPACITY),
    ],
)
def test_hopeless_requests_are_refused_at_once(
    clock: FakeClock, core: SchedulerCore, tokens: int, deadline_in: float, predicate: str
) -> None:
    ticket = core.submit_turn(turn(clock, tokens=tokens, deadline_in=deadline_in))
    [decision] = core.tick()
    assert isinstance(decision, Refused) and (decision.ticket, decision.predicate) == (ticket, predicate)
    assert core.snapshot().pending == 0


@pytest.mark.parametrize(
    ("request_", "where"),
    [
        (TurnRequest("t", "vip", KEY, 10, 2e9), "TurnRequest.priority_class"),
        (TurnRequest("t", "batch", "http://elsewhere|m", 10, 2e9), "TurnRequest.provider_key"),
        (TurnRequest("t", "batch", KEY, -1, 2e9), "TurnRequest.estimated_tokens"),
    ],
)
def test_bad_requests_raise_input_errors_naming_the_field(
    core: SchedulerCore, request_: TurnRequest, where: str
) -> None:
    with pytest.raises(SchedulerInputError) as err:
        core.submit_turn(request_)
    assert err.value.where == where


def test_settlement_through_the_core_refunds_exactly_and_only_once(
    clock: FakeClock, core: SchedulerCore
) -> None:
    clock.advance(30.0)  # 30k tokens in the bucket
    core.submit_turn(turn(clock, tokens=10_000))
    [grant] = [d.grant for d in admitted(core.tick())]
    assert core.snapshot().lanes[KEY].tokens == pytest.approx(20_000)
    assert core.settle_turn(grant.grant_id, 4_000) is SettleResult.SETTLED
    assert core.snapshot().lanes[KEY].tokens == pytest.approx(26_000)
    assert core.settle_turn(grant.grant_id, 0) is SettleResult.UNKNOWN
    assert core.snapshot().lanes[KEY].tokens == pytest.approx(26_000)
    with pytest.raises(SchedulerInputError):
        core.settle_turn(grant.grant_id, -3)


def test_a_429_pauses_the_key_and_the_queue_resumes_after_retry_after(
    clock: FakeClock, core: SchedulerCore
) -> None:
    clock.advance(60.0)
    core.report_rate_limited(KEY, 20.0, {})
    core.submit_turn(turn(clock, tokens=100))
    assert core.tick() == []
    assert core.next_wakeup() == pytest.approx(clock.now() + 20.0)
    clock.advance(20.0)
    assert len(admitted(core.tick())) == 1
    assert core.snapshot().lanes[KEY].rate_limited == 1


def test_sandbox_reserve_through_the_core(clock: FakeClock, core: SchedulerCore) -> None:
    # Given a pool of 2 with 1 reserved: a batch call holds the unreserved one, another batch call waits
    b1 = core.submit_sandbox("tb1", "default", "batch", clock.wall() + 60)
    b2 = core.submit_sandbox("tb2", "default", "batch", clock.wall() + 60)
    first = core.tick()
    assert [d.ticket for d in first if isinstance(d, PermitGranted)] == [b1]
    # When an interactive call arrives, Then it gets the reserved sandbox at once
    i1 = core.submit_sandbox("ti", "default", "interactive", clock.wall() + 60)
    [granted] = core.tick()
    assert isinstance(granted, PermitGranted) and granted.ticket == i1
    # When the batch holder releases, Then the waiting batch call gets its sandbox
    permit = next(d.permit for d in first if isinstance(d, PermitGranted))
    assert core.release_sandbox(permit.permit_id) is True
    assert [d.ticket for d in core.tick()] == [b2]
    assert core.release_sandbox(permit.permit_id) is False
    with pytest.raises(SchedulerInputError):
        core.submit_sandbox("t", "gpu", "batch", clock.wall() + 60)


def test_expired_leases_are_reclaimed(clock: FakeClock, core: SchedulerCore) -> None:
    # Given a batch call holding the only unreserved sandbox and another waiting
    core.submit_sandbox("stuck", "default", "batch", clock.wall() + 10_000)
    core.tick()
    waiting = core.submit_sandbox("next", "default", "batch", clock.wall() + 10_000)
    assert core.tick() == []
    # When the holder never releases, Then at lease expiry its sandbox goes to the waiter
    clock.advance(CONFIG.sandbox_lease_s)
    assert [d.ticket for d in core.tick()] == [waiting]
    assert core.snapshot().permits == 1


def test_reclaim_drops_leases_and_requests_of_dead_holders(clock: FakeClock, core: SchedulerCore) -> None:
    clock.advance(10.0)
    core.submit_turn(turn(clock, tokens=1_000, trajectory="dead"))
    core.submit_sandbox("dead", "default", "batch", clock.wall() + 60)
    core.tick()
    queued = core.submit_turn(turn(clock, tokens=50_000, trajectory="dead"))
    reclaimed = core.reclaim(lambda trajectory_id: trajectory_id != "dead")
    assert len(reclaimed) == 2
    [refusal] = core.tick()
    assert isinstance(refusal, Refused) and (refusal.ticket, refusal.predicate) == (
        queued,
        Predicate.HOLDER_GONE,
    )
    snap = core.snapshot()
    assert (snap.grants, snap.permits, snap.pending, snap.pools["default"].in_use) == (0, 0, 0, 0)


def test_cancel_withdraws_a_waiting_request(clock: FakeClock, core: SchedulerCore) -> None:
    ticket = core.submit_turn(turn(clock, tokens=5_000))
    assert core.cancel(ticket) is True
    assert core.cancel(ticket) is False
    clock.advance(10.0)
    assert core.tick() == []
    assert core.next_wakeup() is None


@settings(max_examples=100, deadline=None)
@given(
    arrivals=st.lists(
        st.tuples(
            st.floats(0.0, 4.0),
            st.sampled_from(["interactive", "standard", "batch"]),
            st.integers(1, 30_000),
            st.floats(0.0, 1.0),
        ),
        min_size=1,
        max_size=60,
    )
)
def test_admitted_tokens_never_exceed_capacity_in_any_window(
    arrivals: list[tuple[float, str, int, float]],
) -> None:
    """Random arrival times, classes and turn sizes, each settled on admission with a random fraction of
    its reservation. Over any window [a, b] shorter than a minute the tokens used by turns admitted in it
    are at most the capacity (the provider counts per minute over a sliding window); over any window,
    at most capacity + rate * (b - a); and from the cold start at most rate * (b - start)."""
    clock = FakeClock()
    core = SchedulerCore(CONFIG, clock, id_prefix="prop")
    start, rate, capacity = clock.now(), 1_000.0, 60_000.0
    used_by_ticket: dict[int, int] = {}
    admissions: list[tuple[float, int]] = []

    def drain() -> None:
        for decision in admitted(core.tick()):
            used = used_by_ticket[decision.ticket]
            core.settle_turn(decision.grant.grant_id, used)
            admissions.append((clock.now(), used))

    for gap, cls, tokens, fraction in arrivals:
        clock.advance(gap)
        drain()
        ticket = core.submit_turn(turn(clock, cls, tokens))
        used_by_ticket[ticket] = int(tokens * fraction)
        drain()
    while (wake := core.next_wakeup()) is not None:
        clock.advance(max(0.0, wake - clock.now()))
        drain()
    assert len(admissions) == len(arrivals)
    for i, (a, _) in enumerate(admissions):
        total = 0
        for b, used in admissions[i:]:
            total += used
            assert total <= capacity + rate * (b - a) + 1e-6
            if b - a < 60.0:
                assert total <= capacity + 1e-6
    running = 0
    for b, used in admissions:
        running += used
        assert running <= rate * (b - start) + 1e-6


class RecordingMetrics:
    def __init__(self) -> None:
        self.events: list[tuple[str, ...]] = []

    def bucket_level(self, provider_key: str, resource: str, level: float, capacity: float) -> None:
        self.events.append(("level", resource))

    def admission_wait(self, priority_class: str, seconds: float) -> None:
        self.events.append(("wait", priority_class, f"{seconds:.1f}"))

    def rate_limited(self, provider_key: str) -> None:
        self.events.append(("429", provider_key))

    def delay_margin(self, provider_key: str, seconds: float) -> None:
        self.events.append(("margin", f"{seconds:.1f}"))

    def refused(self, kind: str, priority_class: str, predicate: str) -> None:
        self.events.append(("refused", kind, priority_class, predicate))


def test_metrics_hooks_see_waits_429s_levels_and_refusals(clock: FakeClock) -> None:
    metrics = RecordingMetrics()
    core = SchedulerCore(CONFIG, clock, metrics=metrics)
    core.submit_turn(turn(clock, "interactive", tokens=2_000))
    core.submit_turn(turn(clock, "batch", tokens=10, deadline_in=0.0))
    clock.advance(2.0)
    core.tick()
    core.report_rate_limited(KEY, 1.0, {})
    assert ("wait", "interactive", "2.0") in metrics.events
    assert ("refused", "turn", "batch", "deadline") in metrics.events
    assert ("429", KEY) in metrics.events
    assert {("level", "tokens"), ("level", "requests")} <= set(metrics.events)


def test_queueing_is_bounded_by_the_requests_deadline_not_a_per_call_span(clock: FakeClock) -> None:
    # Given a key allowing 1 request a minute, already used, and a turn whose trajectory has 240 s left
    limits = ProviderLimits(tokens_per_minute=60_000, requests_per_minute=1, headroom=0.0)
    core = SchedulerCore(SchedulerConfig(providers={KEY: limits}), clock, id_prefix="q")
    clock.advance(60.0)
    core.submit_turn(turn(clock, tokens=10))
    assert admitted(core.tick())
    ticket = core.submit_turn(turn(clock, tokens=10, deadline_in=240.0))
    # When it waits well past any per-call deadline (30 s) for the minute to pass
    clock.advance(45.0)
    assert core.tick() == []
    clock.advance(15.0)
    # Then it is admitted, not refused: its bound is the trajectory's deadline
    [decision] = core.tick()
    assert isinstance(decision, Admitted) and decision.ticket == ticket
    assert decision.waited_s == pytest.approx(60.0)


def test_a_turn_is_refused_for_its_deadline_only_when_the_deadline_passes(clock: FakeClock) -> None:
    # Given a key paused by a 429 whose retry hint outlasts the turn's deadline
    core = SchedulerCore(CONFIG, clock, id_prefix="d")
    clock.advance(60.0)
    core.report_rate_limited(KEY, 600.0, {})
    ticket = core.submit_turn(turn(clock, tokens=10, deadline_in=120.0))
    # When time runs up to just before the deadline, Then nothing is decided early
    clock.advance(119.9)
    assert core.tick() == []
    # And at the deadline it is refused with predicate "deadline", naming what it waited for
    clock.advance(0.1)
    [decision] = core.tick()
    assert isinstance(decision, Refused) and decision.ticket == ticket
    assert (decision.predicate, decision.message) == (
        Predicate.DEADLINE,
        "deadline passed while waiting for turn",
    )


def test_a_queued_turn_larger_than_a_newly_learned_limit_is_refused_not_left_blocking(
    clock: FakeClock,
) -> None:
    # Given a 50k-token turn queued on a key configured for 60k tokens a minute, and a small one behind it
    core = SchedulerCore(CONFIG, clock, id_prefix="l")
    big = core.submit_turn(turn(clock, tokens=50_000))
    small = core.submit_turn(turn(clock, tokens=100))
    # When the provider states its real token limit is 10k a minute
    core.report_limits(KEY, RateLimitInfo(limit_tokens=10_000), rate_limited=False)
    clock.advance(60.0)
    decisions = core.tick()
    # Then the big turn is refused as one that can never fit, and the small one behind it goes
    refused = [d for d in decisions if isinstance(d, Refused)]
    assert [(d.ticket, d.predicate) for d in refused] == [(big, Predicate.EXCEEDS_CAPACITY)]
    assert [d.ticket for d in admitted(decisions)] == [small]
