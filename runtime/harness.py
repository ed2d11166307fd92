"""The harness: one trajectory's turn loop over its ports (ARCHITECTURE.md, "One turn, end to end").

The harness owns the record. Every change is an event that is first validated by ``runtime.fold.apply``,
then appended durably to the log, and only then takes effect (intent before effect). Model output is an
observation the harness evaluates; nothing the model says writes the record.

The loop, at each turn boundary (READY): apply pending control (kill, cancel, pause, interrupt), check the
trajectory deadline, meter wall-clock time and assess the budget (steer / restrict / halt), ask the
scheduler for admission, log the intent, stream the model call (cancellable), charge the provider's usage,
and branch on the stop reason: end_turn -> FINALIZING and the completion check; max_tokens / refusal ->
an observation, never a dispatch; tool calls -> local validation, watchdog, approval gate or dispatch.
Dispatch logs each attempt's intent before it is sent, passes the dependency guard and the sandbox
semaphore, settles the operation from the result, and lets the single retry owner decide what next.

Recovery is ``Harness.recover()``: fold the log, then ``run()`` continues from the folded state. A model
call whose intent was logged but whose reply was not is charged its full reservation (the provider billed
something we cannot see); a dispatched call whose result was not logged is cancelled into *in doubt* and
re-dispatched only when its repeat contract makes that safe, else probed or left unknown with an owner.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from runtime._approval_gate import ApprovalGate
from runtime._tool_stage import ToolStage
from runtime.budget import BudgetStage, Dimension, PriceTable, StageThresholds, assess
from runtime.clock import Clock
from runtime.codec import decode, encode
from runtime.completion import evaluate_completion
from runtime.context import build_messages, estimate_tokens
from runtime.dispatch import NoGuard, RetryPort, SingleAttempt
from runtime.errors import (
    AdmissionRefused,
    DependencyError,
    ModelCallCancelled,
    ProviderRateLimited,
)
from runtime.events import (
    BudgetStageChanged,
    CompletionChecked,
    ControlApplied,
    ControlRejected,
    Event,
    GrantNarrowed,
    LeaseReleased,
    ModelCallFailed,
    ModelCallIntent,
    ModelCallSettled,
    ObservationAppended,
    ObservationKind,
    StateChanged,
    TrajectoryCreated,
    TurnStarted,
    WallClockMeasured,
)
from runtime.events import ModelCallCancelled as ModelCallCancelledEvent
from runtime.fold import apply, fold, on_control, start
from runtime.ports import (
    AdmissionPort,
    CancelToken,
    GuardPort,
    LogStore,
    ModelPort,
    ModelReply,
    ModelRequest,
    StopReason,
    ToolPort,
    TurnRequest,
    Usage,
)
from runtime.record import ControlAction, ModelOutcome, PendingControl, TrajectoryRecord
from runtime.states import ExitReason, TrajectoryState, terminal_state_for
from runtime.tools import ToolRegistry
from runtime.watchdog import WatchdogConfig, WatchdogState

__all__ = ["Harness", "HarnessConfig", "HarnessHooks", "HarnessPorts", "RunOutcome"]

S = TrajectoryState
_log = logging.getLogger(__name__)
_ABORTING = frozenset({ControlAction.CANCEL, ControlAction.PAUSE, ControlAction.KILL})


class HarnessHooks(Protocol):
    """Extension points with no-op defaults (metrics, live views, sandbox teardown)."""

    def on_event(self, record: TrajectoryRecord, event: Event) -> None: ...

    async def on_kill(self, record: TrajectoryRecord) -> None: ...


class _NoHooks:
    def on_event(self, record: TrajectoryRecord, event: Event) -> None:
        return None

    async def on_kill(self, record: TrajectoryRecord) -> None:
        return None


@dataclass
class HarnessPorts:
    """Everything outside the pure core the harness talks to."""

    model: ModelPort
    tools: ToolPort
    log: LogStore
    admission: AdmissionPort
    clock: Clock
    guard: GuardPort = field(default_factory=NoGuard)
    retry: RetryPort = field(default_factory=SingleAttempt)


@dataclass(frozen=True)
class HarnessConfig:
    """Per-trajectory policy the workload sets."""

    provider_key: str
    prices: PriceTable
    thresholds: StageThresholds = field(default_factory=StageThresholds)
    tool_timeout_s: float = 30.0
    approval_timeout_s: float = 300.0
    approval_quorum: int = 1
    max_consecutive_model_failures: int = 4
    max_refusals: int = 2
    model_backoff_base_s: float = 0.5
    model_backoff_cap_s: float = 20.0
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    metadata: Mapping[str, str] = field(default_factory=dict)
    system_prompt: str | None = None
    idle_hibernate_s: float | None = None  # PAUSED / AWAITING_APPROVAL longer than this: run() returns
    rng_seed: int = 0


@dataclass(frozen=True, slots=True)
class RunOutcome:
    """How ``Harness.run`` returned: the trajectory ended, or it hibernated while waiting."""

    record: TrajectoryRecord
    hibernated: bool = False


class Harness:
    """Drives one trajectory to a terminal state (or to hibernation)."""

    def __init__(
        self,
        trajectory_id: str,
        ports: HarnessPorts,
        registry: ToolRegistry,
        config: HarnessConfig,
        hooks: HarnessHooks | None = None,
    ) -> None:
        self.trajectory_id = trajectory_id
        self.ports = ports
        self.registry = registry
        self.config = config
        self.hooks: HarnessHooks = hooks or _NoHooks()
        self._record: TrajectoryRecord | None = None
        self._events: list[Event] = []
        self._lock = asyncio.Lock()
        self._control_arrived = asyncio.Event()
        self._changed = asyncio.Event()  # set on every append: waiters re-read the record
        self._tasks: set[asyncio.Future[None]] = set()
        self._unflushed: list[tuple[TrajectoryRecord, Event, bytes]] = []
        self._durable_record: TrajectoryRecord | None = None
        self._durable_len = 0
        self._tools = ToolStage(self)
        self._gate = ApprovalGate(self)
        self._cancel_token: CancelToken | None = None
        self._kill = asyncio.Event()
        self._watchdog = WatchdogState(config.watchdog)
        self._model_failures = 0
        self._refusals = 0

        self._rng = random.Random(config.rng_seed)

    # ------------------------------------------------------------------ record and log

    @property
    def record(self) -> TrajectoryRecord:
        if self._record is None:
            raise RuntimeError("the harness has no record yet: call create() or recover()")
        return self._record

    @property
    def events(self) -> Sequence[Event]:
        return tuple(self._events)

    async def _append(self, event: Event) -> TrajectoryRecord:
        """Validate and adopt ``event``; it becomes durable at the next flush, which always happens
        before the next effect or wait (intent before effect). The only way the record changes."""
        async with self._lock:
            return self._stage(event)

    def _stage(self, event: Event) -> TrajectoryRecord:
        nxt = start(event) if isinstance(event, TrajectoryCreated) else apply(self.record, event)
        self._unflushed.append((nxt, event, encode(event)))
        self._record = nxt
        self._events.append(event)
        self._changed.set()
        return nxt

    async def _flush(self) -> None:
        """Make every staged event durable in one batch (one acknowledgement, one fsync)."""
        async with self._lock:
            await self._flush_locked()

    async def _flush_locked(self) -> None:
        if not self._unflushed:
            return
        batch, self._unflushed = self._unflushed, []
        try:
            await self.ports.log.append_many(self.trajectory_id, [payload for _, _, payload in batch])
        except BaseException:
            # Nothing outside happened after these events (flushes precede effects), so the durable
            # record is the truth: forget what was not written, then let the caller see the failure.
            self._record = self._durable_record
            del self._events[self._durable_len :]
            raise
        self._durable_record = self._record
        self._durable_len = len(self._events)
        for record, event, _ in batch:
            self.hooks.on_event(record, event)

    async def create(self, created: TrajectoryCreated, goal_message: str | None = None) -> TrajectoryRecord:
        """Start a new trajectory, or fold an existing log with the same id (idempotent create)."""
        if await self.ports.log.exists(self.trajectory_id):
            return await self.recover()
        await self._append(created)
        await self._append(ObservationAppended(ObservationKind.USER, goal_message or created.contract.goal))
        await self._flush()
        return self.record

    async def recover(self) -> TrajectoryRecord:
        """Rebuild the record from the durable log (a restarted or re-created actor)."""
        entries = await self.ports.log.read(self.trajectory_id)
        events = [decode(payload) for _, payload in entries]
        self._record = fold(events)
        self._events = events
        self._durable_record, self._durable_len = self._record, len(events)
        self._tools.replay_watchdog(events)  # a restart must not reset loop detection
        return self._record

    # ------------------------------------------------------------------ control (from the relay)

    async def deliver_control(
        self,
        message_id: str,
        action: ControlAction,
        issuer: str,
        reason: str,
        payload: Mapping[str, Any] | None = None,
    ) -> str:
        """Record an authenticated control request durably; return "recorded", "duplicate" or "rejected".

        The request takes effect at the next turn boundary; kill acts at once (aborts the model stream and
        in-flight waits, and the hook tears down the sandbox). A streaming model call is aborted for a
        pending cancel or pause too (streaming cancellation).
        """
        async with self._lock:
            decision = on_control(self.record, message_id, action, issuer, reason, payload)
            if decision is None:
                return "duplicate"
            self._stage(decision)
            await self._flush_locked()  # durably recorded before the relay may acknowledge it
        if isinstance(decision, ControlRejected):
            return "rejected"
        if action in _ABORTING and self._cancel_token is not None:
            self._cancel_token.cancel(action.value)
        if action is ControlAction.KILL:
            self._kill.set()
            await self.hooks.on_kill(self.record)
        self._control_arrived.set()
        return "recorded"

    async def reject_control(self, message_id: str, reason: str, detail: str = "") -> bool:
        """Audit a control message the shell refused before it reached the record (bad signature, wrong
        role, expired, replayed...). Only a message id not seen before is audited; returns whether it was."""
        async with self._lock:
            if message_id in self.record.seen_control_ids:
                return False
            self._stage(ControlRejected(message_id, reason, detail))
            await self._flush_locked()
        return True

    def _pending(self, *actions: ControlAction) -> PendingControl | None:
        return next((p for p in self.record.pending_control if p.action in actions), None)

    # ------------------------------------------------------------------ the loop

    async def close(self) -> None:
        """Cancel every task this harness started (the actor is going away)."""
        with contextlib.suppress(Exception):
            await self._flush()
        tasks = [t for t in self._tasks if not t.done()]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Future[None]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def run(self) -> RunOutcome:
        """Run until the trajectory is terminal (or hibernates while waiting for a person)."""
        try:
            return await self._run()
        finally:
            if self._unflushed:
                with contextlib.suppress(Exception):
                    await self._flush()

    async def _run(self) -> RunOutcome:
        while not self.record.is_terminal:
            state = self.record.state
            if state is S.READY:
                await self._turn()
            elif state is S.CALLING_MODEL:
                await self._resume_calling_model()
            elif state is S.WAITING_TOOL:
                await self._tools.resume_after_restart()
            elif state is S.AWAITING_APPROVAL:
                if not await self._gate.wait_for_decision():
                    return RunOutcome(self.record, hibernated=True)
            elif state is S.PAUSED:
                if not await self._paused():
                    return RunOutcome(self.record, hibernated=True)
            elif state is S.FINALIZING:
                await self._finalize()
        return RunOutcome(self.record)

    async def _turn(self) -> None:
        """One turn from READY (the turn boundary)."""
        if await self._apply_boundary_control():
            return
        rec = self.record
        now = self.ports.clock.wall()
        if rec.deadline is not None and now >= rec.deadline:
            await self._enter_finalizing(ExitReason.DEADLINE_EXCEEDED, "trajectory deadline passed")
            return
        if await self._assess_budget():
            return
        if self._refusals > self.config.max_refusals:
            await self._enter_finalizing(ExitReason.REFUSED, "the model refused repeatedly")
            return

        tools = self.registry.openai_tool_specs(self._granted_tools())
        messages = build_messages(self._events, self.config.system_prompt)
        max_tokens = self._affordable_max_tokens(estimate_tokens(messages, tools))
        if max_tokens is None:
            await self._halt_unfundable()
            return
        estimate = estimate_tokens(messages, tools) + max_tokens
        call_deadline = now + rec.limits.call_deadline_s
        if rec.deadline is not None:
            call_deadline = min(call_deadline, rec.deadline)

        admission = asyncio.ensure_future(
            self.ports.admission.admit_turn(
                TurnRequest(
                    self.trajectory_id, rec.priority_class, self.config.provider_key, estimate, call_deadline
                )
            )
        )
        try:
            grant = await self._unless_control(admission, _ABORTING)
        except AdmissionRefused as e:
            await self._append(ObservationAppended(ObservationKind.ERROR, f"turn not admitted: {e}"))
            if e.predicate == "deadline":
                await self._enter_finalizing(ExitReason.DEADLINE_EXCEEDED, f"admission refused: {e}")
            elif e.predicate == "exceeds_capacity":
                # waiting can never help: this turn is larger than the provider limit itself
                await self._enter_finalizing(ExitReason.ERROR, f"admission refused: {e}")
            else:
                await self._backoff(e.retry_after)
            return
        if grant is None:
            return  # a control request arrived while queued: the boundary applies it

        await self._append(TurnStarted(self.record.turn_count + 1))
        await self._append(StateChanged(S.READY, S.CALLING_MODEL, "admitted"))
        await self._append(
            ModelCallIntent(
                grant.grant_id, rec.limits.model, max_tokens, call_deadline, estimate - max_tokens
            )
        )
        request = ModelRequest(
            trajectory_id=self.trajectory_id,
            model=rec.limits.model,
            messages=messages,
            max_tokens=max_tokens,
            deadline=call_deadline,
            tools=tools,
            metadata=dict(self.config.metadata),
        )
        await self._call_model(request, grant.grant_id, estimate)

    async def _unless_control(self, work: asyncio.Future[Any], actions: frozenset[ControlAction]) -> Any:
        """Await ``work`` unless one of ``actions`` is or becomes pending; then cancel it, return None."""
        await self._flush()  # about to wait: everything decided so far is durable first
        while True:
            if self._pending(*actions) is not None:
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await work
                return None
            self._control_arrived.clear()
            waiter = asyncio.ensure_future(self._control_arrived.wait())
            done, _ = await asyncio.wait({work, waiter}, return_when=asyncio.FIRST_COMPLETED)
            if work in done:
                waiter.cancel()
                return work.result()
            # a control message arrived: loop to check whether it concerns us

    # ------------------------------------------------------------------ control at the boundary

    async def _apply_boundary_control(self) -> bool:
        """Apply pending requests in arrival order. Returns True when the trajectory left READY."""
        for req in list(self.record.pending_control):
            action = req.action
            if action is ControlAction.KILL:
                await self._append(ControlApplied(req.message_id))
                await self._enter_finalizing(ExitReason.KILLED, f"killed by {req.issuer}: {req.reason}")
                return True
            if action is ControlAction.CANCEL:
                await self._append(ControlApplied(req.message_id))
                await self._enter_finalizing(ExitReason.CANCELED, f"cancelled by {req.issuer}: {req.reason}")
                return True
            if action is ControlAction.PAUSE:
                await self._append(ControlApplied(req.message_id))
                await self._append(StateChanged(S.READY, S.PAUSED, f"paused by {req.issuer}: {req.reason}"))
                return True
            if action is ControlAction.INTERRUPT:
                text = req.payload.get("message") if isinstance(req.payload, Mapping) else None
                await self._append(ObservationAppended(ObservationKind.USER, str(text or req.reason)))
                await self._append(ControlApplied(req.message_id))
            else:
                # resume while not paused, or approve/deny with nothing held: applied as a no-op
                await self._append(ControlApplied(req.message_id))
        return False

    async def _paused(self) -> bool:
        """PAUSED: wait for resume (immediate), cancel or kill. False when hibernating instead."""
        while True:
            for req in list(self.record.pending_control):
                if req.action is ControlAction.RESUME:
                    await self._append(ControlApplied(req.message_id))
                    await self._append(StateChanged(S.PAUSED, S.READY, f"resumed by {req.issuer}"))
                    return True
                if req.action in (ControlAction.KILL, ControlAction.CANCEL):
                    reason = ExitReason.KILLED if req.action is ControlAction.KILL else ExitReason.CANCELED
                    await self._append(ControlApplied(req.message_id))
                    await self._enter_finalizing(reason, f"{req.action.value} by {req.issuer}: {req.reason}")
                    return True
            if not await self._wait_for_control(self.config.idle_hibernate_s):
                return False

    async def _wait_for_control(self, timeout: float | None) -> bool:
        """Wait for a control message (or ``timeout`` seconds on the clock). False on timeout."""
        await self._flush()
        self._control_arrived.clear()
        waiter = asyncio.ensure_future(self._control_arrived.wait())
        if timeout is None:
            await waiter
            return True
        sleeper = asyncio.ensure_future(self.ports.clock.sleep(timeout))
        done, pending = await asyncio.wait({waiter, sleeper}, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        return waiter in done

    # ------------------------------------------------------------------ budget

    async def _assess_budget(self) -> bool:
        """Meter wall-clock time, assess the budget, act on the stage. True when the trajectory halts."""
        rec = self.record
        elapsed = max(rec.spend.get(Dimension.WALL_SECONDS), self.ports.clock.wall() - rec.created_at)
        await self._append(WallClockMeasured(elapsed))
        rec = self.record
        a = assess(rec.ceilings, rec.spend, self.config.thresholds)
        if a.stage is not rec.budget_stage or abs(a.rho - rec.rho) > 1e-9:
            await self._append(BudgetStageChanged(a.stage, a.rho, a.binding_dimension))
            if a.stage is BudgetStage.STEER and rec.budget_stage is BudgetStage.NOMINAL:
                left = a.remaining.get(a.binding_dimension, 0.0)
                await self._append(
                    ObservationAppended(
                        ObservationKind.NOTICE,
                        f"Budget notice: {a.rho:.0%} of the {a.binding_dimension} budget is used "
                        f"({left:g} left). Wrap up: prefer finishing over exploring.",
                    )
                )
        rec = self.record
        if a.stage is BudgetStage.RESTRICT and not rec.grants.read_only:
            # restrict is a guarantee, not a request: the grant itself narrows to read-only tools
            await self._append(GrantNarrowed(rec.grants.tools, True, False, "budget restrict stage"))
            await self._append(
                ObservationAppended(
                    ObservationKind.NOTICE,
                    "Budget restricted: only read-only tools remain. Produce your final result now.",
                )
            )
        if a.stage is BudgetStage.HALT:
            await self._enter_finalizing(
                ExitReason.BUDGET_EXCEEDED, f"budget exhausted on {a.binding_dimension} (rho={a.rho:.3f})"
            )
            return True
        return False

    def _affordable_max_tokens(self, prompt_estimate: int) -> int | None:
        """The output ceiling for the next call, clamped so the call cannot overrun tokens or dollars.

        When not even a minimal reply fits, the meter halts the trajectory (recorded before finalizing).
        """
        rec = self.record
        ceiling = rec.limits.max_output_tokens
        prices = self.config.prices
        if Dimension.TOKENS in rec.ceilings:
            ceiling = min(
                ceiling,
                int(rec.ceilings[Dimension.TOKENS] - rec.spend.get(Dimension.TOKENS)) - prompt_estimate,
            )
        if Dimension.DOLLARS in rec.ceilings:
            left = rec.ceilings[Dimension.DOLLARS] - rec.spend.get(Dimension.DOLLARS)
            left -= prompt_estimate * prices.uncached_input_per_million / 1e6
            if prices.output_per_million > 0:
                ceiling = min(ceiling, int(left * 1e6 / prices.output_per_million))
        if ceiling >= min(16, rec.limits.max_output_tokens):
            return ceiling
        return None

    async def _halt_unfundable(self) -> None:
        rec = self.record
        a = assess(rec.ceilings, rec.spend, self.config.thresholds)
        await self._append(BudgetStageChanged(BudgetStage.HALT, max(a.rho, 1.0), a.binding_dimension))
        await self._enter_finalizing(
            ExitReason.BUDGET_EXCEEDED, "the remaining budget cannot fund another call"
        )

    def _granted_tools(self) -> list[str]:
        g = self.record.grants
        return sorted(t for t in g.tools if g.allows(t) and t in self.registry.names())

    # ------------------------------------------------------------------ the model call

    async def _call_model(self, request: ModelRequest, grant_id: str, reserved: int) -> None:
        token = CancelToken()
        self._cancel_token = token
        if self._pending(*_ABORTING) is not None:
            token.cancel("control pending")
        try:
            await self._flush()  # intent before effect: the call's intent is durable before it is sent
            reply = await self.ports.model.complete(request, token)
        except ModelCallCancelled as e:
            usage = e.usage if isinstance(e.usage, Usage) else Usage()
            self._settle(grant_id, usage.total)
            await self._append(ModelCallCancelledEvent(e.reason, usage, self.config.prices.cost(usage)))
            await self._append(StateChanged(S.CALLING_MODEL, S.READY, f"model call aborted: {e.reason}"))
            return
        except DependencyError as e:
            await self._model_failed(grant_id, e)
            return
        finally:
            self._cancel_token = None
        self._model_failures = 0
        self._settle(grant_id, reply.usage.total)
        await self._append(
            ModelCallSettled(reply.stop_reason, reply.usage, self.config.prices.cost(reply.usage))
        )
        await self._after_reply(reply)

    def _settle(self, grant_id: str, actual_tokens: int) -> None:
        """Settle the scheduler reservation without holding up the turn. A lost settlement only leaves the
        reservation to expire with its lease (the scheduler's backstop), so it is not worth a round trip."""

        async def settle() -> None:
            try:
                await self.ports.admission.settle_turn(grant_id, actual_tokens)
            except Exception as e:  # reported, never fatal to the trajectory
                _log.warning("settling grant %s failed (its lease will expire): %s", grant_id, e)

        self._spawn(settle())

    async def _model_failed(self, grant_id: str, error: DependencyError) -> None:
        # A failed call is billed nothing we can see; release the reservation and let the loop retry it as a
        # new turn (admission again, charged again) with full-jitter backoff, Retry-After as the floor.
        self._settle(grant_id, 0)
        if isinstance(error, ProviderRateLimited):
            await self.ports.admission.report_rate_limited(self.config.provider_key, error.retry_after, {})
        await self._append(ModelCallFailed(str(error), not error.non_retryable))
        self._model_failures += 1
        if error.non_retryable or self._model_failures >= self.config.max_consecutive_model_failures:
            await self._append(StateChanged(S.CALLING_MODEL, S.READY, "model call failed"))
            await self._enter_finalizing(ExitReason.MODEL_ERROR, f"model calls failed: {error}")
            return
        await self._append(StateChanged(S.CALLING_MODEL, S.READY, "model call failed: retrying"))
        await self._backoff(error.retry_after)

    async def _backoff(self, retry_after: float | None) -> None:
        """Capped exponential backoff with full jitter; Retry-After is a floor; control cuts it short."""
        exponent = max(0, self._model_failures - 1)
        ceiling = min(self.config.model_backoff_cap_s, self.config.model_backoff_base_s * 2**exponent)
        delay = max(self._rng.uniform(0, ceiling), retry_after or 0.0)
        await self._unless_control(asyncio.ensure_future(self.ports.clock.sleep(delay)), _ABORTING)

    async def _after_reply(self, reply: ModelReply) -> None:
        """Branch on the stop reason (harness chapter, "Control Actions": where each reply leaves us)."""
        stop = reply.stop_reason
        if stop is StopReason.END_TURN:
            await self._append(ObservationAppended(ObservationKind.ASSISTANT, reply.text))
            await self._enter_finalizing(ExitReason.COMPLETED, "the model ended its turn")
            return
        if stop is StopReason.MAX_TOKENS:
            # quarantine: a truncated reply is never parsed into calls, whatever it contains
            await self._append(ObservationAppended(ObservationKind.ASSISTANT, reply.text))
            await self._append(
                ObservationAppended(
                    ObservationKind.NOTICE,
                    "Your reply hit the output-token ceiling and was discarded unexecuted. "
                    "Make smaller steps or shorter arguments.",
                )
            )
            await self._append(StateChanged(S.CALLING_MODEL, S.READY, "truncated reply"))
            return
        if stop is StopReason.REFUSAL or not reply.tool_calls:
            self._refusals += stop is StopReason.REFUSAL
            await self._append(ObservationAppended(ObservationKind.ASSISTANT, reply.text))
            await self._append(StateChanged(S.CALLING_MODEL, S.READY, f"reply without calls ({stop.value})"))
            return
        await self._append(
            ObservationAppended(ObservationKind.ASSISTANT, reply.text, tool_calls=tuple(reply.tool_calls))
        )
        await self._tools.route(tuple(reply.tool_calls))

    async def _resume_calling_model(self) -> None:
        """Recovery inside CALLING_MODEL: the reply (if any) was not fully processed before the crash."""
        call = self.record.model_call
        if call is not None and call.outcome is None:
            # The intent was logged and the provider may have billed the call: charge the whole reservation
            # (prompt estimate + output ceiling), the most the provider can have billed for it.
            reserved = Usage(uncached_input=call.prompt_tokens, cached_input=0, output=call.max_tokens)
            self._settle(call.grant_id, reserved.total)
            await self._append(
                ModelCallFailed(
                    "the actor restarted during the call", True, reserved, self.config.prices.cost(reserved)
                )
            )
            await self._append(StateChanged(S.CALLING_MODEL, S.READY, "recovered: call outcome lost"))
            return
        last = next(
            (ev for ev in reversed(self._events) if isinstance(ev, ObservationAppended | ModelCallIntent)),
            None,
        )
        if (
            isinstance(last, ObservationAppended)
            and last.observation is ObservationKind.ASSISTANT
            and last.tool_calls
            and self.record.held is None
        ):
            await self._tools.route(tuple(last.tool_calls))
            return
        if self.record.held is not None:
            await self._append(StateChanged(S.CALLING_MODEL, S.AWAITING_APPROVAL, "recovered: call held"))
            return
        outcome = call.outcome if call is not None else None
        if outcome is ModelOutcome.END_TURN:
            await self._enter_finalizing(ExitReason.COMPLETED, "the model ended its turn")
            return
        await self._append(StateChanged(S.CALLING_MODEL, S.READY, "recovered: reply not processed"))

    # ------------------------------------------------------------------ tool calls

    # ------------------------------------------------------------------ approval gate

    # ------------------------------------------------------------------ finalizing

    async def _enter_finalizing(self, reason: ExitReason, detail: str) -> None:
        state = self.record.state
        if (
            state is S.CALLING_MODEL
            and self.record.model_call is not None
            and self.record.model_call.outcome is None
        ):
            raise RuntimeError("cannot finalize with a model call in flight")  # callers settle first
        if state is S.WAITING_TOOL and self.record.pending_calls:
            await self._tools.abandon([], "finalizing")
            state = self.record.state
        if reason is ExitReason.BUDGET_EXCEEDED and self.record.budget_stage is not BudgetStage.HALT:
            await self._halt_unfundable()
            return
        await self._append(StateChanged(state, S.FINALIZING, detail, exit_reason=reason))

    async def _finalize(self) -> None:
        """FINALIZING: release leases, run the completion check on a completion claim, settle terminal."""
        rec = self.record
        for lease_id in list(rec.leases):
            await self._append(LeaseReleased(lease_id))
        rec = self.record
        if rec.exit_reason is ExitReason.COMPLETED and rec.check_passed is None:
            result = evaluate_completion(rec, self._events)
            await self._append(
                CompletionChecked(rec.contract.completion_check.name, result.passed, result.detail)
            )
        rec = self.record
        assert rec.exit_reason is not None
        target = terminal_state_for(rec.exit_reason)
        await self._append(StateChanged(S.FINALIZING, target, f"exit: {rec.exit_reason.value}"))
