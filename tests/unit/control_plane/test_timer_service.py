"""The durable timer service over an in-memory timer store and stand-in trajectories: due timers fire once
into their trajectory and are completed; "not_due" and unreachable ones are claimed again after their lease;
replicas share the work through the lease; a slow trajectory never delays another's timers; Redis away is
waited out."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from cluster.timer_service import FIRED, GONE, NOT_DUE, UNKNOWN_TIMER, TimerConfig, TimerService
from cluster.timers import ClaimedTimer
from runtime.clock import FakeClock

CONFIG = TimerConfig(poll_s=0.5, lease_s=10.0)


@dataclass
class MemoryTimers:
    """``RedisTimerStore``'s claim/complete semantics in memory (``leases=False``: the protection off, a
    claim that does not move the timer, so every replica sees it)."""

    clock: FakeClock
    scores: dict[tuple[str, str], float] = field(default_factory=dict)
    leases: bool = True
    down: bool = False

    def schedule(self, tid: str, timer_id: str, due_at: float) -> None:
        self.scores[(tid, timer_id)] = due_at

    async def claim_due(self, now: float, lease_s: float, limit: int = 64) -> list[ClaimedTimer]:
        if self.down:
            raise ConnectionError("redis is down (fake)")
        due = sorted((s, k) for k, s in self.scores.items() if s <= now)[:limit]
        out = []
        for score, key in due:
            if self.leases:
                self.scores[key] = now + lease_s
            out.append(ClaimedTimer(key[0], key[1], score, now + lease_s if self.leases else score))
        return out

    async def complete(self, timer: ClaimedTimer) -> bool:
        key = (timer.trajectory_id, timer.timer_id)
        if self.scores.get(key) == timer.lease_until:
            del self.scores[key]
            return True
        return False


@dataclass
class StandIns:
    """Trajectories that answer ``fire_timer``: what each answers, and every call in order."""

    answers: dict[str, str] = field(default_factory=dict)
    fired: list[tuple[str, str]] = field(default_factory=list)
    fail: Callable[[str], bool] = lambda _tid: False
    gate: dict[str, asyncio.Event] = field(default_factory=dict)

    async def fire(self, trajectory_id: str, timer_id: str) -> str:
        if trajectory_id in self.gate:
            await self.gate[trajectory_id].wait()
        if self.fail(trajectory_id):
            raise ConnectionError(f"traj:{trajectory_id} unreachable")
        self.fired.append((trajectory_id, timer_id))
        return self.answers.get(trajectory_id, FIRED)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


async def run_until(
    services: list[TimerService], clock: FakeClock, until: Callable[[], bool], tick_s: float = 0.5
) -> None:
    tasks = [asyncio.ensure_future(s.run_forever()) for s in services]
    try:
        for _ in range(4000):
            for _ in range(20):
                await asyncio.sleep(0)
            if until():
                return
            clock.advance(tick_s)
        raise AssertionError("condition not reached")
    finally:
        for s in services:
            s.stop()
        await asyncio.wait_for(asyncio.gather(*tasks), 5.0)


async def test_due_timers_fire_into_their_trajectory_and_are_completed(clock: FakeClock) -> None:
    # Given timers of three trajectories: one due now, one later, one for a trajectory that ended
    store, targets = MemoryTimers(clock), StandIns(answers={"t-gone": GONE, "t-drop": UNKNOWN_TIMER})
    now = clock.wall()
    store.schedule("t-1", "expiry-1", now - 1)
    store.schedule("t-1", "deadline-2", now + 30)
    store.schedule("t-gone", "expiry-9", now - 5)
    store.schedule("t-drop", "backoff-3", now - 2)
    service = TimerService("timers:0", store, targets, CONFIG, clock)

    # When the service runs for 40 (fake) seconds
    await run_until([service], clock, lambda: clock.now() >= 1_040.0)

    # Then each fired once, in due order, and every one of them was completed (none left in the store)
    assert targets.fired == [
        ("t-gone", "expiry-9"),
        ("t-drop", "backoff-3"),
        ("t-1", "expiry-1"),
        ("t-1", "deadline-2"),
    ]
    assert store.scores == {}
    assert service.counts[FIRED] == 2 and service.counts[GONE] == 1 and service.counts[UNKNOWN_TIMER] == 1


async def test_not_due_and_unreachable_timers_are_claimed_again_after_their_lease(clock: FakeClock) -> None:
    # Given a timer the trajectory says is not due yet, and one whose trajectory is unreachable at first
    store = MemoryTimers(clock)
    reachable = {"t-2": False}
    targets = StandIns(answers={"t-1": NOT_DUE}, fail=lambda tid: tid == "t-2" and not reachable["t-2"])
    store.schedule("t-1", "hib-1", clock.wall() - 1)
    store.schedule("t-2", "expiry-2", clock.wall() - 1)
    service = TimerService("timers:0", store, targets, CONFIG, clock)

    # When it runs past one lease, then t-2 becomes reachable, and it runs past another
    def reachable_later_then_fired() -> bool:
        reachable["t-2"] = clock.now() >= 1_012.0
        return ("t-2", "expiry-2") in targets.fired

    await run_until([service], clock, reachable_later_then_fired)

    # Then the not-due timer is still stored (offered again after each lease), and the other fired once
    # it could be reached, and is gone
    assert targets.fired.count(("t-1", "hib-1")) >= 2 and ("t-1", "hib-1") in store.scores
    assert targets.fired.count(("t-2", "expiry-2")) == 1 and ("t-2", "expiry-2") not in store.scores
    assert service.counts["unreachable"] >= 1


@pytest.mark.parametrize("leases", [True, False], ids=["leased-claims", "protection-off"])
async def test_replicas_share_the_work_without_firing_a_timer_twice(clock: FakeClock, leases: bool) -> None:
    # Given 50 due timers and three service replicas over one store; a fire takes a moment
    store, targets = MemoryTimers(clock, leases=leases), StandIns()
    for i in range(50):
        store.schedule(f"t-{i}", f"expiry-{i}", clock.wall() - 1)
    services = [TimerService(f"timers:{n}", store, targets, CONFIG, clock) for n in range(3)]

    # When they run until every timer has fired
    await run_until(services, clock, lambda: len(set(targets.fired)) == 50)

    # Then each fired exactly once (the lease hides a claimed timer from the other replicas)
    if not leases:
        assert len(targets.fired) > 50  # control: without the lease, replicas fire the same timers
        return
    assert sorted(targets.fired) == sorted((f"t-{i}", f"expiry-{i}") for i in range(50))
    assert sum(s.claimed for s in services) == 50 and store.scores == {}


async def test_a_slow_trajectory_never_delays_another_trajectorys_timers(clock: FakeClock) -> None:
    store = MemoryTimers(clock)
    targets = StandIns(gate={"t-slow": asyncio.Event()})  # never set: its actor is not placed
    store.schedule("t-slow", "expiry-1", clock.wall() - 2)
    store.schedule("t-fast", "expiry-2", clock.wall() - 1)
    service = TimerService("timers:0", store, targets, CONFIG, clock)
    await run_until([service], clock, lambda: ("t-fast", "expiry-2") in targets.fired)
    assert targets.fired == [("t-fast", "expiry-2")] and ("t-fast", "expiry-2") not in store.scores


@pytest.mark.parametrize(
    ("budget_s", "survives"), [(300.0, True), (5.0, False)], ids=["budget", "protection-off"]
)
async def test_a_redis_outage_is_waited_out_within_the_budget(
    clock: FakeClock, budget_s: float, survives: bool
) -> None:
    # Given Redis is away for 30 (fake) seconds, with a timer due during the outage
    store, targets = MemoryTimers(clock, down=True), StandIns()
    store.schedule("t-1", "expiry-1", clock.wall() + 5)
    service = TimerService(
        "timers:0", store, targets, CONFIG.model_copy(update={"outage_budget_s": budget_s}), clock
    )
    task = asyncio.ensure_future(service.run_forever())
    try:
        while clock.now() < 1_030.0 and not task.done():
            await asyncio.sleep(0)
            clock.advance(0.25)
        store.down = False
        # When Redis is back
        for _ in range(400):
            await asyncio.sleep(0)
            if targets.fired or task.done():
                break
            clock.advance(0.25)
        # Then the timer fired after all; with a budget shorter than the outage the service gave up (control)
        if survives:
            assert targets.fired == [("t-1", "expiry-1")] and service.failed is None
        else:
            assert targets.fired == [] and service.failed is not None and "outage budget" in service.failed
    finally:
        service.stop()
        await asyncio.wait_for(task, 5.0)
