"""Approval escrow, pure logic: the request, the votes, the verdict, the dispatch re-check, the refusal.

Harness chapter, "Approval Gates" (Definition 0.3, Figure 6, Tables 9 and 10):

- the approval binds to the digest of the exact canonical call; changing one argument voids it;
- it carries an expiry, and *silence counts as denial*: past expiry without a quorum the call is refused;
- a quorum needs distinct signers (Signer Uniqueness), signers whose roles cover the required roles
  (Role Orthogonality), and every signature inside the lease window (Temporal Validity: a signature
  after expiry invalidates the manifest; partial approvals do not persist across renewals);
- before dispatch the harness re-checks the digest and the recorded preconditions (grant and budget are
  re-checked by the admission check);
- denial, expiry and staleness all end the same way: the held call is discarded and a structured
  REFUSED observation goes to the model.

Signatures are verified by the control plane before a vote reaches this module; here a vote's identity
and roles are already authenticated facts.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Any

from runtime.errors import InputError
from runtime.fingerprint import CanonicalForm, call_digest, canonical_args, canonical_json

__all__ = [
    "ApprovalConfigError",
    "ApprovalEvaluation",
    "ApprovalRequest",
    "ApprovalVerdict",
    "ApprovalVote",
    "RefusalReason",
    "VoteDecision",
    "evaluate",
    "explain",
    "recheck_before_dispatch",
    "refusal_for",
    "refusal_observation",
    "render_call",
]


# An approval binds to every argument of the held call: nothing is volatile here.
_NO_VOLATILE = CanonicalForm(volatile_keys=frozenset())


class ApprovalConfigError(InputError):
    """An approval request or vote was malformed (names the field)."""


class ApprovalVerdict(StrEnum):
    APPROVED = "approved"  # quorum reached in time: proceed to the dispatch re-check
    PENDING = "pending"  # keep holding
    DENIED = "denied"  # an authorised reviewer said no
    EXPIRED = "expired"  # silence past expiry is denial
    STALE_DIGEST = "stale_digest"  # a reviewer decided on a different call than the one held


class VoteDecision(StrEnum):
    APPROVE = "approve"
    DENY = "deny"


class RefusalReason(StrEnum):
    """``reason`` codes of the REFUSED observation."""

    APPROVAL_DENIED = "APPROVAL_DENIED"
    APPROVAL_EXPIRED = "APPROVAL_EXPIRED"
    APPROVAL_STALE = "APPROVAL_STALE"
    PRECONDITIONS_CHANGED = "PRECONDITIONS_CHANGED"
    GRANT_REVOKED = "GRANT_REVOKED"
    BUDGET_EXHAUSTED = "BUDGET_EXHAUSTED"


_MESSAGES: Mapping[RefusalReason, str] = MappingProxyType(
    {
        RefusalReason.APPROVAL_DENIED: "A reviewer denied this call. It was not dispatched.",
        RefusalReason.APPROVAL_EXPIRED: "No approval was recorded before the request expired.",
        RefusalReason.APPROVAL_STALE: "The approval was given for a different call than the one held.",
        RefusalReason.PRECONDITIONS_CHANGED: (
            "The world changed since the request; the approval no longer applies."
        ),
        RefusalReason.GRANT_REVOKED: "The grant for this call is no longer valid.",
        RefusalReason.BUDGET_EXHAUSTED: "The remaining budget does not cover this call.",
    }
)

_VERDICT_REFUSAL: Mapping[ApprovalVerdict, RefusalReason] = MappingProxyType(
    {
        ApprovalVerdict.DENIED: RefusalReason.APPROVAL_DENIED,
        ApprovalVerdict.EXPIRED: RefusalReason.APPROVAL_EXPIRED,
        ApprovalVerdict.STALE_DIGEST: RefusalReason.APPROVAL_STALE,
    }
)


def render_call(tool: str, args: Mapping[str, Any]) -> str:
    """Human-readable canonical call, e.g. ``drop_table(db="prod", table="orders_staging")``."""
    canon = canonical_args(args, _NO_VOLATILE)
    inner = ", ".join(
        f"{k}={json.dumps(canon[k], ensure_ascii=False, sort_keys=True)}" for k in sorted(canon)
    )
    return f"{tool}({inner})"


def _check_time(value: float, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ApprovalConfigError(f"must be a finite epoch time, got {value!r}", where=where)
    return float(value)


@dataclass(frozen=True, slots=True)
class ApprovalRequest:
    """What the reviewer is asked to approve (Figure 6a). Build with :meth:`create`."""

    trajectory_id: str
    call_id: str
    tool: str
    call: Mapping[str, Any]  # canonical arguments of the held call
    digest: str  # call_digest(tool, call): what every vote must name
    requested_at: float  # epoch seconds
    expires_at: float  # epoch seconds
    required_roles: frozenset[str] = frozenset()
    quorum: int = 1
    preconditions: Mapping[str, str] = field(default_factory=dict)  # name -> observed digest at request time
    preview: str | None = None

    def __post_init__(self) -> None:
        _check_time(self.requested_at, "approval.requested_at")
        _check_time(self.expires_at, "approval.expires_at")
        if self.expires_at <= self.requested_at:
            raise ApprovalConfigError("expiry must be after the request", where="approval.expires_at")
        if isinstance(self.quorum, bool) or not isinstance(self.quorum, int) or self.quorum < 1:
            raise ApprovalConfigError(f"must be an int ≥ 1, got {self.quorum!r}", where="approval.quorum")
        if self.digest != call_digest(self.tool, self.call):
            raise ApprovalConfigError("digest does not match the canonical call", where="approval.digest")
        object.__setattr__(self, "call", MappingProxyType(dict(self.call)))
        object.__setattr__(self, "preconditions", MappingProxyType(dict(self.preconditions)))

    @classmethod
    def create(
        cls,
        *,
        trajectory_id: str,
        call_id: str,
        tool: str,
        args: Mapping[str, Any],
        requested_at: float,
        ttl_s: float,
        required_roles: Iterable[str] = (),
        quorum: int = 1,
        preconditions: Mapping[str, str] | None = None,
        preview: str | None = None,
    ) -> ApprovalRequest:
        """Hold ``tool(args)`` for review until ``requested_at + ttl_s``."""
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, int | float) or not ttl_s > 0:
            raise ApprovalConfigError(f"must be > 0, got {ttl_s!r}", where="approval.ttl_s")
        canon = canonical_args(args, _NO_VOLATILE)
        return cls(
            trajectory_id=trajectory_id,
            call_id=call_id,
            tool=tool,
            call=canon,
            digest=call_digest(tool, canon),
            requested_at=requested_at,
            expires_at=requested_at + ttl_s,
            required_roles=frozenset(required_roles),
            quorum=quorum,
            preconditions=dict(preconditions or {}),
            preview=preview,
        )

    @property
    def rendered_call(self) -> str:
        return render_call(self.tool, self.call)

    def canonical_call_json(self) -> str:
        return canonical_json({"tool": self.tool, "args": dict(self.call)})


@dataclass(frozen=True, slots=True)
class ApprovalVote:
    """One authenticated decision on one digest."""

    issuer: str
    roles: frozenset[str]
    digest: str
    issued_at: float
    decision: VoteDecision = VoteDecision.APPROVE

    def __post_init__(self) -> None:
        if not self.issuer:
            raise ApprovalConfigError("issuer identity is required", where="vote.issuer")
        _check_time(self.issued_at, "vote.issued_at")
        object.__setattr__(self, "roles", frozenset(self.roles))


@dataclass(frozen=True, slots=True)
class ApprovalEvaluation:
    """The verdict with its evidence (for the audit log and ``tether pending``)."""

    verdict: ApprovalVerdict
    signers: tuple[str, ...]  # distinct approving identities counted toward the quorum
    missing_roles: frozenset[str]
    ignored: tuple[ApprovalVote, ...]  # votes outside the lease window (or dated in the future)
    reason: str


def _cover_roles(required: frozenset[str], signer_roles: Mapping[str, frozenset[str]]) -> frozenset[str]:
    """Assign each required role to a *distinct* signer holding it (bipartite matching, augmenting
    paths); return the roles left uncovered. Distinct holders is the stricter reading of Role
    Orthogonality ("independent signatures from role:secops and role:site-reliability")."""
    holder: dict[str, str] = {}  # role -> signer

    def assign(role: str, visited: set[str]) -> bool:
        for signer, roles in sorted(signer_roles.items()):
            if role not in roles or signer in visited:
                continue
            visited.add(signer)
            taken_by = next((r for r, s in holder.items() if s == signer), None)
            if taken_by is None or assign(taken_by, visited):
                holder[role] = signer
                return True
        return False

    return frozenset(r for r in sorted(required) if not assign(r, set()))


def explain(request: ApprovalRequest, votes: Iterable[ApprovalVote], now: float) -> ApprovalEvaluation:
    """Apply Table 10 at wall time ``now``.

    Order: a denial on the held digest wins; then any vote on another digest makes the request stale;
    then expiry (silence, or a quorum not reached in time, is denial); then the quorum check.
    Votes dated before the request or after expiry or after ``now`` are outside the lease window and
    count for nothing.
    """
    now = _check_time(now, "now")
    in_window: list[ApprovalVote] = []
    ignored: list[ApprovalVote] = []
    for vote in votes:
        if request.requested_at <= vote.issued_at <= min(request.expires_at, now):
            in_window.append(vote)
        else:
            ignored.append(vote)

    def result(
        verdict: ApprovalVerdict,
        reason: str,
        signers: tuple[str, ...] = (),
        missing: frozenset[str] = frozenset(),
    ) -> ApprovalEvaluation:
        return ApprovalEvaluation(verdict, signers, missing, tuple(ignored), reason)

    deniers = sorted(
        {v.issuer for v in in_window if v.digest == request.digest and v.decision is VoteDecision.DENY}
    )
    if deniers:
        return result(ApprovalVerdict.DENIED, f"denied by {', '.join(deniers)}")
    stale = sorted({v.issuer for v in in_window if v.digest != request.digest})
    if stale:
        return result(ApprovalVerdict.STALE_DIGEST, f"decision on another digest by {', '.join(stale)}")

    roles_by_signer: dict[str, frozenset[str]] = {}
    for v in in_window:  # every remaining vote approves the held digest
        roles_by_signer[v.issuer] = roles_by_signer.get(v.issuer, frozenset()) | v.roles
    signers = tuple(sorted(roles_by_signer))
    missing = _cover_roles(request.required_roles, roles_by_signer)

    if now > request.expires_at:
        return result(
            ApprovalVerdict.EXPIRED,
            "no quorum before expiry" if signers else "no answer before expiry",
            signers,
            missing,
        )
    if len(signers) >= request.quorum and not missing:
        return result(ApprovalVerdict.APPROVED, f"quorum of {len(signers)} reached", signers, missing)
    need = max(0, request.quorum - len(signers))
    return result(
        ApprovalVerdict.PENDING,
        f"{len(signers)}/{request.quorum} signers, {need} more needed"
        + (f"; roles not covered: {', '.join(sorted(missing))}" if missing else ""),
        signers,
        missing,
    )


def evaluate(request: ApprovalRequest, votes: Iterable[ApprovalVote], now: float) -> ApprovalVerdict:
    """The verdict alone; see :func:`explain` for the evidence."""
    return explain(request, votes, now).verdict


def recheck_before_dispatch(
    request: ApprovalRequest, tool: str, args: Mapping[str, Any], observed_preconditions: Mapping[str, str]
) -> RefusalReason | None:
    """The re-check between an approval and dispatch: the held call still matches the digest and every
    recorded precondition still reads the same. Grant and budget are the admission check's job."""
    if call_digest(tool, args) != request.digest:
        return RefusalReason.APPROVAL_STALE
    for name, recorded in request.preconditions.items():
        if observed_preconditions.get(name) != recorded:
            return RefusalReason.PRECONDITIONS_CHANGED
    return None


def refusal_for(verdict: ApprovalVerdict) -> RefusalReason | None:
    """The refusal a terminal verdict produces (None for APPROVED and PENDING)."""
    return _VERDICT_REFUSAL.get(verdict)


def refusal_observation(
    reason: RefusalReason, call: ApprovalRequest | str, message: str | None = None
) -> dict[str, str]:
    """The structured observation the model receives instead of the call's result."""
    rendered = call.rendered_call if isinstance(call, ApprovalRequest) else call
    return {
        "status": "REFUSED",
        "reason": reason.value,
        "call": rendered,
        "message": message or _MESSAGES[reason],
    }
