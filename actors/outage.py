"""Riding out an outage of a dependency the cluster services cannot work without (Redis).

Issue 13: treat an unreachable Redis as a wait, not a failure. A service loop (relay, timer service, the
``tether run`` driver's status reads) that fails on Redis backs off and tries again, for as long as the
failures have lasted less than its outage budget (default five minutes); once they have lasted longer,
the failure is real and is raised (``OutageExceeded``, naming the last error). One success ends the
outage and resets both the budget and the backoff.

``Backoff`` is the per-key delay schedule (exponential with full jitter, capped); ``Outage`` the budget
around it. Both take an injected clock, so the unit tests step them without sleeping.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import redis.exceptions

from runtime.clock import Clock, SystemClock
from runtime.errors import DependencyError

__all__ = [
    "DEFAULT_OUTAGE_BUDGET_S",
    "UNREACHABLE",
    "Backoff",
    "Outage",
    "OutageExceeded",
    "is_outage",
    "pause",
]

DEFAULT_OUTAGE_BUDGET_S = 300.0
T = TypeVar("T")
# What an unreachable or restarting Redis raises (redis-py's own types, and the OS's), besides the
# ``DependencyError`` the cluster layer's wrappers turn them into.
UNREACHABLE: tuple[type[BaseException], ...] = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    ConnectionError,
    TimeoutError,
    OSError,
)


class OutageExceeded(DependencyError):
    """A dependency stayed unreachable longer than the outage budget."""


@dataclass
class Backoff:
    """Delays that double from ``base_s`` up to ``cap_s``; with ``jitter`` each delay is drawn uniformly
    from zero to that bound (full jitter: retries of many callers spread out instead of arriving together)."""

    base_s: float = 0.05
    cap_s: float = 5.0
    jitter: bool = True
    rand: Callable[[], float] = field(default=random.random, repr=False)
    attempts: int = 0

    def next(self) -> float:
        """The delay before the next try (and count the try)."""
        bound = min(self.cap_s, self.base_s * float(2 ** min(self.attempts, 30)))
        self.attempts += 1
        return bound * self.rand() if self.jitter else bound

    def reset(self) -> None:
        self.attempts = 0


class Outage:
    """The outage budget of one service loop: ``failed`` waits (backoff) or raises ``OutageExceeded``."""

    def __init__(
        self,
        what: str,
        *,
        budget_s: float = DEFAULT_OUTAGE_BUDGET_S,
        backoff: Backoff | None = None,
        clock: Clock | None = None,
    ) -> None:
        if budget_s < 0:
            raise ValueError(f"outage budget must be >= 0 seconds, got {budget_s}")
        self.what = what
        self.budget_s = budget_s
        self.backoff = backoff or Backoff(base_s=0.1, cap_s=5.0)
        self.clock = clock or SystemClock()
        self.since: float | None = None  # when the current outage began (clock.now())
        self.outages = 0  # how many outages were ridden out (a success after at least one failure)

    @property
    def ongoing(self) -> bool:
        return self.since is not None

    @property
    def lasted_s(self) -> float:
        """How long the current outage has lasted (0 when there is none)."""
        return 0.0 if self.since is None else self.clock.now() - self.since

    def ok(self) -> None:
        """A call succeeded: the outage (if any) is over."""
        if self.since is not None:
            self.outages += 1
        self.since = None
        self.backoff.reset()

    async def failed(self, error: BaseException) -> None:
        """A call failed: wait before the next try, or raise ``OutageExceeded`` when the budget is spent."""
        now = self.clock.now()
        if self.since is None:
            self.since = now
        lasted = now - self.since
        if lasted >= self.budget_s:
            raise OutageExceeded(
                f"{self.what}: still failing after {lasted:.0f}s (outage budget {self.budget_s:.0f}s); "
                f"last error: {error}",
                scope="redis",
            ) from error
        delay = min(self.backoff.next(), max(0.0, self.budget_s - lasted))
        await self.clock.sleep(delay)

    async def call(self, fn: Callable[[], Awaitable[T]]) -> T:
        """``fn()`` until it succeeds, riding out failures within the budget."""
        while True:
            try:
                value = await fn()
            except Exception as e:
                if not is_outage(e):
                    raise
                await self.failed(e)
                continue
            self.ok()
            return value


def is_outage(error: BaseException) -> bool:
    """Whether ``error`` looks like the dependency being away (worth waiting for), not a bug or a refusal."""
    if isinstance(error, DependencyError):
        return not error.non_retryable
    return isinstance(error, UNREACHABLE)


async def pause(clock: Clock, seconds: float, stopping: asyncio.Event) -> None:
    """Sleep ``seconds`` on ``clock``, but wake at once when ``stopping`` is set (a loop's backoff that
    must not delay its ``stop()``)."""
    if stopping.is_set():
        return
    sleeper = asyncio.ensure_future(clock.sleep(seconds))
    stopper = asyncio.ensure_future(stopping.wait())
    try:
        await asyncio.wait({sleeper, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (sleeper, stopper):
            t.cancel()
