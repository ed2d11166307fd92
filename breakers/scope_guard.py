"""Breaker + bulkhead of one dependency scope, composed as a pure decision object.

Order of checks at admission (recovery chapter §12.7.2-3): the breaker is consulted first, so an OPEN scope
withholds a call without taking a queue place; then the bulkhead grants a slot, queues, or fails fast; the
breaker permit (and with it the single half-open probe) is claimed only when a slot is actually granted.
A queued call is re-checked against the breaker when it leaves the queue, because waiting confers no
bypass of the gate, and a trip or reopen rejects everything still queued at once.

After a successful probe the bulkhead's cap in force follows the breaker's ``admission_share`` (§12.7.1:
regular traffic is restored gradually under the concurrency constraint), so the calls that waited out the
outage do not all land on the dependency at once; those above the ramped cap wait in the queue as usual.
The cap is brought up to date at every admission, settlement and reclaim tick.

Returned ``Resolution`` values tell the async shell which waiter gets which answer; this module never waits.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict

from runtime.clock import Clock
from runtime.errors import BreakerOpen, PolicyRefusal
from runtime.metrics import Metrics
from runtime.ports import GuardPermit, OutcomeClass

from .breaker import Breaker, BreakerPolicy, BreakerState, BreakerTicket, RecordEffect
from .bulkhead import Bulkhead, BulkheadPolicy, Lease, Promotions, QueueTicket
from .errors import QueuedPastDeadline

__all__ = ["GuardPolicy", "GuardSnapshot", "Resolution", "ScopeGuard", "Waiting"]

# Permit ids kept after settlement so a duplicate or late record of the same permit is not counted twice.
_SETTLED_MEMORY = 10_000


class GuardPolicy(BaseModel):
    """Breaker and bulkhead policy of one dependency scope."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    breaker: BreakerPolicy = BreakerPolicy()
    bulkhead: BulkheadPolicy = BulkheadPolicy()


@dataclass(frozen=True, slots=True)
class Waiting:
    """The call is queued behind the concurrency cap; its answer comes later as a ``Resolution``."""

    ticket: QueueTicket


@dataclass(frozen=True, slots=True)
class Resolution:
    """The answer for a queued call: a permit, or the refusal that ended its wait."""

    ticket_id: str
    permit: GuardPermit | None = None
    refusal: PolicyRefusal | None = None


@dataclass(frozen=True, slots=True)
class GuardSnapshot:
    """Observable state of one scope (metrics, tests, operator views)."""

    scope: str
    state: BreakerState
    generation: int
    cooldown_s: float
    window_size: int
    window_failures: int
    in_flight: int
    queued: int
    probes_claimed: int
    concurrency_limit: int = 0  # the bulkhead's cap in force (below its maximum while restoring)


@dataclass(slots=True)
class _Held:
    lease: Lease
    ticket: BreakerTicket
    recorded: bool = False


class ScopeGuard:
    """Admission, outcome recording and slot release for one dependency scope."""

    def __init__(self, scope: str, policy: GuardPolicy, clock: Clock, metrics: Metrics | None = None) -> None:
        self.scope = scope
        self.policy = policy
        self.breaker = Breaker(scope, policy.breaker, clock, metrics)
        self.bulkhead = Bulkhead(scope, policy.bulkhead, clock)
        self._held: dict[str, _Held] = {}
        self._settled: OrderedDict[str, None] = OrderedDict()

    # ------------------------------------------------------------------ admission

    def admit(self, call_id: str, deadline: float, holder: str = "") -> GuardPermit | Waiting:
        """A permit now, ``Waiting`` in the queue, or a refusal (``BreakerOpen``, ``BulkheadFull``,
        ``QueuedPastDeadline``) raised before anything is dispatched."""
        self._check_breaker()
        self._ramp_limit()  # waiters a grown cap lets in are promoted at the next settlement or reclaim tick
        placed = self.bulkhead.offer(call_id, deadline, holder)
        if isinstance(placed, QueueTicket):
            return Waiting(placed)
        return self._permit(placed)

    def withdraw(self, ticket_id: str) -> bool:
        """A waiter stopped waiting. False means it was already resolved."""
        return self.bulkhead.withdraw(ticket_id)

    # ------------------------------------------------------------------ settlement

    def record(self, permit: GuardPermit, outcome: OutcomeClass) -> tuple[RecordEffect, list[Resolution]]:
        """Feed a dispatched call's classified outcome to the breaker (once per permit)."""
        if permit.permit_id in self._settled:
            return RecordEffect.IGNORED, []
        held = self._held.get(permit.permit_id)
        if held is not None:
            if held.recorded:
                return RecordEffect.IGNORED, []
            held.recorded = True
            ticket = held.ticket
        else:  # released or reclaimed before its outcome came back: judge by what the permit carries
            ticket = BreakerTicket(permit.breaker_generation, permit.probe)
            self._remember_settled(permit.permit_id)
        effect = self.breaker.record(ticket, outcome)
        return effect, self._after_breaker_change(effect) + self._resolve(self._ramp())

    def release(self, permit: GuardPermit) -> list[Resolution]:
        """Free the permit's slot; a probe released without an outcome counts as a failed probe."""
        held = self._held.pop(permit.permit_id, None)
        if held is None:
            return []
        resolutions: list[Resolution] = []
        if held.recorded:
            self._remember_settled(permit.permit_id)
        else:
            resolutions += self._after_breaker_change(self.breaker.abandon_probe(held.ticket))
        self.bulkhead.discard(held.lease.lease_id)
        return resolutions + self._resolve(self._ramp())

    def reclaim(
        self, holder_alive: Callable[[str], bool] | None = None
    ) -> tuple[list[Lease], list[Resolution]]:
        """Take back expired leases and leases whose holder ``holder_alive`` reports dead; an unrecorded
        probe among them counts as a failed probe."""
        self._ramp_limit()  # reclaim promotes under it
        promotions = self.bulkhead.reclaim(holder_alive)
        resolutions: list[Resolution] = []
        for lease in promotions.reclaimed:
            held = self._held.pop(lease.lease_id, None)
            if held is not None and not held.recorded:
                resolutions += self._after_breaker_change(self.breaker.abandon_probe(held.ticket))
        return list(promotions.reclaimed), resolutions + self._resolve(promotions)

    def snapshot(self) -> GuardSnapshot:
        size, failures = self.breaker.window_counts()
        return GuardSnapshot(
            self.scope,
            self.breaker.state,
            self.breaker.generation,
            self.breaker.cooldown_s,
            size,
            failures,
            self.bulkhead.in_flight,
            self.bulkhead.queued,
            self.breaker.probes_claimed,
            self._ramp_limit(),
        )

    # ------------------------------------------------------------------ internals

    def _ramp_limit(self) -> int:
        """Bring the bulkhead's cap in force to the breaker's admission share (at least one call)."""
        share = self.breaker.admission_share()
        limit = self.bulkhead.policy.max_concurrent
        if share < 1.0:
            limit = max(1, math.ceil(limit * share))
        if limit != self.bulkhead.limit:
            self.bulkhead.set_limit(limit)
        return self.bulkhead.limit

    def _ramp(self) -> Promotions:
        """``_ramp_limit``, then promote whoever the cap in force now lets out of the queue."""
        self._ramp_limit()
        return self.bulkhead.promote()

    def _check_breaker(self) -> None:
        """Raise ``BreakerOpen`` if the breaker would withhold a call now, without claiming anything."""
        refusal = self.breaker.withholding()
        if refusal is not None:
            raise refusal

    def _permit(self, lease: Lease) -> GuardPermit:
        try:
            ticket = self.breaker.admit()
        except BreakerOpen:
            self.bulkhead.discard(lease.lease_id)  # free the slot without promoting anyone into it
            raise
        self._held[lease.lease_id] = _Held(lease, ticket)
        return GuardPermit(lease.lease_id, self.scope, ticket.generation, ticket.probe)

    def _after_breaker_change(self, effect: RecordEffect) -> list[Resolution]:
        if effect not in (RecordEffect.TRIPPED, RecordEffect.REOPENED):
            return []
        # The scope just opened: nothing still queued may pass, tell every waiter now (fail fast).
        refusal = BreakerOpen(self.scope, self.breaker.remaining_cooldown(), self.breaker.generation)
        return self._refuse_queue(refusal)

    def _refuse_queue(self, refusal: PolicyRefusal) -> list[Resolution]:
        out = []
        for ticket_id in self.bulkhead.queued_ticket_ids():
            self.bulkhead.withdraw(ticket_id)
            out.append(Resolution(ticket_id, refusal=refusal))
        return out

    def _resolve(self, promotions: Promotions) -> list[Resolution]:
        out = [
            Resolution(t.ticket_id, refusal=QueuedPastDeadline(self.scope, t.call_id, t.deadline))
            for t in promotions.expired
        ]
        refused: BreakerOpen | None = None
        for ticket, lease in promotions.granted:
            if refused is not None:
                self.bulkhead.discard(lease.lease_id)
                out.append(Resolution(ticket.ticket_id, refusal=refused))
                continue
            try:
                out.append(Resolution(ticket.ticket_id, permit=self._permit(lease)))
            except BreakerOpen as refusal:  # re-checked at dispatch: waiting is no bypass of the gate
                refused = refusal
                out.append(Resolution(ticket.ticket_id, refusal=refusal))
        if refused is not None:  # the gate withholds now: the rest of the queue would only wait to be refused
            out += self._refuse_queue(refused)
        return out

    def _remember_settled(self, permit_id: str) -> None:
        self._settled[permit_id] = None
        while len(self._settled) > _SETTLED_MEMORY:
            self._settled.popitem(last=False)
