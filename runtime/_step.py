"""One decision in the making: the record as it evolves, the events emitted so far, the effects asked for.

Every rule of ``runtime.decide`` writes through a ``Step``. ``emit`` applies each event with
``runtime.fold.apply`` at once, so the next rule reads the record as it will be once the batch is durable,
and an event no guard allows raises ``IllegalEvent`` right where it was decided (a bug in the rules, never
a log entry). Nothing here reads a clock or draws a random number: ``now`` is the decision's input, ids come
from the log position, and jitter from the policy's seed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from runtime.effects import CancelTimer, Effect, StartTimer
from runtime.events import Event, TimerCancelled, TimerStarted
from runtime.fold import apply
from runtime.policy import TrajectoryPolicy
from runtime.record import ControlAction, PendingControl, Timer, TimerKind, TrajectoryRecord

__all__ = ["STOPS", "Step"]

STOPS = (ControlAction.KILL, ControlAction.CANCEL, ControlAction.PAUSE)
"""Requests that stop new work: nothing not yet sent is sent once one of them is pending."""


class Step:
    """The decision being built for one input (``runtime.decide``)."""

    def __init__(self, record: TrajectoryRecord, now: float) -> None:
        self.record = record
        self.now = now
        self.events: list[Event] = []
        self.records: list[TrajectoryRecord] = []  # the record after each event (the interpreter reuses them)
        self.effects: list[Effect] = []
        self.reply: str | None = None
        self._ids = 0

    @property
    def policy(self) -> TrajectoryPolicy:
        return self.record.policy

    def emit(self, *events: Event) -> TrajectoryRecord:
        """Append facts to the decision (each applied to the record at once)."""
        for event in events:
            self.record = apply(self.record, event)
            self.events.append(event)
            self.records.append(self.record)
        return self.record

    def do(self, *effects: Effect) -> None:
        """Ask the interpreter for effects (carried out once this decision's events are durable)."""
        self.effects.extend(effects)

    def new_id(self, prefix: str) -> str:
        """An id unique within the trajectory and the same on every replay of this decision."""
        self._ids += 1
        return f"{prefix}-{self.record.log_position}.{self._ids}"

    def uniform(self, salt: str) -> float:
        """A number in [0, 1) drawn from the policy's seed: the decider's only randomness (jitter)."""
        material = f"{self.policy.rng_seed}|{self.record.trajectory_id}|{self.record.log_position}|{salt}"
        digest = hashlib.sha256(material.encode()).digest()
        return int.from_bytes(digest[:8], "big") / 2.0**64

    # ------------------------------------------------------------------ timers

    def arm(self, kind: TimerKind, due_at: float, subject: str = "") -> Timer:
        """Arm a timer: recorded, then started by the interpreter (durable kinds in the timer store)."""
        timer = Timer(self.new_id(kind.value), kind, due_at, subject)
        self.emit(TimerStarted(timer.timer_id, kind, due_at, subject))
        self.do(StartTimer(timer))
        return timer

    def disarm(self, timer: Timer | None) -> None:
        if timer is not None and timer.timer_id in self.record.timers:
            self.emit(TimerCancelled(timer.timer_id))
            self.do(CancelTimer(timer))

    def disarm_all(self, kinds: Iterable[TimerKind] | None = None) -> None:
        wanted = set(kinds) if kinds is not None else None
        for timer in list(self.record.timers.values()):
            if wanted is None or timer.kind in wanted:
                self.disarm(timer)

    # ------------------------------------------------------------------ control

    def pending(self, *actions: ControlAction) -> PendingControl | None:
        """The first pending request among ``actions`` (arrival order)."""
        return next((p for p in self.record.pending_control if p.action in actions), None)

    @property
    def forward_deadline(self) -> float | None:
        """The last instant forward work may run to: the deadline minus the finalization reserve."""
        deadline = self.record.deadline
        return None if deadline is None else deadline - self.policy.reserve.seconds
