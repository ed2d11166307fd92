"""The degradation ladder through ``decide`` (reliability guide §9, issue 12).

Rungs are declared per workload; a policy trigger (a dependency's breaker open, the budget's restrict stage,
the finalization reserve) moves the trajectory down to the declared rung it asks for, and the result says
so: its rung and machine-readable completeness (status, what was and was not done, the next action). Each
rung is driven here; the control is the same run without a declared ladder, where nothing degrades.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from runtime.deadline import FinalizationReserve
from runtime.degradation import DegradationPolicy, DegradationPolicyError, DegradeTrigger, Rung, result_of
from runtime.escalation import EscalationTrigger
from runtime.events import GrantNarrowed, RungChanged
from runtime.inputs import PermitRefused
from runtime.ports import ModelReply
from runtime.states import ExitReason, TrajectoryState

from .sim import Sim, done
from .supervised import calls, escalations_of, reply, sim_for, supervised

S = TrajectoryState
R = Rung
FULL_LADDER = DegradationPolicy(
    rungs=(R.FULL, R.CONSTRAINED, R.ASSISTED, R.DETERMINISTIC, R.REFUSAL),
    deterministic_answer="Use the cached report from the last green run.",
)


def breaker_open(effect: Any) -> PermitRefused | None:
    """The env-provisioner's breaker is open; every other dependency is healthy."""
    if effect.scope == "env-service":
        return PermitRefused(
            effect.call_id, effect.request_id, "BreakerOpen", "breaker env-service is open", 30.0
        )
    return None


def provision_then_read(messages: Sequence[Mapping[str, Any]]) -> ModelReply:
    """Provisions (a write), reads, tries the write again, then ends."""
    n = calls(messages)
    if n >= 3:
        return done()
    if n in (0, 2):
        return reply(("provision_env", {"name": f"env-{n}"}), n=n)
    return reply(("run_tests", {"suite": f"smoke-{n}"}), n=n)


def _outage(ladder: DegradationPolicy) -> Sim:
    sim = sim_for(provision_then_read, supervised(degradation=ladder), guard=breaker_open)
    sim.run()
    return sim


# --------------------------------------------------------------------------- each rung


@pytest.mark.parametrize(
    ("rungs", "expected", "exit_reason", "status"),
    [
        ((R.FULL, R.CONSTRAINED, R.REFUSAL), R.CONSTRAINED, None, "partial"),
        ((R.FULL, R.ASSISTED, R.REFUSAL), R.ASSISTED, ExitReason.DEGRADED, "partial"),
        ((R.FULL, R.DETERMINISTIC, R.REFUSAL), R.DETERMINISTIC, ExitReason.DEGRADED, "partial"),
        ((R.FULL, R.REFUSAL), R.REFUSAL, ExitReason.DEGRADED, "refused"),
        ((R.FULL,), R.FULL, None, "partial"),  # control: no ladder declared
    ],
    ids=["constrained", "assisted", "deterministic", "refusal", "control: no ladder"],
)
def test_a_breaker_open_moves_down_to_the_declared_rung(
    rungs: tuple[Rung, ...], expected: Rung, exit_reason: ExitReason | None, status: str
) -> None:
    # Given a workload's ladder, and a write dependency whose breaker is open
    ladder = DegradationPolicy(rungs=rungs, deterministic_answer="Use the cached report.")
    sim = _outage(ladder)
    rec = sim.rec
    # Then the trajectory is on the rung the trigger asks for (or the next one declared below it)
    assert rec.supervision.rung is expected and rec.is_terminal
    if exit_reason is not None:
        assert rec.exit_reason is exit_reason
    result = result_of(rec)
    # and its result says so, with what was and was not done and the next action
    assert result["rung"] == expected.value and result["status"] == status
    assert any("provision_env" in line and "BreakerOpen" in line for line in result["not_done"])
    assert result["next_action"]
    if expected is R.CONSTRAINED:
        # constrained: read-only tools, the write was not retried, the reads ran; the run completed
        assert rec.state is S.COMPLETED and sim.tools.delivered("run_tests") >= 1
        assert sim.of(GrantNarrowed)[-1].read_only
    if expected is R.DETERMINISTIC:
        assert result["answer"] == "Use the cached report."
    if expected in (R.ASSISTED, R.REFUSAL):
        assert escalations_of(sim, EscalationTrigger.DEGRADED)  # routed to a person
    if expected is R.FULL:
        # the control: nothing degraded, and the agent kept proposing the write into the open breaker
        assert not sim.of(RungChanged) and [r["reason"] for r in sim.refusals()] == ["BreakerOpen"] * 2
    if expected is R.CONSTRAINED:
        # the second try of the write never reached the breaker: the constrained grant refused it
        assert [r["reason"] for r in sim.refusals()] == ["BreakerOpen", "NOT_GRANTED"]


def test_the_constrained_rungs_smaller_budget_leads_to_the_next_rung() -> None:
    # Given a ladder whose constrained rung allows 2 more turns, then a plan for a person
    ladder = DegradationPolicy(rungs=(R.FULL, R.CONSTRAINED, R.ASSISTED, R.REFUSAL), constrained_turns=2)

    def reads_forever(messages: Sequence[Mapping[str, Any]]) -> ModelReply:
        n = calls(messages)
        if n == 0:
            return reply(("provision_env", {"name": "e"}))
        return reply(("run_tests", {"suite": f"s{n}"}), n=n) if n < 6 else done()

    sim = sim_for(reads_forever, supervised(degradation=ladder), guard=breaker_open)
    rec = sim.run()
    # Then after its two constrained turns it is on the assisted rung: no tools, a plan, a person applies
    assert [e.rung for e in sim.of(RungChanged)] == [R.CONSTRAINED, R.ASSISTED]
    assert rec.grants.tools == frozenset() or not any(rec.grants.allows(t) for t in rec.grants.tools)
    assert rec.exit_reason is ExitReason.DEGRADED and result_of(rec)["status"] == "partial"
    assert "person applies the plan" in result_of(rec)["next_action"]


def test_the_restrict_stage_is_a_trigger() -> None:
    # Given a ladder, and a budget whose restrict stage (>= 90 % of turns) is reached
    def reads(messages: Sequence[Mapping[str, Any]]) -> ModelReply:
        n = calls(messages)
        return reply(("run_tests", {"suite": f"s{n}"}), n=n) if n < 9 else done()

    ceilings = {"turns": 10, "tokens": 1e6, "wall_seconds": 3000, "dollars": 50.0}
    sim = sim_for(reads, supervised(degradation=FULL_LADDER), ceilings=ceilings)
    rec = sim.run()
    (changed,) = sim.of(RungChanged)
    assert changed.rung is R.CONSTRAINED and changed.trigger == DegradeTrigger.RESTRICT_STAGE.value
    assert result_of(rec)["rung"] == "constrained"


@pytest.mark.parametrize("declared", [True, False], ids=["ladder declared", "control: no ladder"])
def test_entering_the_finalization_reserve_ends_on_the_assisted_rung(declared: bool) -> None:
    # Given dollars held back for finalization, and forward work that reaches them
    def reads(messages: Sequence[Mapping[str, Any]]) -> ModelReply:
        n = calls(messages)
        return reply(("run_tests", {"suite": f"s{n}"}), n=n) if n < 50 else done()

    pol = supervised(
        degradation=FULL_LADDER if declared else DegradationPolicy(),
        reserve=FinalizationReserve(dollars=0.995),
    )
    sim = sim_for(reads, pol, ceilings={"turns": 100, "tokens": 1e6, "wall_seconds": 3000, "dollars": 1.0})
    rec = sim.run()
    if declared:
        # Then it ends DEGRADED on the assisted rung, its partial work handed to a person
        assert rec.exit_reason is ExitReason.DEGRADED and rec.supervision.rung is R.ASSISTED
        assert result_of(rec)["done"] and escalations_of(sim, EscalationTrigger.DEGRADED)
    else:
        # Control: the budget's plain halt, no rung, and nothing routes the partial work to a person
        assert rec.exit_reason is ExitReason.BUDGET_EXCEEDED and rec.supervision.rung is R.FULL
        assert not escalations_of(sim, EscalationTrigger.DEGRADED)


def test_a_full_run_is_complete_on_the_full_rung() -> None:
    sim = sim_for(lambda m: reply(("run_tests", {"suite": "u"})) if calls(m) == 0 else done(), supervised())
    rec = sim.run()
    assert result_of(rec) == {
        "status": "complete",
        "rung": "full",
        "done": ["run_tests (call-0-0)"],
        "not_done": [],
        "next_action": "none",
    }


@pytest.mark.parametrize(
    ("kwargs", "where"),
    [
        ({"rungs": (R.CONSTRAINED, R.REFUSAL)}, "degradation.rungs"),
        ({"rungs": (R.FULL, R.CONSTRAINED)}, "degradation.rungs"),
        ({"rungs": (R.FULL, R.REFUSAL, R.CONSTRAINED)}, "degradation.rungs"),
        ({"rungs": (R.FULL, R.DETERMINISTIC, R.REFUSAL)}, "degradation.deterministic_answer"),
        ({"constrained_turns": 0}, "degradation.constrained_turns"),
    ],
)
def test_a_malformed_ladder_is_refused_naming_the_field(kwargs: dict[str, Any], where: str) -> None:
    with pytest.raises(DegradationPolicyError) as info:
        DegradationPolicy(**kwargs)
    assert info.value.where == where


@pytest.mark.parametrize(
    ("rungs", "trigger", "current", "target"),
    [
        ((R.FULL, R.CONSTRAINED, R.REFUSAL), DegradeTrigger.BREAKER_OPEN, R.FULL, R.CONSTRAINED),
        ((R.FULL, R.CONSTRAINED, R.REFUSAL), DegradeTrigger.BREAKER_OPEN, R.CONSTRAINED, None),
        ((R.FULL, R.CONSTRAINED, R.REFUSAL), DegradeTrigger.FINALIZATION_RESERVE, R.CONSTRAINED, R.REFUSAL),
        ((R.FULL, R.ASSISTED, R.REFUSAL), DegradeTrigger.BREAKER_OPEN, R.FULL, R.ASSISTED),
        ((R.FULL,), DegradeTrigger.BREAKER_OPEN, R.FULL, None),
    ],
)
def test_target_rung_rows(
    rungs: tuple[Rung, ...], trigger: DegradeTrigger, current: Rung, target: Rung | None
) -> None:
    assert DegradationPolicy(rungs=rungs).target(trigger, current) is target
