"""Per-dependency bulkhead: caps on concurrent calls and on queued calls (recovery chapter §12.7.3).

- A call either gets a lease at once, waits in a bounded FIFO queue, or is rejected at admission with
  ``BulkheadFull`` when both the concurrency cap and the queue are full (fail fast; the caller's trajectory
  records why).
- Queued requests do not hold a concurrency slot. Nothing queued is handed a lease after its deadline: the
  deadline is absolute epoch seconds (``Clock.wall()``, the ports' time convention), checked at promotion.
- The concurrency cap in force (``limit``) can be lowered below ``max_concurrent`` by the owner, e.g. while a
  breaker restores traffic after a close; leases already held are never revoked by lowering it.
- Every lease expires (``lease_s`` on the monotonic axis) and can be reclaimed early when a liveness
  predicate says its holder died, so a crashed caller cannot pin a slot forever (reliability guide §6.6).

Pure: no I/O, time from the injected clock. Waiting is the shell's job (``breakers.guard``).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from runtime.clock import Clock
from runtime.errors import BulkheadFull

from .errors import QueuedPastDeadline

__all__ = ["Bulkhead", "BulkheadPolicy", "Lease", "Promotions", "QueueTicket"]


class BulkheadPolicy(BaseModel):
    """Caps for one dependency scope. Defaults follow napkin math 12.4 (64 running, 32 waiting)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_concurrent: int = Field(64, ge=1, description="calls that may hold a slot at once")
    max_queued: int = Field(32, ge=0, description="calls that may wait for a slot; 0 = no queue")
    lease_s: float = Field(300.0, gt=0.0, description="a slot not released within this is reclaimed")


@dataclass(frozen=True, slots=True)
class Lease:
    """One occupied concurrency slot."""

    lease_id: str
    call_id: str
    holder: str
    deadline: float  # absolute epoch seconds of the call
    expires_at: float  # monotonic seconds: reclaimed after this


@dataclass(frozen=True, slots=True)
class QueueTicket:
    """A waiting request; it holds no slot."""

    ticket_id: str
    call_id: str
    holder: str
    deadline: float  # absolute epoch seconds: never promoted at or after it


@dataclass(frozen=True, slots=True)
class Promotions:
    """What freeing slots did to the queue: tickets granted a lease, tickets dropped past their deadline,
    and (for ``reclaim``) the leases taken back."""

    granted: tuple[tuple[QueueTicket, Lease], ...] = ()
    expired: tuple[QueueTicket, ...] = ()
    reclaimed: tuple[Lease, ...] = field(default=())


class Bulkhead:
    """Concurrency and queue caps for one dependency scope."""

    def __init__(self, scope: str, policy: BulkheadPolicy, clock: Clock) -> None:
        self.scope = scope
        self.policy = policy
        self._clock = clock
        self._leases: dict[str, Lease] = {}
        self._queue: OrderedDict[str, QueueTicket] = OrderedDict()
        self._ids = itertools.count(1)
        self._limit = policy.max_concurrent

    @property
    def limit(self) -> int:
        """The concurrency cap in force now (``max_concurrent`` unless lowered with ``set_limit``)."""
        return self._limit

    def set_limit(self, limit: int) -> None:
        """Set the cap in force, within ``[1, max_concurrent]``. Waiting tickets a raised cap lets in are
        promoted by the next ``promote``, ``release`` or ``reclaim``."""
        self._limit = min(max(1, limit), self.policy.max_concurrent)

    def promote(self) -> Promotions:
        """Grant waiting tickets the free slots under the cap in force (FIFO)."""
        return self._promote()

    @property
    def in_flight(self) -> int:
        return len(self._leases)

    @property
    def queued(self) -> int:
        return len(self._queue)

    def lease(self, lease_id: str) -> Lease | None:
        return self._leases.get(lease_id)

    def offer(self, call_id: str, deadline: float, holder: str = "") -> Lease | QueueTicket:
        """Admit one call: a lease now, a place in the queue, or ``BulkheadFull``.

        Raises ``QueuedPastDeadline`` when the call's deadline has already passed: it must not dispatch.
        """
        if deadline <= self._clock.wall():
            raise QueuedPastDeadline(self.scope, call_id, deadline)
        if len(self._leases) < self._limit and not self._queue:
            return self._grant(call_id, holder, deadline)
        if len(self._queue) < self.policy.max_queued:
            ticket = QueueTicket(f"{self.scope}#q{next(self._ids)}", call_id, holder, deadline)
            self._queue[ticket.ticket_id] = ticket
            return ticket
        raise BulkheadFull(self.scope, len(self._leases), len(self._queue))

    def release(self, lease_id: str) -> Promotions:
        """Free a slot (unknown or already reclaimed ids are a no-op) and promote waiting tickets."""
        self._leases.pop(lease_id, None)
        return self._promote()

    def discard(self, lease_id: str) -> None:
        """Free a slot without promoting anyone into it (the caller refuses the queue itself)."""
        self._leases.pop(lease_id, None)

    def queued_ticket_ids(self) -> list[str]:
        """Waiting tickets in FIFO order."""
        return list(self._queue)

    def withdraw(self, ticket_id: str) -> bool:
        """A waiter gave up (its deadline passed or it was cancelled). True if it was still queued."""
        return self._queue.pop(ticket_id, None) is not None

    def renew(self, lease_id: str) -> Lease | None:
        """Extend a live lease by ``lease_s`` from now (for a call legitimately running long)."""
        current = self._leases.get(lease_id)
        if current is None:
            return None
        renewed = Lease(
            current.lease_id,
            current.call_id,
            current.holder,
            current.deadline,
            self._clock.now() + self.policy.lease_s,
        )
        self._leases[lease_id] = renewed
        return renewed

    def reclaim(self, holder_alive: Callable[[str], bool] | None = None) -> Promotions:
        """Take back leases that expired or whose holder is dead, drop queued tickets past their
        deadline, then promote waiting tickets into the freed slots."""
        now = self._clock.now()
        dead = [
            lease
            for lease in self._leases.values()
            if lease.expires_at <= now or (holder_alive is not None and not holder_alive(lease.holder))
        ]
        for lease in dead:
            del self._leases[lease.lease_id]
        wall = self._clock.wall()
        stale = [t for t in self._queue.values() if t.deadline <= wall]
        for ticket in stale:
            del self._queue[ticket.ticket_id]
        promoted = self._promote()
        return Promotions(promoted.granted, (*stale, *promoted.expired), tuple(dead))

    # ------------------------------------------------------------------ internals

    def _grant(self, call_id: str, holder: str, deadline: float) -> Lease:
        lease = Lease(
            f"{self.scope}#l{next(self._ids)}",
            call_id,
            holder,
            deadline,
            self._clock.now() + self.policy.lease_s,
        )
        self._leases[lease.lease_id] = lease
        return lease

    def _promote(self) -> Promotions:
        granted: list[tuple[QueueTicket, Lease]] = []
        expired: list[QueueTicket] = []
        wall = self._clock.wall()
        while self._queue and len(self._leases) < self._limit:
            _, ticket = self._queue.popitem(last=False)
            if ticket.deadline <= wall:  # §12.7.3: no queued request is dispatched after its deadline
                expired.append(ticket)
                continue
            granted.append((ticket, self._grant(ticket.call_id, ticket.holder, ticket.deadline)))
        return Promotions(tuple(granted), tuple(expired))
