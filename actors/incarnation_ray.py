"""``actors.incarnation`` over the real thing: trajectory actors on Ray, launches and status in Redis.

- ``RayActors`` is the ``ActorRuntime`` of named trajectory actors (``traj:<id>`` in namespace ``tether``);
  Ray's blocking GCS calls run on a worker thread, so an async caller's event loop is never held up.
- ``RedisTrajectories`` reads what waking needs: the launch record (cached) and the last shown state.
- ``ray_wake_gate`` sizes the wake admission of a process on this cluster, ``ray_incarnations`` puts it all
  together for the relays and the timer service.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Callable
from typing import Any

from actors.incarnation import (
    NAMESPACE,
    TRAJECTORIES_PER_CORE,
    TRAJECTORY_ACTOR_BYTES,
    TRAJECTORY_RESOURCE,
    ActorBusy,
    ActorGone,
    Incarnations,
    TrajectoryInfo,
    WakeGate,
)
from runtime.clock import Clock, SystemClock

__all__ = ["RayActors", "RedisTrajectories", "ray_incarnations", "ray_wake_gate", "stop_named_actors"]


class RayActors:
    """``ActorRuntime`` over Ray: trajectory actors are named ``traj:<id>`` in namespace ``tether``.

    ``ensure_actor`` is ``actors.trajectory.ensure_actor`` bound to the cluster's ports (passed in so this
    module does not import the trajectory actor, and tests can stand in for it).
    """

    def __init__(self, ensure_actor: Callable[[Any], Any], namespace: str = NAMESPACE) -> None:
        self.ensure_actor = ensure_actor
        self.namespace = namespace

    # Ray's name lookups, actor creation and kills are blocking calls to the GCS: they run on a worker thread
    # so a relay's event loop keeps serving other trajectories' lanes meanwhile.

    async def lookup(self, trajectory_id: str) -> Any | None:
        return await asyncio.to_thread(self._lookup, trajectory_id)

    def _lookup(self, trajectory_id: str) -> Any | None:
        import ray

        try:
            return ray.get_actor(f"traj:{trajectory_id}", namespace=self.namespace)
        except ValueError:
            return None

    async def create(self, launch: Any) -> Any:
        return await asyncio.to_thread(self.ensure_actor, launch)

    async def kill(self, handle: Any) -> None:
        await asyncio.to_thread(self._kill, handle)

    @staticmethod
    def _kill(handle: Any) -> None:
        import ray

        with contextlib.suppress(Exception):  # gone already: nothing to free
            ray.kill(handle, no_restart=True)

    async def call(self, handle: Any, method: str, *args: Any) -> Any:
        import ray.exceptions

        try:
            return await getattr(handle, method).remote(*args)
        except ray.exceptions.ActorUnavailableError as e:  # restarting after a crash: it comes back
            raise ActorBusy(str(e)) from e
        except ray.exceptions.RayActorError as e:  # ActorDiedError and kin: dead for good
            raise ActorGone(str(e)) from e
        except ray.exceptions.RayTaskError as e:  # the method raised (e.g. "hibernating; deliver again")
            raise ActorBusy(str(e.cause) if e.cause is not None else str(e)) from e

    async def run(self, handle: Any) -> None:
        await handle.run.remote()


# --------------------------------------------------------------------------- over Redis


class RedisTrajectories:
    """What the relays and the timer service read about a trajectory: its launch record (cached for
    ``cache_s``: a launch is configuration, rewritten only by a new run of the same id) and the state its
    status snapshot shows (read fresh each time)."""

    def __init__(
        self, redis_url: str, *, cache_s: float = 60.0, cache_size: int = 4096, clock: Clock | None = None
    ) -> None:
        import redis.asyncio as aioredis

        self._client = aioredis.Redis.from_url(redis_url, socket_timeout=10.0, socket_connect_timeout=10.0)
        self._cache: collections.OrderedDict[str, tuple[float, Any]] = collections.OrderedDict()
        self._cache_s = cache_s
        self._cache_size = cache_size
        self._clock = clock or SystemClock()

    async def launch(self, trajectory_id: str) -> Any | None:
        """The stored ``TrajectoryLaunch``, or None when it was never launched (``CodecError`` if corrupt)."""
        from actors.launch import TrajectoryLaunch, launch_key

        now = self._clock.now()
        hit = self._cache.get(trajectory_id)
        if hit is not None and now - hit[0] < self._cache_s:
            self._cache.move_to_end(trajectory_id)
            return hit[1]
        key = launch_key(trajectory_id)
        raw = await self._client.get(key)
        if raw is None:
            return None
        launch = TrajectoryLaunch.from_json(raw, where=key)
        self._cache[trajectory_id] = (now, launch)
        self._cache.move_to_end(trajectory_id)
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return launch

    async def info(self, trajectory_id: str) -> TrajectoryInfo | None:
        """Launch and last shown state, or None when the trajectory was never launched."""
        from actors.status import status_key

        launch = await self.launch(trajectory_id)
        if launch is None:
            return None
        state = await self._client.hget(status_key(trajectory_id), "state")
        text = state.decode() if isinstance(state, bytes) else (state or "")
        return TrajectoryInfo(launch, text)

    async def close(self) -> None:
        await self._client.aclose()


def ray_wake_gate() -> WakeGate:
    """The wake admission of a process on this Ray cluster: none of its own when some node declares
    ``tether_trajectory`` slots (Ray admits woken actors into free slots, and the autoscaler sees the ones
    waiting), else a gate sized like a node's default slots: the cluster's memory at
    ``TRAJECTORY_ACTOR_BYTES`` per trajectory and its CPUs at ``TRAJECTORIES_PER_CORE``, the fewer."""
    import ray

    resources = ray.cluster_resources()  # type: ignore[no-untyped-call]
    if resources.get(TRAJECTORY_RESOURCE, 0) > 0:
        return WakeGate(None)
    memory = float(resources.get("memory", 0.0))
    by_memory = int(memory // TRAJECTORY_ACTOR_BYTES)
    cpus = float(resources.get("CPU", 0.0))
    by_cpu = int(cpus * TRAJECTORIES_PER_CORE) if cpus > 0 else by_memory
    return WakeGate(max(1, min(by_memory, by_cpu)))


def ray_incarnations(redis_url: str, adapters: Any, **options: Any) -> tuple[Incarnations, RedisTrajectories]:
    """``Incarnations`` of the real trajectory actors (``actors.trajectory``) on this Ray cluster, woken
    from their launch records in ``redis_url`` with ``adapters`` (``cluster.adapters.ClusterAdapters``)."""
    import importlib

    trajectory = importlib.import_module("actors.trajectory")  # late: only where trajectories are reached
    store = RedisTrajectories(redis_url)

    def ensure(launch: Any) -> Any:
        return trajectory.ensure_actor(launch, adapters)

    incarnations = Incarnations(RayActors(ensure), store.info, gate=ray_wake_gate(), **options)
    return incarnations, store


def stop_named_actors(handles: list[Any], namespace: str, *, timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """Stop long-lived named actors (relays, timer services) through their ``stop()`` and return what each
    answered (its counters, ``name`` among them); kill any that do not answer. Waits, bounded, until their
    names are free, so that starting them again right after creates new actors instead of finding the
    dying ones through ``get_if_exists``."""
    import time

    import ray

    out: list[dict[str, Any]] = []
    for h in handles:
        try:
            out.append(ray.get(h.stop.remote(), timeout=timeout_s))
        except Exception as e:  # already dead, or stuck: make sure it is gone
            out.append({"error": repr(e)})
        with contextlib.suppress(Exception):
            ray.kill(h)
    names = [str(stats.get("name")) for stats in out if stats.get("name")]
    give_up = time.monotonic() + timeout_s
    while names and time.monotonic() < give_up:
        names = [n for n in names if _named_actor_exists(ray, n, namespace)]
        if names:
            time.sleep(0.05)
    return out


def _named_actor_exists(ray: Any, name: str, namespace: str) -> bool:
    try:
        ray.get_actor(name, namespace=namespace)
    except ValueError:
        return False
    return True
