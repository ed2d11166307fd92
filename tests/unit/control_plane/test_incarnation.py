"""Reaching a trajectory with an in-memory actor runtime: a live actor is called, a missing one is woken
from its launch, a dead one still registered under its name is killed and replaced (whoever pins it), an
ended or unknown one is never woken, and waking is admission-controlled, first come first served."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from actors.incarnation import (
    TRAJECTORIES_PER_CORE,
    TRAJECTORY_ACTOR_BYTES,
    Incarnations,
    Reach,
    TargetGone,
    WakeGate,
    default_trajectory_slots,
)
from actors.outage import Backoff, Outage, OutageExceeded
from runtime.clock import FakeClock
from tests.unit.control_plane.fakes import FakeRuntime, Launches


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def incarnations(runtime: FakeRuntime, launches: Launches, clock: FakeClock, **kw: Any) -> Incarnations:
    return Incarnations(runtime, launches, clock=clock, busy_wait_s=1.0, retry_every_s=0.1, **kw)


async def test_a_live_actor_is_called_without_reading_anything(clock: FakeClock) -> None:
    runtime, launches = FakeRuntime(), Launches()
    launches.add("t-1")
    live = await runtime.create({"id": "t-1"})
    reached = await incarnations(runtime, launches, clock).call("t-1", "deliver", b"m")
    assert (reached.reach, reached.value, reached.woke) == (Reach.CALLED, "recorded", False)
    assert live.calls == [("deliver", (b"m",))] and launches.loads == 0


async def test_a_hibernated_trajectory_is_woken_from_its_launch_and_held_while_it_runs(
    clock: FakeClock,
) -> None:
    # Given a trajectory with a launch and no actor
    runtime, launches = FakeRuntime(), Launches()
    launches.add("t-1")
    inc = incarnations(runtime, launches, clock)
    # When a message is delivered
    reached = await inc.call("t-1", "deliver", b"m")
    # Then one incarnation was created, called, and is held (run() going) until it hibernates again
    (woken,) = runtime.created
    assert reached.woke and woken.calls == [("deliver", (b"m",))]
    assert "t-1" in inc.running and inc.woken == 1
    woken.ended.set()
    await asyncio.wait_for(inc.running["t-1"], 1.0)
    assert inc.running == {}


@pytest.mark.parametrize("kill_frees_names", [True, False], ids=["replaced", "protection-off"])
async def test_a_dead_actor_pinned_under_its_name_is_killed_and_replaced(
    clock: FakeClock, kill_frees_names: bool
) -> None:
    # Given t-1's actor exited (hibernated) but its name is still registered: someone holds a handle
    runtime, launches = FakeRuntime(kill_frees_names=kill_frees_names), Launches()
    launches.add("t-1")
    dead = await runtime.create({"id": "t-1"})
    dead.state = "dead"
    inc = incarnations(runtime, launches, clock)

    # When an approval is delivered
    if not kill_frees_names:
        # Then (control: killing does not free the name) every lookup finds the dead actor: never woken
        with pytest.raises(TargetGone, match="died"):
            await inc.call("t-1", "deliver", b"approve")
        assert len(runtime.created) == 1
        return
    reached = await inc.call("t-1", "deliver", b"approve")

    # Then the dead incarnation was killed (its name freed) and a new one woken and called
    assert reached.reach is Reach.CALLED and reached.woke
    assert [a.incarnation for a in runtime.created] == [1, 2]
    assert runtime.created[1].calls == [("deliver", (b"approve",))] and inc.replaced == 1


async def test_an_exiting_actor_is_called_again_until_its_successor_takes_the_call(clock: FakeClock) -> None:
    runtime, launches = FakeRuntime(), Launches()
    launches.add("t-1")
    exiting = await runtime.create({"id": "t-1"})
    exiting.state = "exiting"
    inc = incarnations(runtime, launches, clock)
    call = asyncio.ensure_future(inc.call("t-1", "fire_timer", "expiry-1"))
    for _ in range(3):
        await asyncio.sleep(0)
        clock.advance(0.1)
    exiting.state = "dead"  # it finished exiting
    for _ in range(5):
        await asyncio.sleep(0)
        clock.advance(0.1)
    reached = await asyncio.wait_for(call, 1.0)
    assert reached.woke and runtime.created[-1].calls == [("fire_timer", ("expiry-1",))]


@pytest.mark.parametrize(
    ("known", "state", "reach"), [(False, "", Reach.UNKNOWN), (True, "COMPLETED", Reach.TERMINAL)]
)
async def test_an_unknown_or_ended_trajectory_is_never_woken(
    clock: FakeClock, known: bool, state: str, reach: Reach
) -> None:
    runtime, launches = FakeRuntime(), Launches()
    if known:
        launches.add("t-1", state)
    reached = await incarnations(runtime, launches, clock).call("t-1", "deliver", b"m")
    assert reached.reach is reach and runtime.created == []


async def test_without_wake_nothing_is_created(clock: FakeClock) -> None:
    runtime, launches = FakeRuntime(), Launches()
    launches.add("t-1")
    reached = await incarnations(runtime, launches, clock).call("t-1", "deliver", b"unsigned", wake=False)
    assert reached.reach is Reach.NOT_LIVE and runtime.created == [] and launches.loads == 0


@pytest.mark.parametrize(("capacity", "peak"), [(2, 2), (None, 5)], ids=["gate", "protection-off"])
async def test_waking_admits_at_most_the_capacity_and_the_rest_in_arrival_order(
    clock: FakeClock, capacity: int | None, peak: int
) -> None:
    # Given five parked trajectories and room for two woken ones
    runtime, launches = FakeRuntime(), Launches()
    tids = [f"t-{i}" for i in range(5)]
    for tid in tids:
        launches.add(tid)
    inc = incarnations(runtime, launches, clock, gate=WakeGate(capacity))

    # When all five are approved at once, and each woken one runs for a while then ends
    calls = [asyncio.ensure_future(inc.call(tid, "deliver", b"approve")) for tid in tids]
    for _ in range(20):
        await asyncio.sleep(0)
    order = [a.tid for a in runtime.created]
    while not all(c.done() for c in calls):
        for actor in list(runtime.created):
            actor.ended.set()
        for _ in range(20):
            await asyncio.sleep(0)
        order = [a.tid for a in runtime.created]

    # Then never more than ``capacity`` ran at once, every one was woken, in the order they arrived
    assert runtime.peak_running == peak
    assert order == tids and all(c.result().reach is Reach.CALLED for c in calls)


async def test_an_unplaced_actor_is_waited_for_not_called_again_and_again(clock: FakeClock) -> None:
    # Given no free slot: a woken actor stays pending
    runtime, launches = FakeRuntime(start_pending=True), Launches()
    launches.add("t-1")
    inc = Incarnations(runtime, launches, clock=clock, wake_wait_s=3600.0)
    call = asyncio.ensure_future(inc.call("t-1", "deliver", b"approve"))
    for _ in range(10):
        await asyncio.sleep(0)
    (pending,) = runtime.created
    assert not call.done() and pending.calls == []
    # When a slot frees and it is placed, the one waiting delivery goes through
    pending.placed.set()
    reached = await asyncio.wait_for(call, 1.0)
    assert reached.reach is Reach.CALLED and pending.calls == [("deliver", (b"approve",))]


# --------------------------------------------------------------------------- sizing and outages


def test_trajectory_slots_come_from_memory_or_the_environment() -> None:
    gib = 2**30
    by_memory = int(24 * gib * 0.8 // TRAJECTORY_ACTOR_BYTES)
    assert default_trajectory_slots(24 * gib, env={}, cores=64) == by_memory
    assert default_trajectory_slots(100 * 2**20, env={}, cores=64) == 1
    assert default_trajectory_slots(24 * gib, env={"TETHER_TRAJECTORY_SLOTS": "12"}) == 12
    assert default_trajectory_slots(24 * gib, env={"TETHER_TRAJECTORY_SLOTS": "900"}, cores=2) == 900
    with pytest.raises(ValueError, match="TETHER_TRAJECTORY_SLOTS"):
        default_trajectory_slots(env={"TETHER_TRAJECTORY_SLOTS": "many"})


def test_trajectory_slots_are_also_bounded_by_the_cores() -> None:
    # a 2-core, 24 GB node: memory alone would give ~190 slots, but ~230 idle Ray workers take both cores
    gib = 2**30
    assert TRAJECTORY_ACTOR_BYTES == 100 * 2**20 and TRAJECTORIES_PER_CORE == 64
    assert default_trajectory_slots(24 * gib, env={}, cores=2) == 2 * TRAJECTORIES_PER_CORE == 128
    assert default_trajectory_slots(24 * gib, env={}, cores=16) == int(24 * gib * 0.8 // (100 * 2**20)) == 196
    assert default_trajectory_slots(24 * gib, env={}, cores=0) == TRAJECTORIES_PER_CORE


def test_backoff_doubles_to_its_cap_and_resets() -> None:
    b = Backoff(base_s=0.1, cap_s=1.0, jitter=False)
    assert [b.next() for _ in range(6)] == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    b.reset()
    assert b.next() == 0.1
    jittered = Backoff(base_s=0.1, cap_s=1.0, rand=lambda: 0.5)
    assert [jittered.next() for _ in range(3)] == [0.05, 0.1, 0.2]


async def test_an_outage_is_waited_out_until_its_budget_is_spent(clock: FakeClock) -> None:
    outage = Outage("reading", budget_s=10.0, backoff=Backoff(1.0, 4.0, jitter=False), clock=clock)
    attempts = {"n": 0}

    async def flaky() -> str:
        attempts["n"] += 1
        if attempts["n"] < 4:
            raise ConnectionError("refused")
        return "ok"

    task = asyncio.ensure_future(outage.call(flaky))
    while not task.done():
        await asyncio.sleep(0)
        clock.advance(0.5)
    assert task.result() == "ok" and outage.outages == 1 and not outage.ongoing

    async def down() -> str:
        raise ConnectionError("refused")

    task = asyncio.ensure_future(outage.call(down))
    started = clock.now()
    while not task.done():
        await asyncio.sleep(0)
        clock.advance(0.5)
    with pytest.raises(OutageExceeded, match="outage budget 10s"):
        task.result()
    assert clock.now() - started >= 10.0
