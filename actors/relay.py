"""Control relays: carry signed control messages from ``tether:control:<n>`` to the trajectory actors.

The loop (membership and partition leases, per-trajectory lanes, acks and audits) is ``actors.relay_loop``;
this module is what it delivers through and the Ray shell around it:

- ``TrajectoryTargets`` verifies a message (signature, signer known, role, validity window) **before** it
  reaches for the trajectory: a message that does not verify never wakes anything (issue 16: an unsigned
  message to a hibernated trajectory used to cost a process). It is still handed to a *live* incarnation,
  the authority, which audits the refusal in the trajectory's own log; otherwise the relay refuses it
  itself. A verified message is delivered to a live incarnation, waking or replacing the actor as needed
  (``actors.incarnation``), unless the trajectory ended (``terminal``) or never existed (``unknown``). An
  operator's settle or handoff (``runtime.record.ANY_STATE_ACTIONS``) applies in any state, so it is
  delivered to an ended trajectory too (woken from its log; the decider records it or says why not).
- The relay's verification is the one that counts. Signatures are checked where messages enter the
  cluster: the relay reads them from Redis, where anyone with access to it can write. A caller inside the
  cluster is trusted already (it could as well append to the trajectory's log, or ``cascade`` a kill), so
  the relay hands its verdict to the actor with the message (``actors.ports.ControlVerdict``), and the
  actor takes it instead of verifying again: the keyring and the signature code cost every trajectory
  process ~8.5 MB resident and 36 ms to half a second of CPU on each wake. What only the trajectory can
  judge (addressed to it, a duplicate, a replayed nonce) it still judges.
- ``RelayActor`` is the async Ray actor ``relay:<n>`` (``num_cpus=0``); ``start_relays`` / ``stop_relays``
  the helpers the runner, tests and benchmarks call. The Redis transport and the audit sink come from the
  injected ``actors.ports.ClusterPorts`` (``cluster.adapters``): ``actors/`` never imports ``cluster``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Mapping
from typing import Any

from actors.incarnation import Incarnations, Reach, TargetGone
from actors.incarnation_ray import RedisTrajectories, ray_incarnations, stop_named_actors
from actors.ports import (
    MALFORMED,
    AuditSink,
    ClusterPorts,
    ControlEnvelope,
    ControlVerdict,
    ControlVerifier,
    RelayStream,
    refused_verdict,
    verified_verdict,
)
from actors.relay_loop import (
    AUDIT_STREAM,
    DEFAULT_GROUP,
    NAMESPACE,
    TERMINAL,
    UNKNOWN,
    AuditEntry,
    AuditReason,
    DeliveryPort,
    HandleResult,
    Relay,
    RelayConfig,
    StreamPort,
    owner_of,
    relay_name,
)
from runtime.clock import Clock, SystemClock
from runtime.errors import CodecError, ControlError
from runtime.record import ANY_STATE_ACTIONS

__all__ = [
    "AUDIT_STREAM",
    "DEFAULT_GROUP",
    "NAMESPACE",
    "TERMINAL",
    "UNKNOWN",
    "AuditEntry",
    "AuditReason",
    "AuditSink",
    "DeliveryPort",
    "HandleResult",
    "Relay",
    "RelayActor",
    "RelayConfig",
    "StreamPort",
    "TargetGone",
    "TrajectoryTargets",
    "owner_of",
    "relay_name",
    "start_relays",
    "stop_relays",
]

log = logging.getLogger(__name__)


_ANY_STATE = frozenset(a.value for a in ANY_STATE_ACTIONS)


def _never_seen(_message_id: str, _nonce: str) -> bool:
    return False  # replay is the trajectory's to judge: only its record knows what it has seen


class TrajectoryTargets:
    """The relays' ``DeliveryPort``: verify first, then reach (or wake) the trajectory's actor."""

    any_state_actions: frozenset[str] = _ANY_STATE  # delivered to ended trajectories too

    def __init__(
        self,
        incarnations: Incarnations,
        store: RedisTrajectories,
        adapters: ClusterPorts,
        clock: Clock | None = None,
    ) -> None:
        self.incarnations = incarnations
        self.store = store
        self.adapters = adapters
        self.clock = clock or SystemClock()
        self.refused_here = 0  # unverified messages no live incarnation heard (refused by the relay itself)
        self._verifiers: dict[str | None, ControlVerifier] = {}

    def _verifier(self, keyring_path: str | None) -> ControlVerifier:
        verifier = self._verifiers.get(keyring_path)
        if verifier is None:
            verifier = self._verifiers[keyring_path] = self.adapters.control_verifier(keyring_path)
        return verifier

    async def deliver(self, envelope: ControlEnvelope, received_at: float | None = None) -> str:
        """The trajectory's answer to ``envelope``, read by the relay at ``received_at`` (epoch seconds; the
        time its validity window is judged at; default now)."""
        tid = envelope.trajectory_id
        when = self.clock.wall() if received_at is None else received_at
        try:
            launch = await self.store.launch(tid)
        except CodecError as e:
            return f"rejected:BAD_LAUNCH:{e}"
        if launch is None:
            # no launch, so no keyring to judge by: a live incarnation (if any) verifies for itself
            return await self._to_live(envelope, when, UNKNOWN, None)
        try:
            # the launch names the keyring its actor would verify against; check the same one here
            verified = self._verifier(launch.keyring_path).verify(envelope, when, _never_seen)
        except (ControlError, CodecError) as e:
            reason = e.reason if isinstance(e, ControlError) else MALFORMED
            refused = refused_verdict(reason, str(e))
            return await self._to_live(envelope, when, f"rejected:{reason}:{e}", refused)
        # An operator's settle or handoff applies in any state (issue 11): an ended trajectory still owes
        # what it owes, so it is woken from its log for these, and only these.
        any_state = envelope.action in self.any_state_actions
        verdict = verified_verdict(verified)
        reached = await self.incarnations.call(
            tid, "deliver", envelope.data, when, verdict, wake_ended=any_state
        )
        if reached.reach is Reach.UNKNOWN:
            return UNKNOWN
        if reached.reach is Reach.TERMINAL:
            return TERMINAL
        return str(reached.value)

    async def _to_live(
        self, envelope: ControlEnvelope, when: float, otherwise: str, verdict: ControlVerdict | None
    ) -> str:
        """Hand a message that must not wake anything to a live incarnation (the authority, which audits
        a refusal in its own log, ``verdict`` saying why), or answer ``otherwise`` when there is none."""
        reached = await self.incarnations.call(
            envelope.trajectory_id, "deliver", envelope.data, when, verdict, wake=False
        )
        if reached.reach is Reach.CALLED:
            return str(reached.value)
        self.refused_here += 1
        return otherwise


class RelayActor:
    """Ray shell around ``Relay`` (async actor, ``num_cpus=0``). The loop starts on the first call to
    ``start()`` and runs until ``stop()`` or the actor is killed. ``adapters`` supplies the control stream,
    the audit sink and the verifier (``cluster.adapters.ClusterAdapters``), and is handed on to woken
    trajectories. ``targets`` replaces the trajectory side (tests)."""

    def __init__(
        self,
        name: str,
        redis_url: str,
        adapters: ClusterPorts,
        config: dict[str, Any] | None = None,
        targets: DeliveryPort | None = None,
    ) -> None:
        self._name = name
        self._redis_url = redis_url
        self._adapters = adapters
        self._config = RelayConfig.model_validate(config or {})
        self._targets = targets
        self._relay: Relay | None = None
        self._task: asyncio.Task[None] | None = None
        self._stream: RelayStream | None = None
        self._audit: AuditSink | None = None
        self._incarnations: Incarnations | None = None
        self._store: RedisTrajectories | None = None

    async def start(self) -> bool:
        """Start the loop (idempotent); True once the groups exist and the loop runs."""
        if self._task is not None and not self._task.done():
            return True
        cfg = self._config
        self._stream = self._adapters.relay_stream(self._redis_url)
        self._audit = self._adapters.audit_sink(self._redis_url, cfg.audit_maxlen)
        targets = self._targets
        if targets is None:
            self._incarnations, self._store = ray_incarnations(
                self._redis_url,
                self._adapters,
                call_timeout_s=cfg.deliver_timeout_s,
                wake_wait_s=cfg.wake_wait_s,
            )
            targets = TrajectoryTargets(self._incarnations, self._store, self._adapters)
        self._relay = Relay(self._name, self._stream, targets, self._audit, cfg)
        await self._relay.start()
        self._task = asyncio.get_running_loop().create_task(self._relay.run_forever())
        return True

    async def stop(self) -> dict[str, Any]:
        """Stop after the current step (bounded by ``block_ms``), give the partitions back; returns the
        final counters."""
        if self._relay is not None:
            self._relay.stop()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(self._task, self._config.block_ms / 1000 + 5.0)
        if self._relay is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._relay.shutdown(), 5.0)
        stats = self.stats()
        for closer in (self._stream, self._audit, self._store):
            if closer is not None:
                with contextlib.suppress(Exception):  # best effort: the connection may already be gone
                    await closer.close()
        self._stream = self._audit = self._store = None
        return stats

    def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = self._relay.stats() if self._relay is not None else {"name": self._name}
        stats["running"] = self._task is not None and not self._task.done()
        if self._incarnations is not None:
            stats["woken"] = self._incarnations.woken
            stats["replaced"] = self._incarnations.replaced
            stats["waking"] = self._incarnations.gate.waiting
        return stats

    async def idle(self, timeout_s: float = 30.0) -> bool:
        """True once every lane has emptied (within ``timeout_s``)."""
        if self._relay is None:
            return True
        try:
            await asyncio.wait_for(self._relay.idle(), timeout_s)
        except TimeoutError:
            return False
        return True

    def pid(self) -> int:
        return os.getpid()


def start_relays(
    redis_url: str,
    n: int = 1,
    *,
    adapters: ClusterPorts,
    config: RelayConfig | Mapping[str, Any] | None = None,
    first: int = 0,
    targets: DeliveryPort | None = None,
) -> list[Any]:
    """Start (or find) ``relay:<first>`` .. ``relay:<first+n-1>`` and return their handles once running.

    Needs ``ray.init`` done. ``adapters`` is the cluster layer's implementation of ``actors.ports``
    (``cluster.adapters.ClusterAdapters()``). ``targets`` replaces the trajectory side (tests); by default
    each relay verifies, then reaches ``traj:<id>``, waking hibernated trajectories (``actors.incarnation``).
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
        ).remote(relay_name(i), redis_url, adapters, cfg.model_dump(), targets)

    handles = [create(i) for i in range(first, first + n)]
    for attempt in (1, 2):
        try:
            ray.get([h.start.remote() for h in handles])
            return handles
        except ray.exceptions.ActorDiedError as e:
            # A relay is replaceable by design (its partitions are taken over by whoever runs next);
            # one that died before it ever started is simply created again, once.
            if attempt == 2:
                raise
            log.warning("a relay died before starting (%s); creating it again", e)
            handles = [create(i) for i in range(first, first + n)]
    return handles


def stop_relays(handles: list[Any], *, timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """Stop relays gracefully and return their counters (kill them if they do not answer)."""
    return stop_named_actors(handles, NAMESPACE, timeout_s=timeout_s)
