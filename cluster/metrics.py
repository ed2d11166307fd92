"""Operator metrics: one table of what Tether reports, a typed recording API, and pluggable backends.

What is measured follows the reliability guide §12.5 ("signals worth watching": guard firing rate by guard,
budget exhaustion, escalations by trigger, partial completion rate, retry ratio, duplicate-effect rate, steps
to completion) plus the control plane: scheduler bucket level, admission wait by class, 429s received,
breaker state / trips / probes, control latency, trajectories by state. §12.5 asks for rates, not counts:
counters here are cumulative and the dashboard (cluster/grafana/tether.json) takes ``rate()`` of them.

The plugin is explicit and nothing happens at import time. :class:`Metrics` is the API code records through;
it writes to a backend:

* :class:`NoopBackend` (the default): records nothing.
* :class:`PrometheusBackend`: ``prometheus_client`` metrics in a private registry, served by
  :meth:`PrometheusBackend.serve` — for a process that exposes its own endpoint (the CLI driver).
* :class:`RayBackend`: ``ray.util.metrics`` objects, exported by each node's metrics agent — for code running
  inside Ray actors. Ray prefixes exported names with ``ray_`` (``ray_tether_guard_fired_total``).
* :class:`InMemoryBackend`: plain dicts, for tests and for reading values back.

``install()`` / ``current()`` hold the process-wide instance for code that is not handed one explicitly.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from runtime.errors import InputError

__all__ = [
    "METRICS",
    "BreakerStateValue",
    "InMemoryBackend",
    "Kind",
    "MetricSpec",
    "Metrics",
    "MetricsBackend",
    "NoopBackend",
    "PrometheusBackend",
    "RayBackend",
    "current",
    "install",
]


class Kind(StrEnum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


class BreakerStateValue(StrEnum):
    """Breaker states as exported: the gauge carries the numeric code so a graph shows transitions."""

    CLOSED = "closed"
    HALF_OPEN = "half_open"
    OPEN = "open"

    @property
    def code(self) -> int:
        return {"closed": 0, "half_open": 1, "open": 2}[self.value]


@dataclass(frozen=True)
class MetricSpec:
    """One metric: its base name (counters get ``_total`` on export), kind, labels and help text."""

    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()


_STEP_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0)
_WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
_CONTROL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

METRICS: dict[str, MetricSpec] = {
    spec.name: spec
    for spec in (
        # §12.5 signals
        MetricSpec("tether_guard_fired", Kind.COUNTER, "Guard firings, by guard.", ("guard",)),
        MetricSpec(
            "tether_budget_exhausted",
            Kind.COUNTER,
            "Budget exhaustions, by binding dimension.",
            ("dimension",),
        ),
        MetricSpec("tether_escalations", Kind.COUNTER, "Escalations to a person, by trigger.", ("trigger",)),
        MetricSpec(
            "tether_trajectories_finished",
            Kind.COUNTER,
            "Trajectories that reached a final outcome (completed, partial, failed, cancelled, killed).",
            ("outcome",),
        ),
        MetricSpec("tether_step_attempts", Kind.COUNTER, "Step attempts, first tries and retries."),
        MetricSpec(
            "tether_steps_completed", Kind.COUNTER, "Steps completed; attempts/completed is the retry ratio."
        ),
        MetricSpec(
            "tether_duplicate_effects",
            Kind.COUNTER,
            "External effects applied more than once; zero by construction.",
            ("tool",),
        ),
        MetricSpec(
            "tether_steps_to_completion",
            Kind.HISTOGRAM,
            "Steps a trajectory took to finish.",
            buckets=_STEP_BUCKETS,
        ),
        # scheduler
        MetricSpec(
            "tether_scheduler_bucket_level",
            Kind.GAUGE,
            "Token bucket fill, as a fraction of capacity.",
            ("bucket",),
        ),
        MetricSpec(
            "tether_admission_wait_seconds",
            Kind.HISTOGRAM,
            "Time from admission request to grant, by priority class.",
            ("priority_class",),
            _WAIT_BUCKETS,
        ),
        MetricSpec(
            "tether_provider_429", Kind.COUNTER, "HTTP 429 responses received, by provider.", ("provider",)
        ),
        # breakers
        MetricSpec(
            "tether_breaker_state",
            Kind.GAUGE,
            "Breaker state per scope: 0 closed, 1 half-open, 2 open.",
            ("scope",),
        ),
        MetricSpec("tether_breaker_trips", Kind.COUNTER, "Breaker trips to open, by scope.", ("scope",)),
        MetricSpec(
            "tether_breaker_probes",
            Kind.COUNTER,
            "Half-open probes, by scope and outcome.",
            ("scope", "outcome"),
        ),
        # control plane
        MetricSpec(
            "tether_control_latency_seconds",
            Kind.HISTOGRAM,
            "Time from a control message's publication to the trajectory recording it, by kind.",
            ("kind",),
            _CONTROL_BUCKETS,
        ),
        MetricSpec("tether_trajectories", Kind.GAUGE, "Live trajectories, by state.", ("state",)),
    )
}
"""Every metric Tether exports, by base name."""


class MetricsBackend(Protocol):
    """Where recorded values go. Called with a known spec and labels already checked against it."""

    def inc(self, spec: MetricSpec, labels: Mapping[str, str], amount: float) -> None: ...

    def set(self, spec: MetricSpec, labels: Mapping[str, str], value: float) -> None: ...

    def observe(self, spec: MetricSpec, labels: Mapping[str, str], value: float) -> None: ...


class NoopBackend:
    """Records nothing: the default, so code can always record without checking whether metrics are on."""

    def inc(self, spec: MetricSpec, labels: Mapping[str, str], amount: float) -> None:
        pass

    def set(self, spec: MetricSpec, labels: Mapping[str, str], value: float) -> None:
        pass

    def observe(self, spec: MetricSpec, labels: Mapping[str, str], value: float) -> None:
        pass


def _key(labels: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(labels.items()))


@dataclass
class InMemoryBackend:
    """Keeps values in dicts keyed by (name, sorted labels); histograms keep every observation."""

    counters: dict[tuple[str, tuple[tuple[str, str], ...]], float] = field(default_factory=dict)
    gauges: dict[tuple[str, tuple[tuple[str, str], ...]], float] = field(default_factory=dict)
    observations: dict[tuple[str, tuple[tuple[str, str], ...]], list[float]] = field(default_factory=dict)

    def inc(self, spec: MetricSpec, labels: Mapping[str, str], amount: float) -> None:
        key = (spec.name, _key(labels))
        self.counters[key] = self.counters.get(key, 0.0) + amount

    def set(self, spec: MetricSpec, labels: Mapping[str, str], value: float) -> None:
        self.gauges[(spec.name, _key(labels))] = value

    def observe(self, spec: MetricSpec, labels: Mapping[str, str], value: float) -> None:
        self.observations.setdefault((spec.name, _key(labels)), []).append(value)

    def value(self, name: str, **labels: str) -> float:
        """A counter's total or a gauge's value (0 when never recorded)."""
        key = (name, _key(labels))
        return self.counters.get(key, self.gauges.get(key, 0.0))


class PrometheusBackend:
    """``prometheus_client`` metrics in this backend's own registry (never the global default one)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry

        self.registry = CollectorRegistry(auto_describe=True)
        self._metrics: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._server: Any = None

    def _metric(self, spec: MetricSpec) -> Any:
        with self._lock:
            metric = self._metrics.get(spec.name)
            if metric is None:
                from prometheus_client import Counter, Gauge, Histogram

                common: dict[str, Any] = {"labelnames": spec.labels, "registry": self.registry}
                if spec.kind is Kind.COUNTER:
                    metric = Counter(spec.name, spec.help, **common)
                elif spec.kind is Kind.GAUGE:
                    metric = Gauge(spec.name, spec.help, **common)
                else:
                    metric = Histogram(spec.name, spec.help, buckets=spec.buckets, **common)
                self._metrics[spec.name] = metric
            return metric

    def _child(self, spec: MetricSpec, labels: Mapping[str, str]) -> Any:
        metric = self._metric(spec)
        return metric.labels(**labels) if spec.labels else metric

    def inc(self, spec: MetricSpec, labels: Mapping[str, str], amount: float) -> None:
        self._child(spec, labels).inc(amount)

    def set(self, spec: MetricSpec, labels: Mapping[str, str], value: float) -> None:
        self._child(spec, labels).set(value)

    def observe(self, spec: MetricSpec, labels: Mapping[str, str], value: float) -> None:
        self._child(spec, labels).observe(value)

    def serve(self, port: int, addr: str = "0.0.0.0") -> int:
        """Serve ``/metrics`` over HTTP on ``port`` (0 picks a free one); returns the bound port."""
        from prometheus_client import start_http_server

        if self._server is not None:
            raise RuntimeError("this backend is already serving")
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        self._server = server
        return int(server.server_address[1])

    def close(self) -> None:
        """Stop the HTTP server, if serving."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def exposition(self) -> str:
        """The current text exposition (what a scrape would return)."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()


class RayBackend:
    """``ray.util.metrics`` objects, created on first use inside the (connected) Ray worker or actor."""

    def __init__(self) -> None:
        self._metrics: dict[str, Any] = {}
        self._lock = threading.Lock()

    def _metric(self, spec: MetricSpec) -> Any:
        with self._lock:
            metric = self._metrics.get(spec.name)
            if metric is None:
                from ray.util import metrics as ray_metrics

                if spec.kind is Kind.COUNTER:
                    metric = ray_metrics.Counter(spec.name, spec.help, tag_keys=spec.labels)
                elif spec.kind is Kind.GAUGE:
                    metric = ray_metrics.Gauge(spec.name, spec.help, tag_keys=spec.labels)
                else:
                    metric = ray_metrics.Histogram(
                        spec.name, spec.help, boundaries=list(spec.buckets), tag_keys=spec.labels
                    )
                self._metrics[spec.name] = metric
            return metric

    def inc(self, spec: MetricSpec, labels: Mapping[str, str], amount: float) -> None:
        self._metric(spec).inc(amount, tags=dict(labels))

    def set(self, spec: MetricSpec, labels: Mapping[str, str], value: float) -> None:
        self._metric(spec).set(value, tags=dict(labels))

    def observe(self, spec: MetricSpec, labels: Mapping[str, str], value: float) -> None:
        self._metric(spec).observe(value, tags=dict(labels))


class Metrics:
    """The recording API: one method per signal, each checked against :data:`METRICS`."""

    def __init__(self, backend: MetricsBackend | None = None) -> None:
        self.backend: MetricsBackend = backend if backend is not None else NoopBackend()

    def _record(self, name: str, kind: Kind, value: float, labels: Mapping[str, str] | None = None) -> None:
        labels = labels or {}
        spec = METRICS[name]
        if spec.kind is not kind:  # pragma: no cover - guards the table against a typo in this class
            raise AssertionError(f"{name} is a {spec.kind}, not a {kind}")
        if set(labels) != set(spec.labels):
            raise InputError(f"metric {name}: labels {sorted(labels)} do not match {sorted(spec.labels)}")
        for label, label_value in labels.items():
            if not label_value:
                raise InputError(f"metric {name}: label {label} must not be empty")
        if kind is Kind.COUNTER:
            if value < 0:
                raise InputError(f"metric {name}: a counter cannot go down (got {value})")
            self.backend.inc(spec, labels, value)
        elif kind is Kind.GAUGE:
            self.backend.set(spec, labels, value)
        else:
            if value < 0:
                raise InputError(f"metric {name}: observed value must be >= 0 (got {value})")
            self.backend.observe(spec, labels, value)

    # §12.5 signals
    def guard_fired(self, guard: str) -> None:
        self._record("tether_guard_fired", Kind.COUNTER, 1, {"guard": guard})

    def budget_exhausted(self, dimension: str) -> None:
        self._record("tether_budget_exhausted", Kind.COUNTER, 1, {"dimension": dimension})

    def escalated(self, trigger: str) -> None:
        self._record("tether_escalations", Kind.COUNTER, 1, {"trigger": trigger})

    def trajectory_finished(self, outcome: str, steps: int) -> None:
        """A trajectory reached a final outcome after ``steps`` steps (partial completion is an outcome)."""
        self._record("tether_trajectories_finished", Kind.COUNTER, 1, {"outcome": outcome})
        self._record("tether_steps_to_completion", Kind.HISTOGRAM, steps)

    def step_attempted(self) -> None:
        self._record("tether_step_attempts", Kind.COUNTER, 1)

    def step_completed(self) -> None:
        self._record("tether_steps_completed", Kind.COUNTER, 1)

    def duplicate_effect(self, tool: str) -> None:
        self._record("tether_duplicate_effects", Kind.COUNTER, 1, {"tool": tool})

    # scheduler
    def bucket_level(self, bucket: str, fraction: float) -> None:
        if not 0.0 <= fraction <= 1.0:
            raise InputError(
                f"metric tether_scheduler_bucket_level: fraction must be in [0, 1], got {fraction}"
            )
        self._record("tether_scheduler_bucket_level", Kind.GAUGE, fraction, {"bucket": bucket})

    def admission_waited(self, priority_class: str, seconds: float) -> None:
        self._record(
            "tether_admission_wait_seconds", Kind.HISTOGRAM, seconds, {"priority_class": priority_class}
        )

    def rate_limited(self, provider: str) -> None:
        self._record("tether_provider_429", Kind.COUNTER, 1, {"provider": provider})

    # breakers
    def breaker_state(self, scope: str, state: BreakerStateValue | str) -> None:
        code = BreakerStateValue(state).code
        self._record("tether_breaker_state", Kind.GAUGE, code, {"scope": scope})

    def breaker_tripped(self, scope: str) -> None:
        self._record("tether_breaker_trips", Kind.COUNTER, 1, {"scope": scope})

    def breaker_probed(self, scope: str, outcome: str) -> None:
        self._record("tether_breaker_probes", Kind.COUNTER, 1, {"scope": scope, "outcome": outcome})

    # control plane
    def control_latency(self, kind: str, seconds: float) -> None:
        self._record("tether_control_latency_seconds", Kind.HISTOGRAM, seconds, {"kind": kind})

    def trajectories_in_state(self, state: str, count: int) -> None:
        if count < 0:
            raise InputError(f"metric tether_trajectories: count must be >= 0, got {count}")
        self._record("tether_trajectories", Kind.GAUGE, count, {"state": state})


_current: Metrics | None = None
_current_lock = threading.Lock()


def install(metrics: Metrics) -> Metrics:
    """Make ``metrics`` this process's instance (returned by :func:`current`); returns it."""
    global _current
    with _current_lock:
        _current = metrics
    return metrics


def current() -> Metrics:
    """This process's installed :class:`Metrics`, or a no-op one if none was installed."""
    global _current
    with _current_lock:
        if _current is None:
            _current = Metrics()
        return _current
