"""The scheduler actor (one per cluster, named ``scheduler`` in namespace ``tether``) and its handle.

A thin shell over ``InProcessScheduler``. Admissions wait inside the actor on futures; settle, release,
feedback and control calls run in a separate concurrency group with its own event loop, so they never
queue behind blocked admissions (a semaphore whose releases starve behind its acquires stalls a cluster).

Errors do not cross the Ray boundary as exceptions (``AdmissionRefused`` carries structured fields a
pickled exception would lose); the actor returns an outcome record and the handle raises on the caller's
side. After a restart the actor is constructed afresh: buckets start empty, grants from the previous
incarnation are unknown (settling them is a no-op), so a crash never causes a burst over the limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import ray

from runtime.errors import AdmissionRefused, TetherError
from runtime.ports import RateLimitInfo, SandboxPermit, TurnGrant, TurnRequest
from scheduler.config import SchedulerConfig
from scheduler.core import SchedulerSnapshot
from scheduler.errors import SchedulerInputError
from scheduler.hooks import SchedulerMetrics
from scheduler.inprocess import InProcessScheduler

__all__ = [
    "SCHEDULER_NAME",
    "SCHEDULER_NAMESPACE",
    "SchedulerActor",
    "SchedulerHandle",
    "scheduler_actor_class",
]

SCHEDULER_NAME = "scheduler"
SCHEDULER_NAMESPACE = "tether"
_ADMIT = "admit"  # admissions and sandbox acquisitions: may wait a long time
_CONTROL = "control"  # settle, release, feedback, introspection: always quick

_log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Outcome:
    """What an actor method returns: a value, or a refusal / input error rebuilt by the handle."""

    value: Any = None
    refused: tuple[str, str] | None = None  # (predicate, message)
    input_error: tuple[str, str | None] | None = None  # (message, where)

    def unwrap(self) -> Any:
        if self.refused is not None:
            raise AdmissionRefused(*self.refused)
        if self.input_error is not None:
            message, where = self.input_error
            raise SchedulerInputError(message, where=where)
        return self.value


async def _outcome_of(awaitable: Any) -> _Outcome:
    try:
        return _Outcome(value=await awaitable)
    except AdmissionRefused as refused:
        message = str(refused).removeprefix(f"{refused.predicate}: ")
        return _Outcome(refused=(refused.predicate, message))
    except SchedulerInputError as bad:
        message = str(bad).removeprefix(f"{bad.where}: ") if bad.where else str(bad)
        return _Outcome(input_error=(message, bad.where))


# num_cpus=0: the scheduler must never wait for a CPU slot behind the trajectories it admits.
# Restarts are unlimited and calls in flight are retried on the new incarnation: an admission not yet
# granted is safe to re-submit, and settling an unknown grant is a no-op.
_ACTOR_OPTIONS: dict[str, Any] = {"num_cpus": 0, "max_restarts": -1, "max_task_retries": -1}


class _SchedulerActorBody:
    """Ray actor around one ``InProcessScheduler`` on the system clock.

    ``holder_name_template`` (e.g. ``"trajectory:{trajectory_id}"``), when set, lets the actor reclaim
    leases of trajectories whose named actor no longer exists, every ``reclaim_every_s`` seconds;
    without it, expired leases are still reclaimed when they expire.
    """

    def __init__(
        self,
        config: Mapping[str, Any] | SchedulerConfig | None = None,
        holder_name_template: str | None = None,
        reclaim_every_s: float = 30.0,
        metrics: SchedulerMetrics | None = None,
    ) -> None:
        cfg = config if isinstance(config, SchedulerConfig) else SchedulerConfig.model_validate(config or {})
        self._scheduler = InProcessScheduler(cfg, metrics=metrics)
        self._holder_name_template = holder_name_template
        self._reclaim_every_s = reclaim_every_s
        self._reclaimer: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ may wait

    @ray.method(concurrency_group=_ADMIT)
    async def admit_turn(self, request: TurnRequest) -> _Outcome:
        self._ensure_reclaimer()
        return await _outcome_of(self._scheduler.admit_turn(request))

    @ray.method(concurrency_group=_ADMIT)
    async def acquire_sandbox(
        self, trajectory_id: str, pool: str, priority_class: str, deadline: float
    ) -> _Outcome:
        self._ensure_reclaimer()
        return await _outcome_of(
            self._scheduler.acquire_sandbox(trajectory_id, pool, priority_class, deadline)
        )

    # ------------------------------------------------------------------ never wait

    @ray.method(concurrency_group=_CONTROL)
    async def settle_turn(self, grant_id: str, actual_tokens: int) -> _Outcome:
        return await _outcome_of(self._scheduler.settle_turn(grant_id, actual_tokens))

    @ray.method(concurrency_group=_CONTROL)
    async def release_sandbox(self, permit_id: str) -> _Outcome:
        return await _outcome_of(self._scheduler.release_sandbox(permit_id))

    @ray.method(concurrency_group=_CONTROL)
    async def report_rate_limited(
        self, provider_key: str, retry_after: float | None, remaining: Mapping[str, float]
    ) -> _Outcome:
        return await _outcome_of(self._scheduler.report_rate_limited(provider_key, retry_after, remaining))

    @ray.method(concurrency_group=_CONTROL)
    async def report_remaining(self, provider_key: str, remaining: Mapping[str, float]) -> _Outcome:
        return await _outcome_of(self._scheduler.report_remaining(provider_key, remaining))

    @ray.method(concurrency_group=_CONTROL)
    async def report_limits(self, provider_key: str, info: RateLimitInfo, rate_limited: bool) -> _Outcome:
        return await _outcome_of(self._scheduler.report_limits(provider_key, info, rate_limited))

    @ray.method(concurrency_group=_CONTROL)
    async def snapshot(self) -> SchedulerSnapshot:
        return self._scheduler.snapshot()

    @ray.method(concurrency_group=_CONTROL)
    async def reclaim_dead_holders(self) -> list[str]:
        """Reclaim leases of holders whose named actor is gone (needs ``holder_name_template``)."""
        return self._reclaim_dead()

    def _reclaim_dead(self) -> list[str]:
        template = self._holder_name_template
        if template is None:
            return []
        alive = {entry["name"] for entry in ray.util.list_named_actors(all_namespaces=True)}
        return self._scheduler.reclaim(
            lambda trajectory_id: template.format(trajectory_id=trajectory_id) in alive
        )

    # ------------------------------------------------------------------ background

    def _ensure_reclaimer(self) -> None:
        if self._holder_name_template is None or self._reclaimer is not None:
            return
        self._reclaimer = asyncio.get_running_loop().create_task(self._reclaim_forever())

    async def _reclaim_forever(self) -> None:
        while True:
            await asyncio.sleep(self._reclaim_every_s)
            with contextlib.suppress(Exception):  # a failed liveness listing must not stop reclaiming
                reclaimed = self._reclaim_dead()
                if reclaimed:
                    _log.info("reclaimed %d leases of dead holders", len(reclaimed))


def scheduler_actor_class(admit_slots: int = 10_000, control_slots: int = 100) -> Any:
    """The actor class with the given concurrency-group sizes (Ray fixes them per class, not per
    ``.options()``). ``admit_slots`` bounds admissions waiting inside the actor; ``control_slots``
    are the separate slots settle/release/feedback use, which waiting admissions can never take."""
    options = {**_ACTOR_OPTIONS, "concurrency_groups": {_ADMIT: admit_slots, _CONTROL: control_slots}}
    return ray.remote(**options)(_SchedulerActorBody)


SchedulerActor = scheduler_actor_class()


class SchedulerHandle:
    """``runtime.ports.AdmissionPort`` over the scheduler actor: what trajectory actors hold."""

    def __init__(self, actor: Any) -> None:
        self._actor = actor

    @classmethod
    def connect(
        cls,
        config: SchedulerConfig | None = None,
        *,
        name: str = SCHEDULER_NAME,
        namespace: str = SCHEDULER_NAMESPACE,
        detached: bool = False,
        holder_name_template: str | None = None,
        metrics: SchedulerMetrics | None = None,
    ) -> SchedulerHandle:
        """Get the named scheduler actor, creating it with ``config`` if it does not exist yet.

        ``detached=True`` keeps it alive after the creating job ends, so several jobs on one cluster
        share the same limits. An existing actor keeps its own configuration (and metrics). ``metrics``
        must pickle: e.g. ``scheduler.observe.MetricsAdapter(RayBackend)`` builds its backend in the actor.
        """
        options: dict[str, Any] = {"name": name, "namespace": namespace, "get_if_exists": True}
        if detached:
            options["lifetime"] = "detached"
        payload = (config or SchedulerConfig()).model_dump(mode="json")
        actor = SchedulerActor.options(**options).remote(payload, holder_name_template, 30.0, metrics)
        return cls(actor)

    @property
    def actor(self) -> Any:
        return self._actor

    async def _call(self, method: str, *args: Any) -> Any:
        try:
            outcome = await getattr(self._actor, method).remote(*args)
        except ray.exceptions.RayTaskError as err:  # pragma: no cover - the actor returns outcomes
            cause = err.cause
            if isinstance(cause, TetherError):
                raise cause from err
            raise
        return outcome.unwrap()

    async def admit_turn(self, request: TurnRequest) -> TurnGrant:
        grant: TurnGrant = await self._call("admit_turn", request)
        return grant

    async def settle_turn(self, grant_id: str, actual_tokens: int) -> None:
        await self._call("settle_turn", grant_id, actual_tokens)

    async def report_rate_limited(
        self, provider_key: str, retry_after: float | None, remaining: Mapping[str, float]
    ) -> None:
        await self._call("report_rate_limited", provider_key, retry_after, dict(remaining))

    async def report_remaining(self, provider_key: str, remaining: Mapping[str, float]) -> None:
        await self._call("report_remaining", provider_key, dict(remaining))

    async def report_limits(self, provider_key: str, info: RateLimitInfo, rate_limited: bool) -> None:
        """Admission feedback from one provider response (a 429 and/or its limit headers)."""
        await self._call("report_limits", provider_key, info, rate_limited)

    async def acquire_sandbox(
        self, trajectory_id: str, pool: str, priority_class: str, deadline: float
    ) -> SandboxPermit:
        permit: SandboxPermit = await self._call(
            "acquire_sandbox", trajectory_id, pool, priority_class, deadline
        )
        return permit

    async def release_sandbox(self, permit_id: str) -> None:
        await self._call("release_sandbox", permit_id)

    async def snapshot(self) -> SchedulerSnapshot:
        snap: SchedulerSnapshot = await self._actor.snapshot.remote()
        return snap
