"""SchedulerCore: admission across trajectories as a pure state machine.

Requests go in (``submit_turn``, ``submit_sandbox``); ``tick()`` returns the decisions that are due
now (admitted, permit granted, refused) and ``next_wakeup()`` says when calling ``tick()`` again could
produce more. Settlement, release and provider feedback are immediate calls. The core reads only the
injected ``Clock``; the async wrappers (``InProcessScheduler``, the actor) do the waiting.

Per provider key there is one lane: a ``ProviderLimiter`` (the buckets) in front of a
``DeficitRoundRobin`` (who is next). DRR picks the next turn; the turn goes when both buckets cover
it. Per sandbox pool there is one ``SandboxPool``.

Time: deadlines and lease expiries cross processes as epoch seconds (``runtime.ports``); inside the core
they are converted once to the monotonic axis, on which buckets refill and leases expire.
"""

from __future__ import annotations

import heapq
import itertools
import math
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from runtime.clock import Clock
from runtime.errors import AdmissionRefused
from runtime.ports import RateLimitInfo, SandboxPermit, TurnGrant, TurnRequest
from scheduler.bucket import ProviderLimiter
from scheduler.config import SchedulerConfig
from scheduler.drr import DeficitRoundRobin
from scheduler.errors import Predicate, SchedulerInputError
from scheduler.hooks import NoopMetrics, SchedulerMetrics
from scheduler.lease import TurnLease, chunk_tokens
from scheduler.sandbox import SandboxPool

__all__ = [
    "Admitted",
    "Decision",
    "LaneView",
    "PermitGranted",
    "PoolView",
    "Refused",
    "RequestKind",
    "SchedulerCore",
    "SchedulerSnapshot",
    "SettleResult",
]

# How many settled grants keep their admission time for the limit report that follows their settlement.
_SETTLED_KEPT = 4096


class RequestKind(StrEnum):
    TURN = "turn"
    SANDBOX = "sandbox"


class SettleResult(StrEnum):
    SETTLED = "settled"
    UNKNOWN = "unknown"  # never granted, already settled, or reclaimed: nothing to do


@dataclass(frozen=True, slots=True)
class Admitted:
    ticket: int
    grant: TurnGrant
    waited_s: float


@dataclass(frozen=True, slots=True)
class PermitGranted:
    ticket: int
    permit: SandboxPermit
    waited_s: float


@dataclass(frozen=True, slots=True)
class Refused:
    ticket: int
    kind: RequestKind
    predicate: str
    message: str

    def error(self) -> AdmissionRefused:
        return AdmissionRefused(self.predicate, self.message)


Decision = Admitted | PermitGranted | Refused


@dataclass(frozen=True, slots=True)
class LaneView:
    """One provider key as the scheduler sees it right now.

    ``limit_requests``/``limit_tokens`` are the limits per window the buckets are sized to, and
    ``limit_sources`` where each came from (``configured``, ``stated`` by the provider, ``inferred``);
    ``granted`` counts admissions, ``rate_limited`` the 429s reported, ``retry_hints_honoured`` the retry
    hints that paused the key, by the header that carried them. ``delay_margin_s``: how much longer than
    the provider's window the key's ledgers count, for calls that reached the provider late.
    """

    tokens: float
    token_capacity: float
    requests: float
    request_capacity: float
    rate_factor: float
    blocked_for_s: float
    rate_limited: int
    queued: Mapping[str, int]
    deficits: Mapping[str, float]
    limit_requests: float = 0.0
    limit_tokens: float = 0.0
    limit_sources: Mapping[str, str] = field(default_factory=dict)
    granted: int = 0
    retry_hints_honoured: Mapping[str, int] = field(default_factory=dict)
    delay_margin_s: float = 0.0


@dataclass(frozen=True, slots=True)
class PoolView:
    size: int
    reserved: int
    in_use: int
    in_use_unreserved: int
    waiting: int


@dataclass(frozen=True, slots=True)
class SchedulerSnapshot:
    lanes: Mapping[str, LaneView]
    pools: Mapping[str, PoolView]
    pending: int
    grants: int
    permits: int
    chunks: int = 0  # chunk leases out (scheduler.lease)


@dataclass(slots=True)
class _Pending:
    ticket: int
    kind: RequestKind
    trajectory_id: str
    priority_class: str
    submitted_at: float
    deadline_at: float  # monotonic
    target: str  # provider key (turn) or pool name (sandbox)
    cost: int = 0


@dataclass(slots=True)
class _Lease:
    lease_id: str
    kind: RequestKind
    trajectory_id: str
    priority_class: str
    target: str
    expires_at: float  # monotonic
    reserved: int = 0
    ledger_id: int | None = None  # the reservation's entry in the provider key's window ledger
    admitted_at: float = 0.0  # monotonic


@dataclass(slots=True)
class _Chunk:
    lease: TurnLease
    expires_at: float  # monotonic
    ledger_ids: tuple[int, int, int]  # its entries in the key's window ledgers (ProviderLimiter.lease)


@dataclass(slots=True)
class _Lane:
    limiter: ProviderLimiter
    drr: DeficitRoundRobin[int]
    reported_margin: float = 0.0  # the delay margin last given to the metrics
    top_asked_at: float = -math.inf  # when the top class last asked for a turn here (its reserve's clock)


class SchedulerCore:
    """Token buckets + weighted DRR + sandbox semaphores + leases, driven by ``tick()``."""

    def __init__(
        self,
        config: SchedulerConfig,
        clock: Clock,
        metrics: SchedulerMetrics | None = None,
        id_prefix: str | None = None,
    ) -> None:
        self.config = config
        self.clock = clock
        self.metrics: SchedulerMetrics = metrics or NoopMetrics()
        # A fresh prefix per incarnation: ids from before a restart never collide with new ones.
        self._id_prefix = id_prefix or uuid.uuid4().hex[:8]
        self._tickets = itertools.count(1)
        self._lease_ids = itertools.count(1)
        self._lanes: dict[str, _Lane] = {}
        self._pools: dict[str, SandboxPool[int]] = {
            name: SandboxPool(name, pool, config.reserved_class, self._class_order())
            for name, pool in config.pools.items()
        }
        self._pending: dict[int, _Pending] = {}
        self._deadlines: list[tuple[float, int]] = []  # heap; stale entries skipped
        self._leases: dict[str, _Lease] = {}
        self._chunks: dict[str, _Chunk] = {}  # chunk leases (scheduler.lease), expiring with the leases
        # grants settled lately: (provider key, admitted at), for the report that follows the settlement
        self._settled: OrderedDict[str, tuple[str, float, int]] = OrderedDict()
        self._expiries: list[tuple[float, str]] = []  # heap; stale entries skipped
        # Decided outside tick (refused at submission); handed out by the next tick.
        self._ready: list[Decision] = []
        self._top = self._class_order()[0]  # the highest weight: its reserve and early turns (_admit_lane)
        for provider_key in config.providers:
            self._lane(provider_key)  # configured keys start refilling (from empty) when the scheduler starts

    def _reserve(self, lane: _Lane, priority_class: str, now: float) -> float:
        """The fraction a turn of ``priority_class`` must leave free on ``lane`` (``top_class_reserve``):
        while the top class has a turn waiting that its credit of the round would let go early, or nothing
        waiting but asked within the key's window (room for the next arrival). A waiting top-class turn the
        round's credit cannot pay for goes at the class's visit instead, so room kept for it would stand
        unused: none is kept."""
        if not self.config.top_class_reserve or priority_class == self._top:
            return 0.0
        if lane.drr.waiting(self._top):
            return self.config.top_class_reserve if lane.drr.early(self._top) is not None else 0.0
        if now - lane.top_asked_at >= lane.limiter.limits.window_s:
            return 0.0
        return self.config.top_class_reserve

    def _class_order(self) -> list[str]:
        return sorted(self.config.class_weights, key=lambda c: -self.config.class_weights[c])

    # ------------------------------------------------------------------ time

    def _to_monotonic(self, epoch_s: float) -> float:
        return self.clock.now() + (epoch_s - self.clock.wall())

    def _to_epoch(self, monotonic_s: float) -> float:
        return self.clock.wall() + (monotonic_s - self.clock.now())

    # ------------------------------------------------------------------ submit

    def submit_turn(self, request: TurnRequest) -> int:
        """Queue a turn for admission; its decision comes out of ``tick()``.

        Raises ``SchedulerInputError`` for an unknown class or provider key, or negative tokens.
        """
        self._check_class(request.priority_class, "TurnRequest.priority_class")
        if request.estimated_tokens < 0:
            raise SchedulerInputError(
                f"must be >= 0, got {request.estimated_tokens}", where="TurnRequest.estimated_tokens"
            )
        lane = self._lane(request.provider_key)
        pending = self._new_pending(
            RequestKind.TURN,
            request.trajectory_id,
            request.priority_class,
            request.deadline,
            request.provider_key,
            request.estimated_tokens,
        )
        if not lane.limiter.fits_ever(request.estimated_tokens):
            return self._refuse_now(
                pending,
                Predicate.EXCEEDS_CAPACITY,
                f"turn of {request.estimated_tokens} tokens exceeds the bucket capacity "
                f"{lane.limiter.tokens.capacity:.0f} of {request.provider_key!r}",
            )
        if pending.deadline_at <= pending.submitted_at:
            return self._refuse_now(pending, Predicate.DEADLINE, "deadline already passed at submission")
        self._enqueue(pending)
        lane.drr.push(request.priority_class, pending.ticket, request.estimated_tokens)
        if request.priority_class == self._top:
            lane.top_asked_at = pending.submitted_at
        return pending.ticket

    def submit_sandbox(self, trajectory_id: str, pool: str, priority_class: str, deadline: float) -> int:
        """Queue a sandbox acquisition; its permit (or refusal) comes out of ``tick()``."""
        self._check_class(priority_class, "acquire_sandbox.priority_class")
        sandbox_pool = self._pools.get(pool)
        if sandbox_pool is None:
            raise SchedulerInputError(f"unknown sandbox pool {pool!r}", where="acquire_sandbox.pool")
        pending = self._new_pending(RequestKind.SANDBOX, trajectory_id, priority_class, deadline, pool)
        if pending.deadline_at <= pending.submitted_at:
            return self._refuse_now(pending, Predicate.DEADLINE, "deadline already passed at submission")
        self._enqueue(pending)
        sandbox_pool.enqueue(priority_class, pending.ticket)
        return pending.ticket

    def cancel(self, ticket: int) -> bool:
        """Withdraw a waiting request (its requester went away). False if it was not waiting."""
        pending = self._pending.pop(ticket, None)
        if pending is None:
            return False
        self._withdraw(pending)
        return True

    def _check_class(self, priority_class: str, where: str) -> None:
        if priority_class not in self.config.class_weights:
            known = ", ".join(sorted(self.config.class_weights))
            raise SchedulerInputError(
                f"unknown priority class {priority_class!r} (known: {known})", where=where
            )

    def _lane(self, provider_key: str) -> _Lane:
        lane = self._lanes.get(provider_key)
        if lane is None:
            limits = self.config.limits_for(provider_key)
            if limits is None:
                raise SchedulerInputError(
                    f"no limits configured for provider key {provider_key!r}",
                    where="TurnRequest.provider_key",
                )
            # Buckets start empty: after a restart we cannot know what was spent, so no burst.
            lane = _Lane(
                ProviderLimiter(limits, self.config.feedback, self.clock.now()),
                DeficitRoundRobin(
                    self.config.class_weights,
                    self.config.quantum_tokens,
                    first=(self._top,) if self.config.top_class_reserve else (),
                ),
            )
            self._lanes[provider_key] = lane
        return lane

    def _new_pending(
        self,
        kind: RequestKind,
        trajectory_id: str,
        priority_class: str,
        deadline: float,
        target: str,
        cost: int = 0,
    ) -> _Pending:
        now = self.clock.now()
        return _Pending(
            next(self._tickets),
            kind,
            trajectory_id,
            priority_class,
            now,
            self._to_monotonic(deadline),
            target,
            cost,
        )

    def _enqueue(self, pending: _Pending) -> None:
        self._pending[pending.ticket] = pending
        heapq.heappush(self._deadlines, (pending.deadline_at, pending.ticket))

    def _refuse_now(self, pending: _Pending, predicate: str, message: str) -> int:
        self._ready.append(self._refusal(pending, predicate, message))
        return pending.ticket

    def _refusal(self, pending: _Pending, predicate: str, message: str) -> Refused:
        self.metrics.refused(pending.kind, pending.priority_class, predicate)
        return Refused(pending.ticket, pending.kind, predicate, message)

    def _withdraw(self, pending: _Pending) -> None:
        if pending.kind is RequestKind.TURN:
            self._lanes[pending.target].drr.remove(pending.ticket)
        else:
            self._pools[pending.target].remove(pending.ticket)

    # ------------------------------------------------------------------ decide

    def tick(self) -> list[Decision]:
        """Everything decidable now: expire leases, refuse expired requests, admit what fits."""
        now = self.clock.now()
        decisions, self._ready = self._ready, []
        self._expire_leases(now)
        decisions.extend(self._expire_deadlines(now))
        for key, lane in self._lanes.items():
            decisions.extend(self._admit_lane(key, lane, now))
        for pool in self._pools.values():
            for class_name, ticket in pool.dispatch():
                decisions.append(self._grant_permit(self._pending.pop(ticket), pool.name, class_name, now))
        return decisions

    def _admit_lane(self, key: str, lane: _Lane, now: float) -> list[Decision]:
        admitted: list[Decision] = []
        while (head := lane.drr.peek()) is not None:
            _, ticket, cost = head
            if not lane.limiter.fits_ever(cost):
                # the limit learned since it queued is smaller than this turn: waiting can never help
                lane.drr.pop()
                pending = self._pending.pop(ticket)
                admitted.append(
                    self._refusal(
                        pending,
                        Predicate.EXCEEDS_CAPACITY,
                        f"turn of {cost} tokens exceeds the bucket capacity "
                        f"{lane.limiter.tokens.capacity:.0f} of {key!r} (learned from the provider)",
                    )
                )
                continue
            name = head[0]
            if not lane.limiter.can_admit(cost, now, self._reserve(lane, name, now)):
                # head-of-line: the next turn DRR chose waits for the bucket; only the top class may go
                # first, from its reserve and its credit of the round (top_class_reserve)
                early = self._early_top_turn(lane, now) if self._passes(name) else None
                if early is None:
                    break
                _, ticket, cost = early
            else:
                lane.drr.pop()
            ledger_id = lane.limiter.admit(cost, now)
            pending = self._pending.pop(ticket)
            lease = self._new_lease(RequestKind.TURN, pending, self.config.turn_lease_s, now, reserved=cost)
            lease.ledger_id = ledger_id
            lease.admitted_at = now
            grant = TurnGrant(lease.lease_id, cost, self._to_epoch(lease.expires_at))
            waited = now - pending.submitted_at
            self.metrics.admission_wait(pending.priority_class, waited)
            admitted.append(Admitted(ticket, grant, waited))
        if any(isinstance(d, Admitted) for d in admitted):
            self._report_levels(key, lane, now)
        return admitted

    def _passes(self, head_class: str) -> bool:
        """Whether the top class may go before a waiting head of ``head_class`` (``top_class_reserve``)."""
        return bool(self.config.top_class_reserve) and head_class != self._top

    def _early_top_turn(self, lane: _Lane, now: float) -> tuple[str, int, int] | None:
        """The top class's next turn, taken out of the round's order, if it fits now and the class can pay
        for it this round; else None."""
        waiting = lane.drr.early(self._top)
        if waiting is None or not lane.limiter.fits_ever(waiting[1]):
            return None  # (one that can never fit is refused when DRR reaches it)
        if not lane.limiter.can_admit(waiting[1], now):
            return None
        return lane.drr.pop_early(self._top)

    def _grant_permit(self, pending: _Pending, pool: str, class_name: str, now: float) -> PermitGranted:
        lease = self._new_lease(RequestKind.SANDBOX, pending, self.config.sandbox_lease_s, now)
        permit = SandboxPermit(lease.lease_id, pool, self._to_epoch(lease.expires_at))
        return PermitGranted(pending.ticket, permit, now - pending.submitted_at)

    def _new_lease(
        self, kind: RequestKind, pending: _Pending, ttl: float, now: float, reserved: int = 0
    ) -> _Lease:
        prefix = "g" if kind is RequestKind.TURN else "p"
        lease = _Lease(
            f"{prefix}-{self._id_prefix}-{next(self._lease_ids)}",
            kind,
            pending.trajectory_id,
            pending.priority_class,
            pending.target,
            now + ttl,
            reserved,
        )
        self._leases[lease.lease_id] = lease
        heapq.heappush(self._expiries, (lease.expires_at, lease.lease_id))
        return lease

    def _expire_deadlines(self, now: float) -> list[Decision]:
        refused: list[Decision] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, ticket = heapq.heappop(self._deadlines)
            pending = self._pending.pop(ticket, None)
            if pending is None:
                continue  # already decided
            self._withdraw(pending)
            refused.append(
                self._refusal(
                    pending, Predicate.DEADLINE, f"deadline passed while waiting for {pending.kind}"
                )
            )
        return refused

    def _expire_leases(self, now: float) -> None:
        while self._expiries and self._expiries[0][0] <= now:
            _, lease_id = heapq.heappop(self._expiries)
            self._drop_lease(lease_id)
            self._chunks.pop(lease_id, None)  # a chunk never returned: its tokens stay spent

    def _drop_lease(self, lease_id: str) -> _Lease | None:
        """Forget a lease. A turn's reserved tokens stay spent (the call may have gone out);
        a sandbox goes back to its pool."""
        lease = self._leases.pop(lease_id, None)
        if lease is not None and lease.kind is RequestKind.SANDBOX:
            self._pools[lease.target].release(lease.priority_class)
        return lease

    def next_wakeup(self) -> float | None:
        """The monotonic time at which ``tick()`` may decide something new (None: only a new call can)."""
        now = self.clock.now()
        if self._ready:
            return now
        times: list[float] = []
        for lane in self._lanes.values():
            head = lane.drr.peek()
            if head is None:
                continue
            name, _, cost = head
            reserve = self._reserve(lane, name, now)
            at = lane.limiter.ready_at(cost, now, reserve)
            if reserve and not lane.drr.waiting(self._top):  # or when the reserve lapses, if that is sooner
                lapses = lane.top_asked_at + lane.limiter.limits.window_s
                at = min(at, max(lapses, lane.limiter.ready_at(cost, now)))
            early = lane.drr.early(self._top) if self._passes(name) else None
            if early is not None and lane.limiter.fits_ever(early[1]):
                at = min(at, lane.limiter.ready_at(early[1], now))
            times.append(at)
        while self._deadlines and self._deadlines[0][1] not in self._pending:
            heapq.heappop(self._deadlines)
        if self._deadlines:
            times.append(self._deadlines[0][0])
        while self._expiries and not self._is_lease(self._expiries[0][1]):
            heapq.heappop(self._expiries)
        if self._expiries:
            times.append(self._expiries[0][0])
        finite = [t for t in times if t != math.inf]
        return min(finite) if finite else None

    # ------------------------------------------------------------------ settle / release / feedback

    def settle_turn(self, grant_id: str, actual_tokens: int) -> SettleResult:
        """Replace a grant's reservation by the provider-reported usage (refund or debit exactly)."""
        if actual_tokens < 0:
            raise SchedulerInputError(f"must be >= 0, got {actual_tokens}", where="settle_turn.actual_tokens")
        lease = self._leases.get(grant_id)
        if lease is None or lease.kind is not RequestKind.TURN:
            return SettleResult.UNKNOWN
        del self._leases[grant_id]
        self._settled[grant_id] = (lease.target, lease.admitted_at, lease.reserved)
        if len(self._settled) > _SETTLED_KEPT:
            self._settled.popitem(last=False)
        lane = self._lanes[lease.target]
        now = self.clock.now()
        lane.limiter.settle(lease.reserved, actual_tokens, now, lease.ledger_id)
        self._report_levels(lease.target, lane, now)
        return SettleResult.SETTLED

    # ------------------------------------------------------------------ chunk leases (scheduler.lease)

    def lease_turns(self, request: TurnRequest, requests: int) -> TurnLease | None:
        """A chunk of up to ``requests`` turns like ``request`` while the key is uncontended, else None
        (the caller then submits the turn on its own, in DRR order). Halves the chunk until it fits."""
        leasing = self.config.leasing
        if leasing is None or requests < 2:
            return None
        self._check_class(request.priority_class, "TurnRequest.priority_class")
        if request.estimated_tokens < 0:
            return None  # submit_turn gives the input error
        lane = self._lane(request.provider_key)
        if len(lane.drr):
            return None  # someone waits: DRR decides who is next, one turn at a time
        now = self.clock.now()
        if self._to_monotonic(request.deadline) <= now:
            return None
        n = min(requests, leasing.max_requests)
        reserve = self._reserve(lane, request.priority_class, now)
        while n >= 2 and not lane.limiter.can_lease(
            chunk_tokens(request.estimated_tokens, n), n, now, leasing.slack, reserve
        ):
            n //= 2
        if n < 2:
            return None
        tokens = chunk_tokens(request.estimated_tokens, n)
        use_by = now + leasing.use_s
        ledger_ids = lane.limiter.lease(tokens, n, now, use_by)
        expires_at = use_by + self.config.turn_lease_s
        lease = TurnLease(
            f"c-{self._id_prefix}-{next(self._lease_ids)}",
            request.provider_key,
            request.priority_class,
            tokens,
            n,
            self._to_epoch(use_by),
            self._to_epoch(expires_at),
        )
        self._chunks[lease.lease_id] = _Chunk(lease, expires_at, ledger_ids)
        heapq.heappush(self._expiries, (expires_at, lease.lease_id))
        self._report_levels(request.provider_key, lane, now)
        return lease

    def admits_at_once(self, request: TurnRequest) -> bool:
        """Whether ``submit_turn(request)`` would be decided by the next ``tick`` (admitted or refused):
        nothing queued on its key and the buckets cover it, or it is refused on sight."""
        lane = self._lanes.get(request.provider_key)
        if lane is None or request.estimated_tokens < 0:
            return True  # submit_turn decides it: a new key starts empty, bad input is refused
        now = self.clock.now()
        if (
            not lane.limiter.fits_ever(request.estimated_tokens)
            or self._to_monotonic(request.deadline) <= now
        ):
            return True
        reserve = self._reserve(lane, request.priority_class, now)
        return not len(lane.drr) and lane.limiter.can_admit(request.estimated_tokens, now, reserve)

    def end_lease(self, lease_id: str, used_tokens: int, used_requests: int) -> SettleResult:
        """A chunk comes back with what it used: refund (or debit) its tokens and unused requests."""
        if used_tokens < 0 or used_requests < 0:
            raise SchedulerInputError(
                f"must be >= 0, got tokens={used_tokens} requests={used_requests}", where="end_lease.used"
            )
        chunk = self._chunks.pop(lease_id, None)
        if chunk is None:
            return SettleResult.UNKNOWN  # expired, already returned, or from before a restart
        lease = chunk.lease
        lane = self._lanes[lease.provider_key]
        now = self.clock.now()
        used = (used_tokens, min(used_requests, lease.requests))
        lane.limiter.end_lease((lease.tokens, lease.requests), used, now, chunk.ledger_ids)
        self._report_levels(lease.provider_key, lane, now)
        return SettleResult.SETTLED

    def _is_lease(self, lease_id: str) -> bool:
        return lease_id in self._leases or lease_id in self._chunks

    def release_sandbox(self, permit_id: str) -> bool:
        """Give a sandbox back. False if the permit is unknown (already released or reclaimed)."""
        lease = self._leases.get(permit_id)
        if lease is None or lease.kind is not RequestKind.SANDBOX:
            return False
        self._drop_lease(permit_id)
        return True

    def report_rate_limited(
        self, provider_key: str, retry_after: float | None, remaining: Mapping[str, float] | None = None
    ) -> None:
        """The provider answered 429 on ``provider_key``: pause the key, slow down, clamp, learn."""
        info = RateLimitInfo(
            retry_after_s=retry_after,
            remaining_requests=_pick(remaining, "requests"),
            remaining_tokens=_pick(remaining, "tokens"),
        )
        self.report_limits(provider_key, info, rate_limited=True)

    def report_limits(
        self, provider_key: str, info: RateLimitInfo, rate_limited: bool, grant_id: str | None = None
    ) -> None:
        """Admission feedback from one provider response: what its headers said about the limits, and
        whether it was a 429. The lane learns the real limit from it (``scheduler.learning``); a 429 on a
        grant of this key also how late our requests reach the provider (``ProviderLimiter``)."""
        lane = self._lane(provider_key)
        now = self.clock.now()
        lane.limiter.observe(info, now)
        if rate_limited:
            admitted_at, reserved = self._admission_of(grant_id, provider_key)
            lane.limiter.on_rate_limited(info.retry_after_s, now, info, admitted_at, reserved)
            self.metrics.rate_limited(provider_key)
        self._report_levels(provider_key, lane, now)

    def _admission_of(self, grant_id: str | None, provider_key: str) -> tuple[float | None, int | None]:
        """When this scheduler admitted ``grant_id`` on ``provider_key`` and the tokens it reserved (None,
        None: unknown here, e.g. a turn of a leased chunk, a grant from before a restart, or one settled
        long ago)."""
        if grant_id is None:
            return None, None
        lease = self._leases.get(grant_id)
        if lease is not None:
            return (lease.admitted_at, lease.reserved) if lease.target == provider_key else (None, None)
        key, admitted_at, reserved = self._settled.get(grant_id, ("", 0.0, 0))
        return (admitted_at, reserved) if key == provider_key else (None, None)

    def observe_remaining(self, provider_key: str, remaining: Mapping[str, float]) -> None:
        """A successful response's ``x-ratelimit-remaining-*``: never be more optimistic than the provider."""
        info = RateLimitInfo(
            remaining_requests=_pick(remaining, "requests"), remaining_tokens=_pick(remaining, "tokens")
        )
        self.report_limits(provider_key, info, rate_limited=False)

    def reclaim(self, is_alive: Callable[[str], bool]) -> list[str]:
        """Drop every lease whose holder is gone and refuse its waiting requests; returns lease ids."""
        dead_leases = [lid for lid, lease in self._leases.items() if not is_alive(lease.trajectory_id)]
        for lease_id in dead_leases:
            self._drop_lease(lease_id)
        for pending in [p for p in self._pending.values() if not is_alive(p.trajectory_id)]:
            del self._pending[pending.ticket]
            self._withdraw(pending)
            self._ready.append(self._refusal(pending, Predicate.HOLDER_GONE, "requesting trajectory is gone"))
        return dead_leases

    def refuse_all(self, predicate: str, message: str) -> list[Decision]:
        """Refuse every waiting request (the scheduler is shutting down)."""
        refused = [self._refusal(p, predicate, message) for p in self._pending.values()]
        for pending in list(self._pending.values()):
            self._withdraw(pending)
        self._pending.clear()
        return [*self._ready, *refused]

    # ------------------------------------------------------------------ introspection

    def _report_levels(self, key: str, lane: _Lane, now: float) -> None:
        limiter = lane.limiter
        self.metrics.bucket_level(key, "tokens", limiter.tokens.level(now), limiter.tokens.capacity)
        self.metrics.bucket_level(key, "requests", limiter.requests.level(now), limiter.requests.capacity)
        if limiter.delay_margin_s != lane.reported_margin:
            lane.reported_margin = limiter.delay_margin_s
            self.metrics.delay_margin(key, limiter.delay_margin_s)

    def snapshot(self) -> SchedulerSnapshot:
        now = self.clock.now()
        for lane in self._lanes.values():
            lane.limiter.advance(now)  # a delay margin past its memory is dropped before it is shown
        lanes = {
            key: LaneView(
                tokens=lane.limiter.tokens.level(now),
                token_capacity=lane.limiter.tokens.capacity,
                requests=lane.limiter.requests.level(now),
                request_capacity=lane.limiter.requests.capacity,
                rate_factor=lane.limiter.rate_factor,
                blocked_for_s=max(0.0, lane.limiter.blocked_until - now),
                rate_limited=lane.limiter.rate_limited_count,
                queued=lane.drr.depth(),
                deficits=lane.drr.deficits(),
                limit_requests=lane.limiter.learned_requests.effective,
                limit_tokens=lane.limiter.learned_tokens.effective,
                limit_sources={
                    "requests": lane.limiter.learned_requests.source.value,
                    "tokens": lane.limiter.learned_tokens.source.value,
                },
                granted=lane.limiter.granted_count,
                retry_hints_honoured=dict(lane.limiter.hints_honoured),
                delay_margin_s=lane.limiter.delay_margin_s,
            )
            for key, lane in self._lanes.items()
        }
        pools = {
            name: PoolView(pool.size, pool.reserved, pool.in_use, pool.in_use_unreserved, pool.waiting)
            for name, pool in self._pools.items()
        }
        leases = list(self._leases.values())
        return SchedulerSnapshot(
            lanes=lanes,
            pools=pools,
            pending=len(self._pending),
            grants=sum(1 for lease in leases if lease.kind is RequestKind.TURN),
            permits=sum(1 for lease in leases if lease.kind is RequestKind.SANDBOX),
            chunks=len(self._chunks),
        )


def _pick(remaining: Mapping[str, float] | None, suffix: str) -> float | None:
    """The count for ``suffix`` (``requests``/``tokens``) from a header-name or bare-suffix mapping."""
    for key, value in (remaining or {}).items():
        if key.lower().endswith(suffix):
            return float(value)
    return None
