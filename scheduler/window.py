"""A sliding-window ledger of our own admissions: over any ``window_s`` seconds, at most ``capacity``.

The token bucket spreads admissions evenly, but on its own it allows ``capacity`` as a burst plus
``capacity`` of refill within one minute after an idle spell: twice a per-minute limit that the
provider enforces over a sliding window. This ledger closes that gap. Like the provider's, an entry
keeps its admission time and is corrected to the actual usage at settlement.

An entry may be dated in the future (``add(..., at=...)``): a lease of requests that its holder may
use until ``at`` is counted from now until ``at + window_s``, the latest any of them can leave the
provider's window. Entries stay sorted by date, so expiry still pops from the front.

A ledger may also mirror a provider's sub-minute enforcement (``alone_fits``): then an amount larger
than the remaining capacity still fits when nothing else is in the window, as the testbed provider's
token sub-window rules (``testbed/provider/sliding_window.py``).

Pure: every method takes ``now`` (monotonic seconds).
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass

__all__ = ["WindowLedger"]

_EPS = 1e-9
_MIN_WAIT_S = 1e-6


@dataclass(slots=True)
class _Entry:
    at: float
    amount: float
    entry_id: int


class WindowLedger:
    """Admissions in ``(now - window_s, now]`` summed; a new one fits when the sum stays within capacity."""

    def __init__(self, capacity: float, window_s: float = 60.0, alone_fits: bool = False) -> None:
        if capacity <= 0 or window_s <= 0:
            raise ValueError(f"ledger needs capacity > 0 and window_s > 0, got {capacity=} {window_s=}")
        self.capacity = float(capacity)
        self.window_s = float(window_s)
        self.alone_fits = alone_fits
        self._entries: deque[_Entry] = deque()
        self._by_id: dict[int, _Entry] = {}
        self._ids = itertools.count(1)
        self.total = 0.0

    def _expire(self, now: float) -> None:
        horizon = now - self.window_s
        # No tolerance here: a tolerance would let an admission leave the window a moment before a full
        # window has passed, which is exactly the overrun a sliding-window provider answers with a 429.
        while self._entries and self._entries[0].at <= horizon:
            old = self._entries.popleft()
            del self._by_id[old.entry_id]
            self.total -= old.amount

    def used(self, now: float) -> float:
        self._expire(now)
        return self.total

    def covers(self, amount: float, now: float) -> bool:
        used = self.used(now)
        return used + amount <= self.capacity + _EPS or (self.alone_fits and used <= _EPS)

    def add(self, amount: float, now: float, entry_id: int | None = None, at: float | None = None) -> int:
        """Record an admission; returns its id for ``correct`` (``entry_id``: reuse another ledger's id).

        ``at`` (>= ``now``) dates it later than now: the last moment a leased amount may be used."""
        self._expire(now)
        when = now if at is None else max(now, at)
        entry = _Entry(when, float(amount), next(self._ids) if entry_id is None else entry_id)
        if not self._entries or self._entries[-1].at <= when:
            self._entries.append(entry)
        else:  # behind a lease dated later: keep the deque sorted (leases are few and near the end)
            index = len(self._entries)
            while index > 0 and self._entries[index - 1].at > when:
                index -= 1
            self._entries.insert(index, entry)
        self._by_id[entry.entry_id] = entry
        self.total += entry.amount
        return entry.entry_id

    def correct(self, entry_id: int, amount: float) -> None:
        """Replace an admission's amount by what it really used (no-op once it left the window)."""
        entry = self._by_id.get(entry_id)
        if entry is not None:
            self.total += amount - entry.amount
            entry.amount = float(amount)

    def ready_at(self, amount: float, now: float) -> float:
        """When enough old admissions will have left the window for ``amount`` to fit (inf: never)."""
        self._expire(now)
        if self.covers(amount, now):
            return now
        excess = self.total + amount - self.capacity
        fit = math.inf
        if amount <= self.capacity + _EPS:
            freed = 0.0
            for entry in self._entries:
                freed += entry.amount
                if freed + _EPS >= excess:
                    fit = entry.at + self.window_s
                    break
        if self.alone_fits:
            last = next((e for e in reversed(self._entries) if e.amount > _EPS), None)
            fit = min(fit, now if last is None else last.at + self.window_s)
        return max(fit, now + _MIN_WAIT_S)
