"""Tool calls of one turn: local validation, watchdog, the approval hand-off, and dispatch.

A collaborator of ``runtime.harness.Harness`` (it reads the harness's record and appends through it).
Dispatch logs each attempt's intent before the call is sent (intent before effect), passes the dependency
guard and the sandbox semaphore, settles the operation from the result, and lets the single retry owner
decide what happens next. A call whose deadline passes is timed out first, so its late result is dropped
and audited, never appended.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from runtime.dispatch import Verdict
from runtime.errors import (
    DependencyError,
    InputError,
    PolicyRefusal,
)
from runtime.events import (
    Event,
    LateResultDropped,
    ObservationAppended,
    ObservationKind,
    OperationMarkedInDoubt,
    OperationSettled,
    StateChanged,
    ToolCallCancelled,
    ToolCallHeld,
    ToolDispatchIntent,
)
from runtime.fingerprint import call_digest, call_fingerprint, coarse_fingerprint, effect_key
from runtime.fold import expired_calls, on_tool_result
from runtime.ports import (
    OutcomeClass,
    Settlement,
    ToolCallProposal,
    ToolInvocation,
    ToolOutcome,
)
from runtime.states import ExitReason, TrajectoryState
from runtime.tools import RepeatContract, ToolArgumentsInvalid, UnknownTool
from runtime.watchdog import WatchdogStep

if TYPE_CHECKING:
    from runtime.harness import Harness

__all__ = ["ToolStage"]

S = TrajectoryState
_log = logging.getLogger(__name__)


class ToolStage:
    """Routes a reply's proposed calls and runs their operations for one harness."""

    def __init__(self, harness: Harness) -> None:
        self.h = harness

    async def route(self, proposals: tuple[ToolCallProposal, ...]) -> None:
        """Validate locally, watch for loops, then hold for approval or dispatch."""
        valid: list[tuple[ToolCallProposal, dict[str, Any]]] = []
        for p in proposals:
            problem = None
            try:
                args = self.h.registry.validate(p.tool, p.raw_arguments)
            except ToolArgumentsInvalid as e:
                problem = e.observation()
            except UnknownTool as e:
                problem = {"status": "REJECTED", "reason": "UNKNOWN_TOOL", "message": str(e)}
            else:
                if not self.h.record.grants.allows(p.tool):
                    problem = {
                        "status": "REJECTED",
                        "reason": "NOT_GRANTED",
                        "message": f"{p.tool} is not granted",
                    }
            if problem is not None:
                # local rejection: never reaches the dependency, never counts in its breaker window
                await self.h._append(
                    ObservationAppended(
                        ObservationKind.REFUSAL, json.dumps(problem, default=str), call_id=p.call_id
                    )
                )
                continue
            fired = self._watch(p.tool, args)
            if fired is not None:
                await self.h._append(StateChanged(S.CALLING_MODEL, S.READY, f"watchdog: {fired}"))
                await self.h._enter_finalizing(ExitReason.ERROR, f"watchdog {fired} stopped a loop")
                return
            valid.append((p, args))

        gated = [(p, a) for p, a in valid if self._needs_approval(p.tool)]
        if gated:
            held, held_args = gated[0]
            for p, _ in valid:
                if p is not held:
                    reason = "another call in this reply awaits approval; propose it again afterwards"
                    await self.h._append(
                        ObservationAppended(
                            ObservationKind.REFUSAL,
                            json.dumps({"status": "REFUSED", "reason": "DEFERRED", "message": reason}),
                            call_id=p.call_id,
                        )
                    )
            now = self.h.ports.clock.wall()
            await self.h._append(
                ToolCallHeld(
                    held.call_id,
                    held.tool,
                    held_args,
                    call_digest(held.tool, held_args),
                    now + self.h.config.approval_timeout_s,
                )
            )
            await self.h._append(
                StateChanged(S.CALLING_MODEL, S.AWAITING_APPROVAL, f"{held.tool} needs approval")
            )
            return
        if not valid:
            await self.h._append(StateChanged(S.CALLING_MODEL, S.READY, "no dispatchable calls"))
            return
        await self.h._append(
            StateChanged(S.CALLING_MODEL, S.WAITING_TOOL, f"dispatching {len(valid)} call(s)")
        )
        await self._dispatch_all(valid)

    def _needs_approval(self, tool: str) -> bool:
        return tool in self.h.record.grants.approval_required or self.h.registry.get(tool).requires_approval

    async def _settle_late(
        self, operation_id: str, tool: str, key: str, outcome: ToolOutcome, can_probe: bool
    ) -> None:
        """Settle an abandoned operation from a late result (correlated evidence), or by probing the
        endpoint when the late result says nothing; otherwise it stays in doubt with its owner."""
        op = self.h.record.operations.get(operation_id)
        if (
            op is None
            or op.settled
            or any(p.operation_id == operation_id for p in self.h.record.pending_calls.values())
        ):
            return
        settlement = outcome.settlement
        evidence = "late result"
        if settlement is Settlement.UNKNOWN and can_probe:
            settlement, evidence = await self._probe(tool, key), "probe after timeout"
        if settlement is not Settlement.UNKNOWN:
            await self.h._append(OperationSettled(operation_id, settlement, evidence))
            await self.h._flush()

    async def _probe(self, tool: str, key: str) -> Settlement:
        """Ask the endpoint what became of ``key`` (result recovery). A probe is a new, read-only question
        with its own deadline: the operation's deadline is typically spent by the time one is needed (a
        lost reply). Any failure to get an answer leaves the outcome unknown, never guessed."""
        await self.h._flush()
        deadline = self.h.ports.clock.wall() + self.h.config.tool_timeout_s
        try:
            return (await self.h.ports.tools.probe(tool, key, deadline)).settlement
        except Exception as e:
            _log.warning("probe of %s for %s failed: %s", tool, key, e)
            return Settlement.UNKNOWN

    def replay_watchdog(self, events: Sequence[Event]) -> None:
        """Rebuild the watchdog's window after a restart from the calls it saw: every held call and
        every first dispatch of an effect (retries and approved releases are the same call again)."""
        seen: set[str] = set()
        for ev in events:
            if isinstance(ev, ToolCallHeld):
                seen.add(ev.call_id)
                self._watch(ev.tool, ev.arguments)
            elif isinstance(ev, ToolDispatchIntent) and ev.effect_key not in seen and ev.call_id not in seen:
                seen.add(ev.effect_key)
                if ev.tool in self.h.registry.names():
                    self._watch(ev.tool, ev.arguments)

    def _watch(self, tool: str, args: Mapping[str, Any]) -> str | None:
        contract = self.h.registry.get(tool)
        coarse = coarse_fingerprint(tool, args, contract.target_keys) if contract.target_keys else None
        step = WatchdogStep(call_fingerprint(tool, args), coarse, None)
        self.h._watchdog, verdict = self.h._watchdog.observe(step)
        return verdict.guard.value if verdict.fired and verdict.guard is not None else None

    async def _dispatch_all(
        self,
        calls: Sequence[tuple[ToolCallProposal, Mapping[str, Any]]],
        approval_digest: str | None = None,
    ) -> None:
        """Dispatch calls concurrently; wait until every one settled or timed out, then back to READY."""
        tasks = {
            p.call_id: self.h._spawn(self.run_operation(p.call_id, p.tool, dict(a), approval_digest))
            for p, a in calls
        }
        await self.wait(tasks)

    async def wait(self, tasks: Mapping[str, asyncio.Future[None]]) -> None:
        """Wait for dispatched calls by call id. A call whose deadline passes is timed out (its id leaves
        the pending set first) and no longer holds the turn: its task may finish later, and its late
        result is then dropped and audited. A call between retry attempts still holds the turn."""
        timed_out: set[str] = set()
        while True:
            if self.h._kill.is_set():
                await self.abandon([t for t in tasks.values() if not t.done()], "killed")
                return
            for ev in expired_calls(self.h.record, self.h.ports.clock.wall()):
                timed_out.add(ev.call_id)
                await self.h._append(ev)
            holding = [t for cid, t in tasks.items() if not t.done() and cid not in timed_out]
            if not holding:
                if self.h.record.pending_calls:
                    await self.abandon([], "no live dispatch")  # e.g. results lost with a restart
                break
            deadlines = [p.deadline for p in self.h.record.pending_calls.values()]
            wait = max(0.0, min(deadlines) - self.h.ports.clock.wall()) if deadlines else None
            await self.h._flush()  # about to wait: timeouts and results so far are durable first
            self.h._changed.clear()
            kill_wait = asyncio.ensure_future(self.h._kill.wait())
            changed = asyncio.ensure_future(self.h._changed.wait())
            sleeper = asyncio.ensure_future(self.h.ports.clock.sleep(wait)) if wait is not None else None
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
        if self.h.record.state is S.WAITING_TOOL:
            await self.h._append(StateChanged(S.WAITING_TOOL, S.READY, "tool calls settled"))

    async def abandon(self, live: list[asyncio.Future[None]], reason: str) -> None:
        """Kill / lost results: stop waiting; every still-pending call becomes in doubt (not failed)."""
        for t in live:
            t.cancel()
        for t in live:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        abandoned = list(self.h.record.pending_calls.values())
        for pending in abandoned:
            await self.h._append(ToolCallCancelled(pending.call_id, reason))
        await self.h._flush()  # in doubt is recorded before anyone is asked to cancel
        for pending in abandoned:
            with contextlib.suppress(Exception):
                op = self.h.record.operations[pending.operation_id]
                await self.h.ports.tools.cancel(pending.tool, op.effect_key)
        if self.h.record.state is S.WAITING_TOOL:
            if self.h._kill.is_set():
                await self.h._append(StateChanged(S.WAITING_TOOL, S.READY, "killed: calls in doubt"))
            else:
                await self.h._append(StateChanged(S.WAITING_TOOL, S.READY, f"{reason}: calls in doubt"))

    async def run_operation(
        self,
        call_id: str,
        tool: str,
        args: dict[str, Any],
        approval_digest: str | None,
        operation_id: str | None = None,
    ) -> None:
        """One logical operation: every attempt's intent is logged before it is sent."""
        contract = self.h.registry.get(tool)
        step = self.h.record.turn_count * 1000 + len(self.h.record.operations)
        key = effect_key(self.h.trajectory_id, step, tool, args)
        operation_id = operation_id or f"op-{key[:16]}"
        existing = self.h.record.operations.get(operation_id)
        if existing is not None:
            key = existing.effect_key
        now = self.h.ports.clock.wall()
        deadline = now + self.h.config.tool_timeout_s
        if self.h.record.deadline is not None:
            deadline = min(deadline, self.h.record.deadline)
        retry = self.h.ports.retry
        retry.begin(operation_id, contract.repeat, deadline)
        compensation = contract.compensation.tool if contract.compensation else None
        repeat_safe = contract.repeat in (RepeatContract.IDEMPOTENT, RepeatContract.DEDUPLICATED)
        try:
            while True:
                await self.h._flush()  # the guard may queue us: what is decided so far is durable first
                try:
                    permit = await self.h.ports.guard.admit(contract.dependency_scope, call_id, deadline)
                except PolicyRefusal as e:
                    # breaker open or bulkhead full: the trajectory is told why; nothing was dispatched
                    if self.h.record.state is S.WAITING_TOOL and call_id not in self.h.record.pending_calls:
                        await self.h._append(
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
                dispatched = True
                try:
                    await self.h._append(
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
                    await self.h._flush()  # intent before effect: durable before the call is sent
                    if contract.sandbox_pool:
                        sandbox_permit = await self.h.ports.admission.acquire_sandbox(
                            self.h.trajectory_id,
                            contract.sandbox_pool,
                            self.h.record.priority_class,
                            deadline,
                        )
                    outcome = await self.h.ports.tools.invoke(
                        ToolInvocation(
                            self.h.trajectory_id, call_id, tool, args, key, operation_id, attempt_id, deadline
                        )
                    )
                except DependencyError as e:
                    outcome = ToolOutcome(
                        Settlement.UNKNOWN,
                        OutcomeClass.INFRASTRUCTURE_FAILURE,
                        error=str(e),
                        retry_after=e.retry_after,
                    )
                except (PolicyRefusal, InputError) as e:
                    # refused locally before anything was sent (deadline already passed, no route): the
                    # effect is known absent, and a local rejection never enters the breaker's window
                    outcome = ToolOutcome(
                        Settlement.ESTABLISHED_ABSENT, OutcomeClass.CLIENT_REJECTION, error=f"not sent: {e}"
                    )
                    dispatched = False
                except Exception as e:
                    # an adapter bug must not strand the trajectory; what happened is unknown
                    _log.exception("tool adapter failed on %s (%s)", tool, call_id)
                    outcome = ToolOutcome(
                        Settlement.UNKNOWN, OutcomeClass.INFRASTRUCTURE_FAILURE, error=f"adapter error: {e}"
                    )
                finally:
                    if sandbox_permit is not None:
                        await self.h.ports.admission.release_sandbox(sandbox_permit.permit_id)
                    await self.h.ports.guard.release(permit)
                if dispatched:
                    await self.h.ports.guard.record(permit, outcome.outcome_class)
                result_event = on_tool_result(self.h.record, call_id, outcome, charge=contract.charge)
                await self.h._append(result_event)
                if isinstance(result_event, LateResultDropped):
                    # timed out or abandoned meanwhile: audited, never appended as a result; but it is still
                    # evidence about this operation's effect, so the operation table learns what it can
                    await self._settle_late(operation_id, tool, key, outcome, contract.probe)
                    return
                verdict = retry.decide(operation_id, outcome)
                if verdict.verdict is Verdict.PROBE and contract.probe:
                    settlement = await self._probe(tool, key)
                    verdict = retry.after_probe(operation_id, settlement)
                    if settlement is not Settlement.UNKNOWN:
                        await self.h._append(OperationSettled(operation_id, settlement, "probe"))
                if verdict.verdict is not Verdict.RETRY:
                    return
                await self.h._flush()
                await self.h.ports.clock.sleep(verdict.delay_s)
                if self.h._kill.is_set() or self.h.record.state is not S.WAITING_TOOL:
                    return
        finally:
            retry.forget(operation_id)

    async def resume_after_restart(self) -> None:
        """Recovery inside WAITING_TOOL: dispatched calls whose results were not logged are in doubt.

        Each one is re-dispatched under the same effect key only when its repeat contract makes that safe;
        otherwise it is probed when the tool supports it, or left unknown with the trajectory as owner.
        """
        pending = list(self.h.record.pending_calls.values())
        for p in pending:
            await self.h._append(ToolCallCancelled(p.call_id, "actor restarted: outcome unknown"))
        redo: dict[str, asyncio.Future[None]] = {}
        for p in pending:
            op = self.h.record.operations[p.operation_id]
            contract = self.h.registry.get(p.tool)
            if op.settled:
                continue
            if op.repeat_safe:
                args = self._dispatched_args(p.call_id)
                redo[p.call_id] = self.h._spawn(
                    self.run_operation(p.call_id, p.tool, args, None, op.operation_id)
                )
            elif contract.probe:
                settlement = await self._probe(p.tool, op.effect_key)
                if settlement is not Settlement.UNKNOWN:
                    await self.h._append(OperationSettled(op.operation_id, settlement, "probe after restart"))
            else:
                await self.h._append(
                    OperationMarkedInDoubt(
                        op.operation_id, "never repeat: left unknown", self.h.trajectory_id
                    )
                )
        await self.wait(redo)

    def _dispatched_args(self, call_id: str) -> dict[str, Any]:
        for ev in reversed(self.h._events):
            if isinstance(ev, ToolDispatchIntent) and ev.call_id == call_id:
                return dict(ev.arguments)
        raise KeyError(call_id)
