"""Controls for ``test_defects_end_to_end``: the product with one of issue 10's fixes switched off.

Each switch puts back the behaviour the issue reported as a defect, inside the trajectory actor's own
worker process, the way ``tests.faults.mutations`` does: ``SwitchedAdapters`` is the cluster port object
every trajectory actor receives in its constructor, and unpickling it in the worker applies the switch
there, once (each actor has a worker process of its own). Nothing in the product knows about it. The test
process folds the log with the unpatched rules, so a judge reading the log sees what the switched actor
decided, not what it would have decided with the fix.

The switches patch module-level names that the decider looks up at call time; a rewrite that moves one of
them has to move the switch with it (the control then fails loudly: the name is not there).
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray.cloudpickle

from cluster.adapters import ClusterAdapters

__all__ = ["SWITCHES", "SwitchedAdapters"]

# The workers cannot import ``tests``: this module travels with the pickled adapters instead.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # type: ignore[no-untyped-call]


def _module(name: str) -> Any:
    return importlib.import_module(name)


def _paused_ignores_deadline() -> None:
    """Defect 1: PAUSED answers resume, cancel and kill, and re-arms its idle timer, but never looks at the
    deadline."""
    turn = _module("runtime._decide_turn")
    from runtime.events import ControlApplied, StateChanged
    from runtime.record import ControlAction, TimerKind
    from runtime.states import ExitReason, TrajectoryState

    def paused(step: Any) -> bool:
        for req in list(step.record.pending_control):
            if req.action is ControlAction.RESUME:
                step.emit(ControlApplied(req.message_id))
                step.disarm(step.record.timer_of(TimerKind.HIBERNATE))
                step.emit(StateChanged(TrajectoryState.PAUSED, TrajectoryState.READY, "resumed"))
                return True
            if req.action in (ControlAction.KILL, ControlAction.CANCEL):
                reason = ExitReason.KILLED if req.action is ControlAction.KILL else ExitReason.CANCELED
                step.emit(ControlApplied(req.message_id))
                turn.enter_finalizing(step, reason, f"{req.action.value} by {req.issuer}")
                return True
        turn._arm_hibernation(step)
        return False

    turn._paused = paused


def _stop_waits_for_calls() -> None:
    """Defects 2 and 3: a pause or cancel waits at the turn boundary for every call, in flight or queued
    for a permit, and a permit granted later sends its call whatever stop is pending."""
    turn = _module("runtime._decide_turn")
    dispatch = _module("runtime._decide_dispatch")
    from runtime.record import ControlAction

    original = turn._waiting_tool

    def waiting_tool(step: Any) -> bool:
        stop = step.pending(*turn.STOPS)
        busy = step.record.pending_calls or step.record.queued
        if stop is not None and stop.action is not ControlAction.KILL and busy:
            return False
        return bool(original(step))

    turn._waiting_tool = waiting_tool
    dispatch.stop_requested = lambda step: None


def _approval_wait_charged() -> None:
    """Defect 4: the time a call waited for approval is not excluded from the compute budget's wall
    clock."""
    fold = _module("runtime.fold")
    from runtime.events import ApprovalDecided

    original = fold._HANDLERS[ApprovalDecided]

    def decided(rec: Any, ev: Any) -> Any:
        return dataclasses.replace(original(rec, ev), excluded_wait_s=rec.excluded_wait_s)

    fold._HANDLERS[ApprovalDecided] = decided


def _single_message_quorum() -> None:
    """Defect 5: an approval message that does not make the quorum on its own discards the held call
    (signatures are counted per message, never accumulated)."""
    gate = _module("runtime._decide_approval")
    from runtime.record import ApprovalDecision, ControlAction

    original = gate._vote

    def vote(step: Any, req: Any) -> bool:
        if original(step, req):
            return True
        held = step.record.held
        if req.action is ControlAction.APPROVE and held is not None and held.votes and held.decision is None:
            names = tuple(gate._signers(req))
            gate._refuse_held(step, ApprovalDecision.DENIED, names, "APPROVAL_DENIED", "quorum not met")
            return True
        return False

    gate._vote = vote


def _roles_ignored() -> None:
    """Defect 5, roles: a quorum of distinct signers is enough, whichever roles they hold."""
    approval = _module("runtime.approval")
    approval._cover_roles = lambda required, signer_roles: frozenset()


def _rejected_calls_unwatched() -> None:
    """Defect 6: a call rejected locally (its arguments, its grant) is never shown to the watchdog."""
    tools = _module("runtime._decide_tools")
    original = tools._observe

    def observe(step: Any, p: Any, args: Any) -> str | None:
        return original(step, p, args) if args is not None else None

    tools._observe = observe


SWITCHES: dict[str, Callable[[], None]] = {
    "paused-ignores-deadline": _paused_ignores_deadline,
    "stop-waits-for-calls": _stop_waits_for_calls,
    "approval-wait-charged": _approval_wait_charged,
    "single-message-quorum": _single_message_quorum,
    "roles-ignored": _roles_ignored,
    "rejected-calls-unwatched": _rejected_calls_unwatched,
}


def _applied() -> set[str]:
    """The switches applied in this process (kept outside this module, which arrives pickled by value
    once per object that refers to it)."""
    holder: Any = sys.modules.setdefault("tether_defect_switches", types.ModuleType("tether_defect_switches"))
    if not hasattr(holder, "applied"):
        holder.applied = set()
    applied: set[str] = holder.applied
    return applied


def _switched(switch: str) -> SwitchedAdapters:
    """Unpickling ``SwitchedAdapters`` (in the actor's worker): apply the switch, once per process."""
    if switch not in _applied():
        SWITCHES[switch]()
        _applied().add(switch)
    return SwitchedAdapters(switch=switch)


@dataclass(frozen=True, slots=True)
class SwitchedAdapters(ClusterAdapters):
    """``ClusterAdapters`` that switch one fix off in the trajectory actor's worker process."""

    switch: str = ""

    def __post_init__(self) -> None:
        if self.switch not in SWITCHES:
            raise ValueError(f"unknown switch {self.switch!r}; known: {sorted(SWITCHES)}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (_switched, (self.switch,))
