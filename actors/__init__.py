"""Tether's Ray actors: trajectories, relays, guards, the node's model client and the sandbox.

A worker process imports this package before any actor module, so redis-py is imported here first, without
the OpenTelemetry SDK it would load for metrics Tether never enables (``actors._worker_imports``).
"""

from actors._worker_imports import import_redis_without_otel_sdk, in_ray_worker

__all__ = ["import_redis_without_otel_sdk", "in_ray_worker"]

if in_ray_worker():
    import_redis_without_otel_sdk()
