"""Delegation to child trajectories as data (reliability guide §11).

A delegated sub-task needs what a top-level task needs (§11.1): a goal, a success check, a budget, a
deadline and a failure policy. The workload declares the template (``DelegationPolicy``); a call to the
delegation tool names only the goal, and the parent makes the contract (``DelegationContract``):

- **budget partitions, it does not replicate** (§11.2): the child's allocation is drawn from the parent's
  remaining pool (turns, tokens, dollars) and charged to the parent at once, so the parent's own forward
  work can never spend it and the children can never spend more than the parent has; when a child ends,
  the parent is charged what the child really spent instead (``runtime._handlers_supervise``). A remainder
  below the floor refuses the delegation (load shedding, §11.4);
- **the deadline is inherited**: never past the parent's forward deadline;
- **bounded depth and a concurrency cap** per parent (§11.4);
- **the report is untrusted input** (§11.3): the success check is evaluated by the parent over evidence
  it reads itself (the child's durable log: its accepted tool results, its terminal state, its own
  completion verdict), never over what the child's model says about its work;
- **on_failure** is decided at delegation time: report (the parent's model is told), escalate (a person
  is, too), abort_parent (the parent ends).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from runtime.budget import Dimension
from runtime.errors import InputError

if TYPE_CHECKING:
    from runtime.record import TrajectoryRecord

__all__ = [
    "PARTITIONED",
    "ChildCheck",
    "ChildCheckKind",
    "ChildEvidence",
    "ChildToolResult",
    "DelegationContract",
    "DelegationPolicy",
    "DelegationPolicyError",
    "OnFailure",
    "allocate",
    "evidence_of",
    "verify",
]

PARTITIONED: tuple[str, ...] = (Dimension.TURNS, Dimension.TOKENS, Dimension.DOLLARS)
"""Budget dimensions a child draws from its parent's pool (wall-clock time runs in parallel: the child's
deadline is clamped to the parent's instead)."""


class DelegationPolicyError(InputError):
    """A delegation template is malformed (names the field)."""


class OnFailure(StrEnum):
    REPORT = "report"
    ESCALATE = "escalate"
    ABORT_PARENT = "abort_parent"


class ChildCheckKind(StrEnum):
    COMPLETED = "completed"  # the child ended COMPLETED with its own completion check passed (in its log)
    TOOL_RESULT = "tool_result"  # the child's last result of ``tool`` succeeded (and ``field`` == ``equals``)


@dataclass(frozen=True, slots=True)
class ChildCheck:
    """The success check the PARENT evaluates over the child's evidence."""

    kind: ChildCheckKind = ChildCheckKind.COMPLETED
    tool: str | None = None
    field: str | None = None
    equals: Any = True

    def __post_init__(self) -> None:
        if self.kind is ChildCheckKind.TOOL_RESULT and not self.tool:
            raise DelegationPolicyError("a tool_result check names its tool", where="delegation.check.tool")

    def as_json(self) -> dict[str, Any]:
        return {"kind": self.kind.value, "tool": self.tool, "field": self.field, "equals": self.equals}


@dataclass(frozen=True, slots=True)
class DelegationPolicy:
    """The workload's delegation template. ``tool``: the tool name whose calls spawn children (empty: no
    delegation); ``depth``: this trajectory's own depth (0 at the top)."""

    tool: str = ""
    max_depth: int = 1
    max_children: int = 3
    budget: Mapping[str, float] = field(default_factory=dict)
    floor_fraction: float = 0.5
    deadline_s: float = 300.0
    grants: tuple[str, ...] = ()
    check: ChildCheck = ChildCheck()
    on_failure: OnFailure = OnFailure.REPORT
    metadata: Mapping[str, str] = field(default_factory=dict)
    depth: int = 0

    def __post_init__(self) -> None:
        if self.max_depth < 0 or self.max_children < 1:
            raise DelegationPolicyError("max_depth >= 0 and max_children >= 1", where="delegation")
        if not 0 < self.floor_fraction <= 1:
            raise DelegationPolicyError("must be in (0, 1]", where="delegation.floor_fraction")
        if not math.isfinite(self.deadline_s) or self.deadline_s <= 0:
            raise DelegationPolicyError("must be > 0", where="delegation.deadline_s")
        for dim, amount in self.budget.items():
            if not math.isfinite(amount) or amount <= 0:
                raise DelegationPolicyError("must be > 0", where=f"delegation.budget.{dim}")
        if self.tool and not self.budget:
            raise DelegationPolicyError("a delegation template carves a budget", where="delegation.budget")

    @property
    def enabled(self) -> bool:
        return bool(self.tool)


@dataclass(frozen=True, slots=True)
class DelegationContract:
    """One child's contract, as data (guide §11.1's ``Delegation``)."""

    child_id: str
    parent_id: str
    call_id: str
    goal: str
    check: ChildCheck
    allocation: Mapping[str, float]
    deadline: float
    grants: tuple[str, ...]
    on_failure: OnFailure
    depth: int
    metadata: Mapping[str, str] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return {
            "child_id": self.child_id,
            "parent_id": self.parent_id,
            "call_id": self.call_id,
            "goal": self.goal,
            "check": self.check.as_json(),
            "allocation": dict(self.allocation),
            "deadline": self.deadline,
            "grants": list(self.grants),
            "on_failure": self.on_failure.value,
            "depth": self.depth,
            "metadata": dict(self.metadata),
        }


@dataclass(frozen=True, slots=True)
class ChildToolResult:
    tool: str
    settlement: str
    error: str | None
    result: Any


@dataclass(frozen=True, slots=True)
class ChildEvidence:
    """What the parent reads of a finished child from the child's own durable log. ``claim`` is the child
    model's final text: untrusted, carried for the person reading the report, never judged by."""

    state: str
    exit_reason: str | None
    completion_passed: bool | None
    results: tuple[ChildToolResult, ...] = ()
    spend: Mapping[str, float] = field(default_factory=dict)
    claim: str = ""


def evidence_of(record: TrajectoryRecord) -> ChildEvidence:
    """The evidence of a child from its folded record (the parent's interpreter reads the child's log)."""
    from runtime.events import ObservationAppended, ObservationKind, ToolResultAccepted

    tool_of = {op.call_id: op.tool for op in record.operations.values()}
    results = tuple(
        ChildToolResult(tool_of.get(ev.call_id, "?"), ev.settlement.value, ev.error, ev.result)
        for ev in record.transcript
        if isinstance(ev, ToolResultAccepted)
    )
    claim = ""
    for ev in record.transcript:
        if isinstance(ev, ObservationAppended) and ev.observation is ObservationKind.ASSISTANT and ev.content:
            claim = ev.content
    return ChildEvidence(
        state=record.state.value,
        exit_reason=record.exit_reason.value if record.exit_reason is not None else None,
        completion_passed=record.check_passed,
        results=results,
        spend=record.spend.as_dict(),
        claim=claim[:2000],
    )


def verify(check: ChildCheck, evidence: ChildEvidence) -> tuple[bool, str]:
    """The parent's verdict on a child, from evidence alone (a report claiming success is not evidence)."""
    if check.kind is ChildCheckKind.COMPLETED:
        ok = evidence.state == "COMPLETED" and evidence.completion_passed is True
        return ok, f"child ended {evidence.state} (completion check passed: {evidence.completion_passed})"
    last = next((r for r in reversed(evidence.results) if r.tool == check.tool), None)
    if last is None:
        return False, f"the child has no accepted result of {check.tool!r}"
    if last.settlement != "established" or last.error is not None:
        return False, f"the child's last {check.tool!r} was {last.settlement}: {last.error}"
    if check.field is not None:
        value = last.result.get(check.field) if isinstance(last.result, Mapping) else None
        if value != check.equals:
            return False, f"the child's last {check.tool!r} has {check.field}={value!r}, not {check.equals!r}"
    return True, f"the child's last {check.tool!r} succeeded"


def allocate(policy: DelegationPolicy, record: TrajectoryRecord) -> tuple[dict[str, float] | None, str]:
    """(the child's budget, "") drawn from the parent's remaining pool, or (None, why not).

    The parent's spend already carries every live child's allocation, so what remains is the parent's
    own to give; the dollar part of the finalization reserve is never given away."""
    allocation: dict[str, float] = {}
    for dim, wanted in sorted(policy.budget.items()):
        if dim not in PARTITIONED or dim not in record.ceilings:
            allocation[dim] = wanted  # the parent has no ceiling there: nothing to partition
            continue
        left = record.ceilings[dim] - record.spend.get(dim)
        if dim == Dimension.DOLLARS:
            left -= record.policy.reserve.dollars
        given = min(wanted, max(0.0, left))
        if dim == Dimension.TURNS:
            given = math.floor(given)
        if given < policy.floor_fraction * wanted or given <= 0:
            return None, (
                f"the parent's remaining {dim} ({max(0.0, left):g}) is below the delegation floor "
                f"({policy.floor_fraction:g} x {wanted:g})"
            )
        allocation[dim] = given
    return allocation, ""
