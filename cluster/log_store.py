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

Riding out an outage. An unreachable Redis (refused or dropped connections, timeouts, a server still
loading its AOF after a restart) is a wait, not a failure: every operation is retried with full-jitter
backoff for the *outage budget* (``outage_s``; default ``TETHER_REDIS_OUTAGE_S`` or 180 s), then fails
with a ``DependencyError`` that says how long Redis was unreachable. Errors Redis *answered* (a wrong
password, a foreign key) are not waited on.

Nothing is appended twice. A write whose reply is lost (the server applied it, the connection died
before the answer) must not be re-sent blindly, or the log would hold the batch twice. Each batch
carries a batch id, stored in every entry it writes (field ``b``), and is written by one Lua script
that first looks for that batch id among the stream's newest entries: a retry of a batch that already
landed returns the ids it got the first time instead of appending again. The script runs atomically,
so a batch is in the log whole or not at all.

Compaction. A hibernating trajectory appends its record as one snapshot entry (an opaque payload like any
other: ``runtime.snapshot``) and then calls ``trim(id)``, ``XTRIM MINID`` exactly at the snapshot's id, so
only entries the snapshot covers are removed. Readers fold the newest snapshot plus the entries after it
(``runtime.snapshot.fold_entries``); a trim that never ran leaves a longer log that folds the same.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Self, TypeVar, cast

import redis.asyncio as aioredis
import redis.exceptions

from cluster.embedded import redact_url, redis_errors
from runtime.errors import DependencyError, InputError
from runtime.memstore import LOG_KEY_PREFIX, check_trajectory_id, parse_entry_id

__all__ = [
    "BATCH_FIELD",
    "DEFAULT_OUTAGE_S",
    "FIELD",
    "OUTAGE_ENV",
    "Durability",
    "RedisLogStore",
    "log_key",
    "outage_budget_from_env",
]

FIELD = b"e"  # the encoded event of every log entry
BATCH_FIELD = b"b"  # the id of the batch that wrote the entry (what makes a retried append idempotent)
OUTAGE_ENV = "TETHER_REDIS_OUTAGE_S"
DEFAULT_OUTAGE_S = 180.0
_READ_BATCH = 1000  # XRANGE page size: bounded replies even for long logs
# A retried batch is looked for among the log's newest entries: its own size plus this margin (one writer
# per trajectory, so a batch that landed is the newest one unless a successor incarnation wrote after it).
_LOOKBACK = 32
_FIRST_BACKOFF_S = 0.05
_MAX_BACKOFF_S = 2.0
_Entries = list[tuple[bytes, dict[bytes, bytes]]]
_T = TypeVar("_T")
_log = logging.getLogger(__name__)

# KEYS[1] the log; ARGV[1] the batch id, ARGV[2] how many newest entries to look through (0 on a first
# attempt: no earlier attempt can have landed), ARGV[3..] the payloads.
# Returns {1, ids} when the batch is already in the log, {0, ids} when this call appended it.
_APPEND_ONCE = """
local found = {}
local lookback = tonumber(ARGV[2])
if lookback > 0 then
  local recent = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', lookback)
  for _, entry in ipairs(recent) do
    local fields = entry[2]
    for i = 1, #fields, 2 do
      if fields[i] == 'b' and fields[i + 1] == ARGV[1] then
        table.insert(found, 1, entry[1])
      end
    end
  end
end
if #found > 0 then
  return {1, found}
end
local ids = {}
for i = 3, #ARGV do
  ids[#ids + 1] = redis.call('XADD', KEYS[1], '*', 'e', ARGV[i], 'b', ARGV[1])
end
return {0, ids}
"""


def outage_budget_from_env() -> float:
    """``TETHER_REDIS_OUTAGE_S`` (seconds a store keeps retrying an unreachable Redis), or the default."""
    raw = os.environ.get(OUTAGE_ENV)
    if not raw:
        return DEFAULT_OUTAGE_S
    try:
        value = float(raw)
    except ValueError as e:
        raise InputError(f"must be a number of seconds, not {raw!r}", where=OUTAGE_ENV) from e
    if value < 0:
        raise InputError(f"must be >= 0, not {value}", where=OUTAGE_ENV)
    return value


def _unreachable(error: DependencyError) -> bool:
    """Whether ``error`` (from ``redis_errors``) means Redis could not be reached or did not answer."""
    cause = error.__cause__
    return not error.non_retryable and isinstance(
        cause, redis.exceptions.ConnectionError | redis.exceptions.TimeoutError | OSError
    )


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
        outage_s: float | None = None,
    ) -> None:
        if min_replicas < 0:
            raise ValueError(f"min_replicas must be >= 0, got {min_replicas}")
        self._client = client
        self._url = url
        self._min_replicas = min_replicas
        self._replica_timeout_ms = replica_timeout_ms
        self._owns_client = owns_client
        self.outage_s = outage_budget_from_env() if outage_s is None else outage_s
        if self.outage_s < 0:
            raise ValueError(f"outage_s must be >= 0, got {self.outage_s}")
        self._append_once = client.register_script(_APPEND_ONCE)

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        min_replicas: int = 0,
        socket_timeout: float = 10.0,
        outage_s: float | None = None,
    ) -> Self:
        """A store with its own connection pool to ``url`` (password in the URL: ``redis://:pw@h:p/0``);
        ``outage_s``: how long to wait out an unreachable Redis (``None``: ``TETHER_REDIS_OUTAGE_S``)."""
        client = aioredis.Redis.from_url(
            url, socket_timeout=socket_timeout, socket_connect_timeout=socket_timeout
        )
        return cls(client, url=url, min_replicas=min_replicas, owns_client=True, outage_s=outage_s)

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
        [entry_id] = await self.append_many(trajectory_id, [payload])
        return entry_id

    async def append_many(self, trajectory_id: str, payloads: Sequence[bytes]) -> list[str]:
        """Append ``payloads`` in order as one batch: all or none, written once however often it is retried,
        acknowledged (and, with ``appendfsync always``, fsynced) once for the whole batch."""
        key = log_key(trajectory_id)
        for i, payload in enumerate(payloads):
            if not isinstance(payload, bytes | bytearray | memoryview):
                raise InputError(
                    f"log payload must be bytes, got {type(payload).__name__}", where=f"payloads[{i}]"
                )
        if not payloads:
            return []
        batch = uuid.uuid4().hex  # one id for every retry of this batch
        blobs = [bytes(p) for p in payloads]
        doing = f"appending {len(blobs)} entr{'y' if len(blobs) == 1 else 'ies'} to {key}"
        attempts = 0

        async def attempt() -> list[str]:
            nonlocal attempts
            attempts += 1
            lookback = 0 if attempts == 1 else len(blobs) + _LOOKBACK
            return await self._append_batch(key, batch, blobs, lookback)

        ids = await self._ride_out(doing, attempt)
        if self._min_replicas:
            with redis_errors(self._url, doing):
                acked = await self._client.wait(self._min_replicas, self._replica_timeout_ms)
            if acked < self._min_replicas:
                # The batch is on the primary but not as replicated as asked: report failure so the
                # caller does not perform the effect this intent announces.
                raise DependencyError(
                    f"{doing}: only {acked} of {self._min_replicas} replicas acknowledged "
                    f"within {self._replica_timeout_ms} ms",
                    scope="redis",
                )
        return ids

    async def _append_batch(self, key: str, batch: str, payloads: list[bytes], lookback: int) -> list[str]:
        """One attempt at writing the batch (the Lua script: append unless the batch id is among the
        ``lookback`` newest entries already)."""
        with redis_errors(self._url, f"appending to {key}"):
            found, ids = await self._append_once(keys=[key], args=[batch, lookback, *payloads])
        if found:
            _log.info("%s: batch %s was already appended (its reply had been lost)", key, batch)
        if len(ids) != len(payloads):
            raise DependencyError(
                f"{key}: batch {batch} holds {len(ids)} entries, expected {len(payloads)}",
                scope="redis",
                non_retryable=True,
            )
        return [_text(entry_id) for entry_id in ids]

    async def _ride_out(self, doing: str, attempt: Callable[[], Awaitable[_T]]) -> _T:
        """Run ``attempt`` until it succeeds, retrying while Redis is unreachable for up to ``outage_s``
        (full-jitter exponential backoff); then a ``DependencyError`` naming the outage."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        backoff = _FIRST_BACKOFF_S
        while True:
            try:
                return await attempt()
            except DependencyError as e:
                if not _unreachable(e):
                    raise
                waited = loop.time() - started
                left = self.outage_s - waited
                if left <= 0:
                    raise DependencyError(
                        f"{doing}: Redis at {self.url} unreachable for {waited:.1f}s, beyond the outage "
                        f"budget of {self.outage_s:g}s ({OUTAGE_ENV}); last error: {e}",
                        scope="redis",
                    ) from e
                if waited == 0 or backoff == _FIRST_BACKOFF_S:
                    _log.warning("%s: Redis unreachable, waiting up to %.0fs: %s", doing, left, e)
                await asyncio.sleep(min(left, random.uniform(0, backoff)))
                backoff = min(_MAX_BACKOFF_S, backoff * 2)

    async def read(self, trajectory_id: str, after: str | None = None) -> list[tuple[str, bytes]]:
        """Every entry with an id greater than ``after`` (from the start when ``None``), in order."""
        key = log_key(trajectory_id)
        if after is not None:
            parse_entry_id(after)  # same validation and error as the in-memory store
        return await self._ride_out(f"reading {key}", lambda: self._read(key, after))

    async def _read(self, key: str, after: str | None) -> list[tuple[str, bytes]]:
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

    async def trim(self, trajectory_id: str, before: str) -> int:
        """Remove every entry older than ``before`` (``XTRIM MINID``, exact: the entry itself stays);
        returns how many were removed. Only ever called behind a durable record snapshot at ``before``."""
        key = log_key(trajectory_id)
        parse_entry_id(before, where="before")

        async def once() -> int:
            with redis_errors(self._url, f"trimming {key}"):
                return int(await self._client.xtrim(key, minid=before, approximate=False))

        return await self._ride_out(f"trimming {key}", once)

    async def exists(self, trajectory_id: str) -> bool:
        """Whether the trajectory has a log (a stream with at least one entry)."""
        key = log_key(trajectory_id)

        async def once() -> bool:
            with redis_errors(self._url, f"checking {key}"):
                return bool(await self._client.exists(key))

        return await self._ride_out(f"checking {key}", once)

    async def list_trajectories(self) -> list[str]:
        """Ids of every trajectory with a log, sorted (``SCAN``: does not block the server)."""

        async def once() -> list[str]:
            found: set[str] = set()
            with redis_errors(self._url, "listing trajectory logs"):
                async for key in self._client.scan_iter(
                    match=f"{LOG_KEY_PREFIX}*", count=500, _type="STREAM"
                ):
                    found.add(_text(key)[len(LOG_KEY_PREFIX) :])
            return sorted(found)

        return await self._ride_out("listing trajectory logs", once)

    async def durability(self) -> Durability:
        """What the server does with an acknowledged write (AOF on? fsync policy?)."""

        async def once() -> dict[Any, Any] | None:
            with redis_errors(self._url, "reading the persistence settings"):
                try:
                    return cast(dict[Any, Any], await self._client.config_get("append*"))
                except redis.exceptions.ResponseError:  # managed Redis often disables CONFIG
                    return None

        conf = await self._ride_out("reading the persistence settings", once)
        if conf is None:
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
