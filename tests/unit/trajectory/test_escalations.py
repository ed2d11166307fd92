"""Escalations as a production system through ``decide`` (reliability guide §8, issue 12).

Every trigger opens an escalation with an owner (its route), an SLA (a due time) and a handoff packet; the
escalation is published to the cluster's registry (here: ``Sim.escalations``); acknowledging it transfers
custody to the verified signer, also after the trajectory ended. Each row has its negative: the same run
without the trigger's condition opens none.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from runtime.escalation import (
    Escalation,
    EscalationPolicy,
    EscalationRoute,
    EscalationStatus,
    EscalationTrigger,
)
from runtime.events import ControlApplied, EscalationAcknowledged
from runtime.fingerprint import call_digest
from runtime.ports import ModelReply, OutcomeClass, ProbeResult, Settlement, ToolOutcome
from runtime.record import ControlAction
from runtime.states import ExitReason, TrajectoryState
from runtime.supervision import SupervisionPolicy

from .sim import Sim, done, env_service, policy
from .supervised import calls, contracts, escalations_of, reply, sim_for, supervised

S = TrajectoryState
T = EscalationTrigger
NOTIFY = {"channel": "ops", "text": "deploy"}


def one_call_then_done(tool: str, args: Mapping[str, Any]) -> Any:
    def script(messages: Sequence[Mapping[str, Any]]) -> ModelReply:
        return reply((tool, args)) if calls(messages) == 0 else done()

    return script


def failing(error: str) -> Any:
    return lambda inv: ToolOutcome(Settlement.ESTABLISHED_ABSENT, OutcomeClass.CLIENT_REJECTION, error=error)


# --------------------------------------------------------------------------- triggers


def test_a_call_held_for_approval_is_an_escalation_until_decided() -> None:
    # Given a route for approvals: the approvers, within 10 minutes
    routes = EscalationPolicy({T.APPROVAL_REQUEST: EscalationRoute("approvers", 600.0)})
    pol = policy(contracts(), supervision=SupervisionPolicy(escalations=routes))
    sim = sim_for(one_call_then_done("notify", NOTIFY), pol)
    sim.run(until=sim.clock.wall() + 1)
    # Then the held call is an open escalation owned by the approvers, due in 10 minutes
    (esc,) = escalations_of(sim, T.APPROVAL_REQUEST)
    assert (esc.owner, esc.due_at - esc.opened_at, esc.status) == ("approvers", 600.0, EscalationStatus.OPEN)
    assert esc.evidence["digest"] == call_digest("notify", NOTIFY)
    assert esc.handoff["pending"]["approval"]["digest"] == esc.evidence["digest"]
    assert "tether approve" in esc.handoff["resume"]["how"]
    # When it is approved, it is resolved (and the registry is told)
    sim.control("a1", ControlAction.APPROVE, payload={"call_digest": call_digest("notify", NOTIFY)})
    sim.run()
    assert sim.escalations[esc.escalation_id].status is EscalationStatus.RESOLVED


@pytest.mark.parametrize(
    ("error", "novel"),
    [
        ("QUOTA_FROZEN: account frozen by the provider", True),  # a code nobody declared
        ("UNAVAILABLE: try again", False),  # a known gRPC status
        ("not sent: deadline passed", False),  # a local refusal, no code
    ],
)
def test_an_unknown_error_code_is_novelty(error: str, novel: bool) -> None:
    sim = sim_for(one_call_then_done("run_tests", {"suite": "u"}), supervised())
    sim.tools.behaviour["run_tests"] = failing(error)
    sim.run()
    found = escalations_of(sim, T.NOVELTY)
    assert bool(found) is novel
    if novel:
        assert found[0].evidence["code"] == "QUOTA_FROZEN"


def test_a_call_to_a_tool_that_does_not_exist_is_novelty() -> None:
    sim = sim_for(one_call_then_done("rm_rf", {"path": "/"}), supervised())
    sim.run()
    (esc,) = escalations_of(sim, T.NOVELTY)
    assert "rm_rf" in esc.summary


@pytest.mark.parametrize(("times", "escalated"), [(3, True), (2, False)])
def test_the_same_failure_repeated_is_a_verification_escalation(times: int, escalated: bool) -> None:
    def script(messages: Sequence[Mapping[str, Any]]) -> ModelReply:
        n = calls(messages)
        return reply(("run_tests", {"suite": f"s{n}"}), n=n) if n < times else done()

    sim = sim_for(script, supervised())
    sim.tools.behaviour["run_tests"] = failing("FAILED_PRECONDITION: 3 tests fail in test_pool.py")
    sim.run()
    assert len(escalations_of(sim, T.VERIFICATION)) == (1 if escalated else 0)


def test_a_rejected_completion_claim_is_a_verification_escalation() -> None:
    sim = sim_for(lambda m: done(), supervised(), check="min_tool_results")
    rec = sim.run()
    assert rec.exit_reason is ExitReason.COMPLETION_CHECK_FAILED
    (esc,) = escalations_of(sim, T.VERIFICATION)
    assert esc.evidence["check"] == "min_tool_results"


@pytest.mark.parametrize(("partial_work", "escalated"), [(True, True), (False, False)])
def test_budget_exhaustion_with_usable_partial_work_escalates(partial_work: bool, escalated: bool) -> None:
    def script(messages: Sequence[Mapping[str, Any]]) -> ModelReply:
        n = calls(messages)
        return reply(("run_tests", {"suite": f"s{n}"}), n=n) if partial_work else reply(("rm", "{}"), n=n)

    ceilings = {"turns": 3, "tokens": 1e6, "wall_seconds": 3000, "dollars": 50.0}
    sim = sim_for(script, supervised(), ceilings=ceilings)
    assert sim.run().exit_reason is ExitReason.BUDGET_EXCEEDED
    found = escalations_of(sim, T.BUDGET_EXHAUSTED)
    assert bool(found) is escalated
    if escalated:
        assert found[0].evidence["binding_dimension"] == "turns" and len(found[0].evidence["done"]) == 3


@pytest.mark.parametrize(
    ("probe", "open_at_end"),
    [(Settlement.UNKNOWN, True), (Settlement.ESTABLISHED, False)],
    ids=["probe cannot tell", "control: the probe settles it"],
)
def test_an_end_with_operations_in_doubt_escalates_until_evidence_settles_them(
    probe: Settlement, open_at_end: bool
) -> None:
    # Given a provisioning call in flight when an operator kills the trajectory
    tools = frozenset({"provision_env", "release_env"})
    sim = sim_for(one_call_then_done("provision_env", {"name": "e1"}), supervised(), tools=tools)
    sim.tools.behaviour["provision_env"] = lambda inv: None  # hangs
    sim.tools.probe_answers["provision_env"] = ProbeResult(probe, None, "asked the provisioner")
    sim.run(until=sim.clock.wall() + 1)
    sim.control("k1", ControlAction.KILL)
    rec = sim.run()
    assert rec.exit_reason is ExitReason.KILLED
    # Then an unknown outcome at the end is an escalation with the operation and its owner; evidence that
    # settles it (here: the probe FINALIZING waits for) leaves no open one
    found = escalations_of(sim, T.UNKNOWN_OUTCOME)
    still_open = [e for e in found if sim.escalations[e.escalation_id].status is EscalationStatus.OPEN]
    assert bool(still_open) is open_at_end
    if open_at_end:
        assert still_open[0].evidence["operations"][0]["tool"] == "provision_env"


# --------------------------------------------------------------------------- custody


def _held_loop() -> tuple[Sim, Escalation]:
    def script(messages: Sequence[Mapping[str, Any]]) -> ModelReply:
        return reply(("read_log", {"query": "same"}), n=calls(messages))

    sim = sim_for(script, supervised())
    sim.run(until=sim.clock.wall() + 60)
    (esc,) = escalations_of(sim, T.GUARD)
    return sim, esc


def test_acknowledging_transfers_custody_to_the_verified_signer() -> None:
    sim, esc = _held_loop()
    # When an operator acknowledges it (the shell verified the signature; the decider sees the signer)
    assert sim.control(
        "ack1", ControlAction.ACKNOWLEDGE, "carol", payload={"escalation_id": esc.escalation_id}
    ) == ("recorded")
    # Then custody is hers, recorded durably and published; the hold itself stands until someone acts
    after = sim.escalations[esc.escalation_id]
    assert (after.status, after.custodian) == (EscalationStatus.ACKNOWLEDGED, "carol")
    assert not after.sla_missed(sim.clock.wall()) and sim.rec.hold is not None
    # and an acknowledgement of an escalation that does not exist is refused and audited
    sim.control("ack2", ControlAction.ACKNOWLEDGE, "carol", payload={"escalation_id": "esc-nope"})
    assert [e.refused for e in sim.of(ControlApplied) if e.message_id == "ack2"] == ["UNKNOWN_ESCALATION"]


def test_custody_can_be_taken_after_the_trajectory_ended() -> None:
    sim, esc = _held_loop()
    sim.control("k1", ControlAction.KILL)
    assert sim.run().is_terminal
    reply_ = sim.control(
        "ack1", ControlAction.ACKNOWLEDGE, "dave", payload={"escalation_id": esc.escalation_id}
    )
    assert reply_ == "recorded" and sim.of(EscalationAcknowledged)[-1].custodian == "dave"
    assert sim.escalations[esc.escalation_id].custodian == "dave"
    # the same signer again is a duplicate, not a second record
    again = sim.control(
        "ack2", ControlAction.ACKNOWLEDGE, "dave", payload={"escalation_id": esc.escalation_id}
    )
    assert again == "duplicate"


@pytest.mark.parametrize(
    ("acknowledged_at", "now", "missed"),
    [
        (None, 1_000.0, False),  # open, not yet due
        (None, 1_601.0, True),  # open, past due: the SLA is missed
        (1_500.0, 9_999.0, False),  # taken in time
        (1_700.0, 9_999.0, True),  # taken, but late
    ],
)
def test_sla_rows(acknowledged_at: float | None, now: float, missed: bool) -> None:
    status = EscalationStatus.OPEN if acknowledged_at is None else EscalationStatus.ACKNOWLEDGED
    esc = Escalation(
        "e", "t", T.GUARD, "s", "oncall", 1_000.0, 1_600.0, status=status, acknowledged_at=acknowledged_at
    )
    assert esc.sla_missed(now) is missed


@pytest.mark.parametrize("release_works", [False, True], ids=["release fails", "control: release works"])
def test_cleanup_that_cannot_be_discharged_is_a_stuck_cleanup_escalation(release_works: bool) -> None:
    # Given an environment provisioned (its release is registered cleanup), then the trajectory cancelled
    tools = frozenset({"provision_env", "release_env"})
    sim = sim_for(
        one_call_then_done("provision_env", {"name": "e1"}), supervised(), tools=tools, hold_model=True
    )
    if not release_works:
        sim.tools.behaviour["release_env"] = failing("FAILED_PRECONDITION: the environment is locked")
    env_service(sim.tools)
    sim.run()
    sim.release_model()
    sim.run()
    sim.control("c1", ControlAction.CANCEL)
    sim.hold_model = False
    sim.release_model()
    rec = sim.run()
    assert rec.state is S.CANCELED
    # Then a release that cannot be discharged is handed off and queued for a person, with its obligation
    found = escalations_of(sim, T.STUCK_CLEANUP)
    assert bool(found) is not release_works
    if found:
        assert found[0].evidence["obligations"][0]["tool"] == "release_env"
