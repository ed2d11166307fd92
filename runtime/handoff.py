"""The handoff packet (reliability guide §8.3): what a person needs to decide, not a transcript.

Written on every exit that is not a clean completion (and whenever something is left owed): the goal
verbatim, what was done to the world (from the operation table, with identifiers), what is pending or
partial (leases, a held approval, unknown operations, open obligations with their evidence), why it
stopped in the system's vocabulary, what the agent proposed (marked as a proposal, not a finding), the
decisions needed, and how and until when it can be resumed. Pure: built from the record alone.
"""

from __future__ import annotations

from typing import Any

from runtime.events import ObservationAppended, ObservationKind
from runtime.obligations import OPEN_STATES
from runtime.ports import Settlement
from runtime.record import TrajectoryRecord
from runtime.states import ExitReason

__all__ = ["build_handoff", "needs_handoff"]

_MAX_RESULT_CHARS = 400


def needs_handoff(record: TrajectoryRecord) -> bool:
    """Anything but a clean completion with nothing left owed needs a packet."""
    clean = record.exit_reason is ExitReason.COMPLETED and record.check_passed is True
    owed = any(o.state in OPEN_STATES for o in record.obligations.values())
    unknown = any(not op.settled for op in record.operations.values())
    return not clean or owed or unknown


def _short(value: Any) -> Any:
    text = repr(value) if not isinstance(value, str) else value
    return value if len(text) <= _MAX_RESULT_CHARS else text[:_MAX_RESULT_CHARS] + "..."


def build_handoff(record: TrajectoryRecord, now: float, owner: str) -> dict[str, Any]:
    """The packet for ``record`` at ``now``, addressed to ``owner``."""
    done = [
        {
            "operation_id": op.operation_id,
            "tool": op.tool,
            "effect_key": op.effect_key,
            "arguments": dict(op.arguments),
            "result": _short(op.result),
            "compensates": op.cleanup_of,
        }
        for op in record.operations.values()
        if op.settlement is Settlement.ESTABLISHED
    ]
    unknown = [
        {
            "operation_id": op.operation_id,
            "tool": op.tool,
            "effect_key": op.effect_key,
            "arguments": dict(op.arguments),
            "attempts": op.attempts,
            "owner": op.owner or record.trajectory_id,
            "decide": f"tether settle {op.operation_id} --established|--absent --evidence TEXT",
        }
        for op in record.operations.values()
        if not op.settled
    ]
    obligations = [
        {
            "obligation_id": ob.obligation_id,
            "for_operation": ob.operation_id,
            "tool": ob.tool,
            "arguments": dict(ob.arguments),
            "unbound": list(ob.unbound),
            "state": ob.state.value,
            "evidence": list(ob.evidence),
            "owner": ob.owner,
        }
        for ob in record.obligations.values()
        if ob.state in OPEN_STATES
    ]
    leases = [
        {
            "lease_id": lease.lease_id,
            "kind": lease.kind.value,
            "resource": lease.resource,
            "until": lease.expires_at,
        }
        for lease in record.leases.values()
    ]
    held = record.held
    approval = (
        None
        if held is None
        else {
            "call_id": held.call_id,
            "tool": held.tool,
            "digest": held.digest,
            "expires_at": held.expires_at,
        }
    )
    last = record.history[-1].reason if record.history else ""
    proposal = next(
        (
            e.content
            for e in reversed(record.transcript)
            if isinstance(e, ObservationAppended) and e.observation is ObservationKind.ASSISTANT and e.content
        ),
        None,
    )
    decisions: list[str] = []
    decisions += [str(u["decide"]) for u in unknown]
    decisions += [
        f"release or accept {o['obligation_id']} ({o['tool']} {o['arguments']}): "
        f"tether settle {o['obligation_id']} --established --evidence TEXT"
        for o in obligations
    ]
    if not decisions:
        decisions.append("review the result; nothing is owed to the world")
    resumable = record.deadline is not None and now < record.deadline
    return {
        "trajectory_id": record.trajectory_id,
        "owner": owner,
        "written_at": now,
        "goal": record.contract.goal,
        "done": done,
        "pending": {
            "leases": leases,
            "approval": approval,
            "unknown_operations": unknown,
            "obligations": obligations,
        },
        "stopped": {
            "exit_reason": record.exit_reason.value if record.exit_reason else None,
            "detail": last,
            "completion_check": record.check_passed,
            "audit": [f"{a.kind.value}: {a.subject}: {a.reason}" for a in record.audit[-10:]],
        },
        "proposal": None
        if proposal is None
        else {"text": _short(proposal), "note": "the agent's, not a finding"},
        "decision_needed": decisions,
        "resume": {
            "trajectory_id": record.trajectory_id,
            "how": "a finished trajectory is not resumed: reconcile what is listed, then start a new one",
            "until": record.deadline if resumable else None,
        },
    }
