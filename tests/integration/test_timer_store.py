"""The durable timer store on a real redis-server: schedule, cancel, and the service's claim/complete
(one claimer per due timer until its lease lapses; a re-scheduled timer survives its old claim)."""

from __future__ import annotations

import pytest

from cluster.timers import RedisTimerStore
from runtime.errors import InputError

pytestmark = pytest.mark.integration


async def test_due_timers_are_claimed_once_until_the_lease_lapses(redis_url: str) -> None:
    # Given two timers, one due and one in the future
    store = RedisTimerStore.from_url(redis_url)
    other = RedisTimerStore.from_url(redis_url)
    try:
        await store.schedule("run.a", "deadline-1", 100.0)
        await store.schedule("run.b", "expiry-7", 500.0)
        # When two service replicas claim at t=200
        first = await store.claim_due(200.0, lease_s=30.0)
        second = await other.claim_due(200.0, lease_s=30.0)
        # Then only the due timer is handed out, to the first claimer only
        assert [(t.trajectory_id, t.timer_id, t.due_at) for t in first] == [("run.a", "deadline-1", 100.0)]
        assert second == []
        # and a claimer that died lets it be claimed again once the lease has lapsed
        again = await other.claim_due(231.0, lease_s=30.0)
        assert [t.timer_id for t in again] == ["deadline-1"]
        # the stale claim can no longer remove it; the current one can
        assert not await store.complete(first[0])
        assert await other.complete(again[0])
        assert await store.due_at("run.a", "deadline-1") is None
        assert await store.count() == 1
    finally:
        await store.close()
        await other.close()


async def test_a_rescheduled_timer_survives_its_old_claim_and_cancel_removes_it(redis_url: str) -> None:
    store = RedisTimerStore.from_url(redis_url)
    try:
        await store.schedule("run.a", "hib-3", 10.0)
        (claimed,) = await store.claim_due(20.0, lease_s=5.0)
        await store.schedule("run.a", "hib-3", 99.0)  # the trajectory moved it meanwhile
        assert not await store.complete(claimed)
        assert await store.due_at("run.a", "hib-3") == 99.0
        await store.cancel("run.a", "hib-3")
        await store.cancel("run.a", "hib-3")  # cancelling twice is harmless
        assert await store.due_at("run.a", "hib-3") is None
        with pytest.raises(InputError, match="timer id"):
            await store.schedule("run.a", "has space", 1.0)
    finally:
        await store.close()
