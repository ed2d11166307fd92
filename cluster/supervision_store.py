"""Where supervision's records live across the cluster: the escalation registry, the incident store and the
quarantine, in Redis (issue 12).

The per-trajectory log is the authority for what a trajectory decided (an escalation it opened, an
incident its disclosure rule opened); these are the cross-trajectory views operators act on, written by the
trajectory actors' interpreters (``actors.ports.SupervisionStore``) and by the ``tether incident`` /
``tether escalations`` commands:

- ``tether:escalation:<id>``  the escalation document (JSON: trigger, owner, SLA due time, evidence,
  handoff packet, status, custodian); ``tether:escalations`` a sorted set of ids by opening time;
- ``tether:incident:<id>``    the incident document (JSON: symptom and suspected cause apart, members with
  their metadata, restrictions in issue order with their state, artifacts, capture omissions, releases);
  ``tether:incidents`` a sorted set of ids by opening time;
- ``tether:quarantine``       a hash artifact id -> the incident that quarantined it. A tool call whose
  arguments name a quarantined artifact is refused at the dispatch boundary (``actors.quarantine``).

Incident documents are read-modify-written under ``WATCH`` so concurrent writers (an interpreter adding a
member, the CLI recording a release) never lose each other's update; an incident document is never
deleted (no restriction may destroy the incident record, §12.8.1).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, cast

import redis.asyncio as aioredis
import redis.exceptions

from cluster.embedded import redis_errors

__all__ = [
    "ESCALATIONS_INDEX",
    "INCIDENTS_INDEX",
    "QUARANTINE_KEY",
    "RedisSupervisionStore",
    "escalation_key",
    "incident_key",
]

ESCALATIONS_INDEX = "tether:escalations"
INCIDENTS_INDEX = "tether:incidents"
QUARANTINE_KEY = "tether:quarantine"


def escalation_key(escalation_id: str) -> str:
    return f"tether:escalation:{escalation_id}"


def incident_key(incident_id: str) -> str:
    return f"tether:incident:{incident_id}"


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class RedisSupervisionStore:
    """The escalation registry, the incident store and the quarantine over one Redis client."""

    def __init__(self, client: aioredis.Redis, *, url: str = "redis", owns_client: bool = False) -> None:
        self._client = client
        self._url = url
        self._owns = owns_client

    @classmethod
    def from_url(cls, url: str) -> RedisSupervisionStore:
        client = aioredis.Redis.from_url(url, socket_timeout=10.0, socket_connect_timeout=5.0)
        return cls(client, url=url, owns_client=True)

    async def close(self) -> None:
        if self._owns:
            await self._client.aclose()

    # ------------------------------------------------------------------ escalations

    async def publish_escalation(self, escalation: Mapping[str, Any]) -> None:
        """Write (or update) one escalation document; the newest state wins."""
        escalation_id = str(escalation["escalation_id"])
        with redis_errors(self._url, f"publishing escalation {escalation_id}"):
            pipe = self._client.pipeline(transaction=True)
            pipe.set(escalation_key(escalation_id), json.dumps(dict(escalation), sort_keys=True))
            pipe.zadd(ESCALATIONS_INDEX, {escalation_id: float(escalation.get("opened_at") or 0.0)})
            await pipe.execute()

    async def escalation(self, escalation_id: str) -> dict[str, Any] | None:
        with redis_errors(self._url, f"reading escalation {escalation_id}"):
            raw = await self._client.get(escalation_key(escalation_id))
        return cast(dict[str, Any], json.loads(raw)) if raw else None

    async def escalations(self) -> list[dict[str, Any]]:
        """Every escalation in the registry, oldest first."""
        with redis_errors(self._url, "listing escalations"):
            ids = [_text(i) for i in cast(list[bytes], await self._client.zrange(ESCALATIONS_INDEX, 0, -1))]
            raws = await self._client.mget([escalation_key(i) for i in ids]) if ids else []
        return [cast(dict[str, Any], json.loads(r)) for r in raws if r]

    # ------------------------------------------------------------------ incidents

    async def incident(self, incident_id: str) -> dict[str, Any] | None:
        with redis_errors(self._url, f"reading incident {incident_id}"):
            raw = await self._client.get(incident_key(incident_id))
        return cast(dict[str, Any], json.loads(raw)) if raw else None

    async def incidents(self) -> list[dict[str, Any]]:
        """Every incident, oldest first."""
        with redis_errors(self._url, "listing incidents"):
            ids = [_text(i) for i in cast(list[bytes], await self._client.zrange(INCIDENTS_INDEX, 0, -1))]
            raws = await self._client.mget([incident_key(i) for i in ids]) if ids else []
        return [cast(dict[str, Any], json.loads(r)) for r in raws if r]

    async def update_incident(
        self, incident_id: str, change: Callable[[dict[str, Any] | None], dict[str, Any]]
    ) -> dict[str, Any]:
        """Read-modify-write one incident document atomically (retried on a concurrent write)."""
        key = incident_key(incident_id)
        with redis_errors(self._url, f"updating incident {incident_id}"):
            for _ in range(50):
                async with self._client.pipeline(transaction=True) as pipe:
                    try:
                        await pipe.watch(key)
                        raw = await pipe.get(key)
                        current = cast(dict[str, Any], json.loads(raw)) if raw else None
                        doc = change(current)
                        pipe.multi()  # type: ignore[no-untyped-call]
                        pipe.set(key, json.dumps(doc, sort_keys=True))
                        pipe.zadd(INCIDENTS_INDEX, {incident_id: float(doc.get("opened_at") or 0.0)})
                        await pipe.execute()
                        return doc
                    except redis.exceptions.WatchError:
                        continue
        raise RuntimeError(f"incident {incident_id} kept changing under 50 concurrent writes")

    async def open_incident(self, incident: Mapping[str, Any], artifacts: Sequence[str]) -> None:
        """Record an incident a trajectory opened itself (or add it as a member of an existing one), and
        quarantine what it produced."""
        incident_id = str(incident["incident_id"])

        def merge(current: dict[str, Any] | None) -> dict[str, Any]:
            doc = dict(current) if current is not None else dict(incident)
            members = dict(doc.get("members") or {})
            members.update(dict(incident.get("members") or {}))
            doc["members"] = members
            doc["artifacts"] = sorted({*doc.get("artifacts", []), *artifacts})
            return doc

        await self.update_incident(incident_id, merge)
        await self.quarantine(artifacts, incident_id)

    # ------------------------------------------------------------------ quarantine

    async def quarantine(self, artifacts: Iterable[str], incident_id: str) -> int:
        """Quarantine ``artifacts`` for ``incident_id`` (one already held keeps its first incident)."""
        items = sorted(set(artifacts))
        if not items:
            return 0
        with redis_errors(self._url, f"quarantining artifacts of {incident_id}"):
            pipe = self._client.pipeline(transaction=True)
            for artifact in items:
                pipe.hsetnx(QUARANTINE_KEY, artifact, incident_id)
            added = await pipe.execute()
        return sum(1 for a in added if a)

    async def release(self, artifacts: Iterable[str], incident_id: str) -> list[str]:
        """Release the artifacts ``incident_id`` quarantined (never another incident's); the released ones."""
        items = sorted(set(artifacts))
        if not items:
            return []
        with redis_errors(self._url, f"releasing artifacts of {incident_id}"):
            held = await self._client.hmget(QUARANTINE_KEY, items)
            mine = [
                a for a, by in zip(items, held, strict=True) if by is not None and _text(by) == incident_id
            ]
            if mine:
                await self._client.hdel(QUARANTINE_KEY, *mine)
        return mine

    async def quarantined(self, values: Sequence[str]) -> dict[str, str]:
        """The ``values`` that are quarantined artifacts, each with its incident."""
        candidates = sorted({v for v in values if v})
        if not candidates:
            return {}
        with redis_errors(self._url, "reading the quarantine"):
            held = await self._client.hmget(QUARANTINE_KEY, candidates)
        return {v: _text(by) for v, by in zip(candidates, held, strict=True) if by is not None}

    async def quarantine_size(self) -> int:
        with redis_errors(self._url, "counting the quarantine"):
            return int(await self._client.hlen(QUARANTINE_KEY))
