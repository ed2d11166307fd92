"""Operator metrics as a plugin: the table of what Tether reports, a typed recording API, and the no-op and
in-memory backends. Pure: backends that talk to Prometheus or Ray live at the edge
(``cluster.metrics.PrometheusBackend``, ``actors.metrics_ray.RayBackend``), so every layer can record
through an injected :class:`Metrics` without importing them.

What is measured follows the reliability guide §12.5 ("signals worth watching": guard firing rate by guard,
budget exhaustion, escalations by trigger, partial completion rate, retry ratio, duplicate-effect rate, steps
to completion) plus the control plane: scheduler bucket level, admission wait by class, 429s received,
breaker state / trips / probes, control latency, trajectories by state. Counters are cumulative; the
dashboard (cluster/grafana/tether.json) takes ``rate()`` of them. Nothing happens at import time.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

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
    "Outcome",
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


class Outcome(StrEnum):
    """How a trajectory ended, as operators count it (the ``outcome`` label of finished trajectories).

    PARTIAL is a FAILED trajectory that still established at least one external effect: "mostly worked"
    must not hide inside a binary success metric (reliability guide §12.5, partial completion rate).
    """

    COMPLETED = "completed"
    PARTIAL = "partial"
    FAILED = "failed"
    KILLED = "killed"
    CANCELED = "canceled"


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
_RATIO_BUCKETS = (0.5, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0)

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
            "Trajectories that reached a final outcome (completed, partial, failed, killed, canceled).",
            ("outcome",),
        ),
        MetricSpec("tether_step_attempts", Kind.COUNTER, "Step attempts, first tries and retries."),
        MetricSpec(
            "tether_steps_completed", Kind.COUNTER, "Steps completed; attempts/completed is the retry ratio."
        ),
        MetricSpec(
            "tether_tool_operations",
            Kind.COUNTER,
            "Distinct tool operations dispatched (one per operation, however many attempts).",
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
            "Turns a trajectory took to reach COMPLETED.",
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
            "tether_prompt_reservation_ratio",
            Kind.HISTOGRAM,
            "Prompt tokens a model call reserved / the provider's count of them (below 1: under-reserved).",
            buckets=_RATIO_BUCKETS,
        ),
        MetricSpec(
            "tether_provider_429", Kind.COUNTER, "HTTP 429 responses received, by provider.", ("provider",)
        ),
        MetricSpec(
            "tether_scheduler_delay_margin_seconds",
            Kind.GAUGE,
            "How much longer than the provider's window a key's admission ledgers count, for late calls.",
            ("provider",),
        ),
        MetricSpec(
            "tether_admission_refused",
            Kind.COUNTER,
            "Scheduler refusals, by request kind (turn, sandbox), priority class and failed predicate.",
            ("kind", "priority_class", "predicate"),
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
            "Time from a trajectory recording a control request to applying it, by kind.",
            ("kind",),
            _CONTROL_BUCKETS,
        ),
        MetricSpec(
            "tether_trajectories",
            Kind.GAUGE,
            "Trajectories of the run by state, from their status snapshots (the driver's view).",
            ("state",),
        ),
        MetricSpec(
            "tether_actor_trajectories",
            Kind.GAUGE,
            "Unfinished trajectories held by this process, by state (kept from state changes).",
            ("state",),
        ),
        # supervision (issue 12)
        MetricSpec(
            "tether_exit_reasons",
            Kind.COUNTER,
            "Trajectories that entered FINALIZING, by exit reason.",
            ("reason",),
        ),
        MetricSpec(
            "tether_watchdog_rungs",
            Kind.COUNTER,
            "Watchdog ladder answers (inform, constrain, hold), by detector and rung.",
            ("guard", "rung"),
        ),
        MetricSpec(
            "tether_holds", Kind.COUNTER, "Holds placed, by kind (watchdog, control, incident).", ("kind",)
        ),
        MetricSpec(
            "tether_results",
            Kind.COUNTER,
            "Finished results by degradation rung and completeness status (degraded-result rate).",
            ("rung", "status"),
        ),
        MetricSpec(
            "tether_rung_changes", Kind.COUNTER, "Moves down the degradation ladder, by rung.", ("rung",)
        ),
        MetricSpec(
            "tether_incidents_opened",
            Kind.COUNTER,
            "Incidents opened by a trajectory's own rule (a disclosure rule), by source.",
            ("source",),
        ),
        MetricSpec(
            "tether_children",
            Kind.COUNTER,
            "Child trajectories, by what became of them (spawned, verified, failed_check, cancelled).",
            ("outcome",),
        ),
        MetricSpec(
            "tether_escalations_open",
            Kind.GAUGE,
            "Escalations nobody has taken custody of yet, by trigger (the driver's view of the registry).",
            ("trigger",),
        ),
        MetricSpec(
            "tether_escalations_overdue",
            Kind.GAUGE,
            "Open escalations past their SLA, by trigger (the driver's view of the registry).",
            ("trigger",),
        ),
        MetricSpec(
            "tether_escalation_sla_missed",
            Kind.COUNTER,
            "Escalations that missed their SLA (not acknowledged by their due time), by trigger.",
            ("trigger",),
        ),
        MetricSpec(
            "tether_incidents", Kind.GAUGE, "Incidents in the incident store, by status.", ("status",)
        ),
        MetricSpec(
            "tether_quarantined_artifacts",
            Kind.GAUGE,
            "Artifacts quarantined now (refused as input to any trajectory until released).",
        ),
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

    def trajectory_finished(self, outcome: Outcome | str, steps: int) -> None:
        """A trajectory reached a final outcome after ``steps`` turns (partial completion is an outcome).

        Only a completed trajectory adds to the steps-to-completion distribution: the turns a failed one
        used are not steps to *completion*, and mixing them in would hide the looping tail §12.5 watches.
        """
        self._record("tether_trajectories_finished", Kind.COUNTER, 1, {"outcome": str(outcome)})
        if outcome == Outcome.COMPLETED:
            self._record("tether_steps_to_completion", Kind.HISTOGRAM, steps)

    def step_attempted(self) -> None:
        self._record("tether_step_attempts", Kind.COUNTER, 1)

    def step_completed(self) -> None:
        self._record("tether_steps_completed", Kind.COUNTER, 1)

    def tool_operation_started(self) -> None:
        """A new tool operation was dispatched (its first attempt); attempts / operations: retry ratio."""
        self._record("tether_tool_operations", Kind.COUNTER, 1)

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

    def prompt_reserved(self, reserved: int, counted: int) -> None:
        """A model call reserved ``reserved`` prompt tokens and the provider counted ``counted``."""
        if reserved < 0 or counted <= 0:
            raise InputError(
                f"metric tether_prompt_reservation_ratio: needs reserved >= 0 and counted > 0, "
                f"got {reserved} and {counted}"
            )
        self._record("tether_prompt_reservation_ratio", Kind.HISTOGRAM, reserved / counted)

    def rate_limited(self, provider: str) -> None:
        self._record("tether_provider_429", Kind.COUNTER, 1, {"provider": provider})

    def delay_margin(self, provider: str, seconds: float) -> None:
        self._record("tether_scheduler_delay_margin_seconds", Kind.GAUGE, seconds, {"provider": provider})

    def admission_refused(self, kind: str, priority_class: str, predicate: str) -> None:
        self._record(
            "tether_admission_refused",
            Kind.COUNTER,
            1,
            {"kind": kind, "priority_class": priority_class, "predicate": predicate},
        )

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

    def actor_trajectories_in_state(self, state: str, count: int) -> None:
        if count < 0:
            raise InputError(f"metric tether_actor_trajectories: count must be >= 0, got {count}")
        self._record("tether_actor_trajectories", Kind.GAUGE, count, {"state": state})

    # supervision (issue 12)
    def exited(self, reason: str) -> None:
        self._record("tether_exit_reasons", Kind.COUNTER, 1, {"reason": reason})

    def watchdog_rung(self, guard: str, rung: str) -> None:
        self._record("tether_watchdog_rungs", Kind.COUNTER, 1, {"guard": guard, "rung": rung})

    def hold_placed(self, kind: str) -> None:
        self._record("tether_holds", Kind.COUNTER, 1, {"kind": kind})

    def result(self, rung: str, status: str) -> None:
        self._record("tether_results", Kind.COUNTER, 1, {"rung": rung, "status": status})

    def rung_changed(self, rung: str) -> None:
        self._record("tether_rung_changes", Kind.COUNTER, 1, {"rung": rung})

    def incident_opened(self, source: str) -> None:
        self._record("tether_incidents_opened", Kind.COUNTER, 1, {"source": source})

    def child(self, outcome: str) -> None:
        self._record("tether_children", Kind.COUNTER, 1, {"outcome": outcome})

    def escalations_open(self, trigger: str, count: int) -> None:
        self._record("tether_escalations_open", Kind.GAUGE, count, {"trigger": trigger})

    def escalations_overdue(self, trigger: str, count: int) -> None:
        self._record("tether_escalations_overdue", Kind.GAUGE, count, {"trigger": trigger})

    def escalation_sla_missed(self, trigger: str) -> None:
        self._record("tether_escalation_sla_missed", Kind.COUNTER, 1, {"trigger": trigger})

    def incidents(self, status: str, count: int) -> None:
        self._record("tether_incidents", Kind.GAUGE, count, {"status": status})

    def quarantined_artifacts(self, count: int) -> None:
        self._record("tether_quarantined_artifacts", Kind.GAUGE, count)


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
