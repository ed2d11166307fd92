"""Escalations as a production system (reliability guide §8): a trigger, an owner, an SLA, custody, evidence.

"An escalation path with no owner is worse than no escalation path" (§8.6). Every escalation the decider
opens names its trigger (§8.2), the owner it is routed to and the time by which somebody must have taken
custody of it (the SLA, from ``EscalationPolicy``), the evidence that made the system stop (a detector's
finding, the operations in doubt, the incident), and a handoff packet (§8.3). Acknowledging one transfers
custody to the signer of a control message; an escalation not acknowledged by its ``due_at`` missed its SLA
(a metric and an alert, ``cluster/prometheus/alerts.yml``).

The handoff packet is a hook: ``handoff_packet`` builds the fields the guide's §8.3 names from the record
(the goal verbatim, what was done to the world, what is pending, why it stopped, how to resume). The
cleanup/handoff work (issue 11) may replace its body with the full packet (obligations, leases, the
side-effect ledger) or attach its own ``WriteHandoff`` beside it; nothing else depends on its shape.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from runtime.errors import InputError

if TYPE_CHECKING:
    from runtime.record import TrajectoryRecord

__all__ = [
    "Escalation",
    "EscalationPolicy",
    "EscalationPolicyError",
    "EscalationRoute",
    "EscalationStatus",
    "EscalationTrigger",
    "handoff_packet",
]


class EscalationTrigger(StrEnum):
    """Why a person was brought in (reliability guide §8.2, as this runtime meets the triggers)."""

    APPROVAL_REQUEST = "approval_request"  # policy: an irreversible call held in escrow for a person
    VERIFICATION = "verification"  # an external check rejected the output (the same way, repeatedly)
    REFUSAL = "refusal"  # the model refused to continue
    PAUSE = "pause"  # an operator paused the trajectory
    KILL = "kill"  # an operator killed it
    CANCEL = "cancel"  # an operator cancelled it
    # issue 12: the triggers that open an escalation record with an owner and an SLA
    BUDGET_EXHAUSTED = "budget_exhausted"  # a budget ran out with usable partial work
    GUARD = "guard"  # a watchdog went through its whole ladder to the hold
    NOVELTY = "novelty"  # an unknown error code, a call to a tool that does not exist
    UNKNOWN_OUTCOME = "unknown_outcome"  # the trajectory ended with operations in doubt
    STUCK_CLEANUP = "stuck_cleanup"  # registered cleanup could not finish (issue 11 opens these)
    INCIDENT = "incident"  # a disclosure rule (or an operator) opened an incident
    DELEGATION = "delegation"  # a child's report failed the parent's check (on_failure: escalate)
    DEGRADED = "degraded"  # the degradation ladder reached honest refusal: a route to a person


class EscalationStatus(StrEnum):
    OPEN = "open"  # nobody has taken custody yet: the SLA clock runs
    ACKNOWLEDGED = "acknowledged"  # a signed acknowledgement transferred custody
    RESOLVED = "resolved"  # the condition cleared (an approval decided, a hold released)


class EscalationPolicyError(InputError):
    """An escalation route is malformed (names the trigger)."""


@dataclass(frozen=True, slots=True)
class EscalationRoute:
    """Where escalations of one trigger go: the owning queue or role, and the seconds until somebody must
    have acknowledged one."""

    owner: str = "operator"
    sla_s: float = 3600.0

    def __post_init__(self) -> None:
        if not self.owner:
            raise EscalationPolicyError("an escalation needs an owner", where="escalations.owner")
        if isinstance(self.sla_s, bool) or not math.isfinite(self.sla_s) or self.sla_s <= 0:
            raise EscalationPolicyError(f"sla_s must be > 0, got {self.sla_s!r}", where="escalations.sla_s")


@dataclass(frozen=True, slots=True)
class EscalationPolicy:
    """Routes per trigger; a trigger without a route takes ``default``."""

    routes: Mapping[EscalationTrigger, EscalationRoute] = field(default_factory=dict)
    default: EscalationRoute = EscalationRoute()

    def route(self, trigger: EscalationTrigger) -> EscalationRoute:
        return self.routes.get(trigger, self.default)


@dataclass(frozen=True, slots=True)
class Escalation:
    """One escalation as the record holds it (folded from ``EscalationOpened`` and what followed)."""

    escalation_id: str
    trajectory_id: str
    trigger: EscalationTrigger
    summary: str
    owner: str
    opened_at: float
    due_at: float
    evidence: Mapping[str, Any] = field(default_factory=dict)
    handoff: Mapping[str, Any] = field(default_factory=dict)
    status: EscalationStatus = EscalationStatus.OPEN
    custodian: str | None = None
    acknowledged_at: float | None = None
    resolution: str | None = None

    def sla_missed(self, now: float) -> bool:
        """Nobody took custody by ``due_at`` (an acknowledgement after it still counts as a miss)."""
        if self.acknowledged_at is not None:
            return self.acknowledged_at > self.due_at
        return self.status is EscalationStatus.OPEN and now > self.due_at

    def as_json(self) -> dict[str, Any]:
        """The registry's document (``cluster.escalations``): JSON values only."""
        return {
            "escalation_id": self.escalation_id,
            "trajectory_id": self.trajectory_id,
            "trigger": self.trigger.value,
            "summary": self.summary,
            "owner": self.owner,
            "opened_at": self.opened_at,
            "due_at": self.due_at,
            "evidence": dict(self.evidence),
            "handoff": dict(self.handoff),
            "status": self.status.value,
            "custodian": self.custodian,
            "acknowledged_at": self.acknowledged_at,
            "resolution": self.resolution,
        }


def handoff_packet(
    record: TrajectoryRecord,
    trigger: EscalationTrigger,
    summary: str,
    evidence: Mapping[str, Any],
    *,
    now: float,
    owner: str,
) -> dict[str, Any]:
    """The handoff packet of an escalation (reliability guide §8.3): the trajectory's packet
    (``runtime.handoff.build_handoff``: the goal verbatim, what was done, what is pending and owed, how to
    resume) with why this escalation stopped it, in the system's vocabulary, and its evidence."""
    from runtime.handoff import build_handoff

    packet = build_handoff(record, now, owner)
    packet["why"] = {"trigger": trigger.value, "summary": summary, "evidence": dict(evidence)}
    if not record.is_terminal:
        packet["resume"] = {
            "trajectory_id": record.trajectory_id,
            "how": "it waits: tether resume (a watchdog's or an operator's hold), tether incident release "
            "(an incident's hold), tether approve/deny (a held call), or tether kill",
            "until": record.deadline,
        }
    return packet
