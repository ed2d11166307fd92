"""Holds and incident containment through ``decide`` (recovery chapter §12.8, table 10; issue 12).

An incident's hold stops model-directed work at once in whatever state the trajectory is in (a streaming
reply is aborted unparsed, queued calls are withdrawn, a call held for approval is withdrawn), steps READY
into PAUSED, refuses a plain resume, and lifts only when its incident is released. Containment never
revokes a grant a registered cleanup needs. A disclosure rule opens an incident by itself. Each protection
has its control: the same run without the hold (or the rule) and the judge fails.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest

from runtime.effects import CancelModelStream
from runtime.escalation import EscalationTrigger
from runtime.events import ControlApplied, HoldPlaced, IncidentOpened
from runtime.fingerprint import call_digest
from runtime.incident import DisclosureRule, HoldKind
from runtime.ports import ModelReply
from runtime.record import ControlAction
from runtime.states import TrajectoryState
from runtime.tools import SideEffect, ToolContract

from .sim import HOLD, Sim, done, env_service, provision_contracts, registry
from .supervised import calls, contracts, escalations_of, reply, sim_for, supervised

S = TrajectoryState
NOTIFY = {"channel": "ops", "text": "deploy"}


def _hold(sim: Sim, message_id: str = "h1", incident: str | None = "inc-7", **payload: Any) -> str | None:
    body: dict[str, Any] = dict(payload)
    if incident is not None:
        body["incident_id"] = incident
    return sim.control(message_id, ControlAction.HOLD, "secops-bob", "suspected injection", body)


# --------------------------------------------------------------------------- a hold in every state


def _calling_model() -> Sim:
    def script(messages: Sequence[Mapping[str, Any]]) -> ModelReply:
        return reply(("run_tests", {"suite": "u"})) if calls(messages) == 0 else done()

    sim = sim_for(script, supervised(), hold_model=True)
    sim.run()
    assert sim.rec.state is S.CALLING_MODEL
    sim.hold_model = False  # the call in flight stays held; later ones are answered at once
    return sim


def _waiting_tool() -> Sim:
    two = reply(("run_tests", {"suite": "u"}), ("read_log", {"query": "x"}))
    sim = sim_for(lambda m: two if calls(m) == 0 else done(), supervised(), guard=lambda effect: HOLD)
    sim.run(until=sim.clock.wall() + 1)
    assert sim.rec.state is S.WAITING_TOOL and len(sim.parked_permits) == 2
    return sim


def _awaiting_approval() -> Sim:
    sim = sim_for(lambda m: reply(("notify", NOTIFY)) if calls(m) == 0 else done(), supervised())
    sim.run(until=sim.clock.wall() + 1)
    assert sim.rec.state is S.AWAITING_APPROVAL
    return sim


def _let_it_go_on(sim: Sim) -> None:
    """What would happen next if nothing held it: the reply arrives, permits free up, approval comes."""
    sim.release_model()
    sim.grant_permits()
    sim.control("a1", ControlAction.APPROVE, payload={"call_digest": call_digest("notify", NOTIFY)})
    sim.run(until=sim.clock.wall() + 5)


STATES: list[tuple[str, Callable[[], Sim]]] = [
    ("CALLING_MODEL", _calling_model),
    ("WAITING_TOOL", _waiting_tool),
    ("AWAITING_APPROVAL", _awaiting_approval),
]


@pytest.mark.parametrize("held", [True, False], ids=["incident hold", "control: no hold"])
@pytest.mark.parametrize(("state", "make"), STATES, ids=[s for s, _ in STATES])
def test_an_incident_hold_stops_model_directed_work_at_once(
    state: str, make: Callable[[], Sim], held: bool
) -> None:
    # Given a trajectory in the middle of model-directed work
    sim = make()
    # When an incident's hold arrives (or, in the control, nothing does) and the work would go on
    if held:
        assert _hold(sim) == "recorded"
    _let_it_go_on(sim)
    # Then (the judge) nothing reached a tool and the trajectory waits PAUSED under the incident's hold
    stopped = not sim.tools.deliveries and sim.rec.state is S.PAUSED and sim.rec.hold is not None
    assert stopped is held
    if held:
        assert sim.rec.hold is not None and sim.rec.hold.kind is HoldKind.INCIDENT
        assert sim.rec.hold.incident_ids == ("inc-7",)
        if state == "CALLING_MODEL":
            assert any(isinstance(e, CancelModelStream) for e in sim.effects)  # aborted, never parsed


def test_a_resume_is_refused_under_an_incident_hold_and_only_its_release_lifts_it() -> None:
    # Given a trajectory held by incident inc-7 while waiting for the model
    sim = _calling_model()
    _hold(sim)
    sim.release_model()
    sim.run(until=sim.clock.wall() + 1)
    assert sim.rec.state is S.PAUSED
    # When an operator resumes it, then releases another incident
    sim.control("r1", ControlAction.RESUME, reason="looks fine")
    sim.control("x1", ControlAction.RELEASE, payload={"incident_id": "inc-8"})
    sim.run(until=sim.clock.wall() + 1)
    # Then both are refused and audited; it stays held
    refused = {e.message_id: e.refused for e in sim.of(ControlApplied) if e.refused}
    assert refused == {"r1": "INCIDENT_HOLD", "x1": "WRONG_INCIDENT"}
    assert sim.rec.state is S.PAUSED and not sim.tools.deliveries
    # When inc-7 itself is released
    sim.control("x2", ControlAction.RELEASE, payload={"incident_id": "inc-7"})
    rec = sim.run()
    # Then the trajectory resumes and completes
    assert rec.state is S.COMPLETED and rec.hold is None and sim.tools.delivered("run_tests") == 1


def test_a_trajectory_under_two_incidents_stays_held_until_both_are_released() -> None:
    sim = _calling_model()
    _hold(sim, "h1", "inc-1")
    _hold(sim, "h2", "inc-2")
    sim.release_model()
    sim.control("x1", ControlAction.RELEASE, payload={"incident_id": "inc-1"})
    sim.run(until=sim.clock.wall() + 1)
    assert sim.rec.state is S.PAUSED and sim.rec.hold is not None
    assert sim.rec.hold.incident_ids == ("inc-2",)
    sim.control("x2", ControlAction.RELEASE, payload={"incident_id": "inc-2"})
    assert sim.run().state is S.COMPLETED


def test_an_operator_hold_pauses_and_a_resume_lifts_it() -> None:
    sim = _calling_model()
    assert _hold(sim, incident=None) == "recorded"
    sim.release_model()
    sim.run(until=sim.clock.wall() + 1)
    assert sim.rec.state is S.PAUSED and sim.rec.hold is not None
    assert sim.rec.hold.kind is HoldKind.CONTROL
    sim.control("r1", ControlAction.RESUME)
    assert sim.run().state is S.COMPLETED


def test_a_hold_for_an_ended_trajectory_is_audited_only() -> None:
    sim = sim_for(lambda m: done(), supervised())
    assert sim.run().is_terminal
    assert _hold(sim) == "rejected" and not sim.of(HoldPlaced)


# --------------------------------------------------------------------------- never strand cleanup


def _provisioned(compensated: bool = True) -> Sim:
    """An environment provisioned (its release is registered cleanup, unless ``compensated`` is False: the
    control, the same tool with no compensation declared); the next model call is in flight."""

    def script(messages: Sequence[Mapping[str, Any]]) -> ModelReply:
        return reply(("provision_env", {"name": "e1"})) if calls(messages) == 0 else done()

    reg = contracts()
    if not compensated:
        forward = reg.get("provision_env")
        bare = ToolContract(
            name=forward.name,
            description=forward.description,
            arguments=forward.arguments,
            side_effect=SideEffect.READ_ONLY,
            repeat=forward.repeat,
            probe=forward.probe,
            dependency_scope=forward.dependency_scope,
        )
        reg = registry(bare, *[c for c in provision_contracts() if c.name != "provision_env"])
        for name in ("apply_patch", "read_log", "search", "job_status", "delegate"):
            reg.register(contracts().get(name))
    tools = frozenset({"provision_env", "release_env", "run_tests"})
    sim = sim_for(script, supervised(reg=reg), tools=tools, hold_model=True)
    env_service(sim.tools)
    sim.run()
    sim.release_model()
    sim.run()
    assert sim.rec.operations and sim.rec.state is S.CALLING_MODEL and sim.tools.allocated
    return sim


@pytest.mark.parametrize("mutated", [False, True], ids=["kept", "control: cleanup needs ignored"])
@pytest.mark.parametrize(
    ("revoke", "kept"),
    [
        (["provision_env", "release_env"], {"release_env"}),  # cleanup's tool stays granted
        (["provision_env"], {"release_env"}),
        (["run_tests"], {"provision_env", "release_env"}),
    ],
)
def test_revoking_grants_never_strands_a_registered_cleanup(
    revoke: list[str], kept: set[str], mutated: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if mutated:  # the mutation: containment that does not ask what registered cleanup needs
        from runtime import _decide_supervise

        monkeypatch.setattr(_decide_supervise, "cleanup_tools", lambda record: frozenset())
    sim = _provisioned()
    # When an incident's hold revokes grants
    _hold(sim, revoke=revoke)
    # Then every revoked tool is gone except what registered cleanup needs
    granted = {t for t in sim.rec.grants.tools if sim.rec.grants.allows(t)}
    judged = granted & set(revoke) == kept & set(revoke) and "release_env" in granted
    assert judged is (not mutated or "release_env" not in revoke)


@pytest.mark.parametrize("compensated", [True, False], ids=["cleanup registered", "control: none registered"])
def test_a_held_trajectorys_cleanup_still_runs_when_it_ends(compensated: bool) -> None:
    # Given a trajectory that provisioned an environment, held by an incident that revoked provisioning
    sim = _provisioned(compensated)
    _hold(sim, revoke=["provision_env", "release_env"])
    sim.hold_model = False
    sim.release_model()
    sim.run(until=sim.clock.wall() + 1)
    assert sim.rec.state is S.PAUSED and sim.rec.hold is not None
    # When the operator ends it
    sim.control("c1", ControlAction.CANCEL, reason="contained: end it")
    rec = sim.run()
    # Then (the judge: the environment service's own record) FINALIZING released it although the trajectory
    # was held and the model-directed grants were revoked: cleanup is not model-directed work
    assert rec.state is S.CANCELED
    assert (not sim.tools.allocated) is compensated


# --------------------------------------------------------------------------- disclosure rules


FIXTURES = DisclosureRule("fixtures", r"FIXTURE-\d{3}", frozenset({"search"}))


@pytest.mark.parametrize("rules", [(FIXTURES,), ()], ids=["rule declared", "control: no rule"])
def test_suspect_content_inducing_a_forbidden_proposal_opens_an_incident(
    rules: tuple[DisclosureRule, ...],
) -> None:
    # Given an agent whose context carries private fixture data, and a job of a test in flight
    def script(messages: Sequence[Mapping[str, Any]]) -> ModelReply:
        n = calls(messages)
        if n == 0:
            return reply(("run_tests", {"suite": "integration"}))
        return reply(("search", {"query": "parse FIXTURE-042 rows fast"}), n=n) if n == 1 else done()

    sim = sim_for(script, supervised(disclosure=rules))
    sim.run(until=sim.clock.wall() + 60)
    withheld = sim.tools.delivered("search") == 0
    assert withheld is bool(rules)  # the judge: the fixture never reached the search tool
    if not rules:
        return
    # Then the proposal was withheld before dispatch, the trajectory is held PAUSED by its own incident
    rec = sim.rec
    assert rec.state is S.PAUSED and rec.hold is not None and rec.hold.kind is HoldKind.INCIDENT
    (opened,) = sim.of(IncidentOpened)
    assert opened.evidence["path"] == "$.query" and "FIXTURE" not in json.dumps(dict(opened.evidence))
    assert "no evidence that no earlier disclosure" in str(opened.evidence["caveat"])
    assert opened.symptom != opened.suspected_cause
    # the incident store is told, with the member's metadata (operations, owners of unresolved effects)
    (incident,) = sim.incidents
    assert incident.incident_id == opened.incident_id == rec.hold.incident_ids[0]
    assert incident.member["operations"] and incident.member["grants"]
    # and a person owns it
    (esc,) = escalations_of(sim, EscalationTrigger.INCIDENT)
    assert esc.evidence["incident"] == opened.incident_id
    assert [r["reason"] for r in sim.refusals()] == ["DISCLOSURE"]


def test_a_revocation_while_a_call_is_being_recovered_sends_nothing_more() -> None:
    # Given a provisioning call whose outcome is unknown: its probe is in flight when the incident arrives
    from runtime.inputs import ProbeAnswered
    from runtime.ports import OutcomeClass, ProbeResult, Settlement, ToolOutcome

    def script(messages: Sequence[Mapping[str, Any]]) -> ModelReply:
        return reply(("provision_env", {"name": "e1"})) if calls(messages) == 0 else done()

    tools = frozenset({"provision_env", "release_env"})
    sim = sim_for(script, supervised(), tools=tools)
    sim.tools.behaviour["provision_env"] = lambda inv: ToolOutcome(
        Settlement.UNKNOWN, OutcomeClass.INFRASTRUCTURE_FAILURE, error="UNAVAILABLE: reset"
    )
    sim.tools.probe_answers["provision_env"] = ProbeResult(
        Settlement.ESTABLISHED_ABSENT, None, "never applied"
    )
    while sim.inputs and not isinstance(sim.inputs[0], ProbeAnswered):
        sim.feed(sim.inputs.popleft())
    assert sim.rec.queued and next(iter(sim.rec.queued.values())).stage.value == "probing"
    # When an incident holds it and revokes provision_env, and then the probe says "never applied"
    _hold(sim, revoke=["provision_env"])
    rec = sim.run(until=sim.clock.wall() + 60)
    # Then the retry the probe would have allowed is not sent (the grant is gone), the operation is settled
    # by the probe's evidence, and the trajectory waits PAUSED under the hold
    assert sim.tools.delivered("provision_env") == 1
    assert rec.state is S.PAUSED and all(op.settled for op in rec.operations.values())
