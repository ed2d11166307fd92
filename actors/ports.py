"""What the actor shells need from the cluster layer, declared here and injected from outside.

ARCHITECTURE.md: dependencies point one way, ``runtime`` <- ``scheduler``, ``breakers`` <- ``actors`` <-
``cluster``. The trajectory actor and the relays still need a durable log store, a place to publish live
events, a verifier for signed control messages and a control-stream transport, and all of those live in
``cluster/``. So ``actors/`` names what it needs as small Protocols and value types (this module), and the
composition root ``cluster.adapters.ClusterAdapters`` implements them over ``RedisLogStore``,
``ControlStream``, ``Verifier`` and ``Keyring``. Whoever starts an actor (the ``tether run`` driver, a relay
waking a hibernated trajectory, a test) passes that object in; no module under ``actors/`` imports
``cluster``.

The object crosses a Ray boundary (actor constructor argument), so implementations must be picklable:
a module-level class is pickled by reference and the worker imports its module at run time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from runtime.ports import LogStore

__all__ = [
    "MALFORMED",
    "REFUSED",
    "VERIFIED",
    "AuditEntry",
    "AuditSink",
    "ClosableLogStore",
    "ClusterPorts",
    "ControlEnvelope",
    "ControlVerdict",
    "ControlVerifier",
    "LiveEventSink",
    "RelayClaim",
    "RelayDelivery",
    "RelayStream",
    "SupervisionStore",
    "TimerStore",
    "VerifiedControl",
    "read_verdict",
    "refused_verdict",
    "verified_verdict",
]

MALFORMED = "MALFORMED"  # the reject reason of bytes that do not decode as a control message


# --------------------------------------------------------------------------- control messages


@dataclass(frozen=True, slots=True)
class ControlEnvelope:
    """A decoded, not yet verified control message: what an actor reads of it.

    ``action`` is a ``runtime.record.ControlAction`` value; ``data`` the encoded message exactly as it is
    handed to the trajectory actor; ``source`` the transport's own decoded form, kept so verification
    need not decode again (opaque to ``actors/``).
    """

    message_id: str
    trajectory_id: str
    action: str
    issuer: str
    reason: str
    nonce: str
    payload: Mapping[str, Any]
    data: bytes
    source: object = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class VerifiedControl:
    """A message whose signatures, roles, validity window and freshness all checked out."""

    envelope: ControlEnvelope
    signers: tuple[str, ...]
    roles: frozenset[str]
    signer_roles: Mapping[str, frozenset[str]] = field(default_factory=dict)  # each signer's own roles


class ControlVerifier(Protocol):
    """Decodes and verifies signed control messages (one per relay and keyring, or per actor incarnation that
    verifies for itself: it may cache its keyring)."""

    def decode(self, data: bytes) -> ControlEnvelope:
        """The envelope of ``data``; ``runtime.errors.CodecError`` naming what is wrong otherwise."""
        ...

    def verify(
        self, envelope: ControlEnvelope, now: float, seen: Callable[[str, str], bool]
    ) -> VerifiedControl:
        """Check signature, signer roles, validity window (``now``: epoch seconds) and replay
        (``seen(message_id, nonce)``); ``runtime.errors.ControlError`` with the reason code otherwise."""
        ...


# The relay's verdict on a message it verified, handed to the trajectory actor with the message's bytes:
# ``("verified", signers, {signer: sorted roles})`` or ``("refused", reason, detail)``. Plain values only:
# the actor reads it without the keyring or the signature code (docs/control.md, "Where signatures are
# checked": loading them cost every trajectory process ~8.5 MB resident and up to half a second per wake).
VERIFIED = "verified"
REFUSED = "refused"
ControlVerdict = tuple[str, Any, Any]


def verified_verdict(verified: VerifiedControl) -> ControlVerdict:
    """The verdict that says ``verified`` checked out (its signers and each one's roles)."""
    signer_roles = dict(verified.signer_roles) or {name: verified.roles for name in verified.signers}
    roles = {name: tuple(sorted(held)) for name, held in signer_roles.items()}
    return (VERIFIED, tuple(verified.signers), roles)


def refused_verdict(reason: str, detail: str) -> ControlVerdict:
    """The verdict that refuses a message (``reason``: the verifier's reason code)."""
    return (REFUSED, reason, detail)


def read_verdict(envelope: ControlEnvelope, verdict: ControlVerdict) -> VerifiedControl | tuple[str, str]:
    """What ``verdict`` says of ``envelope``: the verified message, or the (reason, detail) of its refusal.
    ``ValueError`` when it is neither (the caller then verifies for itself)."""
    try:
        tag, first, second = verdict
    except (TypeError, ValueError) as e:
        raise ValueError(f"not a control verdict: {verdict!r}") from e
    if tag == REFUSED and isinstance(first, str) and isinstance(second, str):
        return first, second
    if (
        tag == VERIFIED
        and isinstance(first, tuple | list)
        and first
        and all(isinstance(name, str) for name in first)
        and isinstance(second, Mapping)
        and set(second) == set(first)
        and all(isinstance(held, tuple | list) for held in second.values())
    ):
        signer_roles = {name: frozenset(str(r) for r in held) for name, held in second.items()}
        roles = frozenset[str]().union(*signer_roles.values())
        return VerifiedControl(envelope, tuple(first), roles, signer_roles)
    raise ValueError(f"not a control verdict: {verdict!r}")


# --------------------------------------------------------------------------- views and the log


class LiveEventSink(Protocol):
    """Where state changes are published for live views (``tether watch``); never the audit record."""

    async def publish(self, trajectory_id: str, kind: str, at: float, data: Mapping[str, Any]) -> None: ...

    async def publish_many(
        self, trajectory_id: str, kind: str, items: Sequence[tuple[float, Mapping[str, Any]]]
    ) -> None:
        """``publish`` for each (at, data), in order, in one round trip."""
        ...

    async def close(self) -> None: ...


class ClosableLogStore(LogStore, Protocol):
    """A ``runtime.ports.LogStore`` that holds a connection the actor closes when it goes away."""

    async def close(self) -> None: ...


class TimerStore(Protocol):
    """Durable timers (ARCHITECTURE.md, "Durable timers"): a timer stored here fires as an input to whichever
    incarnation of its trajectory exists, even after the actor hibernated or died. Implemented over Redis by
    ``cluster.timers.RedisTimerStore``; a timer service in the cluster delivers due ones (the trajectory
    actor's ``fire_timer``). Delivery is at-least-once; the trajectory ignores a timer it no longer holds."""

    async def schedule(self, trajectory_id: str, timer_id: str, due_at: float) -> None: ...

    async def cancel(self, trajectory_id: str, timer_id: str) -> None: ...

    async def close(self) -> None: ...


# --------------------------------------------------------------------------- the relay's transport


@dataclass(frozen=True, slots=True)
class RelayDelivery:
    """One entry read from a control partition. An entry that carries no decodable message still comes
    through (``envelope`` None, ``problem`` the audit reason: ``MALFORMED``, ``MISSING_FIELD`` or
    ``TRIMMED``, ``error`` the detail) so the relay can audit and ack it instead of looping on it."""

    entry_id: str
    envelope: ControlEnvelope | None
    error: str | None = None
    partition: int = 0
    problem: str = ""


@dataclass(frozen=True, slots=True)
class RelayClaim:
    """One take-over pass (``XAUTOCLAIM``): entries now ours, where to continue, ids trimmed away."""

    deliveries: list[RelayDelivery]
    next_start_id: str
    deleted_ids: list[str]


class RelayStream(Protocol):
    """The partitioned control stream as one relay of a consumer group sees it, with the partition leases
    that make each partition's reader unique (``cluster.control_leases``)."""

    @property
    def partitions(self) -> int:
        """How many partitions the control stream has."""
        ...

    async def ensure_group(self, group: str, *, start_id: str = "0") -> bool: ...

    async def read(
        self,
        group: str,
        consumer: str,
        *,
        partitions: Sequence[int],
        count: int = 16,
        block_ms: int | None = None,
    ) -> list[RelayDelivery]: ...

    async def ack(self, group: str, partition: int, *entry_ids: str) -> int: ...

    async def claim_stale(
        self,
        group: str,
        consumer: str,
        *,
        partition: int,
        min_idle_ms: int,
        count: int = 16,
        start_id: str = "0-0",
    ) -> RelayClaim: ...

    async def beat(self, name: str, ttl_ms: int) -> list[str]:
        """Announce this relay alive for ``ttl_ms``; the names of every live relay."""
        ...

    async def hold(self, name: str, partitions: Sequence[int], ttl_ms: int) -> set[int]:
        """Renew this relay's leases among ``partitions`` and take the free ones; those it now holds."""
        ...

    async def release(self, name: str, partitions: Sequence[int]) -> int:
        """Give back this relay's leases among ``partitions``."""
        ...

    async def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class AuditEntry:
    """One line of ``tether:audit``: what arrived, why it was not applied, and who noticed."""

    reason: str
    detail: str
    entry_id: str
    relay: str
    at: float
    message_id: str = ""
    trajectory_id: str = ""
    action: str = ""
    issuer: str = ""

    def to_fields(self) -> dict[str | bytes, str | bytes]:
        return {k: str(v) for k, v in self.as_dict().items()}

    def as_dict(self) -> dict[str, Any]:
        return {
            "reason": self.reason,
            "detail": self.detail,
            "entry_id": self.entry_id,
            "relay": self.relay,
            "at": self.at,
            "message_id": self.message_id,
            "trajectory_id": self.trajectory_id,
            "action": self.action,
            "issuer": self.issuer,
        }

    @classmethod
    def from_fields(cls, fields: Mapping[str, str]) -> AuditEntry:
        return cls(
            reason=fields.get("reason", ""),
            detail=fields.get("detail", ""),
            entry_id=fields.get("entry_id", ""),
            relay=fields.get("relay", ""),
            at=float(fields.get("at") or 0.0),
            message_id=fields.get("message_id", ""),
            trajectory_id=fields.get("trajectory_id", ""),
            action=fields.get("action", ""),
            issuer=fields.get("issuer", ""),
        )


class AuditSink(Protocol):
    async def write(self, entry: AuditEntry) -> None: ...

    async def close(self) -> None: ...


# --------------------------------------------------------------------------- supervision (issue 12)


class SupervisionStore(Protocol):
    """The cross-trajectory views supervision writes and the dispatch boundary reads: the escalation
    registry, the incident store and the quarantine (``cluster.supervision_store``)."""

    async def publish_escalation(self, escalation: Mapping[str, Any]) -> None: ...

    async def open_incident(self, incident: Mapping[str, Any], artifacts: Sequence[str]) -> None: ...

    async def quarantined(self, values: Sequence[str]) -> dict[str, str]:
        """The ``values`` that are quarantined artifacts, each with the incident that holds it."""
        ...

    async def close(self) -> None: ...


# --------------------------------------------------------------------------- the composition root


class ClusterPorts(Protocol):
    """Everything the actor shells take from the cluster layer (implemented by
    ``cluster.adapters.ClusterAdapters``). Each call opens a fresh resource the caller closes."""

    def open_log(self, redis_url: str) -> ClosableLogStore:
        """The durable per-trajectory log store."""
        ...

    def live_events(self, redis_url: str) -> LiveEventSink:
        """The live-events publisher (``tether:events``)."""
        ...

    def control_verifier(self, keyring_path: str | None) -> ControlVerifier:
        """A verifier over the keyring at ``keyring_path`` (None: the cluster default)."""
        ...

    def decode_control(self, data: bytes) -> ControlEnvelope:
        """The envelope of an encoded control message, decoded without the keyring or the signature code
        (a message whose relay verdict the actor takes); ``runtime.errors.CodecError`` when it is not one."""
        ...

    def relay_stream(self, redis_url: str) -> RelayStream:
        """The control stream as a relay reads it."""
        ...

    def audit_sink(self, redis_url: str, maxlen: int) -> AuditSink:
        """Where a relay writes audit entries (``tether:audit``)."""
        ...

    def timer_store(self, redis_url: str) -> TimerStore:
        """The durable timer store (``tether:timers``)."""
        ...

    def supervision_store(self, redis_url: str) -> SupervisionStore:
        """Escalations, incidents and the quarantine (issue 12)."""
        ...
