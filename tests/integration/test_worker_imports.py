"""In a real Ray worker, the ``actors`` package imports redis without the OpenTelemetry SDK
(``actors._worker_imports``); the driver that started the worker keeps redis-py's own support."""

from __future__ import annotations

import uuid

import pytest
import ray

pytestmark = pytest.mark.integration


@ray.remote(num_cpus=0)
def _redis_otel_in_a_fresh_worker() -> dict[str, bool]:
    import importlib
    import sys

    import actors  # first, as in a trajectory actor's worker

    providers = importlib.import_module("redis.observability.providers")

    return {
        "in_worker": actors.in_ray_worker(),
        "redis_otel": providers.OTEL_AVAILABLE,
        "sdk_loaded": "opentelemetry.sdk" in sys.modules,
    }


def test_a_ray_worker_loads_redis_without_the_opentelemetry_sdk(ray_local: None) -> None:
    # a runtime env of its own: a new worker process, which has imported neither redis nor the SDK before
    fresh = {"env_vars": {"TETHER_TEST_FRESH_WORKER": uuid.uuid4().hex}}
    state = ray.get(_redis_otel_in_a_fresh_worker.options(runtime_env=fresh).remote(), timeout=120)
    assert state == {"in_worker": True, "redis_otel": False, "sdk_loaded": False}
