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
import json
import random
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from runtime.budget import BudgetStage, Dimension, PriceTable, StageThresholds, assess
from runtime.clock import Clock
from runtime.codec import decode, encode
from runtime.completion import evaluate_completion
from runtime.context import build_messages, estimate_tokens
from runtime.dispatch import NoGuard, RetryPort, SingleAttempt, Verdict
from runtime.errors import (
    AdmissionRefused,
    DependencyError,
    ModelCallCancelled,
    PolicyRefusal,
    ProviderRateLimited,
)
from runtime.events import (
    ApprovalDecided,
    ApprovalRechecked,
    BudgetStageChanged,
    CompletionChecked,
    ControlApplied,
    ControlRejected,
    Event,
    GrantNarrowed,
    LateResultDropped,
    LeaseReleased,
    ModelCallFailed,
    ModelCallIntent,
    ModelCallSettled,
    ObservationAppended,
    ObservationKind,
    OperationMarkedInDoubt,
    OperationSettled,
    StateChanged,
    ToolCallCancelled,
    ToolCallHeld,
    ToolDispatchIntent,
    TrajectoryCreated,
    TurnStarted,
    WallClockMeasured,
)
from runtime.events import ModelCallCancelled as ModelCallCancelledEvent
from runtime.fingerprint import call_digest, call_fingerprint, coarse_fingerprint, effect_key
from runtime.fold import apply, expired_calls, fold, on_control, on_tool_result, start
from runtime.ports import (
    AdmissionPort,
    CancelToken,
    GuardPort,
    LogStore,
    ModelPort,
    ModelReply,
    ModelRequest,
    OutcomeClass,
    Settlement,
    StopReason,
    ToolCallProposal,
    ToolInvocation,
    ToolOutcome,
    ToolPort,
    TurnRequest,
    Usage,
)
from runtime.record import ApprovalDecision, ControlAction, ModelOutcome, PendingControl, TrajectoryRecord
from runtime.states import ExitReason, TrajectoryState, terminal_state_for
from runtime.tools import RepeatContract, ToolArgumentsInvalid, ToolRegistry, UnknownTool
from runtime.watchdog import WatchdogConfig, WatchdogState, WatchdogStep

__all__ = ["Harness", "HarnessConfig", "HarnessHooks", "HarnessPorts", "RunOutcome"]

S = TrajectoryState
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
        """Validate, append durably, then adopt: the only way the record changes."""
        async with self._lock:
            return await self._append_locked(event)

    async def _append_locked(self, event: Event) -> TrajectoryRecord:
        nxt = start(event) if isinstance(event, TrajectoryCreated) else apply(self.record, event)
        await self.ports.log.append(self.trajectory_id, encode(event))
        self._record = nxt
        self._events.append(event)
        self._changed.set()
        self.hooks.on_event(nxt, event)
        return nxt

    async def create(self, created: TrajectoryCreated, goal_message: str | None = None) -> TrajectoryRecord:
        """Start a new trajectory, or fold an existing log with the same id (idempotent create)."""
        if await self.ports.log.exists(self.trajectory_id):
            return await self.recover()
        await self._append(created)
        await self._append(ObservationAppended(ObservationKind.USER, goal_message or created.contract.goal))
        return self.record

    async def recover(self) -> TrajectoryRecord:
        """Rebuild the record from the durable log (a restarted or re-created actor)."""
        entries = await self.ports.log.read(self.trajectory_id)
        events = [decode(payload) for _, payload in entries]
        self._record = fold(events)
        self._events = events
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
            await self._append_locked(decision)
        if isinstance(decision, ControlRejected):
            return "rejected"
        if action in _ABORTING and self._cancel_token is not None:
            self._cancel_token.cancel(action.value)
        if action is ControlAction.KILL:
            self._kill.set()
            await self.hooks.on_kill(self.record)
        self._control_arrived.set()
        return "recorded"

    def _pending(self, *actions: ControlAction) -> PendingControl | None:
        return next((p for p in self.record.pending_control if p.action in actions), None)

    # ------------------------------------------------------------------ the loop

    async def close(self) -> None:
        """Cancel every task this harness started (the actor is going away)."""
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
        while not self.record.is_terminal:
            state = self.record.state
            if state is S.READY:
                await self._turn()
            elif state is S.CALLING_MODEL:
                await self._resume_calling_model()
            elif state is S.WAITING_TOOL:
                await self._resume_waiting_tool()
            elif state is S.AWAITING_APPROVAL:
                if not await self._await_approval():
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
            return
        if grant is None:
            return  # a control request arrived while queued: the boundary applies it

        await self._append(TurnStarted(self.record.turn_count + 1))
        await self._append(StateChanged(S.READY, S.CALLING_MODEL, "admitted"))
        await self._append(ModelCallIntent(grant.grant_id, rec.limits.model, max_tokens, call_deadline))
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
            reply = await self.ports.model.complete(request, token)
        except ModelCallCancelled as e:
            usage = e.usage if isinstance(e.usage, Usage) else Usage()
            await self.ports.admission.settle_turn(grant_id, usage.total)
            await self._append(ModelCallCancelledEvent(e.reason, usage, self.config.prices.cost(usage)))
            await self._append(StateChanged(S.CALLING_MODEL, S.READY, f"model call aborted: {e.reason}"))
            return
        except DependencyError as e:
            await self._model_failed(grant_id, e)
            return
        finally:
            self._cancel_token = None
        self._model_failures = 0
        await self.ports.admission.settle_turn(grant_id, reply.usage.total)
        await self._append(
            ModelCallSettled(reply.stop_reason, reply.usage, self.config.prices.cost(reply.usage))
        )
        await self._after_reply(reply)

    async def _model_failed(self, grant_id: str, error: DependencyError) -> None:
        # A failed call is billed nothing we can see; release the reservation and let the loop retry it as a
        # new turn (admission again, charged again) with full-jitter backoff, Retry-After as the floor.
        await self.ports.admission.settle_turn(grant_id, 0)
        if isinstance(error, ProviderRateLimited):
            await self.ports.admission.report_rate_limited(self.config.provider_key, error.retry_after, {})
        await self._append(ModelCallFailed(str(error), not error.non_retryable))
        self._model_failures += 1
        if error.non_retryable or self._model_failures >= self.config.max_consecutive_model_failures:
            await self._append(StateChanged(S.CALLING_MODEL, S.READY, "model call failed"))
            await self._enter_finalizing(ExitReason.MODEL_ERROR, f"model calls failed: {error}")
            return
        await self._append(StateChanged(S.CALLING_MODEL, S.READY, "model call failed: retrying"))
        ceiling = min(
            self.config.model_backoff_cap_s,
            self.config.model_backoff_base_s * 2 ** (self._model_failures - 1),
        )
        delay = max(self._rng.uniform(0, ceiling), error.retry_after or 0.0)
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
        await self._route_calls(tuple(reply.tool_calls))

    async def _resume_calling_model(self) -> None:
        """Recovery inside CALLING_MODEL: the reply (if any) was not fully processed before the crash."""
        call = self.record.model_call
        if call is not None and call.outcome is None:
            # The intent was logged and the provider may have billed the call: charge the reservation.
            await self.ports.admission.settle_turn(call.grant_id, 0)
            reserved = Usage(uncached_input=0, cached_input=0, output=call.max_tokens)
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
            await self._route_calls(tuple(last.tool_calls))
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

    async def _route_calls(self, proposals: tuple[ToolCallProposal, ...]) -> None:
        """Validate locally, watch for loops, then hold for approval or dispatch."""
        valid: list[tuple[ToolCallProposal, dict[str, Any]]] = []
        for p in proposals:
            problem = None
            try:
                args = self.registry.validate(p.tool, p.raw_arguments)
            except ToolArgumentsInvalid as e:
                problem = e.observation()
            except UnknownTool as e:
                problem = {"status": "REJECTED", "reason": "UNKNOWN_TOOL", "message": str(e)}
            else:
                if not self.record.grants.allows(p.tool):
                    problem = {
                        "status": "REJECTED",
                        "reason": "NOT_GRANTED",
                        "message": f"{p.tool} is not granted",
                    }
            if problem is not None:
                # local rejection: never reaches the dependency, never counts in its breaker window
                await self._append(
                    ObservationAppended(
                        ObservationKind.REFUSAL, json.dumps(problem, default=str), call_id=p.call_id
                    )
                )
                continue
            fired = self._watch(p.tool, args)
            if fired is not None:
                await self._append(StateChanged(S.CALLING_MODEL, S.READY, f"watchdog: {fired}"))
                await self._enter_finalizing(ExitReason.ERROR, f"watchdog {fired} stopped a loop")
                return
            valid.append((p, args))

        gated = [(p, a) for p, a in valid if self._needs_approval(p.tool)]
        if gated:
            held, held_args = gated[0]
            for p, _ in valid:
                if p is not held:
                    reason = "another call in this reply awaits approval; propose it again afterwards"
                    await self._append(
                        ObservationAppended(
                            ObservationKind.REFUSAL,
                            json.dumps({"status": "REFUSED", "reason": "DEFERRED", "message": reason}),
                            call_id=p.call_id,
                        )
                    )
            now = self.ports.clock.wall()
            await self._append(
                ToolCallHeld(
                    held.call_id,
                    held.tool,
                    held_args,
                    call_digest(held.tool, held_args),
                    now + self.config.approval_timeout_s,
                )
            )
            await self._append(
                StateChanged(S.CALLING_MODEL, S.AWAITING_APPROVAL, f"{held.tool} needs approval")
            )
            return
        if not valid:
            await self._append(StateChanged(S.CALLING_MODEL, S.READY, "no dispatchable calls"))
            return
        await self._append(StateChanged(S.CALLING_MODEL, S.WAITING_TOOL, f"dispatching {len(valid)} call(s)"))
        await self._dispatch_all(valid)

    def _needs_approval(self, tool: str) -> bool:
        return tool in self.record.grants.approval_required or self.registry.get(tool).requires_approval

    def _watch(self, tool: str, args: Mapping[str, Any]) -> str | None:
        contract = self.registry.get(tool)
        coarse = coarse_fingerprint(tool, args, contract.target_keys) if contract.target_keys else None
        step = WatchdogStep(call_fingerprint(tool, args), coarse, None)
        self._watchdog, verdict = self._watchdog.observe(step)
        return verdict.guard.value if verdict.fired and verdict.guard is not None else None

    async def _dispatch_all(
        self,
        calls: Sequence[tuple[ToolCallProposal, Mapping[str, Any]]],
        approval_digest: str | None = None,
    ) -> None:
        """Dispatch calls concurrently; wait until every one settled or timed out, then back to READY."""
        tasks = {
            p.call_id: self._spawn(self._run_operation(p.call_id, p.tool, dict(a), approval_digest))
            for p, a in calls
        }
        await self._wait_tools(tasks)

    async def _wait_tools(self, tasks: Mapping[str, asyncio.Future[None]]) -> None:
        """Wait for dispatched calls by call id. A call whose deadline passes is timed out (its id leaves
        the pending set first) and no longer holds the turn: its task may finish later, and its late
        result is then dropped and audited. A call between retry attempts still holds the turn."""
        timed_out: set[str] = set()
        while True:
            if self._kill.is_set():
                await self._abandon([t for t in tasks.values() if not t.done()], "killed")
                return
            for ev in expired_calls(self.record, self.ports.clock.wall()):
                timed_out.add(ev.call_id)
                await self._append(ev)
            holding = [t for cid, t in tasks.items() if not t.done() and cid not in timed_out]
            if not holding:
                if self.record.pending_calls:
                    await self._abandon([], "no live dispatch")  # e.g. results lost with a restart
                break
            deadlines = [p.deadline for p in self.record.pending_calls.values()]
            wait = max(0.0, min(deadlines) - self.ports.clock.wall()) if deadlines else None
            self._changed.clear()
            kill_wait = asyncio.ensure_future(self._kill.wait())
            changed = asyncio.ensure_future(self._changed.wait())
            sleeper = asyncio.ensure_future(self.ports.clock.sleep(wait)) if wait is not None else None
            waiters: set[asyncio.Future[Any]] = {*holding, kill_wait, changed}
            if sleeper is not None:
                waiters.add(sleeper)
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            for w in (kill_wait, changed, sleeper):
                if w is not None:
                    w.cancel()
        for t in tasks.values():
            if t.done() and not t.cancelled() and t.exception() is not None:
                raise t.exception()  # type: ignore[misc]
        if self.record.state is S.WAITING_TOOL:
            await self._append(StateChanged(S.WAITING_TOOL, S.READY, "tool calls settled"))

    async def _abandon(self, live: list[asyncio.Future[None]], reason: str) -> None:
        """Kill / lost results: stop waiting; every still-pending call becomes in doubt (not failed)."""
        for t in live:
            t.cancel()
        for t in live:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        for call_id in list(self.record.pending_calls):
            pending = self.record.pending_calls[call_id]
            await self._append(ToolCallCancelled(call_id, reason))
            with contextlib.suppress(Exception):
                op = self.record.operations[pending.operation_id]
                await self.ports.tools.cancel(pending.tool, op.effect_key)
        if self.record.state is S.WAITING_TOOL:
            if self._kill.is_set():
                await self._append(StateChanged(S.WAITING_TOOL, S.READY, "killed: calls in doubt"))
            else:
                await self._append(StateChanged(S.WAITING_TOOL, S.READY, f"{reason}: calls in doubt"))

    async def _run_operation(
        self,
        call_id: str,
        tool: str,
        args: dict[str, Any],
        approval_digest: str | None,
        operation_id: str | None = None,
    ) -> None:
        """One logical operation: every attempt's intent is logged before it is sent."""
        contract = self.registry.get(tool)
        step = self.record.turn_count * 1000 + len(self.record.operations)
        key = effect_key(self.trajectory_id, step, tool, args)
        operation_id = operation_id or f"op-{key[:16]}"
        existing = self.record.operations.get(operation_id)
        if existing is not None:
            key = existing.effect_key
        now = self.ports.clock.wall()
        deadline = now + self.config.tool_timeout_s
        if self.record.deadline is not None:
            deadline = min(deadline, self.record.deadline)
        retry = self.ports.retry
        retry.begin(operation_id, contract.repeat, deadline)
        compensation = contract.compensation.tool if contract.compensation else None
        repeat_safe = contract.repeat in (RepeatContract.IDEMPOTENT, RepeatContract.DEDUPLICATED)
        try:
            while True:
                try:
                    permit = await self.ports.guard.admit(contract.dependency_scope, call_id, deadline)
                except PolicyRefusal as e:
                    # breaker open or bulkhead full: the trajectory is told why; nothing was dispatched
                    if self.record.state is S.WAITING_TOOL and call_id not in self.record.pending_calls:
                        await self._append(
                            ObservationAppended(
                                ObservationKind.REFUSAL,
                                json.dumps(
                                    {"status": "REJECTED", "reason": type(e).__name__, "message": str(e)}
                                ),
                                call_id=call_id,
                            )
                        )
                    return
                attempt_id = retry.next_attempt(operation_id)
                sandbox_permit = None
                try:
                    await self._append(
                        ToolDispatchIntent(
                            call_id=call_id,
                            tool=tool,
                            arguments=args,
                            effect_key=key,
                            operation_id=operation_id,
                            attempt_id=attempt_id,
                            deadline=deadline,
                            liability=contract.charge,
                            compensation=compensation,
                            repeat_safe=repeat_safe,
                            approval_digest=approval_digest,
                        )
                    )
                    approval_digest = None  # the approval is consumed by the first dispatch
                    if contract.sandbox_pool:
                        sandbox_permit = await self.ports.admission.acquire_sandbox(
                            self.trajectory_id, contract.sandbox_pool, self.record.priority_class, deadline
                        )
                    outcome = await self.ports.tools.invoke(
                        ToolInvocation(
                            self.trajectory_id, call_id, tool, args, key, operation_id, attempt_id, deadline
                        )
                    )
                except DependencyError as e:
                    outcome = ToolOutcome(
                        Settlement.UNKNOWN,
                        OutcomeClass.INFRASTRUCTURE_FAILURE,
                        error=str(e),
                        retry_after=e.retry_after,
                    )
                finally:
                    if sandbox_permit is not None:
                        await self.ports.admission.release_sandbox(sandbox_permit.permit_id)
                    await self.ports.guard.release(permit)
                await self.ports.guard.record(permit, outcome.outcome_class)
                result_event = on_tool_result(self.record, call_id, outcome, charge=contract.charge)
                await self._append(result_event)
                if isinstance(result_event, LateResultDropped):
                    return  # timed out or abandoned meanwhile: audited, never appended as a result
                verdict = retry.decide(operation_id, outcome)
                if verdict.verdict is Verdict.PROBE and contract.probe:
                    settlement = await self.ports.tools.probe(tool, key, deadline)
                    verdict = retry.after_probe(operation_id, settlement)
                    if settlement is not Settlement.UNKNOWN:
                        await self._append(OperationSettled(operation_id, settlement, "probe"))
                if verdict.verdict is not Verdict.RETRY:
                    return
                await self.ports.clock.sleep(verdict.delay_s)
                if self._kill.is_set() or self.record.state is not S.WAITING_TOOL:
                    return
        finally:
            retry.forget(operation_id)

    async def _resume_waiting_tool(self) -> None:
        """Recovery inside WAITING_TOOL: dispatched calls whose results were not logged are in doubt.

        Each one is re-dispatched under the same effect key only when its repeat contract makes that safe;
        otherwise it is probed when the tool supports it, or left unknown with the trajectory as owner.
        """
        pending = list(self.record.pending_calls.values())
        for p in pending:
            await self._append(ToolCallCancelled(p.call_id, "actor restarted: outcome unknown"))
        redo: dict[str, asyncio.Future[None]] = {}
        for p in pending:
            op = self.record.operations[p.operation_id]
            contract = self.registry.get(p.tool)
            if op.settled:
                continue
            if op.repeat_safe:
                args = self._dispatched_args(p.call_id)
                redo[p.call_id] = self._spawn(
                    self._run_operation(p.call_id, p.tool, args, None, op.operation_id)
                )
            elif contract.probe:
                settlement = await self.ports.tools.probe(
                    p.tool, op.effect_key, self.ports.clock.wall() + self.config.tool_timeout_s
                )
                if settlement is not Settlement.UNKNOWN:
                    await self._append(OperationSettled(op.operation_id, settlement, "probe after restart"))
            else:
                await self._append(
                    OperationMarkedInDoubt(op.operation_id, "never repeat: left unknown", self.trajectory_id)
                )
        await self._wait_tools(redo)

    def _dispatched_args(self, call_id: str) -> dict[str, Any]:
        for ev in reversed(self._events):
            if isinstance(ev, ToolDispatchIntent) and ev.call_id == call_id:
                return dict(ev.arguments)
        raise KeyError(call_id)

    # ------------------------------------------------------------------ approval gate

    async def _await_approval(self) -> bool:
        """AWAITING_APPROVAL: approve / deny / expiry decide; kill and cancel finalize. False to hibernate."""
        while True:
            held = self.record.held
            if held is None:  # defensive: nothing held means nothing to wait for
                await self._append(StateChanged(S.AWAITING_APPROVAL, S.READY, "nothing held"))
                return True
            for req in list(self.record.pending_control):
                if req.action in (ControlAction.KILL, ControlAction.CANCEL):
                    reason = ExitReason.KILLED if req.action is ControlAction.KILL else ExitReason.CANCELED
                    await self._append(ControlApplied(req.message_id))
                    await self._enter_finalizing(reason, f"{req.action.value} by {req.issuer}: {req.reason}")
                    return True
                if req.action in (ControlAction.APPROVE, ControlAction.DENY):
                    await self._decide(req)
                    return True
            now = self.ports.clock.wall()
            if now >= held.expires_at:
                await self._refuse_held(
                    ApprovalDecision.EXPIRED,
                    (),
                    "APPROVAL_EXPIRED",
                    "No approval was recorded before the request expired.",
                )
                return True
            timeout = held.expires_at - now
            if self.config.idle_hibernate_s is not None:
                timeout = min(timeout, self.config.idle_hibernate_s)
            arrived = await self._wait_for_control(timeout)
            if (
                not arrived
                and self.config.idle_hibernate_s is not None
                and self.ports.clock.wall() < held.expires_at
            ):
                return False

    async def _decide(self, req: PendingControl) -> None:
        held = self.record.held
        assert held is not None
        payload = req.payload if isinstance(req.payload, Mapping) else {}
        digest = payload.get("digest")
        issuers = payload.get("issuers")
        names = (
            tuple(str(i) for i in issuers) if isinstance(issuers, list | tuple) and issuers else (req.issuer,)
        )
        await self._append(ControlApplied(req.message_id))
        now = self.ports.clock.wall()
        if req.action is ControlAction.DENY:
            await self._refuse_held(
                ApprovalDecision.DENIED,
                names,
                "APPROVAL_DENIED",
                f"Denied by {', '.join(names)}: {req.reason}",
            )
            return
        if digest is not None and digest != held.digest:
            await self._refuse_held(
                ApprovalDecision.DENIED, names, "STALE_DIGEST", "The approval was for a different call."
            )
            return
        if now > held.expires_at:
            await self._refuse_held(
                ApprovalDecision.EXPIRED,
                (),
                "APPROVAL_EXPIRED",
                "The approval arrived after the request expired.",
            )
            return
        if len(set(names)) < self.config.approval_quorum:
            await self._refuse_held(
                ApprovalDecision.DENIED,
                names,
                "QUORUM_NOT_MET",
                f"{self.config.approval_quorum} distinct approvers are required.",
            )
            return
        await self._append(
            ApprovalDecided(
                held.digest, ApprovalDecision.APPROVED, tuple(dict.fromkeys(names)), req.reason, now
            )
        )
        # re-check before dispatch: digest still matches the held call, the grant and budget still allow it
        failed = None
        if call_digest(held.tool, held.arguments) != held.digest:
            failed = "digest"
        elif not self.record.grants.allows(held.tool):
            failed = "grant"
        elif self.record.budget_stage is BudgetStage.HALT:
            failed = "budget"
        await self._append(ApprovalRechecked(held.digest, failed is None, failed, self.ports.clock.wall()))
        if failed is not None:
            await self._append(
                ObservationAppended(
                    ObservationKind.REFUSAL,
                    json.dumps(
                        {"status": "REFUSED", "reason": f"RECHECK_FAILED_{failed.upper()}", "call": held.tool}
                    ),
                    call_id=held.call_id,
                )
            )
            await self._append(StateChanged(S.AWAITING_APPROVAL, S.READY, f"re-check failed: {failed}"))
            return
        await self._append(
            StateChanged(S.AWAITING_APPROVAL, S.WAITING_TOOL, "approved", approval_digest=held.digest)
        )
        await self._dispatch_one_approved(held.call_id, held.tool, dict(held.arguments), held.digest)

    async def _dispatch_one_approved(
        self, call_id: str, tool: str, args: dict[str, Any], digest: str
    ) -> None:
        task = self._spawn(self._run_operation(call_id, tool, args, digest))
        await self._wait_tools({call_id: task})

    async def _refuse_held(
        self, decision: ApprovalDecision, issuers: tuple[str, ...], reason: str, message: str
    ) -> None:
        held = self.record.held
        assert held is not None
        await self._append(ApprovalDecided(held.digest, decision, issuers, reason, self.ports.clock.wall()))
        call = f"{held.tool}({json.dumps(dict(held.arguments), sort_keys=True, default=str)})"
        body = {"status": "REFUSED", "reason": reason, "call": call, "message": message}
        await self._append(
            ObservationAppended(ObservationKind.REFUSAL, json.dumps(body), call_id=held.call_id)
        )
        await self._append(StateChanged(S.AWAITING_APPROVAL, S.READY, reason.lower()))

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
            await self._abandon([], "finalizing")
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
