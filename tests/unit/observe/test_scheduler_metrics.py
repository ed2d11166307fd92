"""The scheduler's hooks adapted to Metrics: bucket fraction, waits by class, 429s, refusals; picklable."""

from __future__ import annotations

import pickle

import pytest

from runtime.clock import FakeClock
from runtime.metrics import InMemoryBackend, Metrics
from runtime.ports import RateLimitInfo, TurnRequest
from scheduler.config import ProviderLimits, SchedulerConfig
from scheduler.core import Admitted, SchedulerCore
from scheduler.hooks import SchedulerMetrics
from scheduler.observe import MetricsAdapter

KEY = "http://provider/v1|model-a"
CONFIG = SchedulerConfig(
    providers={KEY: ProviderLimits(tokens_per_minute=60_000, requests_per_minute=6_000, headroom=0.0)}
)


def test_adapter_is_a_scheduler_metrics_hook() -> None:
    assert isinstance(MetricsAdapter(Metrics()), SchedulerMetrics)


def test_a_scheduler_run_lands_on_tether_metrics() -> None:
    # Given a scheduler core recording through the adapter
    clock, backend = FakeClock(), InMemoryBackend()
    core = SchedulerCore(CONFIG, clock, metrics=MetricsAdapter(Metrics(backend)))
    # When an interactive turn waits 2 s for refill, a batch turn arrives already past its deadline, and
    # the provider answers 429 once
    core.submit_turn(TurnRequest("t1", "interactive", KEY, 2_000, clock.wall() + 3_600))
    core.submit_turn(TurnRequest("t2", "batch", KEY, 10, clock.wall()))
    clock.advance(2.0)
    core.tick()
    core.report_rate_limited(KEY, 1.0, {})
    # Then the wait is observed under its class, the refusal under its predicate, the 429 under the key
    assert backend.observations[("tether_admission_wait_seconds", (("priority_class", "interactive"),))] == [
        pytest.approx(2.0)
    ]
    assert (
        backend.value("tether_admission_refused", kind="turn", priority_class="batch", predicate="deadline")
        == 1
    )
    assert backend.value("tether_provider_429", provider=KEY) == 1.0
    # and both buckets report a fill fraction within [0, 1]
    levels = [
        backend.value("tether_scheduler_bucket_level", bucket=f"{KEY}/{r}") for r in ("tokens", "requests")
    ]
    assert all(0.0 <= level <= 1.0 for level in levels)
    assert ("tether_scheduler_bucket_level", (("bucket", f"{KEY}/tokens"),)) in backend.gauges


@pytest.mark.parametrize(
    ("level", "capacity", "fraction"), [(50, 100, 0.5), (-5, 100, 0.0), (150, 100, 1.0), (3, 0, 0.0)]
)
def test_bucket_level_is_a_clamped_fraction(level: float, capacity: float, fraction: float) -> None:
    backend = InMemoryBackend()
    MetricsAdapter(Metrics(backend)).bucket_level("p", "tokens", level, capacity)
    assert backend.value("tether_scheduler_bucket_level", bucket="p/tokens") == fraction


def test_a_factory_built_adapter_pickles_without_its_backend_and_rebuilds_it() -> None:
    # Given an adapter built from a backend factory, already used once here
    adapter = MetricsAdapter(InMemoryBackend)
    adapter.rate_limited("p")
    # When it crosses a process boundary (pickled, as Ray sends actor arguments)
    copy = pickle.loads(pickle.dumps(adapter))
    copy.rate_limited("p")
    # Then the copy built its own, fresh backend: the sender's values did not travel
    backend = copy.metrics.backend
    assert isinstance(backend, InMemoryBackend)
    assert backend.value("tether_provider_429", provider="p") == 1.0


def test_a_dated_429_sets_the_keys_delay_margin_gauge() -> None:
    # Given a turn admitted, then answered 429 three seconds later, reported with its grant
    clock, backend = FakeClock(), InMemoryBackend()
    core = SchedulerCore(CONFIG, clock, metrics=MetricsAdapter(Metrics(backend)))
    clock.advance(1.0)
    core.submit_turn(TurnRequest("t1", "standard", KEY, 10, clock.wall() + 3_600))
    [admitted] = core.tick()
    assert isinstance(admitted, Admitted)
    clock.advance(3.0)
    core.report_limits(
        KEY, RateLimitInfo(retry_after_s=1.0), rate_limited=True, grant_id=admitted.grant.grant_id
    )
    # Then the gauge shows the margin the key's ledgers now count with
    assert backend.value("tether_scheduler_delay_margin_seconds", provider=KEY) == pytest.approx(3.0)
