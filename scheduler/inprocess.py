"""The async wrapper: ``InProcessScheduler`` implements ``AdmissionPort`` over a ``SchedulerCore``.

Callers await their decision on a future; one driver task calls ``tick()`` whenever something changed
or ``next_wakeup()`` is due, and sleeps on the injected clock in between. Nothing blocks a thread:
settle, release and feedback are immediate and never wait behind queued admissions.

Thread-safe on purpose. In the Ray actor each concurrency group runs its own event loop in its own
thread, so admissions (one loop) and settlements (another) reach the same core: a lock guards the core,
and futures are resolved on the loop that owns them.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Mapping
from typing import Any

from runtime.clock import Clock, SystemClock
from runtime.dispatch import UnlimitedAdmission
from runtime.errors import AdmissionRefused
from runtime.ports import RateLimitInfo, SandboxPermit, TurnGrant, TurnRequest
from scheduler.config import SchedulerConfig
from scheduler.core import Admitted, Decision, PermitGranted, Refused, SchedulerCore, SchedulerSnapshot
from scheduler.errors import Predicate
from scheduler.hooks import SchedulerMetrics
from scheduler.lease import TurnLease

__all__ = ["AlwaysAdmit", "InProcessScheduler"]

_Waiter = tuple[asyncio.AbstractEventLoop, "asyncio.Future[Any]"]


class InProcessScheduler:
    """An ``AdmissionPort`` for one process: unit tests, single-process benchmarks, and the actor's body."""

    def __init__(
        self,
        config: SchedulerConfig,
        clock: Clock | None = None,
        metrics: SchedulerMetrics | None = None,
        id_prefix: str | None = None,
    ) -> None:
        self.clock: Clock = clock or SystemClock()
        self.core = SchedulerCore(config, self.clock, metrics, id_prefix)
        self._lock = threading.Lock()
        self._waiters: dict[int, _Waiter] = {}
        self._driver: asyncio.Task[None] | None = None
        self._driver_loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._closed = False

    # ------------------------------------------------------------------ AdmissionPort

    async def admit_turn(self, request: TurnRequest) -> TurnGrant:
        """Wait for admission; raises ``AdmissionRefused`` (deadline, capacity) or ``SchedulerInputError``."""
        decision = await self._wait(lambda: self.core.submit_turn(request))
        assert isinstance(decision, Admitted)
        return decision.grant

    async def settle_turn(self, grant_id: str, actual_tokens: int) -> None:
        with self._lock:
            self.core.settle_turn(grant_id, actual_tokens)
        self._poke()

    async def settle_many(
        self, settlements: list[tuple[str, int]], returns: list[tuple[str, int, int]] | None = None
    ) -> None:
        """``settle_turn`` for each (grant id, actual tokens) and ``end_lease`` for each (chunk id, used
        tokens, used requests), under one lock and one wake-up."""
        with self._lock:
            for grant_id, actual_tokens in settlements:
                self.core.settle_turn(grant_id, actual_tokens)
            for lease_id, used_tokens, used_requests in returns or ():
                self.core.end_lease(lease_id, used_tokens, used_requests)
        self._poke()

    async def admit_or_lease(self, request: TurnRequest, want: int) -> TurnGrant | TurnLease | None:
        """A chunk of up to ``want`` turns like ``request`` if the key is uncontended
        (``scheduler.lease``); else this one turn if it is admitted at once; else None at once (the key is
        contended: the caller and its process's other callers then ask ``admit_turn`` each, in DRR order,
        instead of queueing behind this call)."""
        with self._lock:
            if self._closed:
                raise AdmissionRefused(Predicate.SHUTDOWN, "scheduler is shutting down")
            lease = self.core.lease_turns(request, want)
            if lease is None and not self.core.admits_at_once(request):
                return None
        if lease is not None:
            return lease
        return await self.admit_turn(request)

    async def end_lease(self, lease_id: str, used_tokens: int, used_requests: int) -> None:
        """A chunk comes back with what it used (refund or debit)."""
        with self._lock:
            self.core.end_lease(lease_id, used_tokens, used_requests)
        self._poke()

    async def report_rate_limited(
        self, provider_key: str, retry_after: float | None, remaining: Mapping[str, float]
    ) -> None:
        with self._lock:
            self.core.report_rate_limited(provider_key, retry_after, remaining)
        self._poke()

    async def report_limits(
        self, provider_key: str, info: RateLimitInfo, rate_limited: bool, grant_id: str | None = None
    ) -> None:
        """Admission feedback from one provider response (a 429 and/or its limit headers): the key's
        limits are learned from it (``scheduler.learning``)."""
        with self._lock:
            self.core.report_limits(provider_key, info, rate_limited, grant_id)
        self._poke()

    async def acquire_sandbox(
        self, trajectory_id: str, pool: str, priority_class: str, deadline: float
    ) -> SandboxPermit:
        decision = await self._wait(
            lambda: self.core.submit_sandbox(trajectory_id, pool, priority_class, deadline)
        )
        assert isinstance(decision, PermitGranted)
        return decision.permit

    async def release_sandbox(self, permit_id: str) -> None:
        with self._lock:
            self.core.release_sandbox(permit_id)
        self._poke()

    # ------------------------------------------------------------------ beyond the port

    async def report_remaining(self, provider_key: str, remaining: Mapping[str, float]) -> None:
        """Feed a successful response's ``x-ratelimit-remaining-*`` into the local view."""
        with self._lock:
            self.core.observe_remaining(provider_key, remaining)
        self._poke()

    def reclaim(self, is_alive: Callable[[str], bool]) -> list[str]:
        """Drop leases and waiting requests of holders that are gone; returns reclaimed lease ids."""
        with self._lock:
            reclaimed = self.core.reclaim(is_alive)
        self._poke()
        return reclaimed

    def snapshot(self) -> SchedulerSnapshot:
        with self._lock:
            return self.core.snapshot()

    async def aclose(self) -> None:
        """Refuse everything still waiting and stop the driver."""
        with self._lock:
            self._closed = True
            self._resolve(self.core.refuse_all(Predicate.SHUTDOWN, "scheduler is shutting down"))
        driver = self._driver
        if driver is not None and self._driver_loop is asyncio.get_running_loop():
            driver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await driver
        elif driver is not None and self._driver_loop is not None:
            self._driver_loop.call_soon_threadsafe(driver.cancel)

    # ------------------------------------------------------------------ waiting

    async def _wait(self, submit: Callable[[], int]) -> Decision:
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._closed:
                raise AdmissionRefused(Predicate.SHUTDOWN, "scheduler is shutting down")
            ticket = submit()  # may raise SchedulerInputError: nothing was queued
            decisions = self.core.tick()
            # Fast path (throughput): decided at once, so answer without a future or a wake-up of the driver
            mine = next((d for d in decisions if d.ticket == ticket), None)
            if mine is None:
                future: asyncio.Future[Decision] = loop.create_future()
                self._waiters[ticket] = (loop, future)
                self._resolve(decisions)
            else:
                self._resolve([d for d in decisions if d is not mine])
        if mine is not None:
            if isinstance(mine, Refused):
                raise mine.error()
            return mine
        self._ensure_driver(loop)
        self._poke()
        try:
            decision = await future
        except asyncio.CancelledError:
            with self._lock:
                self._waiters.pop(ticket, None)
                self.core.cancel(ticket)
            raise
        if isinstance(decision, Refused):
            raise decision.error()
        return decision

    def _resolve(self, decisions: list[Decision]) -> None:
        """Hand each decision to its waiter on the waiter's own loop. Called with the lock held."""
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        for decision in decisions:
            waiter = self._waiters.pop(decision.ticket, None)
            if waiter is None:
                self._undo(decision)  # nobody waits any more: give back what was granted
                continue
            loop, future = waiter
            if loop is running:
                loop.call_soon(self._deliver, future, decision)  # same loop: no self-pipe wake-up
            else:
                loop.call_soon_threadsafe(self._deliver, future, decision)

    def _deliver(self, future: asyncio.Future[Any], decision: Decision) -> None:
        if not future.done():
            future.set_result(decision)
            return
        # The requester was cancelled between the decision and its delivery.
        with self._lock:
            self._undo(decision)
        self._poke()

    def _undo(self, decision: Decision) -> None:
        if isinstance(decision, Admitted):
            self.core.settle_turn(decision.grant.grant_id, 0)  # never used: refund the whole reservation
        elif isinstance(decision, PermitGranted):
            self.core.release_sandbox(decision.permit.permit_id)

    # ------------------------------------------------------------------ driver

    def _ensure_driver(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._lock:
            if self._driver is not None and not self._driver.done():
                return
            self._driver_loop = loop
            self._wake = asyncio.Event()
            self._driver = loop.create_task(self._drive(self._wake), name="scheduler-driver")

    def _poke(self) -> None:
        """Make the driver re-tick now (from any thread)."""
        loop, wake = self._driver_loop, self._wake
        if loop is None or wake is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            wake.set()
        else:
            loop.call_soon_threadsafe(wake.set)

    async def _drive(self, wake: asyncio.Event) -> None:
        while True:
            wake.clear()  # cleared before ticking: a poke during the tick is not lost
            with self._lock:
                self._resolve(self.core.tick())
                wake_at = self.core.next_wakeup()
            if wake_at is None:
                await wake.wait()
                continue
            delay = wake_at - self.clock.now()
            if delay <= 0:
                await asyncio.sleep(0)
                continue
            woken = asyncio.ensure_future(wake.wait())
            slept = asyncio.ensure_future(self.clock.sleep(delay))
            try:
                await asyncio.wait({woken, slept}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                woken.cancel()
                slept.cancel()


class AlwaysAdmit(UnlimitedAdmission):
    """An ``AdmissionPort`` that admits everything at once: no limits, no queues (tests, local runs).

    The runtime's own ``UnlimitedAdmission`` with the system clock by default, under the scheduler's name.
    """

    def __init__(self, lease_s: float = 3600.0, clock: Clock | None = None) -> None:
        super().__init__(clock or SystemClock(), lease_s)
