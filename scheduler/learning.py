"""Learning a provider key's real limit from what the provider says, when the configured one is wrong.

A workload's configured limit is a belief; the provider's answers are evidence. Per resource (requests,
tokens) the limit the buckets use is the smallest of:

- **configured**: the workload's ``ProviderLimits`` (an operator may want less than the provider allows);
- **stated**: the provider's ``x-ratelimit-limit-*`` header, its own word. Used as soon as one response
  carries it; never exceeded;
- **inferred** (requests only), when the provider states no limit, an upper bound of it from two kinds
  of evidence:
  - a response's ``x-ratelimit-remaining-requests`` = R: the provider counted at most our admissions in
    the last window, so its limit is at most ``admitted_in_window + R``;
  - a 429 (unless it said tokens ran out and requests did not): the provider was full, having accepted at
    most what we admitted in the last window less what it rejected there, so its limit is at most
    ``admitted_in_window - rejected_in_window``.
  Both are upper bounds as long as nobody else spends the key (another client makes us take less: our
  share). "The last window" is the provider's window plus the key's delay margin when its calls have been
  seen reaching it late (``scheduler.bucket.ProviderLimiter``). A 429 also counts against a stated
  limit: some servers admit fewer than they state (LiteLLM's router rejects the request that would reach
  its stated rpm).
  Token limits are never inferred: a provider counts tokens its own way (OpenAI charges prompt plus
  ``max_tokens`` on arrival), not the usage our ledger settles to, so our count bounds nothing. A token
  429 still pauses the key and slows its refill (``ProviderLimiter.on_rate_limited``).

An inferred limit only goes down; it is forgotten when the stated limit changes (the provider announced
a new one) and when the scheduler restarts. The first statement forgets nothing: a 429 answered before
any success stated the limit is evidence about that same limit (a gateway that refuses fast and answers
slowly reports its 429s first), and the limit is the smaller of the two. Time-independent and pure: the
caller passes the counts.
"""

from __future__ import annotations

import math
from enum import StrEnum

__all__ = ["LearnedLimit", "LimitSource", "capacity_below"]


class LimitSource(StrEnum):
    """Where the limit a bucket uses came from."""

    CONFIGURED = "configured"
    STATED = "stated"
    INFERRED = "inferred"


def capacity_below(limit: float, headroom: float) -> float:
    """What the local bucket and window ledger hold for ``limit``: the limit less the headroom, but never
    less than one unit of a limit that allows one (a provider allowing 1 request a minute gets 1)."""
    return max(limit * (1.0 - headroom), min(limit, 1.0))


class LearnedLimit:
    """One resource's limit per window for one provider key: configured, stated and inferred."""

    def __init__(self, configured: float) -> None:
        if configured <= 0:
            raise ValueError(f"a configured limit must be > 0, got {configured}")
        self.configured = float(configured)
        self.stated: float | None = None
        self.inferred: float | None = None

    @property
    def effective(self) -> float:
        """The limit the buckets are sized to: the smallest of what is known."""
        return min(v for v in (self.configured, self.stated, self.inferred) if v is not None)

    @property
    def source(self) -> LimitSource:
        effective = self.effective
        if self.inferred is not None and self.inferred == effective and self.inferred < self.configured:
            return LimitSource.INFERRED
        if self.stated is not None and self.stated == effective and self.stated < self.configured:
            return LimitSource.STATED
        return LimitSource.CONFIGURED

    def state(self, limit: float) -> bool:
        """The provider stated ``limit``; returns whether the effective limit changed."""
        if limit <= 0 or not math.isfinite(limit) or limit == self.stated:
            return False
        before = self.effective
        if self.stated is not None:
            self.inferred = None  # a new word from the provider supersedes what we guessed
        self.stated = float(limit)
        return self.effective != before

    def bound(self, upper: float) -> bool:
        """Evidence that the limit is at most ``upper``; returns whether the effective limit changed.
        Nonsense evidence (below one unit: our own traffic cannot explain it) is ignored."""
        if upper < 1.0 or not math.isfinite(upper):
            return False
        if self.inferred is not None and upper >= self.inferred:
            return False
        before = self.effective
        self.inferred = float(upper)
        return self.effective != before
