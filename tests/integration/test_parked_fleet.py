"""A parked fleet under ``tether run`` itself (issue 16): ``FLEET`` trajectories (14; the issue's 50 with
``TETHER_PARKED_FLEET=50``, as ``make test-stress`` runs it: about 4.5 minutes on 2 cores) hold a call for
approval and hibernate (their actors exit), an operator approves them all at once from the CLI
(``tether approve --all-pending``), and every one is woken by the relays and completes.

Waking is admission-controlled: the node declares room for ``SLOTS`` trajectory actors
(``$TETHER_TRAJECTORY_SLOTS``); at no moment are more alive, the rest wait for a slot as pending actors, and
the autoscaler's view of the cluster shows that demand.

The control runs the same fleet (smaller) with the two protections off: the driver pins every actor handle
for the whole run (as ``tether run`` did) and the relays do not replace a dead actor still registered under
its name. Then the approvals are never applied: "0 of 50 woken".
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import ray

import actors.trajectory
from cluster.control_client import ControlClient, TrajectoryStatus
from cluster.runner import RunOptions, RunResult, RunStopped, Services, run_driver
from cluster.signing import keyring_path
from cluster.workload import parse_workload
from tests.integration.test_control_plane import eventually

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.long, pytest.mark.timeout(1800)]

SLOTS = 8
# more than the slots, so waking is admission-controlled; the 50 under make test-stress
FLEET = int(os.environ.get("TETHER_PARKED_FLEET", "14"))

WORKLOAD = """\
name: parked-fleet
provider:
  kind: simulated
  model: sim-small
  limits: {{tpm: 10000000, rpm: 60000}}
  latency: {{ttft_ms: 5, tokens_per_s: 5000}}
tools:
  - {{name: send_notification}}
approval_timeout_s: 3600     # nobody's silence ends these: only the approvals do
hibernate_after_s: 1
trajectories:
  - id: notice
    count: {n}
    scenario: "irreversible:send_notification"
    grants: [send_notification]
    completion_check: {{kind: tool_succeeded, tool: send_notification}}
    expected_state: COMPLETED
    deadline_s: 3600
"""


def _relays_keeping_dead_actors(self: Services) -> None:
    """Protection off: relays whose lookup never replaces a dead actor still registered under its name."""
    from actors.relay import start_relays, stop_relays

    def targets_factory() -> Any:
        class KeepDead:
            def __init__(self, url: str) -> None:
                self.url = url
                self.inner: Any = None

            async def deliver(self, envelope: Any, received_at: float) -> str:
                if self.inner is None:
                    from actors.incarnation import Incarnations
                    from actors.incarnation_ray import RayActors, RedisTrajectories, ray_wake_gate
                    from actors.relay import TrajectoryTargets
                    from actors.trajectory import ensure_actor
                    from cluster.adapters import ClusterAdapters

                    class Keep(RayActors):
                        async def kill(self, handle: Any) -> None:
                            return None

                    store = RedisTrajectories(self.url)
                    runtime = Keep(lambda launch: ensure_actor(launch, ClusterAdapters()))
                    inc = Incarnations(runtime, store.info, gate=ray_wake_gate(), call_timeout_s=10.0)
                    self.inner = TrajectoryTargets(inc, store, ClusterAdapters())
                return str(await self.inner.deliver(envelope, received_at))

        return KeepDead

    handles = start_relays(
        self.redis_url, 1, adapters=self.adapters, targets=targets_factory()(self.redis_url)
    )
    self.relay_handles = handles
    self._stack.callback(stop_relays, handles)


@pytest.mark.parametrize(("n", "protected"), [(FLEET, True), (8, False)], ids=["fleet", "protection-off"])
async def test_a_parked_fleet_is_woken_by_bulk_approval_under_tether_run(
    no_shared_ray: None,
    redis_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    n: int,
    protected: bool,
) -> None:
    # Given tether run's services on a local Ray with room for SLOTS trajectory actors, and a fleet of n
    # trajectories that each hold a notification for approval and hibernate
    monkeypatch.setenv("TETHER_REDIS_URL", redis_url)
    monkeypatch.setenv("TETHER_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TETHER_TRAJECTORY_SLOTS", str(SLOTS))
    pinned: list[Any] = []
    if not protected:
        # the driver holds every actor handle until the run ends, as tether run's driver did
        original = actors.trajectory.ensure_actor

        def pinning(launch: Any, adapters: Any) -> Any:
            pinned.append(original(launch, adapters))
            return pinned[-1]

        monkeypatch.setattr(actors.trajectory, "ensure_actor", pinning)
        monkeypatch.setattr(Services, "_start_relays", _relays_keeping_dead_actors)
    workload = parse_workload(WORKLOAD.format(n=n), "parked.yaml")
    options = RunOptions(run_id="parked", relays=1)
    stop = threading.Event()
    with Services(workload, options) as services:
        assert ray.cluster_resources()["tether_trajectory"] == SLOTS
        run = asyncio.ensure_future(asyncio.to_thread(run_driver, workload, services, options, None, stop))
        try:
            async with ControlClient.from_url(redis_url, keyring=keyring_path()) as client:
                await eventually(lambda: _all_parked(client, n), f"{n} parked trajectories", timeout_s=900.0)

                # When an operator approves every pending notification in one command (the real CLI)
                approved = await _tether(
                    "approve", "--all-pending", "--tool", "send_notification", "--redis", redis_url
                )
                assert f"sent approve for {n} held call(s) of send_notification" in approved

                if not protected:
                    # Then (control) the approvals are never applied: every trajectory stays parked
                    await eventually(lambda: _relay_tried(services, n), "the relay to try every approval")
                    assert await _all_parked(client, n)
                    assert ray.get(services.relay_handles[0].stats.remote()).get("woken", 0) == 0
                    return

                # Then every trajectory is woken and completes, while never more than SLOTS actors are alive
                # and the ones waiting for a slot show up as demand for tether_trajectory
                peak, demand = await _watch_admission(lambda: run.done(), timeout_s=1200.0)
            result: RunResult = await run
        finally:
            stop.set()
            if not run.done():
                with pytest.raises(RunStopped):
                    await run
        relays = [ray.get(h.stats.remote()) for h in services.relay_handles]

    states = {r.name: (r.state, r.exit_reason) for r in result.results}
    assert set(states.values()) == {("COMPLETED", "COMPLETED")} and len(states) == n
    assert not result.unexpected
    assert sum(r["woken"] for r in relays) >= n and sum(r.get("delivered", 0) for r in relays) >= n
    assert 0 < peak <= SLOTS
    assert demand > 0


async def _all_parked(client: ControlClient, n: int) -> bool:
    rows: list[TrajectoryStatus] = [
        s for s in await client.statuses() if s.trajectory_id.startswith("parked.")
    ]
    return len(rows) == n and all(s.hibernated and s.held is not None for s in rows)


async def _relay_tried(services: Services, n: int) -> bool:
    stats = ray.get(services.relay_handles[0].stats.remote())
    return bool(stats.get("retry", 0) >= n)


async def _watch_admission(done: Callable[[], bool], timeout_s: float) -> tuple[int, int]:
    """Sample the cluster until ``done()``: the most trajectory actors alive at once, and the most trajectory
    slots the autoscaler saw demanded by actors waiting to be placed."""
    from ray._private import state
    from ray.autoscaler.v2.sdk import get_cluster_status

    gcs = ray.get_runtime_context().gcs_address
    peak = demand = 0
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "the fleet did not finish"
        actors = state.actors().values()
        alive = sum(1 for a in actors if a["ActorClassName"] == "TrajectoryActor" and a["State"] == "ALIVE")
        peak = max(peak, alive)
        status = get_cluster_status(gcs)
        wanted = sum(
            int(r.count)
            for d in status.resource_demands.ray_task_actor_demand
            for r in d.bundles_by_count
            if "tether_trajectory" in r.bundle
        )
        demand = max(demand, wanted)
        await asyncio.sleep(0.25)
    return peak, demand


async def _tether(*args: str) -> str:
    """Run the ``tether`` command line (this environment's console script); its output, or a failure."""
    exe = Path(sys.executable).with_name("tether")
    proc = await asyncio.create_subprocess_exec(
        str(exe), *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 120.0)
    text = out.decode()
    assert proc.returncode == 0, f"tether {' '.join(args)} exited {proc.returncode}: {text}"
    return text
