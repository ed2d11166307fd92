"""The Ray autoscaler adds worker nodes for trajectory actors and removes them once they are idle.

Runs Ray's ``fake_multinode`` provider on this machine with the shipped config
(``cluster/autoscaler/fake_multinode.yaml``): the head holds no ``tether_trajectory`` resource, each
worker node holds 2, at most 2 worker nodes, idle timeout 6 s.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from cluster.fake_cluster import TRAJECTORY_RESOURCE, FakeMultiNodeCluster, load_autoscaling_config, prewarm

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]

_CONFIG = load_autoscaling_config(FakeMultiNodeCluster().config_path)
_WORKER = _CONFIG["available_node_types"]["ray.worker.trajectory"]
PER_NODE = int(_WORKER["resources"][TRAJECTORY_RESOURCE])
MAX_WORKERS = int(_WORKER["max_workers"])
SCALE_WAIT_S = 120.0


@dataclass(frozen=True)
class WorkloadRun:
    """What a workload started: actor handles (kept alive so they hold their resource) and result refs."""

    handles: list[Any]
    results: list[Any]


Workload = Callable[[int], WorkloadRun]


def stand_in_trajectories(count: int) -> WorkloadRun:
    """A tiny stand-in for the trajectory actor: a few async steps, then it reports the node it ran on.

    The real trajectory actor takes its place later; it requests the same resource.
    """
    import ray

    @ray.remote(num_cpus=0, resources={TRAJECTORY_RESOURCE: 1})
    class StandInTrajectory:
        async def run(self, steps: int) -> dict[str, Any]:
            for _ in range(steps):
                await asyncio.sleep(0.05)  # a "turn" that yields to the event loop
            return {"node_id": ray.get_runtime_context().get_node_id(), "steps": steps}

    handles = [StandInTrajectory.remote() for _ in range(count)]  # type: ignore[attr-defined]
    return WorkloadRun(handles=handles, results=[h.run.remote(5) for h in handles])


def _alive_worker_ids() -> set[str]:
    import ray

    return {
        node["NodeID"]
        for node in ray.nodes()  # type: ignore[no-untyped-call]
        if node["Alive"] and node["Resources"].get(TRAJECTORY_RESOURCE, 0) > 0
    }


def _poll(predicate: Callable[[], bool], timeout: float, interval: float = 0.5) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` passes; the caller asserts on the outcome."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


@pytest.fixture
def fake_cluster() -> Iterator[FakeMultiNodeCluster]:
    import ray

    cluster = FakeMultiNodeCluster().start()
    try:
        ray.init(
            address=cluster.address, logging_level=logging.WARNING, log_to_driver=False, namespace="tether"
        )
        yield cluster
    finally:
        ray.shutdown()
        cluster.stop()


def run_scaling_scenario(workload: Workload, trajectories: int) -> tuple[set[str], list[Any]]:
    """Start ``trajectories`` actors through ``workload``, return (worker nodes seen, results)."""
    import ray

    run = workload(trajectories)
    seen: set[str] = set()
    pending = list(run.results)
    deadline = time.monotonic() + SCALE_WAIT_S
    while pending and time.monotonic() < deadline:
        seen |= _alive_worker_ids()
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=0.5)
    seen |= _alive_worker_ids()
    assert not pending, f"{len(pending)} of {trajectories} trajectories unfinished after {SCALE_WAIT_S:.0f}s"
    results = ray.get(run.results)
    for handle in run.handles:
        ray.kill(handle)  # a finished trajectory releases its resource
    return seen, results


@pytest.mark.parametrize("workload", [stand_in_trajectories], ids=["stand-in"])
def test_autoscaler_scales_out_for_trajectories_and_back_in_when_idle(
    fake_cluster: FakeMultiNodeCluster, workload: Workload
) -> None:
    # Given: a head with no trajectory capacity and no worker nodes
    assert _alive_worker_ids() == set()
    trajectories = PER_NODE * MAX_WORKERS  # needs every worker node the config allows

    # When: more trajectories start than the head can hold
    seen_workers, results = run_scaling_scenario(workload, trajectories)

    # Then: the autoscaler added worker nodes, and every trajectory ran to the end on one of them
    assert len(seen_workers) >= math.ceil(trajectories / PER_NODE)
    assert len(results) == trajectories
    assert all(result["steps"] == 5 for result in results)
    assert {result["node_id"] for result in results} <= seen_workers
    # Then: once the trajectories are gone the idle workers are removed
    assert _poll(lambda: _alive_worker_ids() == set(), timeout=SCALE_WAIT_S), (
        f"idle workers still alive after {SCALE_WAIT_S:.0f}s: {_alive_worker_ids()}"
    )


def test_prewarm_adds_a_worker_before_any_trajectory_exists(fake_cluster: FakeMultiNodeCluster) -> None:
    # Given: an empty cluster
    assert _alive_worker_ids() == set()

    # When: the driver asks for room for one trajectory
    prewarm(1)

    # Then: a worker node joins without any actor asking for it; withdrawing the request lets it go again
    assert _poll(lambda: len(_alive_worker_ids()) == 1, timeout=SCALE_WAIT_S)
    prewarm(0)
    assert _poll(lambda: _alive_worker_ids() == set(), timeout=SCALE_WAIT_S)
