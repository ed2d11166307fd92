"""Requests-per-minute and tokens-per-minute limits over a sliding window (pure; clock injected).

The window is exact, not bucketed: a request is admitted when, counting every admission whose
timestamp lies in ``(now - window_s, now]``, one more request fits under ``rpm`` and its token charge
fits under ``tpm``.

Token charge (the choice, stated once): at admission a request is charged
``prompt_tokens + max_tokens`` (the worst case it can produce). When it completes, or is aborted by
its client, the charge is corrected to ``prompt_tokens + completion_tokens`` actually produced; the
entry keeps its admission timestamp. Cached prompt tokens count toward TPM like any other (providers
meter them against the limit too). A correction never raises a charge, because output is cut at
``max_tokens``; so ``Retry-After`` computed at rejection is an upper bound assuming no new admissions.

A request whose charge alone exceeds ``tpm`` can never be admitted; it is reported as ``too_large``
so the server can answer 400 instead of a 429 that would be retried forever.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass
from enum import StrEnum

from runtime.clock import Clock

__all__ = ["Admitted", "LimitDimension", "LimitSnapshot", "Rejected", "SlidingWindowLimiter"]


class LimitDimension(StrEnum):
    """Which limit refused a request."""

    REQUESTS = "requests"
    TOKENS = "tokens"


@dataclass(frozen=True, slots=True)
class LimitSnapshot:
    """The limit state as the ``x-ratelimit-*`` headers report it. ``None`` means unlimited."""

    limit_requests: int | None
    limit_tokens: int | None
    remaining_requests: int | None
    remaining_tokens: int | None
    reset_requests_s: float
    reset_tokens_s: float

    def headers(self) -> dict[str, str]:
        """OpenAI-style headers; reset times are seconds with an ``s`` suffix (e.g. ``"1.250s"``)."""
        out: dict[str, str] = {}
        if self.limit_requests is not None and self.remaining_requests is not None:
            out["x-ratelimit-limit-requests"] = str(self.limit_requests)
            out["x-ratelimit-remaining-requests"] = str(self.remaining_requests)
            out["x-ratelimit-reset-requests"] = f"{self.reset_requests_s:.3f}s"
        if self.limit_tokens is not None and self.remaining_tokens is not None:
            out["x-ratelimit-limit-tokens"] = str(self.limit_tokens)
            out["x-ratelimit-remaining-tokens"] = str(self.remaining_tokens)
            out["x-ratelimit-reset-tokens"] = f"{self.reset_tokens_s:.3f}s"
        return out


@dataclass(frozen=True, slots=True)
class Admitted:
    """The request fits; ``ticket`` identifies its charge for :meth:`SlidingWindowLimiter.settle`."""

    ticket: int
    snapshot: LimitSnapshot


@dataclass(frozen=True, slots=True)
class Rejected:
    """The request does not fit now. ``retry_after_s`` is when it would fit if nothing else arrives."""

    dimension: LimitDimension
    retry_after_s: float
    snapshot: LimitSnapshot
    too_large: bool = False


@dataclass(slots=True)
class _Entry:
    at: float
    tokens: int
    ticket: int


class SlidingWindowLimiter:
    """Exact sliding-window RPM/TPM limiter. ``rpm``/``tpm`` of ``None`` mean unlimited."""

    def __init__(self, clock: Clock, *, rpm: int | None, tpm: int | None, window_s: float = 60.0) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be positive, got {window_s}")
        self._clock = clock
        self._window = window_s
        self._entries: deque[_Entry] = deque()
        self._by_ticket: dict[int, _Entry] = {}
        self._tokens_in_window = 0
        self._tickets = itertools.count(1)
        self.rpm: int | None = None
        self.tpm: int | None = None
        self.set_limits(rpm=rpm, tpm=tpm)

    def set_limits(self, *, rpm: int | None, tpm: int | None) -> None:
        """Change the limits; charges already in the window stay."""
        for name, value in (("rpm", rpm), ("tpm", tpm)):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 or None (unlimited), got {value}")
        self.rpm, self.tpm = rpm, tpm

    def try_admit(self, tokens: int) -> Admitted | Rejected:
        """Admit a request charging ``tokens`` now, or say when it would fit."""
        if tokens < 0:
            raise ValueError(f"a token charge cannot be negative, got {tokens}")
        now = self._clock.now()
        self._expire(now)
        if self.tpm is not None and tokens > self.tpm:
            return Rejected(LimitDimension.TOKENS, 0.0, self._snapshot(now), too_large=True)
        wait_requests = self._wait_for_requests(now)
        wait_tokens = self._wait_for_tokens(now, tokens)
        if wait_requests > 0 or wait_tokens > 0:
            dimension = LimitDimension.REQUESTS if wait_requests >= wait_tokens else LimitDimension.TOKENS
            return Rejected(dimension, max(wait_requests, wait_tokens), self._snapshot(now))
        entry = _Entry(at=now, tokens=tokens, ticket=next(self._tickets))
        self._entries.append(entry)
        self._by_ticket[entry.ticket] = entry
        self._tokens_in_window += tokens
        return Admitted(entry.ticket, self._snapshot(now))

    def settle(self, ticket: int, actual_tokens: int) -> None:
        """Correct an admitted charge to what the request really used (a no-op once it left the window)."""
        if actual_tokens < 0:
            raise ValueError(f"a token charge cannot be negative, got {actual_tokens}")
        entry = self._by_ticket.get(ticket)
        if entry is None:
            return
        self._tokens_in_window += actual_tokens - entry.tokens
        entry.tokens = actual_tokens

    def snapshot(self) -> LimitSnapshot:
        """The current state, for headers on any response."""
        now = self._clock.now()
        self._expire(now)
        return self._snapshot(now)

    def reset(self) -> None:
        """Forget every charge."""
        self._entries.clear()
        self._by_ticket.clear()
        self._tokens_in_window = 0

    @property
    def tokens_in_window(self) -> int:
        return self._tokens_in_window

    # ------------------------------------------------------------------ internals

    def _expire(self, now: float) -> None:
        # The epsilon keeps "retry after exactly retry_after_s" true despite float rounding.
        horizon = now - self._window + 1e-9
        while self._entries and self._entries[0].at <= horizon:
            old = self._entries.popleft()
            del self._by_ticket[old.ticket]
            self._tokens_in_window -= old.tokens

    def _wait_for_requests(self, now: float) -> float:
        if self.rpm is None or len(self._entries) < self.rpm:
            return 0.0
        # The oldest (len - rpm + 1) entries must leave before one more request fits.
        blocking = self._entries[len(self._entries) - self.rpm]
        return blocking.at + self._window - now

    def _wait_for_tokens(self, now: float, tokens: int) -> float:
        if self.tpm is None or self._tokens_in_window + tokens <= self.tpm:
            return 0.0
        excess = self._tokens_in_window + tokens - self.tpm
        freed = 0
        for entry in self._entries:
            freed += entry.tokens
            if freed >= excess:
                return entry.at + self._window - now
        return self._window  # unreachable while tokens <= tpm; kept total for safety

    def _snapshot(self, now: float) -> LimitSnapshot:
        newest_expiry = (self._entries[-1].at + self._window - now) if self._entries else 0.0
        return LimitSnapshot(
            limit_requests=self.rpm,
            limit_tokens=self.tpm,
            remaining_requests=None if self.rpm is None else max(0, self.rpm - len(self._entries)),
            remaining_tokens=None if self.tpm is None else max(0, self.tpm - self._tokens_in_window),
            reset_requests_s=max(0.0, newest_expiry),
            reset_tokens_s=max(0.0, newest_expiry),
        )
