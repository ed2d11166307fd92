"""Durable timers in Redis: one sorted set of (trajectory, timer) members scored by their due time.

ARCHITECTURE.md, "Durable timers": expiries, deadlines and hibernation wake-ups are timer effects the
trajectory's decider emits; the trajectory actor stores the durable ones here (``schedule``) and removes
them when they fire or are cancelled. A timer service in the cluster (not the ``tether run`` driver) finds
due timers with ``claim_due`` and delivers each to whichever incarnation of the trajectory exists, waking a
hibernated one.

Several service replicas may run at once. ``claim_due`` hands each due timer to one caller for a lease: it
moves the member's score to ``now + lease`` in the same Lua script that read it, so a second replica does
not see it again until the lease lapses. The claimer calls ``complete`` after delivering (removing the
member only if it still carries the claimed score, so a timer re-scheduled meanwhile survives); a claimer
that dies leaves the timer to be claimed again after the lease. Delivery is therefore at-least-once, and the
trajectory's decider ignores a timer it no longer holds, so a repeat is harmless.

Members are ``"<trajectory id> <timer id>"``: trajectory ids never contain a space (``check_trajectory_id``)
and timer ids are made by the decider without one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Self

import redis.asyncio as aioredis

from cluster.embedded import redis_errors
from runtime.errors import InputError
from runtime.memstore import check_trajectory_id

__all__ = ["TIMERS_KEY", "ClaimedTimer", "RedisTimerStore", "timer_member"]

TIMERS_KEY = "tether:timers"

# KEYS[1] the zset; ARGV: now, lease_until, limit. Returns member, score, member, score, ...
_CLAIM = """
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'WITHSCORES', 'LIMIT', 0, tonumber(ARGV[3]))
for i = 1, #due, 2 do
  redis.call('ZADD', KEYS[1], 'XX', ARGV[2], due[i])
end
return due
"""

# KEYS[1] the zset; ARGV: member, claimed score. Removes the member only if it still has that score.
_COMPLETE = """
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if score and tonumber(score) == tonumber(ARGV[2]) then
  return redis.call('ZREM', KEYS[1], ARGV[1])
end
return 0
"""


def timer_member(trajectory_id: str, timer_id: str) -> str:
    """The sorted-set member naming one timer of one trajectory."""
    check_trajectory_id(trajectory_id)
    if not timer_id or any(c.isspace() for c in timer_id):
        raise InputError(f"timer id must be non-empty without spaces, got {timer_id!r}", where="timer_id")
    return f"{trajectory_id} {timer_id}"


@dataclass(frozen=True, slots=True)
class ClaimedTimer:
    """A due timer handed to one claimer until ``lease_until`` (epoch seconds)."""

    trajectory_id: str
    timer_id: str
    due_at: float
    lease_until: float


class RedisTimerStore:
    """``actors.ports.TimerStore`` over one Redis sorted set (plus the service side: claim and complete).

    Construct with ``RedisTimerStore.from_url(url)``, or pass a client you own (then you close it).
    """

    def __init__(
        self, client: aioredis.Redis, *, url: str = "redis", owns_client: bool = False, key: str = TIMERS_KEY
    ) -> None:
        self._client = client
        self._url = url
        self._owns = owns_client
        self._key = key
        self._claim: Any = client.register_script(_CLAIM)
        self._complete: Any = client.register_script(_COMPLETE)

    @classmethod
    def from_url(cls, url: str, *, key: str = TIMERS_KEY) -> Self:
        client = aioredis.Redis.from_url(url, socket_timeout=10.0)
        return cls(client, url=url, owns_client=True, key=key)

    async def schedule(self, trajectory_id: str, timer_id: str, due_at: float) -> None:
        """Store (or move) one timer; it fires at ``due_at`` (epoch seconds) unless cancelled first."""
        member = timer_member(trajectory_id, timer_id)
        with redis_errors(self._url, f"scheduling timer {member!r}"):
            await self._client.zadd(self._key, {member: float(due_at)})

    async def cancel(self, trajectory_id: str, timer_id: str) -> None:
        """Forget one timer (no error if it is gone already)."""
        member = timer_member(trajectory_id, timer_id)
        with redis_errors(self._url, f"cancelling timer {member!r}"):
            await self._client.zrem(self._key, member)

    async def claim_due(self, now: float, lease_s: float, limit: int = 64) -> list[ClaimedTimer]:
        """Up to ``limit`` timers due by ``now``, each leased to this caller until ``now + lease_s``."""
        lease_until = now + lease_s
        with redis_errors(self._url, "claiming due timers"):
            raw = await self._claim(keys=[self._key], args=[now, lease_until, limit])
        claimed: list[ClaimedTimer] = []
        for i in range(0, len(raw), 2):
            member = raw[i].decode() if isinstance(raw[i], bytes) else str(raw[i])
            trajectory_id, _, timer_id = member.partition(" ")
            claimed.append(ClaimedTimer(trajectory_id, timer_id, float(raw[i + 1]), lease_until))
        return claimed

    async def complete(self, timer: ClaimedTimer) -> bool:
        """Remove a delivered timer, unless it was re-scheduled meanwhile. True when removed."""
        member = timer_member(timer.trajectory_id, timer.timer_id)
        with redis_errors(self._url, f"completing timer {member!r}"):
            return bool(await self._complete(keys=[self._key], args=[member, timer.lease_until]))

    async def due_at(self, trajectory_id: str, timer_id: str) -> float | None:
        """When the timer is due (or leased until), None when it is not stored."""
        with redis_errors(self._url, "reading a timer"):
            score = await self._client.zscore(self._key, timer_member(trajectory_id, timer_id))
        return None if score is None else float(score)

    async def count(self) -> int:
        with redis_errors(self._url, "counting timers"):
            return int(await self._client.zcard(self._key))

    async def close(self) -> None:
        if self._owns:
            await self._client.aclose()
