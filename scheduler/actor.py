"""The scheduler actor (one per cluster, named ``scheduler`` in namespace ``tether``) and its handle.

A thin shell over ``InProcessScheduler``. Admissions wait inside the actor on futures; settle, release,
feedback and control calls run in a separate concurrency group with its own event loop, so they never
queue behind blocked admissions (a semaphore whose releases starve behind its acquires stalls a cluster).

Throughput: every actor call costs both processes CPU (Ray's per-call path, not the scheduler's logic, is
what bounds admissions on a node: ``benchmarks/node_capacity.py``). So the handle makes few calls:

- A process with several turns of one key and class to admit at once leases a chunk of them and admits
  and settles them locally (``scheduler.lease``, ``scheduler.lease_client``): one ``admit_or_lease`` and
  one returned chunk per up to ``LeaseConfig.max_requests`` turns, while the key is uncontended. Under
  contention (or with ``SchedulerConfig.leasing=None``) every turn is one ``admit_or_lease``/
  ``admit_turn`` call, in DRR order.
- Settlements (and returned chunks) of one process are coalesced: while one ``settle_many`` call is in
  flight, further ones queue and go in the next call (no timer: an idle process settles at once, a busy
  one sends one call per batch).

Errors do not cross the Ray boundary as exceptions (``AdmissionRefused`` carries structured fields a
pickled exception would lose); the actor returns an outcome (a plain tuple, as everything on the per-turn
path is) and the handle raises on the caller's side. After a restart the actor is constructed afresh:
buckets start empty, grants from the previous incarnation are unknown (settling them is a no-op), so a
crash never causes a burst over the limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import ray

from runtime.clock import Clock, SystemClock
from runtime.errors import AdmissionRefused, TetherError
from runtime.ports import RateLimitInfo, SandboxPermit, TurnGrant, TurnRequest
from scheduler.config import SchedulerConfig
from scheduler.core import SchedulerSnapshot
from scheduler.errors import SchedulerInputError
from scheduler.hooks import SchedulerMetrics
from scheduler.inprocess import InProcessScheduler
from scheduler.lease import TurnLease
from scheduler.lease_client import LeaseClient

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


# What crosses the Ray boundary between the handle and the actor: tuples of primitives, never our
# dataclasses. Ray carries such a tuple as MessagePack and anything else through pickle, and on the
# per-turn path (one admission, one settlement) the dataclasses cost a round trip about 0.2 ms of CPU on
# each side (``benchmarks/turn_overhead.py``). An actor method returns an outcome:
#   ("ok", value)                       value: None, or a tagged tuple (``_pack``), or as is
#   ("refused", predicate, message)     ``AdmissionRefused``, rebuilt by the handle
#   ("input", message, where)           ``SchedulerInputError``, rebuilt by the handle
_Outcome = tuple[Any, ...]
_OK: _Outcome = ("ok", None)


# The values that cross as tagged tuples of their fields, in declaration order (one list, read from the
# dataclasses themselves, so a field added to one of them travels without a change here).
_PACKED: dict[str, type] = {"grant": TurnGrant, "lease": TurnLease, "permit": SandboxPermit}
_TAG = {cls: tag for tag, cls in _PACKED.items()}
_FIELDS = {cls: tuple(f.name for f in dataclasses.fields(cls)) for cls in (TurnRequest, *_PACKED.values())}


def _fields_of(value: Any) -> tuple[Any, ...]:
    return tuple(getattr(value, name) for name in _FIELDS[type(value)])


def _request_wire(request: TurnRequest) -> tuple[Any, ...]:
    return _fields_of(request)


def _request_of(wire: TurnRequest | Sequence[Any]) -> TurnRequest:
    return wire if isinstance(wire, TurnRequest) else TurnRequest(*wire)


def _pack(value: Any) -> Any:
    tag = _TAG.get(type(value))
    return value if tag is None else (tag, *_fields_of(value))  # None, or a value returned as itself


def _unpack(value: Any) -> Any:
    if isinstance(value, tuple) and value and isinstance(value[0], str) and value[0] in _PACKED:
        return _PACKED[value[0]](*value[1:])
    return value


def _unwrap(outcome: _Outcome) -> Any:
    """The value of an outcome, or its refusal / input error raised on the caller's side."""
    tag = outcome[0]
    if tag == "ok":
        return _unpack(outcome[1])
    if tag == "refused":
        raise AdmissionRefused(outcome[1], outcome[2])
    if tag == "input":
        raise SchedulerInputError(outcome[1], where=outcome[2])
    raise TypeError(f"not a scheduler outcome: {outcome!r}")


async def _outcome_of(awaitable: Any) -> _Outcome:
    try:
        value = await awaitable
    except AdmissionRefused as refused:
        message = str(refused).removeprefix(f"{refused.predicate}: ")
        return ("refused", refused.predicate, message)
    except SchedulerInputError as bad:
        message = str(bad).removeprefix(f"{bad.where}: ") if bad.where else str(bad)
        return ("input", message, bad.where)
    return _OK if value is None else ("ok", _pack(value))


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
    async def admit_turn(self, request: TurnRequest | Sequence[Any]) -> _Outcome:
        self._ensure_reclaimer()
        return await _outcome_of(self._scheduler.admit_turn(_request_of(request)))

    @ray.method(concurrency_group=_ADMIT)
    async def admit_or_lease(self, request: TurnRequest | Sequence[Any], want: int) -> _Outcome:
        """A chunk of up to ``want`` turns while the key is uncontended, else this turn if admitted at
        once, else None at once (contended: the caller asks ``admit_turn``)."""
        self._ensure_reclaimer()
        return await _outcome_of(self._scheduler.admit_or_lease(_request_of(request), want))

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
    async def settle_many(
        self, settlements: list[tuple[str, int]], returns: list[tuple[str, int, int]] | None = None
    ) -> _Outcome:
        """Several ``settle_turn`` and returned chunks in one call (what a process's handle batched)."""
        return await _outcome_of(self._scheduler.settle_many(settlements, returns))

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
    async def report_limits(
        self, provider_key: str, info: RateLimitInfo, rate_limited: bool, grant_id: str | None = None
    ) -> _Outcome:
        return await _outcome_of(self._scheduler.report_limits(provider_key, info, rate_limited, grant_id))

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


class _SettleBatcher:
    """Coalesces one process's settlements and returned chunks: one ``settle_many`` in flight at a time,
    the rest queue for the next. Each caller still waits until its own item was applied (or sees the
    error)."""

    def __init__(self, actor: Any) -> None:
        self._actor = actor
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: list[tuple[tuple[str, int] | tuple[str, int, int], asyncio.Future[None]]] = []
        self._flushing = False
        self._flusher: asyncio.Task[None] | None = None

    def usable(self) -> bool:
        """Bound to the first event loop that uses it; callers on another loop settle one by one."""
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        return self._loop is loop

    async def settle(self, grant_id: str, actual_tokens: int) -> None:
        await self._put((grant_id, actual_tokens))

    async def end_lease(self, lease_id: str, used_tokens: int, used_requests: int) -> None:
        await self._put((lease_id, used_tokens, used_requests))

    async def _put(self, item: tuple[str, int] | tuple[str, int, int]) -> None:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        self._queue.append((item, future))
        if not self._flushing:
            self._flushing = True
            self._flusher = loop.create_task(self._flush())
        await future

    async def _flush(self) -> None:
        try:
            while self._queue:
                batch, self._queue = self._queue, []
                settles = [item for item, _ in batch if len(item) == 2]
                returns = [item for item, _ in batch if len(item) == 3]
                try:
                    if returns:
                        outcome = await self._actor.settle_many.remote(settles, returns)
                    else:
                        outcome = await self._actor.settle_many.remote(settles)
                    _unwrap(outcome)
                except BaseException as e:  # every caller of this batch sees it
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(e)
                    if isinstance(e, asyncio.CancelledError):
                        raise
                    continue
                for _, future in batch:
                    if not future.done():
                        future.set_result(None)
        finally:
            self._flushing = False


class _PerCall:
    """The actor's admission calls, one per turn: what ``LeaseClient`` falls back to and leases through."""

    def __init__(self, handle: SchedulerHandle) -> None:
        self._handle = handle

    async def admit_turn(self, request: TurnRequest) -> TurnGrant:
        grant: TurnGrant = await self._handle._call("admit_turn", _request_wire(request))
        return grant

    async def admit_or_lease(self, request: TurnRequest, want: int) -> TurnGrant | TurnLease | None:
        wire = _request_wire(request)
        answer: TurnGrant | TurnLease | None = await self._handle._call("admit_or_lease", wire, want)
        return answer


class SchedulerHandle:
    """``runtime.ports.AdmissionPort`` over the scheduler actor: what trajectory actors hold."""

    def __init__(self, actor: Any, clock: Clock | None = None, leasing: bool = True) -> None:
        self._actor = actor
        self._leasing = leasing
        self._settles = _SettleBatcher(actor)
        self._leases = LeaseClient(_PerCall(self), self._settles.end_lease, clock or SystemClock())

    def __reduce__(self) -> tuple[Any, ...]:
        # the batcher and the chunks belong to one process's event loop
        return (SchedulerHandle, (self._actor, None, self._leasing))

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
        return _unwrap(outcome)

    @property
    def leased_turns(self) -> int:
        """Turns this handle admitted from chunks, with no call of their own."""
        return self._leases.leased

    async def admit_turn(self, request: TurnRequest) -> TurnGrant:
        if self._leasing and self._settles.usable():
            return await self._leases.admit_turn(request)
        grant: TurnGrant = await self._call("admit_turn", _request_wire(request))
        return grant

    async def settle_turn(self, grant_id: str, actual_tokens: int) -> None:
        if self._settles.usable():
            if self._leases.settle_local(grant_id, actual_tokens):
                return
            await self._settles.settle(grant_id, actual_tokens)
        else:
            await self._call("settle_turn", grant_id, actual_tokens)

    async def report_rate_limited(
        self, provider_key: str, retry_after: float | None, remaining: Mapping[str, float]
    ) -> None:
        await self._call("report_rate_limited", provider_key, retry_after, dict(remaining))

    async def report_remaining(self, provider_key: str, remaining: Mapping[str, float]) -> None:
        await self._call("report_remaining", provider_key, dict(remaining))

    async def report_limits(
        self, provider_key: str, info: RateLimitInfo, rate_limited: bool, grant_id: str | None = None
    ) -> None:
        """Admission feedback from one provider response (a 429 and/or its limit headers)."""
        await self._call("report_limits", provider_key, info, rate_limited, grant_id)

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
