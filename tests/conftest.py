"""Fixtures for integration and fault tests: a private redis-server per test, a local Ray per module."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster.redis_server import RedisServer

# Every Ray process these tests start (local ray.init, `ray start` heads, fake autoscaler workers, job
# drivers) must stay on loopback. Ray maps 127.0.0.1 back to the machine's routable address while its
# "cluster mode" is on, and all processes of one cluster must agree on the address, so the mode is turned
# off for the whole session: the env var for child processes, the constant for this one (see
# cluster.runner.keep_ray_on_loopback).
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
try:
    from ray._private import ray_constants as _ray_constants

    _ray_constants.ENABLE_RAY_CLUSTER = False
except ImportError:  # pragma: no cover - ray is a runtime dependency
    pass


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run the tests that connect this process to a Ray cluster of their own (``own_ray_cluster``) first.

    After this process has started and shut down a local Ray, actors created on a cluster it joins later
    were cancelled before running ("all references removed") in our runs; a fresh process, or these
    tests first, never showed it. The defect is in the issue notes; meanwhile the order keeps it out.
    """
    first = [item for item in items if item.get_closest_marker("own_ray_cluster")]
    rest = [item for item in items if not item.get_closest_marker("own_ray_cluster")]
    items[:] = first + rest


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A real redis-server on a free loopback port, data in the test's temp dir, AOF always."""
    server = RedisServer(data_dir=tmp_path / "redis").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url


@pytest.fixture(scope="module")
def ray_local() -> Iterator[None]:
    """One small local Ray per test module, shut down afterwards."""
    import ray

    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    ray.init(
        _node_ip_address="127.0.0.1",  # keep all Ray traffic on loopback
        num_cpus=2,
        include_dashboard=False,
        namespace="tether",
        object_store_memory=100 * 1024 * 1024,
        logging_level="WARNING",
        log_to_driver=False,
        resources={"tether_trajectory": 1000},
    )
    try:
        yield
    finally:
        ray.shutdown()
