"""Chunk leases: admit turns in the caller's process from a chunk the scheduler reserved for it.

One call to the scheduler actor per admission can never beat a bare actor call, and every call costs
both processes CPU. So a process that has several turns to admit at once (``want >= 2``) asks for a
*chunk*: ``n`` requests and ``n * estimate`` tokens of one provider key and priority class, to be used
within ``use_s``. Its turns are then admitted and settled locally (``LocalLease``), and what the chunk
did not use goes back to the scheduler in one call when it is done.

What the scheduler still guarantees (``SchedulerCore.lease_turns``, ``ProviderLimiter.can_lease``):

- **Limits.** A chunk is taken from the buckets and the sliding-window ledgers like ``n`` admissions at
  once, dated ``use_by`` in the windows (its requests may reach the provider until then), so tokens/min,
  requests/min and every sub-window stay within the limit across all chunks and single admissions.
- **Fairness.** A chunk is granted only while the key is uncontended: nobody waits in DRR, the key is not
  paused or slowed by a 429, and it takes at most ``1 - slack`` of what is left in every bucket and
  window (halved until it does). Under contention
  the request falls back to a single admission in DRR order, and a chunk already out lasts at most
  ``use_s``: a batch process cannot hold back an interactive turn for longer.
- **Settlement.** A local grant settles into its chunk (refund or debit); the chunk is returned with the
  tokens and requests it really used, which replaces its reservation exactly as settling a grant does.
- **Holders that die.** A chunk never returned expires like a grant: its tokens stay spent. After a
  scheduler restart the new incarnation does not know the chunk and returning it is a no-op.

Pure: every method takes ``now`` (epoch seconds, as chunks cross processes); nothing here reads a clock.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from runtime.ports import TurnGrant, TurnRequest
from scheduler.errors import SchedulerInputError

__all__ = ["LocalLease", "TurnLease", "chunk_tokens"]


@dataclass(frozen=True, slots=True)
class TurnLease:
    """A chunk as it crosses from the scheduler to its holder (times in epoch seconds)."""

    lease_id: str
    provider_key: str
    priority_class: str
    tokens: int
    requests: int
    use_by: float  # no turn is admitted from the chunk at or after this
    expires_at: float  # an unreturned chunk is forgotten then (its tokens stay spent)


def chunk_tokens(estimated_tokens: int, requests: int) -> int:
    """Tokens a chunk of ``requests`` turns like this one reserves."""
    return estimated_tokens * requests


@dataclass(slots=True)
class LocalLease:
    """The holder's side of one chunk: admit from it, settle into it, and say what it used."""

    lease: TurnLease
    _tokens_left: int = field(init=False)
    _requests_left: int = field(init=False)
    _open: dict[str, int] = field(default_factory=dict, init=False)  # grant id -> reserved tokens
    _used_tokens: int = field(default=0, init=False)
    _numbers: itertools.count[int] = field(default_factory=lambda: itertools.count(1), init=False)

    def __post_init__(self) -> None:
        self._tokens_left = self.lease.tokens
        self._requests_left = self.lease.requests

    @property
    def lease_id(self) -> str:
        return self.lease.lease_id

    def owns(self, grant_id: str) -> bool:
        return grant_id in self._open

    def admit(self, request: TurnRequest, now: float) -> TurnGrant | None:
        """A grant from the chunk, or None when the chunk cannot take this turn (then it goes to the
        scheduler, which also gives any refusal its usual predicate: deadline, capacity, bad input)."""
        lease = self.lease
        if (
            now >= lease.use_by
            or request.provider_key != lease.provider_key
            or request.priority_class != lease.priority_class
            or self._requests_left < 1
            or not 0 <= request.estimated_tokens <= self._tokens_left
            or request.deadline <= now
        ):
            return None
        grant_id = f"{lease.lease_id}#{next(self._numbers)}"
        self._requests_left -= 1
        self._tokens_left -= request.estimated_tokens
        self._open[grant_id] = request.estimated_tokens
        return TurnGrant(grant_id, request.estimated_tokens, lease.expires_at)

    def settle(self, grant_id: str, actual_tokens: int) -> bool:
        """Replace a local grant's reservation by its actual usage. False: not a grant of this chunk."""
        if actual_tokens < 0:
            raise SchedulerInputError(f"must be >= 0, got {actual_tokens}", where="settle_turn.actual_tokens")
        reserved = self._open.pop(grant_id, None)
        if reserved is None:
            return False
        self._tokens_left += reserved - actual_tokens  # a refund is usable again within the chunk
        self._used_tokens += actual_tokens
        return True

    def exhausted(self, now: float) -> bool:
        """No more turns will be admitted from it."""
        return now >= self.lease.use_by or self._requests_left < 1

    def done(self, now: float) -> bool:
        """Ready to go back: exhausted and every grant settled (or the chunk expired anyway)."""
        return (self.exhausted(now) and not self._open) or now >= self.lease.expires_at

    def used(self) -> tuple[int, int]:
        """(tokens, requests) the chunk used; a grant still unsettled counts at its reservation."""
        requests = self.lease.requests - self._requests_left
        return self._used_tokens + sum(self._open.values()), requests
