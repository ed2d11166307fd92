"""Tool calls: from a reply's proposals to settled operations.

A reply's proposed calls are validated locally (schema, grant: a local rejection never reaches the
dependency and never counts in its breaker window), shown to the watchdog (every proposal, valid or not),
then held for approval or queued. A queued call waits for its permits (the dependency's guard, then a
sandbox permit when the tool needs one); nothing is sent while a stop request (pause, cancel, kill) is
pending, and every dispatch passes the admission check (``runtime.admission``). Its intent is durable
before it is sent, with an effect key derived from intent. The attempt's outcome settles the operation
(settlement rule: established, established absent, or unknown), the breaker records its class, the permits
are released, and the single retry owner's rule (``runtime.retry``) decides what happens next: done, a
retry after a full-jitter backoff, a probe (result recovery), or unknown with the trajectory as owner.

Where a lost tool reply goes (a newcomer's question): the call's deadline timer fires (``TimerDue`` ->
``call_deadline``) and the call is timed out, its operation in doubt with the trajectory as owner; a late
reply is dropped and audited but settles the operation as evidence, or triggers a probe when it says
nothing (``settle_late``); after a restart, ``runtime._decide_recover`` re-sends, probes or leaves it
unknown by its repeat contract.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from runtime import _decide_children as children
from runtime import _decide_supervise as supervise
from runtime._decide_approval import hold
from runtime._decide_candidate import note_candidate
from runtime._decide_cleanup import (
    cleanup_timed_out,
    is_cleanup,
    on_cleanup_outcome,
    on_cleanup_probe,
    on_forward_settled,
)
from runtime._decide_commit import repair_attempt, repair_failed, repair_succeeded
from runtime._decide_dispatch import queue_for_permit, refusal, refuse_call, stop_requested
from runtime._step import Step
from runtime.decisions import expired_calls, on_tool_result
from runtime.effects import ProbeTool, ReleasePermit
from runtime.events import (
    CallObserved,
    LateResultDropped,
    OperationSettled,
    StateChanged,
    ToolCallQueued,
    ToolCallWithdrawn,
)
from runtime.fingerprint import call_fingerprint, coarse_fingerprint
from runtime.inputs import ProbeAnswered, ToolOutcomeReceived
from runtime.operations import Operation
from runtime.ports import OutcomeClass, Settlement, ToolCallProposal
from runtime.record import QueueStage, TimerKind
from runtime.retry import RetryAction, after_probe, decide_retry
from runtime.states import TrajectoryState
from runtime.tools import ToolArgumentsInvalid, UnknownTool
from runtime.watchdog import WatchdogStep

__all__ = ["call_timed_out", "on_probe_answered", "on_tool_outcome", "route", "settle_late"]

S = TrajectoryState


# --------------------------------------------------------------------------- a reply's proposals


def _validate(step: Step, p: ToolCallProposal) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(canonical arguments, None) or (None, the local rejection's observation)."""
    registry = step.policy.registry
    try:
        args = registry.validate(p.tool, p.raw_arguments)
    except ToolArgumentsInvalid as e:
        return None, e.observation()
    except UnknownTool as e:
        return None, refusal("UNKNOWN_TOOL", str(e))
    if not step.record.grants.allows(p.tool):
        return None, refusal("NOT_GRANTED", f"{p.tool} is not granted")
    return args, None


def _observe(step: Step, p: ToolCallProposal, args: Mapping[str, Any] | None) -> str | None:
    """Show the proposal to the watchdog (recorded as ``CallObserved``); the detector that fired, if any."""
    registry = step.policy.registry
    if args is not None:
        fingerprint = call_fingerprint(p.tool, args)
        targets = registry.get(p.tool).target_keys
        coarse = coarse_fingerprint(p.tool, args, targets) if targets else None
    else:
        # an invalid call has no canonical arguments: its exact text is what repeats
        fingerprint = call_fingerprint(p.tool, {"raw_arguments": p.raw_arguments})
        coarse = None
    waiting = supervise.waiting_on_job(step, p.tool, args)  # issue 12: polling a running job is exempt
    watchdog_step = WatchdogStep(fingerprint, coarse, None, waiting)
    _, verdict = step.record.watchdog.observe(watchdog_step)
    fired = verdict.guard.value if verdict.fired and verdict.guard is not None else None
    step.emit(CallObserved(p.call_id, p.tool, fingerprint, coarse, None, waiting, fired))
    return fired


def _needs_approval(step: Step, tool: str) -> bool:
    return tool in step.record.grants.approval_required or step.policy.registry.get(tool).requires_approval


def route(step: Step, proposals: tuple[ToolCallProposal, ...]) -> None:
    """CALLING_MODEL with a tool_use reply appended: validate, watch, then hold, queue, or back to READY."""
    valid: list[tuple[ToolCallProposal, dict[str, Any]]] = []
    exhausted = False
    for p in proposals:
        args, problem = _validate(step, p)
        fired = _observe(step, p, args)
        capped = repair_attempt(step, p.tool) if p.tool in step.policy.registry else None
        if capped is not None:
            args, problem, exhausted = None, refusal("REPAIR_EPISODE_EXHAUSTED", capped), True
        elif problem is not None and problem.get("reason") == "INVALID_ARGUMENTS":
            repair_failed(step, p.tool, "its arguments were rejected before dispatch")
        if problem is not None:
            refuse_call(step, p.call_id, problem)
        # issue 12: disclosure rules and the watchdog ladder (inform, constrain, hold)
        screened = supervise.screen(step, p, args, fired)
        if screened == supervise.Screen.STOP:
            return
        if args is not None and screened == supervise.Screen.PASS:
            valid.append((p, args))
    if exhausted:
        # the recovery budget is spent: no automatic path remains, so a person inspects (§12.4.4)
        for p, _ in valid:
            body = {"status": "REFUSED", "reason": "DEFERRED", "message": "Paused for inspection; not sent."}
            refuse_call(step, p.call_id, body)
        step.emit(StateChanged(S.CALLING_MODEL, S.READY, "repair episode exhausted"))
        step.emit(StateChanged(S.READY, S.PAUSED, "repair episode exhausted: awaiting operator inspection"))
        return

    stop = stop_requested(step)
    if stop is not None and valid:
        for p, _ in valid:
            message = f"A {stop} request is pending; the call was not sent."
            refuse_call(step, p.call_id, {"status": "REFUSED", "reason": "DEFERRED", "message": message})
        valid = []
    gated = [(p, a) for p, a in valid if _needs_approval(step, p.tool)]
    if gated:
        held, held_args = gated[0]
        others = [p for p, _ in valid if p is not held]
        hold(step, held, held_args, others)
        return
    if not valid:
        step.emit(StateChanged(S.CALLING_MODEL, S.READY, "no dispatchable calls"))
        return
    step.emit(StateChanged(S.CALLING_MODEL, S.WAITING_TOOL, f"dispatching {len(valid)} call(s)"))
    for p, args in valid:
        if children.is_delegation(step, p.tool):  # issue 12: a delegated call becomes a child trajectory
            children.spawn(step, p, args)
            continue
        queue_for_permit(step, p.call_id, p.tool, args)


# --------------------------------------------------------------------------- permits and dispatch


# --------------------------------------------------------------------------- outcomes


def on_tool_outcome(step: Step, inp: ToolOutcomeReceived) -> None:
    if is_cleanup(inp.call_id):
        on_cleanup_outcome(step, inp)
        return
    outcome = inp.outcome
    # the attempt's permits come back with it: released exactly once, its class recorded if it was sent
    if inp.guard is not None or inp.sandbox is not None:
        step.do(ReleasePermit(inp.guard, inp.sandbox, outcome.outcome_class if inp.dispatched else None))
    rec = step.record
    pending = rec.pending_calls.get(inp.call_id)
    if pending is not None and pending.attempt_id != inp.attempt_id:
        return  # an earlier attempt of a call being retried: its operation belongs to the newer attempt
    charge = 0.0
    if pending is not None and pending.tool in step.policy.registry and inp.dispatched:
        charge = step.policy.registry.get(pending.tool).charge
    accepted = on_tool_result(rec, inp.call_id, outcome, charge)  # invariant 1: accepted only if pending
    step.emit(accepted)
    if isinstance(accepted, LateResultDropped) or pending is None:
        settle_late(step, inp)
        return
    contract = step.policy.registry.get(pending.tool)
    step.disarm(step.record.timer_of(TimerKind.CALL_DEADLINE, inp.call_id))
    if inp.dispatched:
        success = outcome.outcome_class is OutcomeClass.SUCCESS
        note_candidate(step, inp.operation_id, outcome.settlement, outcome.result, success)
    if outcome.outcome_class is not OutcomeClass.INFRASTRUCTURE_FAILURE:
        payload = outcome.result if outcome.outcome_class is OutcomeClass.SUCCESS else None
        on_forward_settled(step, inp.operation_id, outcome.settlement, payload, "its reply")
    if outcome.outcome_class is OutcomeClass.CLIENT_REJECTION and inp.dispatched:
        repair_failed(step, pending.tool, f"the endpoint rejected it: {outcome.error or 'client rejection'}")
    elif outcome.settlement is Settlement.ESTABLISHED and outcome.outcome_class is OutcomeClass.SUCCESS:
        repair_succeeded(step, pending.tool)
    if not inp.dispatched:
        return  # refused locally before anything was sent: known absent, nothing to retry
    op = step.record.operations[inp.operation_id]
    decision = decide_retry(
        contract=contract.repeat,
        policy=step.policy.retry,
        attempts_used=op.attempts,
        settlement=outcome.settlement,
        outcome_class=outcome.outcome_class,
        retry_after=outcome.retry_after,
        non_retryable=False,
        now=step.now,
        deadline=_retry_deadline(step),
        u=step.uniform(f"retry:{op.operation_id}:{op.attempts}"),
    )
    _follow(step, pending.call_id, pending.tool, op, decision.action, decision.delay_s)


def _retry_deadline(step: Step) -> float:
    forward = step.forward_deadline
    return forward if forward is not None else step.now + 10 * step.policy.tool_timeout_s


def _follow(step: Step, call_id: str, tool: str, op: Operation, action: RetryAction, delay_s: float) -> None:
    """Carry out the retry owner's decision for a call whose attempt just ended (or was probed)."""
    queued = step.record.queued.get(call_id)
    args = queued.arguments if queued is not None else _arguments_of(step, op)
    contract = step.policy.registry.get(tool)
    if not step.record.grants.allows(tool) and action in (RetryAction.RETRY, RetryAction.PROBE):
        # issue 12: the grant narrowed (an incident, a degraded rung): nothing more is sent for this call;
        # a probe still asks what became of the effect, since recovery is not model-directed work
        if queued is not None:
            step.emit(ToolCallWithdrawn(call_id, "grant narrowed: not retried"))
        if action is RetryAction.PROBE and contract.probe:
            deadline = step.now + step.policy.probe_timeout_s
            step.do(ProbeTool(op.operation_id, tool, op.effect_key, deadline))
        return
    if action is RetryAction.RETRY:
        request_id = step.new_id("retry")
        step.emit(ToolCallQueued(call_id, tool, args, QueueStage.BACKOFF, request_id, op.operation_id))
        step.arm(TimerKind.RETRY, step.now + delay_s, subject=call_id)
    elif action is RetryAction.PROBE and contract.probe:
        request_id = step.new_id("probe")
        step.emit(ToolCallQueued(call_id, tool, args, QueueStage.PROBING, request_id, op.operation_id))
        deadline = step.now + step.policy.probe_timeout_s
        step.do(ProbeTool(op.operation_id, tool, op.effect_key, deadline, request_id))
    elif queued is not None:
        step.emit(_done(call_id, action))


def _done(call_id: str, action: RetryAction) -> ToolCallWithdrawn:
    return ToolCallWithdrawn(call_id, f"operation ended: {action.value}")


def _arguments_of(step: Step, op: Operation) -> dict[str, Any]:
    return dict(op.arguments)


def settle_late(step: Step, inp: ToolOutcomeReceived) -> None:
    """A result nobody awaits any more is still evidence about its operation's effect (settlement rule):
    it settles an unsettled operation, and when it says nothing, the endpoint is probed where it can be."""
    op = step.record.operations.get(inp.operation_id)
    if op is None or op.settled:
        return
    if any(p.operation_id == op.operation_id for p in step.record.pending_calls.values()):
        return
    if any(q.operation_id == op.operation_id for q in step.record.queued.values()):
        return  # a retry or probe of this operation is under way: it decides
    if inp.outcome.settlement is not Settlement.UNKNOWN:
        result = inp.outcome.result if inp.outcome.outcome_class is OutcomeClass.SUCCESS else None
        step.emit(
            OperationSettled(op.operation_id, inp.outcome.settlement, "late result", result, op.call_id)
        )
        note_candidate(step, op.operation_id, inp.outcome.settlement, result, result is not None)
        on_forward_settled(step, op.operation_id, inp.outcome.settlement, result, "a late reply")
    elif op.tool in step.policy.registry and step.policy.registry.get(op.tool).probe:
        deadline = step.now + step.policy.probe_timeout_s
        step.do(ProbeTool(op.operation_id, op.tool, op.effect_key, deadline))


def on_probe_answered(step: Step, inp: ProbeAnswered) -> None:
    if on_cleanup_probe(step, inp):
        return
    rec = step.record
    op = rec.operations.get(inp.operation_id)
    if op is None:
        return
    settlement = inp.result.settlement
    awaited = any(p.operation_id == op.operation_id for p in rec.pending_calls.values())
    if settlement is not Settlement.UNKNOWN and not op.settled and not awaited:
        detail = f"probe: {inp.result.detail}" if inp.result.detail else "probe"
        result = inp.result.result if settlement is Settlement.ESTABLISHED else None
        # the probe's stored reply counts as the call's result: it binds the obligation and the model sees it
        call_id = op.call_id if not op.cleanup_of else None
        step.emit(OperationSettled(op.operation_id, settlement, detail, result, call_id))
        note_candidate(step, op.operation_id, settlement, result, True)
        on_forward_settled(step, op.operation_id, settlement, result, "a probe")
    q = step.record.queued.get(op.call_id)
    if (
        step.record.state is not S.WAITING_TOOL
        or q is None
        or q.stage is not QueueStage.PROBING
        or (inp.request_id and q.request_id != inp.request_id)
        or q.operation_id != op.operation_id
    ):
        return
    op = step.record.operations[op.operation_id]
    decision = after_probe(
        policy=step.policy.retry,
        attempts_used=op.attempts,
        settlement=settlement,
        now=step.now,
        deadline=_retry_deadline(step),
        u=step.uniform(f"probe:{op.operation_id}:{op.attempts}"),
    )
    if decision.action is RetryAction.RETRY:
        _follow(step, q.call_id, q.tool, op, decision.action, decision.delay_s)
    else:
        step.emit(_done(q.call_id, decision.action))


# --------------------------------------------------------------------------- timers of calls


def call_timed_out(step: Step, call_id: str) -> None:
    """A call's deadline passed: its id leaves the pending set (a later result is dropped and audited) and
    its operation is in doubt, owned by the trajectory. A timeout settles nothing."""
    if is_cleanup(call_id):
        cleanup_timed_out(step, call_id)
        return
    pending = step.record.pending_calls.get(call_id)
    expired = [ev for ev in expired_calls(step.record, step.now) if ev.call_id == call_id]
    step.emit(*expired)
    if expired and pending is not None:  # a revising call that timed out may have changed the candidate
        note_candidate(step, pending.operation_id, Settlement.UNKNOWN, None, False)
