"""Bulkhead: concurrency and queue caps, deadlines in the queue, leases (recovery chapter §12.7.3)."""

from __future__ import annotations

import pytest

from breakers.bulkhead import Bulkhead, BulkheadPolicy, Lease, QueueTicket
from breakers.errors import QueuedPastDeadline
from runtime.clock import FakeClock
from runtime.errors import BulkheadFull, PolicyRefusal


def _bulkhead(
    max_concurrent: int = 64, max_queued: int = 32, lease_s: float = 300.0
) -> tuple[FakeClock, Bulkhead]:
    clock = FakeClock()
    return clock, Bulkhead(
        "test-service",
        BulkheadPolicy(max_concurrent=max_concurrent, max_queued=max_queued, lease_s=lease_s),
        clock,
    )


def test_napkin_math_12_4_burst_rejects_160_of_256() -> None:
    # Given a dependency capped at 64 occupied workers and 32 waiting requests
    clock, bulkhead = _bulkhead(64, 32)
    deadline = clock.wall() + 60.0
    # When 256 trajectories each submit one blocking call and none finishes during the burst
    leased, queued, rejected = 0, 0, []
    for i in range(256):
        try:
            placed = bulkhead.offer(f"call-{i}", deadline, holder=f"traj-{i}")
        except BulkheadFull as full:
            rejected.append(full)
            continue
        leased += isinstance(placed, Lease)
        queued += isinstance(placed, QueueTicket)
    # Then 64 run, 32 wait, 160 are rejected before dispatch, each told why
    assert (leased, queued, len(rejected)) == (64, 32, 160)
    assert (bulkhead.in_flight, bulkhead.queued) == (64, 32)
    assert all(isinstance(r, PolicyRefusal) and (r.in_flight, r.queued) == (64, 32) for r in rejected)
    assert "test-service" in str(rejected[0])


def test_release_promotes_the_oldest_waiter() -> None:
    # Given one slot taken and two waiters
    clock, bulkhead = _bulkhead(1, 2)
    deadline = clock.wall() + 60.0
    running = bulkhead.offer("a", deadline)
    first = bulkhead.offer("b", deadline)
    bulkhead.offer("c", deadline)
    assert isinstance(running, Lease) and isinstance(first, QueueTicket)
    # When the running call releases
    promotions = bulkhead.release(running.lease_id)
    # Then the first waiter holds the slot, the second still waits
    assert [t.call_id for t, _ in promotions.granted] == ["b"]
    assert (bulkhead.in_flight, bulkhead.queued) == (1, 1)


def test_nothing_queued_is_dispatched_after_its_deadline() -> None:
    # Given a waiter with a 5 s deadline behind a busy slot, and a patient one behind it
    clock, bulkhead = _bulkhead(1, 2)
    running = bulkhead.offer("a", clock.wall() + 60.0)
    assert isinstance(running, Lease)
    bulkhead.offer("hasty", clock.wall() + 5.0)
    bulkhead.offer("patient", clock.wall() + 60.0)
    # When the slot frees only after 6 s
    clock.advance(6.0)
    promotions = bulkhead.release(running.lease_id)
    # Then the expired waiter is dropped, not dispatched; the next one gets the slot
    assert [t.call_id for t in promotions.expired] == ["hasty"]
    assert [t.call_id for t, _ in promotions.granted] == ["patient"]


def test_a_call_already_past_its_deadline_is_refused_at_admission() -> None:
    clock, bulkhead = _bulkhead()
    with pytest.raises(QueuedPastDeadline, match="deadline"):
        bulkhead.offer("late", clock.wall())
    assert bulkhead.in_flight == 0


def test_expired_lease_is_reclaimed_and_its_slot_reused() -> None:
    # Given a holder that took the only slot and then went silent, and a waiter
    clock, bulkhead = _bulkhead(1, 1, lease_s=30.0)
    stuck = bulkhead.offer("stuck", clock.wall() + 600.0, holder="dead-traj")
    bulkhead.offer("next", clock.wall() + 600.0, holder="live-traj")
    # When the lease expires and the guard reclaims
    clock.advance(31.0)
    promotions = bulkhead.reclaim()
    # Then the stuck lease is reclaimed and the waiter holds the slot
    assert [lease.call_id for lease in promotions.reclaimed] == ["stuck"]
    assert [t.call_id for t, _ in promotions.granted] == ["next"]
    assert isinstance(stuck, Lease) and bulkhead.lease(stuck.lease_id) is None


def test_lease_of_a_dead_holder_is_reclaimed_before_expiry() -> None:
    # Given two running calls, one whose holder died
    clock, bulkhead = _bulkhead(2, 0)
    deadline = clock.wall() + 600.0
    bulkhead.offer("orphan", deadline, holder="dead-traj")
    bulkhead.offer("fine", deadline, holder="live-traj")
    # When the guard reclaims with a liveness predicate
    promotions = bulkhead.reclaim(lambda holder: holder != "dead-traj")
    # Then only the dead holder's slot is freed
    assert [lease.holder for lease in promotions.reclaimed] == ["dead-traj"]
    assert bulkhead.in_flight == 1


def test_renewed_lease_survives_past_the_original_expiry() -> None:
    clock, bulkhead = _bulkhead(1, 0, lease_s=30.0)
    lease = bulkhead.offer("long", clock.wall() + 600.0)
    assert isinstance(lease, Lease)
    clock.advance(20.0)
    bulkhead.renew(lease.lease_id)
    clock.advance(20.0)
    assert bulkhead.reclaim().reclaimed == ()
    assert bulkhead.in_flight == 1


def test_reclaim_drops_waiters_past_their_deadline() -> None:
    clock, bulkhead = _bulkhead(1, 1)
    bulkhead.offer("a", clock.wall() + 600.0)
    bulkhead.offer("b", clock.wall() + 5.0)
    clock.advance(6.0)
    assert [t.call_id for t in bulkhead.reclaim().expired] == ["b"]
    assert bulkhead.queued == 0


def test_release_of_unknown_lease_is_a_no_op() -> None:
    _, bulkhead = _bulkhead()
    assert bulkhead.release("nope").granted == ()
