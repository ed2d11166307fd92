"""Control messages: the versioned wire schema, its msgpack codec, and the Redis stream transport.

Operators and policies append signed ``ControlMessage``s to ``tether:control:<n>``, the partition of the
message's trajectory (``partition_of``: CRC-32 of the id modulo ``CONTROL_PARTITIONS``); relays read the
partitions through one consumer group, each partition by one relay at a time (``cluster.control_leases``),
deliver to the trajectory actor, ``XACK`` once the actor has answered, and take over a dead relay's
partitions with their pending entries (``XAUTOCLAIM``) (ARCHITECTURE.md, "Control protocol"; issues 4 and
16). Delivery is at-least-once and, per trajectory, in publishing order: consumers dedupe by
``message_id``.

State changes go to ``tether:events`` (trimmed with ``MAXLEN ~``) for live views only: the per-trajectory
log, not this stream, is the audit record.

Signing and verification live in ``cluster.signing``; this module only carries bytes and validates shape.
"""

from __future__ import annotations

import secrets
import uuid
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any, Literal, Self, TypeVar, cast

import msgpack
import redis.asyncio as aioredis
import redis.exceptions
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    StringConstraints,
    ValidationError,
    model_validator,
)

from cluster.embedded import redact_url, redis_errors
from runtime.errors import CodecError
from runtime.memstore import parse_entry_id

__all__ = [
    "CONTROL_PARTITIONS",
    "CONTROL_STREAM",
    "EVENTS_STREAM",
    "SCHEMA_VERSION",
    "Claimed",
    "ControlAction",
    "ControlMessage",
    "ControlStream",
    "Delivery",
    "EntryProblem",
    "Identity",
    "LiveEvent",
    "decode_event",
    "decode_message",
    "encode_event",
    "encode_message",
    "partition_of",
    "partition_stream",
]

SCHEMA_VERSION: Literal[1] = 1
CONTROL_STREAM = "tether:control"  # partition n is the stream "tether:control:<n>"
CONTROL_PARTITIONS = 16
MAX_PARTITIONS = 1024
EVENTS_STREAM = "tether:events"
MAX_MESSAGE_BYTES = 64 * 1024  # a control message is a few hundred bytes; refuse to unpack giants
_FIELD = b"m"  # the one field of every stream entry: the encoded message or event
M = TypeVar("M", bound=BaseModel)
_Entries = list[tuple[bytes, dict[bytes, bytes] | None]]
_StreamsReply = list[tuple[bytes, _Entries]] | None  # RESP2 shape of XREAD / XREADGROUP

Identity = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$")]
TrajectoryId = Annotated[str, StringConstraints(pattern=r"^[!-~]{1,200}$")]  # as runtime.memstore
MessageId = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9._:-]{8,128}$")]
Nonce = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]{16,128}$")]
Signature = Annotated[bytes, Field(min_length=64, max_length=64)]  # Ed25519
EpochSeconds = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]


class ControlAction(StrEnum):
    """The requests a harness accepts from outside the loop (harness chapter, Table 6, plus approvals)."""

    PAUSE = "pause"
    RESUME = "resume"
    CANCEL = "cancel"
    INTERRUPT = "interrupt"
    KILL = "kill"
    APPROVE = "approve"
    DENY = "deny"
    SETTLE = "settle"
    HANDOFF = "handoff"
    # issue 12: holds (an incident's: payload ``incident_id``) and custody of escalations
    HOLD = "hold"
    RELEASE = "release"
    ACKNOWLEDGE = "acknowledge"  # payload ``escalation_id``


_DIGEST_ACTIONS = frozenset({ControlAction.APPROVE, ControlAction.DENY})


class ControlMessage(BaseModel):
    """One control request, as it travels on ``tether:control`` (schema version 1).

    ``payload`` is action-specific: approve/deny carry ``call_digest`` (the digest of the held call they
    decide); interrupt may carry ``message`` (the user message for the next turn; ``reason`` otherwise).
    ``signatures`` is a list of ``(identity, Ed25519 signature)`` pairs over ``signing_document()``, so
    a quorum approval is the same message signed by several identities.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: Literal[1] = SCHEMA_VERSION
    message_id: MessageId
    trajectory_id: TrajectoryId
    action: ControlAction
    issuer: Identity
    reason: Annotated[str, Field(max_length=2000)] = ""
    issued_at: EpochSeconds
    expires_at: EpochSeconds
    nonce: Nonce
    payload: dict[str, JsonValue] = Field(default_factory=dict)
    signatures: tuple[tuple[Identity, Signature], ...] = ()

    @model_validator(mode="after")
    def _check_consistency(self) -> Self:
        if self.expires_at <= self.issued_at:
            raise ValueError(f"expires_at ({self.expires_at}) must be after issued_at ({self.issued_at})")
        if self.action in _DIGEST_ACTIONS:
            digest = self.payload.get("call_digest")
            if not isinstance(digest, str) or not 1 <= len(digest) <= 256:
                raise ValueError(f"{self.action} needs payload.call_digest: the digest of the held call")
        if self.action is ControlAction.ACKNOWLEDGE:
            escalation = self.payload.get("escalation_id")
            if not isinstance(escalation, str) or not 1 <= len(escalation) <= 400:
                raise ValueError("acknowledge needs payload.escalation_id: the escalation taken into custody")
        message = self.payload.get("message")
        if message is not None and not isinstance(message, str):
            raise ValueError("payload.message, when present, must be a string")
        return self

    @classmethod
    def create(
        cls,
        trajectory_id: str,
        action: ControlAction | str,
        issuer: str,
        *,
        now: float,
        ttl_s: float = 300.0,
        reason: str = "",
        payload: dict[str, JsonValue] | None = None,
    ) -> ControlMessage:
        """A fresh unsigned message: new ``message_id`` and ``nonce``, valid from ``now`` for ``ttl_s``."""
        return cls(
            message_id=uuid.uuid4().hex,
            trajectory_id=trajectory_id,
            action=ControlAction(action),
            issuer=issuer,
            reason=reason,
            issued_at=now,
            expires_at=now + ttl_s,
            nonce=secrets.token_urlsafe(18),
            payload=payload or {},
        )

    @property
    def signers(self) -> tuple[str, ...]:
        """Identities that signed, in signing order."""
        return tuple(identity for identity, _ in self.signatures)

    def signing_document(self) -> dict[str, Any]:
        """Everything a signature covers: the message without ``signatures``, as plain msgpack-able values."""
        doc = self.model_dump(mode="python", exclude={"signatures"})
        doc["action"] = str(self.action)
        return doc


def encode_message(message: ControlMessage) -> bytes:
    """msgpack bytes of ``message`` (signatures as a list of ``[identity, signature]`` pairs)."""
    doc = message.signing_document()
    doc["signatures"] = [[identity, sig] for identity, sig in message.signatures]
    return _pack(doc, "control message")


def decode_message(data: bytes) -> ControlMessage:
    """Validate and decode; ``CodecError`` names the field that is wrong (``where``)."""
    doc = _unpack(data, "control message")
    version = doc.get("schema_version")
    if version != SCHEMA_VERSION:
        raise CodecError(
            f"unsupported schema version {version!r}; this build reads {SCHEMA_VERSION}",
            where="control message field 'schema_version'",
        )
    return _validate(ControlMessage, doc, "control message")


class LiveEvent(BaseModel):
    """A state change published on ``tether:events`` for live views (``tether watch``), never for audit.

    ``kind`` says what changed (e.g. ``state``, ``control_rejected``); ``data`` carries the view's columns.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    trajectory_id: TrajectoryId
    kind: Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9_.]{0,63}$")]
    at: EpochSeconds
    data: dict[str, JsonValue] = Field(default_factory=dict)


def encode_event(event: LiveEvent) -> bytes:
    return _pack(event.model_dump(mode="python"), "live event")


def decode_event(data: bytes) -> LiveEvent:
    return _validate(LiveEvent, _unpack(data, "live event"), "live event")


def _pack(doc: dict[str, Any], what: str) -> bytes:
    try:
        return cast(bytes, msgpack.packb(doc, use_bin_type=True))
    except (TypeError, ValueError, OverflowError) as e:
        raise CodecError(f"cannot encode: {e}", where=what) from e


def _unpack(data: bytes, what: str) -> dict[str, Any]:
    if not isinstance(data, bytes | bytearray):
        raise CodecError(f"expected bytes, got {type(data).__name__}", where=what)
    if len(data) > MAX_MESSAGE_BYTES:
        raise CodecError(f"{len(data)} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit", where=what)
    try:
        doc = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise CodecError(f"not valid msgpack: {e}", where=what) from e
    if not isinstance(doc, dict):
        raise CodecError(f"expected a map at the top level, got {type(doc).__name__}", where=what)
    return doc


def _validate(model: type[M], doc: dict[str, Any], what: str) -> M:
    try:
        return model.model_validate(doc)
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or "(message)"
        others = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
        raise CodecError(f"{first['msg']}{others}", where=f"{what} field {field!r}") from e


# --------------------------------------------------------------------------- transport


def partition_of(trajectory_id: str, partitions: int = CONTROL_PARTITIONS) -> int:
    """The partition carrying ``trajectory_id``'s control messages: CRC-32 of its UTF-8 id, modulo the
    partition count (stable across processes and languages, unlike ``hash``)."""
    return zlib.crc32(trajectory_id.encode()) % partitions


def partition_stream(partition: int, prefix: str = CONTROL_STREAM) -> str:
    """The Redis stream of one partition: ``tether:control:<n>``."""
    return f"{prefix}:{partition}"


class EntryProblem(StrEnum):
    """Why an entry read from a partition carries no message (each is an audit reason)."""

    MALFORMED = "MALFORMED"  # the message field does not decode (garbage, another schema version)
    MISSING_FIELD = "MISSING_FIELD"  # the entry has fields, but not the message field (a foreign writer)
    TRIMMED = "TRIMMED"  # a pending entry whose content Redis trimmed away before anyone delivered it


@dataclass(frozen=True, slots=True)
class Delivery:
    """One entry read from a control partition. Exactly one of ``message`` / ``error`` is set: an entry
    that does not decode is still delivered (with ``problem`` saying why) so the relay can audit and ack
    it instead of looping on it."""

    entry_id: str
    message: ControlMessage | None
    error: CodecError | None
    partition: int = 0
    problem: EntryProblem | None = None


@dataclass(frozen=True, slots=True)
class Claimed:
    """Result of one ``XAUTOCLAIM`` pass: entries now owned by the claimer, where to continue the scan
    (``"0-0"`` when it wrapped), and pending ids whose entries were trimmed away (Redis dropped them)."""

    deliveries: list[Delivery]
    next_start_id: str
    deleted_ids: list[str]


class ControlStream:
    """The partitioned control streams (publish, consumer group, ack, claim) and ``tether:events``.

    Control messages are spread over ``partitions`` streams ``tether:control:<n>`` by trajectory
    (``partition_of``), so all of one trajectory's messages are in one stream, in the order they were
    published, and a relay that holds a partition's lease reads them in that order. Operators and relays
    must agree on ``partitions`` (the default, ``CONTROL_PARTITIONS``, everywhere).
    """

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        url: str = "redis",
        stream: str = CONTROL_STREAM,
        partitions: int = CONTROL_PARTITIONS,
        events_stream: str = EVENTS_STREAM,
        events_maxlen: int = 10_000,
        owns_client: bool = False,
    ) -> None:
        if events_maxlen < 1:
            raise ValueError(f"events_maxlen must be >= 1, got {events_maxlen}")
        if not 1 <= partitions <= MAX_PARTITIONS:
            raise ValueError(f"partitions must be 1..{MAX_PARTITIONS}, got {partitions}")
        self._client = client
        self._url = url
        self.prefix = stream
        self.partitions = partitions
        self.events_stream = events_stream
        self.events_maxlen = events_maxlen
        self._owns_client = owns_client

    @classmethod
    def from_url(cls, url: str, *, socket_timeout: float = 30.0, **kwargs: Any) -> Self:
        """A transport with its own connection pool; keep ``block_ms`` of blocking reads below the timeout."""
        client = aioredis.Redis.from_url(url, socket_timeout=socket_timeout, socket_connect_timeout=10.0)
        return cls(client, url=url, owns_client=True, **kwargs)

    @property
    def url(self) -> str:
        return redact_url(self._url)

    @property
    def client(self) -> aioredis.Redis:
        """The Redis client (for the lease table, which shares the connection pool)."""
        return self._client

    def stream_of(self, trajectory_id: str) -> str:
        """The stream that carries ``trajectory_id``'s messages."""
        return partition_stream(partition_of(trajectory_id, self.partitions), self.prefix)

    def stream(self, partition: int) -> str:
        """The stream of partition ``partition``."""
        if not 0 <= partition < self.partitions:
            raise ValueError(f"partition must be 0..{self.partitions - 1}, got {partition}")
        return partition_stream(partition, self.prefix)

    @property
    def streams(self) -> list[str]:
        return [self.stream(p) for p in range(self.partitions)]

    async def close(self) -> None:
        if self._owns_client:
            await self._client.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def publish(self, message: ControlMessage) -> str:
        """Append a (signed) message to its trajectory's partition; returns the entry id once Redis
        acknowledged it."""
        data = encode_message(message)
        stream = self.stream_of(message.trajectory_id)
        with redis_errors(self._url, f"publishing to {stream}"):
            return _text(await self._client.xadd(stream, {_FIELD: data}))

    async def publish_many(self, messages: Sequence[ControlMessage]) -> list[str]:
        """Append many (signed) messages in one round trip, in order; returns their entry ids."""
        if not messages:
            return []
        pipe = self._client.pipeline(transaction=False)
        for message in messages:
            pipe.xadd(self.stream_of(message.trajectory_id), {_FIELD: encode_message(message)})
        with redis_errors(self._url, f"publishing {len(messages)} messages to {self.prefix}:*"):
            ids = await pipe.execute()
        return [_text(i) for i in ids]

    async def ensure_group(
        self, group: str, *, partitions: Iterable[int] | None = None, start_id: str = "0"
    ) -> bool:
        """Create the consumer group (and the streams) where missing; True if this call created any.

        ``start_id="0"`` lets a new group see messages published before any relay started.
        """
        created = False
        for p in range(self.partitions) if partitions is None else partitions:
            stream = self.stream(p)
            with redis_errors(self._url, f"creating consumer group {group!r} on {stream}"):
                try:
                    await self._client.xgroup_create(stream, group, id=start_id, mkstream=True)
                    created = True
                except redis.exceptions.ResponseError as e:
                    if not str(e).startswith("BUSYGROUP"):
                        raise
        return created

    async def read(
        self,
        group: str,
        consumer: str,
        *,
        partitions: Sequence[int] | None = None,
        count: int = 16,
        block_ms: int | None = None,
        pending: bool = False,
    ) -> list[Delivery]:
        """New entries of ``partitions`` (default: all) for ``consumer`` (``XREADGROUP >``), or with
        ``pending=True`` the entries already delivered to it and not acked. Entries come grouped by
        partition, each partition's in stream order."""
        chosen = list(range(self.partitions)) if partitions is None else list(partitions)
        if not chosen:
            return []
        streams: dict[Any, Any] = {self.stream(p): ("0" if pending else ">") for p in chosen}
        with redis_errors(self._url, f"reading {self.prefix}:* as {group}/{consumer}"):
            reply = cast(
                _StreamsReply,
                await self._client.xreadgroup(group, consumer, streams, count=count, block=block_ms),
            )
        out: list[Delivery] = []
        for stream_name, entries in reply or []:
            partition = self._partition_of_stream(_text(stream_name))
            out.extend(_delivery(entry_id, fields, partition) for entry_id, fields in entries)
        return out

    async def ack(self, group: str, partition: int, *entry_ids: str) -> int:
        """Acknowledge entries (only after the request is durably recorded); returns how many were pending."""
        if not entry_ids:
            return 0
        stream = self.stream(partition)
        with redis_errors(self._url, f"acking on {stream}"):
            return int(await self._client.xack(stream, group, *entry_ids))

    async def claim_stale(
        self,
        group: str,
        consumer: str,
        *,
        partition: int,
        min_idle_ms: int,
        count: int = 16,
        start_id: str = "0-0",
    ) -> Claimed:
        """Take over entries of one partition pending longer than ``min_idle_ms`` on any consumer
        (``min_idle_ms=0``: every pending entry, as a relay does when it takes a partition over)."""
        stream = self.stream(partition)
        with redis_errors(self._url, f"claiming stale entries on {stream}"):
            reply = await self._client.xautoclaim(
                stream, group, consumer, min_idle_time=min_idle_ms, start_id=start_id, count=count
            )
        next_start = cast(bytes, reply[0])
        entries = cast(_Entries, reply[1])
        deleted = cast(list[bytes], reply[2] if len(reply) > 2 else [])  # Redis >= 7 lists trimmed ids
        return Claimed(
            deliveries=[_delivery(entry_id, fields, partition) for entry_id, fields in entries],
            next_start_id=_text(next_start),
            deleted_ids=[_text(d) for d in deleted],
        )

    async def pending_count(self, group: str) -> int:
        """How many entries the group has delivered and not yet acked, over every partition."""
        total = 0
        for stream in self.streams:
            with redis_errors(self._url, f"inspecting pending entries on {stream}"):
                try:
                    summary = await self._client.xpending(stream, group)
                except redis.exceptions.ResponseError as e:
                    if "NOGROUP" in str(e):
                        continue  # nobody created the group on this partition yet: nothing pending
                    raise
            total += int(summary["pending"])
        return total

    async def lag(self, group: str) -> int:
        """Entries published and not yet delivered to the group, plus delivered and not acked: zero when
        the relays have handled everything (a stream without the group counts all its entries)."""
        total = 0
        for stream in self.streams:
            with redis_errors(self._url, f"inspecting {stream}"):
                if not await self._client.exists(stream):
                    continue
                groups = {_text(g["name"]): g for g in await self._client.xinfo_groups(stream)}
                g = groups.get(group)
                if g is None:
                    total += int(await self._client.xlen(stream))
                    continue
                total += int(g["pending"]) + int(g.get("lag") or 0)
        return total

    async def trim_delivered(self) -> int:
        """Drop entries that every consumer group has delivered and acked; returns how many went.

        Per partition, the floor is, per group, its oldest pending entry (or its last delivered one when
        nothing is pending); entries at or above the lowest floor stay, so nothing unacked or undelivered
        is lost. Control messages are not trimmed on publish for that reason (a MAXLEN could drop pending
        ones).
        """
        removed = 0
        for stream in self.streams:
            with redis_errors(self._url, f"trimming {stream}"):
                if not await self._client.exists(stream):
                    continue
                groups = await self._client.xinfo_groups(stream)
                if not groups:
                    continue
                floors: list[str] = []
                for group in groups:
                    if group["pending"]:
                        summary = await self._client.xpending(stream, group["name"])
                        floors.append(_text(summary["min"]))
                    else:
                        floors.append(_text(group["last-delivered-id"]))
                floor = min(floors, key=parse_entry_id)
                removed += int(await self._client.xtrim(stream, minid=floor, approximate=False))
        return removed

    def _partition_of_stream(self, name: str) -> int:
        head, _, tail = name.rpartition(":")
        if head != self.prefix or not tail.isdigit():
            raise CodecError(f"not a partition of {self.prefix}", where=f"stream {name!r}")
        return int(tail)

    async def publish_event(self, event: LiveEvent) -> str:
        """Append a state change to the events stream, trimming it to about ``events_maxlen`` entries."""
        with redis_errors(self._url, f"publishing to {self.events_stream}"):
            entry_id = await self._client.xadd(
                self.events_stream, {_FIELD: encode_event(event)}, maxlen=self.events_maxlen, approximate=True
            )
        return _text(entry_id)

    async def publish_events(self, events: Sequence[LiveEvent]) -> list[str]:
        """``publish_event`` for each, in order, in one pipelined round trip."""
        if not events:
            return []
        with redis_errors(self._url, f"publishing to {self.events_stream}"):
            pipe = self._client.pipeline(transaction=False)
            for event in events:
                pipe.xadd(
                    self.events_stream,
                    {_FIELD: encode_event(event)},
                    maxlen=self.events_maxlen,
                    approximate=True,
                )
            ids = await pipe.execute()
        return [_text(i) for i in ids]

    async def read_events(
        self, after: str = "$", *, count: int = 100, block_ms: int | None = None
    ) -> list[tuple[str, LiveEvent]]:
        """Events after ``after`` (``"$"``: only ones published from now on, so pass ``block_ms``).

        A live view keeps the last id it saw and passes it back. Entries that do not decode (another
        version's writer) are skipped: a view must not stop on one bad line.
        """
        with redis_errors(self._url, f"reading {self.events_stream}"):
            reply = cast(
                _StreamsReply,
                await self._client.xread({self.events_stream: after}, count=count, block=block_ms),
            )
        out: list[tuple[str, LiveEvent]] = []
        for _, entries in reply or []:
            for entry_id, fields in entries:
                try:
                    out.append((_text(entry_id), decode_event((fields or {}).get(_FIELD, b""))))
                except CodecError:
                    continue
        return out

    async def events_length(self) -> int:
        with redis_errors(self._url, f"measuring {self.events_stream}"):
            return int(await self._client.xlen(self.events_stream))


def _delivery(entry_id: bytes | str, fields: dict[bytes, bytes] | None, partition: int) -> Delivery:
    entry = _text(entry_id)
    where = f"{CONTROL_STREAM}:{partition} {entry}"
    if fields is None:
        # A pending entry whose content was trimmed reads back with no fields at all.
        error = CodecError("the pending entry was trimmed before delivery", where=where)
        return Delivery(entry, None, error, partition, EntryProblem.TRIMMED)
    data = fields.get(_FIELD)
    if data is None:
        names = ", ".join(sorted(_text(k) for k in fields)) or "none"
        error = CodecError(
            f"the entry has no message field {_FIELD.decode()!r} (fields: {names})", where=where
        )
        return Delivery(entry, None, error, partition, EntryProblem.MISSING_FIELD)
    try:
        return Delivery(entry, decode_message(data), None, partition)
    except CodecError as e:
        return Delivery(entry, None, e, partition, EntryProblem.MALFORMED)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
