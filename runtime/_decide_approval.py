"""The approval gate (harness chapter, "Approval Gates"): escrow for irreversible calls.

A call that needs approval is held with the digest of its canonical form, an expiry (silence is denial),
the quorum of distinct signers and the roles they must cover. Approvals are verified by the control plane
and accumulate as votes on the held digest; the gate evaluates them with ``runtime.approval.explain``
(signer uniqueness, role coverage, temporal validity). Once approved, the call is re-checked (digest, grant,
budget) and queued for dispatch like any other call, carrying the approval's digest: the only way it can
be dispatched.

An approval naming another digest (stale: given for a different call) or none at all is refused and
audited and leaves the held call waiting; only an explicit deny or the expiry denies. Denial and expiry
end the same way: the call is discarded, a structured REFUSED observation goes to the model, and the
trajectory returns to READY. Time spent waiting counts against the request's expiry, not the trajectory's
compute budget (``runtime._handlers_tools``: ``excluded_wait_s``); the absolute deadline keeps running.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from runtime._decide_dispatch import queue_for_permit
from runtime._decide_finalize import enter_finalizing
from runtime._step import Step
from runtime.approval import (
    ApprovalRequest,
    ApprovalVerdict,
    ApprovalVote,
    RefusalReason,
    explain,
    recheck_before_dispatch,
    refusal_observation,
)
from runtime.budget import BudgetStage
from runtime.events import (
    ApprovalDecided,
    ApprovalRechecked,
    ApprovalVoted,
    ControlApplied,
    ObservationAppended,
    ObservationKind,
    StateChanged,
    ToolCallHeld,
)
from runtime.fingerprint import call_digest
from runtime.ports import ToolCallProposal
from runtime.record import ApprovalDecision, ControlAction, HeldCall, PendingControl, TimerKind
from runtime.states import ExitReason, TrajectoryState

__all__ = ["awaiting", "hold"]

S = TrajectoryState


def hold(
    step: Step, held: ToolCallProposal, args: Mapping[str, Any], others: Sequence[ToolCallProposal]
) -> None:
    """CALLING_MODEL -> AWAITING_APPROVAL: one call to escrow; the reply's other calls are deferred."""
    for p in others:
        reason = "another call in this reply awaits approval; propose it again afterwards"
        body = {"status": "REFUSED", "reason": "DEFERRED", "message": reason}
        step.emit(ObservationAppended(ObservationKind.REFUSAL, json.dumps(body), call_id=p.call_id))
    expires = step.now + step.policy.approval_timeout_s
    digest = call_digest(held.tool, args)
    step.emit(
        ToolCallHeld(
            held.call_id,
            held.tool,
            dict(args),
            digest,
            expires,
            requested_at=step.now,
            quorum=step.policy.approval_quorum,
            required_roles=step.policy.approval_roles,
        )
    )
    step.emit(StateChanged(S.CALLING_MODEL, S.AWAITING_APPROVAL, f"{held.tool} needs approval"))
    step.arm(TimerKind.APPROVAL_EXPIRY, expires, subject=digest)
    if step.policy.idle_hibernate_s is not None:
        step.arm(TimerKind.HIBERNATE, step.now + step.policy.idle_hibernate_s)


def awaiting(step: Step) -> bool:
    """AWAITING_APPROVAL: kill and cancel finalize, approvals and denials decide, expiry denies. True when
    the trajectory left the state."""
    held = step.record.held
    if held is None:  # defensive: nothing held means nothing to wait for
        step.emit(StateChanged(S.AWAITING_APPROVAL, S.READY, "nothing held"))
        return True
    for req in list(step.record.pending_control):
        if req.action in (ControlAction.KILL, ControlAction.CANCEL):
            reason = ExitReason.KILLED if req.action is ControlAction.KILL else ExitReason.CANCELED
            step.emit(ControlApplied(req.message_id))
            enter_finalizing(step, reason, f"{req.action.value} by {req.issuer}: {req.reason}")
            return True
        if req.action in (ControlAction.APPROVE, ControlAction.DENY) and _vote(step, req):
            return True
    held = step.record.held
    assert held is not None
    if step.now >= held.expires_at:
        _refuse_held(step, ApprovalDecision.EXPIRED, (), "APPROVAL_EXPIRED", None)
        return True
    return False


def _signers(req: PendingControl) -> dict[str, frozenset[str]]:
    """Each verified signer with its roles, from the payload the control plane recorded."""
    payload = req.payload
    raw = payload.get("signer_roles")
    if isinstance(raw, Mapping) and raw:
        return {
            str(name): frozenset(str(r) for r in roles) if isinstance(roles, list | tuple) else frozenset()
            for name, roles in raw.items()
        }
    issuers = payload.get("issuers")
    if isinstance(issuers, list | tuple) and issuers:
        return {str(i): frozenset() for i in issuers}
    return {req.issuer: frozenset()}


def _vote(step: Step, req: PendingControl) -> bool:
    """Apply one approve/deny request. True when it decided the held call."""
    held = step.record.held
    assert held is not None
    raw_digest = req.payload.get("call_digest", req.payload.get("digest"))
    digest = raw_digest if isinstance(raw_digest, str) and raw_digest else None
    names = tuple(_signers(req))
    if digest is not None and digest != held.digest:
        # Given for a different call (an earlier one, or the next): refused and audited; the held call
        # keeps waiting. Only an explicit deny of this call, or its expiry, denies it.
        step.emit(ControlApplied(req.message_id, refused="STALE_DIGEST", detail=f"for {digest[:16]}"))
        return False
    if req.action is ControlAction.DENY:
        step.emit(ControlApplied(req.message_id))
        _refuse_held(step, ApprovalDecision.DENIED, names, "APPROVAL_DENIED", f"Denied by {', '.join(names)}")
        return True
    if digest is None:
        detail = "an approval names the digest of its call"
        step.emit(ControlApplied(req.message_id, refused="MISSING_DIGEST", detail=detail))
        return False
    if step.now > held.expires_at:
        step.emit(ControlApplied(req.message_id))
        _refuse_held(step, ApprovalDecision.EXPIRED, (), "APPROVAL_EXPIRED", "The approval arrived too late.")
        return True
    step.emit(ControlApplied(req.message_id))
    voted = {v.issuer for v in held.votes}
    for name, roles in _signers(req).items():
        if name not in voted:
            step.emit(ApprovalVoted(held.digest, name, roles, step.now))
    held = step.record.held
    assert held is not None
    evaluation = explain(_request(step, held), _votes(held), step.now)
    if evaluation.verdict is ApprovalVerdict.APPROVED:
        _approve(step, evaluation.signers)
        return True
    return False  # a partial approval: held until the quorum and the roles are covered, or expiry


def _request(step: Step, held: HeldCall) -> ApprovalRequest:
    requested = held.requested_at if 0 < held.requested_at < held.expires_at else held.expires_at - 1.0
    return ApprovalRequest(
        trajectory_id=step.record.trajectory_id,
        call_id=held.call_id,
        tool=held.tool,
        call=dict(held.arguments),
        digest=held.digest,
        requested_at=requested,
        expires_at=held.expires_at,
        required_roles=held.required_roles,
        quorum=held.quorum,
    )


def _votes(held: HeldCall) -> list[ApprovalVote]:
    return [ApprovalVote(v.issuer, v.roles, held.digest, v.at) for v in held.votes]


def _approve(step: Step, signers: tuple[str, ...]) -> None:
    held = step.record.held
    assert held is not None
    step.emit(ApprovalDecided(held.digest, ApprovalDecision.APPROVED, signers, "quorum reached", step.now))
    # re-check before dispatch: the call still matches its digest, the grant and the budget still allow it
    failed = None
    if recheck_before_dispatch(_request(step, held), held.tool, held.arguments, {}) is not None:
        failed = "digest"
    elif not step.record.grants.allows(held.tool):
        failed = "grant"
    elif step.record.budget_stage is BudgetStage.HALT:
        failed = "budget"
    step.emit(ApprovalRechecked(held.digest, failed is None, failed, step.now))
    step.disarm_all((TimerKind.APPROVAL_EXPIRY, TimerKind.HIBERNATE))
    if failed is not None:
        body = {"status": "REFUSED", "reason": f"RECHECK_FAILED_{failed.upper()}", "call": held.tool}
        step.emit(ObservationAppended(ObservationKind.REFUSAL, json.dumps(body), call_id=held.call_id))
        step.emit(StateChanged(S.AWAITING_APPROVAL, S.READY, f"re-check failed: {failed}"))
        return
    step.emit(StateChanged(S.AWAITING_APPROVAL, S.WAITING_TOOL, "approved", approval_digest=held.digest))
    queue_for_permit(step, held.call_id, held.tool, held.arguments, approval_digest=held.digest)


def _refuse_held(
    step: Step, decision: ApprovalDecision, issuers: tuple[str, ...], reason: str, message: str | None
) -> None:
    held = step.record.held
    assert held is not None
    step.emit(ApprovalDecided(held.digest, decision, issuers, reason, step.now))
    call = f"{held.tool}({json.dumps(dict(held.arguments), sort_keys=True, default=str)})"
    body = refusal_observation(_REFUSALS[reason], call, message)
    body["reason"] = reason
    step.emit(ObservationAppended(ObservationKind.REFUSAL, json.dumps(body), call_id=held.call_id))
    step.disarm_all((TimerKind.APPROVAL_EXPIRY, TimerKind.HIBERNATE))
    step.emit(StateChanged(S.AWAITING_APPROVAL, S.READY, reason.lower()))


_REFUSALS = {
    "APPROVAL_DENIED": RefusalReason.APPROVAL_DENIED,
    "APPROVAL_EXPIRED": RefusalReason.APPROVAL_EXPIRED,
}
