"""Scoped breaker: equation 7, generation fencing, probe cooldown backoff (recovery chapter §12.7.1)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from breakers.breaker import Breaker, BreakerPolicy, BreakerState, BreakerTicket, RecordEffect, should_trip
from runtime.clock import FakeClock
from runtime.errors import BreakerOpen
from runtime.ports import OutcomeClass

F = OutcomeClass.INFRASTRUCTURE_FAILURE
R = OutcomeClass.CLIENT_REJECTION
S = OutcomeClass.SUCCESS

# Exercise 4: policy of the test-service breaker.
EX4 = BreakerPolicy(window_size=50, min_samples=20, trip_threshold=0.5, cooldown_s=5.0, max_cooldown_s=80.0)


def _feed(breaker: Breaker, outcomes: list[OutcomeClass]) -> list[RecordEffect]:
    """Dispatch and record each outcome in turn; stops once the breaker withholds calls."""
    effects = []
    for outcome in outcomes:
        if breaker.withholding() is not None:
            break
        ticket = breaker.admit()
        effects.append(breaker.record(ticket, outcome))
    return effects


def _tripped(policy: BreakerPolicy = EX4) -> tuple[FakeClock, Breaker]:
    clock = FakeClock()
    breaker = Breaker("test-service", policy, clock)
    _feed(breaker, [F] * policy.min_samples)
    assert breaker.state is BreakerState.OPEN
    return clock, breaker


# ----------------------------------------------------------------------------- exercise 4 (a), (b)

# 14 transport timeouts + 6 server errors are infrastructure failures; 12 validation rejections and 3
# authorization denials returned by the endpoint are client rejections; 15 successes.
EX4_WINDOW = {"timeouts": 14, "server_errors": 6, "validation": 12, "authorization": 3, "successes": 15}


@pytest.mark.parametrize(
    ("classification", "failures", "fraction", "opens"),
    [
        ("chapter: endpoint rejections are non-failures", 14 + 6, 0.4, False),
        ("naive: everything but success is a failure", 14 + 6 + 12 + 3, 0.7, True),
    ],
)
def test_exercise_4_failure_fraction_and_trip_decision(
    classification: str, failures: int, fraction: float, opens: bool
) -> None:
    # Given the exercise-4 window of 50 classified outcomes
    size = sum(EX4_WINDOW.values())
    # When equation 7 is applied under each classification
    # Then the fraction and the decision are the chapter's
    assert size == 50
    assert failures / size == pytest.approx(fraction)
    assert should_trip(size, failures, EX4) is opens, classification


def test_exercise_4_window_fed_through_the_breaker_stays_closed_at_0_4() -> None:
    # Given a test-service breaker with the exercise-4 policy
    clock = FakeClock()
    breaker = Breaker("test-service", EX4, clock)
    # When the 50 outcomes arrive (non-failures first, so every prefix has a lower failure fraction)
    outcomes = [S] * 15 + [R] * (12 + 3) + [F] * (14 + 6)
    effects = _feed(breaker, outcomes)
    # Then the window holds all 50 with a failure fraction of 0.4, and the breaker never opened
    assert breaker.window_counts() == (50, 20)
    assert breaker.failure_fraction() == pytest.approx(0.4)
    assert breaker.state is BreakerState.CLOSED
    assert RecordEffect.TRIPPED not in effects


def test_exercise_4_naive_classification_opens_the_breaker() -> None:
    # Given the same traffic, classified so that every non-success counts as a failure
    clock = FakeClock()
    breaker = Breaker("test-service", EX4, clock)
    # When it arrives
    effects = _feed(breaker, [S] * 15 + [F] * 35)
    # Then the breaker opens: the malformed trajectory's rejections lock out every tenant
    assert breaker.state is BreakerState.OPEN
    assert RecordEffect.TRIPPED in effects


# ----------------------------------------------------------------------------- exercise 4 (c)


def _probes_within(policy: BreakerPolicy, horizon_s: float, probe_timeout_s: float) -> int:
    """Sustained outage after a trip at t=0: each probe resolves by timeout, the next cooldown starts
    when it resolves. Counts probes sent at or before ``horizon_s``."""
    clock, breaker = _tripped(policy)
    tripped_at = clock.now()
    sent = 0
    while True:
        clock.advance(breaker.remaining_cooldown())
        if clock.now() - tripped_at > horizon_s:
            return sent
        ticket = breaker.admit()
        assert ticket.probe
        sent += 1
        clock.advance(probe_timeout_s)
        assert breaker.record(ticket, F) is RecordEffect.REOPENED


@pytest.mark.parametrize(
    ("multiplier", "expected_probes"),
    [
        # probes at 5, 17, 39, 81, 163, 245, 327, 409, 491, 573 s (cooldowns 5, 10, 20, 40, then 80 s)
        (2.0, 10),
        # probes at 5 + 7k s for k = 0..85 (the 86th lands exactly at 600 s)
        (1.0, 86),
    ],
)
def test_exercise_4c_probe_count_over_600s(multiplier: float, expected_probes: int) -> None:
    # Given the exercise-4 cooldown policy (5 s first cooldown, 80 s cap), doubling or fixed
    policy = EX4.model_copy(update={"cooldown_multiplier": multiplier})
    # When the dependency stays down for 600 s and every probe times out after 2 s
    # Then the probe count matches the chapter's arithmetic
    assert _probes_within(policy, horizon_s=600.0, probe_timeout_s=2.0) == expected_probes


def test_cooldown_doubles_up_to_the_cap_and_resets_on_close() -> None:
    # Given a tripped breaker
    clock, breaker = _tripped()
    cooldowns = []
    # When five probes in a row fail
    for _ in range(5):
        cooldowns.append(breaker.cooldown_s)
        clock.advance(breaker.remaining_cooldown())
        breaker.record(breaker.admit(), F)
    cooldowns.append(breaker.cooldown_s)
    # Then the cooldown doubled and stuck at the cap
    assert cooldowns == [5.0, 10.0, 20.0, 40.0, 80.0, 80.0]
    # And a successful probe closes the breaker; the cooldown resets once regular traffic is back
    clock.advance(breaker.remaining_cooldown())
    assert breaker.record(breaker.admit(), S) is RecordEffect.CLOSED
    assert (breaker.state, breaker.cooldown_s, breaker.restoring) == (BreakerState.CLOSED, 80.0, True)
    clock.advance(EX4.restore_s)
    assert (breaker.state, breaker.cooldown_s, breaker.restoring) == (BreakerState.CLOSED, 5.0, False)


# ----------------------------------------------------------------------------- gradual restore (§12.7.1)


def _closed_after_probes(policy: BreakerPolicy, failed_probes: int) -> tuple[FakeClock, Breaker]:
    """A breaker that tripped, failed ``failed_probes`` probes, then closed on a successful one."""
    clock, breaker = _tripped(policy)
    for _ in range(failed_probes):
        clock.advance(breaker.remaining_cooldown())
        assert breaker.record(breaker.admit(), F) is RecordEffect.REOPENED
    clock.advance(breaker.remaining_cooldown())
    assert breaker.record(breaker.admit(), S) is RecordEffect.CLOSED
    return clock, breaker


def test_a_successful_probe_restores_regular_traffic_gradually() -> None:
    # Given a scope that just closed on a successful probe (restore over 10 s from a tenth of the traffic)
    clock, breaker = _closed_after_probes(EX4, failed_probes=0)
    shares = []
    # When the restore runs its course
    for _ in range(6):
        shares.append(round(breaker.admission_share(), 3))
        clock.advance(2.5)
    # Then the admitted share grows linearly from the start share to all of it, and stays there
    assert shares == [0.1, 0.325, 0.55, 0.775, 1.0, 1.0]
    # And the gate admits throughout: the restore scales concurrency, it refuses nobody itself
    assert breaker.withholding() is None


def test_a_breaker_that_never_tripped_admits_all_of_its_traffic() -> None:
    breaker = Breaker("test-service", EX4, FakeClock())
    assert (breaker.admission_share(), breaker.restoring) == (1.0, False)


def test_restore_s_zero_restores_all_traffic_at_the_close() -> None:
    # Given the restore switched off
    policy = EX4.model_copy(update={"restore_s": 0.0})
    # When a probe after one failed probe succeeds
    _, breaker = _closed_after_probes(policy, failed_probes=1)
    # Then everything is admitted at once and the cooldown is back to its base
    assert (breaker.admission_share(), breaker.restoring, breaker.cooldown_s) == (1.0, False, 5.0)


@pytest.mark.parametrize(
    ("trip_after_s", "cooldown_after_trip"),
    [
        (4.0, 20.0),  # during the restore: the same outage's next failed trial (10 s lengthened)
        (10.0, 5.0),  # after it: a fresh outage, the base cooldown
    ],
)
def test_a_trip_during_the_restore_lengthens_the_cooldown(
    trip_after_s: float, cooldown_after_trip: float
) -> None:
    # Given a scope that closed after one failed probe (its cooldown had grown to 10 s)
    clock, breaker = _closed_after_probes(EX4, failed_probes=1)
    # When the window fills with failures some seconds after the close
    clock.advance(trip_after_s)
    effects = _feed(breaker, [F] * EX4.min_samples)
    # Then it trips, and the next cooldown depends on whether regular traffic had been restored
    assert effects[-1] is RecordEffect.TRIPPED
    assert (breaker.state, breaker.cooldown_s) == (BreakerState.OPEN, cooldown_after_trip)
    assert breaker.admission_share() == 1.0  # nothing left of the restore: the gate withholds instead


# ----------------------------------------------------------------------------- gate behaviour


def test_minimum_sample_count_prevents_an_early_trip() -> None:
    # Given a breaker needing 20 samples
    clock = FakeClock()
    breaker = Breaker("test-service", EX4, clock)
    # When 19 calls all fail
    _feed(breaker, [F] * 19)
    # Then it is still closed; the 20th failure trips it
    assert breaker.state is BreakerState.CLOSED
    assert _feed(breaker, [F]) == [RecordEffect.TRIPPED]


def test_open_breaker_withholds_with_scope_and_cooldown() -> None:
    # Given a breaker that just tripped
    clock, breaker = _tripped()
    clock.advance(2.0)
    # When a call asks for admission
    with pytest.raises(BreakerOpen) as refused:
        breaker.admit()
    # Then the refusal names the scope and the remaining cooldown
    assert refused.value.scope == "test-service"
    assert refused.value.cooldown_s == pytest.approx(3.0)
    assert refused.value.retry_after == pytest.approx(3.0)


def test_only_one_probe_is_claimed_after_the_cooldown() -> None:
    # Given a tripped breaker whose cooldown has passed
    clock, breaker = _tripped()
    clock.advance(5.0)
    # When 50 callers ask one after another (the guard serialises them)
    granted, refused = [], 0
    for _ in range(50):
        try:
            granted.append(breaker.admit())
        except BreakerOpen:
            refused += 1
    # Then exactly one got the probe permit
    assert [t.probe for t in granted] == [True]
    assert (refused, breaker.state, breaker.probes_claimed) == (49, BreakerState.HALF_OPEN, 1)


def test_half_open_refusal_quotes_the_base_cooldown_not_the_lengthened_one() -> None:
    # Given a breaker whose cooldown has been lengthened to 20 s and whose next probe is out
    clock, breaker = _tripped()
    for _ in range(2):
        clock.advance(breaker.remaining_cooldown())
        breaker.record(breaker.admit(), F)
    clock.advance(breaker.remaining_cooldown())
    breaker.admit()
    # When another caller asks while the probe is in flight
    with pytest.raises(BreakerOpen) as refused:
        breaker.admit()
    # Then it is told to come back after the base cooldown: a successful probe reopens traffic at once
    assert (breaker.cooldown_s, refused.value.cooldown_s) == (20.0, 5.0)


def test_late_old_generation_success_does_not_close_a_reopened_breaker() -> None:
    # Given a probe that timed out (recorded as a failure: the breaker reopened with a new generation)
    clock, breaker = _tripped()
    clock.advance(5.0)
    timed_out_probe = breaker.admit()
    breaker.record(timed_out_probe, F)
    assert breaker.generation == timed_out_probe.generation + 1
    # When the timed-out probe's success arrives late
    effect = breaker.record(timed_out_probe, S)
    # Then it is stale: the breaker stays open, generation unchanged
    assert effect is RecordEffect.STALE
    assert (breaker.state, breaker.generation) == (BreakerState.OPEN, timed_out_probe.generation + 1)


def test_late_result_cannot_usurp_a_newer_probe() -> None:
    # Given a reopened breaker whose next probe is in flight
    clock, breaker = _tripped()
    clock.advance(5.0)
    first = breaker.admit()
    breaker.record(first, F)
    clock.advance(10.0)
    second = breaker.admit()
    # When the first probe's late success arrives
    assert breaker.record(first, S) is RecordEffect.STALE
    # Then the newer trial still owns the slot and decides
    assert breaker.state is BreakerState.HALF_OPEN
    assert breaker.record(second, S) is RecordEffect.CLOSED


def test_calls_admitted_before_a_trip_do_not_count_afterwards() -> None:
    # Given a call dispatched while closed, then a trip
    clock = FakeClock()
    breaker = Breaker("test-service", EX4, clock)
    in_flight = breaker.admit()
    _feed(breaker, [F] * 20)
    # When the old call fails after the trip
    # Then it changes nothing (it settles its own operation only)
    assert breaker.record(in_flight, F) is RecordEffect.STALE


def test_client_rejection_probe_closes_the_breaker() -> None:
    # Given a half-open breaker
    clock, breaker = _tripped()
    clock.advance(5.0)
    probe = breaker.admit()
    # When the endpoint answers the probe with a domain rejection
    # Then the endpoint handled the request: the breaker closes
    assert breaker.record(probe, R) is RecordEffect.CLOSED


def test_abandoned_probe_reopens() -> None:
    # Given a half-open breaker whose probe holder vanished
    clock, breaker = _tripped()
    clock.advance(5.0)
    probe = breaker.admit()
    # When the probe is abandoned without an outcome
    # Then the breaker reopens with a longer cooldown rather than staying half-open forever
    assert breaker.abandon_probe(probe) is RecordEffect.REOPENED
    assert (breaker.state, breaker.cooldown_s) == (BreakerState.OPEN, 10.0)
    assert breaker.abandon_probe(BreakerTicket(breaker.generation, probe=False)) is RecordEffect.IGNORED


def test_outcomes_age_out_of_a_timed_window() -> None:
    # Given a window that forgets outcomes older than 60 s
    clock = FakeClock()
    breaker = Breaker("test-service", EX4.model_copy(update={"window_age_s": 60.0}), clock)
    _feed(breaker, [F] * 19)
    # When 61 s pass and one more failure arrives
    clock.advance(61.0)
    _feed(breaker, [F])
    # Then only the fresh failure is in the window and there is no trip
    assert breaker.window_counts() == (1, 1)
    assert breaker.state is BreakerState.CLOSED


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"window_size": 10, "min_samples": 20}, "min_samples"),
        ({"cooldown_s": 10.0, "max_cooldown_s": 5.0}, "max_cooldown_s"),
        ({"trip_threshold": 1.5}, "trip_threshold"),
        ({"cooldown_multiplier": 0.5}, "cooldown_multiplier"),
        ({"restore_s": -1.0}, "restore_s"),
        ({"restore_start_share": 0.0}, "restore_start_share"),
    ],
)
def test_inconsistent_policy_is_rejected_naming_the_field(fields: dict[str, float], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        BreakerPolicy(**fields)
