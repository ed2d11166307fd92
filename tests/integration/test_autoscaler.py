"""The Ray autoscaler adds worker nodes for real trajectory actors and removes them once they are idle.

Runs Ray's ``fake_multinode`` provider on this machine with the shipped config
(``cluster/autoscaler/fake_multinode.yaml``): the head holds no ``tether_trajectory`` resource, each
worker node holds 2, at most 2 worker nodes, idle timeout 6 s. The workload is ``examples/autoscale.yaml``
run by ``tether run``'s services (simulated provider, testbed tools, scheduler and guard actors on the
head) with one real trajectory actor per trajectory.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from actors.trajectory import ensure_actor
from cluster.fake_cluster import TRAJECTORY_RESOURCE, FakeMultiNodeCluster, load_autoscaling_config, prewarm
from cluster.runner import RunOptions, Services, plan_launches
from cluster.workload import load_workload

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.long,
    pytest.mark.own_ray_cluster,
    pytest.mark.timeout(900),
]

_CONFIG = load_autoscaling_config(FakeMultiNodeCluster().config_path)
_WORKER = _CONFIG["available_node_types"]["ray.worker.trajectory"]
PER_NODE = int(_WORKER["resources"][TRAJECTORY_RESOURCE])
MAX_WORKERS = int(_WORKER["max_workers"])
SCALE_WAIT_S = 300.0  # generous: a fake worker node is a raylet and its processes, slow on a busy machine
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "autoscale.yaml"


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
            address=cluster.address,
            _node_ip_address="127.0.0.1",  # the driver stays on loopback too
            logging_level=logging.WARNING,
            log_to_driver=False,
            namespace="tether",
        )
        yield cluster
    finally:
        ray.shutdown()
        cluster.stop()


def _trajectory_slots_in_use() -> float:
    import ray

    total = ray.cluster_resources().get(TRAJECTORY_RESOURCE, 0.0)  # type: ignore[no-untyped-call]
    free = ray.available_resources().get(TRAJECTORY_RESOURCE, 0.0)  # type: ignore[no-untyped-call]
    return float(total - free)


def _head_slots() -> float:
    import ray

    heads = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("node:__internal_head__")]  # type: ignore[no-untyped-call]
    assert len(heads) == 1
    return float(heads[0]["Resources"].get(TRAJECTORY_RESOURCE, 0.0))


def test_autoscaler_scales_out_for_trajectory_actors_and_back_in_when_idle(
    fake_cluster: FakeMultiNodeCluster, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray

    # Given: a head with no trajectory capacity, no worker nodes, and tether run's services on the head
    workload = load_workload(EXAMPLE)
    trajectories = len(workload.expanded())
    assert trajectories > PER_NODE  # more than one worker node can hold
    assert _alive_worker_ids() == set() and _head_slots() == 0
    monkeypatch.setenv("TETHER_REDIS_URL", redis_url)
    monkeypatch.setenv("TETHER_HOME", str(tmp_path / "home"))
    # No control relays: this test is about capacity, and no operator signal is sent during it.
    with Services(workload, RunOptions(address=fake_cluster.address, relays=0)) as services:
        # On a cluster scaled to zero no node advertises the trajectory resource yet, so the workload asks
        # for it explicitly (trajectory_resources); the launches carry it to every actor.
        planned = plan_launches(
            workload,
            run_id="autoscale",
            redis_url=services.redis_url,
            base_url=services.base_url,
            testbed_address=services.testbed_address,
            created_at=time.time(),
        )
        specs = [spec for spec, _ in planned]
        launches = [launch for _, launch in planned]
        assert all(launch.resources == {TRAJECTORY_RESOURCE: 1.0} for launch in launches)

        # When: one real trajectory actor per trajectory is started and run to its end
        handles = [ensure_actor(launch, services.adapters) for launch in launches]
        pending = [handle.run.remote() for handle in handles]
        refs = list(pending)
        seen: set[str] = set()
        deadline = time.monotonic() + SCALE_WAIT_S
        while pending and time.monotonic() < deadline:
            seen |= _alive_worker_ids()
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=0.5)
        seen |= _alive_worker_ids()
        assert not pending, (
            f"{len(pending)} of {trajectories} trajectories unfinished after {SCALE_WAIT_S:.0f}s"
        )
        summaries: list[dict[str, Any]] = ray.get(refs)

        # Then: the autoscaler added worker nodes, and every trajectory holds a slot only workers offer
        assert len(seen) >= math.ceil(trajectories / PER_NODE)
        assert _poll(lambda: _trajectory_slots_in_use() == trajectories, timeout=60.0)
        # Then: every trajectory finished in the state its script implies
        assert [(spec.id, s["state"]) for spec, s in zip(specs, summaries, strict=True)] == [
            (spec.id, spec.expected_state) for spec in specs
        ]
        for handle in handles:
            ray.kill(handle)  # a finished trajectory's actor goes away and releases its slot

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
