"""The composition root of the actor shells: ``actors.ports`` implemented over the cluster layer.

``actors/`` declares what it needs (``actors.ports.ClusterPorts``) and never imports ``cluster``; this
module supplies it: the Redis log store, live events on ``tether:events``, signed-message verification
against the keyring (and decoding without it, for an actor that takes its relay's verdict), the
partitioned ``tether:control:<n>`` consumer-group transport with its partition leases, the ``tether:audit``
sink and the durable timer store.

``ClusterAdapters`` is a plain, stateless, module-level class, so it pickles by reference: the driver (or
a relay) passes one to every actor it creates and the worker imports this module when it unpickles it.
Every method opens a fresh resource owned by the caller.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import redis.asyncio as aioredis

from actors.ports import (
    AuditEntry,
    ControlEnvelope,
    RelayClaim,
    RelayDelivery,
    VerifiedControl,
)
from actors.relay import AUDIT_STREAM
from cluster.control import Claimed, ControlMessage, ControlStream, Delivery, LiveEvent, decode_message
from cluster.control import encode_message as encode_control
from cluster.control_leases import PartitionLeases
from cluster.embedded import redis_errors
from cluster.log_store import RedisLogStore
from cluster.supervision_store import RedisSupervisionStore
from cluster.timers import RedisTimerStore

if TYPE_CHECKING:
    # cryptography's Ed25519 (about 7 MB of every trajectory process) is loaded on the first control
    # message a process verifies, not when the actor's constructor arguments are unpickled
    from cluster.signing import Verifier

__all__ = [
    "ClusterAdapters",
    "KeyringVerifier",
    "LiveEvents",
    "RedisAudit",
    "RelayControlStream",
    "decode_envelope",
    "envelope_of",
    "relay_claim",
    "relay_delivery",
]


# --------------------------------------------------------------------------- control messages


def envelope_of(message: ControlMessage, data: bytes | None = None) -> ControlEnvelope:
    """The actors' view of a decoded message (``data``: its encoding, re-encoded when not given)."""
    return ControlEnvelope(
        message_id=message.message_id,
        trajectory_id=message.trajectory_id,
        action=message.action.value,
        issuer=message.issuer,
        reason=message.reason,
        nonce=message.nonce,
        payload=dict(message.payload),
        data=encode_control(message) if data is None else data,
        source=message,
    )


def decode_envelope(data: bytes) -> ControlEnvelope:
    """The envelope of encoded ``data`` (msgpack and the schema only: no keyring, no signature code)."""
    return envelope_of(decode_message(data), bytes(data))


_Stamp = tuple[int, int, int] | None


class KeyringVerifier:
    """``actors.ports.ControlVerifier`` over ``cluster.signing.Verifier``.

    The keyring is loaded once and reloaded only when its file changes (mtime, size, inode), so a
    delivery costs one ``stat`` instead of a YAML parse, and ``tether keys new`` during a run still
    takes effect without restarting any actor.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.loads = 0  # how many times the file was actually read (tests judge the cache by it)
        self._stamp: _Stamp = None
        self._verifier: Verifier | None = None

    def _current(self) -> Verifier:
        try:
            st = os.stat(self.path)
            stamp: _Stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        except FileNotFoundError:
            stamp = None
        if self._verifier is None or stamp != self._stamp:
            from cluster.signing import Keyring, Verifier

            self._verifier = Verifier(Keyring.load(self.path))
            self._stamp = stamp
            self.loads += 1
        return self._verifier

    def decode(self, data: bytes) -> ControlEnvelope:
        return decode_envelope(data)

    def verify(
        self, envelope: ControlEnvelope, now: float, seen: Callable[[str, str], bool]
    ) -> VerifiedControl:
        message = envelope.source
        if not isinstance(message, ControlMessage):
            message = decode_message(envelope.data)
        verified = self._current().verify(message, now, seen)
        return VerifiedControl(
            envelope,
            verified.signers,
            frozenset(r.value for r in verified.roles),
            {name: frozenset(r.value for r in roles) for name, roles in verified.signer_roles.items()},
        )


# --------------------------------------------------------------------------- live events


class LiveEvents:
    """``actors.ports.LiveEventSink`` over ``ControlStream.publish_event``."""

    def __init__(self, stream: ControlStream) -> None:
        self._stream = stream

    async def publish(self, trajectory_id: str, kind: str, at: float, data: Mapping[str, Any]) -> None:
        await self._stream.publish_event(
            LiveEvent(trajectory_id=trajectory_id, kind=kind, at=at, data=dict(data))
        )

    async def publish_many(
        self, trajectory_id: str, kind: str, items: Sequence[tuple[float, Mapping[str, Any]]]
    ) -> None:
        events = [LiveEvent(trajectory_id=trajectory_id, kind=kind, at=at, data=dict(d)) for at, d in items]
        await self._stream.publish_events(events)

    async def close(self) -> None:
        await self._stream.close()


# --------------------------------------------------------------------------- relays


def relay_delivery(delivery: Delivery) -> RelayDelivery:
    """A transport ``Delivery`` as the relay loop reads it."""
    if delivery.message is None:
        error = str(delivery.error) if delivery.error is not None else "no message"
        problem = delivery.problem.value if delivery.problem is not None else "MALFORMED"
        return RelayDelivery(delivery.entry_id, None, error, delivery.partition, problem)
    return RelayDelivery(delivery.entry_id, envelope_of(delivery.message), partition=delivery.partition)


def relay_claim(claimed: Claimed) -> RelayClaim:
    return RelayClaim(
        [relay_delivery(d) for d in claimed.deliveries], claimed.next_start_id, list(claimed.deleted_ids)
    )


class RelayControlStream:
    """``actors.ports.RelayStream`` over ``ControlStream`` (consumer group, ack, ``XAUTOCLAIM``) and
    ``PartitionLeases`` (membership, one reader per partition), sharing one connection pool."""

    def __init__(self, stream: ControlStream) -> None:
        self.stream = stream
        self.leases = PartitionLeases(stream.client, url=stream.url, prefix=stream.prefix)

    @property
    def partitions(self) -> int:
        return self.stream.partitions

    async def ensure_group(self, group: str, *, start_id: str = "0") -> bool:
        return await self.stream.ensure_group(group, start_id=start_id)

    async def read(
        self,
        group: str,
        consumer: str,
        *,
        partitions: Sequence[int],
        count: int = 16,
        block_ms: int | None = None,
    ) -> list[RelayDelivery]:
        found = await self.stream.read(group, consumer, partitions=partitions, count=count, block_ms=block_ms)
        return [relay_delivery(d) for d in found]

    async def ack(self, group: str, partition: int, *entry_ids: str) -> int:
        return await self.stream.ack(group, partition, *entry_ids)

    async def claim_stale(
        self,
        group: str,
        consumer: str,
        *,
        partition: int,
        min_idle_ms: int,
        count: int = 16,
        start_id: str = "0-0",
    ) -> RelayClaim:
        claimed = await self.stream.claim_stale(
            group, consumer, partition=partition, min_idle_ms=min_idle_ms, count=count, start_id=start_id
        )
        return relay_claim(claimed)

    async def beat(self, name: str, ttl_ms: int) -> list[str]:
        return await self.leases.beat(name, ttl_ms)

    async def hold(self, name: str, partitions: Sequence[int], ttl_ms: int) -> set[int]:
        return await self.leases.hold(name, partitions, ttl_ms)

    async def release(self, name: str, partitions: Sequence[int]) -> int:
        return await self.leases.release(name, partitions)

    async def close(self) -> None:
        await self.stream.close()


class RedisAudit:
    """Audit entries on the ``tether:audit`` stream (trimmed with ``MAXLEN ~``)."""

    def __init__(self, client: aioredis.Redis, *, url: str = "redis", maxlen: int = 100_000) -> None:
        self._client = client
        self._url = url
        self._maxlen = maxlen

    async def write(self, entry: AuditEntry) -> None:
        with redis_errors(self._url, f"writing to {AUDIT_STREAM}"):
            fields: Any = entry.to_fields()
            await self._client.xadd(AUDIT_STREAM, fields, maxlen=self._maxlen, approximate=True)

    async def close(self) -> None:
        await self._client.aclose()


# --------------------------------------------------------------------------- the root


@dataclass(frozen=True, slots=True)
class ClusterAdapters:
    """``actors.ports.ClusterPorts`` over Redis and the keyring (stateless; safe to pickle and share)."""

    socket_timeout_s: float = 10.0
    relay_socket_timeout_s: float = 30.0  # above any relay's blocking-read time (RelayConfig.block_ms)

    def open_log(self, redis_url: str) -> RedisLogStore:
        return RedisLogStore.from_url(redis_url, socket_timeout=self.socket_timeout_s)

    def live_events(self, redis_url: str) -> LiveEvents:
        return LiveEvents(ControlStream.from_url(redis_url, socket_timeout=self.socket_timeout_s))

    def control_verifier(self, keyring_path: str | None) -> KeyringVerifier:
        from cluster.signing import keyring_path as default_keyring_path

        return KeyringVerifier(Path(keyring_path) if keyring_path else default_keyring_path())

    def decode_control(self, data: bytes) -> ControlEnvelope:
        return decode_envelope(data)

    def relay_stream(self, redis_url: str) -> RelayControlStream:
        return RelayControlStream(
            ControlStream.from_url(redis_url, socket_timeout=self.relay_socket_timeout_s)
        )

    def timer_store(self, redis_url: str) -> RedisTimerStore:
        return RedisTimerStore.from_url(redis_url)

    def audit_sink(self, redis_url: str, maxlen: int) -> RedisAudit:
        client = aioredis.Redis.from_url(redis_url, socket_timeout=self.relay_socket_timeout_s)
        return RedisAudit(client, url=redis_url, maxlen=maxlen)

    def supervision_store(self, redis_url: str) -> RedisSupervisionStore:
        return RedisSupervisionStore.from_url(redis_url)
