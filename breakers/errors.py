"""Refusals specific to dependency guarding, as subclasses of the rooted ``runtime.errors`` tree.

``BreakerOpen`` and ``BulkheadFull`` live in ``runtime.errors`` because trajectories handle them by name;
the ones here refine ``AdmissionRefused`` so callers that only know the runtime tree still handle them.
"""

from __future__ import annotations

from runtime.errors import AdmissionRefused

__all__ = ["AttemptBudgetExhausted", "QueuedPastDeadline"]


class QueuedPastDeadline(AdmissionRefused):
    """A call reached (or waited in) the bulkhead past its absolute deadline; it is never dispatched."""

    def __init__(self, scope: str, call_id: str, deadline: float) -> None:
        self.scope = scope
        self.call_id = call_id
        self.deadline = deadline
        super().__init__(
            "deadline", f"call {call_id!r} for {scope!r} passed its deadline {deadline:.3f} before dispatch"
        )


class AttemptBudgetExhausted(AdmissionRefused):
    """The logical operation has used every attempt of its single shared budget."""

    def __init__(self, operation_id: str, attempts: int) -> None:
        self.operation_id = operation_id
        self.attempts = attempts
        super().__init__("attempt_budget", f"operation {operation_id!r} used all {attempts} attempts")
