"""The durable timer service: fire due timers into whichever incarnation of their trajectory exists.

ARCHITECTURE.md, "Durable timers": expiries, deadlines, hibernation and backoff are timers the trajectory
stores in ``tether:timers`` (``cluster.timers.RedisTimerStore``). This service lives in the cluster (one or
more ``timers:<n>`` actors started beside the relays, never in the ``tether run`` driver) and:

1. claims due timers with a lease (``claim_due(now, lease_s)``: another replica does not see a claimed timer
   again until the lease lapses, so replicas share the work without firing a timer twice, except after a
   claimer died or was slower than its lease: delivery is at-least-once);
2. fires each into its trajectory, calling the trajectory actor's ``fire_timer(timer_id) -> str``
   ("fired", "not_due" or "unknown") on a live incarnation, waking a hibernated or dead one from its
   stored launch first, with the same admission as the relays (``actors.incarnation``); a trajectory's
   timers are fired one at a time in due order, different trajectories concurrently;
3. completes it (``complete(claimed)``) when it fired, when the trajectory no longer holds it ("unknown"),
   or when the trajectory ended or never existed. A "not_due" timer and one whose trajectory could not be
   reached are left leased: they are claimed again once the lease lapses.

Redis away: the loop waits within its outage budget (issue 13) instead of failing.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field

from actors import aio
from actors.incarnation import Incarnations, Reach
from actors.incarnation_ray import (
    RayActors,
    RedisTrajectories,
    ray_incarnations,
    ray_wake_gate,
    stop_named_actors,
)
from actors.outage import Outage, OutageExceeded, is_outage, pause
from actors.ports import ClusterPorts
from cluster.timers import ClaimedTimer, RedisTimerStore
from runtime.clock import Clock, SystemClock

__all__ = [
    "FIRED",
    "NOT_DUE",
    "UNKNOWN_TIMER",
    "DueTimers",
    "IncarnationTimers",
    "TimerConfig",
    "TimerService",
    "TimerServiceActor",
    "TimerTarget",
    "start_timer_services",
    "stop_timer_services",
    "timer_service_name",
]

log = logging.getLogger(__name__)

NAMESPACE = "tether"
FIRED, NOT_DUE, UNKNOWN_TIMER = "fired", "not_due", "unknown"  # what ``fire_timer`` answers
GONE = "gone"  # the trajectory ended or never existed: its timers are void


def timer_service_name(n: int) -> str:
    return f"timers:{n}"


class TimerConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    poll_s: float = Field(default=0.5, gt=0.0)  # how often due timers are looked for when none were
    lease_s: float = Field(default=30.0, gt=0.0)  # a claimed timer is this replica's for this long
    batch: int = Field(default=64, ge=1, le=10_000)
    max_inflight: int = Field(default=2_000, ge=1)  # timers claimed and not yet settled, at most
    fire_timeout_s: float = Field(default=30.0, gt=0.0)  # one fire_timer call to a placed actor
    wake_wait_s: float = Field(default=600.0, gt=0.0)  # a woken actor waiting for a free slot
    outage_budget_s: float = Field(default=300.0, ge=0.0)


class DueTimers(Protocol):
    """The service side of the timer store (``RedisTimerStore``)."""

    async def claim_due(self, now: float, lease_s: float, limit: int = 64) -> list[ClaimedTimer]: ...

    async def complete(self, timer: ClaimedTimer) -> bool: ...


class TimerTarget(Protocol):
    """Fires one timer into its trajectory: "fired", "not_due", "unknown" (the trajectory does not hold
    it) or "gone" (the trajectory ended or never existed). Raises when it could not be reached."""

    async def fire(self, trajectory_id: str, timer_id: str) -> str: ...


class IncarnationTimers:
    """``TimerTarget`` over ``actors.incarnation.Incarnations``: ``fire_timer`` on a live incarnation."""

    def __init__(self, incarnations: Incarnations) -> None:
        self.incarnations = incarnations

    async def fire(self, trajectory_id: str, timer_id: str) -> str:
        reached = await self.incarnations.call(trajectory_id, "fire_timer", timer_id)
        if reached.reach is not Reach.CALLED:
            return GONE
        return str(reached.value)


@dataclass(slots=True)
class _Lane:
    timers: collections.deque[ClaimedTimer] = field(default_factory=collections.deque)
    task: asyncio.Task[None] | None = None


class TimerService:
    """Claim due timers, fire them per trajectory, complete them (ports injected; see the module)."""

    def __init__(
        self,
        name: str,
        store: DueTimers,
        target: TimerTarget,
        config: TimerConfig | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.name = name
        self.store = store
        self.target = target
        self.config = config or TimerConfig()
        self.clock = clock or SystemClock()
        self.counts: dict[str, int] = {k: 0 for k in (FIRED, NOT_DUE, UNKNOWN_TIMER, GONE, "unreachable")}
        self.claimed = 0
        self.failed: str | None = None
        self._lanes: dict[str, _Lane] = {}
        self._inflight = 0
        self._stopping = asyncio.Event()
        self._outage = Outage(f"timer service {name}", budget_s=self.config.outage_budget_s, clock=self.clock)

    async def step(self) -> int:
        """Claim what is due now (up to the in-flight limit) and queue it; returns how many were claimed."""
        room = self.config.max_inflight - self._inflight
        if room <= 0:
            return 0
        claimed = await self.store.claim_due(
            self.clock.wall(), self.config.lease_s, min(room, self.config.batch)
        )
        self.claimed += len(claimed)
        for timer in claimed:
            self._queue(timer)
        return len(claimed)

    async def run_forever(self) -> None:
        """Loop until ``stop()``; Redis away is waited out within the outage budget."""
        try:
            while not self._stopping.is_set():
                try:
                    got = await self.step()
                except asyncio.CancelledError:
                    raise
                except Exception as e:
                    if not is_outage(e):
                        log.exception("%s: claiming due timers failed; retrying", self.name)
                    await self._outage.failed(e)
                    continue
                self._outage.ok()
                if got < self.config.batch:
                    await self._pause(self.config.poll_s)
        except OutageExceeded as e:
            self.failed = str(e)
            log.error("%s: giving up: %s", self.name, e)

    def stop(self) -> None:
        self._stopping.set()

    async def idle(self) -> None:
        """Wait until every claimed timer is settled (tests)."""
        while True:
            tasks = [lane.task for lane in self._lanes.values() if lane.task is not None]
            if not tasks:
                return
            await asyncio.gather(*tasks, return_exceptions=True)

    async def shutdown(self) -> None:
        tasks = [lane.task for lane in self._lanes.values() if lane.task is not None]
        await asyncio.gather(
            *(aio.stop(task, what="a timer lane", again_s=aio.ASK_AGAIN_S) for task in tasks)
        )

    def stats(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "claimed": self.claimed,
            "inflight": self._inflight,
            "outages": self._outage.outages,
            "outage_s": round(self._outage.lasted_s, 3),
            "failed": self.failed,
            **self.counts,
        }

    def _queue(self, timer: ClaimedTimer) -> None:
        lane = self._lanes.get(timer.trajectory_id)
        if lane is None:
            lane = self._lanes[timer.trajectory_id] = _Lane()
        for i, queued in enumerate(lane.timers):
            if queued.timer_id == timer.timer_id:
                lane.timers[i] = timer  # claimed again (its lease lapsed meanwhile): complete the new claim
                return
        lane.timers.append(timer)
        self._inflight += 1
        if lane.task is None or lane.task.done():
            lane.task = asyncio.ensure_future(self._serve(timer.trajectory_id, lane))

    async def _serve(self, trajectory_id: str, lane: _Lane) -> None:
        try:
            while lane.timers and not self._stopping.is_set():
                timer = lane.timers[0]
                await self._fire(timer)
                lane.timers.popleft()
                self._inflight -= 1
        finally:
            if self._lanes.get(trajectory_id) is lane and not lane.timers:
                del self._lanes[trajectory_id]

    async def _fire(self, timer: ClaimedTimer) -> None:
        try:
            answer = await self.target.fire(timer.trajectory_id, timer.timer_id)
        except Exception as e:  # not reachable now: the lease lapses and it is claimed again
            self.counts["unreachable"] += 1
            log.warning("%s: firing %s/%s failed: %r", self.name, timer.trajectory_id, timer.timer_id, e)
            return
        self.counts[answer if answer in self.counts else UNKNOWN_TIMER] += 1
        if answer == NOT_DUE:
            return  # the trajectory holds it for later: left leased, claimed again after the lease
        try:
            await self.store.complete(timer)
        except Exception as e:  # claimed again after the lease; the trajectory ignores a repeat
            log.warning("%s: completing %s/%s failed: %r", self.name, timer.trajectory_id, timer.timer_id, e)

    async def _pause(self, seconds: float) -> None:
        """Sleep on the injected clock, but wake at once on ``stop()``."""
        await pause(self.clock, seconds, self._stopping)


# --------------------------------------------------------------------------- the Ray shell


class TimerServiceActor:
    """Ray shell around ``TimerService`` (async actor ``timers:<n>``, ``num_cpus=0``).

    ``ensure_actor`` replaces how a trajectory's actor is created from its launch (tests stand in for the
    trajectory actor); by default it is ``actors.trajectory.ensure_actor`` with ``adapters``.
    """

    def __init__(
        self,
        name: str,
        redis_url: str,
        adapters: ClusterPorts,
        config: dict[str, Any] | None = None,
        ensure_actor: Callable[[Any], Any] | None = None,
    ) -> None:
        self._name = name
        self._redis_url = redis_url
        self._adapters = adapters
        self._config = TimerConfig.model_validate(config or {})
        self._ensure_actor = ensure_actor
        self._service: TimerService | None = None
        self._task: asyncio.Task[None] | None = None
        self._store: RedisTimerStore | None = None
        self._trajectories: RedisTrajectories | None = None
        self._incarnations: Incarnations | None = None

    async def start(self) -> bool:
        if self._task is not None and not self._task.done():
            return True
        cfg = self._config
        options: dict[str, Any] = {"call_timeout_s": cfg.fire_timeout_s, "wake_wait_s": cfg.wake_wait_s}
        if self._ensure_actor is None:
            self._incarnations, self._trajectories = ray_incarnations(
                self._redis_url, self._adapters, **options
            )
        else:
            self._trajectories = RedisTrajectories(self._redis_url)
            self._incarnations = Incarnations(
                RayActors(self._ensure_actor), self._trajectories.info, gate=ray_wake_gate(), **options
            )
        self._store = RedisTimerStore.from_url(self._redis_url)
        self._service = TimerService(self._name, self._store, IncarnationTimers(self._incarnations), cfg)
        self._task = asyncio.get_running_loop().create_task(self._service.run_forever())
        return True

    async def stop(self) -> dict[str, Any]:
        if self._service is not None:
            self._service.stop()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(self._task, self._config.poll_s + 5.0)
        if self._service is not None:
            await self._service.shutdown()
        stats = self.stats()
        for closer in (self._store, self._trajectories):
            if closer is not None:
                with contextlib.suppress(Exception):
                    await closer.close()
        self._store = self._trajectories = None
        return stats

    async def idle(self, timeout_s: float = 30.0) -> bool:
        if self._service is None:
            return True
        try:
            await asyncio.wait_for(self._service.idle(), timeout_s)
        except TimeoutError:
            return False
        return True

    def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = self._service.stats() if self._service is not None else {"name": self._name}
        stats["running"] = self._task is not None and not self._task.done()
        if self._incarnations is not None:
            stats["woken"] = self._incarnations.woken
            stats["replaced"] = self._incarnations.replaced
        return stats

    def pid(self) -> int:
        return os.getpid()


def start_timer_services(
    redis_url: str,
    n: int = 1,
    *,
    adapters: ClusterPorts,
    config: TimerConfig | Mapping[str, Any] | None = None,
    first: int = 0,
    ensure_actor: Callable[[Any], Any] | None = None,
) -> list[Any]:
    """Start (or find) ``timers:<first>`` .. ``timers:<first+n-1>`` and return their handles once running."""
    import ray

    if n < 1:
        raise ValueError(f"need at least one timer service, got n={n}")
    cfg = config if isinstance(config, TimerConfig) else TimerConfig.model_validate(dict(config or {}))
    remote: Any = ray.remote(TimerServiceActor)
    handles = [
        remote.options(
            name=timer_service_name(i),
            namespace=NAMESPACE,
            get_if_exists=True,
            num_cpus=0,
            max_concurrency=1000,
        ).remote(timer_service_name(i), redis_url, adapters, cfg.model_dump(), ensure_actor)
        for i in range(first, first + n)
    ]
    ray.get([h.start.remote() for h in handles])
    return handles


def stop_timer_services(handles: list[Any], *, timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """Stop timer services and return their counters (kill them if they do not answer)."""
    return stop_named_actors(handles, NAMESPACE, timeout_s=timeout_s)
