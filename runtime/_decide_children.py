"""Delegation's rules (issue 12, reliability guide §11): a call to the delegation tool becomes a child
trajectory, its own actor, under a contract made from the workload's template (``runtime.delegation``).

- ``is_delegation`` / ``spawn`` (``runtime._decide_tools.route``, once the reply is dispatching): depth,
  the per-parent concurrency cap and the budget floor are checked; the child's allocation is drawn from
  the parent's remaining pool and charged at once (``ChildSpawned``); ``SpawnChild`` starts it.
- ``waiting`` (``runtime._decide_turn._waiting_tool``): the parent waits in WAITING_TOOL for its live
  children as for its calls in flight.
- ``on_child_finished`` (``ChildFinished``): the report is untrusted input; the parent's own check judges
  the evidence read from the child's log (§11.3: the "sub-agent reports wrongly" fault); the child's real
  spend replaces its allocation (``ChildSettled``); on a failed check the contract's ``on_failure``
  decides: report, escalate, or abort the parent.
- ``cascade``: cancel and kill reach every live child at once (``CancelChild``), and so does any exit of
  the parent (FINALIZING): a child never outlives the parent that is answerable for it. Each child runs
  its own FINALIZING, so its cleanup is done by its own rules.
- ``reattach`` (``Recovered``): a restarted parent attaches again to its live children (spawning is
  idempotent by child id: the running actor is found, not replaced).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from runtime._decide_dispatch import refusal, refuse_call
from runtime._decide_finalize import enter_finalizing
from runtime._step import Step
from runtime.delegation import DelegationContract, DelegationPolicy, OnFailure, allocate, verify
from runtime.effects import CancelChild, SpawnChild
from runtime.escalation import EscalationTrigger
from runtime.events import ChildCancelled, ChildSettled, ChildSpawned
from runtime.inputs import ChildFinished
from runtime.ports import ToolCallProposal
from runtime.states import ExitReason, TrajectoryState
from runtime.supervision import ChildState

__all__ = ["cascade", "is_delegation", "on_child_finished", "reattach", "spawn", "waiting"]

S = TrajectoryState


def _template(step: Step) -> DelegationPolicy:
    return step.policy.supervision.delegation


def is_delegation(step: Step, tool: str) -> bool:
    """Whether a call to ``tool`` spawns a child."""
    template = _template(step)
    return template.enabled and tool == template.tool


def _contract(step: Step, child: ChildState, deadline: float) -> DelegationContract:
    template = _template(step)
    return DelegationContract(
        child_id=child.child_id,
        parent_id=step.record.trajectory_id,
        call_id=child.call_id,
        goal=child.goal,
        check=template.check,
        allocation=dict(child.allocation),
        deadline=deadline,
        grants=template.grants,
        on_failure=template.on_failure,
        depth=template.depth + 1,
        metadata=dict(template.metadata),
    )


def spawn(step: Step, p: ToolCallProposal, args: Mapping[str, Any]) -> None:
    """WAITING_TOOL: a delegation call becomes a child, or is refused before anything starts."""
    rec = step.record
    template = _template(step)
    if template.depth + 1 > template.max_depth:
        message = f"delegation depth {template.max_depth} reached"
        refuse_call(step, p.call_id, refusal("DELEGATION_DEPTH", message))
        return
    if len(rec.supervision.live_children()) >= template.max_children:
        message = f"{template.max_children} children already run; wait for one to end"
        refuse_call(step, p.call_id, refusal("DELEGATION_LIMIT", message))
        return
    allocation, why = allocate(template, rec)
    if allocation is None:
        refuse_call(step, p.call_id, refusal("DELEGATION_BUDGET", why))
        return
    child_id = f"{rec.trajectory_id}.c{len(rec.supervision.children) + 1}"
    deadline = step.now + template.deadline_s
    forward = step.forward_deadline
    if forward is not None:
        deadline = min(deadline, forward)
    goal = str(args.get("goal") or rec.contract.goal)
    step.emit(ChildSpawned(child_id, p.call_id, goal, allocation, deadline))
    child = step.record.supervision.children[child_id]
    step.do(SpawnChild(_contract(step, child, deadline)))


def waiting(step: Step) -> bool:
    """WAITING_TOOL: whether live children still hold the parent here."""
    return bool(step.record.supervision.live_children())


def cascade(step: Step, kill: bool, reason: str) -> None:
    """Cancel (or kill) every live child; the parent stops waiting for them."""
    for child in step.record.supervision.live_children():
        step.emit(ChildCancelled(child.child_id, child.call_id, reason[:300]))
        step.do(CancelChild(child.child_id, kill, reason[:300]))


def reattach(step: Step) -> None:
    """A restarted parent waits for its live children again (``SpawnChild`` finds the running actor)."""
    for child in step.record.supervision.live_children():
        step.do(SpawnChild(_contract(step, child, child.deadline)))


def on_child_finished(step: Step, inp: ChildFinished) -> None:
    """A child ended: judge its evidence with the parent's own check, settle what it spent, and apply the
    contract's failure policy."""
    rec = step.record
    child = rec.supervision.children.get(inp.child_id)
    if child is None or child.status == "settled":
        return  # not ours, or its evidence was already settled (a re-delivery)
    evidence = inp.evidence
    ok, detail = verify(_template(step).check, evidence)
    report: dict[str, Any] = {
        "status": "VERIFIED" if ok else "FAILED_CHECK",
        "child": child.child_id,
        "state": evidence.state,
        "verdict": detail,
        # the child's own account: untrusted input (guide §11.3), shown as a claim, never judged by
        "claimed_unverified": evidence.claim[:800],
    }
    was_live = child.live
    step.emit(ChildSettled(child.child_id, child.call_id, ok, detail, dict(evidence.spend), report))
    if ok or not was_live or step.record.is_terminal:
        return
    on_failure = _template(step).on_failure
    if on_failure is OnFailure.ESCALATE:
        from runtime._decide_supervise import open_escalation

        open_escalation(
            step,
            EscalationTrigger.DELEGATION,
            f"child {child.child_id} failed the parent's check: {detail}",
            {"key": child.child_id, "child": child.child_id, "verdict": detail, "state": evidence.state},
        )
    elif on_failure is OnFailure.ABORT_PARENT and step.record.state is S.WAITING_TOOL:
        cascade(step, False, f"a sibling failed its check ({child.child_id})")
        enter_finalizing(step, ExitReason.DELEGATION_FAILED, f"child {child.child_id} failed: {detail}")
