"""Anthropic-like limiter: a continuously refilling token bucket per dimension (pure; clock injected).

Each limit is a bucket holding at most one window's worth (``rpm`` requests, ``tpm`` tokens) and refilled
continuously at ``limit / window_s`` per second, so capacity comes back gradually instead of resetting at
fixed intervals (Anthropic documents its rate limits this way). A fresh key starts full: the first minute
may see a burst of a whole minute's limit, then the refill rate holds.

A request is admitted when the request bucket holds at least 1 and the token bucket at least its charge.
A rejected request is still charged (one request, its prompt tokens) when ``count_rejected`` is on, which
may drive a bucket below zero: the debt is refilled before anything else fits. The common rules (charge,
correction, truthful headers) are in :mod:`.limits`.
"""

from __future__ import annotations

import itertools
import math

from runtime.clock import Clock
from testbed.provider.limits import (
    Admitted,
    LimitDimension,
    LimitSnapshot,
    Rejected,
    check_charge,
    check_limits,
)

__all__ = ["TokenBucketLimiter"]

# Float slack: a bucket refilled for exactly ``retry_after_s`` covers the charge despite rounding.
_EPS = 1e-6


class _Bucket:
    def __init__(self, window_s: float, now: float) -> None:
        self.window_s = window_s
        self.capacity = 0.0
        self.level = 0.0
        self.at = now

    def configure(self, limit: int | None, now: float) -> None:
        self.refill(now)
        if limit is None:
            self.capacity = self.level = 0.0
            return
        if self.capacity == 0.0:
            self.level = float(limit)  # newly limited: starts full
        self.capacity = float(limit)
        self.level = min(self.level, self.capacity)

    @property
    def limited(self) -> bool:
        return self.capacity > 0

    @property
    def rate(self) -> float:
        return self.capacity / self.window_s

    def refill(self, now: float) -> None:
        if now > self.at:
            self.level = min(self.capacity, self.level + (now - self.at) * self.rate)
            self.at = now

    def wait_for(self, amount: float) -> float:
        """Seconds until ``amount`` is covered (0: now)."""
        if not self.limited or self.level + _EPS >= amount:
            return 0.0
        return (amount - self.level) / self.rate

    def until_full(self) -> float:
        return 0.0 if not self.limited else max(0.0, (self.capacity - self.level) / self.rate)


class TokenBucketLimiter:
    """RPM/TPM as continuously refilling buckets. ``rpm``/``tpm`` of ``None`` mean unlimited."""

    def __init__(
        self,
        clock: Clock,
        *,
        rpm: int | None,
        tpm: int | None,
        window_s: float = 60.0,
        count_rejected: bool = True,
    ) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be positive, got {window_s}")
        self._clock = clock
        self._window = window_s
        self.count_rejected = count_rejected
        now = clock.now()
        self._requests = _Bucket(window_s, now)
        self._tokens = _Bucket(window_s, now)
        self._charged: dict[int, int] = {}
        self._tickets = itertools.count(1)
        self.rpm: int | None = None
        self.tpm: int | None = None
        self.set_limits(rpm=rpm, tpm=tpm)

    def set_limits(self, *, rpm: int | None, tpm: int | None) -> None:
        """Change the limits; the current levels stay (clipped to the new capacities)."""
        check_limits(rpm, tpm)
        now = self._clock.now()
        self.rpm, self.tpm = rpm, tpm
        self._requests.configure(rpm, now)
        self._tokens.configure(tpm, now)

    def try_admit(self, tokens: int, *, rejected_tokens: int = 0) -> Admitted | Rejected:
        """Admit a request charging ``tokens`` now, or say when it would fit."""
        check_charge(tokens)
        check_charge(rejected_tokens, "a rejected request's charge")
        self._refill()
        if self.tpm is not None and tokens > self.tpm:
            return Rejected(LimitDimension.TOKENS, 0.0, self._snapshot(), too_large=True)
        dimension, wait = self._wait(tokens)
        if wait > 0:
            if self.count_rejected:
                self._take(1, rejected_tokens)
                dimension, wait = self._wait(tokens)
            return Rejected(dimension, wait, self._snapshot())
        self._take(1, tokens)
        ticket = next(self._tickets)
        self._charged[ticket] = tokens
        return Admitted(ticket, self._snapshot())

    def settle(self, ticket: int, actual_tokens: int) -> None:
        """Correct an admitted charge to what the request used: the difference flows back into the bucket."""
        check_charge(actual_tokens)
        charged = self._charged.pop(ticket, None)
        if charged is None or not self._tokens.limited:
            return
        self._refill()
        bucket = self._tokens
        bucket.level = min(bucket.capacity, bucket.level + charged - actual_tokens)

    def snapshot(self) -> LimitSnapshot:
        self._refill()
        return self._snapshot()

    def reset(self) -> None:
        """Refill both buckets and forget open charges."""
        self._refill()
        self._requests.level = self._requests.capacity
        self._tokens.level = self._tokens.capacity
        self._charged.clear()

    @property
    def levels(self) -> tuple[float, float]:
        """(requests, tokens) currently in the buckets (for tests)."""
        self._refill()
        return self._requests.level, self._tokens.level

    # ------------------------------------------------------------------ internals

    def _refill(self) -> None:
        now = self._clock.now()
        self._requests.refill(now)
        self._tokens.refill(now)

    def _take(self, requests: int, tokens: int) -> None:
        if self._requests.limited:
            self._requests.level -= requests
        if self._tokens.limited:
            self._tokens.level -= tokens

    def _wait(self, tokens: int) -> tuple[LimitDimension, float]:
        wait_requests = self._requests.wait_for(1)
        wait_tokens = self._tokens.wait_for(tokens)
        if wait_requests >= wait_tokens:
            return LimitDimension.REQUESTS, wait_requests
        return LimitDimension.TOKENS, wait_tokens

    def _snapshot(self) -> LimitSnapshot:
        return LimitSnapshot(
            limit_requests=self.rpm,
            limit_tokens=self.tpm,
            remaining_requests=None if self.rpm is None else max(0, math.floor(self._requests.level + _EPS)),
            remaining_tokens=None if self.tpm is None else max(0, math.floor(self._tokens.level + _EPS)),
            reset_requests_s=self._requests.until_full(),
            reset_tokens_s=self._tokens.until_full(),
        )
