"""Repair episodes and commitment regions (recovery chapter §12.4.4, §12.5) through ``runtime.decide``."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from runtime.clock import FakeClock
from runtime.events import RepairEpisodeChanged
from runtime.obligations import ObligationState
from runtime.ports import OutcomeClass, Settlement, ToolOutcome
from runtime.repair import EpisodeState, RepairChoice, repair_or_rebuild
from runtime.states import TrajectoryState
from runtime.tools import Compensation, RepeatContract, SideEffect, ToolContract

from .sim import Sim, call, created, done, env_service, policy, provision_contracts, registry, tool_results

S = TrajectoryState
OB = ObligationState


# --------------------------------------------------------------------------- repair episodes


def test_the_repair_vs_rebuild_rule_is_equation_4() -> None:
    # Napkin Math 12.1: C_r = 4.09 s, C_f = 86.6 s: p* ~ 4.7 %
    assert repair_or_rebuild(0.5, 4.09, 86.6)[0] is RepairChoice.REPAIR
    assert repair_or_rebuild(0.04, 4.09, 86.6)[0] is RepairChoice.REBUILD
    assert repair_or_rebuild(None, None, None)[0] is RepairChoice.REPAIR


def invalid_forever(messages):  # type: ignore[no-untyped-def]
    return call("run_tests", f'{{"suite": {tool_results(messages)}}}', tool_results(messages))


def test_corrective_attempts_are_counted_at_admission_and_the_cap_pauses_for_a_person() -> None:
    # Given a model that keeps proposing invalid (but each time different) arguments
    clock = FakeClock()
    sim = Sim(invalid_forever, clock, pol=policy(repair_cap=2))
    sim.start(created(clock))
    rec = sim.run(until=clock.wall() + 60)
    # Then the first rejection opened an episode, two corrective attempts were admitted, the third refused,
    # and the trajectory waits for a person instead of burning its turn budget
    changes = [(e.state, e.attempts) for e in sim.of(RepairEpisodeChanged)]
    assert changes == [
        (EpisodeState.OPEN, 0),
        (EpisodeState.OPEN, 1),
        (EpisodeState.OPEN, 2),
        (EpisodeState.EXHAUSTED, 2),
    ]
    assert rec.state is S.PAUSED and rec.turn_count == 4
    assert sim.refusals()[-1]["reason"] == "REPAIR_EPISODE_EXHAUSTED"


def test_a_successful_repair_closes_the_episode() -> None:
    def script(messages):  # type: ignore[no-untyped-def]
        k = tool_results(messages)
        if k == 0:
            return call("run_tests", '{"suite": 1}', 0)  # wrong type: rejected locally
        if k == 1:
            return call("run_tests", {"suite": "fixed"}, 1)
        return done()

    clock = FakeClock()
    sim = Sim(script, clock)
    sim.start(created(clock))
    rec = sim.run()
    assert rec.state is S.COMPLETED
    assert rec.repairs["run_tests"].state is EpisodeState.CLOSED and rec.repairs["run_tests"].attempts == 1


def test_the_cost_rule_can_forbid_repairing_altogether() -> None:
    clock = FakeClock()
    pol = policy(repair_success_probability=0.01, repair_attempt_cost=4.0, repair_fallback_cost=80.0)
    sim = Sim(invalid_forever, clock, pol=pol)
    sim.start(created(clock))
    rec = sim.run(until=clock.wall() + 60)
    assert rec.repairs["run_tests"].choice is RepairChoice.REBUILD and rec.state is S.PAUSED
    assert "REBUILD_PREFERRED" in sim.refusals()[-1]["message"]


def test_an_endpoint_rejection_opens_an_episode_too() -> None:
    clock = FakeClock()

    def script(messages):  # type: ignore[no-untyped-def]
        return call("run_tests", {"suite": f"s{tool_results(messages)}"}, tool_results(messages))

    sim = Sim(script, clock, pol=policy(repair_cap=1))
    sim.tools.behaviour["run_tests"] = lambda inv: ToolOutcome(
        Settlement.ESTABLISHED_ABSENT, OutcomeClass.CLIENT_REJECTION, error="INVALID_ARGUMENT: no such suite"
    )
    sim.start(created(clock))
    rec = sim.run(until=clock.wall() + 60)
    # one corrective attempt reached the endpoint; the next was refused before dispatch
    assert sim.tools.delivered("run_tests") == 2 and rec.state is S.PAUSED


# --------------------------------------------------------------------------- pivots and the outbox


class PublishArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NotifyArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    recipient: str
    text: str


def release_contracts() -> list[ToolContract]:
    """validate (read-only check), publish (the pivot: commits provision_env, notifies afterwards)."""
    return [
        *provision_contracts(),
        ToolContract(
            name="validate",
            description="Validate an artifact.",
            arguments=PublishArgs,
            side_effect=SideEffect.READ_ONLY,
            repeat=RepeatContract.IDEMPOTENT,
            dependency_scope="registry",
        ),
        ToolContract(
            name="publish",
            description="Publish an artifact (irreversible).",
            arguments=PublishArgs,
            side_effect=SideEffect.IRREVERSIBLE,
            needs_approval=False,
            repeat=RepeatContract.NEVER_REPEAT,
            dependency_scope="registry",
            pivot=True,
            prechecks=("validate",),
            commits=("provision_env",),
            follow_up=(
                Compensation(
                    "announce",
                    from_args={"name": "text"},
                    fixed={"recipient": "subscribers"},
                    postcondition={"sent": True},
                ),
            ),
        ),
        ToolContract(
            name="announce",
            description="Notify recipients.",
            arguments=NotifyArgs,
            side_effect=SideEffect.IRREVERSIBLE,
            needs_approval=False,
            repeat=RepeatContract.IDEMPOTENT,
            dependency_scope="notifier",
        ),
    ]


def release_sim(plan: list[tuple[str, dict[str, Any]]]) -> Sim:
    def script(messages):  # type: ignore[no-untyped-def]
        k = tool_results(messages)
        return call(plan[k][0], plan[k][1], k) if k < len(plan) else done()

    clock = FakeClock()
    reg = registry(*release_contracts())
    reg.check_references()
    sim = Sim(script, clock, pol=policy(reg))
    env_service(sim.tools)
    sim.tools.behaviour["announce"] = lambda inv: ToolOutcome(
        Settlement.ESTABLISHED, OutcomeClass.SUCCESS, {"sent": True}
    )
    tools = frozenset({"provision_env", "release_env", "validate", "publish", "announce"})
    sim.start(created(clock, check="always", tools=tools))
    return sim


def test_a_pivot_is_refused_until_its_prechecks_have_passed() -> None:
    sim = release_sim(
        [("publish", {"name": "v1"}), ("validate", {"name": "v1"}), ("publish", {"name": "v1"})]
    )
    rec = sim.run()
    # the first publish was refused before dispatch; after validate passed, the second went out
    assert [d.tool for d in sim.tools.deliveries] == ["validate", "publish", "announce"]
    assert "PRECHECK_MISSING" in sim.refusals()[0]["message"]
    assert rec.state is S.COMPLETED


def test_an_established_pivot_commits_its_region_and_stages_its_follow_up_in_the_same_batch() -> None:
    plan = [("provision_env", {"name": "staging"}), ("validate", {"name": "v1"}), ("publish", {"name": "v1"})]
    sim = release_sim(plan)
    rec = sim.run()
    obligations = {o.duty + ":" + o.tool: o for o in rec.obligations.values()}
    # the environment is part of what the pivot committed: kept, not released
    assert obligations["compensation:release_env"].state is OB.COMMITTED
    assert len(sim.tools.allocated) == 1
    # the follow-up duty was staged with the pivot's outcome and delivered (verified by its postcondition)
    outbox = obligations["outbox:announce"]
    assert outbox.state is OB.DISCHARGED and outbox.arguments == {"text": "v1", "recipient": "subscribers"}
    batch = next(d for _, d in sim.decisions if any(getattr(e, "duty", None) == "outbox" for e in d.events))
    assert any(type(e).__name__ == "ToolResultAccepted" for e in batch.events)  # one durable batch
    assert sim.tools.delivered("announce") == 1


def test_while_a_pivots_outcome_is_unknown_nothing_that_relies_on_it_runs() -> None:
    plan = [("validate", {"name": "v1"}), ("publish", {"name": "v1"}), ("provision_env", {"name": "after"})]
    sim = release_sim(plan)
    sim.tools.behaviour["publish"] = lambda inv: ToolOutcome(
        Settlement.UNKNOWN, OutcomeClass.INFRASTRUCTURE_FAILURE, error="reply lost"
    )
    rec = sim.run()
    assert sim.tools.delivered("provision_env") == 0
    assert "PIVOT_UNRESOLVED" in sim.refusals()[-1]["message"] and rec.is_terminal
