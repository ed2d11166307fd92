"""Repair episodes (recovery chapter §12.4): corrective attempts are bounded, and counted when admitted.

When a call is rejected for its own content (the local validator refused its arguments, or the endpoint
answered with a client rejection), the runtime knows the action never took effect: a repair is possible.
Every later proposal of the same tool is a corrective attempt of one *repair episode* and is counted when
it is admitted, not when it succeeds, so failed, timed-out or aborted attempts cannot evade the cap, and
renaming nothing resets it. The episode closes when the tool succeeds; exhausted, further attempts are
refused and the trajectory is paused for a person (exhausting an episode is an exhausted recovery budget,
not proof that no fix exists).

Repair or rebuild (§12.4.3): repairing first costs ``C_r + (1 - p) C_f`` in expectation against ``C_f`` for
unwinding and rebuilding at once, so repair is worth trying only when ``p > p* = C_r / C_f``. The workload
may declare the three numbers for its failure class; without them the runtime allows the bounded repair.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

__all__ = ["EpisodeState", "RepairChoice", "RepairEpisode", "repair_or_rebuild"]


class EpisodeState(StrEnum):
    OPEN = "open"
    CLOSED = "closed"  # the tool succeeded: the repair worked
    EXHAUSTED = "exhausted"  # the cap was reached: no more corrective attempts


class RepairChoice(StrEnum):
    REPAIR = "repair"
    REBUILD = "rebuild"


@dataclass(frozen=True, slots=True)
class RepairEpisode:
    episode_id: str
    tool: str
    state: EpisodeState
    attempts: int  # corrective attempts admitted so far
    cap: int
    choice: RepairChoice
    reason: str  # why it opened (the rejection), and the cost rule's verdict


def repair_or_rebuild(
    success_probability: float | None, attempt_cost: float | None, fallback_cost: float | None
) -> tuple[RepairChoice, str]:
    """Equation 4: repair first iff ``p > C_r / C_f``. Undeclared costs allow the bounded repair."""
    if success_probability is None or attempt_cost is None or fallback_cost is None:
        return RepairChoice.REPAIR, "no declared costs: bounded repair"
    if fallback_cost <= 0:
        return RepairChoice.REBUILD, "rebuilding costs nothing: rebuild"
    threshold = attempt_cost / fallback_cost
    if success_probability > threshold:
        return RepairChoice.REPAIR, f"p={success_probability:g} > p*={threshold:.3g}: repair first"
    return RepairChoice.REBUILD, f"p={success_probability:g} <= p*={threshold:.3g}: rebuild"
