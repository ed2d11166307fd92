"""Breaker metrics: state per scope, trips and probe outcomes, recorded from the breaker's own transitions."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from breakers.breaker import Breaker, BreakerPolicy
from breakers.inprocess import InProcessGuard
from breakers.scope_guard import GuardPolicy
from runtime.clock import FakeClock
from runtime.metrics import InMemoryBackend, Metrics, MetricSpec
from runtime.ports import OutcomeClass

F = OutcomeClass.INFRASTRUCTURE_FAILURE
OK = OutcomeClass.SUCCESS
POLICY = BreakerPolicy(window_size=4, min_samples=4, trip_threshold=0.5, cooldown_s=5.0, max_cooldown_s=40.0)
SCOPE = "search/tenant-a"


def breaker() -> tuple[FakeClock, Breaker, InMemoryBackend]:
    clock, backend = FakeClock(), InMemoryBackend()
    return clock, Breaker(SCOPE, POLICY, clock, Metrics(backend)), backend


def trip(b: Breaker) -> None:
    for _ in range(POLICY.min_samples):
        b.record(b.admit(), F)


def state_code(backend: InMemoryBackend) -> float:
    return backend.value("tether_breaker_state", scope=SCOPE)


def probes(backend: InMemoryBackend) -> dict[str, float]:
    return {
        dict(labels)["outcome"]: v
        for (n, labels), v in backend.counters.items()
        if n == "tether_breaker_probes"
    }


def test_a_new_breaker_shows_its_scope_closed() -> None:
    _, _, backend = breaker()
    assert ("tether_breaker_state", (("scope", SCOPE),)) in backend.gauges
    assert state_code(backend) == 0.0


def test_a_trip_is_counted_once_and_the_state_shows_open() -> None:
    # Given a closed breaker
    _, b, backend = breaker()
    # When enough failures trip it
    trip(b)
    # Then one trip, state open (2), no probe yet
    assert backend.value("tether_breaker_trips", scope=SCOPE) == 1.0
    assert state_code(backend) == 2.0
    assert probes(backend) == {}


@pytest.mark.parametrize(
    ("probe_outcome", "end_state", "counted"),
    [(OK, 0.0, {"success": 1.0}), (F, 2.0, {"failure": 1.0})],
)
def test_a_probe_shows_half_open_then_counts_its_outcome(
    probe_outcome: OutcomeClass, end_state: float, counted: dict[str, float]
) -> None:
    # Given a tripped breaker whose cooldown has passed
    clock, b, backend = breaker()
    trip(b)
    clock.advance(POLICY.cooldown_s)
    # When the probe is admitted
    ticket = b.admit()
    # Then the state shows half-open
    assert state_code(backend) == 1.0
    # And when its outcome comes back, the probe is counted by outcome and the state follows
    b.record(ticket, probe_outcome)
    assert probes(backend) == counted
    assert state_code(backend) == end_state
    # and a failed probe is a reopening, not a second trip
    assert backend.value("tether_breaker_trips", scope=SCOPE) == 1.0


def test_an_abandoned_probe_is_counted_as_abandoned() -> None:
    clock, b, backend = breaker()
    trip(b)
    clock.advance(POLICY.cooldown_s)
    b.abandon_probe(b.admit())
    assert probes(backend) == {"abandoned": 1.0}
    assert state_code(backend) == 2.0


def test_stale_and_counted_outcomes_record_nothing_new() -> None:
    # Given a tripped breaker and a ticket from before the trip
    _, b, backend = breaker()
    old = b.admit()
    trip(b)
    before = dict(backend.counters), dict(backend.gauges)
    # When the stale outcome arrives
    b.record(old, F)
    # Then no metric moved
    assert (dict(backend.counters), dict(backend.gauges)) == before


class Broken(InMemoryBackend):
    def inc(self, spec: MetricSpec, labels: Mapping[str, str], amount: float) -> None:
        raise RuntimeError("exporter down")

    def set(self, spec: MetricSpec, labels: Mapping[str, str], value: float) -> None:
        raise RuntimeError("exporter down")


def test_a_broken_exporter_never_changes_a_breaker_decision() -> None:
    # Given two breakers fed the same outcomes, one with a backend that always raises
    clock = FakeClock()
    plain = Breaker(SCOPE, POLICY, clock)
    broken = Breaker(SCOPE, POLICY, clock, Metrics(Broken()))
    # When both trip and probe
    for b in (plain, broken):
        trip(b)
    clock.advance(POLICY.cooldown_s)
    effects = [b.record(b.admit(), OK) for b in (plain, broken)]
    # Then they decided identically
    assert effects[0] is effects[1]
    assert plain.state is broken.state


async def test_in_process_guard_records_per_scope() -> None:
    # Given one guard over two scopes sharing metrics
    clock, backend = FakeClock(), InMemoryBackend()
    guard = InProcessGuard(clock, GuardPolicy(breaker=POLICY), metrics=Metrics(backend))
    # When one scope's calls all fail and the other's succeed
    for i in range(POLICY.min_samples):
        for scope, outcome in (("a", F), ("b", OK)):
            permit = await guard.admit(scope, f"c{i}", clock.wall() + 60)
            await guard.record(permit, outcome)
            await guard.release(permit)
    # Then only the failing scope tripped and shows open
    assert backend.value("tether_breaker_trips", scope="a") == 1.0
    assert backend.value("tether_breaker_trips", scope="b") == 0.0
    assert (
        backend.value("tether_breaker_state", scope="a"),
        backend.value("tether_breaker_state", scope="b"),
    ) == (
        2.0,
        0.0,
    )
