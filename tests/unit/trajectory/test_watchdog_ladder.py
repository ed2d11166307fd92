"""The watchdog ladder through ``decide`` (recovery chapter §12.6, reliability guide §4.4-§4.5, issue 12).

Each detector is driven by a stub agent whose behaviour the test controls (guide §13.4) and must climb
inform -> constrain -> hold, far below the budget; every row has a control run with the protection off
(the detector desensitised, or no task-state projection declared) in which the same judge fails.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from runtime.escalation import EscalationStatus, EscalationTrigger
from runtime.events import CallWithheld, GrantNarrowed, WatchdogFired
from runtime.incident import HoldKind
from runtime.ports import ModelReply, OutcomeClass, Settlement, ToolInvocation, ToolOutcome
from runtime.progress import ProgressRule, ProgressSpec
from runtime.record import ControlAction
from runtime.states import ExitReason, TrajectoryState
from runtime.supervision import LadderRung, OnHold, WatchdogLadder
from runtime.watchdog import WatchdogConfig

from .sim import Sim, done
from .supervised import calls, escalations_of, reply, sim_for, supervised

S = TrajectoryState
OFF = WatchdogConfig(exact_window=50, exact_limit=50, coarse_window=50, coarse_limit=50)
"""The call-level detectors desensitised past any budget here: the control runs' protection is off."""
PATCHES = ProgressSpec({"apply_patch": ProgressRule(fields=("failing",))})
CEILINGS = {"turns": 20, "tokens": 1e6, "wall_seconds": 3000, "dollars": 50.0}


# --------------------------------------------------------------------------- stub agents


def same_read(messages: Sequence[Mapping[str, Any]]) -> ModelReply:
    return reply(("read_log", {"query": "why is it failing"}), n=calls(messages))


def invalid_read(messages: Sequence[Mapping[str, Any]]) -> ModelReply:
    return reply(("read_log", '{"query": '), n=calls(messages))


_VARIANTS = ("Pytest", "pytest ", "  PYTEST", "pytest\t", "PyTest", "pyTEST  ", "PYtest")


def varied_search(messages: Sequence[Mapping[str, Any]]) -> ModelReply:
    """Evades exact matching: case and whitespace change every time (guide §4.5)."""
    n = calls(messages)
    return reply(("search", {"query": _VARIANTS[n % len(_VARIANTS)]}), n=n)


def oscillating_patch(messages: Sequence[Mapping[str, Any]]) -> ModelReply:
    """Fix A breaks B, fix B breaks A: every patch differs, the task state alternates."""
    n = calls(messages)
    return reply(("apply_patch", {"patch": f"attempt {n}"}), n=n)


def alternating(inv: ToolInvocation) -> ToolOutcome:
    n = int(str(inv.arguments["patch"]).split()[-1])
    failing = ["test_a"] if n % 2 == 0 else ["test_b"]
    return ToolOutcome(Settlement.ESTABLISHED, OutcomeClass.SUCCESS, {"failing": failing, "at": n})


def restating_reads(messages: Sequence[Mapping[str, Any]]) -> ModelReply:
    """Differs every turn, changes nothing: stagnation."""
    n = calls(messages)
    return reply(("read_log", {"query": f"look again #{n}"}), n=n)


# --------------------------------------------------------------------------- the rows


@dataclass(frozen=True)
class Loop:
    name: str
    script: Any
    guard: str
    rung_turns: tuple[int, int, int]  # turns at which inform, constrain and hold answered
    delivered: int  # calls that reached the tool before the hold
    exit_reason: ExitReason
    settings: Mapping[str, Any] = field(default_factory=dict)
    control: Mapping[str, Any] = field(default_factory=dict)  # the same stub, the protection off
    behaviour: Mapping[str, Any] = field(default_factory=dict)


LOOPS = [
    Loop("exact repetition", same_read, "exact_repeat", (3, 4, 5), 2, ExitReason.REPEATED_ACTION,
         control={"watchdog": OFF}),
    Loop("an invalid call repeated", invalid_read, "exact_repeat", (3, 4, 5), 0, ExitReason.REPEATED_ACTION,
         control={"watchdog": OFF}),
    Loop("trivial variation evades exact matching", varied_search, "trivial_variation", (5, 6, 7), 4,
         ExitReason.REPEATED_ACTION,
         control={"watchdog": WatchdogConfig(coarse_window=50, coarse_limit=50)}),
    Loop("cycle over the task state", oscillating_patch, "cycle", (4, 5, 6), 5, ExitReason.CYCLING,
         settings={"progress": PATCHES}, control={"progress": ProgressSpec()},
         behaviour={"apply_patch": alternating}),
    Loop("stagnation over K turns", restating_reads, "stagnation", (6, 7, 8), 8, ExitReason.STAGNATED,
         settings={"progress": PATCHES}, control={"progress": ProgressSpec()}),
]  # fmt: skip


def _run(row: Loop, settings: Mapping[str, Any], ladder: WatchdogLadder | None = None) -> Sim:
    sim = sim_for(row.script, supervised(ladder=ladder, **settings), ceilings=CEILINGS)
    sim.tools.behaviour.update(row.behaviour)
    sim.run(until=sim.clock.wall() + 600)
    return sim


def held_early(sim: Sim, guard: str) -> bool:
    """The judge: held by ``guard``'s watchdog before turn 10 of a 20-turn budget, and nothing admitted
    while held."""
    rec = sim.rec
    return (
        rec.hold is not None
        and rec.hold.kind is HoldKind.WATCHDOG
        and rec.hold.guard == guard
        and rec.turn_count < 10
        and rec.state is S.READY
        and rec.turn_request is None
    )


@pytest.mark.parametrize("row", LOOPS, ids=[r.name for r in LOOPS])
def test_each_detector_climbs_inform_constrain_hold(row: Loop) -> None:
    # Given a stub agent looping in the row's way
    # When it runs (ten minutes of fake time; the deadline is an hour away)
    sim = _run(row, row.settings)
    # Then its detector answered three times, one rung each, at the expected turns
    fired = sim.of(WatchdogFired)
    assert [(f.guard, f.rung) for f in fired] == [(row.guard, r.value) for r in LadderRung]
    assert tuple(f.evidence["turn"] for f in fired) == row.rung_turns
    # inform withheld the proposal with a factual observation; constrain narrowed the grant
    assert sim.of(GrantNarrowed) and sim.of(GrantNarrowed)[0].reason.startswith(f"watchdog {row.guard}")
    # and it is held: nothing more was admitted in ten minutes, nothing reached the tool after the hold
    assert held_early(sim, row.guard)
    assert len(sim.tools.deliveries) == row.delivered
    # with an escalation carrying the detector's evidence, an owner and an SLA
    (esc,) = escalations_of(sim, EscalationTrigger.GUARD)
    assert esc.evidence["guard"] == row.guard and esc.evidence["rung"] == "hold" and esc.owner
    assert esc.due_at > esc.opened_at and esc.status is EscalationStatus.OPEN
    assert esc.handoff["why"]["trigger"] == "guard" and esc.handoff["goal"] == "Make the tests pass."


@pytest.mark.parametrize("row", LOOPS, ids=[r.name for r in LOOPS])
def test_control_with_the_detector_off_the_loop_runs_on(row: Loop) -> None:
    # Given the same stub with the row's protection off
    sim = _run(row, {**row.settings, **row.control})
    # Then the judge fails: no watchdog answers it and nothing holds it early (it runs to its budget, or
    # another protection, such as a repair episode's cap, stops it)
    assert not held_early(sim, row.guard) and not sim.of(WatchdogFired)


@pytest.mark.parametrize("row", LOOPS, ids=[r.name for r in LOOPS])
def test_only_a_policy_ends_a_held_loop_and_never_as_an_error(row: Loop) -> None:
    # Given the policy that ends a held trajectory
    sim = _run(row, row.settings, WatchdogLadder(on_hold=OnHold.END))
    # Then it ends at the hold rung, FAILED with the detector's own exit reason
    rec = sim.rec
    assert rec.state is S.FAILED and rec.exit_reason is row.exit_reason
    assert rec.exit_reason is not ExitReason.ERROR and rec.turn_count == row.rung_turns[2]


def test_a_held_loop_is_ended_by_the_hold_timeout_when_nobody_acts() -> None:
    # Given a policy: held longer than 120 s and nobody resumed it, end it
    row = LOOPS[0]
    sim = sim_for(row.script, supervised(ladder=WatchdogLadder(hold_timeout_s=120.0)), ceilings=CEILINGS)
    sim.run(until=sim.clock.wall() + 60)
    assert held_early(sim, "exact_repeat")
    # When the timeout passes
    rec = sim.run(until=sim.clock.wall() + 120)
    # Then the policy ended it, with the loop's exit reason; the escalation says the hold is over
    assert rec.state is S.FAILED and rec.exit_reason is ExitReason.REPEATED_ACTION
    assert escalations_of(sim, EscalationTrigger.GUARD)[0].status is EscalationStatus.RESOLVED


def test_resume_releases_a_watchdog_hold_with_a_fresh_window() -> None:
    # Given a trajectory held by the exact-repeat watchdog, whose agent then changes its approach
    def script(messages: Sequence[Mapping[str, Any]]) -> ModelReply:
        n = calls(messages)
        if n < 5:
            return reply(("read_log", {"query": "why is it failing"}), n=n)
        return reply(("run_tests", {"suite": "unit"}), n=n) if n == 5 else done()

    sim = sim_for(script, supervised(), ceilings=CEILINGS)
    sim.run(until=sim.clock.wall() + 60)
    assert held_early(sim, "exact_repeat")
    # When an operator resumes it
    sim.control("r1", ControlAction.RESUME, reason="looked at it: carry on")
    rec = sim.run()
    # Then the hold is lifted, the escalation resolved, and the run goes on to completion
    assert rec.state is S.COMPLETED and rec.hold is None
    assert escalations_of(sim, EscalationTrigger.GUARD)[0].status is EscalationStatus.RESOLVED
    assert sim.tools.delivered("run_tests") == 1


# --------------------------------------------------------------------------- waiting on a long job


def polling_agent(messages: Sequence[Mapping[str, Any]]) -> ModelReply:
    n = calls(messages)
    return reply(("job_status", {"job": "test_r18"}), n=n) if n < 9 else done()


def job(inv: ToolInvocation, polls: list[int] = []) -> ToolOutcome:  # noqa: B006 - a counter per test
    polls.append(1)
    state = "running" if len(polls) < 8 else "done"
    return ToolOutcome(Settlement.ESTABLISHED, OutcomeClass.SUCCESS, {"state": state, "job": "test_r18"})


@pytest.mark.parametrize("declared", [True, False], ids=["waiting declared", "control: not declared"])
def test_a_trajectory_waiting_on_a_long_job_is_exempt(declared: bool) -> None:
    # Given a background job polled every turn (the same call, the same "running" answer, for 8 turns)
    rule = ProgressRule(waiting={"state": ("running",)} if declared else {})
    spec = ProgressSpec({"job_status": rule, "apply_patch": ProgressRule()})
    polls: list[int] = []
    sim = sim_for(polling_agent, supervised(progress=spec), ceilings=CEILINGS)
    sim.tools.behaviour["job_status"] = lambda inv: job(inv, polls)
    rec = sim.run(until=sim.clock.wall() + 600)
    if declared:
        # Then polling a running job is neither a repetition nor stagnation: it completes
        assert rec.state is S.COMPLETED and not sim.of(WatchdogFired) and not sim.of(CallWithheld)
    else:
        # Control: without the declared marker the same polling is held as a loop
        assert rec.hold is not None and not rec.is_terminal


def test_an_agent_insisting_on_a_removed_tool_climbs_to_the_hold() -> None:
    # Given the constrain rung took read_log away, and the agent keeps proposing it
    sim = _run(LOOPS[0], {})
    fired = sim.of(WatchdogFired)
    # Then the third answer (the hold) was to a proposal of the removed tool
    assert fired[1].evidence["removed"] == ["read_log"]
    assert "took it away" in fired[2].detail and sim.rec.hold is not None


def test_the_ladder_is_declared_per_workload() -> None:
    # Given a workload whose ladder holds at the first firing
    row = LOOPS[0]
    sim = sim_for(row.script, supervised(ladder=WatchdogLadder((LadderRung.HOLD,))), ceilings=CEILINGS)
    sim.run(until=sim.clock.wall() + 60)
    # Then the third identical call is the hold, without inform or constrain
    assert [f.rung for f in sim.of(WatchdogFired)] == ["hold"] and held_early(sim, "exact_repeat")


def test_ladder_rows_through_the_pure_policy() -> None:
    ladder = WatchdogLadder()
    assert [ladder.rung(n) for n in (1, 2, 3, 4, 9)] == [
        LadderRung.INFORM,
        LadderRung.CONSTRAIN,
        LadderRung.HOLD,
        LadderRung.HOLD,
        LadderRung.HOLD,
    ]
    from runtime.supervision import SupervisionPolicyError

    with pytest.raises(SupervisionPolicyError) as info:
        WatchdogLadder((LadderRung.INFORM,))
    assert info.value.where == "watchdog.ladder"
