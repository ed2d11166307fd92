"""The guard (breaker + bulkhead per scope) through its async GuardPort shell, on a fake clock."""

from __future__ import annotations

import asyncio

import pytest

from breakers import (
    BreakerPolicy,
    BreakerState,
    BulkheadPolicy,
    GuardPolicy,
    InProcessGuard,
    QueuedPastDeadline,
)
from runtime.clock import FakeClock
from runtime.errors import BreakerOpen, BulkheadFull
from runtime.ports import GuardPermit, GuardPort, OutcomeClass

F = OutcomeClass.INFRASTRUCTURE_FAILURE
S = OutcomeClass.SUCCESS

POLICY = GuardPolicy(
    breaker=BreakerPolicy(
        window_size=10, min_samples=5, trip_threshold=0.5, cooldown_s=5.0, max_cooldown_s=80.0
    ),
    bulkhead=BulkheadPolicy(max_concurrent=4, max_queued=2, lease_s=60.0),
)


async def _settle(guard: InProcessGuard, permit: GuardPermit, outcome: OutcomeClass) -> None:
    await guard.record(permit, outcome)
    await guard.release(permit)


async def _trip(guard: InProcessGuard, clock: FakeClock, scope: str) -> None:
    for i in range(5):
        permit = await guard.admit(scope, f"{scope}-fail-{i}", clock.wall() + 30.0)
        await _settle(guard, permit, F)
    assert guard.snapshot(scope).state is BreakerState.OPEN


def test_in_process_guard_is_a_guard_port() -> None:
    assert isinstance(InProcessGuard(FakeClock()), GuardPort)


async def test_fifty_concurrent_callers_at_cooldown_end_get_exactly_one_probe() -> None:
    # Given a tripped scope whose cooldown has just ended
    clock = FakeClock()
    guard = InProcessGuard(clock, POLICY)
    await _trip(guard, clock, "test-service")
    clock.advance(5.0)
    # When 50 callers ask at the same moment
    results = await asyncio.gather(
        *(guard.admit("test-service", f"c{i}", clock.wall() + 30.0) for i in range(50)),
        return_exceptions=True,
    )
    # Then exactly one holds a permit and it is the probe; the rest are withheld with the scope named
    permits = [r for r in results if isinstance(r, GuardPermit)]
    refusals = [r for r in results if isinstance(r, BreakerOpen)]
    assert [p.probe for p in permits] == [True]
    assert len(refusals) == 49 and {r.scope for r in refusals} == {"test-service"}
    assert guard.snapshot("test-service").probes_claimed == 1


async def test_one_tenants_failures_do_not_lock_out_another() -> None:
    # Given tenant-scoped breakers on one environment service
    clock = FakeClock()
    guard = InProcessGuard(clock, POLICY)
    # When tenant a's calls keep failing
    await _trip(guard, clock, "env-service/tenant-a")
    # Then tenant a is withheld and tenant b is admitted as before
    with pytest.raises(BreakerOpen):
        await guard.admit("env-service/tenant-a", "a-next", clock.wall() + 30.0)
    permit = await guard.admit("env-service/tenant-b", "b-1", clock.wall() + 30.0)
    assert permit.scope == "env-service/tenant-b" and not permit.probe
    assert guard.snapshot("env-service/tenant-b").state is BreakerState.CLOSED


async def test_queued_admission_waits_for_a_release_and_does_not_block_it() -> None:
    # Given a full concurrency cap
    clock = FakeClock()
    guard = InProcessGuard(clock, POLICY)
    held = [await guard.admit("svc", f"h{i}", clock.wall() + 30.0) for i in range(4)]
    # When a fifth caller queues, and a held call records and releases meanwhile
    waiter = asyncio.create_task(guard.admit("svc", "queued", clock.wall() + 30.0))
    await asyncio.sleep(0)
    assert guard.snapshot("svc").queued == 1 and not waiter.done()
    await _settle(guard, held[0], S)
    # Then the waiter is granted the freed slot
    permit = await asyncio.wait_for(waiter, timeout=5)
    assert permit.scope == "svc"
    assert (guard.snapshot("svc").in_flight, guard.snapshot("svc").queued) == (4, 0)


async def test_both_caps_full_fails_fast() -> None:
    clock = FakeClock()
    guard = InProcessGuard(clock, POLICY)
    for i in range(4):
        await guard.admit("svc", f"h{i}", clock.wall() + 30.0)
    waiters = [asyncio.create_task(guard.admit("svc", f"q{i}", clock.wall() + 30.0)) for i in range(2)]
    await asyncio.sleep(0)
    with pytest.raises(BulkheadFull) as full:
        await guard.admit("svc", "overflow", clock.wall() + 30.0)
    assert (full.value.in_flight, full.value.queued) == (4, 2)
    for w in waiters:
        w.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)
    assert guard.snapshot("svc").queued == 0


async def test_queued_call_past_its_deadline_is_refused_not_dispatched() -> None:
    # Given a full cap and a queued call with a 3 s deadline
    clock = FakeClock()
    guard = InProcessGuard(clock, POLICY)
    held = [await guard.admit("svc", f"h{i}", clock.wall() + 30.0) for i in range(4)]
    waiter = asyncio.create_task(guard.admit("svc", "hasty", clock.wall() + 3.0))
    await asyncio.sleep(0)
    # When 3 s pass before any slot frees
    clock.advance(3.0)
    # Then the caller is told its deadline passed, and a later release grants nothing to it
    with pytest.raises(QueuedPastDeadline):
        await asyncio.wait_for(waiter, timeout=5)
    await guard.release(held[0])
    assert (guard.snapshot("svc").in_flight, guard.snapshot("svc").queued) == (3, 0)


async def test_trip_refuses_everything_still_queued() -> None:
    # Given a full cap with two queued callers
    clock = FakeClock()
    guard = InProcessGuard(
        clock, POLICY.model_copy(update={"bulkhead": BulkheadPolicy(max_concurrent=5, max_queued=2)})
    )
    held = [await guard.admit("svc", f"h{i}", clock.wall() + 30.0) for i in range(5)]
    waiters = [asyncio.create_task(guard.admit("svc", f"q{i}", clock.wall() + 30.0)) for i in range(2)]
    await asyncio.sleep(0)
    # When the in-flight calls fail and the breaker trips
    for permit in held:
        await guard.record(permit, F)
    # Then the queued callers are refused at once with the breaker's answer
    results = await asyncio.gather(*waiters, return_exceptions=True)
    assert all(isinstance(r, BreakerOpen) for r in results)


async def test_late_old_generation_success_does_not_close_a_reopened_guard() -> None:
    # Given a probe that failed (reopened) and a call admitted before the trip still in flight
    clock = FakeClock()
    guard = InProcessGuard(clock, POLICY)
    old = await guard.admit("svc", "old", clock.wall() + 600.0)
    await _trip(guard, clock, "svc")
    clock.advance(5.0)
    probe = await guard.admit("svc", "probe", clock.wall() + 30.0)
    await _settle(guard, probe, F)
    # When the pre-trip call and the failed probe both report success late
    effects = [await guard.record_effect(old, S), await guard.record_effect(probe, S)]
    # Then neither changes the breaker
    assert [e.value for e in effects] == ["stale", "ignored"]
    assert guard.snapshot("svc").state is BreakerState.OPEN


async def test_probe_released_without_outcome_reopens() -> None:
    clock = FakeClock()
    guard = InProcessGuard(clock, POLICY)
    await _trip(guard, clock, "svc")
    clock.advance(5.0)
    probe = await guard.admit("svc", "probe", clock.wall() + 30.0)
    await guard.release(probe)
    snap = guard.snapshot("svc")
    assert (snap.state, snap.cooldown_s) == (BreakerState.OPEN, 10.0)


async def test_reclaim_frees_expired_leases_for_waiters() -> None:
    # Given a full cap whose holders vanished, and a waiter
    clock = FakeClock()
    guard = InProcessGuard(clock, POLICY)
    for i in range(4):
        await guard.admit("svc", f"h{i}", clock.wall() + 600.0)
    waiter = asyncio.create_task(guard.admit("svc", "w", clock.wall() + 600.0))
    await asyncio.sleep(0)
    # When the leases expire and the guard reclaims
    clock.advance(61.0)
    reclaimed = guard.reclaim()
    # Then the waiter gets a slot
    assert len(reclaimed) == 4
    assert (await asyncio.wait_for(waiter, timeout=5)).scope == "svc"


# ----------------------------------------------------------------------------- gradual restore (§12.7.1)


def _restoring_policy(restore_s: float) -> GuardPolicy:
    return GuardPolicy(
        breaker=POLICY.breaker.model_copy(update={"restore_s": restore_s, "restore_start_share": 0.1}),
        bulkhead=BulkheadPolicy(max_concurrent=20, max_queued=40, lease_s=60.0),
    )


async def _closed_by_probe(guard: InProcessGuard, clock: FakeClock, scope: str) -> None:
    await _trip(guard, clock, scope)
    clock.advance(5.0)
    probe = await guard.admit(scope, "probe", clock.wall() + 30.0)
    assert probe.probe
    await _settle(guard, probe, S)
    assert guard.snapshot(scope).state is BreakerState.CLOSED


@pytest.mark.parametrize(
    ("restore_s", "dispatched_at_once"),
    [
        (10.0, 2),  # a tenth of the 20 slots: the rest wait in the queue
        (0.0, 20),  # control, the restore off: every caller that waited out the outage lands at once
    ],
)
async def test_after_the_close_the_dependency_sees_the_waiting_callers_gradually(
    restore_s: float, dispatched_at_once: int
) -> None:
    # Given a scope that just closed on a successful probe
    clock = FakeClock()
    guard = InProcessGuard(clock, _restoring_policy(restore_s))
    await _closed_by_probe(guard, clock, "test-service")
    # When 30 callers that waited out the outage arrive together
    calls = [
        asyncio.ensure_future(guard.admit("test-service", f"c{i}", clock.wall() + 60.0)) for i in range(30)
    ]
    await asyncio.sleep(0)
    # Then the bulkhead's own count of held slots is the ramped cap, and nobody was refused
    snap = guard.snapshot("test-service")
    assert (snap.in_flight, snap.queued) == (dispatched_at_once, 30 - dispatched_at_once)
    assert snap.concurrency_limit == dispatched_at_once
    for call in calls:
        call.cancel()
    await asyncio.gather(*calls, return_exceptions=True)


async def test_the_ramped_cap_grows_with_time_and_lets_the_queue_in() -> None:
    # Given a restoring scope with its ramped cap full and callers queued behind it
    clock = FakeClock()
    guard = InProcessGuard(clock, _restoring_policy(10.0))
    await _closed_by_probe(guard, clock, "test-service")
    calls = [
        asyncio.ensure_future(guard.admit("test-service", f"c{i}", clock.wall() + 60.0)) for i in range(30)
    ]
    await asyncio.sleep(0)
    # When half the restore has passed and the guard's reclaim tick runs (no call has finished)
    clock.advance(5.0)
    guard.reclaim()
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    # Then the cap is 55 % of 20 slots and the queue's head was let in up to it
    snap = guard.snapshot("test-service")
    assert (snap.concurrency_limit, snap.in_flight, snap.queued) == (11, 11, 19)
    # And once the restore is over, a call's settlement lets in everyone the full cap holds
    clock.advance(5.0)
    held = [c.result() for c in calls if c.done()]
    await _settle(guard, held[0], S)
    await asyncio.sleep(0)
    snap = guard.snapshot("test-service")
    assert (snap.concurrency_limit, snap.in_flight, snap.queued) == (20, 20, 9)
    for call in calls:
        call.cancel()
    await asyncio.gather(*calls, return_exceptions=True)


async def test_a_trip_during_the_restore_refuses_the_queue_and_lengthens_the_cooldown() -> None:
    # Given a restoring scope with callers queued behind its ramped cap
    clock = FakeClock()
    guard = InProcessGuard(clock, _restoring_policy(10.0))
    await _closed_by_probe(guard, clock, "test-service")
    calls = [
        asyncio.ensure_future(guard.admit("test-service", f"c{i}", clock.wall() + 60.0)) for i in range(30)
    ]
    await asyncio.sleep(0)
    # When the dependency fails again: the admitted calls fail and the window fills up
    clock.advance(1.0)
    for _ in range(3):
        await asyncio.sleep(0)
        for permit in [c.result() for c in calls if c.done() and not c.exception()]:
            await _settle(guard, permit, F)
        await asyncio.sleep(0)
        if guard.snapshot("test-service").state is BreakerState.OPEN:
            break
    results = await asyncio.gather(*calls, return_exceptions=True)
    # Then the scope is open again, the queue was refused, not dispatched, and the next cooldown doubled
    snap = guard.snapshot("test-service")
    assert snap.state is BreakerState.OPEN
    assert snap.cooldown_s == 10.0
    assert sum(isinstance(r, BreakerOpen) for r in results) >= 20


async def test_settle_records_the_outcome_and_frees_the_slot_in_one_step() -> None:
    # Given a scope whose calls finish with settle (what the interpreter sends: one guard round trip)
    clock = FakeClock()
    guard = InProcessGuard(clock, POLICY)

    async def fail(i: int) -> None:
        permit = await guard.admit("svc", f"fail-{i}", clock.wall() + 30.0)
        await guard.settle(permit, F)

    # When four calls fail and each is settled
    for i in range(4):
        await fail(i)
    # Then every outcome counted and no slot is still held
    snap = guard.snapshot("svc")
    assert (snap.state, snap.window_failures, snap.in_flight) == (BreakerState.CLOSED, 4, 0)
    # And the fifth failure trips the breaker, as a recorded one does
    await fail(4)
    assert guard.snapshot("svc").state is BreakerState.OPEN


async def test_settle_without_an_outcome_only_releases() -> None:
    clock = FakeClock()
    guard = InProcessGuard(clock, POLICY)
    permit = await guard.admit("svc", "c1", clock.wall() + 30.0)
    await guard.settle(permit, None)
    snap = guard.snapshot("svc")
    assert (snap.window_size, snap.in_flight) == (0, 0)


async def test_settle_releases_the_permit_even_when_recording_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    guard = InProcessGuard(clock, POLICY)
    permit = await guard.admit("svc", "c1", clock.wall() + 30.0)

    async def broken(*_: object) -> None:
        raise RuntimeError("recording failed")

    monkeypatch.setattr(guard, "record_effect", broken)
    with pytest.raises(RuntimeError, match="recording failed"):
        await guard.settle(permit, S)
    assert guard.snapshot("svc").in_flight == 0
