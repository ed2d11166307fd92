"""OpenAI-like limiter: exact sliding windows over the minute and over a sub-minute period (pure).

A request is admitted when, counting every charge whose timestamp lies in ``(now - length, now]``, one more
request and its token charge fit under the limits of *both* horizons:

- the window (``window_s``, 60 s for a real provider): ``rpm`` requests and ``tpm`` tokens;
- the sub-window (``sub_window_s``, default ``window_s / 60``; 0 turns it off): the request limit scaled to
  its length and rounded up, ``ceil(rpm * sub / window)`` (OpenAI's example: a 60 RPM limit may act as one
  request per second, so "short high-volume request bursts" are refused). With ``sub_window_tokens`` the
  token limit too, ``ceil(tpm * sub / window)``; then a request that would be the only token charge in its
  sub-window is never refused by it (a 60k-TPM key still takes one 4k-token request). Off by default:
  OpenAI's example is about requests, and a per-second token share of a few requests' size makes the
  outcome hinge on how well a client estimates prompt sizes rather than on how it paces.

Rejected requests leave a charge (one request, their prompt tokens) when ``count_rejected`` is on. The
common rules (charge, correction, truthful headers) are in :mod:`.limits`.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass

from runtime.clock import Clock
from testbed.provider.limits import (
    Admitted,
    LimitDimension,
    LimitSnapshot,
    Rejected,
    check_charge,
    check_limits,
)

__all__ = ["SlidingWindowLimiter"]

# Expiry tolerance: keeps "retry after exactly retry_after_s" true despite float rounding.
_EXPIRY_EPS = 1e-9
_REJECTED = 0  # ticket of a rejected request's charge: never settled


@dataclass(slots=True)
class _Entry:
    at: float
    tokens: int
    ticket: int


class _Horizon:
    """The charges of the last ``length`` seconds and their sums, with this horizon's limits."""

    def __init__(self, length: float, rpm: int | None, tpm: int | None, alone_fits: bool) -> None:
        self.length = length
        self.rpm, self.tpm = rpm, tpm
        self.alone_fits = alone_fits  # a token charge alone in this horizon always fits
        self.entries: deque[_Entry] = deque()
        self.requests = 0
        self.tokens = 0

    def expire(self, now: float) -> None:
        cutoff = now - self.length + _EXPIRY_EPS
        while self.entries and self.entries[0].at <= cutoff:
            old = self.entries.popleft()
            self.requests -= 1
            self.tokens -= old.tokens

    def holds(self, entry: _Entry, now: float) -> bool:
        return entry.at > now - self.length + _EXPIRY_EPS

    def add(self, entry: _Entry) -> None:
        self.entries.append(entry)
        self.requests += 1
        self.tokens += entry.tokens

    def clear(self) -> None:
        self.entries.clear()
        self.requests = self.tokens = 0

    def wait_requests(self, now: float) -> float:
        """Seconds until one more request fits (0: now)."""
        if self.rpm is None or self.requests + 1 <= self.rpm:
            return 0.0
        blocking = self.entries[self.requests - self.rpm]  # the oldest (requests - rpm + 1) must leave
        return blocking.at + self.length - now

    def wait_tokens(self, now: float, charge: int) -> float:
        """Seconds until ``charge`` more tokens fit (0: now)."""
        if self.tpm is None or self.tokens + charge <= self.tpm:
            return 0.0
        if self.alone_fits and self.tokens == 0:
            return 0.0
        excess = self.tokens + charge - self.tpm
        freed = 0
        fit = math.inf
        for entry in self.entries:
            freed += entry.tokens
            if freed >= excess:
                fit = entry.at + self.length - now
                break
        if self.alone_fits:
            fit = min(fit, self.empty_of_tokens_in(now))
        return fit

    def empty_of_tokens_in(self, now: float) -> float:
        """Seconds until no token charge is left in this horizon."""
        last = next((e for e in reversed(self.entries) if e.tokens > 0), None)
        return 0.0 if last is None else max(0.0, last.at + self.length - now)

    def remaining_requests(self) -> int | None:
        return None if self.rpm is None else max(0, self.rpm - self.requests)


def _scaled(limit: int | None, fraction: float) -> int | None:
    return None if limit is None else max(1, math.ceil(limit * fraction))


class SlidingWindowLimiter:
    """Exact sliding-window RPM/TPM limiter (minute + sub-window). ``rpm``/``tpm`` of ``None``: unlimited."""

    def __init__(
        self,
        clock: Clock,
        *,
        rpm: int | None,
        tpm: int | None,
        window_s: float = 60.0,
        sub_window_s: float | None = None,
        sub_window_tokens: bool = False,
        count_rejected: bool = True,
    ) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be positive, got {window_s}")
        sub = window_s / 60.0 if sub_window_s is None else sub_window_s
        if sub < 0 or sub >= window_s:
            raise ValueError(f"sub_window_s must be in [0, window_s), got {sub}")
        self._clock = clock
        self._window = window_s
        self._sub = sub
        self._sub_tokens = sub_window_tokens
        self.count_rejected = count_rejected
        self._minute = _Horizon(window_s, None, None, alone_fits=False)
        self._short: _Horizon | None = _Horizon(sub, None, None, alone_fits=True) if sub > 0 else None
        self._by_ticket: dict[int, _Entry] = {}
        self._tickets = itertools.count(1)
        self.rpm: int | None = None
        self.tpm: int | None = None
        self.set_limits(rpm=rpm, tpm=tpm)

    @property
    def sub_window_s(self) -> float:
        return self._sub

    def set_limits(self, *, rpm: int | None, tpm: int | None) -> None:
        """Change the limits; charges already in the windows stay."""
        check_limits(rpm, tpm)
        self.rpm, self.tpm = rpm, tpm
        self._minute.rpm, self._minute.tpm = rpm, tpm
        if self._short is not None:
            fraction = self._sub / self._window
            self._short.rpm = _scaled(rpm, fraction)
            self._short.tpm = _scaled(tpm, fraction) if self._sub_tokens else None

    def _horizons(self) -> tuple[_Horizon, ...]:
        return (self._minute,) if self._short is None else (self._minute, self._short)

    def try_admit(self, tokens: int, *, rejected_tokens: int = 0) -> Admitted | Rejected:
        """Admit a request charging ``tokens`` now, or say when it would fit."""
        check_charge(tokens)
        check_charge(rejected_tokens, "a rejected request's charge")
        now = self._clock.now()
        self._expire(now)
        if self.tpm is not None and tokens > self.tpm:
            return Rejected(LimitDimension.TOKENS, 0.0, self._snapshot(now), too_large=True)
        dimension, wait = self._wait(now, tokens)
        if wait > 0:
            if self.count_rejected:
                # unsuccessful requests count: the refusal itself is a charge, so recompute the wait with it
                self._add(_Entry(now, rejected_tokens, _REJECTED))
                dimension, wait = self._wait(now, tokens)
            return Rejected(dimension, wait, self._snapshot(now))
        entry = _Entry(now, tokens, next(self._tickets))
        self._add(entry)
        self._by_ticket[entry.ticket] = entry
        return Admitted(entry.ticket, self._snapshot(now))

    def settle(self, ticket: int, actual_tokens: int) -> None:
        """Correct an admitted charge to what the request really used (a no-op once it left the window)."""
        check_charge(actual_tokens)
        entry = self._by_ticket.pop(ticket, None)  # the server settles each ticket once
        if entry is None:
            return
        now = self._clock.now()
        self._expire(now)
        delta = actual_tokens - entry.tokens
        for horizon in self._horizons():
            if horizon.holds(entry, now):
                horizon.tokens += delta
        entry.tokens = actual_tokens

    def snapshot(self) -> LimitSnapshot:
        """The current state, for headers on any response."""
        now = self._clock.now()
        self._expire(now)
        return self._snapshot(now)

    def reset(self) -> None:
        """Forget every charge."""
        for horizon in self._horizons():
            horizon.clear()
        self._by_ticket.clear()

    @property
    def tokens_in_window(self) -> int:
        return self._minute.tokens

    @property
    def requests_in_window(self) -> int:
        return self._minute.requests

    # ------------------------------------------------------------------ internals

    def _add(self, entry: _Entry) -> None:
        for horizon in self._horizons():
            horizon.add(entry)

    def _expire(self, now: float) -> None:
        for horizon in self._horizons():
            horizon.expire(now)

    def _wait(self, now: float, tokens: int) -> tuple[LimitDimension, float]:
        wait_requests = max(h.wait_requests(now) for h in self._horizons())
        wait_tokens = max(h.wait_tokens(now, tokens) for h in self._horizons())
        if wait_requests >= wait_tokens:
            return LimitDimension.REQUESTS, wait_requests
        return LimitDimension.TOKENS, wait_tokens

    def _snapshot(self, now: float) -> LimitSnapshot:
        # The window's counts, as OpenAI reports them: the sub-window does not show in ``remaining`` (a burst
        # may be refused while it is positive, as OpenAI warns); a refusal's Retry-After covers it exactly.
        minute = self._minute
        newest = minute.entries[-1].at + self._window - now if minute.entries else 0.0
        return LimitSnapshot(
            limit_requests=self.rpm,
            limit_tokens=self.tpm,
            remaining_requests=minute.remaining_requests(),
            remaining_tokens=None if self.tpm is None else max(0, self.tpm - minute.tokens),
            reset_requests_s=max(0.0, newest),
            reset_tokens_s=minute.empty_of_tokens_in(now),
        )
