"""Completion checks: the harness's external verdict on a model's claim that it is done.

An ``end_turn`` reply is a request to run the task contract's check, never success by itself (harness
chapter, "The completion path"). Checks read only what the runtime recorded — accepted tool results, results
a probe recovered for a call whose reply was lost, and the operation table — never the model's text.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from runtime.events import Event, OperationSettled, ToolResultAccepted
from runtime.ports import OutcomeClass, Settlement
from runtime.record import CompletionCheck, Revision, TrajectoryRecord

__all__ = ["CHECKS", "CheckResult", "evaluate_completion"]

_SUCCESS = OutcomeClass.SUCCESS


@dataclass(frozen=True, slots=True)
class CheckResult:
    passed: bool
    detail: str


def _accepted(events: Iterable[Event]) -> list[ToolResultAccepted]:
    """Every call's results in order: accepted replies, and results recovered by a probe after the reply
    was lost (they count as the call's result: the endpoint's own record established them)."""
    out: list[ToolResultAccepted] = []
    for ev in events:
        if isinstance(ev, ToolResultAccepted):
            out.append(ev)
        elif isinstance(ev, OperationSettled) and ev.call_id is not None and not ev.by_operator:
            out.append(ToolResultAccepted(ev.call_id, ev.settlement, _SUCCESS, ev.result, None))
    return out


def _always(check: CompletionCheck, record: TrajectoryRecord, events: list[Event]) -> CheckResult:
    return CheckResult(True, "the contract accepts any end of turn")


def _never(check: CompletionCheck, record: TrajectoryRecord, events: list[Event]) -> CheckResult:
    return CheckResult(False, "the contract's check never passes")


def _min_tool_results(check: CompletionCheck, record: TrajectoryRecord, events: list[Event]) -> CheckResult:
    raw = check.params.get("count", 1)
    need = raw if isinstance(raw, int) and not isinstance(raw, bool) else 1
    ok = [ev for ev in _accepted(events) if ev.settlement is Settlement.ESTABLISHED and ev.error is None]
    return CheckResult(len(ok) >= need, f"{len(ok)} successful tool result(s), {need} required")


def _tool_succeeded(check: CompletionCheck, record: TrajectoryRecord, events: list[Event]) -> CheckResult:
    tool = check.params.get("tool")
    by_call = {op.call_id: op.tool for op in record.operations.values()}
    last = None
    for ev in _accepted(events):
        if by_call.get(ev.call_id) == tool:
            last = ev
    if last is None:
        return CheckResult(False, f"no result from {tool!r} was accepted")
    passed = last.settlement is Settlement.ESTABLISHED and last.error is None
    return CheckResult(
        passed, f"last {tool!r} result: {last.settlement}{'' if passed else ' / ' + str(last.error)}"
    )


def _candidate_checked(check: CompletionCheck, record: TrajectoryRecord, events: list[Event]) -> CheckResult:
    """The current candidate revision passed its required checks (``tools``: the check tools required, each
    by its latest verdict on this revision; default: the latest check of any tool). Evidence about an
    earlier revision does not count: a changed candidate needs its own checks (recovery chapter §12.4)."""
    revisions = record.revisions or (Revision(0, None, None),)
    current = revisions[-1]
    raw = check.params.get("tools", ())
    required = [t for t in raw if isinstance(t, str)] if isinstance(raw, list | tuple) else []
    doubt = ", outcome in doubt" if current.in_doubt else ""
    made = f" (made by {current.tool}{doubt})" if current.tool else ""
    name = f"revision {current.number}{made}"
    earlier = [r.number for r in revisions[:-1] if any(c.passed for c in r.checks)]
    stale = f"; passing checks of revision(s) {earlier} do not count for it" if earlier else ""
    if not required:
        if not current.checks:
            return CheckResult(False, f"{name} has no check{stale}")
        last = current.checks[-1]
        return CheckResult(last.passed, f"{name}: {last.tool} {last.detail}")
    missing = []
    for tool in required:
        verdicts = [c for c in current.checks if c.tool == tool]
        if not verdicts:
            missing.append(f"{tool} has not run")
        elif not verdicts[-1].passed:
            missing.append(f"{tool} {verdicts[-1].detail}")
    if missing:
        return CheckResult(False, f"{name}: {'; '.join(missing)}{stale}")
    return CheckResult(True, f"{name}: {', '.join(required)} passed")


CHECKS = {
    "always": _always,
    "never": _never,
    "min_tool_results": _min_tool_results,
    "tool_succeeded": _tool_succeeded,
    "candidate_checked": _candidate_checked,
}
"""Checks by the name a task contract gives."""


def evaluate_completion(record: TrajectoryRecord, events: Iterable[Event]) -> CheckResult:
    """Run the contract's completion check; an unknown check name fails closed."""
    check = record.contract.completion_check
    fn = CHECKS.get(check.name)
    if fn is None:
        return CheckResult(False, f"unknown completion check {check.name!r}: failing closed")
    return fn(check, record, list(events))
