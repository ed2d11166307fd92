"""Approval escrow (harness chapter "Approval Gates", Tables 9 and 10)."""

from __future__ import annotations

import pytest

from runtime.approval import (
    ApprovalConfigError,
    ApprovalRequest,
    ApprovalVerdict,
    ApprovalVote,
    RefusalReason,
    VoteDecision,
    evaluate,
    explain,
    recheck_before_dispatch,
    refusal_for,
    refusal_observation,
)
from runtime.clock import FakeClock
from runtime.fingerprint import call_digest

ARGS = {"db": "prod", "table": "orders_staging"}


def held(clock: FakeClock, **overrides: object) -> ApprovalRequest:
    fields: dict[str, object] = {
        "trajectory_id": "traj-1",
        "call_id": "call-7",
        "tool": "drop_table",
        "args": ARGS,
        "requested_at": clock.wall(),
        "ttl_s": 3_600,
        "preconditions": {"orders_staging.rows": "sha256:rows-v1"},
    }
    fields.update(overrides)
    return ApprovalRequest.create(**fields)  # type: ignore[arg-type]


def vote(
    request: ApprovalRequest,
    issuer: str,
    roles: set[str],
    at: float,
    decision: VoteDecision = VoteDecision.APPROVE,
    digest: str | None = None,
) -> ApprovalVote:
    return ApprovalVote(issuer, frozenset(roles), digest or request.digest, at, decision)


def test_single_approval_in_time_approves() -> None:
    clock = FakeClock()
    request = held(clock)
    clock.advance(600)
    votes = [vote(request, "alice", {"operator"}, clock.wall())]
    assert evaluate(request, votes, clock.wall()) is ApprovalVerdict.APPROVED
    assert evaluate(request, [], clock.wall()) is ApprovalVerdict.PENDING


def test_silence_past_expiry_is_denial() -> None:
    # Given a held call nobody answers
    clock = FakeClock()
    request = held(clock)
    # When the clock passes the expiry
    clock.advance(3_600)
    assert evaluate(request, [], clock.wall()) is ApprovalVerdict.PENDING  # the expiry instant is still valid
    clock.advance(0.001)
    # Then the verdict is EXPIRED and the model gets the chapter's REFUSED observation
    verdict = evaluate(request, [], clock.wall())
    assert verdict is ApprovalVerdict.EXPIRED
    reason = refusal_for(verdict)
    assert reason is RefusalReason.APPROVAL_EXPIRED
    assert refusal_observation(reason, request) == {
        "status": "REFUSED",
        "reason": "APPROVAL_EXPIRED",
        "call": 'drop_table(db="prod", table="orders_staging")',
        "message": "No approval was recorded before the request expired.",
    }


def test_quorum_needs_distinct_signers() -> None:
    # Given a two-signer quorum
    clock = FakeClock()
    request = held(clock, quorum=2)
    clock.advance(60)
    t = clock.wall()
    # When one operator signs twice (even with different roles) the quorum is not met
    twice = [vote(request, "alice", {"operator"}, t), vote(request, "alice", {"sre"}, t)]
    assert evaluate(request, twice, t) is ApprovalVerdict.PENDING
    assert explain(request, twice, t).signers == ("alice",)
    # Then a second identity completes it
    assert evaluate(request, [*twice, vote(request, "bob", {"operator"}, t)], t) is ApprovalVerdict.APPROVED


def test_required_roles_must_each_be_covered_by_a_distinct_signer() -> None:
    # Given production mutations needing secops and sre (Table 10, Role Orthogonality)
    clock = FakeClock()
    request = held(clock, quorum=2, required_roles={"secops", "sre"})
    t = clock.wall() + 10
    # When two operators without secops sign
    two_sre = [vote(request, "bob", {"sre"}, t), vote(request, "carol", {"sre", "operator"}, t)]
    evaluation = explain(request, two_sre, t)
    # Then the quorum count is met but the role coverage is not
    assert evaluation.verdict is ApprovalVerdict.PENDING
    assert evaluation.missing_roles == {"secops"}
    # And one person holding both roles plus a bystander cannot cover both roles alone
    both = [vote(request, "dave", {"secops", "sre"}, t), vote(request, "erin", {"operator"}, t)]
    assert explain(request, both, t).verdict is ApprovalVerdict.PENDING
    assert len(explain(request, both, t).missing_roles) == 1
    # While secops + sre from different people approves
    good = [vote(request, "dave", {"secops", "sre"}, t), vote(request, "bob", {"sre"}, t)]
    assert evaluate(request, good, t) is ApprovalVerdict.APPROVED


def test_signature_outside_the_lease_window_counts_for_nothing() -> None:
    clock = FakeClock()
    request = held(clock, quorum=2)
    early = vote(request, "alice", {"operator"}, request.requested_at - 1)
    late = vote(request, "bob", {"operator"}, request.expires_at + 1)
    ok = vote(request, "carol", {"operator"}, request.requested_at + 5)
    evaluation = explain(request, [early, ok, late], request.requested_at + 10)
    assert evaluation.verdict is ApprovalVerdict.PENDING
    assert evaluation.signers == ("carol",)
    assert set(evaluation.ignored) == {early, late}
    # A partial approval does not survive expiry
    assert evaluate(request, [ok], request.expires_at + 1) is ApprovalVerdict.EXPIRED


def test_denial_wins_over_approvals() -> None:
    clock = FakeClock()
    request = held(clock, quorum=1)
    t = clock.wall() + 1
    votes = [vote(request, "alice", {"operator"}, t), vote(request, "bob", {"secops"}, t, VoteDecision.DENY)]
    assert evaluate(request, votes, t) is ApprovalVerdict.DENIED
    assert refusal_for(ApprovalVerdict.DENIED) is RefusalReason.APPROVAL_DENIED


def test_vote_on_another_digest_is_stale() -> None:
    # Given a reviewer who approved an earlier version of the call (one argument differs)
    clock = FakeClock()
    request = held(clock)
    other = call_digest("drop_table", {"db": "prod", "table": "orders"})
    t = clock.wall() + 1
    verdict = evaluate(request, [vote(request, "alice", {"operator"}, t, digest=other)], t)
    # Then the approval does not apply
    assert verdict is ApprovalVerdict.STALE_DIGEST
    assert refusal_observation(RefusalReason.APPROVAL_STALE, request)["reason"] == "APPROVAL_STALE"


def test_recheck_before_dispatch_catches_changed_call_and_world() -> None:
    clock = FakeClock()
    request = held(clock)
    same = {"orders_staging.rows": "sha256:rows-v1"}
    assert (
        recheck_before_dispatch(request, "drop_table", {"table": "orders_staging", "db": "prod"}, same)
        is None
    )
    changed_call = {"db": "prod", "table": "orders"}
    assert recheck_before_dispatch(request, "drop_table", changed_call, same) is RefusalReason.APPROVAL_STALE
    moved = {"orders_staging.rows": "sha256:rows-v2"}
    assert recheck_before_dispatch(request, "drop_table", ARGS, moved) is RefusalReason.PRECONDITIONS_CHANGED


@pytest.mark.parametrize(
    ("overrides", "where"),
    [
        ({"ttl_s": 0}, "approval.ttl_s"),
        ({"quorum": 0}, "approval.quorum"),
        ({"requested_at": float("inf")}, "approval.requested_at"),
    ],
)
def test_malformed_requests_name_the_field(overrides: dict[str, object], where: str) -> None:
    with pytest.raises(ApprovalConfigError) as err:
        held(FakeClock(), **overrides)
    assert err.value.where == where


def test_request_digest_must_match_its_call() -> None:
    clock = FakeClock()
    request = held(clock)
    with pytest.raises(ApprovalConfigError, match="digest"):
        ApprovalRequest(
            trajectory_id="t",
            call_id="c",
            tool="drop_table",
            call={"db": "dev", "table": "x"},
            digest=request.digest,
            requested_at=request.requested_at,
            expires_at=request.expires_at,
        )
