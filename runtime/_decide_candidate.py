"""The candidate's revisions: which version of the artifact each check's evidence speaks for (recovery chapter
§12.9.3, table 10, row 5 "candidate changes after a check"; §12.4: a changed candidate "constitutes a new
candidate revision requiring fresh test evidence").

A tool's contract says whether it ``revises`` the candidate (a patch, a written document) or ``checks`` it
(a test run). Every outcome of a revising call that may have changed the candidate opens the next revision
— an unknown outcome too, marked in doubt, since nobody can say the candidate is unchanged. A check's
verdict is filed under the revision it ran on (the latest opened by an operation dispatched before the
check's own), and stays there: evidence keeps its scope. The ``candidate_checked`` completion check
(``runtime.completion``) then asks the current revision for its own passing checks, so a check of an
earlier revision is never counted for a later one.
"""

from __future__ import annotations

from collections.abc import Mapping

from runtime._step import Step
from runtime.events import CandidateChecked, CandidateRevised
from runtime.ports import Settlement
from runtime.tools import CandidateRole

__all__ = ["check_verdict", "note_candidate"]


def note_candidate(step: Step, operation_id: str, settlement: Settlement, result: object, ok: bool) -> None:
    """Evidence about operation ``operation_id`` arrived (a reply, a late reply, a probe, a timeout):
    ``ok`` when it is a successful result (``result`` its payload). Revises or checks the candidate when the
    operation's tool says so; each operation counts once."""
    rec = step.record
    op = rec.operations.get(operation_id)
    if op is None or op.cleanup_of or op.tool not in step.policy.registry:
        return
    role = step.policy.registry.get(op.tool).candidate
    if role is CandidateRole.REVISES:
        if settlement is Settlement.ESTABLISHED_ABSENT or (settlement is Settlement.ESTABLISHED and not ok):
            return  # known not to have happened, or answered with an error: the candidate is as it was
        if any(r.operation_id == operation_id for r in rec.revisions):
            return
        number = (rec.revisions[-1].number if rec.revisions else 0) + 1
        step.emit(CandidateRevised(number, operation_id, op.tool, in_doubt=settlement is Settlement.UNKNOWN))
    elif role is CandidateRole.CHECKS and settlement is Settlement.ESTABLISHED and ok:
        if any(c.operation_id == operation_id for r in rec.revisions for c in r.checks):
            return
        number = _revision_checked(step, operation_id)
        passed, detail = check_verdict(result)
        step.emit(CandidateChecked(number, operation_id, op.tool, passed, detail, op.call_id))


def _revision_checked(step: Step, check_operation: str) -> int:
    """The revision a check ran on: the latest one opened by an operation dispatched before the check's (a
    revision that began while the check was running is not what it checked)."""
    order = {op_id: i for i, op_id in enumerate(step.record.operations)}
    mine = order[check_operation]
    revisions = step.record.revisions
    before = [r.number for r in revisions if r.operation_id is None or order[r.operation_id] < mine]
    return before[-1] if before else 0


def check_verdict(result: object) -> tuple[bool, str]:
    """What a check's successful result says: a ``passed`` field when it has one (a test run that ran and
    failed is a successful call whose verdict is a failure), else the success itself."""
    if isinstance(result, Mapping) and "passed" in result:
        passed = result["passed"] is True
        failed = result.get("failed")
        return passed, "passed" if passed else (f"failed ({failed} failing)" if failed else "failed")
    return True, "the check succeeded"
