"""Handlers for supervision's events (issue 12): the hold flag, the watchdog ladder and the turn-level
progress window, escalations, incidents, the degradation rung, and children.

Rules they guard: a hold is replaced only by a stronger one (incident > control > watchdog) and lifted only
as it was placed (an incident's hold by releasing its incidents); the ladder counts each detector's firings
one by one; the rung only moves down; an escalation is opened once, taken into custody by a verified signer
and resolved once; a child's allocation is charged to its parent when it is spawned and replaced by what
the child really spent when it settles (so the parent's spend always covers its live children).
"""

from __future__ import annotations

from collections.abc import Mapping

from runtime._handlers_common import Handler, appended, refuse, require_state, with_item
from runtime._replace import replace
from runtime.delegation import PARTITIONED
from runtime.escalation import Escalation, EscalationStatus, EscalationTrigger
from runtime.events import (
    CallWithheld,
    ChildCancelled,
    ChildSettled,
    ChildSpawned,
    EscalationAcknowledged,
    EscalationOpened,
    EscalationResolved,
    HoldPlaced,
    HoldReleased,
    IncidentOpened,
    ProgressObserved,
    RungChanged,
    WatchdogFired,
)
from runtime.incident import Hold, HoldKind
from runtime.record import TrajectoryRecord
from runtime.states import TrajectoryState
from runtime.supervision import ChildState, SupervisionPolicy
from runtime.watchdog import WatchdogState, WatchdogStep

S = TrajectoryState


def _policy(rec: TrajectoryRecord) -> SupervisionPolicy:
    return rec.policy.supervision if rec.policy is not None else SupervisionPolicy()


def _sup(rec: TrajectoryRecord, **changes: object) -> TrajectoryRecord:
    return replace(rec, supervision=replace(rec.supervision, **changes))


# --------------------------------------------------------------------------- the hold


def _hold_placed(rec: TrajectoryRecord, ev: HoldPlaced) -> TrajectoryRecord:
    current = rec.hold
    ids = (ev.incident_id,) if ev.incident_id else ()
    if current is not None:
        if current.kind.precedence > ev.hold_kind.precedence:
            refuse(rec, ev, "weaker_hold", f"already held by {current.kind}: a weaker hold cannot replace it")
        if current.kind is ev.hold_kind and ev.hold_kind is HoldKind.INCIDENT:
            if ev.incident_id in current.incident_ids:
                refuse(rec, ev, "already_held", f"incident {ev.incident_id!r} already holds it")
            ids = (*current.incident_ids, *ids)
    hold = Hold(
        kind=ev.hold_kind,
        reason=ev.reason,
        since=ev.at,
        issuer=ev.issuer,
        incident_ids=ids,
        escalation_id=ev.escalation_id,
        guard=ev.guard,
        expires_at=ev.expires_at,
    )
    return replace(rec, hold=hold)


def _hold_released(rec: TrajectoryRecord, ev: HoldReleased) -> TrajectoryRecord:
    hold = rec.hold
    if hold is None or hold.kind is not ev.hold_kind:
        refuse(rec, ev, "not_held", f"no {ev.hold_kind} hold to release")
    if hold.kind is HoldKind.INCIDENT:
        if ev.incident_id not in hold.incident_ids:
            refuse(rec, ev, "wrong_incident", f"incident {ev.incident_id!r} does not hold it")
        left = tuple(i for i in hold.incident_ids if i != ev.incident_id)
        if left:
            return replace(rec, hold=replace(hold, incident_ids=left))
    if hold.kind is HoldKind.WATCHDOG:
        # a resumed trajectory starts a fresh window: the evidence stays in the log and the escalation
        sup = replace(rec.supervision, ladder={}, progress=rec.supervision.progress.reset(), constrained={})
        return replace(rec, hold=None, watchdog=rec.watchdog.reset(), supervision=sup)
    return replace(rec, hold=None)


# --------------------------------------------------------------------------- the watchdog ladder


def _watchdog_fired(rec: TrajectoryRecord, ev: WatchdogFired) -> TrajectoryRecord:
    fired = rec.supervision.ladder.get(ev.guard, 0)
    if ev.count != fired + 1:
        refuse(rec, ev, "ladder_out_of_order", f"{ev.guard} has fired {fired} time(s); next is {fired + 1}")
    constrained = rec.supervision.constrained
    removed = ev.evidence.get("removed")
    if ev.rung == "constrain" and isinstance(removed, list | tuple):
        constrained = {**constrained, **{str(t): ev.guard for t in removed}}
    return _sup(rec, ladder={**rec.supervision.ladder, ev.guard: ev.count}, constrained=constrained)


def _progress_observed(rec: TrajectoryRecord, ev: ProgressObserved) -> TrajectoryRecord:
    sup = rec.supervision
    if ev.turn <= sup.progress_turn:
        refuse(rec, ev, "turn_already_observed", f"turn {ev.turn} was observed")
    window = WatchdogState(_policy(rec).progress_watch, sup.progress.history, sup.progress.steps_seen)
    window, _ = window.observe(WatchdogStep(None, None, ev.digest, ev.waiting_on_job))
    return _sup(rec, progress=window, progress_turn=ev.turn, results_seen=ev.results_seen)


def _call_withheld(rec: TrajectoryRecord, ev: CallWithheld) -> TrajectoryRecord:
    note = f"{ev.tool} ({ev.call_id}): withheld by {ev.by}"
    return _sup(rec, withheld=(*rec.supervision.withheld, note))


# --------------------------------------------------------------------------- escalations, incidents


def _escalation(rec: TrajectoryRecord, ev: EscalationAcknowledged | EscalationResolved) -> Escalation:
    esc = rec.supervision.escalations.get(ev.escalation_id)
    if esc is None:
        refuse(rec, ev, "unknown_escalation", f"no escalation {ev.escalation_id!r}")
    return esc


def _escalation_opened(rec: TrajectoryRecord, ev: EscalationOpened) -> TrajectoryRecord:
    if ev.escalation_id in rec.supervision.escalations:
        refuse(rec, ev, "escalation_exists", f"escalation {ev.escalation_id!r} is already open")
    try:
        trigger = EscalationTrigger(ev.trigger)
    except ValueError:
        refuse(rec, ev, "unknown_trigger", f"{ev.trigger!r} is not an escalation trigger")
    esc = Escalation(
        escalation_id=ev.escalation_id,
        trajectory_id=rec.trajectory_id,
        trigger=trigger,
        summary=ev.summary,
        owner=ev.owner,
        opened_at=ev.opened_at,
        due_at=ev.due_at,
        evidence=ev.evidence,
        handoff=ev.handoff,
    )
    return _sup(rec, escalations=with_item(rec.supervision.escalations, ev.escalation_id, esc))


def _escalation_acknowledged(rec: TrajectoryRecord, ev: EscalationAcknowledged) -> TrajectoryRecord:
    esc = _escalation(rec, ev)
    first = esc.acknowledged_at if esc.acknowledged_at is not None else ev.at
    status = esc.status if esc.status is EscalationStatus.RESOLVED else EscalationStatus.ACKNOWLEDGED
    esc = replace(esc, status=status, custodian=ev.custodian, acknowledged_at=first)
    return _sup(rec, escalations=with_item(rec.supervision.escalations, esc.escalation_id, esc))


def _escalation_resolved(rec: TrajectoryRecord, ev: EscalationResolved) -> TrajectoryRecord:
    esc = _escalation(rec, ev)
    if esc.status is EscalationStatus.RESOLVED:
        refuse(rec, ev, "already_resolved", f"escalation {ev.escalation_id!r} is resolved")
    esc = replace(esc, status=EscalationStatus.RESOLVED, resolution=ev.resolution)
    return _sup(rec, escalations=with_item(rec.supervision.escalations, esc.escalation_id, esc))


def _incident_opened(rec: TrajectoryRecord, ev: IncidentOpened) -> TrajectoryRecord:
    if ev.incident_id in rec.supervision.incidents:
        refuse(rec, ev, "incident_exists", f"incident {ev.incident_id!r} is already recorded")
    return _sup(rec, incidents=(*rec.supervision.incidents, ev.incident_id))


# --------------------------------------------------------------------------- degradation


def _rung_changed(rec: TrajectoryRecord, ev: RungChanged) -> TrajectoryRecord:
    current = rec.supervision.rung
    if ev.rung.level <= current.level:
        refuse(rec, ev, "rung_only_descends", f"on {current}; a trigger moves only down the ladder")
    answer = ev.detail if ev.rung.value == "deterministic" else rec.supervision.answer
    return _sup(rec, rung=ev.rung, rung_turn=rec.turn_count, answer=answer)


# --------------------------------------------------------------------------- children


def _partitioned(amounts: Mapping[str, float]) -> dict[str, float]:
    return {d: a for d, a in amounts.items() if d in PARTITIONED}


def _child_spawned(rec: TrajectoryRecord, ev: ChildSpawned) -> TrajectoryRecord:
    require_state(rec, ev, S.WAITING_TOOL)
    if ev.child_id in rec.supervision.children:
        refuse(rec, ev, "child_exists", f"child {ev.child_id!r} was already spawned")
    if rec.deadline is not None and ev.deadline > rec.deadline:
        refuse(rec, ev, "deadline_beyond_trajectory", "a child's deadline is within its parent's")
    spend = rec.spend
    for dim, amount in _partitioned(ev.allocation).items():
        spend = spend.with_value(dim, spend.get(dim) + amount)  # reserved: the parent cannot spend it
    child = ChildState(ev.child_id, ev.call_id, ev.goal, dict(ev.allocation), deadline=ev.deadline)
    children = with_item(rec.supervision.children, ev.child_id, child)
    return replace(rec, spend=spend, supervision=replace(rec.supervision, children=children))


def _child(rec: TrajectoryRecord, ev: ChildSettled | ChildCancelled) -> ChildState:
    child = rec.supervision.children.get(ev.child_id)
    if child is None:
        refuse(rec, ev, "unknown_child", f"no child {ev.child_id!r}")
    return child


def _child_settled(rec: TrajectoryRecord, ev: ChildSettled) -> TrajectoryRecord:
    child = _child(rec, ev)
    if child.status == "settled":
        refuse(rec, ev, "child_settled", f"child {ev.child_id!r} already settled")
    spend = rec.spend
    allocated = _partitioned(child.allocation)
    for dim in sorted(set(allocated) | set(_partitioned(ev.spent))):
        # the allocation held in reserve gives way to what the child really spent (overshoot included)
        value = spend.get(dim) - allocated.get(dim, 0.0) + ev.spent.get(dim, 0.0)
        spend = spend.with_value(dim, max(0.0, value))
    child = replace(child, status="settled", verified=ev.verified, spent=dict(ev.spent))
    children = with_item(rec.supervision.children, ev.child_id, child)
    return replace(
        rec,
        spend=spend,
        supervision=replace(rec.supervision, children=children),
        transcript=appended(rec.transcript, ev),
    )


def _child_cancelled(rec: TrajectoryRecord, ev: ChildCancelled) -> TrajectoryRecord:
    child = _child(rec, ev)
    if not child.live:
        refuse(rec, ev, "child_not_running", f"child {ev.child_id!r} is {child.status}")
    children = with_item(rec.supervision.children, ev.child_id, replace(child, status="cancelled"))
    return replace(
        rec, supervision=replace(rec.supervision, children=children), transcript=appended(rec.transcript, ev)
    )


HANDLERS: Mapping[type, Handler] = {
    HoldPlaced: _hold_placed,
    HoldReleased: _hold_released,
    WatchdogFired: _watchdog_fired,
    ProgressObserved: _progress_observed,
    CallWithheld: _call_withheld,
    EscalationOpened: _escalation_opened,
    EscalationAcknowledged: _escalation_acknowledged,
    EscalationResolved: _escalation_resolved,
    IncidentOpened: _incident_opened,
    RungChanged: _rung_changed,
    ChildSpawned: _child_spawned,
    ChildSettled: _child_settled,
    ChildCancelled: _child_cancelled,
}
"""Supervision's rules, by event type, for ``runtime.fold.apply``."""
