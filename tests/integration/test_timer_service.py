"""The durable timer service as Ray actors (``timers:<n>``) on a real Redis, firing into stand-in trajectory
actors that expose ``fire_timer`` and record every call in Redis (the real trajectory actor's ``fire_timer``
is wired in by the trajectory core):

- two replicas fire every due timer once, into live trajectories and into hibernated ones (no actor: the
  service re-creates it from its stored launch first); future timers wait; every fired timer is completed;
- a redis-server restart mid-run is waited out and the timers due meanwhile still fire (control: with an
  outage budget shorter than the outage the service gives up and they do not).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import ray
import redis.asyncio as aioredis

from actors.launch import ProviderLaunch, TrajectoryLaunch, save_launch
from cluster.adapters import ClusterAdapters
from cluster.redis_server import RedisServer
from cluster.timer_service import start_timer_services, stop_timer_services
from cluster.timers import RedisTimerStore
from tests.integration.test_control_plane import eventually

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.usefixtures("ray_local")]

FAST = {"poll_s": 0.1, "lease_s": 30.0, "fire_timeout_s": 20.0}


def stand_in_factory() -> Callable[[Any], Any]:
    """``ensure_actor`` for stand-in trajectories (built here so Ray ships it by value to the service)."""

    class StandIn:
        def __init__(self, trajectory_id: str, redis_url: str) -> None:
            import os

            self.tid = trajectory_id
            self.url = redis_url
            self.pid = os.getpid()

        async def fire_timer(self, timer_id: str) -> str:
            import redis.asyncio as aioredis

            client = aioredis.Redis.from_url(self.url)
            try:
                await client.rpush(f"standin:{self.tid}", f"{self.pid}:{timer_id}")
            finally:
                await client.aclose()
            return "fired"

        async def run(self) -> None:
            import asyncio

            await asyncio.Event().wait()  # runs until killed (the test kills every stand-in)

    def ensure(launch: Any) -> Any:
        import ray

        return (
            ray.remote(StandIn)
            .options(name=f"traj:{launch.trajectory_id}", namespace="tether", get_if_exists=True, num_cpus=0)
            .remote(launch.trajectory_id, launch.redis_url)
        )

    return ensure


@pytest.fixture
async def world(redis_url: str) -> AsyncIterator[dict[str, Any]]:
    store = RedisTimerStore.from_url(redis_url)
    raw = aioredis.Redis.from_url(redis_url)
    state: dict[str, Any] = {"store": store, "raw": raw, "services": [], "tids": []}
    try:
        yield state
    finally:
        stop_timer_services(state["services"])
        for tid in state["tids"]:
            try:
                ray.kill(ray.get_actor(f"traj:{tid}", namespace="tether"), no_restart=True)
            except ValueError:
                continue
        await store.close()
        await raw.aclose()


def launch(url: str) -> str:
    tid = f"t-{uuid.uuid4().hex[:10]}"
    save_launch(
        url,
        TrajectoryLaunch(
            trajectory_id=tid,
            goal="wait for timers",
            ceilings={"tokens": 1_000},
            created_at=time.time(),
            provider=ProviderLaunch(base_url="http://127.0.0.1:9/v1", model="sim"),
            redis_url=url,
        ),
    )
    return tid


async def fired(raw: aioredis.Redis, tid: str) -> list[str]:
    return [v.decode().split(":", 1)[1] for v in await raw.lrange(f"standin:{tid}", 0, -1)]


async def test_replicas_fire_every_due_timer_once_into_live_and_hibernated_trajectories(
    redis_url: str, world: dict[str, Any]
) -> None:
    # Given ten trajectories with stored launches: five live (their stand-in actors run), five hibernated
    # (no actor); three due timers and one future timer each
    ensure = stand_in_factory()
    tids = world["tids"] = [launch(redis_url) for _ in range(10)]
    live = {tid: ensure(_launch_of(redis_url, tid)) for tid in tids[:5]}
    for handle in live.values():
        handle.run.remote()
    now = time.time()
    store: RedisTimerStore = world["store"]
    for tid in tids:
        for k in range(3):
            await store.schedule(tid, f"due-{k}", now - 10 + k)
        await store.schedule(tid, "later", now + 3600)

    # When two timer service replicas run
    world["services"] = start_timer_services(
        redis_url, 2, adapters=ClusterAdapters(), config=FAST, ensure_actor=ensure
    )

    async def all_fired() -> bool:
        return all([len(await fired(world["raw"], tid)) >= 3 for tid in tids])

    await eventually(all_fired, "every due timer to fire", timeout_s=120.0)
    await eventually(lambda: _settled(world["services"]), "the services to settle", timeout_s=30.0)

    # Then each due timer fired exactly once, in due order, into one incarnation per trajectory; the
    # hibernated trajectories were woken for it; only the future timers are left
    for tid in tids:
        assert await fired(world["raw"], tid) == ["due-0", "due-1", "due-2"]
    assert await store.count() == 10
    assert [await store.due_at(t, "later") is not None for t in tids] == [True] * 10
    stats = [ray.get(s.stats.remote()) for s in world["services"]]
    assert sum(s["fired"] for s in stats) == 30 and sum(s["woken"] for s in stats) == 5
    for tid in tids[5:]:
        assert ray.get_actor(f"traj:{tid}", namespace="tether") is not None


@pytest.mark.parametrize(
    ("budget_s", "survives"), [(300.0, True), (1.0, False)], ids=["budget", "protection-off"]
)
async def test_the_service_rides_out_a_redis_restart(
    redis_server: RedisServer, redis_url: str, world: dict[str, Any], budget_s: float, survives: bool
) -> None:
    # Given a running service and a live stand-in trajectory with a timer due in a few seconds
    ensure = stand_in_factory()
    tid = launch(redis_url)
    world["tids"] = [tid]
    ensure(_launch_of(redis_url, tid)).run.remote()
    config = {**FAST, "outage_budget_s": budget_s}
    world["services"] = start_timer_services(
        redis_url, 1, adapters=ClusterAdapters(), config=config, ensure_actor=ensure
    )
    service = world["services"][0]
    await world["store"].schedule(tid, "expiry-1", time.time() + 2.0)

    # When redis-server stops for a few seconds (the timer falls due meanwhile) and comes back
    redis_server.stop()
    if survives:
        await eventually(lambda: _value(_stats(service)["outage_s"] >= 3.0), "a 3 s outage", timeout_s=60.0)
    else:
        await eventually(lambda: _value(_stats(service)["failed"]), "the service to give up", timeout_s=60.0)
    redis_server.start()

    # Then the timer fires after all (the control: the service gave up, the timer stays stored, unfired)
    if not survives:
        stats = _stats(service)
        assert "outage budget" in stats["failed"] and not stats["running"]
        # fresh connections: the old ones died with the server
        raw, store = aioredis.Redis.from_url(redis_url), RedisTimerStore.from_url(redis_url)
        try:
            assert await fired(raw, tid) == [] and await store.count() == 1
        finally:
            await raw.aclose()
            await store.close()
        return
    raw = world["raw"] = aioredis.Redis.from_url(redis_url)  # the old connection died with the server
    await eventually(lambda: fired(raw, tid), "the timer to fire after the restart", timeout_s=60.0)
    assert await fired(raw, tid) == ["expiry-1"]
    stats = _stats(service)
    assert stats["failed"] is None and stats["outages"] >= 1


def _launch_of(url: str, tid: str) -> TrajectoryLaunch:
    from actors.launch import load_launch

    found = load_launch(url, tid)
    assert found is not None
    return found


def _stats(handle: Any) -> dict[str, Any]:
    return dict(ray.get(handle.stats.remote()))


async def _settled(services: list[Any]) -> bool:
    return all(_stats(s)["inflight"] == 0 for s in services)


async def _value(v: Any) -> Any:
    await asyncio.sleep(0)
    return v
