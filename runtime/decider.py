"""The trajectory as a decider: one rulebook, two pure functions.

``decide(record, input, now) -> Decision`` takes the folded record and ONE input and returns what happened
(``events``: facts, appended durably as one batch) and what to do next (``effects``: commands for the
interpreter). ``evolve(record, event) -> record`` applies one event (it is ``runtime.fold.apply``); ``fold``
is ``evolve`` over the log. No I/O, no awaiting, no clock reads (``now`` is an argument), no randomness
except from the policy's seed: the same record, input and ``now`` always give the same decision.

The interpreter (``actors.interpreter``) loops: input -> ``decide`` -> append the events durably (one
batch, one fsync) -> carry out the effects -> their results are the next inputs. An effect whose result is
lost because the actor died is what the ``Recovered`` input handles. A rule not reachable from ``decide``
does not exist.

Inputs (``runtime.inputs``): ``Started``, ``Recovered``, ``AdmissionGranted``, ``AdmissionDenied``,
``ModelReplied``, ``ModelFailed``, ``ModelCancelled``, ``PermitGranted``, ``PermitRefused``,
``ToolOutcomeReceived``, ``ProbeAnswered``, ``ControlReceived``, ``ControlRefused``, ``TimerDue``,
``ChildFinished`` (one line each in that module's table). Effects (``runtime.effects``):
``RequestAdmission``, ``CallModel``, ``CancelModelStream``, ``SettleAdmission``, ``ReportLimits``,
``AcquirePermit``, ``ReleasePermit``, ``DispatchTool``, ``ProbeTool``, ``CancelToolCall``, ``StartTimer``,
``CancelTimer``, ``KillProcesses``, ``Hibernate``, ``ReleaseLease``, ``PublishEscalation``, ``OpenIncident``,
``SpawnChild``, ``CancelChild`` (one line each in that module's table).

Where the rules live: the turn, admission, the model call and control at the boundary in
``runtime._decide_turn``; tool calls, permits, dispatch, outcomes, retries and probes in
``runtime._decide_tools`` (its docstring says where a lost tool reply goes) and ``runtime._decide_dispatch``
(permits, admission, intent before effect); the approval gate in
``runtime._decide_approval``; FINALIZING in ``runtime._decide_finalize``; recovery, one row per state, in
``runtime._decide_recover``; supervision (the watchdog ladder, holds, incidents, degradation, escalations)
in ``runtime._decide_supervise`` and delegation to child trajectories in ``runtime._decide_children``,
hooked into the modules above at points marked "issue 12". After each input's own rule, ``advance``
carries the record as far as it goes without waiting for anything outside (a settled tool call returns to
READY, which applies pending control, checks the deadline and the budget and asks for the next turn, all in
the same decision); then ``after_decision`` opens the escalations the decision's events call for.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from runtime import _decide_supervise as supervise
from runtime._decide_children import on_child_finished
from runtime._decide_dispatch import on_permit_granted, on_permit_refused, retry_due
from runtime._decide_recover import on_recovered, on_started
from runtime._decide_tools import call_timed_out, on_probe_answered, on_tool_outcome
from runtime._decide_turn import (
    advance,
    deadline_due,
    hibernate_due,
    on_admission_denied,
    on_admission_granted,
    on_control,
    on_control_refused,
    on_model_cancelled,
    on_model_failed,
    on_model_replied,
)
from runtime._step import Step
from runtime.effects import Effect, StartTimer
from runtime.events import Event, TimerFired
from runtime.fold import apply
from runtime.inputs import (
    AdmissionDenied,
    AdmissionGranted,
    ChildFinished,
    ControlReceived,
    ControlRefused,
    Input,
    ModelCancelled,
    ModelFailed,
    ModelReplied,
    PermitGranted,
    PermitRefused,
    ProbeAnswered,
    Recovered,
    Started,
    TimerDue,
    ToolOutcomeReceived,
)
from runtime.record import TimerKind, TrajectoryRecord

__all__ = ["Decision", "decide", "evolve"]

evolve = apply
"""``evolve(record, event) -> record``: apply one event (``runtime.fold.apply``; it refuses an event whose
guard fails with ``IllegalEvent`` before anything is written)."""


@dataclass(frozen=True, slots=True)
class Decision:
    """What one input decided. ``reply`` answers the caller of an input that wants one: a control
    delivery ("recorded", "duplicate", "rejected") or a timer delivery ("fired", "not_due", "unknown")."""

    events: tuple[Event, ...] = ()
    effects: tuple[Effect, ...] = ()
    reply: str | None = None
    # the record after each event, as the decision evolved it (so the interpreter need not fold them again);
    # derived from ``events``, so not part of a decision's identity
    records: tuple[TrajectoryRecord, ...] = field(default=(), compare=False, repr=False)


def _timer_due(step: Step, inp: TimerDue) -> None:
    timer = step.record.timers.get(inp.timer_id)
    if timer is None or step.record.is_terminal:
        step.reply = "unknown"  # fired already, cancelled, or this incarnation never armed it
        return
    if step.now < timer.due_at:
        step.reply = "not_due"  # a clock ahead of ours: arm it again
        step.do(StartTimer(timer))
        return
    step.emit(TimerFired(timer.timer_id))
    step.reply = "fired"
    if timer.kind in (TimerKind.DEADLINE, TimerKind.RESERVE):
        deadline_due(step)
    elif timer.kind is TimerKind.HIBERNATE:
        hibernate_due(step)
    elif timer.kind is TimerKind.CALL_DEADLINE:
        call_timed_out(step, timer.subject)
    elif timer.kind is TimerKind.RETRY:
        retry_due(step, timer.subject)
    # APPROVAL_EXPIRY and BACKOFF: ``advance`` acts on them (the expiry check, the next turn)


_RULES: Mapping[type, Callable[[Step, Any], None]] = {
    Started: on_started,
    Recovered: on_recovered,
    AdmissionGranted: on_admission_granted,
    AdmissionDenied: on_admission_denied,
    ModelReplied: on_model_replied,
    ModelFailed: on_model_failed,
    ModelCancelled: on_model_cancelled,
    PermitGranted: on_permit_granted,
    PermitRefused: on_permit_refused,
    ToolOutcomeReceived: on_tool_outcome,
    ProbeAnswered: on_probe_answered,
    ControlReceived: on_control,
    ControlRefused: on_control_refused,
    TimerDue: _timer_due,
    ChildFinished: on_child_finished,  # issue 12: delegation (runtime._decide_children)
}


def decide(record: TrajectoryRecord, input: Input, now: float) -> Decision:
    """The decision for ``input`` given ``record`` at wall time ``now`` (epoch seconds). Pure."""
    rule = _RULES.get(type(input))
    if rule is None:
        raise TypeError(f"not a decider input: {type(input).__name__}")
    step = Step(record, now)
    rule(step, input)
    advance(step)
    supervise.after_decision(step, 0)  # issue 12: escalation triggers, publishing escalations
    return Decision(tuple(step.events), tuple(step.effects), step.reply, tuple(step.records))
