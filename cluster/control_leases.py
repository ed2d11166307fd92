"""Which relay reads which control partition: relay membership and partition leases in Redis.

Each control partition (``tether:control:<n>``, see ``cluster.control``) is read by at most one relay at a
time, so one trajectory's messages are delivered in the order they were published even with many relays
(issue 16: two messages sent within milliseconds used to land on two relays and race).

- **Membership.** Every relay beats into the sorted set ``tether:relays`` (member: its name, score: when
  the beat lapses, on the Redis server's clock). ``beat`` returns the relays whose beat has not lapsed.
- **Leases.** ``tether:control:lease:<n>`` holds the name of the relay reading partition ``n``, with a TTL.
  ``hold`` renews the leases a relay has and takes free ones it asks for, in one script; ``release`` gives
  leases back (only the holder's). A relay that dies or stops beating loses its leases when they lapse and
  another takes its partitions over, pending entries first (``XAUTOCLAIM``), then new ones.

Both use the server's clock (``TIME`` inside the scripts), so relays on nodes whose clocks disagree still
agree on who is alive.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import redis.asyncio as aioredis

from cluster.control import CONTROL_STREAM
from cluster.embedded import redis_errors

__all__ = ["MEMBERS_KEY", "PartitionLeases", "lease_key"]

MEMBERS_KEY = "tether:relays"

# KEYS[1] members zset; ARGV: name, ttl_ms. Beat, forget lapsed members, return the live ones.
_BEAT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
return redis.call('ZRANGE', KEYS[1], 0, -1)
"""

# KEYS: lease keys; ARGV: owner, ttl_ms. Renew ours, take free ones; return the 1-based indices now ours.
_HOLD = """
local held = {}
for i, key in ipairs(KEYS) do
  local holder = redis.call('GET', key)
  if holder == ARGV[1] then
    redis.call('PEXPIRE', key, ARGV[2])
    table.insert(held, i)
  elseif not holder then
    redis.call('SET', key, ARGV[1], 'PX', ARGV[2])
    table.insert(held, i)
  end
end
return held
"""

# KEYS: lease keys; ARGV: owner. Delete the ones this owner holds.
_RELEASE = """
local n = 0
for _, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[1] then
    n = n + redis.call('DEL', key)
  end
end
return n
"""


def lease_key(partition: int, prefix: str = CONTROL_STREAM) -> str:
    """The lease of one partition: ``tether:control:lease:<n>``."""
    return f"{prefix}:lease:{partition}"


class PartitionLeases:
    """Relay membership and partition leases over one Redis client (the caller owns the client)."""

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        url: str = "redis",
        prefix: str = CONTROL_STREAM,
        members_key: str = MEMBERS_KEY,
    ) -> None:
        self._client = client
        self._url = url
        self._prefix = prefix
        self._members = members_key
        self._beat: Any = client.register_script(_BEAT)
        self._hold: Any = client.register_script(_HOLD)
        self._release: Any = client.register_script(_RELEASE)

    async def beat(self, name: str, ttl_ms: int) -> list[str]:
        """Announce ``name`` alive for ``ttl_ms``; returns every live relay (sorted, ``name`` included)."""
        with redis_errors(self._url, f"beating as relay {name!r}"):
            live = await self._beat(keys=[self._members], args=[name, int(ttl_ms)])
        return sorted(_text(m) for m in live)

    async def hold(self, name: str, partitions: Sequence[int], ttl_ms: int) -> set[int]:
        """Renew ``name``'s leases among ``partitions`` and take the free ones; returns those it holds."""
        if not partitions:
            return set()
        keys = [lease_key(p, self._prefix) for p in partitions]
        with redis_errors(self._url, f"holding control partition leases as {name!r}"):
            held = await self._hold(keys=keys, args=[name, int(ttl_ms)])
        return {partitions[int(i) - 1] for i in held}

    async def release(self, name: str, partitions: Iterable[int]) -> int:
        """Give back ``name``'s leases among ``partitions`` (others' are left alone)."""
        keys = [lease_key(p, self._prefix) for p in partitions]
        if not keys:
            return 0
        with redis_errors(self._url, f"releasing control partition leases of {name!r}"):
            return int(await self._release(keys=keys, args=[name]))

    async def holders(self, partitions: Sequence[int]) -> dict[int, str | None]:
        """Who holds each partition now (None: nobody)."""
        keys = [lease_key(p, self._prefix) for p in partitions]
        with redis_errors(self._url, "reading control partition leases"):
            values = await self._client.mget(keys) if keys else []
        return {p: (_text(v) if v is not None else None) for p, v in zip(partitions, values, strict=True)}


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
