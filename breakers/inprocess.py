"""The async shell over ``ScopeGuard``: waiting in the bulkhead queue, delivering answers to waiters.

``InProcessGuard`` implements ``runtime.ports.GuardPort`` for any number of scopes in one process. The
guard actor wraps one instance; unit tests use it directly with a ``FakeClock``.

Thread safety: the Ray actor runs its admission and settlement methods in separate concurrency groups,
which are separate event loops on separate threads, so every state change happens under one lock and a
waiter's future is completed on its own loop (``call_soon_threadsafe``). Waiting never holds the lock, so
queued admissions cannot block ``record`` or ``release``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

from runtime.clock import Clock
from runtime.metrics import Metrics
from runtime.ports import GuardPermit, OutcomeClass

from .breaker import RecordEffect
from .bulkhead import Lease, QueueTicket
from .errors import QueuedPastDeadline
from .scope_guard import GuardPolicy, GuardSnapshot, Resolution, ScopeGuard

__all__ = ["InProcessGuard"]

_Waiter = tuple[asyncio.AbstractEventLoop, "asyncio.Future[GuardPermit]"]


class InProcessGuard:
    """Breaker + bulkhead per dependency scope, in this process. ``policy`` is one policy for every
    scope or a function choosing one per scope (e.g. tighter caps for a tenant partition). ``metrics``
    records every scope's breaker state, trips and probes (no-op when None)."""

    def __init__(
        self,
        clock: Clock,
        policy: GuardPolicy | Callable[[str], GuardPolicy] | None = None,
        holder: str = "",
        metrics: Metrics | None = None,
    ) -> None:
        self._clock = clock
        self._metrics = metrics
        chosen = policy if policy is not None else GuardPolicy()
        self._policy_for: Callable[[str], GuardPolicy] = (
            chosen if callable(chosen) and not isinstance(chosen, GuardPolicy) else (lambda _scope: chosen)
        )
        self._holder = holder
        self._guards: dict[str, ScopeGuard] = {}
        self._waiters: dict[str, _Waiter] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ GuardPort

    async def admit(
        self, scope: str, call_id: str, deadline: float, holder: str | None = None
    ) -> GuardPermit:
        """A permit, after waiting in the bulkhead queue if needed; refusals raise (never queue forever)."""
        loop = asyncio.get_running_loop()
        with self._lock:
            guard = self._guard(scope)
            placed = guard.admit(call_id, deadline, self._holder if holder is None else holder)
            if isinstance(placed, GuardPermit):
                return placed
            future: asyncio.Future[GuardPermit] = loop.create_future()
            self._waiters[placed.ticket.ticket_id] = (loop, future)
        return await self._wait(guard, placed.ticket, future)

    async def record(self, permit: GuardPermit, outcome: OutcomeClass) -> None:
        await self.record_effect(permit, outcome)

    async def record_effect(self, permit: GuardPermit, outcome: OutcomeClass) -> RecordEffect:
        """``record`` that also says what the outcome did to the breaker (stale, tripped, ...)."""
        with self._lock:
            effect, resolutions = self._guard(permit.scope).record(permit, outcome)
            deliveries = self._claim(resolutions)
        self._deliver(deliveries)
        return effect

    async def release(self, permit: GuardPermit) -> None:
        self._release(permit)

    async def settle(self, permit: GuardPermit, outcome: OutcomeClass | None) -> None:
        """``record`` then ``release``; the permit is released even if recording fails."""
        try:
            if outcome is not None:
                await self.record_effect(permit, outcome)
        finally:
            self._release(permit)

    # ------------------------------------------------------------------ maintenance and views

    def reclaim(self, holder_alive: Callable[[str], bool] | None = None) -> list[Lease]:
        """Reclaim expired leases (and those of dead holders) in every scope; returns what was reclaimed."""
        reclaimed: list[Lease] = []
        deliveries: list[tuple[_Waiter, Resolution]] = []
        with self._lock:
            for guard in self._guards.values():
                leases, resolutions = guard.reclaim(holder_alive)
                reclaimed += leases
                deliveries += self._claim(resolutions)
        self._deliver(deliveries)
        return reclaimed

    def snapshot(self, scope: str) -> GuardSnapshot:
        with self._lock:
            return self._guard(scope).snapshot()

    def scopes(self) -> list[str]:
        with self._lock:
            return sorted(self._guards)

    # ------------------------------------------------------------------ internals

    def _guard(self, scope: str) -> ScopeGuard:
        guard = self._guards.get(scope)
        if guard is None:
            guard = ScopeGuard(scope, self._policy_for(scope), self._clock, self._metrics)
            self._guards[scope] = guard
        return guard

    def _release(self, permit: GuardPermit) -> None:
        with self._lock:
            deliveries = self._claim(self._guard(permit.scope).release(permit))
        self._deliver(deliveries)

    async def _wait(
        self, guard: ScopeGuard, ticket: QueueTicket, future: asyncio.Future[GuardPermit]
    ) -> GuardPermit:
        timer = asyncio.ensure_future(self._sleep_until(ticket.deadline))
        try:
            pending: set[asyncio.Future[Any]] = {future, timer}
            await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            self._abandon(guard, ticket, future)
            raise
        finally:
            timer.cancel()
        if not future.done():
            with self._lock:
                withdrawn = guard.withdraw(ticket.ticket_id)
                if withdrawn:
                    self._waiters.pop(ticket.ticket_id, None)
            if withdrawn:  # §12.7.3: nothing queued is dispatched after its deadline
                raise QueuedPastDeadline(guard.scope, ticket.call_id, ticket.deadline)
        # Resolved (possibly from another loop a moment ago): the answer is on its way.
        return await future

    async def _sleep_until(self, wall_deadline: float) -> None:
        # Re-read the clock after each wake-up: the timer task may start after time has already moved.
        while (remaining := wall_deadline - self._clock.wall()) > 0:
            await self._clock.sleep(remaining)

    def _abandon(self, guard: ScopeGuard, ticket: QueueTicket, future: asyncio.Future[GuardPermit]) -> None:
        """The waiter was cancelled. If its slot was already granted, give it back."""
        with self._lock:
            if guard.withdraw(ticket.ticket_id):
                self._waiters.pop(ticket.ticket_id, None)
                return
        if future.done() and not future.cancelled() and future.exception() is None:
            self._release(future.result())
        else:
            future.cancel()  # a grant still in flight is released by _complete when it lands

    def _claim(self, resolutions: list[Resolution]) -> list[tuple[_Waiter, Resolution]]:
        """Under the lock: pair each resolution with its waiter."""
        out = []
        for resolution in resolutions:
            waiter = self._waiters.pop(resolution.ticket_id, None)
            if waiter is not None:
                out.append((waiter, resolution))
        return out

    def _deliver(self, deliveries: list[tuple[_Waiter, Resolution]]) -> None:
        for (loop, future), resolution in deliveries:
            loop.call_soon_threadsafe(self._complete, future, resolution)

    def _complete(self, future: asyncio.Future[GuardPermit], resolution: Resolution) -> None:
        if future.done():  # the waiter gave up: a slot granted to nobody goes straight back
            if resolution.permit is not None:
                self._release(resolution.permit)
            return
        if resolution.permit is not None:
            future.set_result(resolution.permit)
        else:
            future.set_exception(resolution.refusal or RuntimeError("resolution without permit or refusal"))
