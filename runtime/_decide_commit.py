"""Commitment regions and repair episodes (recovery chapter §12.4.4, §12.5): the two ways the runtime bounds
what recovery itself may do.

Pivots. A pivot is admitted only after every check that can run before it has run (its ``prechecks``:
tools with a successful result since the region began) and never while another pivot's outcome is unknown
(an unknown commitment is a third branch: nothing that relies on it having happened, or not, may run).
When a pivot is established, in the same durable batch as its outcome, what it ``commits`` is no longer
compensated and its follow-up duties are staged in the outbox as obligations, delivered with retries under
the cleanup rules (``runtime._decide_cleanup``; on every exit, FINALIZING delivers what is staged).

Repair episodes. A call rejected for its own content (invalid arguments, a client rejection) opens an
episode for its tool; each later proposal of that tool is counted when admitted; the cap bounds them; the
repair-vs-rebuild rule (``runtime.repair``) may forbid repairing at all. An exhausted episode refuses further
attempts and pauses the trajectory for a person.
"""

from __future__ import annotations

from typing import Any

from runtime._step import Step
from runtime.events import ObligationBound, ObligationRegistered, ObligationUpdated, RepairEpisodeChanged
from runtime.obligations import ObligationState, resource_key
from runtime.operations import Operation
from runtime.ports import Settlement
from runtime.repair import EpisodeState, RepairChoice, RepairEpisode, repair_or_rebuild
from runtime.tools import CompensationUnbound, ToolContract

__all__ = [
    "commit_pivot",
    "pivot_refusal",
    "repair_attempt",
    "repair_failed",
    "repair_succeeded",
]


# --------------------------------------------------------------------------- pivots


def _region_start(step: Step) -> int:
    """The dispatch order (position in the operation table) of the last established pivot, or -1."""
    last = -1
    for i, op in enumerate(step.record.operations.values()):
        contract = step.policy.registry.get(op.tool) if op.tool in step.policy.registry else None
        if contract is not None and contract.pivot and op.settlement is Settlement.ESTABLISHED:
            last = i
    return last


def pivot_refusal(step: Step, contract: ToolContract, operation_id: str | None) -> str | None:
    """Why a call may not be admitted now because of a pivot (None: nothing in the way)."""
    pivots = step.policy.registry.pivots
    if not pivots and not contract.pivot:
        return None  # no pivot is registered: nothing can be in the way (and no scan of every operation)
    for op in step.record.operations.values():
        if op.operation_id == operation_id or op.settled or op.cleanup_of is not None:
            continue
        if op.tool in pivots:
            return f"PIVOT_UNRESOLVED: the outcome of pivot {op.tool} ({op.operation_id}) is unknown"
    if not contract.pivot:
        return None
    start = _region_start(step)
    passed = {
        op.tool
        for i, op in enumerate(step.record.operations.values())
        if i > start and op.settlement is Settlement.ESTABLISHED and op.result is not None
    }
    missing = [t for t in contract.prechecks if t not in passed]
    if missing:
        return f"PRECHECK_MISSING: run {', '.join(missing)} (and let it pass) before {contract.name}"
    return None


def commit_pivot(step: Step, op: Operation, result: object) -> None:
    """An established pivot: its region's compensations of committed tools end, its duties are staged."""
    registry = step.policy.registry
    contract = registry.get(op.tool) if op.tool in registry else None
    if contract is None or not contract.pivot:
        return
    for ob in list(step.record.obligations.values()):
        if ob.forward_tool in contract.commits and ob.state in (
            ObligationState.PLANNED,
            ObligationState.BOUND,
        ):
            step.emit(
                ObligationUpdated(
                    ob.obligation_id, ObligationState.COMMITTED, f"committed by pivot {op.operation_id}"
                )
            )
    payload: dict[str, Any] = dict(result) if isinstance(result, dict) else {}
    for i, duty in enumerate(contract.follow_up):
        obligation_id = f"out-{op.operation_id}-{i}"
        if obligation_id in step.record.obligations:
            continue
        unbound: tuple[str, ...] = ()
        try:
            args = duty.bind(dict(op.arguments), payload)
        except CompensationUnbound as e:
            args, unbound = {}, (str(e),)
        step.emit(
            ObligationRegistered(
                obligation_id,
                op.operation_id,
                op.tool,
                duty.tool,
                args,
                unbound,
                duty.after,
                True,  # a follow-up duty is delivered on every exit
                dict(duty.postcondition),
                duty="outbox",
                at=step.now,
            )
        )
        if not unbound:
            step.emit(
                ObligationBound(obligation_id, args, resource_key(duty.tool, args), "staged with the pivot")
            )


# --------------------------------------------------------------------------- repair episodes


def _episode(step: Step, tool: str) -> RepairEpisode | None:
    episode = step.record.repairs.get(tool)
    return episode if episode is not None and episode.state is not EpisodeState.CLOSED else None


def repair_failed(step: Step, tool: str, why: str) -> None:
    """A call of ``tool`` was rejected for its own content: an episode opens (if none is open)."""
    if _episode(step, tool) is not None:
        return
    policy = step.policy
    choice, verdict = repair_or_rebuild(
        policy.repair_success_probability, policy.repair_attempt_cost, policy.repair_fallback_cost
    )
    cap = policy.repair_cap if choice is RepairChoice.REPAIR else 0
    step.emit(
        RepairEpisodeChanged(
            tool, step.new_id("repair"), EpisodeState.OPEN, 0, cap, choice, f"{why}; {verdict}"
        )
    )


def repair_attempt(step: Step, tool: str) -> str | None:
    """Count a proposal of ``tool`` as a corrective attempt (at admission). The refusal, if the episode is
    exhausted (or the cost rule forbids repairing), else None."""
    episode = _episode(step, tool)
    if episode is None:
        return None
    if episode.state is EpisodeState.EXHAUSTED or episode.attempts >= episode.cap:
        if episode.state is EpisodeState.OPEN:
            step.emit(
                RepairEpisodeChanged(
                    tool,
                    episode.episode_id,
                    EpisodeState.EXHAUSTED,
                    episode.attempts,
                    episode.cap,
                    episode.choice,
                    episode.reason,
                )
            )
        if episode.choice is RepairChoice.REBUILD:
            return f"REBUILD_PREFERRED: the cost rule favours rebuilding over repairing {tool}"
        return f"REPAIR_CAP_REACHED: {episode.attempts} corrective attempts of {tool} were admitted"
    step.emit(
        RepairEpisodeChanged(
            tool,
            episode.episode_id,
            EpisodeState.OPEN,
            episode.attempts + 1,
            episode.cap,
            episode.choice,
            episode.reason,
        )
    )
    return None


def repair_succeeded(step: Step, tool: str) -> None:
    episode = _episode(step, tool)
    if episode is not None and episode.state is EpisodeState.OPEN:
        step.emit(
            RepairEpisodeChanged(
                tool,
                episode.episode_id,
                EpisodeState.CLOSED,
                episode.attempts,
                episode.cap,
                episode.choice,
                f"{episode.reason}; repaired",
            )
        )
