"""Supervision's rules (issue 12): the watchdog ladder, the one hold flag, incidents, the degradation ladder
and escalations. Called from the decider's existing rules at a few marked points:

- ``screen`` (``runtime._decide_tools.route``, every proposed call): disclosure rules withhold a call and
  open an incident; a fired call-level detector (exact repetition, trivial variation) climbs its ladder;
- ``at_boundary`` (``runtime._decide_turn._ready``, the turn boundary): the turn-level detectors over the
  declared task state (cycle, stagnation), the degradation triggers (restrict stage, finalization
  reserve, the constrained rung's smaller budget), and the hold itself (READY withholds admission; a
  control or incident hold steps into PAUSED);
- ``on_control`` (``runtime._decide_turn.on_control``, on arrival): hold, release, acknowledge, a resume
  under a hold, and the cascade of cancel and kill to children;
- ``on_dependency_refused`` (``runtime._decide_dispatch.on_permit_refused``): a breaker open degrades;
- ``completion_exit`` (``runtime._decide_turn._after_reply``): an end of turn on the assisted rung is a plan
  for a person, not a completion claim;
- ``after_decision`` (``runtime.decider.decide``, after every input): the escalation triggers found in the
  decision's events, and publishing every escalation that was opened, taken into custody or resolved.

The ladder (reliability guide §4.4, recovery chapter §12.6.3): a detector's first firing informs (the
repeated call is withheld with a factual observation: the admission gate enforces the feedback), the
second constrains (the grant narrows: the looping tool goes, or only read-only tools remain), the third
holds (no new model-directed work; an escalation carries the detector's evidence). Only a policy ends a
held trajectory (``OnHold.END``, or ``hold_timeout_s``), FAILED with the detector's own exit reason: a loop
is not an ERROR.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from runtime._decide_finalize import enter_finalizing, withdraw
from runtime._step import Step
from runtime.budget import BudgetStage
from runtime.degradation import DegradeTrigger, Rung
from runtime.effects import CancelModelStream, OpenIncident, PublishEscalation
from runtime.escalation import EscalationStatus, EscalationTrigger, handoff_packet
from runtime.events import (
    ApprovalDecided,
    CallWithheld,
    CompletionChecked,
    ControlApplied,
    ControlRequested,
    EscalationAcknowledged,
    EscalationOpened,
    EscalationResolved,
    GrantNarrowed,
    HandoffWritten,
    HoldPlaced,
    HoldReleased,
    IncidentOpened,
    ObservationAppended,
    ObservationKind,
    OperationSettled,
    ProgressObserved,
    RungChanged,
    StateChanged,
    ToolCallHeld,
    ToolResultAccepted,
    TurnAbandoned,
)
from runtime.incident import HoldKind, cleanup_tools, find_disclosure, member_metadata
from runtime.inputs import ControlReceived
from runtime.ports import Settlement, ToolCallProposal
from runtime.progress import turn_progress
from runtime.record import ApprovalDecision, ControlAction, QueueStage, TimerKind
from runtime.states import TERMINAL_STATES, ExitReason, TrajectoryState
from runtime.supervision import LadderRung, OnHold, SupervisionPolicy, guard_of, json_safe
from runtime.watchdog import Guard, WatchdogFinding, inspect

__all__ = [
    "Screen",
    "after_decision",
    "at_boundary",
    "completion_exit",
    "narrow",
    "on_control",
    "on_dependency_refused",
    "open_escalation",
    "reserve_reached",
    "screen",
    "waiting_on_job",
]

S = TrajectoryState

_EXIT_FOR_GUARD: Mapping[Guard, ExitReason] = {
    Guard.EXACT_REPEAT: ExitReason.REPEATED_ACTION,
    Guard.TRIVIAL_VARIATION: ExitReason.REPEATED_ACTION,
    Guard.CYCLE: ExitReason.CYCLING,
    Guard.STAGNATION: ExitReason.STAGNATED,
}
_ERROR_CODE = re.compile(r"^([A-Z][A-Z0-9_]*):")


def _policy(step: Step) -> SupervisionPolicy:
    return step.policy.supervision


class Screen:
    """What ``screen`` decided for one proposed call."""

    PASS = "pass"  # route it as usual
    WITHHELD = "withheld"  # refused before dispatch; the reply's other calls go on
    STOP = "stop"  # the reply's routing ends here (held, or ended): the state has already moved


# --------------------------------------------------------------------------- escalations


def open_escalation(step: Step, trigger: EscalationTrigger, summary: str, evidence: Mapping[str, Any]) -> str:
    """Open an escalation with the route's owner and SLA and the handoff packet; returns its id."""
    rec = step.record
    routes = _policy(step).escalations
    route = routes.route(trigger)
    # a trigger the workload routed nowhere goes to the trajectory's escalation owner (issue 11's handoff)
    owner = route.owner if trigger in routes.routes else step.policy.escalation_owner
    escalation_id = f"esc-{rec.trajectory_id}-{rec.log_position}"
    packet = handoff_packet(rec, trigger, summary, evidence, now=step.now, owner=owner)
    step.emit(
        EscalationOpened(
            escalation_id,
            trigger.value,
            summary[:500],
            owner,
            step.now,
            step.now + route.sla_s,
            json_safe(evidence),
            json_safe(packet),
        )
    )
    return escalation_id


def _already_escalated(step: Step, trigger: EscalationTrigger, key: str) -> bool:
    escalations = step.record.supervision.escalations.values()
    return any(e.trigger is trigger and e.evidence.get("key") == key for e in escalations)


def _resolve(step: Step, escalation_id: str | None, resolution: str) -> None:
    esc = step.record.supervision.escalations.get(escalation_id or "")
    if esc is not None and esc.status is not EscalationStatus.RESOLVED:
        step.emit(EscalationResolved(esc.escalation_id, resolution))


# --------------------------------------------------------------------------- grants


def narrow(step: Step, tools: frozenset[str], read_only: bool, reason: str) -> None:
    """Narrow the grant, keeping whatever registered cleanup needs, and withdraw every queued call the
    narrower grant no longer allows (a queued call is model-directed work not yet sent)."""
    rec = step.record
    keep = cleanup_tools(rec) & rec.grants.tools
    tools = (tools | keep) & rec.grants.tools
    read_only = read_only or rec.grants.read_only
    if tools == rec.grants.tools and read_only == rec.grants.read_only:
        return
    if read_only and keep - rec.grants.read_only_tools:
        read_only = rec.grants.read_only  # a read-only grant would strand cleanup: narrow the tool set only
    step.emit(GrantNarrowed(tools, read_only, rec.grants.subagents_allowed and not read_only, reason))
    for q in list(step.record.queued.values()):
        # a probe is recovery, not model-directed work: it goes on (its answer settles the operation)
        if q.stage is not QueueStage.PROBING and not step.record.grants.allows(q.tool):
            body = {"status": "REFUSED", "reason": "NOT_GRANTED", "message": f"Not sent: {reason}."}
            withdraw(step, q.call_id, f"grant narrowed: {reason}", body)


# --------------------------------------------------------------------------- holds


def _place_hold(
    step: Step,
    kind: HoldKind,
    reason: str,
    issuer: str,
    *,
    incident_id: str | None = None,
    escalation_id: str | None = None,
    guard: str | None = None,
) -> None:
    """Set the hold flag and withdraw eligibility from work in progress (§12.8.1): a streaming reply is
    aborted (never parsed), queued calls are withdrawn, a call held for approval is refused. Calls
    already dispatched finish: their results settle their operations, which is no release decision."""
    rec = step.record
    expires = None
    ladder = _policy(step).ladder
    if kind is HoldKind.WATCHDOG and ladder.hold_timeout_s is not None:
        expires = step.now + ladder.hold_timeout_s
    step.emit(HoldPlaced(kind, reason, issuer, step.now, incident_id, escalation_id, guard, expires))
    if expires is not None:
        step.arm(TimerKind.HOLD_EXPIRY, expires, subject=kind.value)
    if rec.state is S.CALLING_MODEL and rec.model_call is not None and rec.model_call.outcome is None:
        step.do(CancelModelStream(f"{kind.value} hold"))
    elif rec.state is S.WAITING_TOOL:
        for q in list(rec.queued.values()):
            if q.stage is QueueStage.PROBING:
                continue  # result recovery of an earlier attempt goes on: it settles, it sends nothing new
            body = {"status": "REFUSED", "reason": "HELD", "message": f"Not sent: {reason}."}
            withdraw(step, q.call_id, f"not sent: {kind.value} hold", body)
    elif rec.state is S.AWAITING_APPROVAL and rec.held is not None:
        held = rec.held
        step.emit(ApprovalDecided(held.digest, ApprovalDecision.DENIED, (), f"{kind.value}_hold", step.now))
        body = {"status": "REFUSED", "reason": "HELD", "message": f"The held call was withdrawn: {reason}."}
        step.emit(ObservationAppended(ObservationKind.REFUSAL, json.dumps(body), call_id=held.call_id))
        step.disarm_all((TimerKind.APPROVAL_EXPIRY, TimerKind.HIBERNATE))
        step.emit(StateChanged(S.AWAITING_APPROVAL, S.READY, f"{kind.value} hold: approval withdrawn"))
    elif rec.state is S.READY and rec.turn_request is not None:
        step.emit(TurnAbandoned(rec.turn_request.request_id, f"{kind.value} hold"))
        step.disarm(rec.timer_of(TimerKind.BACKOFF))


def _release_hold(step: Step, issuer: str, reason: str, incident_id: str | None = None) -> None:
    hold = step.record.hold
    if hold is None:
        return
    step.emit(HoldReleased(hold.kind, issuer, reason, incident_id))
    if step.record.hold is None:
        step.disarm(step.record.timer_of(TimerKind.HOLD_EXPIRY, hold.kind.value))
        _resolve(step, hold.escalation_id, f"hold released by {issuer}: {reason}")
        if hold.kind.pauses and step.record.state is S.PAUSED:
            step.disarm(step.record.timer_of(TimerKind.HIBERNATE))
            step.emit(StateChanged(S.PAUSED, S.READY, f"{hold.kind.value} hold released by {issuer}"))


# --------------------------------------------------------------------------- the watchdog ladder


def _climb(
    step: Step, guard: Guard, finding: WatchdogFinding | None, call: ToolCallProposal | None
) -> LadderRung:
    """Record one firing of ``guard`` and carry out the ladder's answer (all but the hold's state move)."""
    from runtime.events import WatchdogFired

    count = step.record.supervision.ladder.get(guard.value, 0) + 1
    rung = _policy(step).ladder.rung(count)
    detail = finding.detail if finding is not None else guard.value
    removed: list[str] = []
    if rung is LadderRung.CONSTRAIN:
        # a call-level detector takes the looping tool away; a state-level one leaves only read-only tools
        # (the writes are what oscillate). Proposing a removed tool again climbs the same ladder.
        grants = step.record.grants
        allowed = [t for t in sorted(grants.tools) if grants.allows(t)]
        if call is not None and call.tool in grants.tools:
            narrow(step, grants.tools - {call.tool}, False, f"watchdog {guard.value}: constrain")
        else:
            narrow(step, grants.tools, True, f"watchdog {guard.value}: constrain")
        removed = [t for t in allowed if not step.record.grants.allows(t)]
    evidence: dict[str, Any] = {
        "guard": guard.value,
        "firing": count,
        "rung": rung.value,
        "finding": detail,
        "steps": list(finding.step_indices) if finding is not None else [],
        "turn": step.record.turn_count,
        "removed": removed,
    }
    # the windows the detectors saw (most recent last): what a person reviewing the hold needs first
    evidence["fingerprints"] = [s.call_fingerprint for s in step.record.watchdog.history[-6:]]
    evidence["digests"] = [s.state_digest for s in step.record.supervision.progress.history[-6:]]
    if call is not None:
        evidence.update(call_id=call.call_id, tool=call.tool, arguments=call.raw_arguments[:500])
    step.emit(WatchdogFired(guard.value, rung.value, count, detail, call.call_id if call else None, evidence))
    if rung is LadderRung.INFORM and call is not None:
        note = (
            f"Watchdog ({guard.value}): {detail}. The call {call.tool}({call.raw_arguments[:120]}) was not "
            "run again: without changed preconditions its result will not change. Formulate a different "
            "approach before proposing it again."
        )
    elif rung is LadderRung.INFORM:
        note = (
            f"Watchdog ({guard.value}): {detail}. The declared task state has not advanced: formulate a "
            "different hypothesis before the next change."
        )
    elif rung is LadderRung.CONSTRAIN:
        gone = ", ".join(removed) or "nothing more"
        note = f"Watchdog ({guard.value}): {detail}. No longer available to you: {gone}."
    else:
        note = f"Watchdog ({guard.value}): {detail}. Work is on hold until a person reviews it."
    if call is not None:
        body = {"status": "REFUSED", "reason": "WATCHDOG", "guard": guard.value, "rung": rung.value}
        body["message"] = note
        step.emit(ObservationAppended(ObservationKind.REFUSAL, json.dumps(body), call_id=call.call_id))
        step.emit(CallWithheld(call.call_id, call.tool, f"watchdog {guard.value} ({rung.value})", detail))
    else:
        step.emit(ObservationAppended(ObservationKind.NOTICE, note))
    if rung is LadderRung.HOLD:
        summary = f"watchdog {guard.value} held the trajectory: {detail}"
        escalation = open_escalation(step, EscalationTrigger.GUARD, summary, evidence)
        _place_hold(step, HoldKind.WATCHDOG, summary, "watchdog", escalation_id=escalation, guard=guard.value)
    return rung


def _finding(history: Any, config: Any, guard: Guard) -> WatchdogFinding | None:
    verdict = inspect(history, config)
    return next((f for f in verdict.findings if f.guard is guard), None)


def screen(step: Step, p: ToolCallProposal, args: Mapping[str, Any] | None, fired: str | None) -> str:
    """One proposed call, already validated and shown to the watchdog (``fired``: its detector)."""
    sup = _policy(step)
    disclosed = find_disclosure(sup.disclosure, p.tool, args if args is not None else p.raw_arguments)
    if disclosed is not None:
        _disclosure(step, p, disclosed.data_class, disclosed.path)
        return Screen.STOP
    guard = guard_of(fired) if fired is not None else None
    watchdog = step.record.watchdog
    finding = _finding(watchdog.history, watchdog.config, guard) if guard is not None else None
    if guard is None:
        # the model insists on a tool a constrain rung took away: the same detector's ladder climbs on
        removed_by = guard_of(step.record.supervision.constrained.get(p.tool, ""))
        if removed_by is None or step.record.grants.allows(p.tool):
            return Screen.PASS
        guard = removed_by
        detail = f"{p.tool} proposed again after the {guard.value} watchdog took it away"
        finding = WatchdogFinding(guard, 1, (), detail)
    rung = _climb(step, guard, finding, p)
    if rung is not LadderRung.HOLD:
        return Screen.WITHHELD
    step.emit(StateChanged(S.CALLING_MODEL, S.READY, f"watchdog: {guard.value} hold"))
    if _policy(step).ladder.on_hold is OnHold.END:
        enter_finalizing(step, _EXIT_FOR_GUARD[guard], f"watchdog {guard.value}: ended by policy")
    return Screen.STOP


def _disclosure(step: Step, p: ToolCallProposal, data_class: str, path: str) -> None:
    """Suspect content induced a forbidden proposal (table 10): withheld before dispatch, the trajectory
    held, an incident opened with the pre-dispatch decision and the owners of what is still unresolved."""
    rec = step.record
    incident_id = f"inc-{rec.trajectory_id}-{rec.log_position}"
    symptom = f"a call to {p.tool} carried data of class {data_class!r} (at {path}); withheld before dispatch"
    cause = "unknown: suspect content in the context induced the proposal (to be confirmed)"
    body = {"status": "REFUSED", "reason": "DISCLOSURE", "data_class": data_class, "message": symptom}
    step.emit(ObservationAppended(ObservationKind.REFUSAL, json.dumps(body), call_id=p.call_id))
    step.emit(CallWithheld(p.call_id, p.tool, f"disclosure rule {data_class}", path))
    evidence = {
        "decision": "withheld before dispatch: no bytes of it left the host",
        "call_id": p.call_id,
        "tool": p.tool,
        "path": path,
        "data_class": data_class,
        "turn": rec.turn_count,
        "caveat": "blocking this call is no evidence that no earlier disclosure occurred",
    }
    step.emit(IncidentOpened(incident_id, symptom, cause, json_safe(evidence)))
    about = {**evidence, "incident": incident_id}
    escalation = open_escalation(step, EscalationTrigger.INCIDENT, symptom, about)
    step.emit(StateChanged(S.CALLING_MODEL, S.READY, f"incident {incident_id}: disclosure rule"))
    issuer = "policy:disclosure"
    _place_hold(step, HoldKind.INCIDENT, symptom, issuer, incident_id=incident_id, escalation_id=escalation)
    step.do(
        OpenIncident(
            incident_id,
            rec.trajectory_id,
            symptom,
            cause,
            evidence,
            json_safe(member_metadata(step.record)),
            artifacts_of(step.record),
        )
    )


def waiting_on_job(step: Step, tool: str, args: Mapping[str, Any] | None) -> bool:
    """Whether a proposed call polls a job its last identical call reported as still running (a declared
    ``waiting`` marker): legitimate repetition, exempt from the detectors (§12.6.1)."""
    rule = _policy(step).progress.tools.get(tool)
    if rule is None or not rule.waiting or args is None:
        return False
    rec = step.record
    last = None
    by_call = rec.operations_by_call()
    for ev in rec.transcript:
        if isinstance(ev, ToolResultAccepted):
            op = by_call.get(ev.call_id)
            if op is not None and op.tool == tool and dict(op.arguments) == dict(args):
                last = ev
    if last is None or not isinstance(last.result, Mapping):
        return False
    return any(last.result.get(k) in values for k, values in rule.waiting.items())


def artifacts_of(record: Any) -> tuple[str, ...]:
    """What a trajectory produced, as artifact ids a quarantine can name: every string a tool result of
    its accepted results carries under a key ending in ``_id``, and the final answer's digest."""
    out: list[str] = []
    for ev in record.transcript:
        if isinstance(ev, ToolResultAccepted) and isinstance(ev.result, Mapping):
            for k, v in ev.result.items():
                if isinstance(v, str) and k.endswith("_id") and v not in out:
                    out.append(v)
    return tuple(out)


def _observe_progress(step: Step) -> bool:
    """Once per turn, at the boundary: the declared task state's digest, and the turn-level detectors."""
    rec = step.record
    sup = rec.supervision
    if rec.turn_count <= sup.progress_turn or rec.turn_count < 1:
        return False
    spec = _policy(step).progress
    progress = turn_progress(rec, spec, sup.results_seen)
    seen = progress.results_seen
    step.emit(ProgressObserved(rec.turn_count, progress.digest, progress.waiting_on_job, seen))
    if not spec.declared or rec.hold is not None:
        return False
    window = step.record.supervision.progress
    verdict = inspect(window.history, window.config)
    for finding in verdict.findings:
        if finding.guard not in (Guard.CYCLE, Guard.STAGNATION):
            continue
        rung = _climb(step, finding.guard, finding, None)
        if rung is LadderRung.HOLD:
            if _policy(step).ladder.on_hold is OnHold.END:
                enter_finalizing(step, _EXIT_FOR_GUARD[finding.guard], f"watchdog {finding.guard}: ended")
            return True
        break
    return False


# --------------------------------------------------------------------------- degradation


def degrade(
    step: Step,
    trigger: DegradeTrigger | str,
    detail: str,
    target: Rung | None = None,
    failing: frozenset[str] = frozenset(),
) -> bool:
    """Move down the ladder on ``trigger``; True when the trajectory left its state (it ended).
    ``failing``: tools of the dependency whose breaker opened (the constrained rung does without them)."""
    ladder = _policy(step).degradation
    current = step.record.supervision.rung
    if target is None:
        if not isinstance(trigger, DegradeTrigger):
            return False
        target = ladder.target(trigger, current)
    if target is None or target.level <= current.level:
        return False
    text = ladder.deterministic_answer or "" if target is Rung.DETERMINISTIC else detail
    step.emit(RungChanged(target, str(trigger), text))
    if target is Rung.CONSTRAINED:
        narrow(step, step.record.grants.tools - failing, True, f"degraded to constrained: {detail}")
        turns = ladder.constrained_turns
        left = f" You have {turns} more turn(s)." if turns is not None else ""
        step.emit(
            ObservationAppended(
                ObservationKind.NOTICE,
                f"Degraded to the constrained rung ({detail}): only read-only tools remain.{left} "
                "Report what you could and could not do.",
            )
        )
        return False
    if target is Rung.ASSISTED:
        narrow(step, frozenset(), False, f"degraded to assisted: {detail}")
        step.emit(
            ObservationAppended(
                ObservationKind.NOTICE,
                f"Degraded to the assisted rung ({detail}): no tool will run. Write a plan a person can "
                "apply, step by step, and end your turn with it.",
            )
        )
        return False
    if step.record.state is S.CALLING_MODEL:
        return False  # the reply in flight settles first; the boundary then ends it
    return _end_degraded(step, target, str(trigger), detail)


def _end_degraded(step: Step, rung: Rung, trigger: str, detail: str) -> bool:
    """End on a degraded rung: a person is routed to the assisted plan and to an honest refusal."""
    if rung in (Rung.ASSISTED, Rung.REFUSAL):
        summary = f"degraded to {rung.value}: {detail}"
        open_escalation(step, EscalationTrigger.DEGRADED, summary, {"trigger": trigger, "rung": rung.value})
    enter_finalizing(step, ExitReason.DEGRADED, f"degraded to {rung.value}: {detail}")
    return True


def on_dependency_refused(step: Step, reason: str, message: str, tool: str) -> None:
    """A dependency's guard refused a call: a breaker open is a degradation trigger, and the constrained
    rung keeps read-only tools of the dependencies that still work (guide §9.2)."""
    if reason != "BreakerOpen" or step.record.is_terminal:
        return
    registry = step.policy.registry
    scope = registry.get(tool).dependency_scope if tool in registry else None
    failing = frozenset(
        t for t in step.record.grants.tools if t in registry and registry.get(t).dependency_scope == scope
    )
    degrade(step, DegradeTrigger.BREAKER_OPEN, message, failing=failing)


def _degradation_triggers(step: Step) -> bool:
    rec = step.record
    ladder = _policy(step).degradation
    if not ladder.enabled:
        return False
    if rec.budget_stage is BudgetStage.RESTRICT and degrade(step, DegradeTrigger.RESTRICT_STAGE, "budget"):
        return True
    reserve = step.policy.reserve
    forward = step.forward_deadline
    in_reserve = (reserve.seconds > 0 and forward is not None and step.now >= forward) or (
        reserve.dollars > 0 and reserve.forward_dollars(rec.ceilings, rec.spend) <= 0
    )
    if in_reserve and reserve_reached(step):
        return True
    rec = step.record
    turns = ladder.constrained_turns
    used = rec.turn_count - rec.supervision.rung_turn
    if rec.supervision.rung is Rung.CONSTRAINED and turns is not None and used >= turns:
        nxt = ladder.next_below(Rung.CONSTRAINED)
        if nxt in (Rung.ASSISTED,):
            return degrade(step, "constrained_budget", "the constrained rung's turns are used", nxt)
        enter_finalizing(step, ExitReason.DEGRADED, "the constrained rung's turns are used")
        return True
    return False


def reserve_reached(step: Step) -> bool:
    """Forward work reached the finalization reserve (its time, or dollars it cannot spend). No forward
    work runs in the reserve, so the result is what there is, on the rung the trigger asks for; True when
    that ended the trajectory (no ladder declared: False, and the budget's own halt applies)."""
    ladder = _policy(step).degradation
    trigger = DegradeTrigger.FINALIZATION_RESERVE
    target = ladder.target(trigger, step.record.supervision.rung)
    if target is None:
        return False
    step.emit(RungChanged(target, trigger.value, "forward work reached the finalization reserve"))
    return _end_degraded(step, target, trigger.value, "forward work reached the finalization reserve")


def completion_exit(step: Step) -> ExitReason:
    """An end of turn on the assisted rung is a plan for a person, not a completion claim: a person is
    routed to it."""
    rung = step.record.supervision.rung
    if rung.level < Rung.ASSISTED.level:
        return ExitReason.COMPLETED
    summary = "a plan for a person to apply (assisted rung)"
    open_escalation(step, EscalationTrigger.DEGRADED, summary, {"rung": rung.value})
    return ExitReason.DEGRADED


# --------------------------------------------------------------------------- the turn boundary


def at_boundary(step: Step) -> bool | None:
    """READY, after control, the deadline and the budget: True when the state moved, False when the
    trajectory waits here (held: admission withheld), None to go on to the next turn."""
    if _observe_progress(step) and step.record.state is not S.READY:
        return True
    if _degradation_triggers(step):
        return True
    rec = step.record
    if rec.state is not S.READY:
        return True
    hold = rec.hold
    if hold is None:
        return None
    if rec.turn_request is not None:
        step.emit(TurnAbandoned(rec.turn_request.request_id, f"{hold.kind.value} hold"))
    if hold.kind.pauses:
        step.emit(StateChanged(S.READY, S.PAUSED, f"{hold.kind.value} hold: {hold.reason}"[:300]))
        return True
    if hold.expires_at is not None and step.now >= hold.expires_at:
        guard = guard_of(hold.guard or "") or Guard.EXACT_REPEAT
        enter_finalizing(step, _EXIT_FOR_GUARD[guard], f"watchdog {guard.value}: held past its timeout")
        return True
    return False


# --------------------------------------------------------------------------- control on arrival


def on_control(step: Step, inp: ControlReceived) -> bool:
    """Supervision's part of a control message, on arrival. True when it handled the message entirely."""
    rec = step.record
    if inp.message_id in rec.seen_control_ids:
        return False  # the usual path answers "duplicate"
    action = inp.action
    if action is ControlAction.ACKNOWLEDGE:
        _acknowledge(step, inp)
        return True
    if rec.is_terminal:
        return False  # the usual path audits it: terminal states are absorbing
    if action in (ControlAction.HOLD, ControlAction.RELEASE):
        step.emit(ControlRequested(inp.message_id, action, inp.issuer, inp.reason, dict(inp.payload)))
        step.reply = "recorded"
        if action is ControlAction.HOLD:
            _hold(step, inp)
        else:
            _release(step, inp)
        return True
    hold = rec.hold
    if action is ControlAction.RESUME and hold is not None:
        if hold.kind is HoldKind.INCIDENT:
            step.emit(ControlRequested(inp.message_id, action, inp.issuer, inp.reason, dict(inp.payload)))
            detail = f"held by incident {', '.join(hold.incident_ids)}: release the incident"
            step.emit(ControlApplied(inp.message_id, refused="INCIDENT_HOLD", detail=detail))
            step.reply = "recorded"
            return True
        _release_hold(step, inp.issuer, inp.reason or "resumed")
        return False  # and the resume itself takes its usual way
    if action in (ControlAction.KILL, ControlAction.CANCEL):
        from runtime._decide_children import cascade

        cascade(step, action is ControlAction.KILL, f"parent {action.value}: {inp.reason}")
    return False


def _hold(step: Step, inp: ControlReceived) -> None:
    raw = inp.payload.get("incident_id")
    incident = raw if isinstance(raw, str) and raw else None
    kind = HoldKind.INCIDENT if incident else HoldKind.CONTROL
    current = step.record.hold
    if current is not None and current.kind.precedence > kind.precedence:
        step.emit(ControlApplied(inp.message_id, refused="HELD", detail=f"already held by {current.kind}"))
        return
    if incident is not None and current is not None and incident in current.incident_ids:
        step.emit(ControlApplied(inp.message_id, refused="ALREADY_HELD", detail=incident))
        return
    step.emit(ControlApplied(inp.message_id))
    reason = inp.reason or (f"incident {incident}" if incident else "held by an operator")
    _place_hold(step, kind, reason, inp.issuer, incident_id=incident)
    revoke = inp.payload.get("revoke")
    if isinstance(revoke, list | tuple) and revoke:
        tools = frozenset(str(t) for t in revoke)
        # containment never strands a registered cleanup: ``narrow`` keeps the tools cleanup needs
        narrow(step, step.record.grants.tools - tools, False, f"incident {incident}: grant revoked")


def _release(step: Step, inp: ControlReceived) -> None:
    raw = inp.payload.get("incident_id")
    incident = raw if isinstance(raw, str) and raw else None
    hold = step.record.hold
    if hold is None:
        step.emit(ControlApplied(inp.message_id, refused="NOT_HELD", detail="nothing holds it"))
        return
    if hold.kind is HoldKind.INCIDENT and incident not in hold.incident_ids:
        detail = f"held by incident {', '.join(hold.incident_ids)}; the release names {incident}"
        step.emit(ControlApplied(inp.message_id, refused="WRONG_INCIDENT", detail=detail))
        return
    step.emit(ControlApplied(inp.message_id))
    named = incident if hold.kind is HoldKind.INCIDENT else None
    _release_hold(step, inp.issuer, inp.reason or "released", named)


def _acknowledge(step: Step, inp: ControlReceived) -> None:
    """Custody of an escalation passes to the verified signer (also after the trajectory ended: liability
    outlives the loop)."""
    rec = step.record
    raw = inp.payload.get("escalation_id")
    escalation_id = raw if isinstance(raw, str) else ""
    esc = rec.supervision.escalations.get(escalation_id)
    if rec.is_terminal:
        if esc is None:
            from runtime.events import ControlRejected

            detail = escalation_id[:200]
            step.emit(ControlRejected(inp.message_id, "unknown_escalation", detail, verified=True))
            step.reply = "rejected"
            return
        if esc.custodian == inp.issuer:
            step.reply = "duplicate"
            return
        step.emit(EscalationAcknowledged(escalation_id, inp.issuer, step.now, inp.message_id))
        step.reply = "recorded"
        return
    step.emit(ControlRequested(inp.message_id, inp.action, inp.issuer, inp.reason, dict(inp.payload)))
    step.reply = "recorded"
    if esc is None:
        step.emit(ControlApplied(inp.message_id, refused="UNKNOWN_ESCALATION", detail=escalation_id[:200]))
        return
    step.emit(ControlApplied(inp.message_id))
    step.emit(EscalationAcknowledged(escalation_id, inp.issuer, step.now, inp.message_id))


# --------------------------------------------------------------------------- after every decision


def after_decision(step: Step, first: int) -> None:
    """Escalation triggers among this decision's events (from index ``first``), then publish every
    escalation this decision opened, acknowledged or resolved."""
    from runtime._decide_children import cascade

    rec = step.record
    if rec.state is S.FINALIZING or rec.is_terminal:
        cascade(step, True, f"parent {rec.state.value}")
    for event in list(step.events[first:]):
        _trigger(step, event)
    published: set[str] = set()
    for event in list(step.events[first:]):
        if isinstance(event, EscalationOpened | EscalationAcknowledged | EscalationResolved):
            if event.escalation_id in published:
                continue
            published.add(event.escalation_id)
            esc = step.record.supervision.escalations.get(event.escalation_id)
            if esc is not None:
                step.do(PublishEscalation(esc))


def _trigger(step: Step, event: object) -> None:
    rec = step.record
    if isinstance(event, ToolCallHeld):
        open_escalation(
            step,
            EscalationTrigger.APPROVAL_REQUEST,
            f"{event.tool} needs approval",
            {"key": event.digest, "digest": event.digest, "tool": event.tool, "expires_at": event.expires_at},
        )
    elif isinstance(event, ApprovalDecided):
        for esc in rec.supervision.open_escalations():
            approval = esc.trigger is EscalationTrigger.APPROVAL_REQUEST
            if approval and esc.evidence.get("digest") == event.digest:
                step.emit(EscalationResolved(esc.escalation_id, f"approval {event.decision.value}"))
    elif isinstance(event, CompletionChecked) and not event.passed:
        open_escalation(
            step,
            EscalationTrigger.VERIFICATION,
            f"the completion check {event.check!r} rejected the claim: {event.detail}",
            {"key": f"completion:{event.check}", "check": event.check, "detail": event.detail},
        )
    elif isinstance(event, ToolResultAccepted) and event.error:
        _failed_result(step, event)
    elif isinstance(event, ObservationAppended) and event.observation is ObservationKind.REFUSAL:
        _unknown_tool(step, event)
    elif isinstance(event, StateChanged):
        _state_trigger(step, event)
    elif isinstance(event, HandoffWritten):
        _stuck_cleanup(step)
    elif isinstance(event, OperationSettled):
        open_now = rec.supervision.open_escalations()
        unknown = [esc for esc in open_now if esc.trigger is EscalationTrigger.UNKNOWN_OUTCOME]
        # the scan of every operation only when an unknown-outcome escalation is open to be resolved
        if unknown and all(op.settled for op in rec.operations.values()):
            for esc in unknown:
                step.emit(EscalationResolved(esc.escalation_id, "every operation settled by evidence"))


def _failed_result(step: Step, event: ToolResultAccepted) -> None:
    rec = step.record
    op = rec.operation_for_call(event.call_id)
    tool = op.tool if op is not None else "?"
    error = event.error or ""
    match = _ERROR_CODE.match(error)
    code = match.group(1) if match else None
    if code is not None and code not in _policy(step).known_error_codes:
        key = f"{tool}:{code or 'no code'}"
        if not _already_escalated(step, EscalationTrigger.NOVELTY, key):
            open_escalation(
                step,
                EscalationTrigger.NOVELTY,
                f"{tool} answered with an unknown error code: {error[:160]}",
                {"key": key, "tool": tool, "code": code, "error": error[:500]},
            )
    # the same failure the same way, repeatedly, is a verification escalation (guide §8.2)
    same = 0
    by_call = rec.operations_by_call()
    for ev in rec.transcript:
        if isinstance(ev, ToolResultAccepted) and ev.error == error:
            other = by_call.get(ev.call_id)
            same += other is not None and other.tool == tool
    key = f"{tool}:{error[:200]}"
    if same >= _policy(step).verification_repeats and not _already_escalated(
        step, EscalationTrigger.VERIFICATION, key
    ):
        open_escalation(
            step,
            EscalationTrigger.VERIFICATION,
            f"{tool} failed the same way {same} times",
            {"key": key, "tool": tool, "error": error[:500], "times": same},
        )


def _unknown_tool(step: Step, event: ObservationAppended) -> None:
    try:
        body = json.loads(event.content)
    except ValueError:
        return
    if not isinstance(body, dict) or body.get("reason") != "UNKNOWN_TOOL":
        return
    message = str(body.get("message", ""))
    key = f"unknown_tool:{message[:120]}"
    if not _already_escalated(step, EscalationTrigger.NOVELTY, key):
        open_escalation(
            step,
            EscalationTrigger.NOVELTY,
            f"the model called a tool that does not exist: {message[:160]}",
            {"key": key, "call_id": event.call_id, "message": message[:500]},
        )


def _stuck_cleanup(step: Step) -> None:
    """Cleanup handed off with the packet (issue 11): what could not be discharged needs a person."""
    from runtime.obligations import ObligationState

    owed = [
        {
            "obligation": o.obligation_id,
            "tool": o.tool,
            "state": o.state.value,
            "evidence": list(o.evidence[-3:]),
        }
        for o in step.record.obligations.values()
        if o.state in (ObligationState.HANDED_OFF, ObligationState.STUCK)
    ]
    if owed and not _already_escalated(step, EscalationTrigger.STUCK_CLEANUP, "stuck_cleanup"):
        open_escalation(
            step,
            EscalationTrigger.STUCK_CLEANUP,
            f"{len(owed)} cleanup obligation(s) could not be discharged and were handed off",
            {"key": "stuck_cleanup", "obligations": owed},
        )


def _state_trigger(step: Step, event: StateChanged) -> None:
    rec = step.record
    if event.to_state is S.FINALIZING and event.exit_reason is ExitReason.BUDGET_EXCEEDED:
        done = [op.operation_id for op in rec.operations.values() if op.settlement is Settlement.ESTABLISHED]
        if done:
            open_escalation(
                step,
                EscalationTrigger.BUDGET_EXHAUSTED,
                f"the budget ran out with usable partial work ({len(done)} operation(s) done)",
                {"key": "budget", "binding_dimension": rec.binding_dimension, "done": done},
            )
    if event.from_state is S.FINALIZING and event.to_state in TERMINAL_STATES:
        unsettled = [
            {"operation": op.operation_id, "tool": op.tool, "effect_key": op.effect_key, "owner": op.owner}
            for op in rec.operations.values()
            if not op.settled
        ]
        if unsettled:
            open_escalation(
                step,
                EscalationTrigger.UNKNOWN_OUTCOME,
                f"ended {event.to_state.value} with {len(unsettled)} operation(s) in doubt",
                {"key": "unknown_outcomes", "operations": unsettled},
            )
        for esc in rec.supervision.open_escalations():
            if esc.trigger in (EscalationTrigger.GUARD, EscalationTrigger.APPROVAL_REQUEST):
                step.emit(EscalationResolved(esc.escalation_id, f"trajectory ended {event.to_state.value}"))
