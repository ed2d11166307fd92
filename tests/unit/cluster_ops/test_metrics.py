"""The metrics plugin: the recording API against the in-memory backend, label checks, and the exposition."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from cluster.metrics import (
    METRICS,
    BreakerStateValue,
    InMemoryBackend,
    Kind,
    Metrics,
    NoopBackend,
    PrometheusBackend,
    current,
    install,
)
from runtime.errors import InputError

Call = Callable[[Metrics], None]


@pytest.mark.parametrize(
    ("call", "name", "labels", "value"),
    [
        (lambda m: m.guard_fired("loop_detector"), "tether_guard_fired", {"guard": "loop_detector"}, 1.0),
        (lambda m: m.budget_exhausted("tokens"), "tether_budget_exhausted", {"dimension": "tokens"}, 1.0),
        (lambda m: m.escalated("policy"), "tether_escalations", {"trigger": "policy"}, 1.0),
        (
            lambda m: m.trajectory_finished("partial", 7),
            "tether_trajectories_finished",
            {"outcome": "partial"},
            1.0,
        ),
        (lambda m: m.step_attempted(), "tether_step_attempts", {}, 1.0),
        (lambda m: m.step_completed(), "tether_steps_completed", {}, 1.0),
        (lambda m: m.duplicate_effect("payments"), "tether_duplicate_effects", {"tool": "payments"}, 1.0),
        (
            lambda m: m.bucket_level("sim/tokens", 0.25),
            "tether_scheduler_bucket_level",
            {"bucket": "sim/tokens"},
            0.25,
        ),
        (lambda m: m.rate_limited("sim"), "tether_provider_429", {"provider": "sim"}, 1.0),
        (
            lambda m: m.delay_margin("sim", 12.5),
            "tether_scheduler_delay_margin_seconds",
            {"provider": "sim"},
            12.5,
        ),
        (lambda m: m.breaker_state("search", "half_open"), "tether_breaker_state", {"scope": "search"}, 1.0),
        (lambda m: m.breaker_tripped("search"), "tether_breaker_trips", {"scope": "search"}, 1.0),
        (
            lambda m: m.breaker_probed("search", "success"),
            "tether_breaker_probes",
            {"scope": "search", "outcome": "success"},
            1.0,
        ),
        (lambda m: m.trajectories_in_state("RUNNING", 4), "tether_trajectories", {"state": "RUNNING"}, 4.0),
    ],
)
def test_each_signal_lands_on_its_metric_with_its_labels(
    call: Call, name: str, labels: dict[str, str], value: float
) -> None:
    # Given: metrics over the in-memory backend
    backend = InMemoryBackend()

    # When: one signal is recorded
    call(Metrics(backend))

    # Then: exactly that metric moved, by that amount, under those labels
    assert backend.value(name, **labels) == value


@pytest.mark.parametrize(
    ("call", "name", "labels", "observed"),
    [
        (lambda m: m.trajectory_finished("completed", 12), "tether_steps_to_completion", {}, [12.0]),
        (
            lambda m: m.admission_waited("batch", 1.5),
            "tether_admission_wait_seconds",
            {"priority_class": "batch"},
            [1.5],
        ),
        (
            lambda m: m.control_latency("pause", 0.02),
            "tether_control_latency_seconds",
            {"kind": "pause"},
            [0.02],
        ),
        (lambda m: m.prompt_reserved(300, 200), "tether_prompt_reservation_ratio", {}, [1.5]),
    ],
)
def test_histograms_keep_each_observation(
    call: Call, name: str, labels: dict[str, str], observed: list[float]
) -> None:
    backend = InMemoryBackend()

    call(Metrics(backend))

    assert backend.observations[(name, tuple(sorted(labels.items())))] == observed


@pytest.mark.parametrize(
    ("call", "fragment"),
    [
        (lambda m: m.guard_fired(""), "must not be empty"),
        (lambda m: m.bucket_level("b", 1.5), r"\[0, 1\]"),
        (lambda m: m.trajectories_in_state("RUNNING", -1), ">= 0"),
        (lambda m: m.admission_waited("batch", -0.1), ">= 0"),
        (lambda m: m.prompt_reserved(300, 0), "counted > 0"),
        (lambda m: m.breaker_state("s", "ajar"), "ajar"),
    ],
)
def test_bad_values_are_refused_with_the_metric_named(call: Call, fragment: str) -> None:
    with pytest.raises((InputError, ValueError), match=fragment):
        call(Metrics(InMemoryBackend()))


@pytest.mark.parametrize(("state", "code"), [("closed", 0), ("half_open", 1), ("open", 2)])
def test_breaker_state_codes(state: str, code: int) -> None:
    assert BreakerStateValue(state).code == code


def test_the_default_plugin_records_nothing_and_is_replaceable() -> None:
    # Given: nothing installed in this process (the default is the no-op)
    previous = current()
    try:
        install(Metrics())
        assert isinstance(current().backend, NoopBackend)
        current().guard_fired("loop")  # accepted, goes nowhere

        # When: a backend is installed
        backend = InMemoryBackend()
        install(Metrics(backend))
        current().guard_fired("loop")

        # Then: recording through current() reaches it
        assert backend.value("tether_guard_fired", guard="loop") == 1.0
    finally:
        install(previous)


@given(st.lists(st.sampled_from(["loop", "schema", "budget"]), max_size=30))
def test_prometheus_exposition_counts_every_firing(guards: list[str]) -> None:
    # Given: a Prometheus backend with its own registry
    backend = PrometheusBackend()
    metrics = Metrics(backend)

    # When: guards fire
    for guard in guards:
        metrics.guard_fired(guard)

    # Then: the exposition, parsed back, has one sample per guard with its count
    samples = {
        s.labels["guard"]: s.value
        for family in text_string_to_metric_families(backend.exposition())
        for s in family.samples
        if s.name == "tether_guard_fired_total"
    }
    assert samples == {g: float(guards.count(g)) for g in set(guards)}


def test_backends_never_touch_the_global_prometheus_registry() -> None:
    backend = PrometheusBackend()
    Metrics(backend).guard_fired("loop")

    assert REGISTRY.get_sample_value("tether_guard_fired_total", {"guard": "loop"}) is None


def test_metric_table_names_and_kinds_are_prometheus_conventional() -> None:
    for spec in METRICS.values():
        assert spec.name.startswith("tether_")
        assert not spec.name.endswith("_total"), "counters get _total on export"
        if spec.kind is Kind.HISTOGRAM:
            assert list(spec.buckets) == sorted(spec.buckets) and spec.buckets
