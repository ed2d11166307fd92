"""The declared task-state projection: which tool results count as progress, and how they are canonicalised.

A watchdog that looks at raw results either misses a loop or raises false alarms (recovery chapter
§12.6.1): the runtime must declare which parts of the world belong to the task projection and filter the
noise. The workload does, per tool (``ProgressRule``):

- ``key_args``: the arguments that name the slot of task state a call updates (``suite`` for a test run:
  the latest result of each suite is the state of that suite);
- ``fields``: the result fields that belong to the projection (empty: the whole result);
- ``ignore``: result fields that are noise (timestamps, request ids), dropped at every depth;
- ``waiting``: result field values that mean "a long job is still running" (a poll of a pending job): such
  a turn is exempt from stagnation (§12.6.1: the runtime tracks the job and respects its deadline instead).

The task state is the latest projection per slot, built from the accepted results in the log; its digest
after each turn is one step of the turn-level detectors (cycle, stagnation) in ``runtime.watchdog``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from operator import countOf
from typing import TYPE_CHECKING, Any

from runtime.errors import InputError
from runtime.fingerprint import (
    DEFAULT_VOLATILE_KEYS,
    CanonicalForm,
    canonical_json,
    canonical_value,
    state_digest,
)

if TYPE_CHECKING:
    from runtime.record import TrajectoryRecord

__all__ = ["ProgressRule", "ProgressSpec", "ProgressSpecError", "TurnProgress", "turn_progress"]


class ProgressSpecError(InputError):
    """A progress rule is malformed (names the tool and field)."""


@dataclass(frozen=True, slots=True)
class ProgressRule:
    key_args: tuple[str, ...] = ()
    fields: tuple[str, ...] = ()
    ignore: frozenset[str] = DEFAULT_VOLATILE_KEYS
    waiting: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ProgressSpec:
    """Which tools' results are task state. Empty: no projection, so the turn-level detectors are off
    (the call-level ones, exact repetition and trivial variation, still watch every proposal)."""

    tools: Mapping[str, ProgressRule] = field(default_factory=dict)

    @property
    def declared(self) -> bool:
        return bool(self.tools)


@dataclass(frozen=True, slots=True)
class TurnProgress:
    """The task state's digest after a turn, and whether the turn only polled a running job."""

    digest: str | None
    waiting_on_job: bool
    results_seen: int  # accepted results in the log so far (the next turn's results come after these)


def _project(rule: ProgressRule, result: Any) -> Any:
    if isinstance(result, Mapping) and rule.fields:
        result = {k: result.get(k) for k in rule.fields}
    return canonical_value(result, CanonicalForm(rule.ignore, nested=True))


def _waiting(rule: ProgressRule, result: Any) -> bool:
    if not isinstance(result, Mapping):
        return False
    return any(result.get(k) in values for k, values in rule.waiting.items())


def turn_progress(record: TrajectoryRecord, spec: ProgressSpec, results_seen: int) -> TurnProgress:
    """The task state after the latest turn. ``results_seen``: accepted results already counted before
    this turn; a turn whose new results all say "still running" (and that changed nothing else) waits."""
    from runtime.events import ToolResultAccepted
    from runtime.ports import Settlement

    if not spec.declared:
        # only the count, every turn, over a transcript that grows with the trajectory: counted in C
        # (events are final classes: the exact type is the isinstance test)
        return TurnProgress(None, False, countOf(map(type, record.transcript), ToolResultAccepted))
    results = [ev for ev in record.transcript if isinstance(ev, ToolResultAccepted)]
    tool_of = record.operations_by_call()
    state: dict[str, Any] = {}
    new_waiting: list[bool] = []
    for index, ev in enumerate(results):
        op = tool_of.get(ev.call_id)
        if op is None or ev.settlement is not Settlement.ESTABLISHED or ev.error is not None:
            continue
        rule = spec.tools.get(op.tool)
        if rule is None:
            continue
        waiting = _waiting(rule, ev.result)
        if index >= results_seen:
            new_waiting.append(waiting)
        if waiting:
            continue  # "still running" is not a state of the task
        key = canonical_json({k: op.arguments.get(k) for k in rule.key_args})
        state[f"{op.tool}{key}"] = _project(rule, ev.result)
    return TurnProgress(state_digest(state), bool(new_waiting) and all(new_waiting), len(results))
