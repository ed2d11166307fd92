"""Delegation to child trajectories through ``decide`` (reliability guide §11, §13.3; issue 12).

A delegation call becomes a child under a contract made from the workload's template; budgets partition
(a child's allocation comes out of the parent's remaining pool, so the parent and all its children together
never spend more than the parent has), depth and concurrency are bounded, the parent waits for its
children as for its calls, a child's report is judged by the parent's own check over evidence (the
"sub-agent reports wrongly" fault), and cancel and kill cascade. Controls are mutations of the rule that
protects: budgets replicated instead of partitioned, a parent that trusts the child's claim.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import pytest

from runtime import _decide_children
from runtime.context import build_messages
from runtime.delegation import (
    ChildCheck,
    ChildCheckKind,
    ChildEvidence,
    ChildToolResult,
    DelegationPolicy,
    OnFailure,
)
from runtime.effects import CancelChild, SpawnChild
from runtime.escalation import EscalationTrigger
from runtime.events import ChildSettled, ChildSpawned
from runtime.inputs import ChildFinished
from runtime.ports import ModelReply
from runtime.record import ControlAction
from runtime.states import ExitReason, TrajectoryState

from .sim import Sim, done
from .supervised import calls, escalations_of, reply, sim_for, supervised

S = TrajectoryState
CEILINGS = {"turns": 30, "tokens": 200_000, "wall_seconds": 3000, "dollars": 1.0}
TEMPLATE = DelegationPolicy(
    tool="delegate",
    max_depth=1,
    max_children=3,
    budget={"turns": 5, "tokens": 20_000, "dollars": 0.3},
    deadline_s=600.0,
    grants=("run_tests",),
    check=ChildCheck(ChildCheckKind.TOOL_RESULT, tool="run_tests", field="passed", equals=True),
    metadata={"scenario": "finish_after:2"},
)
GOALS = ("fix the pool", "fix the cache", "fix the retry")


def delegate_all(messages: Sequence[Mapping[str, Any]]) -> ModelReply:
    """One reply delegating three sub-tasks in parallel, then done."""
    if calls(messages) == 0:
        return reply(*(("delegate", {"goal": g}) for g in GOALS))
    return done()


def _parent(template: DelegationPolicy = TEMPLATE, **kw: Any) -> Sim:
    sim = sim_for(delegate_all, supervised(delegation=template), ceilings=CEILINGS, **kw)
    sim.run(until=sim.clock.wall() + 1)
    return sim


def honest(spend: float = 0.05, passed: bool = True) -> ChildEvidence:
    result = ChildToolResult(
        "run_tests", "established", None, {"passed": passed, "failed": 0 if passed else 2}
    )
    return ChildEvidence("COMPLETED", "COMPLETED", True, (result,), {"turns": 3, "dollars": spend}, "Done.")


def liar() -> ChildEvidence:
    """The sub-agent reports success; its own log says the suite failed (guide §13.3)."""
    result = ChildToolResult("run_tests", "established", None, {"passed": False, "failed": 3})
    claim = "All tests pass now. The fix is complete and verified."
    return ChildEvidence("COMPLETED", "COMPLETED", True, (result,), {"turns": 4, "dollars": 0.08}, claim)


def total_exposure(sim: Sim) -> float:
    """The judge: the parent's own dollars plus the most every child may spend (its allocation, or what
    it spent once settled)."""
    rec = sim.rec
    own = rec.spend.get("dollars") - sum(
        c.spent.get("dollars", 0.0) if c.status == "settled" else c.allocation.get("dollars", 0.0)
        for c in rec.supervision.children.values()
    )
    children = sum(e.contract.allocation.get("dollars", 0.0) for e in sim.spawned)
    return own + children


# --------------------------------------------------------------------------- spawning


def test_three_children_are_spawned_under_contracts_drawn_from_the_parents_pool() -> None:
    sim = _parent(TEMPLATE)
    rec = sim.rec
    # Then three children run, each its own contract; the parent waits for them in WAITING_TOOL
    assert rec.state is S.WAITING_TOOL and len(sim.spawned) == 3
    contracts = [e.contract for e in sim.spawned]
    assert [c.goal for c in contracts] == list(GOALS)
    assert {c.child_id for c in contracts} == {"t1.c1", "t1.c2", "t1.c3"}
    for c in contracts:
        assert c.allocation == {"turns": 5, "tokens": 20_000, "dollars": 0.3}
        assert c.deadline <= rec.deadline and c.depth == 1 and c.grants == ("run_tests",)
        assert c.check == TEMPLATE.check and c.on_failure is OnFailure.REPORT
    # and their allocations are charged to the parent at once: its own work cannot spend them
    assert rec.spend.get("dollars") > 0.9 and rec.spend.get("turns") == 1 + 15


def _replicating(policy: DelegationPolicy, record: Any) -> tuple[dict[str, float], str]:
    """The mutation: every child gets the template's whole budget, whatever the parent has left."""
    return dict(policy.budget), ""


@pytest.mark.parametrize("mutated", [False, True], ids=["partitioned", "control: replicated budgets"])
def test_the_children_can_never_spend_more_than_the_parent_has(
    mutated: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given children that ask for 0.4 of a 1.0 dollar pool each
    if mutated:
        monkeypatch.setattr(_decide_children, "allocate", _replicating)
    template = replace(TEMPLATE, budget={"dollars": 0.4, "turns": 5})
    sim = _parent(template)
    # Then (the judge) the parent's own spend plus everything its children may spend fits its ceiling:
    # the third child is refused when the remainder falls below the floor
    fits = total_exposure(sim) <= CEILINGS["dollars"]
    assert fits is not mutated
    if not mutated:
        assert len(sim.spawned) == 2 and [r["reason"] for r in sim.refusals()] == ["DELEGATION_BUDGET"]


def test_the_concurrency_cap_and_the_depth_bound_refuse_before_anything_starts() -> None:
    capped = _parent(replace(TEMPLATE, max_children=2))
    assert len(capped.spawned) == 2 and [r["reason"] for r in capped.refusals()] == ["DELEGATION_LIMIT"]
    deep = _parent(replace(TEMPLATE, depth=1))
    assert not deep.spawned and [r["reason"] for r in deep.refusals()] == ["DELEGATION_DEPTH"] * 3
    assert deep.run().state is S.COMPLETED  # the parent goes on without them


# --------------------------------------------------------------------------- reports are untrusted


def test_verified_children_settle_their_real_spend_and_the_parent_goes_on() -> None:
    sim = _parent()
    for child in ("t1.c1", "t1.c2", "t1.c3"):
        sim.feed(ChildFinished(child, honest(spend=0.05)))
    rec = sim.run()
    # Then each allocation (0.3) was replaced by what the child spent (0.05), and the parent completed
    assert rec.state is S.COMPLETED
    assert all(e.verified for e in sim.of(ChildSettled))
    assert rec.spend.get("dollars") == pytest.approx(0.15, abs=0.01) and rec.spend.get("turns") == 2 + 9
    # and its model saw each report as the delegate call's result
    messages = build_messages(rec.transcript)  # type: ignore[arg-type]
    answers = [m["content"] for m in messages if m.get("role") == "tool"]
    assert len(answers) == 3 and all('"status": "VERIFIED"' in a for a in answers)


def _trusting(check: ChildCheck, evidence: ChildEvidence) -> tuple[bool, str]:
    """The mutation: a parent that believes what the child says about its work."""
    return "pass" in evidence.claim.lower(), "the child says so"


@pytest.mark.parametrize("mutated", [False, True], ids=["parent's check", "control: trusts the claim"])
def test_a_child_that_reports_wrongly_is_caught_by_the_parents_check(
    mutated: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if mutated:
        monkeypatch.setattr(_decide_children, "verify", _trusting)
    sim = _parent()
    # When the first child claims success while its own log shows a failing suite
    sim.feed(ChildFinished("t1.c1", liar()))
    (settled,) = sim.of(ChildSettled)
    # Then (the judge) the parent does not accept the report; the report the model sees says so
    assert settled.verified is mutated
    if not mutated:
        assert settled.report["status"] == "FAILED_CHECK" and "passed=False" in settled.detail
        assert settled.report["claimed_unverified"].startswith("All tests pass")


@pytest.mark.parametrize(
    ("on_failure", "parent_state", "exit_reason"),
    [
        (OnFailure.REPORT, S.WAITING_TOOL, None),
        (OnFailure.ESCALATE, S.WAITING_TOOL, None),
        (OnFailure.ABORT_PARENT, S.FAILED, ExitReason.DELEGATION_FAILED),
    ],
)
def test_the_contracts_failure_policy_decides_what_a_failed_child_means(
    on_failure: OnFailure, parent_state: TrajectoryState, exit_reason: ExitReason | None
) -> None:
    sim = _parent(replace(TEMPLATE, on_failure=on_failure))
    sim.feed(ChildFinished("t1.c1", liar()))
    rec = sim.run(until=sim.clock.wall() + 1)
    assert rec.state is parent_state and rec.exit_reason is exit_reason
    assert bool(escalations_of(sim, EscalationTrigger.DELEGATION)) is (on_failure is OnFailure.ESCALATE)
    if on_failure is OnFailure.ABORT_PARENT:
        # the siblings are stopped with it
        assert {c.child_id for c in sim.cancelled_children} == {"t1.c2", "t1.c3"}


# --------------------------------------------------------------------------- cascades


@pytest.mark.parametrize("action", [ControlAction.KILL, ControlAction.CANCEL])
def test_cancel_and_kill_cascade_to_every_live_child_at_once(action: ControlAction) -> None:
    sim = _parent()
    sim.feed(ChildFinished("t1.c1", honest()))
    # When the parent is killed (or cancelled) while two children still run
    sim.control("k1", action)
    rec = sim.run(until=sim.clock.wall() + 1)
    # Then both live children are told at once, and the parent ends without waiting for them
    assert {(c.child_id, c.kill) for c in sim.cancelled_children} == {
        ("t1.c2", action is ControlAction.KILL),
        ("t1.c3", action is ControlAction.KILL),
    }
    assert rec.is_terminal and rec.exit_reason in (ExitReason.KILLED, ExitReason.CANCELED)
    # and a child's evidence arriving afterwards still settles what it really spent
    sim.feed(ChildFinished("t1.c2", honest(spend=0.01)))
    assert sim.rec.supervision.children["t1.c2"].spent == {"turns": 3, "dollars": 0.01}


def test_a_restarted_parent_attaches_again_to_its_live_children() -> None:
    sim = _parent()
    sim.feed(ChildFinished("t1.c1", honest()))
    sim.restart()
    again = [e for e in sim.effects if isinstance(e, SpawnChild)][3:]
    assert sorted(e.contract.child_id for e in again) == ["t1.c2", "t1.c3"]
    assert sim.rec.state is S.WAITING_TOOL and len(sim.of(ChildSpawned)) == 3


def test_a_parent_that_ends_for_any_reason_stops_its_children() -> None:
    # Given the parent's deadline passes while its children run
    sim = sim_for(delegate_all, supervised(delegation=TEMPLATE), ceilings=CEILINGS)
    rec = sim.run()
    assert rec.exit_reason is ExitReason.DEADLINE_EXCEEDED
    assert {c.child_id for c in sim.cancelled_children} == {"t1.c1", "t1.c2", "t1.c3"}
    assert not any(isinstance(e, CancelChild) and e.child_id == "t1.c4" for e in sim.effects)
