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
from typing import Any

from actors.metrics_ray import RayBackend
from runtime.metrics import (
    METRICS,
    BreakerStateValue,
    InMemoryBackend,
    Kind,
    Metrics,
    MetricsBackend,
    MetricSpec,
    NoopBackend,
    current,
    install,
)

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
