"""The guard actor: one async Ray actor per dependency scope, holding that scope's breaker and bulkhead.

- Named ``guard:<scope>`` in namespace ``tether``, ``num_cpus=0``: a guard is bookkeeping, not compute.
- ``admit`` runs in the ``admit`` concurrency group and may wait in the bulkhead queue; ``record``,
  ``release`` and views run in the ``settle`` group, so no number of queued admissions can starve the calls
  that free slots (a group is its own event loop and thread; ``InProcessGuard`` is thread-safe for this).
- Refusals cross the wire as a plain ``GuardRefusal`` value and are raised again on the caller's side as
  the runtime's named errors, so callers catch ``BreakerOpen``/``BulkheadFull`` exactly as in process.
- A background task reclaims leases past their expiry, so a holder that died frees its slot.
- Metrics: given ``metrics_backend`` (a zero-argument factory, e.g. ``actors.metrics_ray.RayBackend``,
  passed by whoever creates the actor; this package may not import ``actors``), the actor records its
  scope's breaker state, trips and probes through ``runtime.metrics.Metrics`` built inside the actor.

``GuardHandle`` is the thin caller-side wrapper implementing ``runtime.ports.GuardPort``; it routes each
scope to its actor, creating it on first use (``get_if_exists``), so any process reaches the same guard.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray

from runtime.clock import SystemClock
from runtime.errors import BreakerOpen, BulkheadFull, PolicyRefusal
from runtime.metrics import Metrics, MetricsBackend
from runtime.ports import GuardPermit, OutcomeClass

from .errors import QueuedPastDeadline
from .inprocess import InProcessGuard
from .scope_guard import GuardPolicy, GuardSnapshot

__all__ = ["NAMESPACE", "GuardActor", "GuardHandle", "GuardRefusal", "actor_name"]

NAMESPACE = "tether"


def actor_name(scope: str) -> str:
    """The Ray actor name of a scope's guard."""
    if not scope or scope.strip() != scope:
        raise ValueError(
            f"a dependency scope must be a non-empty name without surrounding spaces, got {scope!r}"
        )
    return f"guard:{scope}"


@dataclass(frozen=True, slots=True)
class GuardRefusal:
    """A refusal as a wire value (exceptions with keyword-only constructors do not round-trip pickling)."""

    kind: str  # "breaker_open" | "bulkhead_full" | "deadline"
    scope: str
    cooldown_s: float = 0.0
    generation: int = 0
    in_flight: int = 0
    queued: int = 0
    call_id: str = ""
    deadline: float = 0.0

    @classmethod
    def of(cls, error: PolicyRefusal) -> GuardRefusal:
        if isinstance(error, BreakerOpen):
            return cls(
                "breaker_open", error.scope or "", cooldown_s=error.cooldown_s, generation=error.generation
            )
        if isinstance(error, BulkheadFull):
            return cls("bulkhead_full", error.scope or "", in_flight=error.in_flight, queued=error.queued)
        if isinstance(error, QueuedPastDeadline):
            return cls("deadline", error.scope or "", call_id=error.call_id, deadline=error.deadline)
        raise TypeError(f"no wire form for {type(error).__name__}")

    def error(self) -> PolicyRefusal:
        if self.kind == "breaker_open":
            return BreakerOpen(self.scope, self.cooldown_s, self.generation)
        if self.kind == "bulkhead_full":
            return BulkheadFull(self.scope, self.in_flight, self.queued)
        return QueuedPastDeadline(self.scope, self.call_id, self.deadline)


@ray.remote(num_cpus=0, concurrency_groups={"admit": 10_000, "settle": 64})  # type: ignore[call-overload]
class GuardActor:
    """Breaker + bulkhead of one dependency scope. A thin shell over ``InProcessGuard``."""

    def __init__(
        self,
        scope: str,
        policy: dict[str, Any],
        reclaim_interval_s: float = 1.0,
        metrics_backend: Callable[[], MetricsBackend] | None = None,
    ) -> None:
        self._scope = scope
        # built here, in the actor's process: a backend holds locks and exporter state that do not pickle
        metrics = Metrics(metrics_backend()) if metrics_backend is not None else None
        self._guard = InProcessGuard(SystemClock(), GuardPolicy.model_validate(policy), metrics=metrics)
        self._reclaim_interval_s = reclaim_interval_s
        self._reclaimer: asyncio.Task[None] | None = None

    @ray.method(concurrency_group="admit")
    async def admit(self, call_id: str, deadline: float, holder: str = "") -> GuardPermit | GuardRefusal:
        self._ensure_reclaimer()
        try:
            return await self._guard.admit(self._scope, call_id, deadline, holder)
        except (BreakerOpen, BulkheadFull, QueuedPastDeadline) as refusal:
            return GuardRefusal.of(refusal)

    @ray.method(concurrency_group="settle")
    async def record(self, permit: GuardPermit, outcome: str) -> str:
        return (await self._guard.record_effect(permit, OutcomeClass(outcome))).value

    @ray.method(concurrency_group="settle")
    async def release(self, permit: GuardPermit) -> None:
        await self._guard.release(permit)

    @ray.method(concurrency_group="settle")
    async def settle(self, permit: GuardPermit, outcome: str | None) -> None:
        """``record`` (when there is an outcome) and ``release`` in one round trip: what a finished call
        sends (two calls before, and every tool call paid for both)."""
        await self._guard.settle(permit, OutcomeClass(outcome) if outcome is not None else None)

    @ray.method(concurrency_group="settle")
    async def snapshot(self) -> GuardSnapshot:
        return self._guard.snapshot(self._scope)

    @ray.method(concurrency_group="settle")
    async def reclaim(self) -> int:
        """Reclaim expired leases now; returns how many."""
        return len(self._guard.reclaim())

    @ray.method(concurrency_group="settle")
    async def ping(self) -> None:
        """A no-op round trip (benchmarks compare against it)."""

    def _ensure_reclaimer(self) -> None:
        if self._reclaimer is None:
            self._reclaimer = asyncio.get_running_loop().create_task(self._reclaim_forever())

    async def _reclaim_forever(self) -> None:
        while True:
            await asyncio.sleep(self._reclaim_interval_s)
            self._guard.reclaim()


def _kill_quietly(handle: Any) -> None:
    with contextlib.suppress(Exception):  # gone already: nothing to free
        ray.kill(handle, no_restart=True)


class GuardHandle:
    """``GuardPort`` over the guard actors: one actor per scope, created on first use.

    ``holder`` identifies the caller for lease bookkeeping (e.g. the trajectory id). ``metrics_backend`` is
    handed to the actors this handle creates (the first creator of a scope's actor decides, like the policy).
    """

    def __init__(
        self,
        policy: GuardPolicy | Callable[[str], GuardPolicy] | None = None,
        holder: str = "",
        detached: bool = False,
        metrics_backend: Callable[[], MetricsBackend] | None = None,
    ) -> None:
        chosen = policy if policy is not None else GuardPolicy()
        self._policy_for: Callable[[str], GuardPolicy] = (
            chosen if callable(chosen) and not isinstance(chosen, GuardPolicy) else (lambda _scope: chosen)
        )
        self._holder = holder
        self._detached = detached
        self._metrics_backend = metrics_backend
        self._actors: dict[str, Any] = {}

    def actor(self, scope: str) -> Any:
        """The scope's guard actor (created if nobody has yet; the first creator's policy wins)."""
        handle = self._actors.get(scope)
        if handle is None:
            options: dict[str, Any] = {
                "name": actor_name(scope),
                "namespace": NAMESPACE,
                "get_if_exists": True,
            }
            if self._detached:
                options["lifetime"] = "detached"
            actor_class: Any = GuardActor
            handle = actor_class.options(**options).remote(
                scope, self._policy_for(scope).model_dump(), 1.0, self._metrics_backend
            )
            self._actors[scope] = handle
        return handle

    async def _call(self, scope: str, method: str, *args: Any) -> Any:
        """Call ``method`` on the scope's guard actor. A guard that died (its process killed: it is not
        restarted, its state is a cache of the breaker window) is forgotten and created again, once, by
        this call: a handle kept to a dead actor would refuse every later call of this process (a chaos run
        left 7 environments unreleased that way, each release refused 10 times by the same dead guard)."""
        handle = self.actor(scope)
        try:
            return await getattr(handle, method).remote(*args)
        except ray.exceptions.ActorDiedError:
            self._actors.pop(scope, None)
            # While its creator (the driver) holds a handle, a dead actor stays registered under its name and
            # ``get_if_exists`` would hand it back: killing it frees the name (a blocking GCS call: a thread)
            await asyncio.to_thread(_kill_quietly, handle)
            return await getattr(self.actor(scope), method).remote(*args)

    async def admit(self, scope: str, call_id: str, deadline: float) -> GuardPermit:
        reply = await self._call(scope, "admit", call_id, deadline, self._holder)
        if isinstance(reply, GuardRefusal):
            raise reply.error()
        permit: GuardPermit = reply
        return permit

    async def record(self, permit: GuardPermit, outcome: OutcomeClass) -> None:
        await self._call(permit.scope, "record", permit, outcome.value)

    async def release(self, permit: GuardPermit) -> None:
        await self._call(permit.scope, "release", permit)

    async def settle(self, permit: GuardPermit, outcome: OutcomeClass | None) -> None:
        await self._call(permit.scope, "settle", permit, outcome.value if outcome is not None else None)

    async def snapshot(self, scope: str) -> GuardSnapshot:
        snap: GuardSnapshot = await self._call(scope, "snapshot")
        return snap
