"""Holds and incident containment as pure values and rules (recovery chapter §12.6.3, §12.8).

**The hold.** Watchdog, control and incident holds are one flag on the record (``TrajectoryRecord.hold``)
with a reason. While it stands no new model-directed work is admitted: no turn is requested and nothing
model-proposed is dispatched; registered cleanup is not model-directed and keeps running (FINALIZING is
never held). The kinds differ only in what READY does next (§12.6.3, §12.8.1): a watchdog hold leaves the
trajectory in READY waiting for a policy choice (two of the responses resume at once), a control or
incident hold carries it into PAUSED.

**Incidents** (§12.8). The incident record keeps the symptom and the suspected cause apart, names every
member trajectory with its metadata (``member_metadata``: grants, operations, owners of unresolved side
effects, spend) and the capture omissions, and orders its restrictions by exposure removed per minute of
confirmation (``order_restrictions``), with two overrides: no restriction destroys the incident record,
and none revokes a grant that a registered cleanup needs (``cleanup_tools``).

**Disclosure rules.** A workload may forbid a data class from reaching a tool (``DisclosureRule``): a call
whose arguments carry it is withheld before dispatch (structurally: nothing leaves the host) and opens an
incident, the "suspect content induces a forbidden proposal" row of the fault-test plan (table 10).
Blocking it is no evidence that no earlier disclosure occurred: the incident says so.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from runtime.errors import InputError

if TYPE_CHECKING:
    from runtime.record import TrajectoryRecord

__all__ = [
    "DisclosureFinding",
    "DisclosureRule",
    "DisclosureRuleError",
    "Hold",
    "HoldKind",
    "Restriction",
    "RestrictionKind",
    "cleanup_tools",
    "find_disclosure",
    "member_metadata",
    "order_restrictions",
    "unresolved_owners",
]


class HoldKind(StrEnum):
    """Who placed the hold; only whether READY steps into PAUSED differs."""

    WATCHDOG = "watchdog"  # a detector reached the hold rung: READY stays READY, admission withheld
    CONTROL = "control"  # an operator's hold: READY -> PAUSED; resume or release lifts it
    INCIDENT = "incident"  # an incident's hold: READY -> PAUSED; only releasing the incident lifts it

    @property
    def pauses(self) -> bool:
        return self is not HoldKind.WATCHDOG

    @property
    def precedence(self) -> int:
        """A stronger hold replaces a weaker one, never the other way round."""
        return {HoldKind.WATCHDOG: 0, HoldKind.CONTROL: 1, HoldKind.INCIDENT: 2}[self]


@dataclass(frozen=True, slots=True)
class Hold:
    """The hold flag: why, since when, who placed it, and what it is tied to."""

    kind: HoldKind
    reason: str
    since: float
    issuer: str
    incident_ids: tuple[str, ...] = ()  # every incident holding it: released when the last one is
    escalation_id: str | None = None
    guard: str | None = None  # the watchdog detector, for a watchdog hold
    expires_at: float | None = None  # a watchdog hold the policy ends at this instant (None: waits)


# --------------------------------------------------------------------------- restrictions


class RestrictionKind(StrEnum):
    HOLD = "hold"  # stop model-directed work of one trajectory
    REVOKE_GRANT = "revoke_grant"  # narrow one trajectory's grant by a tool
    QUARANTINE = "quarantine"  # refuse one artifact as input to anybody


@dataclass(frozen=True, slots=True)
class Restriction:
    """One restriction an incident owner issues. Until confirmed, its source keeps exposing the system at
    ``exposure_per_min``; confirming it takes ``confirm_min`` minutes. ``state``: requested, confirmed or
    uncertain (the supervisor records all three: §12.8.1)."""

    kind: RestrictionKind
    target: str  # trajectory id, "trajectory:tool", or artifact id
    exposure_per_min: float
    confirm_min: float
    state: str = "planned"
    note: str = ""

    def __post_init__(self) -> None:
        if not self.exposure_per_min >= 0:
            raise ValueError(f"exposure_per_min must be >= 0, got {self.exposure_per_min!r}")
        if not self.confirm_min > 0:
            raise ValueError(f"confirm_min must be > 0, got {self.confirm_min!r}")

    @property
    def rank(self) -> float:
        """Exposure removed per minute of confirmation: the order to issue in (highest first)."""
        return self.exposure_per_min / self.confirm_min

    def as_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind.value,
            "target": self.target,
            "exposure_per_min": self.exposure_per_min,
            "confirm_min": self.confirm_min,
            "rank": round(self.rank, 6),
            "state": self.state,
            "note": self.note,
        }


def order_restrictions(
    restrictions: Iterable[Restriction], cleanup_needs: Mapping[str, frozenset[str]]
) -> tuple[list[Restriction], list[Restriction]]:
    """(issue these, in this order; kept back, each with why).

    Highest exposure removed per minute of confirmation first (ties: kind, then target, so the order is
    deterministic). A grant revocation that would strand a registered cleanup (``cleanup_needs``:
    trajectory id -> the tools its registered cleanup dispatches) is kept back, however well it ranks."""
    issue: list[Restriction] = []
    kept: list[Restriction] = []
    for r in restrictions:
        if r.kind is RestrictionKind.REVOKE_GRANT:
            trajectory, _, tool = r.target.rpartition(":")
            if tool in cleanup_needs.get(trajectory, frozenset()):
                kept.append(replace(r, state="kept", note=f"registered cleanup of {trajectory} needs {tool}"))
                continue
        issue.append(r)
    issue.sort(key=lambda r: (-r.rank, r.kind.value, r.target))
    return issue, kept


def cleanup_tools(record: TrajectoryRecord) -> frozenset[str]:
    """Tools the trajectory's registered cleanup dispatches: every obligation not yet discharged (the
    cleanup graph of issue 11), and the compensation of every operation whose effect may exist. Their
    grants are never revoked by containment."""
    from runtime.obligations import ObligationState
    from runtime.ports import Settlement

    done = (ObligationState.DISCHARGED, ObligationState.COMMITTED, ObligationState.HANDED_OFF)
    owed = {o.tool for o in record.obligations.values() if o.state not in done}
    compensations = {
        op.compensation
        for op in record.operations.values()
        if op.compensation is not None and op.settlement is not Settlement.ESTABLISHED_ABSENT
    }
    return frozenset(owed | compensations)


def unresolved_owners(record: TrajectoryRecord) -> list[dict[str, Any]]:
    """Every operation whose outcome is not settled, with the owner who must resolve it (§12.8.1: the
    incident names the owners of unresolved side effects)."""
    return [
        {
            "operation": op.operation_id,
            "tool": op.tool,
            "effect_key": op.effect_key,
            "owner": op.owner or record.trajectory_id,
            "in_doubt": op.in_doubt,
        }
        for op in record.operations.values()
        if not op.settled
    ]


def member_metadata(record: TrajectoryRecord) -> dict[str, Any]:
    """What an incident records of one member trajectory (§12.8.1): identity, state, grants, operations
    with their attempts, owners of unresolved side effects, spend."""
    return {
        "trajectory_id": record.trajectory_id,
        "tenant": record.tenant,
        "parent_id": record.parent_id,
        "state": record.state.value,
        "exit_reason": record.exit_reason.value if record.exit_reason is not None else None,
        "turns": record.turn_count,
        "grants": sorted(t for t in record.grants.tools if record.grants.allows(t)),
        "operations": [
            {
                "operation": op.operation_id,
                "tool": op.tool,
                "attempts": op.attempts,
                "last_attempt": op.last_attempt_id,
                "settlement": op.settlement.value,
                "compensation": op.compensation,
            }
            for op in record.operations.values()
        ],
        "unresolved": unresolved_owners(record),
        "cleanup_tools": sorted(cleanup_tools(record)),
        "spend": record.spend.as_dict(),
    }


# --------------------------------------------------------------------------- disclosure rules


class DisclosureRuleError(InputError):
    """A disclosure rule is malformed (names the rule and field)."""


@dataclass(frozen=True, slots=True)
class DisclosureRule:
    """Data of class ``data_class`` (recognised by the regular expression ``pattern`` in any string
    argument) may not go to any tool in ``tools``."""

    data_class: str
    pattern: str
    tools: frozenset[str]
    _compiled: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        where = f"disclosure[{self.data_class!r}]"
        if not self.data_class:
            raise DisclosureRuleError("a rule names its data class", where="disclosure.data_class")
        if not self.tools:
            raise DisclosureRuleError("a rule names at least one tool", where=f"{where}.tools")
        try:
            compiled = re.compile(self.pattern)
        except re.error as e:
            raise DisclosureRuleError(f"not a regular expression: {e}", where=f"{where}.pattern") from e
        if compiled.search(""):
            raise DisclosureRuleError("the pattern matches the empty string", where=f"{where}.pattern")
        object.__setattr__(self, "_compiled", compiled)

    def matches(self, text: str) -> bool:
        return self._compiled.search(text) is not None


@dataclass(frozen=True, slots=True)
class DisclosureFinding:
    """Which rule a proposed call broke, and where in its arguments (the path, never the value: sensitive
    payload belongs in a forensic store, not in the log or an alert)."""

    data_class: str
    tool: str
    path: str


def _strings(value: Any, path: str) -> Iterable[tuple[str, str]]:
    if isinstance(value, str):
        yield path, value
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from _strings(v, f"{path}.{k}")
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            yield from _strings(v, f"{path}[{i}]")


def find_disclosure(
    rules: Sequence[DisclosureRule], tool: str, arguments: Mapping[str, Any] | str
) -> DisclosureFinding | None:
    """The first rule ``tool(arguments)`` breaks, or None. ``arguments`` may be the raw text of an invalid
    call: a call is screened whether or not it is well formed."""
    for rule in rules:
        if tool not in rule.tools:
            continue
        for path, text in _strings(arguments, "$"):
            if rule.matches(text):
                return DisclosureFinding(rule.data_class, tool, path)
    return None
