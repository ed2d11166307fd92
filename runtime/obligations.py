"""Obligations: what a trajectory owes the world for the effects it caused (recovery chapter §12.3-12.5).

Every forward call whose contract declares a compensation registers an *obligation* durably before it is
dispatched (the cleanup template of §12.3.1: the compensation tool, the arguments known before dispatch,
and the result fields still to bind). When correlated evidence establishes the forward effect, its result
binds the template; when evidence shows the effect absent, the obligation is discharged; while the outcome
is unknown, it stays open with an owner.

On the way out (FINALIZING) open obligations form the cleanup graph (§12.3.4): an edge runs from an
obligation to every obligation it must wait for (the contract's ``after``: stop the test before releasing
its environment). Independent obligations unwind in parallel; a stuck one blocks only what depends on it.
Each compensation is its own separately committed operation, intent before effect, under the narrow cleanup
grant (no model call). An obligation is discharged only on verifiable evidence that its postcondition holds
(a probe of the endpoint's record, or the declared postcondition fields in the reply): never because a call
returned. What cannot be discharged is handed off, with its evidence, to an owner: never dropped.

Ownership is by operation (branch scope, §12.3.5): only the operation that created a resource registers
its release, so abandoning one branch (a child trajectory, a repair candidate) never releases what a
sibling or the parent still uses; two obligations bound to the same resource are released once.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

__all__ = [
    "OPEN_STATES",
    "Obligation",
    "ObligationState",
    "blocked_by",
    "postcondition_holds",
    "ready_to_unwind",
    "resource_key",
]


class ObligationState(StrEnum):
    """Where an obligation stands. DISCHARGED, COMMITTED and HANDED_OFF are final for the trajectory."""

    PLANNED = "planned"  # registered before dispatch; its target is not bound yet
    BOUND = "bound"  # the forward effect is established; the compensation's arguments are complete
    ADMITTING = "admitting"  # the compensation waits for its permits
    RUNNING = "running"  # the compensation is dispatched (its own operation), outcome not yet known
    VERIFYING = "verifying"  # the compensation returned; its postcondition is being verified
    DISCHARGED = "discharged"  # the postcondition holds (or the forward effect was established absent)
    STUCK = "stuck"  # cannot progress without a person: failed, unverifiable, unbound, blocked
    COMMITTED = "committed"  # the effect stands on purpose (completed task, past a pivot): not compensated
    HANDED_OFF = "handed_off"  # transferred, with its evidence, to another owner


OPEN_STATES = frozenset(
    {
        ObligationState.PLANNED,
        ObligationState.BOUND,
        ObligationState.ADMITTING,
        ObligationState.RUNNING,
        ObligationState.VERIFYING,
        ObligationState.STUCK,
    }
)
"""States in which the obligation is still the trajectory's to settle."""


@dataclass(frozen=True, slots=True)
class Obligation:
    """One registered compensation (or follow-up duty) and everything known about it.

    ``operation_id`` is the forward operation whose effect it answers for; ``cleanup_operation`` the
    compensation's own operation once dispatched (a separately committed operation with its own attempts).
    ``unbound`` names result fields still needed (the §12.3.1 binding rule). ``evidence`` accumulates,
    oldest first: settled nodes keep their evidence, failed ones their owner.
    """

    obligation_id: str
    operation_id: str
    forward_tool: str
    tool: str
    arguments: Mapping[str, object]
    unbound: tuple[str, ...] = ()
    state: ObligationState = ObligationState.PLANNED
    owner: str = ""
    after: tuple[str, ...] = ()  # tools whose obligations must be discharged first (the graph's edges)
    on_completion: bool = False  # also runs when the trajectory completes (a temporary resource)
    postcondition: Mapping[str, object] = field(default_factory=dict)
    resource: str | None = None  # canonical target once bound (two obligations, one resource: one release)
    cleanup_operation: str | None = None
    request_id: str | None = None  # the permit request or probe this obligation waits for
    attempts: int = 0
    evidence: tuple[str, ...] = ()
    accepted_risk: bool = False  # an operator closed it without evidence: recorded as such, never as clean
    duty: str = "compensation"  # or "outbox": a pivot's follow-up duty, delivered with retries
    registered_at: float = 0.0  # epoch seconds

    @property
    def open(self) -> bool:
        return self.state in OPEN_STATES

    @property
    def call_id(self) -> str:
        """The id the compensation's attempts carry where a call id is expected (permits, results)."""
        return f"cleanup:{self.obligation_id}"


def resource_key(tool: str, arguments: Mapping[str, Any]) -> str:
    """The canonical identity of what a compensation acts on (its tool and bound arguments)."""
    return f"{tool}:{json.dumps(dict(arguments), sort_keys=True, separators=(',', ':'), default=str)}"


def postcondition_holds(postcondition: Mapping[str, object], evidence: object) -> bool:
    """Every declared postcondition field has the declared value in ``evidence`` (a result payload)."""
    if not isinstance(evidence, Mapping):
        return False
    return all(evidence.get(k) == v for k, v in postcondition.items())


def blocked_by(ob: Obligation, obligations: Iterable[Obligation]) -> list[Obligation]:
    """The obligations ``ob`` must wait for: open obligations of the tools its contract names in
    ``after`` (registered by this trajectory), other than itself."""
    return [
        o
        for o in obligations
        if o.obligation_id != ob.obligation_id and o.forward_tool in ob.after and o.open
    ]


def ready_to_unwind(obligations: Mapping[str, Obligation]) -> list[Obligation]:
    """Bound obligations whose predecessors are all settled: what FINALIZING may dispatch now, in a stable
    order (independent ones go out together)."""
    values = list(obligations.values())
    ready = [o for o in values if o.state is ObligationState.BOUND and not blocked_by(o, values)]
    return sorted(ready, key=lambda o: o.obligation_id)
