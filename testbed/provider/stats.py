"""Counters kept from the provider's side, served at ``GET /testbed/stats`` (pure; clock injected).

JSON shape::

    {"uptime_s": float, "in_flight": int,
     "requests": int,        # every POST /v1/chat/completions
     "accepted": int,        # admitted by the limiter (then completed or aborted)
     "rate_limited": int,    # answered 429 by the limiter or a forced 429 fault
     "rejected": int,        # answered 4xx other than 429 (bad request, scenario, too large, auth)
     "failed": int,          # answered 5xx by a fault
     "aborted": int,         # accepted streams whose client went away before the end
     "tokens": {"prompt": int, "cached": int, "completion": int},   # billed, accepted requests only
     "trajectories": {ID: {"requests", "accepted", "rate_limited", "aborted",
                           "prompt_tokens", "cached_tokens", "completion_tokens"}},
     "timeline": [{"t": int, "accepted": int, "tokens": int, "rate_limited": int}, ...]}

``trajectories`` is keyed by the ``X-Tether-Trajectory`` header (``"-"`` when absent). ``timeline``
has one row per second since start/reset that saw activity: ``accepted`` counts admissions in that
second, ``tokens`` the billed tokens (prompt + completion) of requests that *finished* in it,
``rate_limited`` the 429s sent in it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Any

from runtime.clock import Clock

__all__ = ["ProviderStats", "TrajectoryCounters"]

_MAX_TIMELINE_ROWS = 86_400


@dataclass(slots=True)
class TrajectoryCounters:
    requests: int = 0
    accepted: int = 0
    rate_limited: int = 0
    aborted: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


@dataclass(slots=True)
class _Second:
    accepted: int = 0
    tokens: int = 0
    rate_limited: int = 0


class ProviderStats:
    """Mutable counters; every method is O(1)."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self.in_flight = 0  # a gauge: survives reset, since requests in flight still finish
        self.reset()

    def reset(self) -> None:
        """Zero every counter and restart the timeline (``POST /testbed/reset``)."""
        self._started = self._clock.now()
        self.requests = self.accepted = self.rate_limited = self.rejected = 0
        self.failed = self.aborted = 0
        self.prompt = self.cached = self.completion = 0
        self._trajectories: defaultdict[str, TrajectoryCounters] = defaultdict(TrajectoryCounters)
        self._timeline: dict[int, _Second] = {}

    def _second(self) -> _Second:
        t = int(self._clock.now() - self._started)
        row = self._timeline.get(t)
        if row is None:
            if len(self._timeline) >= _MAX_TIMELINE_ROWS:
                del self._timeline[min(self._timeline)]
            row = self._timeline[t] = _Second()
        return row

    def on_request(self, trajectory: str) -> None:
        self.requests += 1
        self._trajectories[trajectory].requests += 1

    def on_rate_limited(self, trajectory: str) -> None:
        self.rate_limited += 1
        self._trajectories[trajectory].rate_limited += 1
        self._second().rate_limited += 1

    def on_rejected(self) -> None:
        self.rejected += 1

    def on_failed(self) -> None:
        self.failed += 1

    def on_accepted(self, trajectory: str) -> None:
        self.accepted += 1
        self.in_flight += 1
        self._trajectories[trajectory].accepted += 1
        self._second().accepted += 1

    def on_finished(
        self, trajectory: str, *, prompt: int, cached: int, completion: int, aborted: bool
    ) -> None:
        """An accepted request ended (completed or aborted): bill what it used."""
        self.in_flight -= 1
        self.prompt += prompt
        self.cached += cached
        self.completion += completion
        counters = self._trajectories[trajectory]
        counters.prompt_tokens += prompt
        counters.cached_tokens += cached
        counters.completion_tokens += completion
        if aborted:
            self.aborted += 1
            counters.aborted += 1
        self._second().tokens += prompt + completion

    def to_json(self) -> dict[str, Any]:
        return {
            "uptime_s": self._clock.now() - self._started,
            "in_flight": self.in_flight,
            "requests": self.requests,
            "accepted": self.accepted,
            "rate_limited": self.rate_limited,
            "rejected": self.rejected,
            "failed": self.failed,
            "aborted": self.aborted,
            "tokens": {"prompt": self.prompt, "cached": self.cached, "completion": self.completion},
            "trajectories": {k: asdict(v) for k, v in self._trajectories.items()},
            "timeline": [{"t": t, **asdict(row)} for t, row in sorted(self._timeline.items())],
        }
