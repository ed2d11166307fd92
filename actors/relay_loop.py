"""Control relays: carry signed control messages from ``tether:control`` to the trajectory actors.

Issue 4, "Transport" (and ARCHITECTURE.md, "Control protocol"):

- Every relay (``relay:<n>`` in namespace ``tether``) reads the stream through ONE consumer group, so each
  entry goes to one relay at a time.
- An entry is ``XACK``ed only after the trajectory actor answered: it has durably recorded the request in its
  own log, or recognised a duplicate, or rejected it (and audited why). Until then the entry stays pending.
- A relay that dies leaves its entries pending; every relay periodically runs ``XAUTOCLAIM`` for entries
  idle longer than ``claim_idle_ms`` and delivers them itself. A delivery that failed (actor died mid-call)
  is retried the same way. Delivery is therefore at-least-once; the actor dedupes by message id.
- A message for an unknown trajectory, or an entry that does not decode, becomes an audit entry on
  ``tether:audit`` and is acked: one bad message must never turn into an exception loop.
- A message for a trajectory whose actor is gone but whose launch record exists (hibernated, or died) wakes
  it: the actor is re-created, folds its log, records the message and is told to run on.

``Relay`` is the loop with its ports injected (unit-testable without Ray or Redis); ``RelayActor`` is the
thin Ray shell and ``start_relays`` the helper the runner calls. The Redis transport and the audit sink
come from the injected ``actors.ports.ClusterPorts`` (``cluster.adapters``): this module never imports
``cluster``.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field

from actors.ports import (
    AuditEntry,
    AuditSink,
    ClusterPorts,
    ControlEnvelope,
    RelayDelivery,
    RelayStream,
)
from runtime.clock import Clock, SystemClock
from runtime.errors import DependencyError

__all__ = [
    "AUDIT_STREAM",
    "DEFAULT_GROUP",
    "NAMESPACE",
    "UNKNOWN",
    "AuditEntry",
    "AuditReason",
    "AuditSink",
    "DeliveryPort",
    "HandleResult",
    "RayTrajectoryDirectory",
    "Relay",
    "RelayActor",
    "RelayConfig",
    "StreamPort",
    "TargetGone",
    "relay_name",
    "start_relays",
    "stop_relays",
]

log = logging.getLogger(__name__)

NAMESPACE = "tether"
DEFAULT_GROUP = "relays"
AUDIT_STREAM = "tether:audit"
UNKNOWN = "unknown"  # what a DeliveryPort answers for a trajectory nobody ever launched


def relay_name(n: int) -> str:
    """The Ray actor name of relay number ``n``."""
    return f"relay:{n}"


class RelayConfig(BaseModel):
    """How relays read the control stream. All relays of a cluster share ``group``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    group: str = Field(default=DEFAULT_GROUP, min_length=1, max_length=64)
    batch: int = Field(default=32, ge=1, le=1000)
    block_ms: int = Field(default=200, ge=1, le=10_000)  # bounds how long stop() waits for the loop
    claim_idle_ms: int = Field(default=5_000, ge=1)  # pending this long on any relay: presumed dead
    claim_every_s: float = Field(default=1.0, gt=0.0)
    deliver_timeout_s: float = Field(default=30.0, gt=0.0)
    error_backoff_s: float = Field(default=0.5, ge=0.0)
    audit_maxlen: int = Field(default=100_000, ge=1)


class AuditReason(StrEnum):
    """Why a relay wrote an audit entry (actor rejections carry the verifier's reason after ``REJECTED:``)."""

    UNKNOWN_TRAJECTORY = "UNKNOWN_TRAJECTORY"
    MALFORMED = "MALFORMED"
    TRIMMED = "TRIMMED"  # a pending entry whose message Redis trimmed away before anyone delivered it
    REJECTED = "REJECTED"


class HandleResult(StrEnum):
    """What the relay did with one entry."""

    DELIVERED = "delivered"  # the actor recorded it (or already had it): acked
    AUDITED = "audited"  # unknown trajectory, malformed, or rejected by the actor: audited and acked
    RETRY = "retry"  # delivery failed: left pending, XAUTOCLAIM retries it


# --------------------------------------------------------------------------- ports


StreamPort = RelayStream  # the control stream as a relay reads it (``actors.ports``)


class DeliveryPort(Protocol):
    """Hands one encoded message to its trajectory's actor.

    Returns the actor's answer (``"recorded"``, ``"duplicate"``, ``"rejected:<REASON>"``) or ``"unknown"``
    when no such trajectory was ever launched. Raises ``TargetGone`` (or anything else) when the actor could
    not answer: the relay then leaves the entry pending.
    """

    async def deliver(self, trajectory_id: str, data: bytes) -> str: ...


class TargetGone(DependencyError):
    """The trajectory actor died or timed out before answering; the message stays pending."""


# --------------------------------------------------------------------------- the loop


class Relay:
    """One relay's read-deliver-ack loop over injected ports."""

    def __init__(
        self,
        name: str,
        stream: StreamPort,
        targets: DeliveryPort,
        audit: AuditSink,
        config: RelayConfig | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.name = name
        self.stream = stream
        self.targets = targets
        self.audit = audit
        self.config = config or RelayConfig()
        self.clock = clock or SystemClock()
        self.counts: dict[str, int] = {r.value: 0 for r in HandleResult}
        self.claimed = 0
        self._claim_cursor = "0-0"
        self._next_claim = 0.0  # claim on the first step: a restarted cluster finishes old work first
        self._stopping = asyncio.Event()

    async def start(self) -> None:
        """Create the group if needed."""
        await self.stream.ensure_group(self.config.group)

    async def step(self, *, block: bool = True) -> int:
        """One pass: claim stale entries when due, then read and handle new ones. Returns entries handled."""
        handled = 0
        if self.clock.now() >= self._next_claim:
            handled += await self._claim_pass()
            self._next_claim = self.clock.now() + self.config.claim_every_s
        fresh = await self.stream.read(
            self.config.group,
            self.name,
            count=self.config.batch,
            block_ms=self.config.block_ms if block else None,
        )
        await self.handle_batch(fresh)
        return handled + len(fresh)

    async def _claim_pass(self) -> int:
        """Take over entries idle on any consumer (a dead relay's, or our own failed deliveries)."""
        claimed = await self.stream.claim_stale(
            self.config.group,
            self.name,
            min_idle_ms=self.config.claim_idle_ms,
            count=self.config.batch,
            start_id=self._claim_cursor,
        )
        self._claim_cursor = claimed.next_start_id
        for entry_id in claimed.deleted_ids:
            # Redis dropped these from the PEL itself; there is nothing to deliver or ack.
            await self._audit(AuditReason.TRIMMED, "pending entry was trimmed before delivery", entry_id)
        self.claimed += len(claimed.deliveries)
        await self.handle_batch(claimed.deliveries)
        return len(claimed.deliveries)

    async def handle_batch(self, deliveries: list[RelayDelivery]) -> None:
        """Handle a batch: different trajectories concurrently, one trajectory's messages in stream order
        (a pause followed by a resume must arrive in that order), each entry acked on its own answer."""
        lanes: dict[str, list[RelayDelivery]] = {}
        for d in deliveries:
            lane = d.envelope.trajectory_id if d.envelope is not None else f"(entry {d.entry_id})"
            lanes.setdefault(lane, []).append(d)

        async def run_lane(lane: list[RelayDelivery]) -> None:
            for d in lane:
                await self.handle(d)

        await asyncio.gather(*(run_lane(lane) for lane in lanes.values()))

    async def handle(self, delivery: RelayDelivery) -> HandleResult:
        """Deliver one entry; ack unless the actor could not answer."""
        result = await self._handle(delivery)
        self.counts[result.value] += 1
        if result is not HandleResult.RETRY:
            await self.stream.ack(self.config.group, delivery.entry_id)
        return result

    async def _handle(self, delivery: RelayDelivery) -> HandleResult:
        message = delivery.envelope
        if message is None:
            reason = AuditReason.TRIMMED if delivery.trimmed else AuditReason.MALFORMED
            await self._audit(reason, str(delivery.error), delivery.entry_id)
            return HandleResult.AUDITED
        try:
            answer = await asyncio.wait_for(
                self.targets.deliver(message.trajectory_id, message.data),
                self.config.deliver_timeout_s,
            )
        except Exception as e:  # the actor did not answer: leave pending, XAUTOCLAIM retries
            log.warning(
                "%s: delivering %s to %s failed: %r", self.name, delivery.entry_id, message.trajectory_id, e
            )
            return HandleResult.RETRY
        if answer in ("recorded", "duplicate"):
            return HandleResult.DELIVERED
        if answer == UNKNOWN:
            await self._audit(
                AuditReason.UNKNOWN_TRAJECTORY, "no such trajectory", delivery.entry_id, message
            )
            return HandleResult.AUDITED
        # "rejected:<REASON>" (or any answer we do not know): the actor refused it; keep the reason on file
        await self._audit(
            f"{AuditReason.REJECTED}:{answer.partition(':')[2] or answer}", answer, delivery.entry_id, message
        )
        return HandleResult.AUDITED

    async def _audit(
        self, reason: str, detail: str, entry_id: str, message: ControlEnvelope | None = None
    ) -> None:
        entry = AuditEntry(
            reason=str(reason),
            detail=detail,
            entry_id=entry_id,
            relay=self.name,
            at=self.clock.wall(),
            message_id=message.message_id if message else "",
            trajectory_id=message.trajectory_id if message else "",
            action=message.action if message else "",
            issuer=message.issuer if message else "",
        )
        await self.audit.write(entry)

    async def run_forever(self) -> None:
        """Loop until ``stop()``; a failing step (Redis away) backs off and retries instead of dying."""
        await self.start()
        while not self._stopping.is_set():
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("%s: relay step failed, retrying: %r", self.name, e)
                await self.clock.sleep(self.config.error_backoff_s)

    def stop(self) -> None:
        self._stopping.set()

    def stats(self) -> dict[str, Any]:
        return {"name": self.name, "claimed": self.claimed, **self.counts}


# --------------------------------------------------------------------------- Redis + Ray adapters


LaunchLoader = Callable[[str], Awaitable[Any | None]]
ActorFactory = Callable[[Any], Any]


@dataclass
class RayTrajectoryDirectory:
    """Finds (or wakes) ``traj:<id>`` and calls its ``deliver``.

    ``load_launch`` / ``ensure_actor`` come from ``actors.trajectory``; they are passed in so this module
    does not import the trajectory actor (and tests can stand in for it).

    An actor that is exiting to hibernate refuses deliveries ("deliver again"); its name stays taken until
    the process is gone. The directory then re-looks the name up for up to ``wake_wait_s`` and delivers to
    the re-created actor, so waking a trajectory does not wait for a whole ``XAUTOCLAIM`` round.
    """

    load_launch: LaunchLoader
    ensure_actor: ActorFactory
    namespace: str = NAMESPACE
    wake_wait_s: float = 5.0
    retry_every_s: float = 0.05
    woken: int = 0

    def _lookup(self, trajectory_id: str) -> Any | None:
        import ray

        try:
            return ray.get_actor(f"traj:{trajectory_id}", namespace=self.namespace)
        except ValueError:
            return None

    async def deliver(self, trajectory_id: str, data: bytes) -> str:
        import ray.exceptions

        deadline = time.monotonic() + self.wake_wait_s
        while True:
            handle = self._lookup(trajectory_id)
            woke = False
            if handle is None:
                launch = await self.load_launch(trajectory_id)
                if launch is None:
                    return UNKNOWN
                handle = self.ensure_actor(launch)
                woke = True
            try:
                answer = str(await handle.deliver.remote(data))
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:
                # died between lookup and call, or exiting to hibernate: look again until the wait is over
                if time.monotonic() >= deadline:
                    raise TargetGone(
                        f"traj:{trajectory_id} did not take the message: {e}", scope="trajectory"
                    ) from e
                await asyncio.sleep(self.retry_every_s)
                continue
            if woke:
                self.woken += 1
                # Fire and forget: run() lasts as long as the trajectory (a recorded message already restarts
                # the loop; this covers a woken actor whose message was a duplicate).
                handle.run.remote()
            return answer


def _default_directory(redis_url: str, adapters: ClusterPorts) -> RayTrajectoryDirectory:
    # imported late: the trajectory actor module is only needed where relays actually run
    trajectory = importlib.import_module("actors.trajectory")

    async def load(trajectory_id: str) -> Any | None:
        # load_launch is a blocking Redis GET: keep it off the relay's event loop
        return await asyncio.to_thread(trajectory.load_launch, redis_url, trajectory_id)

    def ensure(launch: Any) -> Any:
        return trajectory.ensure_actor(launch, adapters)

    return RayTrajectoryDirectory(load_launch=load, ensure_actor=ensure)


class RelayActor:
    """Ray shell around ``Relay`` (async actor, ``num_cpus=0``). The loop starts on the first call to
    ``start()`` and runs until ``stop()`` or the actor is killed. ``adapters`` supplies the control stream
    and the audit sink (``cluster.adapters.ClusterAdapters``), and is handed on to woken trajectories."""

    def __init__(
        self,
        name: str,
        redis_url: str,
        adapters: ClusterPorts,
        config: dict[str, Any] | None = None,
        directory: Any | None = None,
    ) -> None:
        self._name = name
        self._redis_url = redis_url
        self._adapters = adapters
        self._config = RelayConfig.model_validate(config or {})
        self._directory = directory
        self._relay: Relay | None = None
        self._task: asyncio.Task[None] | None = None
        self._stream: RelayStream | None = None
        self._audit: AuditSink | None = None

    async def start(self) -> bool:
        """Start the loop (idempotent); True once the group exists and the loop runs."""
        if self._task is not None and not self._task.done():
            return True
        self._stream = self._adapters.relay_stream(self._redis_url)
        self._audit = self._adapters.audit_sink(self._redis_url, self._config.audit_maxlen)
        directory = self._directory or _default_directory(self._redis_url, self._adapters)
        self._relay = Relay(self._name, self._stream, directory, self._audit, self._config)
        await self._relay.start()
        self._task = asyncio.get_running_loop().create_task(self._relay.run_forever())
        return True

    async def stop(self) -> dict[str, Any]:
        """Stop after the current step (bounded by ``block_ms``); returns the final counters."""
        if self._relay is not None:
            self._relay.stop()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(self._task, self._config.block_ms / 1000 + 5.0)
        for closer in (self._stream, self._audit):
            if closer is not None:
                with contextlib.suppress(Exception):  # best effort: the connection may already be gone
                    await closer.close()
        self._stream = None
        self._audit = None
        return self.stats()

    def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = self._relay.stats() if self._relay is not None else {"name": self._name}
        stats["running"] = self._task is not None and not self._task.done()
        return stats

    def pid(self) -> int:
        return os.getpid()


def start_relays(
    redis_url: str,
    n: int = 1,
    *,
    adapters: ClusterPorts,
    config: RelayConfig | Mapping[str, Any] | None = None,
    first: int = 0,
    directory: Any | None = None,
) -> list[Any]:
    """Start (or find) ``relay:<first>`` .. ``relay:<first+n-1>`` and return their handles once running.

    Needs ``ray.init`` done. ``adapters`` is the cluster layer's implementation of ``actors.ports``
    (``cluster.adapters.ClusterAdapters()``). ``directory`` replaces the trajectory lookup (tests); by
    default each relay resolves ``traj:<id>`` and wakes hibernated trajectories through ``actors.trajectory``.
    """
    import ray

    if n < 1:
        raise ValueError(f"need at least one relay, got n={n}")
    cfg = config if isinstance(config, RelayConfig) else RelayConfig.model_validate(dict(config or {}))
    remote: Any = ray.remote(RelayActor)

    def create(i: int) -> Any:
        return remote.options(
            name=relay_name(i),
            namespace=NAMESPACE,
            get_if_exists=True,
            num_cpus=0,
            max_concurrency=1000,
            lifetime=None,
        ).remote(relay_name(i), redis_url, adapters, cfg.model_dump(), directory)

    handles = [create(i) for i in range(first, first + n)]
    for attempt in (1, 2):
        try:
            ray.get([h.start.remote() for h in handles])
            return handles
        except ray.exceptions.ActorDiedError as e:
            # A relay is replaceable by design (its pending messages are claimed by whoever runs next);
            # one that died before it ever started is simply created again, once.
            if attempt == 2:
                raise
            log.warning("a relay died before starting (%s); creating it again", e)
            handles = [create(i) for i in range(first, first + n)]
    return handles


def stop_relays(handles: list[Any], *, timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """Stop relays gracefully and return their counters (kill them if they do not answer)."""
    import ray

    out: list[dict[str, Any]] = []
    for h in handles:
        try:
            out.append(ray.get(h.stop.remote(), timeout=timeout_s))
        except Exception as e:  # already dead, or stuck: make sure it is gone
            out.append({"error": repr(e)})
        with contextlib.suppress(Exception):
            ray.kill(h)
    # Wait (bounded) until the names are free: a start_relays right after this must create new relays,
    # not find the dying ones through get_if_exists.
    names = [str(stats.get("name")) for stats in out if stats.get("name")]
    give_up = time.monotonic() + timeout_s
    while names and time.monotonic() < give_up:
        names = [n for n in names if _actor_exists(ray, n)]
        if names:
            time.sleep(0.05)
    return out


def _actor_exists(ray: Any, name: str) -> bool:
    try:
        ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return False
    return True
