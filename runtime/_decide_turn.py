"""The turn (harness chapter, "One turn, end to end"): the boundary, admission, the model call, its reply.

At the turn boundary (READY) pending control is applied in arrival order (kill, cancel, pause, interrupt),
then the trajectory deadline, then the budget stage (steer >= 0.70, restrict >= 0.90, halt >= 1.00 of the
tightest ceiling), then the next call's output ceiling is clamped to what the budget can still fund and
the scheduler is asked to admit the turn. Waiting for admission is bounded by the trajectory's own
(forward) deadline, not the per-call one: the call deadline is fixed when the grant arrives.

A reply's stop reason decides what follows: end_turn -> FINALIZING and the completion check; max_tokens and
refusals -> an observation, never a dispatch; tool calls -> ``runtime._decide_tools.route``. A failed call
is charged whatever usage it carried and retried as a new turn after a full-jitter backoff; a 429 is
admission feedback for the scheduler, never a model failure, and gives its turn back.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from runtime import _decide_children as children
from runtime import _decide_supervise as supervise
from runtime import decisions
from runtime._decide_approval import awaiting
from runtime._decide_cleanup import operator_act
from runtime._decide_finalize import abandon_calls, enter_finalizing, finalize, halt_unfundable, withdraw
from runtime._decide_tools import route
from runtime._step import STOPS, Step
from runtime.budget import BudgetStage, Dimension, assess
from runtime.context import anchored_estimate, context_of, estimate_from_chars
from runtime.effects import (
    CallModel,
    CancelModelStream,
    Hibernate,
    KillProcesses,
    ReportLimits,
    RequestAdmission,
    SettleAdmission,
)
from runtime.events import (
    BudgetStageChanged,
    ControlApplied,
    ControlRejected,
    GrantNarrowed,
    ModelCallCancelled,
    ModelCallFailed,
    ModelCallIntent,
    ModelCallSettled,
    ObservationAppended,
    ObservationKind,
    StateChanged,
    TurnAbandoned,
    TurnRequested,
    TurnStarted,
    WallClockMeasured,
)
from runtime.inputs import (
    AdmissionDenied,
    AdmissionGranted,
    ControlReceived,
    ControlRefused,
    ModelCancelled,
    ModelFailed,
    ModelReplied,
)
from runtime.ports import ModelReply, ModelRequest, RateLimitInfo, StopReason, TurnRequest, Usage
from runtime.record import ANY_STATE_ACTIONS, ControlAction, JsonValue, TimerKind
from runtime.states import ExitReason, TrajectoryState

__all__ = [
    "advance",
    "on_admission_denied",
    "on_admission_granted",
    "on_control",
    "on_control_refused",
    "on_model_cancelled",
    "on_model_failed",
    "on_model_replied",
]

S = TrajectoryState
_NO_DEADLINE_QUEUE_S = 86_400.0  # how long a turn of a trajectory without a deadline may queue


# --------------------------------------------------------------------------- moving on


def advance(step: Step) -> None:
    """Carry the record as far as it goes without waiting for anything outside (each pass either changes
    the state or ends the decision)."""
    for _ in range(32):
        rec = step.record
        if rec.is_terminal:
            return
        state = rec.state
        if state is S.READY:
            moved = _ready(step)
        elif state is S.PAUSED:
            moved = _paused(step)
        elif state is S.AWAITING_APPROVAL:
            moved = awaiting(step)
        elif state is S.WAITING_TOOL:
            moved = _waiting_tool(step)
        elif state is S.FINALIZING:
            moved = finalize(step)  # False while cleanup is in flight
        else:  # CALLING_MODEL: the model call's result moves it on
            moved = False
        if not moved:
            return
    raise RuntimeError(f"the rules did not settle for {step.record.trajectory_id}")  # a rule bug


def _deadline_passed(step: Step) -> bool:
    """Forward work is over: the deadline, less the finalization reserve that funds the way out, passed."""
    forward = step.forward_deadline
    return forward is not None and step.now >= forward


def _deadline_detail(step: Step) -> str:
    if step.record.deadline is not None and step.now < step.record.deadline:
        return "trajectory deadline: entered the finalization reserve"
    return "trajectory deadline passed"


def _ready(step: Step) -> bool:
    """The turn boundary. True when the trajectory left READY."""
    if _apply_boundary_control(step):
        return True
    if _deadline_passed(step):
        _abandon_request(step, "deadline")
        enter_finalizing(step, ExitReason.DEADLINE_EXCEEDED, _deadline_detail(step))
        return True
    rec = step.record
    if rec.turn_request is not None or rec.timer_of(TimerKind.BACKOFF) is not None:
        return False  # waiting for admission, or a backoff
    if _assess_budget(step):
        return True
    held = supervise.at_boundary(step)  # issue 12: holds, turn-level watchdogs, degradation triggers
    if held is not None:
        return held
    if step.record.refusals > step.policy.max_refusals:
        enter_finalizing(step, ExitReason.REFUSED, "the model refused repeatedly")
        return True
    return _request_turn(step)


def _abandon_request(step: Step, reason: str) -> None:
    if step.record.turn_request is not None:
        step.emit(TurnAbandoned(step.record.turn_request.request_id, reason))
    step.disarm(step.record.timer_of(TimerKind.BACKOFF))


def _apply_boundary_control(step: Step) -> bool:
    """Apply pending requests in arrival order. True when the trajectory left READY."""
    for req in list(step.record.pending_control):
        action = req.action
        if action in (ControlAction.KILL, ControlAction.CANCEL):
            reason = ExitReason.KILLED if action is ControlAction.KILL else ExitReason.CANCELED
            step.emit(ControlApplied(req.message_id))
            _abandon_request(step, f"{action.value} requested")
            verb = "killed" if action is ControlAction.KILL else "cancelled"
            enter_finalizing(step, reason, f"{verb} by {req.issuer}: {req.reason}")
            return True
        if action is ControlAction.PAUSE:
            step.emit(ControlApplied(req.message_id))
            _abandon_request(step, "paused")
            step.emit(StateChanged(S.READY, S.PAUSED, f"paused by {req.issuer}: {req.reason}"))
            _arm_hibernation(step)
            return True
        if action is ControlAction.INTERRUPT:
            text = req.payload.get("message") if isinstance(req.payload, Mapping) else None
            step.emit(ObservationAppended(ObservationKind.USER, str(text or req.reason)))
            step.emit(ControlApplied(req.message_id))
        elif action in (ControlAction.APPROVE, ControlAction.DENY):
            detail = "no call awaits approval"
            step.emit(ControlApplied(req.message_id, refused="NOTHING_HELD", detail=detail))
        else:  # resume while not paused: nothing to do
            step.emit(ControlApplied(req.message_id))
    return False


def _arm_hibernation(step: Step) -> None:
    idle = step.policy.idle_hibernate_s
    if idle is not None and step.record.timer_of(TimerKind.HIBERNATE) is None:
        step.arm(TimerKind.HIBERNATE, step.now + idle)


def _paused(step: Step) -> bool:
    """PAUSED: resume is immediate; kill and cancel finalize; the deadline still ends it."""
    for req in list(step.record.pending_control):
        if req.action is ControlAction.RESUME:
            step.emit(ControlApplied(req.message_id))
            step.disarm(step.record.timer_of(TimerKind.HIBERNATE))
            step.emit(StateChanged(S.PAUSED, S.READY, f"resumed by {req.issuer}"))
            return True
        if req.action in (ControlAction.KILL, ControlAction.CANCEL):
            reason = ExitReason.KILLED if req.action is ControlAction.KILL else ExitReason.CANCELED
            step.emit(ControlApplied(req.message_id))
            enter_finalizing(step, reason, f"{req.action.value} by {req.issuer}: {req.reason}")
            return True
    if _deadline_passed(step):
        enter_finalizing(step, ExitReason.DEADLINE_EXCEEDED, _deadline_detail(step) + " while paused")
        return True
    _arm_hibernation(step)
    return False


def _waiting_tool(step: Step) -> bool:
    """WAITING_TOOL: kill and cancel stop waiting (calls in flight are cancelled at their endpoints and left
    in doubt; nothing queued is sent); pause withdraws what is not sent yet and lets the rest finish."""
    stop = step.pending(*STOPS)
    if stop is not None and stop.action in (ControlAction.KILL, ControlAction.CANCEL):
        abandon_calls(step, "killed" if stop.action is ControlAction.KILL else "cancelled")
    elif stop is not None:
        for q in list(step.record.queued.values()):
            body = {"status": "REFUSED", "reason": "DEFERRED", "message": "A pause request is pending."}
            withdraw(step, q.call_id, "not sent: pause requested", body)
    if _deadline_passed(step) and (step.record.pending_calls or step.record.queued):
        abandon_calls(step, "trajectory deadline passed")
    if _deadline_passed(step) or (stop is not None and stop.action is not ControlAction.PAUSE):
        children.cascade(step, False, "the parent stopped waiting")  # issue 12: cancel reaches children
    rec = step.record
    if not rec.pending_calls and not rec.queued and not children.waiting(step):  # issue 12: children
        step.emit(StateChanged(S.WAITING_TOOL, S.READY, "tool calls settled"))
        return True
    return False


# --------------------------------------------------------------------------- budget and the next turn


def _assess_budget(step: Step) -> bool:
    """Meter wall-clock time, assess the budget, act on the stage. True when the trajectory halts."""
    rec = step.record
    # time spent awaiting a person is charged to the request's expiry, not to the compute budget
    elapsed = max(rec.spend.get(Dimension.WALL_SECONDS), step.now - rec.created_at - rec.excluded_wait_s)
    step.emit(WallClockMeasured(elapsed))
    rec = step.record
    a = assess(rec.ceilings, rec.spend, step.policy.thresholds)
    if a.stage is not rec.budget_stage or abs(a.rho - rec.rho) > 1e-9:
        step.emit(BudgetStageChanged(a.stage, a.rho, a.binding_dimension))
        if a.stage is BudgetStage.STEER and rec.budget_stage is BudgetStage.NOMINAL:
            left = a.remaining.get(a.binding_dimension, 0.0)
            step.emit(
                ObservationAppended(
                    ObservationKind.NOTICE,
                    f"Budget notice: {a.rho:.0%} of the {a.binding_dimension} budget is used "
                    f"({left:g} left). Wrap up: prefer finishing over exploring.",
                )
            )
    rec = step.record
    if a.stage is BudgetStage.RESTRICT and not rec.grants.read_only:
        # restrict is a guarantee, not a request: the grant itself narrows to read-only tools
        step.emit(GrantNarrowed(rec.grants.tools, True, False, "budget restrict stage"))
        step.emit(
            ObservationAppended(
                ObservationKind.NOTICE,
                "Budget restricted: only read-only tools remain. Produce your final result now.",
            )
        )
    if a.stage is BudgetStage.HALT:
        enter_finalizing(
            step, ExitReason.BUDGET_EXCEEDED, f"budget exhausted on {a.binding_dimension} (rho={a.rho:.3f})"
        )
        return True
    return False


def _affordable_max_tokens(step: Step, prompt_estimate: int) -> int | None:
    """The output ceiling for the next call, clamped so the call cannot overrun tokens or dollars (the
    finalization reserve's dollars are not forward work's to spend). None when not even a minimal reply
    fits."""
    rec, prices = step.record, step.policy.prices
    ceiling = rec.limits.max_output_tokens
    if Dimension.TOKENS in rec.ceilings:
        left_tokens = int(rec.ceilings[Dimension.TOKENS] - rec.spend.get(Dimension.TOKENS))
        ceiling = min(ceiling, left_tokens - prompt_estimate)
    if Dimension.DOLLARS in rec.ceilings:
        left = step.policy.reserve.forward_dollars(rec.ceilings, rec.spend)
        left -= prompt_estimate * prices.uncached_input_per_million / 1e6
        if prices.output_per_million > 0:
            ceiling = min(ceiling, int(left * 1e6 / prices.output_per_million))
    return ceiling if ceiling >= min(16, rec.limits.max_output_tokens) else None


def _tools_and_messages(step: Step) -> tuple[list[dict[str, Any]], list[dict[str, Any]], int]:
    """The tools and messages of the next call, and its plain prompt estimate (``estimate_tokens`` of both).
    A turn asks twice (at the request and at the grant) and each turn extends the last: both are cached
    in ``runtime.context`` and the registry, so a turn costs what it added to the transcript."""
    rec = step.record
    registry = step.policy.registry
    granted = sorted(t for t in rec.grants.tools if rec.grants.allows(t) and t in registry)
    tools = registry.openai_tool_specs(granted)
    messages, chars = context_of(rec.transcript, step.policy.system_prompt)
    prompt = estimate_from_chars(chars + registry.spec_chars(granted), len(messages))
    return tools, messages, prompt


def _request_turn(step: Step) -> bool:
    _, _, basis = _tools_and_messages(step)
    prompt = anchored_estimate(basis, step.record.prompt_anchor)
    max_tokens = _affordable_max_tokens(step, prompt)
    if max_tokens is None:
        if step.policy.reserve.dollars > 0 and supervise.reserve_reached(step):
            return True  # issue 12: reaching the reserve is a degradation trigger, not a plain halt
        halt_unfundable(step)
        return True
    rec = step.record
    request_id = step.new_id("turn")
    step.emit(TurnRequested(request_id, prompt + max_tokens, max_tokens, prompt, basis))
    forward = step.forward_deadline
    queue_until = forward if forward is not None else step.now + _NO_DEADLINE_QUEUE_S
    request = TurnRequest(
        rec.trajectory_id, rec.priority_class, step.policy.provider_key, prompt + max_tokens, queue_until
    )
    step.do(RequestAdmission(request_id, request))
    return False


def _backoff(step: Step, retry_after: float | None) -> None:
    """Capped exponential backoff with full jitter before the next turn; Retry-After is a floor."""
    policy = step.policy
    exponent = max(0, step.record.model_failures - 1)
    ceiling = min(policy.model_backoff_cap_s, policy.model_backoff_base_s * 2.0**exponent)
    delay = max(step.uniform("model-backoff") * ceiling, retry_after or 0.0)
    step.arm(TimerKind.BACKOFF, step.now + delay)


# --------------------------------------------------------------------------- admission


def on_admission_granted(step: Step, inp: AdmissionGranted) -> None:
    rec = step.record
    request = rec.turn_request
    grant = inp.grant
    if rec.state is not S.READY or request is None or request.request_id != inp.request_id:
        step.do(SettleAdmission(grant.grant_id, 0))  # nobody wants it any more: give the tokens back
        return
    call_deadline = step.now + rec.limits.call_deadline_s
    forward = step.forward_deadline
    if forward is not None:
        call_deadline = min(call_deadline, forward)
    if call_deadline <= step.now:
        step.do(SettleAdmission(grant.grant_id, 0))
        step.emit(TurnAbandoned(request.request_id, "the deadline passed while the turn queued"))
        enter_finalizing(step, ExitReason.DEADLINE_EXCEEDED, "deadline passed while waiting for admission")
        return
    step.emit(TurnStarted(rec.turn_count + 1))
    step.emit(StateChanged(S.READY, S.CALLING_MODEL, "admitted"))
    step.emit(
        ModelCallIntent(
            grant.grant_id,
            rec.limits.model,
            request.max_tokens,
            call_deadline,
            request.prompt_tokens,
            request.prompt_basis,
        )
    )
    tools, messages, _ = _tools_and_messages(step)
    model_request = ModelRequest(
        trajectory_id=rec.trajectory_id,
        model=rec.limits.model,
        messages=messages,
        max_tokens=request.max_tokens,
        deadline=call_deadline,
        tools=tools,
        metadata=dict(step.policy.metadata),
    )
    step.do(CallModel(grant.grant_id, model_request))


def on_admission_denied(step: Step, inp: AdmissionDenied) -> None:
    request = step.record.turn_request
    if step.record.state is not S.READY or request is None or request.request_id != inp.request_id:
        return
    step.emit(TurnAbandoned(request.request_id, f"not admitted: {inp.predicate}"))
    text = f"turn not admitted: {inp.predicate}: {inp.message}"
    step.emit(ObservationAppended(ObservationKind.ERROR, text))
    if inp.predicate == "deadline":
        enter_finalizing(step, ExitReason.DEADLINE_EXCEEDED, f"admission refused: {inp.message}")
    elif inp.predicate == "exceeds_capacity":
        # waiting can never help: this turn is larger than the provider limit itself
        enter_finalizing(step, ExitReason.ERROR, f"admission refused: {inp.message}")
    else:
        _backoff(step, inp.retry_after)


# --------------------------------------------------------------------------- the model call


def _current_call(step: Step, grant_id: str) -> bool:
    call = step.record.model_call
    return (
        step.record.state is S.CALLING_MODEL
        and call is not None
        and call.outcome is None
        and call.grant_id == grant_id
    )


def on_model_replied(step: Step, inp: ModelReplied) -> None:
    if not _current_call(step, inp.grant_id):
        return  # a reply nobody awaits (the call was already charged on recovery): nothing to do
    reply = inp.reply
    step.do(SettleAdmission(inp.grant_id, reply.usage.total))
    if reply.rate_limit is not None and not reply.rate_limit.empty:
        step.do(ReportLimits(step.policy.provider_key, reply.rate_limit, False, inp.grant_id))
    cost = step.policy.prices.cost(reply.usage)
    step.emit(ModelCallSettled(reply.stop_reason, reply.usage, cost, usage_estimated=reply.usage_estimated))
    _after_reply(step, reply)


def _after_reply(step: Step, reply: ModelReply) -> None:
    """Branch on the stop reason (harness chapter, "Control Actions": where each reply leaves us)."""
    stop = reply.stop_reason
    if stop is StopReason.END_TURN:
        step.emit(ObservationAppended(ObservationKind.ASSISTANT, reply.text))
        # issue 12: on the assisted rung an end of turn is a plan for a person, not a completion claim
        enter_finalizing(step, supervise.completion_exit(step), "the model ended its turn")
        return
    if stop is StopReason.MAX_TOKENS:
        # quarantine: a truncated reply is never parsed into calls, whatever it contains
        step.emit(ObservationAppended(ObservationKind.ASSISTANT, reply.text))
        step.emit(
            ObservationAppended(
                ObservationKind.NOTICE,
                "Your reply hit the output-token ceiling and was discarded unexecuted. "
                "Make smaller steps or shorter arguments.",
            )
        )
        step.emit(StateChanged(S.CALLING_MODEL, S.READY, "truncated reply"))
        return
    if stop is StopReason.REFUSAL or not reply.tool_calls:
        step.emit(ObservationAppended(ObservationKind.ASSISTANT, reply.text))
        step.emit(StateChanged(S.CALLING_MODEL, S.READY, f"reply without calls ({stop.value})"))
        return
    step.emit(ObservationAppended(ObservationKind.ASSISTANT, reply.text, tool_calls=tuple(reply.tool_calls)))
    route(step, tuple(reply.tool_calls))


def on_model_failed(step: Step, inp: ModelFailed) -> None:
    if not _current_call(step, inp.grant_id):
        return
    usage = inp.usage if isinstance(inp.usage, Usage) else Usage()
    step.do(SettleAdmission(inp.grant_id, usage.total))
    if inp.rate_limited or (inp.rate_limit is not None and not inp.rate_limit.empty):
        info = inp.rate_limit or RateLimitInfo(retry_after_s=inp.retry_after)
        step.do(ReportLimits(step.policy.provider_key, info, inp.rate_limited, inp.grant_id))
    cost = step.policy.prices.cost(usage)
    step.emit(ModelCallFailed(inp.error, inp.retryable, usage, cost, rate_limited=inp.rate_limited))
    if inp.rate_limited:
        # admission feedback: the scheduler now knows; the turn was given back and no failure counted
        step.emit(StateChanged(S.CALLING_MODEL, S.READY, "rate limited by the provider: re-admitting"))
        _backoff(step, inp.retry_after)
        return
    failures = step.record.model_failures
    if not inp.retryable or failures >= step.policy.max_consecutive_model_failures:
        step.emit(StateChanged(S.CALLING_MODEL, S.READY, "model call failed"))
        enter_finalizing(step, ExitReason.MODEL_ERROR, f"model calls failed: {inp.error}")
        return
    step.emit(StateChanged(S.CALLING_MODEL, S.READY, "model call failed: retrying"))
    _backoff(step, inp.retry_after)


def on_model_cancelled(step: Step, inp: ModelCancelled) -> None:
    if not _current_call(step, inp.grant_id):
        return
    step.do(SettleAdmission(inp.grant_id, inp.usage.total))
    step.emit(ModelCallCancelled(inp.reason, inp.usage, step.policy.prices.cost(inp.usage)))
    step.emit(StateChanged(S.CALLING_MODEL, S.READY, f"model call aborted: {inp.reason}"))


# --------------------------------------------------------------------------- control messages


def on_control(step: Step, inp: ControlReceived) -> None:
    """A verified message is recorded durably (the relay acknowledges it only then) and applied at the next
    turn boundary; kill acts at once, and a pending stop aborts a streaming model call. An operator's
    settle or handoff acts on what the trajectory owes, at once and in any state."""
    if inp.action in ANY_STATE_ACTIONS:
        operator_act(step, inp)
        return
    if supervise.on_control(step, inp):  # issue 12: hold, release, acknowledge; resume under a hold
        return
    rec = step.record
    payload: dict[str, JsonValue] = dict(inp.payload)
    if inp.signer_roles:
        payload["signer_roles"] = {name: sorted(roles) for name, roles in inp.signer_roles.items()}
    recorded = decisions.on_control(rec, inp.message_id, inp.action, inp.issuer, inp.reason, payload)
    if recorded is None:
        step.reply = "duplicate"  # delivery is at-least-once: idempotent by message id
        return
    step.emit(recorded)
    if isinstance(recorded, ControlRejected):
        step.reply = "rejected"  # terminal states are absorbing: audited only
        return
    step.reply = "recorded"
    if inp.action in STOPS and _current_call(step, rec.model_call.grant_id if rec.model_call else ""):
        step.do(CancelModelStream(inp.action.value))  # streaming cancellation
    if inp.action is ControlAction.KILL:
        step.do(KillProcesses(f"killed by {inp.issuer}"))


def on_control_refused(step: Step, inp: ControlRefused) -> None:
    """Audit a message the shell refused. An unverified refusal never spends its id (verify before dedupe)."""
    if inp.message_id in step.record.seen_control_ids:
        step.reply = "duplicate"
        return
    step.emit(ControlRejected(inp.message_id, inp.reason, inp.detail[:500]))
    step.reply = "rejected"


def hibernate_due(step: Step) -> None:
    """The idle timer fired: a trajectory still waiting for a person may let its actor go."""
    if step.record.state in (S.PAUSED, S.AWAITING_APPROVAL) and not step.record.pending_control:
        step.do(Hibernate(f"idle in {step.record.state.value}"))


def deadline_due(step: Step) -> None:
    """The trajectory's absolute deadline fired: in every live state, hibernated ones included (the timer
    store wakes them), the trajectory ends DEADLINE_EXCEEDED with its cleanup."""
    rec = step.record
    grant = rec.model_call.grant_id if rec.model_call else ""
    if rec.state is S.CALLING_MODEL and _current_call(step, grant):
        step.do(CancelModelStream("deadline"))  # the aborted call brings it back to READY, which ends it
    elif rec.state is S.WAITING_TOOL:
        abandon_calls(step, "trajectory deadline passed")
