"""``ray.util.metrics`` backend for :class:`runtime.metrics.Metrics`, for code running inside Ray actors.

Each node's metrics agent exports these; Ray prefixes exported names with ``ray_``
(``ray_tether_guard_fired_total``).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from runtime.metrics import Kind, MetricSpec

__all__ = ["RayBackend"]


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
