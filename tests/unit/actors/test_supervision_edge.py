"""Supervision at the edge, without Ray or Redis (issue 12): the quarantine gate at the dispatch boundary,
the workload's supervision section, the child launch, and the driver's escalation tallies."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from actors.children import child_launch
from actors.launch import ProviderLaunch, TrajectoryLaunch
from actors.quarantine import ArtifactQuarantined, QuarantineGate
from actors.wiring import build_created, build_policy, build_registry
from cluster.observe import SlaTally, supervision_counts
from cluster.workload import WorkloadError, parse_workload
from runtime.degradation import Rung
from runtime.delegation import ChildCheckKind, DelegationContract, OnFailure
from runtime.escalation import EscalationTrigger
from runtime.ports import OutcomeClass, ProbeResult, Settlement, ToolInvocation, ToolOutcome
from runtime.supervision import LadderRung, OnHold
from testbed.tools.ledger import Ledger
from testbed.tools.services import note_id_of


class Tools:
    def __init__(self) -> None:
        self.sent: list[str] = []

    async def invoke(self, invocation: ToolInvocation) -> ToolOutcome:
        self.sent.append(invocation.call_id)
        return ToolOutcome(Settlement.ESTABLISHED, OutcomeClass.SUCCESS, {"ok": True})

    async def probe(self, tool: str, effect_key: str, deadline: float) -> ProbeResult:
        return ProbeResult(Settlement.UNKNOWN, None, "")

    async def cancel(self, tool: str, effect_key: str) -> None:
        return None


class Quarantine:
    def __init__(self, held: dict[str, str] | None = None, broken: bool = False) -> None:
        self.held = held or {}
        self.broken = broken

    async def quarantined(self, values: Sequence[str]) -> dict[str, str]:
        if self.broken:
            raise ConnectionError("redis is away")
        return {v: self.held[v] for v in values if v in self.held}


def invocation(args: dict[str, Any]) -> ToolInvocation:
    return ToolInvocation("t1", "c1", "read_note", args, "ek", "op", "op#a1", 9e9)


@pytest.mark.parametrize(
    ("held", "args", "refused"),
    [
        ({"note-abc": "inc-1"}, {"note_id": "note-abc"}, True),
        ({"note-abc": "inc-1"}, {"filter": {"ids": ["x", "note-abc"]}}, True),  # nested
        ({"note-abc": "inc-1"}, {"note_id": "note-xyz"}, False),
        ({}, {"note_id": "note-abc"}, False),  # control: nothing quarantined, the same call is sent
    ],
)
async def test_a_quarantined_artifact_is_refused_at_the_dispatch_boundary(
    held: dict[str, str], args: dict[str, Any], refused: bool
) -> None:
    tools = Tools()
    gate = QuarantineGate(tools, Quarantine(held))
    if refused:
        with pytest.raises(ArtifactQuarantined) as info:
            await gate.invoke(invocation(args))
        assert "note-abc (incident inc-1)" in str(info.value) and not tools.sent
    else:
        await gate.invoke(invocation(args))
        assert tools.sent == ["c1"]


async def test_registered_cleanup_of_a_quarantined_resource_is_not_refused() -> None:
    # Given an environment an incident quarantined, released by its trajectory's registered cleanup
    tools = Tools()
    gate = QuarantineGate(tools, Quarantine({"env-1": "inc-1"}))
    cleanup = ToolInvocation(
        "t1", "cleanup:obl-op-1", "release_env", {"env_id": "env-1"}, "ek", "cop", "cop#a1", 9e9
    )
    # Then it goes through (residual settlement), while the same id as a model-directed call does not
    await gate.invoke(cleanup)
    with pytest.raises(ArtifactQuarantined):
        await gate.invoke(
            ToolInvocation("t2", "c2", "release_env", {"env_id": "env-1"}, "ek2", "o", "o#1", 9e9)
        )
    assert tools.sent == ["cleanup:obl-op-1"]


async def test_the_gate_fails_closed_when_the_quarantine_cannot_be_read() -> None:
    tools = Tools()
    with pytest.raises(ArtifactQuarantined) as info:
        await QuarantineGate(tools, Quarantine(broken=True)).invoke(invocation({"note_id": "n"}))
    assert "could not be consulted" in str(info.value) and not tools.sent


# --------------------------------------------------------------------------- the workload's section

WORKLOAD = """
tools: [{name: run_tests}, {name: search_packages}, {name: read_note}, {name: write_note}]
supervision:
  watchdog: {ladder: [inform, hold], on_hold: end, stagnation_turns: 4}
  progress:
    run_tests: {key_args: [suite], fields: [passed, failed]}
  disclosure:
    - {data_class: fixtures, pattern: "FIXTURE-[0-9]{3}", tools: [search_packages]}
  escalations:
    default: {owner: operator, sla_s: 600}
    guard: {owner: sre-oncall, sla_s: 120}
  degradation: {rungs: [full, constrained, refusal], constrained_turns: 2}
  delegation:
    budget: {turns: 4, dollars: 0.05}
    grants: [run_tests]
    check: {kind: tool_result, tool: run_tests, field: passed}
    on_failure: escalate
trajectories:
  - {id: p, grants: [run_tests, delegate]}
"""


def test_the_supervision_section_builds_the_runtimes_policy() -> None:
    workload = parse_workload(WORKLOAD, "w.yaml")
    spec = workload.supervision
    assert spec is not None
    policy = spec.build(depth=0)
    assert policy.ladder.rungs == (LadderRung.INFORM, LadderRung.HOLD) and policy.ladder.on_hold is OnHold.END
    assert policy.progress_watch.stagnation_steps == 4
    assert policy.progress.tools["run_tests"].key_args == ("suite",)
    assert policy.disclosure[0].matches("look up FIXTURE-042")
    assert policy.escalations.route(EscalationTrigger.GUARD).owner == "sre-oncall"
    assert policy.escalations.route(EscalationTrigger.NOVELTY).sla_s == 600
    assert policy.degradation.rungs == (Rung.FULL, Rung.CONSTRAINED, Rung.REFUSAL)
    d = policy.delegation
    assert (d.tool, d.on_failure, d.check.kind) == (
        "delegate",
        OnFailure.ESCALATE,
        ChildCheckKind.TOOL_RESULT,
    )


@pytest.mark.parametrize(
    ("old", "new", "says"),
    [
        ("ladder: [inform, hold]", "ladder: [hold, inform]", "the ladder ends with hold"),
        ("rungs: [full, constrained, refusal]", "rungs: [full, constrained]", "ends with refusal"),
        ("tools: [search_packages]}", "tools: [no_such_tool]}", "undeclared tools"),
        ("guard: {owner", "gaurd: {owner", "unknown trigger"),
        ('"FIXTURE-[0-9]{3}"', '"FIXTURE-[0-9"', "not a regular expression"),
        (
            "    run_tests: {key_args",
            "    rm_rf: {key_args",
            "supervision.progress.rm_rf: not a declared tool",
        ),
        ("grants: [run_tests]\n", "grants: [nope]\n", "delegation.grants names undeclared tools"),
        ("budget: {turns: 4, dollars: 0.05}", "budget: {}", "budget"),
    ],
)
def test_a_malformed_supervision_section_names_what_is_wrong(old: str, new: str, says: str) -> None:
    assert old in WORKLOAD
    with pytest.raises(WorkloadError) as info:
        parse_workload(WORKLOAD.replace(old, new, 1), "w.yaml")
    assert says in str(info.value) and "w.yaml" in str(info.value)


# --------------------------------------------------------------------------- child launches


def _parent() -> TrajectoryLaunch:
    workload = parse_workload(WORKLOAD, "w.yaml")
    return TrajectoryLaunch(
        trajectory_id="run.p",
        goal="Fix the build.",
        ceilings={"turns": 20, "dollars": 1.0, "wall_seconds": 600},
        grants=("run_tests", "delegate"),
        created_at=1000.0,
        provider=ProviderLaunch(base_url="http://p/v1", model="m"),
        redis_url="redis://x:1/0",
        tool_routes={"run_tests": "127.0.0.1:9"},
        supervision=workload.supervision,
    )


def test_a_child_launch_is_its_parents_wiring_under_its_contract() -> None:
    parent = _parent()
    registry = build_registry(parent)
    assert "delegate" in registry  # the delegation tool is registered for the model to call
    contract = DelegationContract(
        child_id="run.p.c1",
        parent_id="run.p",
        call_id="call-1",
        goal="Run the unit suite.",
        check=build_policy(parent, registry).supervision.delegation.check,
        allocation={"turns": 4, "dollars": 0.05},
        deadline=1300.0,
        grants=("run_tests",),
        on_failure=OnFailure.ESCALATE,
        depth=1,
        metadata={"scenario": "finish_after:2"},
    )
    child = child_launch(parent, contract, now=1100.0)
    assert (child.trajectory_id, child.parent_id, child.depth) == ("run.p.c1", "run.p", 1)
    assert child.ceilings == {"turns": 4, "dollars": 0.05, "wall_seconds": 200.0}
    assert child.created_at + child.deadline_s == 1300.0 and child.grants == ("run_tests",)
    assert child.metadata["scenario"] == "finish_after:2" and child.tool_routes == parent.tool_routes
    created = build_created(child, build_registry(child))
    assert created.parent_id == "run.p"
    # one level deeper: the child may not delegate again
    assert build_policy(child, build_registry(child)).supervision.delegation.depth == 1


# --------------------------------------------------------------------------- the driver's tallies


def test_sla_misses_are_counted_once_per_escalation() -> None:
    escalations = [
        {"escalation_id": "a", "trigger": "guard", "status": "open", "due_at": 100.0},
        {"escalation_id": "b", "trigger": "novelty", "status": "open", "due_at": 300.0},
        {
            "escalation_id": "c",
            "trigger": "guard",
            "status": "acknowledged",
            "due_at": 100.0,
            "acknowledged_at": 90.0,
        },
        {
            "escalation_id": "d",
            "trigger": "budget_exhausted",
            "status": "acknowledged",
            "due_at": 100.0,
            "acknowledged_at": 150.0,
        },
    ]
    tally = SlaTally()
    assert sorted(tally.update(escalations, now=200.0)) == ["budget_exhausted", "guard"]
    assert tally.update(escalations, now=250.0) == []  # read again: not counted twice
    assert tally.update(escalations, now=400.0) == ["novelty"]
    counts = supervision_counts(escalations, now=200.0)
    assert (
        counts["open"]["guard"] == 1 and counts["overdue"]["guard"] == 1 and counts["overdue"]["novelty"] == 0
    )
    assert set(counts["open"]) == {t.value for t in EscalationTrigger}  # every trigger, zero included


# --------------------------------------------------------------------------- the notes service's ledger


def test_notes_are_content_addressed_and_every_read_is_recorded() -> None:
    ledger = Ledger()
    note = note_id_of("summary r18", "pool fix")
    assert note == note_id_of("summary r18", "pool fix") != note_id_of("summary r18", "cache fix")
    assert ledger.write_note(note, "summary r18", "pool fix", "ek-1") is True
    assert ledger.write_note(note, "summary r18", "pool fix", "ek-2") is False  # idempotent
    assert ledger.read_note(note, "ek-r1") == ("summary r18", "pool fix")
    assert ledger.read_note("note-none", "ek-r2") is None
    snapshot = ledger.snapshot()
    assert [r.effect_key for r in snapshot.reads_of(note)] == ["ek-r1"]
    assert ledger.delete_note(note, "ek-d") and ledger.read_note(note, "ek-r3") is None
