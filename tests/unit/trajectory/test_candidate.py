"""Candidate revisions (recovery chapter §12.9.3, table 10, row 5 "candidate changes after a check") through
``runtime.decide``: earlier evidence keeps its scope, and the changed candidate's required checks are not
skipped."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict

from runtime.clock import FakeClock
from runtime.errors import IllegalEvent
from runtime.events import CandidateChecked, CandidateRevised, CompletionChecked
from runtime.fold import apply, fold
from runtime.ports import ModelReply, OutcomeClass, Settlement, ToolInvocation, ToolOutcome
from runtime.record import CompletionCheck, TaskContract
from runtime.states import TrajectoryState
from runtime.tools import CandidateRole, RepeatContract, SideEffect, ToolContract, ToolRegistry

from .sim import Sim, SuiteArgs, call, created, done, policy, tool_results

S = TrajectoryState


class PatchArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: str


def contracts() -> list[ToolContract]:
    """``patch`` revises the candidate; ``run_tests`` (re-registered) and ``lint`` check it."""
    patch = ToolContract(
        name="patch",
        description="Change the candidate.",
        arguments=PatchArgs,
        side_effect=SideEffect.IRREVERSIBLE,
        needs_approval=False,
        repeat=RepeatContract.IDEMPOTENT,
        dependency_scope="workspace",
        candidate=CandidateRole.REVISES,
    )
    checks = [
        ToolContract(
            name=name,
            description=f"{name} the candidate.",
            arguments=SuiteArgs,
            side_effect=SideEffect.READ_ONLY,
            repeat=RepeatContract.IDEMPOTENT,
            dependency_scope="test-service",
            candidate=CandidateRole.CHECKS,
        )
        for name in ("run_tests", "lint")
    ]
    return [patch, *checks]


def scripted(*steps: tuple[str, Mapping[str, Any]]):  # type: ignore[no-untyped-def]
    """The model makes ``steps`` one per turn, then claims it is done."""

    def script(messages: Sequence[Mapping[str, Any]]) -> ModelReply:
        k = tool_results(messages)
        return call(steps[k][0], steps[k][1], k) if k < len(steps) else done()

    return script


def sim_of(*steps: tuple[str, Mapping[str, Any]], required: Sequence[str] = ()) -> Sim:
    clock = FakeClock()
    reg = ToolRegistry()
    for c in contracts():
        reg.register(c)
    tools = frozenset({"patch", "run_tests", "lint"})
    params: dict[str, Any] = {"tools": list(required)} if required else {}
    start = dataclasses.replace(
        created(clock, tools=tools),
        contract=TaskContract("Fix the bug.", CompletionCheck("candidate_checked", params)),
    )
    sim = Sim(scripted(*steps), clock, pol=policy(reg))
    sim.start(start)
    return sim


PATCH_A = ("patch", {"text": "a"})
PATCH_B = ("patch", {"text": "b"})
TESTS = ("run_tests", {"suite": "unit"})
LINT = ("lint", {"suite": "style"})


def verdict(sim: Sim) -> CompletionChecked:
    checked = sim.of(CompletionChecked)
    assert len(checked) == 1
    return checked[0]  # type: ignore[no-any-return]


def test_a_check_of_an_earlier_revision_does_not_complete_a_changed_candidate() -> None:
    # Given a candidate patched, tested (passing), then patched again, and an end of turn
    sim = sim_of(PATCH_A, TESTS, PATCH_B)
    rec = sim.run()
    # Then the passing test stays with revision 1; revision 2 has no check, so completion is refused
    assert [(r.number, r.tool, [c.tool for c in r.checks]) for r in rec.revisions] == [
        (0, None, []),
        (1, "patch", ["run_tests"]),
        (2, "patch", []),
    ]
    check = verdict(sim)
    assert not check.passed and rec.state is S.FAILED and rec.check_passed is False
    assert "revision 2" in check.detail and "revision(s) [1] do not count" in check.detail
    # the record names each check's identity (operation and call) under its revision
    evidence = rec.revisions[1].checks[0]
    assert evidence.call_id == "call-1" and rec.operations[evidence.operation_id].tool == "run_tests"


def test_the_changed_candidate_completes_once_its_own_check_passes() -> None:
    sim = sim_of(PATCH_A, TESTS, PATCH_B, TESTS)
    rec = sim.run()
    assert verdict(sim).passed and rec.state is S.COMPLETED
    assert [[c.call_id for c in r.checks] for r in rec.revisions] == [[], ["call-1"], ["call-3"]]
    # the second run of the same suite reached the service: nothing was answered from the first one
    assert sim.tools.delivered("run_tests") == 2


def test_a_failing_check_of_the_current_revision_fails_completion() -> None:
    sim = sim_of(PATCH_A, TESTS)
    sim.tools.behaviour["run_tests"] = lambda inv: ToolOutcome(
        Settlement.ESTABLISHED, OutcomeClass.SUCCESS, {"passed": False, "failed": 2}
    )
    rec = sim.run()
    check = verdict(sim)
    assert not check.passed and "failed (2 failing)" in check.detail
    assert rec.revisions[-1].checks[0].passed is False


def test_every_required_check_must_pass_on_the_current_revision() -> None:
    # lint passed on revision 1, but the contract requires run_tests too
    sim = sim_of(PATCH_A, LINT, required=["run_tests", "lint"])
    sim.run()
    check = verdict(sim)
    assert not check.passed and "run_tests has not run" in check.detail
    sim = sim_of(PATCH_A, TESTS, LINT, required=["run_tests", "lint"])
    assert sim.run().state is S.COMPLETED


def test_checks_of_the_candidate_as_given_count_until_it_changes() -> None:
    sim = sim_of(TESTS)
    rec = sim.run()
    assert rec.state is S.COMPLETED and [r.number for r in rec.revisions] == [0]


def test_an_unknown_outcome_of_a_revising_call_opens_a_revision_in_doubt() -> None:
    # Given a patch whose reply says nothing about what happened (the candidate may have changed)
    sim = sim_of(TESTS, PATCH_A)

    def unknown(inv: ToolInvocation) -> ToolOutcome:
        return ToolOutcome(Settlement.UNKNOWN, OutcomeClass.INFRASTRUCTURE_FAILURE, error="connection reset")

    sim.tools.behaviour["patch"] = unknown
    rec = sim.run(until=sim.clock.wall() + 120)
    # Then the earlier passing test no longer vouches for the candidate: a revision in doubt follows it
    revised = sim.of(CandidateRevised)
    assert revised and revised[0].in_doubt and len(revised) == 1  # once per operation, retries included
    assert rec.revisions[-1].in_doubt and rec.revisions[-1].checks == ()
    assert rec.check_passed is not True


def test_a_patch_that_was_refused_leaves_the_candidate_as_it_was() -> None:
    sim = sim_of(TESTS, PATCH_A)
    sim.tools.behaviour["patch"] = lambda inv: ToolOutcome(
        Settlement.ESTABLISHED_ABSENT, OutcomeClass.CLIENT_REJECTION, error="INVALID_ARGUMENT: conflict"
    )
    rec = sim.run(until=sim.clock.wall() + 120)
    assert sim.of(CandidateRevised) == [] and [r.number for r in rec.revisions] == [0]


def test_the_fold_keeps_revisions_in_order_and_each_verdict_once() -> None:
    sim = sim_of(PATCH_A, TESTS)
    sim.run()
    upto = next(i for i, ev in enumerate(sim.log) if isinstance(ev, CandidateChecked))
    rec = fold(sim.log[: upto + 1], sim.policy)  # mid-run (a terminal record absorbs everything)
    with pytest.raises(IllegalEvent, match="revision_order"):
        apply(rec, CandidateRevised(5, "op-x", "patch"))
    with pytest.raises(IllegalEvent, match="already_revised"):
        apply(rec, CandidateRevised(2, rec.revisions[1].operation_id or "", "patch"))
    done_check = rec.revisions[1].checks[0]
    with pytest.raises(IllegalEvent, match="already_checked"):
        apply(rec, CandidateChecked(1, done_check.operation_id, "run_tests", True, "again"))
    with pytest.raises(IllegalEvent, match="unknown_revision"):
        apply(rec, CandidateChecked(7, "op-y", "run_tests", True, "x"))
