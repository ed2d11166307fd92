"""Injected time. Nothing in ``runtime/`` reads the wall clock directly.

``Clock.now()`` is seconds on a monotonic axis (deadlines, buckets, breakers, leases);
``Clock.wall()`` is seconds since the epoch (timestamps recorded in events and messages).
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol, runtime_checkable

__all__ = ["Clock", "FakeClock", "SystemClock"]


@runtime_checkable
class Clock(Protocol):
    """Source of time for every rule that depends on it."""

    def now(self) -> float:
        """Monotonic seconds; only differences are meaningful."""
        ...

    def wall(self) -> float:
        """Seconds since the Unix epoch."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` on this clock's axis."""
        ...


class SystemClock:
    """The real clock: ``time.monotonic`` and ``time.time``."""

    def now(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))


class FakeClock:
    """A clock that moves only when told to. Unit tests use it instead of sleeping.

    ``sleep`` suspends the caller until ``advance`` moves time past its wake-up point,
    so async code under test can be stepped deterministically.
    """

    def __init__(self, start: float = 1_000.0, wall_start: float = 1_700_000_000.0) -> None:
        self._now = start
        self._wall_offset = wall_start - start
        self._sleepers: list[tuple[float, asyncio.Future[None]]] = []

    def now(self) -> float:
        return self._now

    def wall(self) -> float:
        return self._now + self._wall_offset

    def advance(self, seconds: float) -> None:
        """Move time forward and wake every sleeper whose deadline has passed."""
        if seconds < 0:
            raise ValueError("a clock cannot go backwards")
        self._now += seconds
        due = [(t, f) for t, f in self._sleepers if t <= self._now]
        self._sleepers = [(t, f) for t, f in self._sleepers if t > self._now]
        for _, fut in due:
            if not fut.done():
                fut.set_result(None)

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._sleepers.append((self._now + seconds, fut))
        await fut

    @property
    def pending_sleepers(self) -> int:
        """How many coroutines are waiting on this clock."""
        return sum(1 for _, f in self._sleepers if not f.done())
