"""The durable per-trajectory log on Redis streams (ARCHITECTURE.md, "Durability and recovery contract").

Each trajectory has one append-only stream ``tether:log:<trajectory_id>``; each entry holds one
msgpack-encoded event as opaque bytes in the field ``e``. The store never decodes events: folding them
is ``runtime/``'s business.

When is an append durable? ``append`` returns after Redis replied to ``XADD``. With the AOF policy
Tether's own server uses (``appendonly yes``, ``appendfsync always``; see ``cluster.redis_server``),
Redis writes *and fsyncs* the AOF before it sends the reply, so an acknowledged intent survives a crash
of the Redis process or the machine. Under ``everysec`` up to about a second of acknowledged entries can
be lost on a machine crash (``benchmarks/log_append.py`` measures what ``always`` costs). A replicated
deployment can additionally require ``min_replicas`` replicas to have the entry (``WAIT``) before
``append`` returns; ``durability()`` reports what the server is configured to do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Self, cast

import redis.asyncio as aioredis
import redis.exceptions

from cluster.embedded import redact_url, redis_errors
from runtime.errors import DependencyError, InputError
from runtime.memstore import LOG_KEY_PREFIX, check_trajectory_id, parse_entry_id

__all__ = ["FIELD", "Durability", "RedisLogStore", "log_key"]

FIELD = b"e"  # the one field of every log entry: the encoded event
_READ_BATCH = 1000  # XRANGE page size: bounded replies even for long logs
_Entries = list[tuple[bytes, dict[bytes, bytes]]]


def log_key(trajectory_id: str) -> str:
    """The Redis key of a trajectory's log."""
    return LOG_KEY_PREFIX + check_trajectory_id(trajectory_id)


@dataclass(frozen=True, slots=True)
class Durability:
    """The server's persistence settings as it reports them (``None`` where CONFIG is not allowed)."""

    appendonly: bool | None
    appendfsync: str | None

    @property
    def fsync_per_write(self) -> bool:
        """True when every acknowledged write is on disk before the reply."""
        return bool(self.appendonly) and self.appendfsync == "always"


class RedisLogStore:
    """``runtime.ports.LogStore`` over redis.asyncio streams.

    Construct with ``RedisLogStore.from_url(url)``, or pass a client you own (then you close it).
    """

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        url: str = "redis",
        min_replicas: int = 0,
        replica_timeout_ms: int = 1000,
        owns_client: bool = False,
    ) -> None:
        if min_replicas < 0:
            raise ValueError(f"min_replicas must be >= 0, got {min_replicas}")
        self._client = client
        self._url = url
        self._min_replicas = min_replicas
        self._replica_timeout_ms = replica_timeout_ms
        self._owns_client = owns_client

    @classmethod
    def from_url(cls, url: str, *, min_replicas: int = 0, socket_timeout: float = 10.0) -> Self:
        """A store with its own connection pool to ``url`` (password in the URL: ``redis://:pw@h:p/0``)."""
        client = aioredis.Redis.from_url(
            url, socket_timeout=socket_timeout, socket_connect_timeout=socket_timeout
        )
        return cls(client, url=url, min_replicas=min_replicas, owns_client=True)

    @property
    def url(self) -> str:
        """The server's URL without its password."""
        return redact_url(self._url)

    async def close(self) -> None:
        """Close the connection pool if this store created it."""
        if self._owns_client:
            await self._client.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def append(self, trajectory_id: str, payload: bytes) -> str:
        """Append ``payload``; returns the entry id once Redis acknowledged it (and fsynced, see module)."""
        key = log_key(trajectory_id)
        if not isinstance(payload, bytes | bytearray | memoryview):
            raise InputError(f"log payload must be bytes, got {type(payload).__name__}", where="payload")
        with redis_errors(self._url, f"appending to {key}"):
            entry_id = await self._client.xadd(key, {FIELD: bytes(payload)})
            if self._min_replicas:
                acked = await self._client.wait(self._min_replicas, self._replica_timeout_ms)
                if acked < self._min_replicas:
                    # The entry is on the primary but not as replicated as asked: report failure so the
                    # caller does not perform the effect this intent announces.
                    raise DependencyError(
                        f"appending to {key}: only {acked} of {self._min_replicas} replicas acknowledged "
                        f"entry {_text(entry_id)} within {self._replica_timeout_ms} ms",
                        scope="redis",
                    )
        return _text(entry_id)

    async def append_many(self, trajectory_id: str, payloads: Sequence[bytes]) -> list[str]:
        """Append ``payloads`` in order as one MULTI/EXEC transaction: all or none, acknowledged (and,
        with ``appendfsync always``, fsynced) once for the whole batch."""
        key = log_key(trajectory_id)
        for i, payload in enumerate(payloads):
            if not isinstance(payload, bytes | bytearray | memoryview):
                raise InputError(
                    f"log payload must be bytes, got {type(payload).__name__}", where=f"payloads[{i}]"
                )
        if not payloads:
            return []
        if len(payloads) == 1:
            return [await self.append(trajectory_id, payloads[0])]
        with redis_errors(self._url, f"appending {len(payloads)} entries to {key}"):
            async with self._client.pipeline(transaction=True) as pipe:
                for payload in payloads:
                    pipe.xadd(key, {FIELD: bytes(payload)})
                ids = await pipe.execute()
            if self._min_replicas:
                acked = await self._client.wait(self._min_replicas, self._replica_timeout_ms)
                if acked < self._min_replicas:
                    raise DependencyError(
                        f"appending to {key}: only {acked} of {self._min_replicas} replicas acknowledged "
                        f"a batch of {len(payloads)} within {self._replica_timeout_ms} ms",
                        scope="redis",
                    )
        return [_text(entry_id) for entry_id in ids]

    async def read(self, trajectory_id: str, after: str | None = None) -> list[tuple[str, bytes]]:
        """Every entry with an id greater than ``after`` (from the start when ``None``), in order."""
        key = log_key(trajectory_id)
        if after is not None:
            parse_entry_id(after)  # same validation and error as the in-memory store
        start = "-" if after is None else f"({after}"
        out: list[tuple[str, bytes]] = []
        with redis_errors(self._url, f"reading {key}"):
            while True:
                page = cast(_Entries, await self._client.xrange(key, min=start, max="+", count=_READ_BATCH))
                for entry_id, fields in page:
                    out.append((_text(entry_id), _payload(key, entry_id, fields)))
                if len(page) < _READ_BATCH:
                    return out
                start = f"({_text(page[-1][0])}"

    async def exists(self, trajectory_id: str) -> bool:
        """Whether the trajectory has a log (a stream with at least one entry)."""
        key = log_key(trajectory_id)
        with redis_errors(self._url, f"checking {key}"):
            return bool(await self._client.exists(key))

    async def list_trajectories(self) -> list[str]:
        """Ids of every trajectory with a log, sorted (``SCAN``: does not block the server)."""
        found: set[str] = set()
        with redis_errors(self._url, "listing trajectory logs"):
            async for key in self._client.scan_iter(match=f"{LOG_KEY_PREFIX}*", count=500, _type="STREAM"):
                found.add(_text(key)[len(LOG_KEY_PREFIX) :])
        return sorted(found)

    async def durability(self) -> Durability:
        """What the server does with an acknowledged write (AOF on? fsync policy?)."""
        with redis_errors(self._url, "reading the persistence settings"):
            try:
                conf: dict[Any, Any] = await self._client.config_get("append*")
            except redis.exceptions.ResponseError:  # managed Redis often disables CONFIG
                return Durability(appendonly=None, appendfsync=None)
        values = {_text(k): _text(v) for k, v in conf.items()}
        appendonly = values.get("appendonly")
        return Durability(
            appendonly=None if appendonly is None else appendonly == "yes",
            appendfsync=values.get("appendfsync"),
        )


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _payload(key: str, entry_id: bytes | str, fields: dict[Any, Any]) -> bytes:
    """The event bytes of one entry; an entry without the field was not written by Tether."""
    value = fields.get(FIELD, fields.get(FIELD.decode()))
    if value is None:
        raise DependencyError(
            f"{key} entry {_text(entry_id)} has no {FIELD.decode()!r} field: the key holds foreign data",
            scope="redis",
            non_retryable=True,
        )
    return value if isinstance(value, bytes) else str(value).encode()
