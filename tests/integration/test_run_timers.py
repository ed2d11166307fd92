"""Durable timers under ``tether run`` (ARCHITECTURE.md, "Durable timers"; issue 10): a hibernated
trajectory's approval expiry is fired by the cluster's timer service, never by the CLI driver.

The run's only trajectory holds a call for approval and hibernates (its actor exits); nobody answers. The
driver only watches (``Driver.self_wake`` is off whenever the run has a timer service), so the expiry is
recorded because ``timers:0`` woke the trajectory from its launch and fired the timer into it: silence is
denial, and the trajectory ends. The control stops the timer service before the run: then nothing wakes the
trajectory, and seconds after its expiry it still sleeps with the call held, the expiry unrecorded.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
import ray

from cluster.control_client import ControlClient, TrajectoryStatus
from cluster.log_store import RedisLogStore
from cluster.runner import RunOptions, RunResult, RunStopped, Services, run_driver
from cluster.timer_service import stop_timer_services
from cluster.workload import parse_workload
from runtime.events import ApprovalDecided
from runtime.record import ApprovalDecision
from runtime.snapshot import events_after_snapshot

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

EXPIRY_S = 6.0

WORKLOAD = f"""\
name: expiry
provider: {{kind: simulated, model: sim-small}}
tools: [{{name: send_notification}}]
approval_timeout_s: {EXPIRY_S}
hibernate_after_s: 1
scheduler: false
trajectories:
  - id: silent
    scenario: "irreversible:send_notification"
    grants: [send_notification]
    completion_check: {{kind: tool_succeeded, tool: send_notification}}
    expected_state: FAILED
    deadline_s: 600
"""
TID = "expiry.silent"


@pytest.mark.parametrize("timers", ["timer-service", "protection-off"])
async def test_a_hibernated_trajectorys_approval_expires_without_the_driver(
    ray_local: None, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, timers: str
) -> None:
    # Given tether run's services (relay and timer service) and a trajectory that holds a call for approval
    monkeypatch.setenv("TETHER_REDIS_URL", redis_url)
    monkeypatch.setenv("TETHER_HOME", str(tmp_path / "home"))
    workload = parse_workload(WORKLOAD, "expiry.yaml")
    options = RunOptions(run_id="expiry", poll_s=0.1)
    stop = threading.Event()
    with Services(workload, options) as services:
        assert services.timer_handles, "tether run starts a timer service beside its relays"
        if timers == "protection-off":
            stop_timer_services(services.timer_handles)  # nothing in the cluster fires timers now
        run = asyncio.ensure_future(asyncio.to_thread(run_driver, workload, services, options, None, stop))
        try:
            async with ControlClient.from_url(redis_url) as client:
                # When it hibernates (its actor exits) and nobody answers
                parked = await _parked(client, run)
                assert parked.held is not None and parked.held.expires_at is not None
                expires_at = parked.held.expires_at

                if timers == "protection-off":
                    # Then (control) nothing wakes it: past its expiry it still sleeps, the call still held
                    while time.time() < expires_at + 4.0:
                        await asyncio.sleep(0.2)
                    status = await client.status(TID)
                    assert status is not None and status.hibernated and status.held is not None
                    assert await _expiries(redis_url) == []
                    return

                # Then the timer service wakes it and fires the expiry: silence is denial, and it ends
                result: RunResult = await asyncio.wait_for(run, 60.0)
        finally:
            stop.set()
            if not run.done() or timers == "protection-off":
                with pytest.raises(RunStopped):
                    await run
        fired = [ray.get(h.stats.remote()) for h in services.timer_handles]

    (only,) = result.results
    assert (only.state, only.exit_reason) == ("FAILED", "COMPLETION_CHECK_FAILED")
    (expired,) = await _expiries(redis_url)
    assert expires_at <= expired.decided_at < expires_at + 10.0  # at its expiry, not the driver's grace
    # the timer service woke it; the woken actor re-arms its overdue timers as it recovers, so the expiry may
    # be decided there first and the service's own delivery answered "unknown" (already fired)
    assert sum(s["woken"] for s in fired) >= 1, fired
    assert sum(s["fired"] + s["unknown"] for s in fired) >= 1, fired


async def _parked(client: ControlClient, run: asyncio.Future[RunResult]) -> TrajectoryStatus:
    give_up = time.monotonic() + 60.0
    while time.monotonic() < give_up:
        assert not run.done(), "the run ended before the trajectory hibernated"
        status = await client.status(TID)
        if status is not None and status.hibernated and status.held is not None:
            return status
        await asyncio.sleep(0.05)
    raise AssertionError(f"{TID} never hibernated holding its call")


async def _expiries(url: str) -> list[ApprovalDecided]:
    async with RedisLogStore.from_url(url) as store:
        events = events_after_snapshot(await store.read(TID))  # it hibernated: its log was compacted
    return [e for e in events if isinstance(e, ApprovalDecided) and e.decision is ApprovalDecision.EXPIRED]
