"""The holder's side of chunk leases (``scheduler.lease``) for one process: admits locally from a chunk
while it lasts, asks the scheduler for the next one, and returns each chunk when it is done.

``SchedulerHandle`` puts one in front of the scheduler actor; it works over any ``LeaseUpstream`` (in unit
tests an ``InProcessScheduler`` on a fake clock). The rules, all here:

- A chunk is asked for only when this process has several turns of one key and class to admit: two or
  more callers waiting at once, or the last chunk used two or more. A lone trajectory taking one turn at
  a time keeps the per-call path (one admit, one settle), so leasing never costs it anything.
- One request for a chunk per key and class in flight; callers arriving meanwhile wait for it and then
  admit from it. The scheduler answers at once: a chunk, the turn admitted on the spot, or "contended";
  then every caller asks on its own (``admit_turn``), so DRR orders them with everyone else's.
- A local grant settles into its chunk, never with a call. A chunk goes back (one ``end_lease``, batched
  with settlements by the caller) when it is exhausted or past ``use_by`` and all its grants are settled.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Protocol

from runtime.clock import Clock
from runtime.ports import TurnGrant, TurnRequest
from scheduler.lease import LocalLease, TurnLease

__all__ = ["LeaseClient", "LeaseUpstream"]

_Key = tuple[str, str]  # (provider key, priority class)
_MAX_TRIES = 8  # local attempts per turn (chunks drained by the process's other callers) before asking alone


class LeaseUpstream(Protocol):
    """What the client needs from the scheduler."""

    async def admit_turn(self, request: TurnRequest) -> TurnGrant: ...

    async def admit_or_lease(self, request: TurnRequest, want: int) -> TurnGrant | TurnLease | None:
        """A chunk, or the turn admitted at once, or None at once when the key is contended."""
        ...


class LeaseClient:
    """Local admission from chunks. ``return_lease(lease_id, used_tokens, used_requests)`` sends a chunk
    back (the handle batches it); ``clock`` is the process's (epoch ``wall()`` against ``use_by``)."""

    def __init__(
        self,
        upstream: LeaseUpstream,
        return_lease: Callable[[str, int, int], Awaitable[None]],
        clock: Clock,
    ) -> None:
        self._upstream = upstream
        self._return_lease = return_lease
        self._clock = clock
        self._current: dict[_Key, LocalLease] = {}
        self._by_id: dict[str, LocalLease] = {}  # every chunk not yet returned, current or draining
        self._fetching: dict[_Key, asyncio.Future[bool]] = {}  # result: a chunk came back
        self._asking: Counter[_Key] = Counter()  # callers inside admit_turn, per key and class
        self._last_used: dict[_Key, int] = {}  # requests the last returned chunk used
        self._tasks: set[asyncio.Task[None]] = set()
        self.leased = 0  # turns admitted from chunks (introspection and benchmarks)

    # ------------------------------------------------------------------ admit

    async def admit_turn(self, request: TurnRequest) -> TurnGrant:
        key = (request.provider_key, request.priority_class)
        self._asking[key] += 1
        try:
            fetched = 0
            for _ in range(_MAX_TRIES):
                grant = self._admit_local(key, request)
                if grant is not None:
                    return grant
                fetch = self._fetching.get(key)
                if fetch is not None:  # another caller of this process is asking: share its chunk
                    if not await asyncio.shield(fetch):
                        break  # contended: everyone waits in DRR on their own
                    continue
                want = self._want(key)
                if want < 2 or fetched == 2:  # a chunk that cannot take this turn twice: ask alone
                    break
                fetched += 1
                answer = await self._fetch(key, request, want)
                if isinstance(answer, TurnGrant):
                    return answer
                if answer is None:
                    break  # contended: wait in DRR like everyone else
            return await self._upstream.admit_turn(request)
        finally:
            self._asking[key] -= 1

    def _want(self, key: _Key) -> int:
        demand = max(self._asking[key], self._last_used.get(key, 0))
        return 2 * demand if demand >= 2 else 1

    def _admit_local(self, key: _Key, request: TurnRequest) -> TurnGrant | None:
        lease = self._current.get(key)
        if lease is None:
            return None
        grant = lease.admit(request, self._clock.wall())
        if grant is not None:
            self.leased += 1
        self._finish_if_done(lease)
        return grant

    async def _fetch(self, key: _Key, request: TurnRequest, want: int) -> TurnGrant | TurnLease | None:
        fetch: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._fetching[key] = fetch
        got_chunk = False
        try:
            answer = await self._upstream.admit_or_lease(request, want)
            if isinstance(answer, TurnLease):
                self._install(key, answer)
                got_chunk = True
            return answer
        finally:
            del self._fetching[key]
            fetch.set_result(got_chunk)

    def _install(self, key: _Key, lease: TurnLease) -> None:
        local = LocalLease(lease)
        previous = self._current.get(key)
        self._current[key] = local
        self._by_id[lease.lease_id] = local
        if previous is not None:
            self._finish_if_done(previous)
        task = asyncio.get_running_loop().create_task(self._close_at_use_by(local))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _close_at_use_by(self, lease: LocalLease) -> None:
        """Give the rest of an idle chunk back once nothing more can be admitted from it."""
        await self._clock.sleep(lease.lease.use_by - self._clock.wall())
        self._finish_if_done(lease)
        if lease.lease_id in self._by_id:  # grants still out: the last settle returns it, else expiry
            await self._clock.sleep(lease.lease.expires_at - self._clock.wall())
            self._finish_if_done(lease)

    # ------------------------------------------------------------------ settle

    def settle_local(self, grant_id: str, actual_tokens: int) -> bool:
        """Settle a grant taken from a chunk; False if it was not one (the caller settles it upstream)."""
        lease = self._by_id.get(grant_id.partition("#")[0])
        if lease is None or not lease.settle(grant_id, actual_tokens):
            return False
        self._finish_if_done(lease)
        return True

    def _finish_if_done(self, lease: LocalLease) -> None:
        """Retire an exhausted chunk from new admissions, and send it back once all its grants settled."""
        now = self._clock.wall()
        key = (lease.lease.provider_key, lease.lease.priority_class)
        if lease.exhausted(now) and self._current.get(key) is lease:
            del self._current[key]
        if self._by_id.get(lease.lease_id) is not lease or not lease.done(now):
            return
        del self._by_id[lease.lease_id]
        used_tokens, used_requests = lease.used()
        self._last_used[key] = used_requests
        task = asyncio.get_running_loop().create_task(
            self._send_back(lease.lease_id, used_tokens, used_requests)
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send_back(self, lease_id: str, used_tokens: int, used_requests: int) -> None:
        # a lost return only leaves the chunk to expire with its tokens spent (the scheduler's backstop)
        with contextlib.suppress(Exception):
            await self._return_lease(lease_id, used_tokens, used_requests)

    async def aclose(self) -> None:
        """Stop the timers (chunks not returned expire at the scheduler)."""
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task
