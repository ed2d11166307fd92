"""The scheduler's metrics hooks (``scheduler.hooks.SchedulerMetrics``) recorded through
``runtime.metrics.Metrics``: bucket level, admission wait by class, 429s received, refusals, and the
delay margin a key's windows allow for late calls.

``MetricsAdapter`` is handed to ``SchedulerCore`` / ``InProcessScheduler`` / the scheduler actor. For the
actor it is built from a backend *factory* (e.g. ``actors.metrics_ray.RayBackend``; this package may not
import ``actors``): the adapter crosses to the actor's process by pickling, and the backend, which holds
locks and exporter state, is only built there, on first use.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from runtime.metrics import Metrics, MetricsBackend

__all__ = ["MetricsAdapter"]

_log = logging.getLogger(__name__)


class MetricsAdapter:
    """``SchedulerMetrics`` over a ``Metrics`` (or a factory of its backend, built where it is used).

    The scheduler calls these from its decision loop: they are cheap and never raise (a failed metric is
    logged and dropped, never a failed admission).
    """

    def __init__(self, metrics: Metrics | Callable[[], MetricsBackend]) -> None:
        self._metrics: Metrics | None = metrics if isinstance(metrics, Metrics) else None
        self._factory: Callable[[], MetricsBackend] | None = None if isinstance(metrics, Metrics) else metrics

    def __getstate__(self) -> dict[str, Any]:
        # a factory-built Metrics stays behind; the receiving process builds its own
        return {"_metrics": None if self._factory is not None else self._metrics, "_factory": self._factory}

    @property
    def metrics(self) -> Metrics:
        if self._metrics is None:
            assert self._factory is not None
            self._metrics = Metrics(self._factory())
        return self._metrics

    def bucket_level(self, provider_key: str, resource: str, level: float, capacity: float) -> None:
        fraction = min(1.0, max(0.0, level / capacity)) if capacity > 0 else 0.0
        self._safely(lambda m: m.bucket_level(f"{provider_key}/{resource}", fraction))

    def admission_wait(self, priority_class: str, seconds: float) -> None:
        self._safely(lambda m: m.admission_waited(priority_class, max(0.0, seconds)))

    def rate_limited(self, provider_key: str) -> None:
        self._safely(lambda m: m.rate_limited(provider_key))

    def delay_margin(self, provider_key: str, seconds: float) -> None:
        self._safely(lambda m: m.delay_margin(provider_key, max(0.0, seconds)))

    def refused(self, kind: str, priority_class: str, predicate: str) -> None:
        self._safely(lambda m: m.admission_refused(kind, priority_class, predicate))

    def _safely(self, record: Callable[[Metrics], None]) -> None:
        try:
            record(self.metrics)
        except Exception:
            _log.warning("scheduler: metric not recorded", exc_info=True)
