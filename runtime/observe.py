"""Trajectory events turned into operator metrics: ``MetricsHooks``, a ``TrajectoryHooks`` that records
through an injected :class:`runtime.metrics.Metrics`.

Everything here is read off the events the interpreter appends (and the record each one produced), so a
signal is counted once, when the durable log says it happened. A restarted actor folds its log without
calling hooks, so nothing is counted twice after a crash; what the old incarnation saw was already exported.

Mapping (reliability guide §12.5 "signals worth watching", plus the control plane):

=============================  ==========================================================================
signal                         recorded when
=============================  ==========================================================================
guard firing, by guard         a watchdog detector fires (``WatchdogFired``; its ladder rung is counted
                               too); a proposed call is rejected locally (schema, unknown tool, grant) or
                               refused by its dependency's guard (breaker open, bulkhead full, queued past
                               its deadline)
budget exhaustion, dimension   entering FINALIZING with ``BUDGET_EXCEEDED``; the binding dimension is the
                               record's (set by the halt assessment just before)
escalations, by trigger        every ``EscalationOpened`` (``runtime.escalation.EscalationTrigger``: approval,
                               verification, budget, guard, novelty, unknown outcome, incident, delegation,
                               degraded), a model refusal, an operator's pause / kill / cancel
exit reasons, rungs, holds     entering FINALIZING (by exit reason); each result by rung and status (the
                               degraded-result rate); holds by kind; moves down the degradation ladder;
                               incidents a trajectory opened; children by outcome
finished, by outcome           FINALIZING -> terminal; ``partial`` is FAILED with an established effect
steps to completion            turns at COMPLETED (histogram; only completed trajectories)
retry ratio                    every ``ToolDispatchIntent`` is an attempt; its operation's first attempt a
                               new operation; an operation settling ESTABLISHED a completed step
control latency, by kind       ``ControlRequested`` -> ``ControlApplied`` on the injected clock
trajectories by state          a per-process census moved on every state change (unfinished states only)
=============================  ==========================================================================

Duplicate effects are not measured here: "applied twice" is only visible to the system holding the effect,
so the testbed's independent ledger counts them. A metric that cannot be recorded never fails the trajectory:
``on_event`` runs inside the interpreter's append, so errors are logged and swallowed.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from runtime.clock import Clock
from runtime.degradation import result_of
from runtime.escalation import EscalationTrigger
from runtime.events import (
    ChildCancelled,
    ChildSettled,
    ChildSpawned,
    ControlApplied,
    ControlRequested,
    EscalationOpened,
    Event,
    HoldPlaced,
    IncidentOpened,
    ModelCallSettled,
    ObservationAppended,
    ObservationKind,
    OperationSettled,
    RungChanged,
    StateChanged,
    ToolDispatchIntent,
    ToolResultAccepted,
    WatchdogFired,
)
from runtime.metrics import Metrics, Outcome
from runtime.ports import Settlement, StopReason
from runtime.record import ControlAction, TrajectoryRecord
from runtime.states import TERMINAL_STATES, ExitReason, TrajectoryState
from runtime.watchdog import Guard

__all__ = [
    "REJECTION_GUARDS",
    "EscalationTrigger",
    "HookChain",
    "MetricsHooks",
    "StateCensus",
    "TrajectoryHooks",
    "outcome_of",
    "watchdog_guard",
]

S = TrajectoryState
_log = logging.getLogger(__name__)


class TrajectoryHooks(Protocol):
    """Extension points of a trajectory's interpreter, with no-op defaults: every durable event (with the
    record it produced), and a kill (the sandbox teardown)."""

    def on_event(self, record: TrajectoryRecord, event: Event) -> None: ...

    async def on_kill(self, record: TrajectoryRecord) -> None: ...


_CONTROL_TRIGGERS: Mapping[ControlAction, EscalationTrigger] = {
    ControlAction.PAUSE: EscalationTrigger.PAUSE,
    ControlAction.KILL: EscalationTrigger.KILL,
    ControlAction.CANCEL: EscalationTrigger.CANCEL,
}

REJECTION_GUARDS: Mapping[str, str] = {
    # local rejections (runtime._tool_stage): nothing reached the dependency
    "INVALID_ARGUMENTS": "schema",
    "UNKNOWN_TOOL": "unknown_tool",
    "NOT_GRANTED": "grant",
    # the dependency's guard withheld the call (the refusal's class name is the reason)
    "BreakerOpen": "breaker_open",
    "BulkheadFull": "bulkhead_full",
    "QueuedPastDeadline": "queued_past_deadline",
}
"""The ``reason`` of a REJECTED refusal observation -> the guard label it counts under. Anything else is not a
guard (e.g. a deferred call) and is not counted, which also keeps the label set bounded."""

# runtime._tool_stage finalizes a loop with exactly this detail (a structured field would be better).
_WATCHDOG_DETAIL = re.compile(r"^watchdog (?P<guard>[a-z_]+) stopped a loop$")


def watchdog_guard(event: StateChanged) -> str | None:
    """The watchdog guard that finalized the trajectory with ``event``, or None if none did."""
    if event.to_state is not S.FINALIZING or event.exit_reason is not ExitReason.ERROR:
        return None
    match = _WATCHDOG_DETAIL.match(event.reason)
    if match is None:
        return None
    name = match.group("guard")
    return name if name in {g.value for g in Guard} else "watchdog"


def outcome_of(record: TrajectoryRecord) -> Outcome:
    """How a terminal ``record`` counts: partial (FAILED with an established effect) wins over killed."""
    if record.state is S.COMPLETED:
        return Outcome.COMPLETED
    if record.state is S.CANCELED:
        return Outcome.CANCELED
    if any(op.settlement is Settlement.ESTABLISHED for op in record.operations.values()):
        return Outcome.PARTIAL
    if record.exit_reason is ExitReason.KILLED:
        return Outcome.KILLED
    return Outcome.FAILED


class StateCensus:
    """How many unfinished trajectories this process holds in each state, moved by state changes.

    Terminal states are not held: a finished trajectory leaves the census (``tether_trajectories_finished``
    counts it). Thread-safe, because several trajectories of one process may share it.
    """

    def __init__(self) -> None:
        self._counts: dict[TrajectoryState, int] = {}
        self._lock = threading.Lock()

    def move(self, old: TrajectoryState | None, new: TrajectoryState | None) -> dict[TrajectoryState, int]:
        """Move one trajectory from ``old`` to ``new`` (None: not held); returns the changed counts."""
        changed: dict[TrajectoryState, int] = {}
        with self._lock:
            if old is not None and old not in TERMINAL_STATES:
                # never below zero: a trajectory first seen mid-flight entered without a matching leave
                self._counts[old] = changed[old] = max(0, self._counts.get(old, 0) - 1)
            if new is not None and new not in TERMINAL_STATES:
                self._counts[new] = changed[new] = self._counts.get(new, 0) + 1
        return changed

    def count(self, state: TrajectoryState) -> int:
        with self._lock:
            return self._counts.get(state, 0)


@dataclass
class _Track:
    """What the hooks remember about one trajectory between its events."""

    state: TrajectoryState | None = None
    previous: TrajectoryRecord | None = None
    requested: dict[str, tuple[ControlAction, float]] = field(default_factory=dict)


class MetricsHooks:
    """``TrajectoryHooks`` recording §12.5 signals through ``metrics``; ``clock`` times control latency.

    One instance may serve several trajectories in a process (state is kept per trajectory id), and instances
    given the same ``census`` share the trajectories-by-state counts.
    """

    def __init__(self, metrics: Metrics, clock: Clock, census: StateCensus | None = None) -> None:
        self.metrics = metrics
        self.clock = clock
        self.census = census if census is not None else StateCensus()
        self._tracks: dict[str, _Track] = {}
        self._lock = threading.Lock()
        self._failures = 0

    @property
    def failures(self) -> int:
        """How many events could not be recorded (logged, never raised)."""
        return self._failures

    def on_event(self, record: TrajectoryRecord, event: Event) -> None:
        try:
            with self._lock:
                self._observe(record, event)
        except Exception:  # a metric must never fail the append it observes
            self._failures += 1
            _log.warning("metrics: %s of %s not recorded", event.kind, record.trajectory_id, exc_info=True)

    async def on_kill(self, record: TrajectoryRecord) -> None:
        return None  # the kill is counted from its ControlRequested event

    # ------------------------------------------------------------------ internals

    def _observe(self, record: TrajectoryRecord, event: Event) -> None:
        track = self._tracks.setdefault(record.trajectory_id, _Track())
        if record.state is not track.state:
            for state, count in self.census.move(track.state, record.state).items():
                self.metrics.actor_trajectories_in_state(state.value, count)
            track.state = record.state
        m = self.metrics
        if isinstance(event, StateChanged):
            self._state_changed(record, event)
        elif isinstance(event, ToolDispatchIntent):
            m.step_attempted()
            op = record.operations.get(event.operation_id)
            if op is not None and op.attempts == 1:
                m.tool_operation_started()
        elif isinstance(event, ToolResultAccepted | OperationSettled):
            self._maybe_completed_step(record, track.previous, event)
        elif isinstance(event, ControlRequested):
            track.requested[event.message_id] = (event.action, self.clock.now())
            trigger = _CONTROL_TRIGGERS.get(event.action)
            if trigger is not None:
                m.escalated(trigger.value)
        elif isinstance(event, ControlApplied):
            requested = track.requested.pop(event.message_id, None)
            if requested is not None:  # requested before a restart: only this side was seen, not timed
                action, at = requested
                m.control_latency(action.value, max(0.0, self.clock.now() - at))
        elif isinstance(event, ModelCallSettled):
            if event.stop_reason is StopReason.REFUSAL:
                m.escalated(EscalationTrigger.REFUSAL.value)
            call = record.model_call
            if call is not None and call.prompt_tokens > 0 and event.counted_prompt > 0:
                m.prompt_reserved(call.prompt_tokens, event.counted_prompt)
        elif isinstance(event, EscalationOpened):  # issue 12: every escalation record, by trigger
            m.escalated(event.trigger)
        elif isinstance(event, WatchdogFired):
            m.guard_fired(event.guard)
            m.watchdog_rung(event.guard, event.rung)
        elif isinstance(event, HoldPlaced):
            m.hold_placed(event.hold_kind.value)
        elif isinstance(event, RungChanged):
            m.rung_changed(event.rung.value)
        elif isinstance(event, IncidentOpened):
            m.incident_opened("disclosure_rule")
        elif isinstance(event, ChildSpawned):
            m.child("spawned")
        elif isinstance(event, ChildSettled):
            m.child("verified" if event.verified else "failed_check")
        elif isinstance(event, ChildCancelled):
            m.child("cancelled")
        elif isinstance(event, ObservationAppended):
            guard = _rejection_guard(event)
            if guard is not None:
                m.guard_fired(guard)
        track.previous = record
        if record.is_terminal and not track.requested:
            del self._tracks[record.trajectory_id]  # bounded memory; a later audit event starts afresh

    def _state_changed(self, record: TrajectoryRecord, event: StateChanged) -> None:
        if event.to_state is S.FINALIZING:
            if event.exit_reason is not None:
                self.metrics.exited(event.exit_reason.value)
            if event.exit_reason is ExitReason.BUDGET_EXCEEDED:
                self.metrics.budget_exhausted(record.binding_dimension or "unknown")
            guard = watchdog_guard(event)
            if guard is not None:
                self.metrics.guard_fired(guard)
        elif event.from_state is S.FINALIZING and event.to_state in TERMINAL_STATES:
            self.metrics.trajectory_finished(outcome_of(record), record.turn_count)
            result = result_of(record)
            self.metrics.result(result["rung"], result["status"])

    def _maybe_completed_step(
        self,
        record: TrajectoryRecord,
        previous: TrajectoryRecord | None,
        event: ToolResultAccepted | OperationSettled,
    ) -> None:
        if isinstance(event, ToolResultAccepted):
            op = record.operation_for_call(event.call_id)
        else:
            op = record.operations.get(event.operation_id)
        if op is None or op.settlement is not Settlement.ESTABLISHED:
            return
        before = previous.operations.get(op.operation_id) if previous is not None else None
        if before is not None and before.settlement is Settlement.ESTABLISHED:
            return  # the same evidence again (idempotent re-delivery): already counted
        self.metrics.step_completed()


def _rejection_guard(event: ObservationAppended) -> str | None:
    if event.observation is not ObservationKind.REFUSAL:
        return None
    try:
        body = json.loads(event.content)
    except ValueError:
        return None
    if not isinstance(body, dict) or body.get("status") != "REJECTED":
        return None
    return REJECTION_GUARDS.get(str(body.get("reason")))


class HookChain:
    """Several ``TrajectoryHooks`` as one, called in order (e.g. the status view, then metrics)."""

    def __init__(self, *hooks: TrajectoryHooks) -> None:
        self.hooks = hooks

    def on_event(self, record: TrajectoryRecord, event: Event) -> None:
        for hook in self.hooks:
            hook.on_event(record, event)

    async def on_kill(self, record: TrajectoryRecord) -> None:
        for hook in self.hooks:
            await hook.on_kill(record)
