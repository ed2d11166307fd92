"""Semantic watchdogs: pure detectors of non-progress over a bounded window of steps.

A budget stops a loop only at its ceiling; detection latency is what sets a loop's cost (recovery
chapter §12.6.2: stopping at turn 4 instead of 50 is 88.7x cheaper). The reliability guide §4.1 names
three phenomena with separate detectors, plus §4.5's coarse detector against trivial variation:

- **exact repetition**: the same call fingerprint at least ``limit`` times within the window;
- **trivial variation**: the same (tool, target resource) coarse fingerprint ``limit`` times with
  differing arguments, which evades the exact detector;
- **cycling / oscillation**: the state digest returns to one seen at lag ≥ 2 (equation 6, period p ≥ 2:
  A, B, A, B), counted as recurrences; one planned backtrack is tolerated, repeated recurrence is not;
- **stagnation**: the state digest does not advance for ``steps`` consecutive steps (period 1,
  "stutter" turns).

Steps marked ``waiting_on_job`` (polling a pending asynchronous job) are exempt from every detector:
they neither count nor reset. An unchanged workspace and a repeated status call while a background test
runs are not a loop (§12.6.1); the job's own deadline bounds the polling instead.

Tolerances are greater than one because legitimate repetition exists (§4.4: polling, pagination,
retry after a transient error). A verdict is evidence, not proof: the caller turns it into the
pending_control admission hold and picks a graduated response (inform, constrain, end).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from runtime.errors import InputError

__all__ = [
    "Guard",
    "WatchdogConfig",
    "WatchdogConfigError",
    "WatchdogFinding",
    "WatchdogState",
    "WatchdogStep",
    "WatchdogVerdict",
    "inspect",
    "recurrence_period",
]


class WatchdogConfigError(InputError):
    """A watchdog threshold was out of range (names the field)."""


class Guard(StrEnum):
    """Which detector fired, in the order they are evaluated."""

    EXACT_REPEAT = "exact_repeat"
    TRIVIAL_VARIATION = "trivial_variation"
    CYCLE = "cycle"
    STAGNATION = "stagnation"


@dataclass(frozen=True, slots=True)
class WatchdogStep:
    """What one step looked like to the harness. Any fingerprint may be None (e.g. a turn with no tool
    call has no call fingerprint; a step with no state capture has no digest)."""

    call_fingerprint: str | None
    coarse_fingerprint: str | None
    state_digest: str | None
    waiting_on_job: bool = False


@dataclass(frozen=True, slots=True)
class WatchdogConfig:
    """Windows and tolerances; defaults follow the seeds (fire on the third identical call, tolerate
    one backtrack, keep a bounded digest history)."""

    exact_window: int = 10
    exact_limit: int = 3
    coarse_window: int = 10
    coarse_limit: int = 5
    cycle_history: int = 8  # retained digests m: periods 2..m are detectable
    cycle_recurrences: int = 2
    stagnation_steps: int = 5

    def __post_init__(self) -> None:
        for name, minimum in (
            ("exact_window", 2),
            ("exact_limit", 2),
            ("coarse_window", 2),
            ("coarse_limit", 2),
            ("cycle_history", 2),
            ("cycle_recurrences", 1),
            ("stagnation_steps", 1),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise WatchdogConfigError(
                    f"must be an int ≥ {minimum}, got {value!r}", where=f"watchdog.{name}"
                )
        if self.exact_limit > self.exact_window:
            raise WatchdogConfigError("limit cannot exceed the window", where="watchdog.exact_limit")
        if self.coarse_limit > self.coarse_window:
            raise WatchdogConfigError("limit cannot exceed the window", where="watchdog.coarse_limit")

    @property
    def retained(self) -> int:
        """Steps any detector may look back over."""
        return max(self.exact_window, self.coarse_window, self.cycle_history + 1, self.stagnation_steps + 1)


@dataclass(frozen=True, slots=True)
class WatchdogFinding:
    """One fired guard with its evidence: indices are positions in the inspected history."""

    guard: Guard
    count: int
    step_indices: tuple[int, ...]
    detail: str


@dataclass(frozen=True, slots=True)
class WatchdogVerdict:
    """Every guard that fired on the latest step; ``guard`` is the first in evaluation order."""

    findings: tuple[WatchdogFinding, ...] = ()

    @property
    def fired(self) -> bool:
        return bool(self.findings)

    @property
    def guard(self) -> Guard | None:
        return self.findings[0].guard if self.findings else None


def recurrence_period(window: Sequence[str], current: str) -> int | None:
    """Recovery chapter Listing 1: the smallest lag at which ``current`` appeared in ``window``
    (oldest first), or None."""
    for lag, past in enumerate(reversed(window), start=1):
        if past == current:
            return lag
    return None


def _exact(history: Sequence[WatchdogStep], cfg: WatchdogConfig) -> WatchdogFinding | None:
    latest = history[-1].call_fingerprint
    if latest is None or history[-1].waiting_on_job:
        return None
    start = max(0, len(history) - cfg.exact_window)
    hits = tuple(
        i
        for i in range(start, len(history))
        if history[i].call_fingerprint == latest and not history[i].waiting_on_job
    )
    if len(hits) < cfg.exact_limit:
        return None
    return WatchdogFinding(
        Guard.EXACT_REPEAT,
        len(hits),
        hits,
        f"identical call {len(hits)} times in the last {cfg.exact_window} steps",
    )


def _coarse(history: Sequence[WatchdogStep], cfg: WatchdogConfig) -> WatchdogFinding | None:
    latest = history[-1].coarse_fingerprint
    if latest is None or history[-1].waiting_on_job:
        return None
    start = max(0, len(history) - cfg.coarse_window)
    hits = tuple(
        i
        for i in range(start, len(history))
        if history[i].coarse_fingerprint == latest and not history[i].waiting_on_job
    )
    variants = {history[i].call_fingerprint for i in hits}
    # Same target with one identical call is the exact detector's case, not a variation.
    if len(hits) < cfg.coarse_limit or len(variants) < 2:
        return None
    return WatchdogFinding(
        Guard.TRIVIAL_VARIATION,
        len(hits),
        hits,
        f"same tool and target {len(hits)} times with {len(variants)} argument variants",
    )


def _progress_steps(history: Sequence[WatchdogStep]) -> list[int]:
    """Indices of steps whose state digest is evidence (captured, not waiting on a job)."""
    return [i for i, s in enumerate(history) if s.state_digest is not None and not s.waiting_on_job]


def _cycle(history: Sequence[WatchdogStep], cfg: WatchdogConfig) -> WatchdogFinding | None:
    idx = _progress_steps(history)
    if not idx or idx[-1] != len(history) - 1:
        return None
    digests = [history[i].state_digest for i in idx]
    # Consider the last cycle_history + 1 captures; a recurrence is a return at lag ≥ 2 that is not a
    # stutter (an unchanged state is stagnation's business, lag 1).
    lo = max(0, len(digests) - (cfg.cycle_history + 1))
    recurrences: list[int] = []
    for j in range(lo + 1, len(digests)):
        current = digests[j]
        if current is None or current == digests[j - 1]:
            continue
        window = [d for d in digests[lo:j] if d is not None]
        lag = recurrence_period(window, current)
        if lag is not None and lag >= 2:
            recurrences.append(idx[j])
    if len(recurrences) < cfg.cycle_recurrences or recurrences[-1] != len(history) - 1:
        return None
    return WatchdogFinding(
        Guard.CYCLE,
        len(recurrences),
        tuple(recurrences),
        f"state returned to an earlier digest {len(recurrences)} times"
        f" in the last {cfg.cycle_history} captures",
    )


def _stagnation(history: Sequence[WatchdogStep], cfg: WatchdogConfig) -> WatchdogFinding | None:
    idx = _progress_steps(history)
    if len(idx) < cfg.stagnation_steps + 1 or idx[-1] != len(history) - 1:
        return None
    tail = idx[-(cfg.stagnation_steps + 1) :]
    digests = {history[i].state_digest for i in tail}
    if len(digests) != 1:
        return None
    return WatchdogFinding(
        Guard.STAGNATION,
        cfg.stagnation_steps,
        tuple(tail[1:]),
        f"state unchanged for {cfg.stagnation_steps} steps",
    )


_DETECTORS = (_exact, _coarse, _cycle, _stagnation)


def inspect(history: Sequence[WatchdogStep], config: WatchdogConfig = WatchdogConfig()) -> WatchdogVerdict:
    """Run every detector on the latest step of ``history`` (oldest first). A detector fires only on a
    pattern that includes the latest step, so a stale pattern does not keep firing on healthy steps."""
    if not history:
        return WatchdogVerdict()
    window = history[-config.retained :]
    offset = len(history) - len(window)
    findings = []
    for detect in _DETECTORS:
        finding = detect(window, config)
        if finding is not None:
            shifted = tuple(i + offset for i in finding.step_indices)
            findings.append(WatchdogFinding(finding.guard, finding.count, shifted, finding.detail))
    return WatchdogVerdict(tuple(findings))


@dataclass(frozen=True, slots=True)
class WatchdogState:
    """Bounded history for one trajectory. ``observe`` returns the next state and the verdict; to check
    a proposal *before* dispatch (action comparison), observe it and discard the returned state."""

    config: WatchdogConfig = WatchdogConfig()
    history: tuple[WatchdogStep, ...] = ()
    steps_seen: int = 0

    def observe(self, step: WatchdogStep) -> tuple[WatchdogState, WatchdogVerdict]:
        history = (*self.history, step)[-self.config.retained :]
        verdict = inspect(history, self.config)
        # Re-base indices on the trajectory's step count so the finding names real steps.
        base = self.steps_seen + 1 - len(history)
        rebased = WatchdogVerdict(
            tuple(
                WatchdogFinding(f.guard, f.count, tuple(i + base for i in f.step_indices), f.detail)
                for f in verdict.findings
            )
        )
        return WatchdogState(self.config, history, self.steps_seen + 1), rebased

    def reset(self) -> WatchdogState:
        """Forget the window (after an intervention changed the situation, e.g. a backtrack)."""
        return WatchdogState(self.config, (), self.steps_seen)
