"""The interpreter: a trajectory's decider brought to the world (ARCHITECTURE.md, "a decider").

Input -> ``runtime.decide`` -> append the events durably (one batch, one acknowledgement) -> carry out the
effects, concurrently -> their results are the next inputs. Nothing is decided here: this module only turns
effects into port calls and port results (and port errors) into inputs. Inputs are decided one at a time,
in arrival order; an effect that reaches outside never starts before the events of its decision are
durable (intent before effect).

Batches: a decision on an effect's result whose own effects touch only admission, permits, settlement and
local timers (leases that lapse by themselves if the actor dies) is *held*: those effects start at once and
its events go out with the next batch, in log order, before the next effect that reaches outside (or after
``hold_s``, so an admission that queues for minutes does not keep a learned result off the disk). A plain
tool-using turn is then two fsyncs, one per intent: [the tool's outcome, the next request, the turn
started, the model call's intent] and [the reply settled, the call queued, the dispatch intent]. A crash
loses at most the held events, exactly as it would have lost a decision just before its append; control
deliveries and timer deliveries always wait for their batch (their callers acknowledge on it). Evidence only
the world could tell again is never held (``_may_hold_events``): the result of a call that may not be
repeated, a settlement, a started job's handle, an obligation.

When an append fails (the log store gave up after its outage budget), nothing of that decision happened:
no event is kept and no effect is started. Whatever was in flight may now have lost its answer, so the
interpreter does what a new incarnation would: it waits for the log, folds it again and decides
``Recovered`` (``runtime._decide_recover``). A write that failed is never followed by an event that
presumes it succeeded.

Timers: a ``StartTimer`` effect arms a local timer; durable kinds (the deadline, an approval's expiry) are
also stored in the cluster's timer store, whose service delivers them (``fire_timer``) to whichever
incarnation exists, waking a hibernated trajectory.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from actors import aio
from runtime.clock import Clock
from runtime.codec import encode
from runtime.decider import Decision, decide, evolve
from runtime.delegation import ChildEvidence, DelegationContract
from runtime.dispatch import NoGuard
from runtime.effects import (
    AcquirePermit,
    CallModel,
    CancelChild,
    CancelModelStream,
    CancelTimer,
    CancelToolCall,
    DispatchTool,
    Effect,
    Hibernate,
    KillProcesses,
    OpenIncident,
    ProbeTool,
    PublishEscalation,
    ReleaseLease,
    ReleasePermit,
    ReportLimits,
    RequestAdmission,
    SettleAdmission,
    SpawnChild,
    StartTimer,
)
from runtime.errors import (
    AdmissionRefused,
    DependencyError,
    InputError,
    ModelCallCancelled,
    PolicyRefusal,
    ProviderRateLimited,
)
from runtime.events import (
    CleanupSettled,
    Event,
    ObligationRegistered,
    ObligationUpdated,
    ObservationAppended,
    ObservationKind,
    OperationSettled,
    TimerFired,
    ToolJobStarted,
    ToolResultAccepted,
    TrajectoryCreated,
)
from runtime.fold import fold
from runtime.inputs import (
    AdmissionDenied,
    AdmissionGranted,
    ChildFinished,
    ControlReceived,
    ControlRefused,
    Input,
    ModelCancelled,
    ModelFailed,
    ModelReplied,
    PermitGranted,
    PermitRefused,
    ProbeAnswered,
    Recovered,
    Started,
    TimerDue,
    ToolOutcomeReceived,
)
from runtime.policy import TrajectoryPolicy
from runtime.ports import (
    AdmissionPort,
    CancelToken,
    GuardPermit,
    GuardPort,
    LogStore,
    ModelPort,
    OutcomeClass,
    ProbeResult,
    RateLimitInfo,
    SandboxPermit,
    Settlement,
    ToolOutcome,
    ToolPort,
    Usage,
)
from runtime.record import Lease, Timer, TrajectoryRecord
from runtime.snapshot import encode_snapshot, events_after_snapshot, fold_entries
from runtime.states import TrajectoryState

__all__ = [
    "ChildrenPort",
    "Hooks",
    "Interpreter",
    "InterpreterPorts",
    "LeasePort",
    "RunOutcome",
    "SupervisionPort",
    "TimerPort",
]

_log = logging.getLogger(__name__)
_WAITING = frozenset({TrajectoryState.PAUSED, TrajectoryState.AWAITING_APPROVAL})


class Hooks(Protocol):
    """Extension points with no-op defaults (metrics, live views, sandbox teardown)."""

    def on_event(self, record: TrajectoryRecord, event: Event) -> None: ...

    async def on_kill(self, record: TrajectoryRecord) -> None: ...


class _NoHooks:
    def on_event(self, record: TrajectoryRecord, event: Event) -> None:
        return None

    async def on_kill(self, record: TrajectoryRecord) -> None:
        return None


class LeasePort(Protocol):
    """Gives leases back when FINALIZING releases them (a workspace is torn down and removed)."""

    async def release(self, lease: Lease) -> None: ...


class TimerPort(Protocol):
    """Where durable timers are stored (``actors.ports.TimerStore``, over Redis)."""

    async def schedule(self, trajectory_id: str, timer_id: str, due_at: float) -> None: ...

    async def cancel(self, trajectory_id: str, timer_id: str) -> None: ...


class SupervisionPort(Protocol):
    """Where escalations and self-opened incidents are published (``actors.ports.SupervisionStore``)."""

    async def publish_escalation(self, escalation: Mapping[str, Any]) -> None: ...

    async def open_incident(self, incident: Mapping[str, Any], artifacts: Sequence[str]) -> None: ...


class ChildrenPort(Protocol):
    """Child trajectories (``actors.children.RayChildren``): start one and wait for its evidence; cascade."""

    async def run_child(self, contract: DelegationContract) -> ChildEvidence: ...

    async def cancel_child(self, child_id: str, kill: bool, reason: str) -> None: ...


@dataclass
class InterpreterPorts:
    """Everything outside the pure core the interpreter talks to."""

    model: ModelPort
    tools: ToolPort
    log: LogStore
    admission: AdmissionPort
    clock: Clock
    guard: GuardPort = field(default_factory=NoGuard)
    timers: TimerPort | None = None  # None: durable timers live only as long as this process
    leases: LeasePort | None = None  # None: leases are records only
    # issue 12: None when the runtime has no registry (escalations stay in the log) / no delegation
    supervision: SupervisionPort | None = None
    children: ChildrenPort | None = None


# Effects that may start while their decision's events are still held: they touch nothing outside but
# admission, permits and settlement, whose leases lapse by themselves if the actor dies, and local timers.
# A crash loses the held events with them, as it would have lost them just before an append.
_BEFORE_THE_LOG = (
    RequestAdmission,
    SettleAdmission,
    ReportLimits,
    AcquirePermit,
    ReleasePermit,
    StartTimer,
    CancelTimer,
)


# Events that are evidence of what an outside effect did or owes: written at once, never held. A crash
# that lost one would turn a known outcome into an unknown one (or forget a duty), and an unknown outcome
# of an operation that may not be repeated costs a probe or an operator.
_EVIDENCE = (OperationSettled, CleanupSettled, ToolJobStarted, ObligationRegistered, ObligationUpdated)


def _may_hold_events(record: TrajectoryRecord, events: Sequence[Event]) -> bool:
    """Whether ``events`` may wait in memory for the next batch: nothing in them is evidence that only
    the world holds otherwise. A tool's result may wait only when its operation is repeat-safe (an
    idempotent or deduplicated call that recovery may simply send again)."""
    for event in events:
        if isinstance(event, _EVIDENCE):
            return False
        if isinstance(event, ToolResultAccepted):
            op = record.operation_for_call(event.call_id)
            if op is None or not op.repeat_safe:
                return False
    return True


@dataclass(frozen=True, slots=True)
class _Held:
    """One decided event not yet written: the record after it, and the timer it fired (if any)."""

    event: Event
    record: TrajectoryRecord
    fired: Timer | None


@dataclass(frozen=True, slots=True)
class RunOutcome:
    """How ``Interpreter.run`` returned: the trajectory ended, or it hibernated while waiting."""

    record: TrajectoryRecord
    hibernated: bool = False


class Interpreter:
    """Carries out one trajectory's decisions (see the module docstring)."""

    def __init__(
        self,
        trajectory_id: str,
        policy: TrajectoryPolicy,
        ports: InterpreterPorts,
        hooks: Hooks | None = None,
        *,
        recovery_budget_s: float = 300.0,
        hold_s: float = 0.05,
    ) -> None:
        self.trajectory_id = trajectory_id
        self.policy = policy
        self.ports = ports
        self.hooks: Hooks = hooks or _NoHooks()
        self.recovery_budget_s = recovery_budget_s
        self._record: TrajectoryRecord | None = None
        self._events: list[Event] = []
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Future[Any]] = set()
        self._timers: dict[str, asyncio.Future[Any]] = {}
        self._model_token: CancelToken | None = None
        self._ended = asyncio.Event()
        self._hibernated = False
        self._recovering: asyncio.Future[None] | None = None
        self._closed = False
        self.hold_s = hold_s
        self._held: list[_Held] = []  # decided, not yet written (see ``submit``)
        self._durable: TrajectoryRecord | None = None  # the record as the log holds it
        self._flusher: asyncio.Future[None] | None = None
        self.appends = 0  # durable batches written

    # ------------------------------------------------------------------ the record

    @property
    def record(self) -> TrajectoryRecord:
        if self._record is None:
            raise RuntimeError("the interpreter has no record yet: call create() or recover()")
        return self._record

    @property
    def events(self) -> Sequence[Event]:
        return tuple(self._events)

    async def create(self, created: TrajectoryCreated, goal: str | None = None) -> TrajectoryRecord:
        """Start a new trajectory, or fold an existing log with the same id (idempotent create)."""
        if await self.ports.log.exists(self.trajectory_id):
            return await self.recover()
        goal_text = goal or created.contract.goal
        first: list[Event] = [created, ObservationAppended(ObservationKind.USER, goal_text)]
        await self.ports.log.append_many(self.trajectory_id, [encode(e) for e in first])
        self.appends += 1
        self._events = list(first)
        self._record = self._durable = fold(first, self.policy)
        for event in first:
            self.hooks.on_event(self._record, event)
        await self.submit(Started())
        return self.record

    async def recover(self) -> TrajectoryRecord:
        """Rebuild the record from the durable log (a restarted or re-created actor) and decide
        ``Recovered``."""
        await self._reload()
        await self.submit(Recovered())
        return self.record

    async def _reload(self) -> None:
        entries = await self.ports.log.read(self.trajectory_id)
        # the newest record snapshot plus the events after it (the whole log when it has none)
        self._held, self._flusher = [], None
        self._record = self._durable = fold_entries(entries, self.policy)
        self._events = events_after_snapshot(entries)

    async def compact(self) -> bool:
        """Write the record as one snapshot entry at the end of the log, then trim the entries before it
        (``runtime.snapshot``): what a hibernating trajectory leaves in Redis. The snapshot is durable
        before anything is trimmed, and the trim removes only what it covers, so a crash in between loses
        nothing. Skipped (False) when the record may not be the log's fold (recovering after a failed
        write) or a write fails (the log then stays whole)."""
        async with self._lock:
            if self._record is None or self._closed:
                return False
            if self._recovering is not None and not self._recovering.done():
                return False
            try:
                await self._flush()  # the snapshot covers only what the log holds
            except Exception:
                return False  # reported, and recovery started, by _flush
            try:
                [snapshot_id] = await self.ports.log.append_many(
                    self.trajectory_id, [encode_snapshot(self._record)]
                )
            except Exception as e:
                _log.warning("%s: no snapshot written, the log stays whole: %s", self.trajectory_id, e)
                return False
            try:
                await self.ports.log.trim(self.trajectory_id, snapshot_id)
            except Exception as e:  # the snapshot covers the untrimmed entries: recovery skips them
                _log.warning("%s: snapshot written, trim failed (harmless): %s", self.trajectory_id, e)
            return True

    # ------------------------------------------------------------------ inputs

    async def submit(self, inp: Input, *, durable: bool = True) -> Decision:
        """Decide ``inp``, make its events durable, then start its effects.

        With ``durable=False`` (an effect's result, a local timer) a decision whose effects touch nothing
        outside but leases that lapse by themselves (``_BEFORE_THE_LOG``) is held: its events join the next
        batch, written before the next effect that does touch the world (or within ``hold_s``), so a turn
        costs one fsync per intent. Every other decision is written at once, with whatever was held before
        it, in log order: an intent is always durable before its effect starts."""
        async with self._lock:
            record = before_decision = self.record
            decision = decide(record, inp, self.ports.clock.wall())
            # Stopping announces no external effect, so it need not wait for the log: a kill tears the
            # processes down and a stream is aborted while the decision is being made durable (one slow
            # fsync held kills for seconds). The relay still acknowledges only after the append; a crash
            # before it means redelivery, which records the stop then.
            teardown: asyncio.Future[None] | None = None
            for effect in decision.effects:
                if isinstance(effect, CancelModelStream):
                    self._start(effect)
                elif isinstance(effect, KillProcesses) and teardown is None:
                    teardown = asyncio.ensure_future(self._kill(effect))
            if decision.events:
                # the records the decision evolved (the same fold; recomputed only if a decision lacks them)
                after = decision.records if len(decision.records) == len(decision.events) else None
                for i, event in enumerate(decision.events):
                    before = record
                    record = after[i] if after is not None else evolve(record, event)
                    fired = before.timers.get(event.timer_id) if isinstance(event, TimerFired) else None
                    self._held.append(_Held(event, record, fired))
            write = (
                durable
                or record.is_terminal
                or not self._may_hold(decision.effects)
                or not _may_hold_events(before_decision, decision.events)
            )
            try:
                if self._held and write:
                    await self._flush()
                elif decision.events:
                    self._record = record
                    self._flush_later()
            finally:
                if teardown is not None:
                    await teardown
            for effect in decision.effects:
                # a stop started above; kill acts at once: the processes are gone before it is acknowledged
                if not isinstance(effect, KillProcesses | CancelModelStream):
                    self._start(effect)
            if record.is_terminal:
                self._ended.set()
            elif self._hibernated and (record.state not in _WAITING or record.pending_control):
                # asked to hibernate, then woken before the actor left: it runs on
                self._hibernated = False
                self._ended.clear()
        return decision

    def _may_hold(self, effects: Sequence[Effect]) -> bool:
        for effect in effects:
            if isinstance(effect, StartTimer | CancelTimer):
                if effect.timer.kind.durable and self.ports.timers is not None:
                    return False  # the timer store is outside: it must not hold a timer the log lacks
            elif not isinstance(effect, _BEFORE_THE_LOG):
                return False
        return True

    async def _flush(self) -> None:
        """Write everything held as one batch (caller holds the lock). On failure nothing held happened:
        the record goes back to the durable one and the interpreter recovers from the log."""
        held, self._held = self._held, []
        if self._flusher is not None and self._flusher is not asyncio.current_task():
            self._flusher.cancel()
        self._flusher = None
        if not held:
            return
        try:
            await self.ports.log.append_many(self.trajectory_id, [encode(h.event) for h in held])
        except Exception as e:
            # Nothing of these decisions happened. Whatever they answered may be lost: recover.
            _log.warning("%s: append failed (%s); recovering from the log", self.trajectory_id, e)
            self._record = self._durable
            self._start_recovery()
            raise
        self.appends += 1
        for h in held:
            self._events.append(h.event)
            self.hooks.on_event(h.record, h.event)
            if h.fired is not None:
                self._forget_timer(h.fired)
        self._durable = self._record = held[-1].record

    def _flush_later(self) -> None:
        """Bound how long held events stay in memory (an admission may queue for minutes)."""
        if self._flusher is None or self._flusher.done():
            self._flusher = self._spawn(self._flush_after_hold())

    async def _flush_after_hold(self) -> None:
        await self.ports.clock.sleep(self.hold_s)
        async with self._lock:
            if self._flusher is not asyncio.current_task():
                return  # a batch went out meanwhile and took the held events with it
            try:
                await self._flush()
            except Exception:
                return  # reported, and recovery started, by _flush

    async def deliver(self, message: ControlReceived | ControlRefused) -> str:
        """Record a verified control message (or audit a refused one); the answer the relay acts on:
        "recorded", "duplicate" or "rejected". Returns only once the record is durable."""
        decision = await self.submit(message)
        return decision.reply or "recorded"

    async def fire_timer(self, timer_id: str) -> str:
        """A durable timer delivered by the cluster's timer service: "fired", "not_due" or "unknown"."""
        decision = await self.submit(TimerDue(timer_id))
        return decision.reply or "unknown"

    async def run(self) -> RunOutcome:
        """Wait until the trajectory is terminal, or asked to hibernate while it still waits for a person
        (a hibernation asked for before an input woke it again does not count)."""
        while True:
            if self.record.is_terminal:
                return RunOutcome(self.record)
            if self._hibernated:
                return RunOutcome(self.record, hibernated=True)
            await self._ended.wait()

    async def close(self, timeout_s: float = 10.0) -> None:
        """Cancel every effect and timer this interpreter started (the actor is going away), waiting for
        them at most ``timeout_s``: a task whose cancel was swallowed below it (a client library turning it
        into a timeout it then handles) must not keep the actor from going away."""
        self._closed = True
        tasks = [t for t in [*self._tasks, *self._timers.values()] if not t.done()]
        what = f"{self.trajectory_id}: an effect or timer"
        await asyncio.gather(*(aio.stop(t, what=what, within_s=timeout_s) for t in tasks))
        self._tasks.clear()
        self._timers.clear()

    # ------------------------------------------------------------------ recovery after a failed write

    def _start_recovery(self) -> None:
        if self._recovering is None or self._recovering.done():
            self._recovering = asyncio.ensure_future(self._recover_after_failure())

    async def _recover_after_failure(self) -> None:
        # Everything in flight answers a decision that may not exist: stop it, as a crash would.
        for t in [*self._tasks, *self._timers.values()]:
            if t is not asyncio.current_task():
                t.cancel()
        self._timers.clear()
        if self._model_token is not None:
            self._model_token.cancel("recovering")
        clock = self.ports.clock
        give_up = clock.now() + self.recovery_budget_s
        delay = 0.5
        while not self._closed:
            try:
                async with self._lock:
                    await self._reload()
                break
            except Exception as e:
                if clock.now() >= give_up:
                    budget = self.recovery_budget_s
                    _log.error("%s: the log stayed unreachable for %.0fs: %s", self.trajectory_id, budget, e)
                    raise
                await clock.sleep(delay)
                delay = min(delay * 2, 10.0)
        await self.submit(Recovered())

    # ------------------------------------------------------------------ effects

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Future[None]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _answer(self, effect: Effect) -> None:
        """Run one effect and decide its result (if it has one).

        Permits travel with their attempt: the decider gives them back when it decides the attempt's
        result. A result it never decides (the interpreter closed, or recovery stopped the effect) would
        keep its permits until their leases lapse (the guard's ``lease_s``, minutes), so they are given
        back here, with no outcome recorded: a probe among them counts as abandoned."""
        held = _permits_of(effect)
        decided = False
        try:
            inp = await self._carry(effect)
            held = _permits_of(inp) or held
            if aio.cancel_requested():
                # cancelled (close, or recovery after a failed write), but a library below turned the cancel
                # into an error the effect reported as its result: a result of a stopped effect is not decided
                raise asyncio.CancelledError
            if inp is not None and not self._closed:
                await self.submit(inp, durable=False)
                decided = True
        except asyncio.CancelledError:
            raise
        except Exception:
            _log.exception("%s: an effect's result could not be decided", self.trajectory_id)
        finally:
            if held is not None and not decided:
                # shielded: a second cancel (close's) must not stop the release half way
                await asyncio.shield(self._release(*held, None))

    def _start(self, effect: Effect) -> None:
        if isinstance(effect, StartTimer):
            self._arm(effect.timer)
        elif isinstance(effect, CancelTimer):
            self._disarm(effect.timer)
        elif isinstance(effect, CancelModelStream):
            if self._model_token is not None:
                self._model_token.cancel(effect.reason)
        elif isinstance(effect, Hibernate):
            self._hibernated = True
            self._ended.set()
        else:
            self._spawn(self._answer(effect))

    async def _carry(self, effect: Effect) -> Input | None:
        if isinstance(effect, RequestAdmission):
            return await self._admit(effect)
        if isinstance(effect, CallModel):
            return await self._call_model(effect)
        if isinstance(effect, AcquirePermit):
            return await self._permit(effect)
        if isinstance(effect, DispatchTool):
            return await self._dispatch(effect)
        if isinstance(effect, ProbeTool):
            return await self._probe(effect)
        if isinstance(effect, SpawnChild):
            return await self._run_child(effect)
        if isinstance(effect, PublishEscalation | OpenIncident | CancelChild):
            await self._supervise(effect)
            return None
        if isinstance(effect, SettleAdmission):
            settle = self.ports.admission.settle_turn(effect.grant_id, effect.actual_tokens)
            await self._quietly(settle, effect)
        elif isinstance(effect, ReportLimits):
            report = self.ports.admission.report_limits(
                effect.provider_key, effect.info, effect.rate_limited, effect.grant_id
            )
            await self._quietly(report, effect)
        elif isinstance(effect, ReleasePermit):
            await self._release(effect.guard, effect.sandbox, effect.outcome)
        elif isinstance(effect, CancelToolCall):
            await self._quietly(self.ports.tools.cancel(effect.tool, effect.effect_key), effect)
        elif isinstance(effect, ReleaseLease) and self.ports.leases is not None:
            await self._quietly(self.ports.leases.release(effect.lease), effect)
        return None

    async def _quietly(self, work: Coroutine[Any, Any, None], effect: Effect) -> None:
        # Settlement, limit reports, cancels: a lost one only leaves a lease to expire (the scheduler's
        # backstop) or an endpoint to finish; reported, never fatal to the trajectory.
        try:
            await work
        except Exception as e:
            _log.warning("%s: %s failed: %s", self.trajectory_id, type(effect).__name__, e)

    async def _admit(self, effect: RequestAdmission) -> Input:
        try:
            grant = await self.ports.admission.admit_turn(effect.request)
        except AdmissionRefused as e:
            return AdmissionDenied(effect.request_id, e.predicate, str(e), e.retry_after)
        except Exception as e:  # a scheduler that cannot answer is a transient refusal, not a crash
            return AdmissionDenied(effect.request_id, "unavailable", f"{type(e).__name__}: {e}", None)
        return AdmissionGranted(effect.request_id, grant)

    async def _call_model(self, effect: CallModel) -> Input:
        token = CancelToken()
        self._model_token = token
        try:
            reply = await self.ports.model.complete(effect.request, token)
        except ModelCallCancelled as e:
            usage = e.usage if isinstance(e.usage, Usage) else Usage()
            return ModelCancelled(effect.grant_id, e.reason, usage)
        except ProviderRateLimited as e:
            info = e.rate_limit if isinstance(e.rate_limit, RateLimitInfo) else None
            usage = e.usage if isinstance(e.usage, Usage) else Usage()
            return ModelFailed(effect.grant_id, str(e), True, True, e.retry_after, usage, info)
        except DependencyError as e:
            usage = e.usage if isinstance(e.usage, Usage) else Usage()
            return ModelFailed(effect.grant_id, str(e), not e.non_retryable, False, e.retry_after, usage)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # an adapter bug must not strand the trajectory: it is a failed call
            _log.exception("%s: the model adapter failed", self.trajectory_id)
            return ModelFailed(effect.grant_id, f"adapter error: {type(e).__name__}: {e}", True)
        finally:
            if self._model_token is token:
                self._model_token = None
        return ModelReplied(effect.grant_id, reply)

    async def _permit(self, effect: AcquirePermit) -> Input:
        guard: GuardPermit | None = None
        try:
            guard = await self.ports.guard.admit(effect.scope, effect.call_id, effect.deadline)
            sandbox = None
            if effect.pool is not None:
                sandbox = await self.ports.admission.acquire_sandbox(
                    self.trajectory_id, effect.pool, effect.priority_class, effect.deadline
                )
        except PolicyRefusal as e:
            if guard is not None:
                await self._release(guard, None, None)
            return PermitRefused(effect.call_id, effect.request_id, type(e).__name__, str(e), e.retry_after)
        except asyncio.CancelledError:
            if guard is not None:
                await self._release(guard, None, None)
            raise
        except Exception as e:
            if guard is not None:
                await self._release(guard, None, None)
            reason = "GuardUnavailable"
            return PermitRefused(effect.call_id, effect.request_id, reason, f"{type(e).__name__}: {e}", None)
        return PermitGranted(effect.call_id, effect.request_id, guard, sandbox)

    async def _release(
        self, guard: GuardPermit | None, sandbox: SandboxPermit | None, outcome: OutcomeClass | None
    ) -> None:
        try:
            if sandbox is not None:
                await self.ports.admission.release_sandbox(sandbox.permit_id)
            if guard is not None:
                await self.ports.guard.settle(guard, outcome)  # record + release: one guard round trip
        except Exception as e:  # the lease expires at the guard or the scheduler (their backstop)
            _log.warning("%s: releasing permits failed: %s", self.trajectory_id, e)

    async def _dispatch(self, effect: DispatchTool) -> Input:
        inv = effect.invocation
        dispatched = True
        try:
            outcome = await self.ports.tools.invoke(inv)
        except DependencyError as e:
            infra = OutcomeClass.INFRASTRUCTURE_FAILURE
            outcome = ToolOutcome(Settlement.UNKNOWN, infra, error=str(e), retry_after=e.retry_after)
        except (PolicyRefusal, InputError) as e:
            # refused locally before anything was sent (deadline already passed, no route): the effect is
            # known absent, and a local rejection never enters the breaker's window
            outcome = ToolOutcome(
                Settlement.ESTABLISHED_ABSENT, OutcomeClass.CLIENT_REJECTION, error=f"not sent: {e}"
            )
            dispatched = False
        except asyncio.CancelledError:
            raise
        except Exception as e:  # an adapter bug must not strand the trajectory; what happened is unknown
            _log.exception("%s: tool adapter failed on %s (%s)", self.trajectory_id, inv.tool, inv.call_id)
            outcome = ToolOutcome(
                Settlement.UNKNOWN, OutcomeClass.INFRASTRUCTURE_FAILURE, error=f"adapter error: {e}"
            )
        return ToolOutcomeReceived(
            inv.call_id, inv.operation_id, inv.attempt_id, outcome, dispatched, effect.guard, effect.sandbox
        )

    async def _probe(self, effect: ProbeTool) -> Input:
        try:
            result = await self.ports.tools.probe(effect.tool, effect.effect_key, effect.deadline)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # any failure to get an answer leaves the outcome unknown, never guessed
            result = ProbeResult(Settlement.UNKNOWN, None, f"probe failed: {type(e).__name__}: {e}")
        return ProbeAnswered(effect.operation_id, result, effect.request_id)

    async def _run_child(self, effect: SpawnChild) -> Input:
        """Start (or find) a child trajectory and wait for it; its evidence is the next input."""
        contract = effect.contract
        port = self.ports.children
        if port is None:
            claim = "this runtime cannot delegate: no child trajectory was started"
            return ChildFinished(contract.child_id, ChildEvidence("FAILED", None, None, claim=claim))
        delay = 0.5
        for attempt in range(8):
            try:
                return ChildFinished(contract.child_id, await port.run_child(contract))
            except asyncio.CancelledError:
                raise
            except Exception as e:
                _log.warning("%s: following child %s failed (%s)", self.trajectory_id, contract.child_id, e)
                if attempt < 7:
                    await self.ports.clock.sleep(delay)
                    delay = min(delay * 2, 10.0)
        # unknown what the child did: failed, and charged its whole allocation (it may have spent it all)
        claim = "the child could not be followed to its end; charged its whole allocation"
        evidence = ChildEvidence("UNKNOWN", None, None, spend=dict(contract.allocation), claim=claim)
        return ChildFinished(contract.child_id, evidence)

    async def _supervise(self, effect: PublishEscalation | OpenIncident | CancelChild) -> None:
        """Publish to the registries, or cascade to a child: retried a few times, never fatal (the log
        holds the decision; the registries are views, and a child past its deadline ends by itself)."""
        delay = 0.2
        for attempt in range(5):
            try:
                if isinstance(effect, CancelChild):
                    if self.ports.children is not None:
                        await self.ports.children.cancel_child(effect.child_id, effect.kill, effect.reason)
                    return
                store = self.ports.supervision
                if store is None:
                    return
                if isinstance(effect, PublishEscalation):
                    await store.publish_escalation(effect.escalation.as_json())
                else:
                    doc = {
                        "incident_id": effect.incident_id,
                        "opened_at": self.ports.clock.wall(),
                        "opened_by": f"policy:{effect.trajectory_id}",
                        "owner": "operator",
                        "status": "open",
                        "symptom": effect.symptom,
                        "suspected_cause": effect.suspected_cause,
                        "evidence": dict(effect.evidence),
                        "members": {effect.trajectory_id: dict(effect.member)},
                        "selector": {"trajectories": [effect.trajectory_id]},
                        "capture_omissions": [],
                    }
                    await store.open_incident(doc, effect.artifacts)
                return
            except asyncio.CancelledError:
                raise
            except Exception as e:
                _log.warning(
                    "%s: %s failed (attempt %d): %s", self.trajectory_id, type(effect).__name__, attempt, e
                )
                await self.ports.clock.sleep(delay)
                delay *= 2

    async def _kill(self, effect: KillProcesses) -> None:
        try:
            await self.hooks.on_kill(self.record)
        except Exception:
            _log.exception("%s: killing its processes failed (%s)", self.trajectory_id, effect.reason)

    # ------------------------------------------------------------------ timers

    def _arm(self, timer: Timer) -> None:
        previous = self._timers.pop(timer.timer_id, None)
        if previous is not None:
            previous.cancel()
        self._timers[timer.timer_id] = asyncio.ensure_future(self._wait_timer(timer))
        if timer.kind.durable and self.ports.timers is not None:
            store = self.ports.timers
            self._spawn(self._store(store.schedule(self.trajectory_id, timer.timer_id, timer.due_at)))

    def _disarm(self, timer: Timer) -> None:
        task = self._timers.pop(timer.timer_id, None)
        if task is not None:
            task.cancel()
        self._forget_timer(timer)

    def _forget_timer(self, timer: Timer | None) -> None:
        if timer is not None and timer.kind.durable and self.ports.timers is not None:
            self._spawn(self._store(self.ports.timers.cancel(self.trajectory_id, timer.timer_id)))

    async def _store(self, work: Coroutine[Any, Any, None]) -> None:
        try:
            await work
        except Exception as e:  # the local timer still fires while the actor lives
            _log.warning("%s: the timer store did not answer: %s", self.trajectory_id, e)

    async def _wait_timer(self, timer: Timer) -> None:
        delay = timer.due_at - self.ports.clock.wall()
        if delay > 0:
            await self.ports.clock.sleep(delay)
        if self._timers.get(timer.timer_id) is asyncio.current_task():
            del self._timers[timer.timer_id]
        if not self._closed:
            try:
                await self.submit(TimerDue(timer.timer_id), durable=False)
            except Exception:
                _log.exception("%s: timer %s could not be decided", self.trajectory_id, timer.timer_id)


def _permits_of(item: Effect | Input | None) -> tuple[GuardPermit | None, SandboxPermit | None] | None:
    """The permits an attempt in flight holds: those a dispatch carries, or those a grant or an outcome
    brings back; None when there are none."""
    if not isinstance(item, DispatchTool | PermitGranted | ToolOutcomeReceived):
        return None
    return None if item.guard is None and item.sandbox is None else (item.guard, item.sandbox)
