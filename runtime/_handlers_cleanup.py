"""Handlers for obligations and what settles them: registration before dispatch, binding on evidence, the
compensation's own operation, the handoff packet, and operators' decisions.

An obligation is registered once, with the forward call's intent; it binds only from correlated evidence of
the forward effect; a discharged, committed or handed-off obligation never reopens. The compensation is an
operation of its own in the operation table (``cleanup_of`` names its obligation), so its attempts, effect
key and settlement follow the same rules as any other effect.

The candidate's revisions live here too (evidence about what the trajectory produced): a revision is opened
once per operation, in order; a check's verdict is filed once, under the revision it ran on.
"""

from __future__ import annotations

from collections.abc import Mapping

from runtime._handlers_common import Handler, audit, refuse, with_item
from runtime._replace import replace
from runtime.events import (
    CandidateChecked,
    CandidateRevised,
    CleanupDispatched,
    CleanupSettled,
    Event,
    HandoffWritten,
    ObligationBound,
    ObligationRegistered,
    ObligationUpdated,
    OperatorActed,
    RepairEpisodeChanged,
)
from runtime.obligations import Obligation, ObligationState
from runtime.operations import Operation, settle
from runtime.ports import Settlement
from runtime.record import AuditKind, CheckEvidence, Revision, TrajectoryRecord
from runtime.repair import EpisodeState, RepairEpisode
from runtime.states import TrajectoryState

S = TrajectoryState
_FINAL = frozenset({ObligationState.DISCHARGED, ObligationState.COMMITTED})


def _obligation(rec: TrajectoryRecord, ev: Event, obligation_id: str) -> Obligation:
    ob = rec.obligations.get(obligation_id)
    if ob is None:
        refuse(rec, ev, "unknown_obligation", f"no obligation {obligation_id!r}")
    return ob


def _registered(rec: TrajectoryRecord, ev: ObligationRegistered) -> TrajectoryRecord:
    if ev.obligation_id in rec.obligations:
        refuse(rec, ev, "obligation_registered", f"{ev.obligation_id!r} is already registered")
    if ev.operation_id not in rec.operations:
        refuse(rec, ev, "unknown_operation", "an obligation answers for a dispatched operation")
    ob = Obligation(
        obligation_id=ev.obligation_id,
        operation_id=ev.operation_id,
        forward_tool=ev.forward_tool,
        tool=ev.tool,
        arguments=dict(ev.arguments),
        unbound=ev.unbound,
        owner=rec.trajectory_id,
        after=ev.after,
        on_completion=ev.on_completion,
        postcondition=dict(ev.postcondition),
        evidence=("registered before dispatch" if ev.duty == "compensation" else "staged in the outbox",),
        duty=ev.duty,
        registered_at=ev.at,
    )
    return replace(rec, obligations=with_item(rec.obligations, ob.obligation_id, ob))


def _bound(rec: TrajectoryRecord, ev: ObligationBound) -> TrajectoryRecord:
    ob = _obligation(rec, ev, ev.obligation_id)
    if ob.state not in (ObligationState.PLANNED, ObligationState.STUCK, ObligationState.HANDED_OFF):
        refuse(rec, ev, "already_bound", f"obligation is {ob.state}")
    state = ObligationState.BOUND if ob.state is not ObligationState.HANDED_OFF else ob.state
    ob = replace(
        ob,
        arguments=dict(ev.arguments),
        unbound=(),
        resource=ev.resource,
        state=state,
        request_id=None,
        evidence=(*ob.evidence, ev.evidence),
    )
    return replace(rec, obligations=with_item(rec.obligations, ob.obligation_id, ob))


def _updated(rec: TrajectoryRecord, ev: ObligationUpdated) -> TrajectoryRecord:
    ob = _obligation(rec, ev, ev.obligation_id)
    if ob.state in _FINAL and not ev.accepted_risk:
        refuse(rec, ev, "obligation_final", f"obligation is {ob.state}: it never reopens")
    ob = replace(
        ob,
        state=ev.state,
        owner=ev.owner or ob.owner,
        request_id=ev.request_id,
        evidence=(*ob.evidence, ev.evidence),
        accepted_risk=ob.accepted_risk or ev.accepted_risk,
    )
    return replace(rec, obligations=with_item(rec.obligations, ob.obligation_id, ob))


def _cleanup_dispatched(rec: TrajectoryRecord, ev: CleanupDispatched) -> TrajectoryRecord:
    if rec.state is not S.FINALIZING:
        refuse(rec, ev, "wrong_state", "compensations run in FINALIZING, under the cleanup grant")
    ob = _obligation(rec, ev, ev.obligation_id)
    if ob.state is not ObligationState.ADMITTING:
        refuse(rec, ev, "not_admitted", f"obligation is {ob.state}")
    if ev.tool != ob.tool or dict(ev.arguments) != dict(ob.arguments):
        refuse(rec, ev, "call_differs_from_obligation", "the cleanup grant covers exactly the bound call")
    existing = rec.operations.get(ev.operation_id)
    if existing is None:
        op = Operation(
            operation_id=ev.operation_id,
            call_id=ob.call_id,
            tool=ev.tool,
            effect_key=ev.effect_key,
            attempts=1,
            last_attempt_id=ev.attempt_id,
            arguments=dict(ev.arguments),
            cleanup_of=ob.obligation_id,
        )
    else:
        if existing.settlement is Settlement.ESTABLISHED:
            refuse(rec, ev, "settlement_before_retry", f"the compensation is {existing.settlement}")
        op = replace(
            existing,
            attempts=existing.attempts + 1,
            last_attempt_id=ev.attempt_id,
            settlement=Settlement.UNKNOWN,
            in_doubt=False,
            owner=None,
        )
    ob = replace(
        ob,
        state=ObligationState.RUNNING,
        request_id=None,
        attempts=ob.attempts + 1,
        evidence=(*ob.evidence, f"compensation attempt {op.attempts} sent ({ev.attempt_id})"),
    )
    return replace(
        rec,
        operations=with_item(rec.operations, op.operation_id, op),
        obligations=with_item(
            rec.obligations, ob.obligation_id, replace(ob, cleanup_operation=op.operation_id)
        ),
    )


def _cleanup_settled(rec: TrajectoryRecord, ev: CleanupSettled) -> TrajectoryRecord:
    ob = _obligation(rec, ev, ev.obligation_id)
    if ob.cleanup_operation is None:
        refuse(rec, ev, "nothing_dispatched", "no compensation was sent for this obligation")
    op = rec.operations[ob.cleanup_operation]
    try:
        op = settle(op, ev.settlement)
    except ValueError as exc:
        refuse(rec, ev, "settled_is_final", str(exc))
    if not op.settled:
        op = replace(op, in_doubt=True, owner=rec.trajectory_id)
    elif ev.result is not None:
        op = replace(op, result=ev.result)
    return replace(rec, operations=with_item(rec.operations, op.operation_id, op))


def _handoff(rec: TrajectoryRecord, ev: HandoffWritten) -> TrajectoryRecord:
    return replace(rec, handoff=dict(ev.packet))


def _repair(rec: TrajectoryRecord, ev: RepairEpisodeChanged) -> TrajectoryRecord:
    current = rec.repairs.get(ev.tool)
    if current is not None and current.state is EpisodeState.OPEN and current.episode_id != ev.episode_id:
        refuse(rec, ev, "episode_open", f"episode {current.episode_id!r} of {ev.tool!r} is still open")
    if current is not None and current.episode_id == ev.episode_id and ev.attempts < current.attempts:
        refuse(rec, ev, "attempts_never_decrease", "an attempt is counted at admission and stays counted")
    episode = RepairEpisode(ev.episode_id, ev.tool, ev.state, ev.attempts, ev.cap, ev.choice, ev.reason)
    return replace(rec, repairs=with_item(rec.repairs, ev.tool, episode))


def _revised(rec: TrajectoryRecord, ev: CandidateRevised) -> TrajectoryRecord:
    current = rec.revisions[-1].number if rec.revisions else 0
    if ev.revision != current + 1:
        refuse(rec, ev, "revision_order", f"the next revision is {current + 1}, not {ev.revision}")
    if any(r.operation_id == ev.operation_id for r in rec.revisions):
        refuse(rec, ev, "already_revised", f"operation {ev.operation_id!r} already opened a revision")
    given = rec.revisions or (Revision(0, None, None),)
    return replace(rec, revisions=(*given, Revision(ev.revision, ev.operation_id, ev.tool, ev.in_doubt)))


def _checked(rec: TrajectoryRecord, ev: CandidateChecked) -> TrajectoryRecord:
    revisions = rec.revisions or (Revision(0, None, None),)
    at = next((i for i, r in enumerate(revisions) if r.number == ev.revision), None)
    if at is None:
        refuse(rec, ev, "unknown_revision", f"there is no revision {ev.revision}")
    if any(c.operation_id == ev.operation_id for r in revisions for c in r.checks):
        refuse(rec, ev, "already_checked", f"operation {ev.operation_id!r} already gave its verdict")
    # evidence keeps the scope of the revision it checked: filed there, never under a later one
    checked = revisions[at]
    evidence = CheckEvidence(ev.operation_id, ev.call_id, ev.tool, ev.passed, ev.detail)
    checked = replace(checked, checks=(*checked.checks, evidence))
    return replace(rec, revisions=(*revisions[:at], checked, *revisions[at + 1 :]))


def _operator(rec: TrajectoryRecord, ev: OperatorActed) -> TrajectoryRecord:
    if ev.message_id in rec.seen_control_ids:
        refuse(rec, ev, "duplicate_message", f"message {ev.message_id!r} was already recorded")
    return replace(
        rec,
        seen_control_ids=rec.seen_control_ids | {ev.message_id},
        applied_control_ids=rec.applied_control_ids | {ev.message_id},
        audit=audit(
            rec, AuditKind.OPERATOR_ACTED, ev.target, f"{ev.action.value} by {ev.issuer}: {ev.detail}"
        ),
    )


HANDLERS: Mapping[type, Handler] = {
    ObligationRegistered: _registered,
    ObligationBound: _bound,
    ObligationUpdated: _updated,
    CleanupDispatched: _cleanup_dispatched,
    CleanupSettled: _cleanup_settled,
    HandoffWritten: _handoff,
    OperatorActed: _operator,
    RepairEpisodeChanged: _repair,
    CandidateRevised: _revised,
    CandidateChecked: _checked,
}
"""The obligation rules, by event type, for ``runtime.fold.apply``."""
