"""The guard actor on a local Ray: trips on failures, scopes stay independent, settling is never starved."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator

import pytest

from breakers import BreakerPolicy, BreakerState, BulkheadPolicy, GuardPolicy
from breakers.guard import GuardHandle, actor_name
from runtime.errors import BreakerOpen
from runtime.ports import GuardPermit, GuardPort, OutcomeClass

pytestmark = pytest.mark.integration

F = OutcomeClass.INFRASTRUCTURE_FAILURE
S = OutcomeClass.SUCCESS

POLICY = GuardPolicy(
    breaker=BreakerPolicy(
        window_size=10, min_samples=5, trip_threshold=0.5, cooldown_s=0.5, max_cooldown_s=4.0
    ),
    bulkhead=BulkheadPolicy(max_concurrent=1, max_queued=2000, lease_s=60.0),
)


@pytest.fixture
def guard(ray_local: None) -> Iterator[GuardHandle]:
    yield GuardHandle(POLICY, holder="test-driver")


def _scope(name: str) -> str:
    # A fresh scope per test: the module shares one Ray, and named actors outlive a test.
    return f"{name}-{uuid.uuid4().hex[:6]}"


def _deadline(seconds: float = 60.0) -> float:
    return time.time() + seconds


async def _fail(guard: GuardHandle, scope: str, times: int) -> None:
    for i in range(times):
        permit = await guard.admit(scope, f"fail-{i}", _deadline())
        await guard.record(permit, F)
        await guard.release(permit)


async def test_guard_handle_is_a_guard_port(guard: GuardHandle) -> None:
    assert isinstance(guard, GuardPort)


async def test_guard_actor_trips_on_failures(guard: GuardHandle) -> None:
    # Given a dependency scope behind its guard actor
    scope = _scope("test-service")
    # When five dispatched calls fail
    await _fail(guard, scope, 5)
    # Then the next call is withheld with the scope named, and the actor is the named one in 'tether'
    with pytest.raises(BreakerOpen) as refused:
        await guard.admit(scope, "next", _deadline())
    assert refused.value.scope == scope and refused.value.cooldown_s > 0
    assert (await guard.snapshot(scope)).state is BreakerState.OPEN
    import ray

    assert ray.get_actor(actor_name(scope), namespace="tether") is not None


async def test_one_scopes_failures_do_not_affect_another(guard: GuardHandle) -> None:
    # Given two tenant scopes of one environment service
    tenant_a, tenant_b = _scope("env-service/tenant-a"), _scope("env-service/tenant-b")
    # When tenant a trips
    await _fail(guard, tenant_a, 5)
    # Then tenant b's calls are admitted and settle normally
    permit = await guard.admit(tenant_b, "b-1", _deadline())
    await guard.record(permit, S)
    await guard.release(permit)
    snap_a, snap_b = await guard.snapshot(tenant_a), await guard.snapshot(tenant_b)
    assert (snap_a.state, snap_b.state) == (BreakerState.OPEN, BreakerState.CLOSED)
    assert (snap_b.window_size, snap_b.window_failures, snap_b.in_flight) == (1, 0, 0)


async def test_settle_through_the_actor_records_and_frees_the_slot(guard: GuardHandle) -> None:
    # Given a scope of one slot (max_concurrent 1)
    scope = _scope("settle-service")
    # When a call settles with its outcome in one round trip
    first = await guard.admit(scope, "s-1", _deadline())
    await guard.settle(first, S)
    # Then the slot is free at once for the next caller and the outcome is in the window
    second = await asyncio.wait_for(guard.admit(scope, "s-2", _deadline()), timeout=10)
    await guard.settle(second, None)
    snap = await guard.snapshot(scope)
    assert (snap.window_size, snap.window_failures, snap.in_flight) == (1, 0, 0)
    # And failures settled this way trip the breaker as recorded ones do (4 of 5 samples failed)
    for i in range(4):
        await guard.settle(await guard.admit(scope, f"f-{i}", _deadline()), F)
    assert (await guard.snapshot(scope)).state is BreakerState.OPEN


QUEUED = 1100


async def test_record_and_release_are_not_blocked_by_queued_admissions(guard: GuardHandle) -> None:
    # Given one slot held and more callers queued behind it than an async actor's default concurrency
    # (1000): without a separate settlement group, record/release would wait behind them forever
    scope = _scope("slow-service")
    held = await guard.admit(scope, "holder", _deadline())
    served: list[GuardPermit] = []

    async def wait_then_release(i: int) -> None:
        permit = await guard.admit(scope, f"queued-{i}", _deadline(120.0))
        served.append(permit)
        await guard.release(permit)

    waiters = [asyncio.create_task(wait_then_release(i)) for i in range(QUEUED)]
    while (await guard.snapshot(scope)).queued < QUEUED:
        await asyncio.sleep(0.05)
    # When the holder records and releases while they all wait
    # (wait_for only turns a deadlock into a failure instead of a hung test)
    await asyncio.wait_for(guard.record(held, S), timeout=30)
    await asyncio.wait_for(guard.release(held), timeout=30)
    # Then the queue drains through the single slot, one permit per caller, nothing left behind
    await asyncio.wait_for(asyncio.gather(*waiters), timeout=60)
    snap = await guard.snapshot(scope)
    assert len({p.permit_id for p in served}) == QUEUED
    assert (snap.in_flight, snap.queued, snap.state) == (0, 0, BreakerState.CLOSED)


async def test_fifty_concurrent_callers_at_cooldown_end_get_one_probe(guard: GuardHandle) -> None:
    # Given a tripped scope (0.5 s cooldown on the actor's real clock)
    scope = _scope("probe-service")
    await _fail(guard, scope, 5)
    await asyncio.sleep(0.6)  # the actor's cooldown runs on real time
    # When 50 callers ask at once
    results = await asyncio.gather(
        *(guard.admit(scope, f"c{i}", _deadline()) for i in range(50)), return_exceptions=True
    )
    # Then exactly one is the probe, the rest are withheld
    permits = [r for r in results if isinstance(r, GuardPermit)]
    assert [p.probe for p in permits] == [True]
    assert sum(isinstance(r, BreakerOpen) for r in results) == 49
    # And the probe's success closes the scope
    await guard.record(permits[0], S)
    await guard.release(permits[0])
    assert (await guard.snapshot(scope)).state is BreakerState.CLOSED


class _KeepsDeadGuard(GuardHandle):
    """The protection off: a handle that keeps calling the guard actor it first found."""

    async def _call(self, scope: str, method: str, *args: object) -> object:
        return await getattr(self.actor(scope), method).remote(*args)


@pytest.mark.parametrize("kind", [GuardHandle, _KeepsDeadGuard], ids=["replaces-dead-guard", "control-keeps"])
async def test_a_killed_guard_actor_is_replaced_for_the_next_call(ray_local: None, kind: type) -> None:
    import os
    import signal

    import ray

    # Given a scope's guard actor created (and held) by one owner, as the driver of `tether run` does, and
    # used by another handle (a trajectory's); then the guard's worker process SIGKILLed (chaos)
    scope = _scope("killed")
    owner = GuardHandle(POLICY, holder="driver")
    guard_actor = owner.actor(scope)
    handle = kind(POLICY, holder="trajectory")
    permit = await handle.admit(scope, "before", _deadline())
    await handle.release(permit)
    pid = await guard_actor.__ray_call__.remote(lambda _self: os.getpid())
    os.kill(pid, signal.SIGKILL)
    # When the trajectory's handle asks again (a cleanup's release, later in the same process)
    if kind is _KeepsDeadGuard:
        # (control) the handle held on to the dead actor: every later call is refused
        with pytest.raises(ray.exceptions.RayActorError):
            await handle.admit(scope, "after", _deadline())
        return
    permit = await handle.admit(scope, "after", _deadline())
    # Then a new guard actor of the scope answered and settles normally
    await handle.record(permit, S)
    await handle.release(permit)
    assert (await handle.snapshot(scope)).state is BreakerState.CLOSED
