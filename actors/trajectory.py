"""The trajectory actor: one async Ray actor per trajectory, a thin shell over ``actors.interpreter``.

The trajectory's rules are ``runtime.decide``; the interpreter carries out its decisions. This shell only
builds the ports from the launch record (``actors.wiring``), creates or recovers the record from the durable
log, lets the interpreter run, and receives control messages and durable timers.

- Named ``traj:<id>`` in namespace ``tether``, ``num_cpus=0`` (waiting on a model or a tool is not compute),
  ``{"tether_trajectory": 1}`` when the cluster defines that resource (so the autoscaler can size nodes).
- Restarts are unlimited and calls in flight are retried on the new incarnation: after its worker process
  dies (SIGKILL, node loss) the actor is rebuilt from the same launch, folds its log and continues. Budgets,
  spend, turn count and pending approvals carry over; an operation whose intent was logged but whose result
  was not is *unknown* and is not re-dispatched unless its repeat contract allows it (the decider decides).
- ``deliver(message, received_at, verdict)`` takes a signed control message whose signature, signers,
  roles and validity window (judged when the relay read it) are settled before it looks at anything seen:
  only then is a known id a duplicate and a used nonce (``tether:nonces:<id>``) a replay; a refusal is
  audited in the trajectory's log (``ControlRefused``, which never spends the id of a message that did not
  verify: issue 16). Signatures are checked where messages enter the cluster: the relay reads them from
  Redis, where anyone with access can write, verifies them and passes its ``verdict`` along. A Ray caller
  is trusted already (it could as well write this trajectory's log or call ``cascade``), so the actor
  takes that verdict and never loads the keyring or the signature code (~8.5 MB resident per trajectory
  process, 36 ms to half a second of CPU on every wake). Called without one, it verifies for itself.
- Timers: durable timers (the deadline, an approval's expiry) are stored in the cluster's timer store; its
  service (``cluster.timer_service``) calls ``fire_timer`` on whichever incarnation exists (re-creating a
  hibernated one first).
- Hibernation: when the decider asks for it during a long wait (approval, pause) the actor compacts its
  log (the record as one snapshot entry, the entries it covers trimmed: ``runtime.snapshot``), closes its
  ports, marks its status ``hibernated=1`` and exits for good; ``ensure_actor(load_launch(...))`` brings it
  back on the next signal or timer.
- Kill: the ``on_kill`` hook tears the trajectory's sandbox process groups down at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
import redis.asyncio as aioredis

from actors.children import RayChildren
from actors.interpreter import Interpreter, RunOutcome
from actors.launch import TrajectoryLaunch, load_launch, save_launch
from actors.metrics_ray import RayBackend
from actors.ports import (
    MALFORMED,
    ClusterPorts,
    ControlEnvelope,
    ControlVerdict,
    ControlVerifier,
    VerifiedControl,
    read_verdict,
)
from actors.quarantine import QuarantineGate
from actors.sandbox import Sandbox
from actors.status import StatusPublisher, summarize
from actors.tools_local import LOCAL_SCOPE
from actors.wiring import BuiltPorts, SplitGuard, build_created, build_policy, build_ports, build_registry
from breakers.inprocess import InProcessGuard
from runtime.clock import SystemClock
from runtime.dispatch import NoGuard
from runtime.errors import CodecError, ControlError, InputError
from runtime.events import Event
from runtime.inputs import ControlReceived, ControlRefused
from runtime.memstore import check_trajectory_id
from runtime.metrics import Metrics
from runtime.observe import HookChain, MetricsHooks
from runtime.ports import AdmissionPort, GuardPort
from runtime.record import AuditKind, ControlAction, Lease, LeaseKind, TrajectoryRecord

if TYPE_CHECKING:
    from actors.model_client import RayModelClient

__all__ = [
    "NAMESPACE",
    "NONCE_KEY_PREFIX",
    "TRAJECTORY_RESOURCE",
    "TrajectoryActor",
    "TrajectoryLaunch",
    "actor_name",
    "ensure_actor",
    "load_launch",
    "save_launch",
]

NAMESPACE = "tether"
TRAJECTORY_RESOURCE = "tether_trajectory"
NONCE_KEY_PREFIX = "tether:nonces:"
_NONCE_TTL_S = 2 * 86_400  # longer than any message's validity window (Verifier.max_ttl_s)
_OLDEST_RECEIPT_S = _NONCE_TTL_S / 2  # judged at most this far back, every window is one the nonces outlive
_log = logging.getLogger(__name__)
_WARM_TIMEOUT_S = 60.0  # waiting for the node's model client before the first turn (it may be being placed)


def _not_judged_here(_message_id: str, _nonce: str) -> bool:
    return False  # replay is judged after verification, against the record and the nonce set


def _refusal_reason(record: TrajectoryRecord, message_id: str) -> str:
    """The reason the decider audited for refusing a verified message (an ended trajectory, a settle naming
    nothing owed, ...), so the relay's audit names it rather than a guess."""
    for entry in reversed(record.audit):
        if entry.kind is AuditKind.CONTROL_REJECTED and entry.subject == message_id:
            return entry.reason.upper()
    return "TRAJECTORY_TERMINAL"


def actor_name(trajectory_id: str) -> str:
    """The Ray actor name of a trajectory."""
    return f"traj:{check_trajectory_id(trajectory_id)}"


class _Hooks:
    """Interpreter hooks: the status view on every event, the sandbox teardown on kill."""

    def __init__(self, status: StatusPublisher, sandbox: Sandbox | None) -> None:
        self.status = status
        self.sandbox = sandbox

    def on_event(self, record: TrajectoryRecord, event: Event) -> None:
        self.status.on_event(record, event)

    async def on_kill(self, record: TrajectoryRecord) -> None:
        if self.sandbox is not None:
            await self.sandbox.kill_all()


class _SandboxLeases:
    """The trajectory's leases as the world holds them: the workspace lease is its sandbox (every process
    group killed, the workspace directory removed); a credential lease has nothing to tear down here."""

    def __init__(self, sandbox: Sandbox | None) -> None:
        self.sandbox = sandbox

    async def release(self, lease: Lease) -> None:
        if lease.kind is not LeaseKind.WORKSPACE or self.sandbox is None:
            return
        await self.sandbox.kill_all()
        workspace = self.sandbox.workspace
        await asyncio.to_thread(shutil.rmtree, workspace, True)


class TrajectoryActor:
    """The Ray actor body (wrapped by ``ray.remote`` in ``ensure_actor``).

    Construct with a launch's JSON and the cluster layer's ports (``actors.ports.ClusterPorts``, in
    practice ``cluster.adapters.ClusterAdapters()``): the log store, the live-event sink and the control
    verifier come from there, so this module never imports ``cluster``.
    """

    def __init__(self, launch_json: str, adapters: ClusterPorts) -> None:
        self.launch = TrajectoryLaunch.from_json(launch_json)
        self._adapters = adapters
        # Made on the first message that comes without a relay's verdict (one per incarnation: it caches
        # the keyring); a trajectory reached only through relays never loads it.
        self._verifier: ControlVerifier | None = None
        # The nonces of recorded messages: None until read from Redis (``_warm_control``); until then each
        # check asks Redis. This incarnation is their only writer, so the copy stays whole once read.
        self._nonces: set[str] | None = None
        self._nonces_added: set[str] = set()  # recorded by this incarnation (joined to what is read)
        self._warming: asyncio.Task[None] | None = None
        self._inflight: dict[str, asyncio.Future[str]] = {}  # message id -> the delivery answering it
        self._sandbox: Sandbox | None = None
        self._clock = SystemClock()
        self._start_lock = asyncio.Lock()
        self._harness: Interpreter | None = None
        self._built: BuiltPorts | None = None
        self._redis: aioredis.Redis | None = None
        self._status: StatusPublisher | None = None
        self._loop_task: asyncio.Task[RunOutcome] | None = None
        self._exiting = False
        self._run_callers = 0

    # ------------------------------------------------------------------ Ray methods

    async def run(self) -> dict[str, Any]:
        """Run to a terminal state (or hibernation); return the summary. Callers share one loop."""
        self._run_callers += 1
        try:
            harness = await self._started()
            if self._exiting:
                return summarize(harness.record, hibernated=True)
            outcome = await asyncio.shield(self._ensure_running())
            return summarize(outcome.record, hibernated=outcome.hibernated)
        finally:
            self._run_callers -= 1

    async def deliver(
        self, message: bytes, received_at: float | None = None, verdict: ControlVerdict | None = None
    ) -> str:
        """Verify (or take the relay's verdict), then record one signed control message: "recorded",
        "duplicate" or "rejected:<REASON>".

        ``received_at`` (epoch seconds): when the relay read it from the control stream; its validity window
        is judged then, not now (it may have waited for this actor to be placed). Never later than now, never
        earlier than a day ago (the nonce set outlives every window judged that way).

        ``verdict``: the relay's verification of the message (``actors.ports.ControlVerdict``: signature,
        signers, roles, and the window judged at ``received_at``), taken instead of verifying here; without
        one (any other caller), or with a receipt more than a day old, the message is verified here.

        Verify before dedupe (issue 16): the signature, the signers, their roles and the validity window
        are checked before the message is compared with anything seen, so a copy that does not verify can
        neither take a message id nor pass for a duplicate of the genuine message (it is refused and
        audited, and the genuine one still applies when it comes). Only a verified message whose id the
        record holds is a duplicate; only a verified message whose nonce was used is a replay.
        """
        if self._exiting:
            # about to exit for hibernation: the relay must deliver again to the re-created actor
            raise RuntimeError(f"{actor_name(self.launch.trajectory_id)} is hibernating; deliver again")
        harness = await self._started()
        try:
            msg = self._adapters.decode_control(message)
        except CodecError as e:
            _log.warning("undecodable control message for %s: %s", self.launch.trajectory_id, e)
            return f"rejected:{MALFORMED}"
        if msg.trajectory_id != self.launch.trajectory_id:
            await self._audit(harness, msg, "WRONG_TRAJECTORY", f"addressed to {msg.trajectory_id}")
            return "rejected:WRONG_TRAJECTORY"
        verified = self._judge(msg, received_at, verdict)
        if not isinstance(verified, VerifiedControl):
            reason, detail = verified
            await self._audit(harness, msg, reason, detail)  # unverified: never spends the id
            return f"rejected:{reason}"
        if msg.message_id in harness.record.seen_control_ids:
            return "duplicate"
        inflight = self._inflight.get(msg.message_id)
        if inflight is not None:
            # The same verified message is being delivered right now (two relays, or a redelivery):
            # whatever the first delivery answers, this one is its duplicate, never a second record.
            first = await asyncio.shield(inflight)
            return "duplicate" if first in ("recorded", "duplicate") else first
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._inflight[msg.message_id] = future
        try:
            answer = await self._deliver_new(harness, msg, verified)
        except asyncio.CancelledError:
            future.cancel()
            raise
        except Exception as e:
            future.set_exception(e)
            future.exception()  # retrieved: a failure nobody else waits on must not be logged as lost
            raise
        else:
            future.set_result(answer)
            return answer
        finally:
            del self._inflight[msg.message_id]

    def _judge(
        self, msg: ControlEnvelope, received_at: float | None, verdict: ControlVerdict | None
    ) -> VerifiedControl | tuple[str, str]:
        """Everything but replay (that is judged after, against the record, for verified messages only): the
        message verified, or the (reason, detail) of its refusal. The relay's verdict when it gave one (its
        verification is the one that counts); otherwise, or for a receipt older than this actor would judge
        at (a lane that kept retrying for a day: the nonce set outlives only windows judged since), verified
        here."""
        recent = received_at is not None and received_at >= self._clock.wall() - _OLDEST_RECEIPT_S
        if verdict is not None and recent:
            try:
                return read_verdict(msg, verdict)
            except ValueError as e:  # a caller's bug; verifying here costs memory, never a wrong answer
                _log.warning("%s: %s; verifying here", self.launch.trajectory_id, e)
        try:
            return self._control_verifier().verify(msg, self._judged_at(received_at), _not_judged_here)
        except ControlError as e:
            return e.reason, str(e)

    def _judged_at(self, received_at: float | None) -> float:
        now = self._clock.wall()
        if received_at is None:
            return now
        return max(min(float(received_at), now), now - _OLDEST_RECEIPT_S)

    async def _deliver_new(
        self, harness: Interpreter, msg: ControlEnvelope, verified: VerifiedControl
    ) -> str:
        """Record a verified message with a new id, unless its nonce was used (a replay)."""
        if await self._nonce_used(msg.nonce):
            await self._audit(harness, msg, "REPLAYED", f"message {msg.message_id}: nonce already used")
            return "rejected:REPLAYED"
        payload: dict[str, Any] = dict(msg.payload)
        action = ControlAction(msg.action)
        if action in (ControlAction.APPROVE, ControlAction.DENY):
            # the approval gate reads payload["call_digest"] itself and counts distinct signers
            payload["issuers"] = list(verified.signers)
        signer_roles = dict(verified.signer_roles) or {name: verified.roles for name in verified.signers}
        received = ControlReceived(msg.message_id, action, msg.issuer, msg.reason, payload, signer_roles)
        answer = await harness.deliver(received)
        if answer == "rejected":
            return f"rejected:{_refusal_reason(harness.record, msg.message_id)}"
        if answer == "recorded":
            # the nonce set holds only verified, recorded messages
            self._nonces_added.add(msg.nonce)
            if self._nonces is not None:
                self._nonces.add(msg.nonce)
            client = self._client()
            await client.sadd(self._nonce_key, msg.nonce)
            await client.expire(self._nonce_key, _NONCE_TTL_S)
            self._ensure_running()  # a woken actor runs on from here
        return answer

    async def status(self) -> dict[str, Any]:
        """The current summary plus what a status view shows (pending control, held call)."""
        harness = await self._started()
        rec = harness.record
        held = rec.held
        return {
            **summarize(rec, hibernated=self._exiting),
            "hold": None if rec.hold is None else rec.hold.kind.value,
            "pending_control": [p.action.value for p in rec.pending_control],
            "held": None
            if held is None
            else {"tool": held.tool, "digest": held.digest, "expires_at": held.expires_at},
            "pid": os.getpid(),
            # process groups of sandboxed commands running now (kill tears them down)
            "sandbox_groups": sorted(self._sandbox.live_process_groups) if self._sandbox else [],
        }

    async def fire_timer(self, timer_id: str) -> str:
        """A durable timer delivered by the cluster's timer service: "fired", "not_due" or "unknown"."""
        if self._exiting:
            raise RuntimeError(f"{actor_name(self.launch.trajectory_id)} is hibernating; deliver again")
        interpreter = await self._started()
        answer = await interpreter.fire_timer(timer_id)
        self._ensure_running()  # a woken actor runs on from here
        return answer

    async def cascade(self, kill: bool, parent_id: str, reason: str) -> str:
        """Cancel or kill cascaded from this trajectory's parent (issue 12): an in-cluster call from the
        parent's actor, recorded like a control message from ``parent:<id>`` (idempotent by its id)."""
        if self._exiting:
            raise RuntimeError(f"{actor_name(self.launch.trajectory_id)} is hibernating; deliver again")
        if parent_id != self.launch.parent_id:
            return "rejected:NOT_PARENT"
        harness = await self._started()
        action = ControlAction.KILL if kill else ControlAction.CANCEL
        message_id = f"cascade-{action.value}-{parent_id}"
        answer = await harness.deliver(ControlReceived(message_id, action, f"parent:{parent_id}", reason))
        self._ensure_running()
        return "rejected:TRAJECTORY_TERMINAL" if answer == "rejected" else answer

    def pid(self) -> int:
        """The worker process id (fault tests kill it)."""
        return os.getpid()

    async def exit_hibernated(self) -> None:
        """Exit for good once every run() caller has its answer (called by the actor on itself)."""
        for _ in range(200):  # at most ~2 s: a caller that has not collected its answer by then reads status
            if self._run_callers == 0:
                break
            await asyncio.sleep(0.01)
        ray.actor.exit_actor()  # type: ignore[no-untyped-call]

    # ------------------------------------------------------------------ internals

    @property
    def _nonce_key(self) -> str:
        return NONCE_KEY_PREFIX + self.launch.trajectory_id

    def _client(self) -> aioredis.Redis:
        if self._redis is None:
            self._redis = aioredis.Redis.from_url(self.launch.redis_url, socket_timeout=10.0)
        return self._redis

    def _control_verifier(self) -> ControlVerifier:
        if self._verifier is None:
            self._verifier = self._adapters.control_verifier(self.launch.keyring_path)
        return self._verifier

    async def _nonce_used(self, nonce: str) -> bool:
        if self._nonces is not None:
            return nonce in self._nonces
        return bool(await self._client().sismember(self._nonce_key, nonce))

    async def _warm_control(self) -> None:
        """What a control message needs, made ready off its path once the trajectory has started: the used
        nonces (so a check costs no Redis round trip, which an fsync stall of the server can hold for
        seconds). A failure only logs: the message path asks Redis itself.

        Not the verifier: a message from a relay comes with the relay's verdict, and loading Ed25519 and
        the keyring here cost every trajectory process ~8.5 MB RSS (~3.2 MB USS) and 36 ms to half a second
        of CPU on each wake for a verification that is not needed."""
        try:
            used = await self._client().smembers(self._nonce_key)
        except Exception as e:
            _log.warning("%s: used nonces not read ahead: %r", self.launch.trajectory_id, e)
            return
        self._nonces = {n.decode() if isinstance(n, bytes) else str(n) for n in used} | self._nonces_added

    async def _audit(self, harness: Interpreter, msg: ControlEnvelope, reason: str, detail: str) -> None:
        answer = await harness.deliver(ControlRefused(msg.message_id, reason, detail[:500]))
        if answer == "rejected" and self._status is not None:
            self._status.show(harness.record)

    async def _started(self) -> Interpreter:
        """Build the ports and create (or fold) the record, once per incarnation."""
        if self._harness is not None:
            return self._harness
        async with self._start_lock:
            if self._harness is not None:
                return self._harness
            launch = self.launch
            registry = build_registry(launch)
            guard = self._guard()
            sandbox = self._sandbox = self._make_sandbox()
            timers = self._adapters.timer_store(launch.redis_url)
            model = self._model()
            self._built = build_ports(
                launch,
                self._clock,
                admission=self._admission(model),
                guard=guard,
                logs=self._adapters,
                sandbox=sandbox,
                timers=timers,
                model=model,
            )
            self._built.closers.append(timers.close)
            self._built.ports.leases = _SandboxLeases(sandbox)
            self._supervise(self._built)
            events = self._adapters.live_events(launch.redis_url)
            self._status = StatusPublisher(self._client(), events, launch.trajectory_id, self._clock)
            policy = build_policy(launch, registry)
            if sandbox is not None:
                policy = dataclasses.replace(policy, workspace=str(sandbox.workspace))
            harness = Interpreter(
                launch.trajectory_id,
                policy,
                self._built.ports,
                HookChain(_Hooks(self._status, sandbox), MetricsHooks(Metrics(RayBackend()), self._clock)),
            )
            await harness.create(build_created(launch, registry))
            self._status.show(harness.record)
            self._harness = harness
            self._warming = asyncio.ensure_future(self._warm_control())
            return harness

    def _supervise(self, built: BuiltPorts) -> None:
        """Issue 12: escalations and incidents go to the cluster's registries; every tool call passes the
        quarantine at the dispatch boundary; delegated calls become child trajectories."""
        store = self._adapters.supervision_store(self.launch.redis_url)
        built.closers.append(store.close)
        ports = built.ports
        ports.tools = QuarantineGate(ports.tools, store)
        ports.supervision = store
        ports.children = RayChildren(self.launch, self._adapters, ports.log)

    def _make_sandbox(self) -> Sandbox | None:
        """The trajectory's process sandbox, when the launch names a workspace root. A sandbox that cannot
        be made (an id that is no safe directory name) leaves the trajectory without one: its sandboxed
        tools are refused, everything else runs."""
        root = self.launch.workspace_root
        if not root:
            return None
        try:
            # run_command's contract promises no network: refuse to run rather than run connected
            return Sandbox(self.launch.trajectory_id, Path(root), require_network_isolation=True)
        except InputError as e:
            _log.warning("no sandbox for %s: %s", self.launch.trajectory_id, e)
            return None

    def _model(self) -> RayModelClient | None:
        """The node's model client (None: ``model_placement: trajectory``, the in-process adapter)."""
        if self.launch.model_placement != "node":
            return None
        from actors.model_client import ModelTarget, RayModelClient

        provider = self.launch.provider
        target = ModelTarget(provider.base_url, provider.api_key_env, tally_redis_url=self.launch.redis_url)
        return RayModelClient(target, clock=self._clock)

    def _admission(self, model: RayModelClient | None) -> AdmissionPort:
        """The scheduler actor's handle (or ``AlwaysAdmit``); with the node's model client, it warms that
        client before the first admission (``AdmitWhenWarm``: calls granted while the client starts would
        reach the provider in one burst)."""
        from actors.model_client import AdmitWhenWarm
        from scheduler.actor import SCHEDULER_NAME, SCHEDULER_NAMESPACE, SchedulerHandle
        from scheduler.inprocess import AlwaysAdmit

        admission: AdmissionPort = AlwaysAdmit(clock=self._clock)
        if self.launch.use_scheduler:
            with contextlib.suppress(ValueError):
                admission = SchedulerHandle(ray.get_actor(SCHEDULER_NAME, namespace=SCHEDULER_NAMESPACE))
        if model is None:
            return admission
        return AdmitWhenWarm(admission, model, _WARM_TIMEOUT_S, self.launch.trajectory_id)

    def _guard(self) -> GuardPort:
        tid = self.launch.trajectory_id
        if self.launch.guard == "none":
            return NoGuard()
        local = InProcessGuard(self._clock, holder=tid)
        if self.launch.guard == "local":
            return local
        from breakers.guard import GuardHandle

        return SplitGuard(GuardHandle(holder=tid), local, frozenset({LOCAL_SCOPE}))

    def _ensure_running(self) -> asyncio.Task[RunOutcome]:
        # One loop per incarnation: harness.run() only returns terminal or hibernated, and both are final
        # for this process (a hibernated actor exits; a woken trajectory runs in a new incarnation).
        if self._loop_task is None:
            self._loop_task = asyncio.ensure_future(self._loop())
        return self._loop_task

    async def _loop(self) -> RunOutcome:
        harness = await self._started()
        outcome = await harness.run()
        assert self._status is not None
        if outcome.hibernated:
            self._exiting = True
            # at rest the trajectory costs its log: compact it to one record snapshot (runtime.snapshot)
            await harness.compact()
            self._status.show(outcome.record, hibernated=True)
        else:
            self._status.show(outcome.record)
        await self._status.flush()
        if outcome.hibernated:
            await self._shutdown()
            me = ray.get_runtime_context().current_actor
            # No retries: the actor's max_task_retries=-1 would otherwise resubmit this call when the exit
            # it causes is seen as a failure (log noise about infinite retries, then "dead actor").
            me.exit_hibernated.options(max_task_retries=0).remote()
        return outcome

    async def _shutdown(self) -> None:
        if self._warming is not None and not self._warming.done():
            self._warming.cancel()
        if self._harness is not None:
            await self._harness.close()
        if self._built is not None:
            await self._built.close()
        if self._status is not None:
            await self._status.close()
        if self._redis is not None:
            await self._redis.aclose()
            self._redis = None


_RemoteTrajectory: Any = ray.remote(TrajectoryActor)


def ensure_actor(launch: TrajectoryLaunch, adapters: ClusterPorts) -> Any:
    """The actor ``traj:<id>``: the live one if it exists, else a new one built from ``launch``.

    ``adapters`` is the cluster layer's implementation of ``actors.ports.ClusterPorts``
    (``cluster.adapters.ClusterAdapters()``); it is pickled into the actor's constructor arguments.
    """
    if launch.resources is not None:
        resources = dict(launch.resources)
    elif ray.cluster_resources().get(TRAJECTORY_RESOURCE, 0) > 0:  # type: ignore[no-untyped-call]
        resources = {TRAJECTORY_RESOURCE: 1.0}
    else:
        resources = {}
    return _RemoteTrajectory.options(
        name=actor_name(launch.trajectory_id),
        namespace=NAMESPACE,
        get_if_exists=True,
        num_cpus=0,
        max_restarts=-1,
        max_task_retries=-1,
        resources=resources,
    ).remote(launch.to_json(), adapters)
