"""Cleanup that always runs (recovery chapter §12.3, §12.5.4; reliability guide §8.3).

Registration: a call whose contract declares a compensation registers its obligation in the same durable
batch as its first intent (before dispatch). Binding: correlated evidence of the forward effect (a reply, a
late reply, a probe, an operator) binds the template, or discharges it when the effect is established
absent; an unknown outcome binds nothing and guesses nothing.

FINALIZING (every exit): calls in flight were cancelled and probed (``abandon_calls``); once their answers
are in (or the hard deadline passes), the cleanup graph unwinds: each bound obligation whose predecessors
are settled is admitted (guard and sandbox permits, like any call, under the cleanup grant: no model call),
recorded (intent), then sent; its reply is verified (a probe of the endpoint's record, or the declared
postcondition in the reply) before the obligation is discharged; unknown outcomes retry under the
compensation's repeat contract; what cannot be discharged stays on record with its evidence and is handed
off with the packet. A completed task keeps what it did, except temporary resources (``on_completion``).

Operators: ``tether settle`` and ``tether handoff`` arrive as signed control messages and act on
operations and obligations in any state, terminal included (liability outlives the loop).
"""

from __future__ import annotations

from runtime._decide_commit import commit_pivot
from runtime._step import Step
from runtime.effects import AcquirePermit, DispatchTool, ProbeTool, ReleasePermit
from runtime.events import (
    CleanupDispatched,
    CleanupSettled,
    ControlRejected,
    HandoffWritten,
    ObligationBound,
    ObligationRegistered,
    ObligationUpdated,
    OperationMarkedInDoubt,
    OperationSettled,
    OperatorActed,
)
from runtime.fingerprint import effect_key
from runtime.handoff import build_handoff, needs_handoff
from runtime.inputs import ControlReceived, PermitGranted, PermitRefused, ProbeAnswered, ToolOutcomeReceived
from runtime.obligations import (
    OPEN_STATES,
    Obligation,
    ObligationState,
    blocked_by,
    postcondition_holds,
    ready_to_unwind,
    resource_key,
)
from runtime.ports import OutcomeClass, Settlement, ToolInvocation
from runtime.record import ControlAction, JsonValue, TimerKind
from runtime.retry import RetryAction, decide_retry
from runtime.states import ExitReason, TrajectoryState
from runtime.tools import CompensationUnbound, ToolContract

__all__ = [
    "CLEANUP_PREFIX",
    "cleanup_retry_due",
    "finish_cleanup",
    "is_cleanup",
    "on_cleanup_outcome",
    "on_cleanup_permit",
    "on_cleanup_permit_refused",
    "on_cleanup_probe",
    "on_forward_settled",
    "operator_act",
    "register",
    "unwind",
]

S = TrajectoryState
OB = ObligationState
CLEANUP_PREFIX = "cleanup:"


def obligation_id_for(operation_id: str) -> str:
    return f"obl-{operation_id}"


def is_cleanup(call_id: str) -> bool:
    return call_id.startswith(CLEANUP_PREFIX)


def _by_call(step: Step, call_id: str) -> Obligation | None:
    return step.record.obligations.get(call_id[len(CLEANUP_PREFIX) :]) if is_cleanup(call_id) else None


def _update(step: Step, ob: Obligation, state: ObligationState, evidence: str, **kw: object) -> None:
    step.emit(ObligationUpdated(ob.obligation_id, state, evidence, **kw))  # type: ignore[arg-type]


# --------------------------------------------------------------------------- registration and binding


def register(step: Step, contract: ToolContract, operation_id: str, arguments: dict[str, JsonValue]) -> None:
    """The cleanup template, in the same batch as the forward call's first intent (before dispatch)."""
    comp = contract.compensation
    if comp is None or obligation_id_for(operation_id) in step.record.obligations:
        return
    try:
        known = comp.template(arguments)
    except CompensationUnbound:
        known = {}
    step.emit(
        ObligationRegistered(
            obligation_id_for(operation_id),
            operation_id,
            contract.name,
            comp.tool,
            known,
            tuple(comp.from_result),
            comp.after,
            comp.on_completion,
            dict(comp.postcondition),
            at=step.now,
        )
    )


def on_forward_settled(
    step: Step, operation_id: str, settlement: Settlement, result: object, evidence: str
) -> None:
    """Correlated evidence about a forward effect binds (or discharges) its obligation; an established
    pivot commits its region and stages its duties in the same batch."""
    if settlement is Settlement.ESTABLISHED and operation_id in step.record.operations:
        commit_pivot(step, step.record.operations[operation_id], result)
    ob = step.record.obligations.get(obligation_id_for(operation_id))
    if (
        ob is None
        or ob.state not in (OB.PLANNED, OB.STUCK, OB.HANDED_OFF)
        or (ob.unbound == () and ob.resource)
    ):
        return
    if settlement is Settlement.ESTABLISHED_ABSENT:
        # Before FINALIZING an attempt known absent may be followed by a retry of the same operation
        # (probe-then-retry), which can still create the resource: the obligation stays planned, and
        # FINALIZING discharges it if the operation is still absent then (a chaos run left 4 environments
        # billed when the retry after an absent probe created them and the obligation was already discharged).
        if ob.state is OB.STUCK or (ob.state is OB.PLANNED and step.record.state is S.FINALIZING):
            _update(step, ob, OB.DISCHARGED, f"the forward effect was established absent ({evidence})")
        return
    if settlement is not Settlement.ESTABLISHED:
        return
    contract = step.policy.registry.get(ob.forward_tool) if ob.forward_tool in step.policy.registry else None
    op = step.record.operations[operation_id]
    if contract is None or contract.compensation is None:
        return
    try:
        args = contract.compensation.bind(dict(op.arguments), result if isinstance(result, dict) else {})
    except CompensationUnbound as e:
        _update(step, ob, OB.STUCK, f"established, but its result cannot bind the compensation: {e}")
        return
    step.emit(ObligationBound(ob.obligation_id, args, resource_key(ob.tool, args), f"bound by {evidence}"))


# --------------------------------------------------------------------------- FINALIZING


def unwind(step: Step) -> bool:
    """Carry the cleanup graph as far as it goes. True when nothing more can happen (terminal may follow)."""
    rec = step.record
    deadline_passed = rec.deadline is not None and step.now >= rec.deadline
    completed = rec.exit_reason is ExitReason.COMPLETED and rec.check_passed is True
    for ob in sorted(rec.obligations.values(), key=lambda o: o.obligation_id):
        op = step.record.operations.get(ob.operation_id)
        if ob.state is OB.PLANNED:
            if op is not None and op.settlement is Settlement.ESTABLISHED_ABSENT:
                _update(step, ob, OB.DISCHARGED, "the forward effect was established absent")
            elif ob.request_id is not None and not deadline_passed:
                continue  # a probe after the cancel may still bind it
            elif op is not None and op.settlement is Settlement.ESTABLISHED:
                _update(step, ob, OB.STUCK, "established, but nothing bound its target")
            elif op is not None and not deadline_passed and _may_probe_forward(step, ob):
                _probe_forward(step, ob, op.effect_key)
            else:
                _update(
                    step, ob, OB.STUCK, "the forward outcome is unknown: nothing to bind, nothing guessed"
                )
        elif ob.state is OB.BOUND and completed and not ob.on_completion:
            _update(step, ob, OB.COMMITTED, "kept: the task completed and this effect is its result")
    _merge_shared(step)
    if not deadline_passed:
        for ob in ready_to_unwind(step.record.obligations):
            if ob.request_id is None:
                _admit(step, ob)
    obligations = list(step.record.obligations.values())
    for ob in obligations:
        if ob.state is OB.BOUND and ob.request_id is None:
            stuck = [b for b in blocked_by(ob, obligations) if b.state is OB.STUCK]
            if stuck:
                _update(step, ob, OB.STUCK, f"blocked: {stuck[0].obligation_id} did not complete")
    waiting = [
        o
        for o in step.record.obligations.values()
        if o.state in (OB.ADMITTING, OB.RUNNING, OB.VERIFYING)
        or (o.state in (OB.PLANNED, OB.BOUND) and o.request_id is not None)
        or (o.state is OB.BOUND and blocked_by(o, list(step.record.obligations.values())))
    ]
    if waiting and not deadline_passed:
        return False
    for ob in waiting:
        _update(step, ob, OB.STUCK, "the trajectory's deadline passed before this cleanup finished")
    return True


# A forward effect whose outcome is still unknown when the trajectory ends (its reply lost and the probes
# of the time refused or unanswered: a breaker open, a guard restarting) is asked about again before its
# obligation is given up: an answer binds the compensation (the environment is released, not orphaned).
_FORWARD_PROBE = "probing the forward outcome before cleanup"
_FORWARD_UNANSWERED = "the forward probe was not answered by its deadline"
FORWARD_PROBE_ASKS = 3


def _may_probe_forward(step: Step, ob: Obligation) -> bool:
    if ob.forward_tool not in step.policy.registry or not step.policy.registry.get(ob.forward_tool).probe:
        return False
    return sum(1 for e in ob.evidence if e.startswith(_FORWARD_PROBE)) < FORWARD_PROBE_ASKS


def _probe_forward(step: Step, ob: Obligation, key: str) -> None:
    request_id = step.new_id("probe")
    asked = 1 + sum(1 for e in ob.evidence if e.startswith(_FORWARD_PROBE))
    _update(step, ob, OB.PLANNED, f"{_FORWARD_PROBE} (ask {asked})", request_id=request_id)
    deadline = step.now + step.policy.probe_timeout_s
    step.do(ProbeTool(ob.operation_id, ob.forward_tool, key, deadline, request_id))
    step.disarm(step.record.timer_of(TimerKind.CALL_DEADLINE, ob.call_id))
    step.arm(TimerKind.CALL_DEADLINE, deadline + VERIFY_GRACE_S, subject=ob.call_id)


def _forward_still_unknown(step: Step, ob: Obligation, detail: str) -> None:
    """The forward probe left the outcome unknown: ask again after a pause while asks remain (the pause
    lets a breaker close or a guard come back), else leave it to ``unwind``, which gives it up (stuck)."""
    if _may_probe_forward(step, ob):
        asked = sum(1 for e in ob.evidence if e.startswith(_FORWARD_PROBE))
        delay = 2.0 * asked
        timer = step.arm(TimerKind.RETRY, step.now + delay, subject=ob.call_id)
        _update(step, ob, OB.PLANNED, f"{detail}; asking again in {delay:.0f}s", request_id=timer.timer_id)
    else:
        _update(step, ob, OB.PLANNED, detail)


def _merge_shared(step: Step) -> None:
    """Two bound obligations on one resource (branch scope): the later one follows the first, so the
    resource is released once, when nothing left in the trajectory needs it."""
    first: dict[str, Obligation] = {}
    for ob in sorted(step.record.obligations.values(), key=lambda o: o.obligation_id):
        if ob.resource is None or ob.state is not OB.BOUND:
            continue
        holder = first.setdefault(ob.resource, ob)
        if holder is not ob:
            _update(step, ob, OB.DISCHARGED, f"same resource as {holder.obligation_id}: released once, by it")


def _admit(step: Step, ob: Obligation) -> None:
    contract = step.policy.registry.get(ob.tool)
    request_id = step.new_id("cleanup-permit")
    _update(
        step, ob, OB.ADMITTING, "admitting the compensation under the cleanup grant", request_id=request_id
    )
    deadline = (
        step.record.deadline if step.record.deadline is not None else step.now + step.policy.tool_timeout_s
    )
    step.do(
        AcquirePermit(
            ob.call_id,
            request_id,
            contract.dependency_scope,
            contract.sandbox_pool,
            step.record.priority_class,
            deadline,
        )
    )


def readmit(step: Step) -> None:
    """After a restart: a compensation that was waiting for its permits asks for them again. The request
    died with the lost incarnation, and unlike every other cleanup wait (a dispatched release, a
    verification, a pause before asking again) it has no timer that would bring it back (chaos: releases
    left waiting until the trajectory's deadline, then handed off with the environment still billed)."""
    for ob in list(step.record.obligations.values()):
        if ob.state is OB.ADMITTING:
            _admit(step, ob)


def on_cleanup_permit(step: Step, inp: PermitGranted) -> None:
    ob = _by_call(step, inp.call_id)
    if (
        ob is None
        or ob.state is not OB.ADMITTING
        or ob.request_id != inp.request_id
        or step.record.state is not S.FINALIZING
    ):
        step.do(ReleasePermit(inp.guard, inp.sandbox, None))
        return
    rec = step.record
    operation_id = f"cop-{ob.obligation_id}"
    existing = rec.operations.get(operation_id)
    attempt = (existing.attempts if existing is not None else 0) + 1
    key = (
        existing.effect_key
        if existing is not None
        else effect_key(rec.trajectory_id, 0, ob.tool, {**ob.arguments, "_obligation": ob.obligation_id})
    )
    deadline = step.now + step.policy.tool_timeout_s
    if rec.deadline is not None:
        deadline = min(deadline, max(rec.deadline, step.now))
    attempt_id = f"{operation_id}#a{attempt}"
    step.emit(
        CleanupDispatched(
            ob.obligation_id,
            operation_id,
            attempt_id,
            key,
            ob.tool,
            dict(ob.arguments),  # type: ignore[arg-type]
            deadline,
            inp.guard,
            inp.sandbox,
        )
    )
    step.arm(TimerKind.CALL_DEADLINE, deadline, subject=ob.call_id)
    invocation = ToolInvocation(
        rec.trajectory_id, ob.call_id, ob.tool, dict(ob.arguments), key, operation_id, attempt_id, deadline
    )
    step.do(DispatchTool(invocation, inp.guard, inp.sandbox))


# A compensation refused its permits (the dependency's breaker open, its bulkhead full, its guard actor
# restarting) asks again after a backoff, this many times, before it is stuck and handed off: a refusal
# says "not now", and the cleanup is owed all the same (the trajectory's deadline still bounds the wait).
_NOT_ADMITTED = "the compensation was not admitted"
ADMISSION_ASKS = 10
ADMISSION_BACKOFF_S = (0.5, 15.0)


def on_cleanup_permit_refused(step: Step, inp: PermitRefused) -> None:
    ob = _by_call(step, inp.call_id)
    if ob is None or ob.state is not OB.ADMITTING or ob.request_id != inp.request_id:
        return
    refused = 1 + sum(1 for e in ob.evidence if e.startswith(_NOT_ADMITTED))
    detail = f"{_NOT_ADMITTED}: {inp.reason}: {inp.message}"
    if refused >= ADMISSION_ASKS:
        _update(step, ob, OB.STUCK, f"{detail} ({refused} times)")
        return
    base, cap = ADMISSION_BACKOFF_S
    backoff = min(cap, base * 2 ** (refused - 1)) * (0.5 + step.uniform(f"cleanup-admit:{ob.obligation_id}"))
    delay = max(inp.retry_after or 0.0, backoff)
    timer = step.arm(TimerKind.RETRY, step.now + delay, subject=ob.call_id)
    _update(step, ob, OB.BOUND, f"{detail}; asking again in {delay:.1f}s", request_id=timer.timer_id)


def on_cleanup_outcome(step: Step, inp: ToolOutcomeReceived) -> None:
    if inp.guard is not None or inp.sandbox is not None:
        step.do(ReleasePermit(inp.guard, inp.sandbox, inp.outcome.outcome_class if inp.dispatched else None))
    ob = _by_call(step, inp.call_id)
    if ob is None or ob.cleanup_operation is None:
        return
    op = step.record.operations[ob.cleanup_operation]
    outcome = inp.outcome
    if ob.state is not OB.RUNNING or op.last_attempt_id != inp.attempt_id:
        return  # a late reply of an attempt already timed out or superseded: its operation was decided
    step.emit(
        CleanupSettled(
            ob.obligation_id, outcome.settlement, outcome.outcome_class, outcome.result, outcome.error
        )
    )
    step.disarm(step.record.timer_of(TimerKind.CALL_DEADLINE, ob.call_id))
    _after_attempt(
        step,
        ob,
        outcome.settlement,
        outcome.outcome_class,
        outcome.result,
        outcome.error,
        outcome.retry_after,
    )


def _after_attempt(
    step: Step,
    ob: Obligation,
    settlement: Settlement,
    outcome_class: OutcomeClass,
    result: object,
    error: str | None,
    retry_after: float | None,
) -> None:
    contract = step.policy.registry.get(ob.tool)
    op = step.record.operations[ob.cleanup_operation or ""]
    if settlement is Settlement.ESTABLISHED and outcome_class is OutcomeClass.SUCCESS:
        if contract.probe:
            _verify(step, ob, op.effect_key)
        elif ob.postcondition and postcondition_holds(ob.postcondition, result):
            _update(step, ob, OB.DISCHARGED, f"postcondition {dict(ob.postcondition)} holds in the reply")
        else:
            _update(step, ob, OB.STUCK, "the compensation returned, but nothing verifies its postcondition")
        return
    decision = decide_retry(
        contract=contract.repeat,
        policy=step.policy.cleanup_retry,
        attempts_used=op.attempts,
        settlement=settlement,
        outcome_class=outcome_class,
        retry_after=retry_after,
        non_retryable=False,
        now=step.now,
        deadline=step.record.deadline if step.record.deadline is not None else step.now + 600.0,
        u=step.uniform(f"cleanup:{ob.obligation_id}:{op.attempts}"),
    )
    detail = error or settlement.value
    if decision.action is RetryAction.RETRY:
        timer = step.arm(TimerKind.RETRY, step.now + decision.delay_s, subject=ob.call_id)
        _update(
            step,
            ob,
            OB.BOUND,
            f"attempt {op.attempts} failed ({detail}); retrying",
            request_id=timer.timer_id,
        )
    elif decision.action is RetryAction.PROBE and contract.probe:
        _verify(step, ob, op.effect_key)
    elif settlement is Settlement.UNKNOWN and contract.probe:
        # the attempts are spent and none was answered: the endpoint's record may still show one applied
        _update(step, ob, OB.RUNNING, f"attempt {op.attempts} failed ({detail}); no attempts left")
        _verify(step, ob, op.effect_key)
    else:
        _update(step, ob, OB.STUCK, f"the compensation did not complete: {detail} ({decision.reason})")


# A verification probe that never answers (its answer lost with the task that awaited it) is asked again
# this many times, then the obligation is stuck and handed off: FINALIZING never waits on it for good.
_UNANSWERED = "the verification was not answered by its deadline"
_VERIFYING = "verifying the postcondition with the endpoint"
_INCONCLUSIVE = "verification inconclusive"
VERIFY_ASKS = 3
VERIFY_GRACE_S = 5.0


def _verify(step: Step, ob: Obligation, key: str) -> None:
    request_id = step.new_id("verify")
    _update(step, ob, OB.VERIFYING, _VERIFYING, request_id=request_id)
    deadline = step.now + step.policy.probe_timeout_s
    step.do(ProbeTool(ob.cleanup_operation or "", ob.tool, key, deadline, request_id))
    # the probe carries its deadline on the wire; this timer covers an answer that never comes back
    step.disarm(step.record.timer_of(TimerKind.CALL_DEADLINE, ob.call_id))
    step.arm(TimerKind.CALL_DEADLINE, deadline + VERIFY_GRACE_S, subject=ob.call_id)


def cleanup_timed_out(step: Step, call_id: str) -> None:
    """A compensation's deadline passed without a reply: a timeout settles nothing, so the retry rule
    decides as for an unknown outcome. A verification left unanswered is asked again, a bounded number of
    times, then the obligation is stuck (handed off with its evidence)."""
    ob = _by_call(step, call_id)
    if ob is None:
        return
    if ob.state is OB.PLANNED and ob.request_id is not None:
        _forward_still_unknown(step, ob, _FORWARD_UNANSWERED)
        return
    if ob.state is OB.VERIFYING:
        asked = 1 + sum(1 for e in ob.evidence if e == _UNANSWERED)
        if asked >= VERIFY_ASKS:
            _update(step, ob, OB.STUCK, f"{_UNANSWERED} ({asked} times): nothing verifies the compensation")
            return
        _update(step, ob, OB.VERIFYING, _UNANSWERED)
        op = step.record.operations[ob.cleanup_operation or ""]
        _verify(step, ob, op.effect_key)
        return
    if ob.state is not OB.RUNNING:
        return
    _after_attempt(step, ob, Settlement.UNKNOWN, OutcomeClass.INFRASTRUCTURE_FAILURE, None, "timed out", None)


def cleanup_retry_due(step: Step, call_id: str) -> None:
    ob = _by_call(step, call_id)
    if ob is not None and ob.state is OB.BOUND and ob.request_id is not None:
        _update(step, ob, OB.BOUND, "backoff over: the compensation is admitted again")
    elif ob is not None and ob.state is OB.PLANNED and ob.request_id is not None:
        _update(step, ob, OB.PLANNED, "pause over: the forward outcome is asked about again")
    elif ob is not None and ob.state is OB.VERIFYING and ob.evidence[-1].startswith(_INCONCLUSIVE):
        op = step.record.operations[ob.cleanup_operation or ""]
        _verify(step, ob, op.effect_key)


def on_cleanup_probe(step: Step, inp: ProbeAnswered) -> bool:
    """A probe that answers an obligation: a verification of its compensation, or the binding probe of a
    forward call cancelled on the way out. True when it was one of those."""
    for ob in step.record.obligations.values():
        if ob.request_id is None or ob.request_id != inp.request_id:
            continue
        result = inp.result
        if ob.state is OB.VERIFYING:
            step.disarm(step.record.timer_of(TimerKind.CALL_DEADLINE, ob.call_id))
            if result.settlement is Settlement.ESTABLISHED and postcondition_holds(
                ob.postcondition, result.result
            ):
                _update(
                    step,
                    ob,
                    OB.DISCHARGED,
                    f"verified by the endpoint's record: {result.detail or 'established'}",
                )
            elif result.settlement is Settlement.ESTABLISHED:
                _update(
                    step,
                    ob,
                    OB.STUCK,
                    f"the endpoint shows the compensation, not its postcondition: {result.result}",
                )
            elif result.settlement is Settlement.ESTABLISHED_ABSENT:
                op = step.record.operations[ob.cleanup_operation or ""]
                step.emit(
                    CleanupSettled(
                        ob.obligation_id, Settlement.ESTABLISHED_ABSENT, OutcomeClass.INFRASTRUCTURE_FAILURE
                    )
                )
                _after_attempt(
                    step,
                    ob,
                    Settlement.ESTABLISHED_ABSENT,
                    OutcomeClass.INFRASTRUCTURE_FAILURE,
                    None,
                    f"the endpoint has no record of attempt {op.attempts}",
                    None,
                )
            else:
                # the endpoint could not say (its probe failed, or was not sent in time on a busy node):
                # asked again after a pause, a bounded number of times, before the obligation is stuck
                detail = f"{_INCONCLUSIVE}: {result.detail or 'unknown'}"
                asked = sum(1 for e in ob.evidence if e == _VERIFYING)
                if asked < VERIFY_ASKS:
                    delay = 2.0 * asked
                    timer = step.arm(TimerKind.RETRY, step.now + delay, subject=ob.call_id)
                    note = f"{detail}; asking again in {delay:.0f}s"
                    _update(step, ob, OB.VERIFYING, note, request_id=timer.timer_id)
                else:
                    _update(step, ob, OB.STUCK, f"{detail} ({asked} times)")
            return True
        if ob.state is OB.PLANNED:
            step.disarm(step.record.timer_of(TimerKind.CALL_DEADLINE, ob.call_id))
            if result.settlement is Settlement.UNKNOWN:
                _forward_still_unknown(step, ob, f"probe answered: unknown ({result.detail or 'no detail'})")
                return False
            step.emit(ObligationUpdated(ob.obligation_id, OB.PLANNED, f"probe answered: {result.settlement}"))
            return False  # the operation settles through the ordinary probe path, which binds it
    return False


def finish_cleanup(step: Step) -> None:
    """The last act before the terminal state: the packet for anything but a clean completion, and what is
    still owed handed off to its owner with it (never dropped)."""
    rec = step.record
    owner = step.policy.escalation_owner
    if needs_handoff(rec) and rec.handoff is None:
        step.emit(HandoffWritten(build_handoff(rec, step.now, owner)))
    for ob in list(step.record.obligations.values()):
        if ob.state in OPEN_STATES:
            _update(step, ob, OB.HANDED_OFF, f"handed off to {owner} with the packet", owner=owner)
    for op in list(step.record.operations.values()):
        if (
            not op.settled
            and op.owner in (None, rec.trajectory_id)
            and not any(p.operation_id == op.operation_id for p in step.record.pending_calls.values())
        ):
            step.emit(OperationMarkedInDoubt(op.operation_id, "handed off with the packet", owner))


# --------------------------------------------------------------------------- operators


def operator_act(step: Step, inp: ControlReceived) -> None:
    """``tether settle`` / ``tether handoff``: applied at once, in any state (terminal included)."""
    rec = step.record
    if inp.message_id in rec.seen_control_ids:
        step.reply = "duplicate"
        return
    payload = inp.payload
    target = str(payload.get("target") or "")
    text = str(payload.get("evidence") or inp.reason or "")
    if inp.action is ControlAction.HANDOFF:
        to = str(payload.get("to") or inp.issuer)
        step.emit(
            OperatorActed(
                inp.message_id, inp.action, inp.issuer, rec.trajectory_id, f"custody to {to}: {text}"
            )
        )
        for ob in list(step.record.obligations.values()):
            if ob.state in OPEN_STATES or ob.state is OB.HANDED_OFF:
                _update(step, ob, OB.HANDED_OFF, f"custody transferred to {to} by {inp.issuer}", owner=to)
        for op in list(step.record.operations.values()):
            awaited = any(p.operation_id == op.operation_id for p in step.record.pending_calls.values())
            if not op.settled and not awaited:
                step.emit(OperationMarkedInDoubt(op.operation_id, f"custody transferred by {inp.issuer}", to))
        step.reply = "recorded"
        return
    settlement = str(payload.get("settlement") or "")
    target_ob = rec.obligations.get(target)
    target_op = rec.operations.get(target)
    awaited = target_op is not None and any(
        p.operation_id == target_op.operation_id for p in rec.pending_calls.values()
    )
    if (
        target_ob is not None
        and (target_ob.state in OPEN_STATES or target_ob.state is OB.HANDED_OFF)
        and settlement == "established"
    ):
        step.emit(OperatorActed(inp.message_id, inp.action, inp.issuer, target, text))
        _update(
            step,
            target_ob,
            OB.DISCHARGED,
            f"accepted by {inp.issuer} without verified evidence: {text}",
            owner=inp.issuer,
            accepted_risk=True,
        )
        step.reply = "recorded"
        return
    if (
        target_op is not None
        and not target_op.settled
        and not awaited
        and settlement in ("established", "absent")
    ):
        value = Settlement.ESTABLISHED if settlement == "established" else Settlement.ESTABLISHED_ABSENT
        step.emit(OperatorActed(inp.message_id, inp.action, inp.issuer, target, text))
        step.emit(
            OperationSettled(
                target_op.operation_id, value, f"operator {inp.issuer}: {text}", by_operator=True
            )
        )
        on_forward_settled(step, target_op.operation_id, value, None, f"operator {inp.issuer}")
        step.reply = "recorded"
        return
    why = "still awaited" if awaited else "no open operation or obligation by that id, or no settlement given"
    step.emit(ControlRejected(inp.message_id, "UNKNOWN_TARGET", f"{target!r}: {why}", verified=True))
    step.reply = "rejected"
