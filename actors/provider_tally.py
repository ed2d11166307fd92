"""What each trajectory's model adapter saw of its provider, counted in Redis for the run report.

``RedisProviderTally`` is an ``actors.model_outcomes.CallObserver``: the adapter tells it how every call ended
(HTTP status, outcome, the header that carried a retry hint, whether usage was estimated) and it adds that
to the hash ``tether:provider:<trajectory id>`` (``HINCRBY``), off the call's path: observations are counted
in memory and one writer task flushes them, so a burst of calls is one write and a slow Redis never holds
up a model call. Like the status snapshot this is a view, not the record: a lost flush loses counts, never
a call. ``read_provider_tallies`` sums the hashes of a run's trajectories per provider.

Fields: ``provider`` (the adapter's scope, e.g. the base URL), ``requests``, ``status:<code>`` (``none``: no
HTTP answer), ``outcome:<reply|rate_limited|failed|cancelled>``, ``hint:<header>``, ``usage_estimated``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

import redis.asyncio as aioredis

from actors.model_outcomes import CallObserved
from runtime.memstore import check_trajectory_id

__all__ = [
    "TALLY_KEY_PREFIX",
    "RedisProviderTally",
    "fields_of",
    "read_provider_tallies",
    "summed",
    "tally_key",
]

TALLY_KEY_PREFIX = "tether:provider:"
_log = logging.getLogger(__name__)


def tally_key(trajectory_id: str) -> str:
    """The Redis hash holding what one trajectory's adapter saw of its provider."""
    return TALLY_KEY_PREFIX + check_trajectory_id(trajectory_id)


def fields_of(call: CallObserved) -> list[str]:
    """The counters one observed call adds 1 to."""
    fields = [
        "requests",
        f"status:{call.status if call.status is not None else 'none'}",
        f"outcome:{call.outcome}",
    ]
    if call.hint_source:
        fields.append(f"hint:{call.hint_source}")
    if call.usage_estimated:
        fields.append("usage_estimated")
    return fields


class RedisProviderTally:
    """A ``CallObserver`` that adds every call to its trajectory's tally hash (see the module docstring).

    ``observe`` must be called on a running event loop (the adapter's); it never blocks or raises.
    """

    def __init__(self, client: aioredis.Redis) -> None:
        self._client = client
        self._pending: dict[str, Counter[str]] = {}
        self._providers: dict[str, str] = {}
        self._writer: asyncio.Task[None] | None = None

    @classmethod
    def from_url(cls, redis_url: str) -> RedisProviderTally:
        return cls(aioredis.Redis.from_url(redis_url, socket_timeout=10.0))

    def observe(self, call: CallObserved) -> None:
        counts = self._pending.setdefault(call.trajectory_id, Counter())
        counts.update(fields_of(call))
        self._providers[call.trajectory_id] = call.provider
        if self._writer is None or self._writer.done():
            self._writer = asyncio.get_running_loop().create_task(self._flush_soon())

    async def _flush_soon(self) -> None:
        await asyncio.sleep(0)  # let the rest of a burst be counted first
        await self.flush()

    async def flush(self) -> None:
        """Write what was counted so far (a failed write is logged; its counts are dropped)."""
        pending, self._pending = self._pending, {}
        if not pending:
            return
        try:
            pipe = self._client.pipeline(transaction=False)
            for trajectory_id, counts in pending.items():
                key = tally_key(trajectory_id)
                pipe.hset(key, "provider", self._providers[trajectory_id])
                for name, amount in counts.items():
                    pipe.hincrby(key, name, amount)
            await pipe.execute()
        except Exception:
            _log.warning(
                "provider tally not written (a view; the calls themselves are unaffected)", exc_info=True
            )

    async def drain(self) -> None:
        """Return once everything counted so far is written (or its write has failed and been logged)."""
        if self._writer is not None:
            with contextlib.suppress(Exception):
                await self._writer
        await self.flush()

    async def aclose(self) -> None:
        """Flush what is left and close the connection."""
        await self.drain()
        await self._client.aclose()


async def read_provider_tallies(
    client: aioredis.Redis, trajectory_ids: Iterable[str]
) -> dict[str, dict[str, Any]]:
    """The tallies of ``trajectory_ids`` summed per provider, as the run report shows them::

    {"http://gateway/v1": {"requests": 13, "responses": {"200": 10, "429": 2, "none": 1},
                           "outcomes": {"reply": 10, "rate_limited": 2, "failed": 1},
                           "retry_hints": {"llm_provider-retry-after": 2}, "usage_estimated": 0}}
    """
    ids = list(trajectory_ids)
    pipe = client.pipeline(transaction=False)
    for trajectory_id in ids:
        pipe.hgetall(tally_key(trajectory_id))
    out: dict[str, dict[str, Any]] = {}
    for raw in await pipe.execute():
        fields = {_text(k): _text(v) for k, v in raw.items()}
        if not fields:
            continue
        seen = out.setdefault(
            fields.get("provider", "unknown"),
            {"requests": 0, "responses": {}, "outcomes": {}, "retry_hints": {}, "usage_estimated": 0},
        )
        for name, value in fields.items():
            if name == "provider":
                continue
            _add(seen, name, int(value))
    return out


def _add(seen: dict[str, Any], name: str, amount: int) -> None:
    group, _, label = name.partition(":")
    if not label:
        seen[group] = seen.get(group, 0) + amount
        return
    bucket: dict[str, int] = seen[
        {"status": "responses", "outcome": "outcomes", "hint": "retry_hints"}[group]
    ]
    bucket[label] = bucket.get(label, 0) + amount


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def summed(tallies: Mapping[str, Mapping[str, Any]], field: str) -> int:
    """One counter summed over providers (``requests``, or ``outcomes.rate_limited`` as ``rate_limited``)."""
    if field == "rate_limited":
        return sum(int(t["outcomes"].get("rate_limited", 0)) for t in tallies.values())
    return sum(int(t.get(field, 0)) for t in tallies.values())
