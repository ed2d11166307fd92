"""What the actors' worker processes import less of.

Every Tether actor (one process per live trajectory, plus relays, guards, the scheduler) imports redis-py.
redis-py 8 imports the OpenTelemetry *SDK* at import time, only to learn whether it could export its own
optional client metrics (``redis.observability``), which Tether never turns on: Tether's metrics go to
Prometheus through Ray. That import is about 50 modules and 1.35 MB of private memory per worker; in a probe
worker, importing ``actors.trajectory`` took 0.28-0.30 s without it against 0.29-0.33 s with it (5 workers
each; ``docs/perf/capacity.md``, issue 14). redis-py treats a missing SDK as "metrics
unavailable" (its ``OTEL_AVAILABLE`` flag); so, in Ray worker processes only, redis is imported while the
SDK is made unimportable, and the SDK is importable again right after: code that wants it later (a user's
tool, Ray) gets it as usual. Drivers (``tether run``, the CLI, a user's program) are left alone, so a user
who enabled redis-py's own OpenTelemetry metrics there keeps them.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

__all__ = ["import_redis_without_otel_sdk", "in_ray_worker"]

_SDK = "opentelemetry.sdk"


class _WithoutOtelSdk(importlib.abc.MetaPathFinder):
    """Answers an import of the OpenTelemetry SDK with ``ModuleNotFoundError``, as if it were absent."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname == _SDK or fullname.startswith(_SDK + "."):
            raise ModuleNotFoundError(
                f"{fullname} is not imported for redis-py in Tether's actors", name=fullname
            )
        return None


def in_ray_worker() -> bool:
    """True in a Ray worker process (an actor's or a task's), false in a driver or without Ray."""
    worker_module = sys.modules.get("ray._private.worker")
    if worker_module is None:
        return False
    worker = getattr(worker_module, "global_worker", None)
    return getattr(worker, "mode", None) == getattr(worker_module, "WORKER_MODE", object())


def import_redis_without_otel_sdk() -> bool:
    """Import ``redis.asyncio`` with the OpenTelemetry SDK hidden; True when this call imported it (False:
    redis or the SDK was already imported, and nothing changed)."""
    if "redis" in sys.modules or _SDK in sys.modules:
        return False
    finder = _WithoutOtelSdk()
    sys.meta_path.insert(0, finder)
    try:
        importlib.import_module("redis.asyncio")
    finally:
        sys.meta_path.remove(finder)
    return True
