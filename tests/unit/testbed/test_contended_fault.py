"""The load-dependent service time knob of the testbed tool services (``FaultMode.CONTENDED``) and the
per-service door counters, on a fake clock."""

from __future__ import annotations

import asyncio

from actors.tools_grpc.codec import ToolCall
from actors.tools_grpc.server import ToolContext
from runtime.clock import FakeClock
from testbed.tools.faults import FaultInjector, FaultMode, FaultPlan

SERVICE = "package-search"


def call(i: int) -> ToolCall:
    return ToolCall("search_packages", {"query": "x"}, f"k{i}", f"op{i}", f"a{i}", 0.0, "t", f"c{i}", 0)


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def test_service_time_grows_with_the_calls_in_service() -> None:
    # Given a contended service: 1 s plus 0.5 s for every other call in service
    clock = FakeClock()
    injector = FaultInjector(
        {"search_packages": SERVICE},
        {SERVICE: FaultPlan(mode=FaultMode.CONTENDED, delay_s=1.0, per_call_s=0.5)},
    )
    # When three calls arrive together
    tasks = [
        asyncio.ensure_future(injector.before_effect(call(i), ToolContext(call(i), clock.now() + 60, clock)))
        for i in range(3)
    ]
    await settle()
    door = injector.door(SERVICE)
    assert (door.arrivals, door.in_service, door.peak_in_service) == (3, 3, 3)
    # Then the first is done after 1 s, the second after 1.5 s, the third after 2 s
    finished = []
    for step in (1.0, 0.5, 0.5):
        clock.advance(step)
        await settle()
        finished.append(sum(t.done() for t in tasks))
    assert finished == [1, 2, 3]
    assert injector.door(SERVICE).finished == 3


async def test_work_whose_caller_left_keeps_its_place() -> None:
    # Given a contended service and a call whose caller gives up (the server's effect task is shielded)
    clock = FakeClock()
    injector = FaultInjector(
        {"search_packages": SERVICE},
        {SERVICE: FaultPlan(mode=FaultMode.CONTENDED, delay_s=5.0, per_call_s=1.0)},
    )
    orphan = asyncio.ensure_future(
        injector.before_effect(call(0), ToolContext(call(0), clock.now() + 1, clock))
    )
    waiter = asyncio.ensure_future(asyncio.shield(orphan))
    await settle()
    waiter.cancel()
    clock.advance(1.0)
    await settle()
    # When a new call arrives
    late = asyncio.ensure_future(
        injector.before_effect(call(1), ToolContext(call(1), clock.now() + 60, clock))
    )
    await settle()
    # Then the orphan still counts: the newcomer's service time includes it
    assert injector.door(SERVICE).in_service == 2
    clock.advance(5.0)
    await settle()
    assert orphan.done() and not late.done()
    clock.advance(1.0)
    await settle()
    assert late.done()


async def test_every_call_is_counted_at_the_door_even_without_a_fault() -> None:
    injector = FaultInjector({"search_packages": SERVICE})
    clock = FakeClock()
    for i in range(4):
        await injector.before_effect(call(i), ToolContext(call(i), clock.now() + 60, clock))
    door = injector.door(SERVICE)
    assert (door.arrivals, door.finished, door.in_service) == (4, 4, 0)


def aimed_call(i: int, trajectory: str) -> ToolCall:
    return ToolCall(
        "search_packages", {"query": "x"}, f"k{i}", f"op{i}", f"a{i}", 0.0, trajectory, f"c{i}", 0
    )


async def test_a_contended_rule_among_rules_aims_at_its_trajectories_and_the_door_counts_everyone() -> None:
    # Given a list of rules: a contended one for trajectory "slow" only, then a failure nobody matches
    clock = FakeClock()
    injector = FaultInjector(
        {"search_packages": SERVICE},
        {
            SERVICE: [
                FaultPlan(
                    mode=FaultMode.CONTENDED, delay_s=2.0, per_call_s=1.0, trajectories=frozenset({"slow"})
                ),
                FaultPlan(mode=FaultMode.FAIL, status="UNAVAILABLE", trajectories=frozenset({"nobody"})),
            ]
        },
    )
    # When a call of "run1.slow" and one of "run1.fast" arrive together
    slow = asyncio.ensure_future(
        injector.before_effect(aimed_call(0, "run1.slow"), ToolContext(call(0), clock.now() + 60, clock))
    )
    fast = asyncio.ensure_future(
        injector.before_effect(aimed_call(1, "run1.fast"), ToolContext(call(1), clock.now() + 60, clock))
    )
    await settle()
    # Then only the aimed trajectory waits (2 s: nothing else was in service when it arrived), and both
    # passed the door
    assert fast.done() and not slow.done()
    assert injector.door(SERVICE).arrivals == 2
    clock.advance(1.5)
    await settle()
    assert not slow.done()
    clock.advance(0.5)
    await settle()
    assert slow.done() and slow.exception() is None
    assert injector.door(SERVICE).finished == 2
