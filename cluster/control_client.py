"""The operator's side of the control plane: build, sign and publish control messages; read status.

A ``ControlClient`` signs each message as one operator identity (Ed25519, ``cluster.signing``) and appends
it to ``tether:control``; the relays carry it to the trajectory actor, which verifies it again and records
it (issue 4). The client checks what it can before publishing, so an operator gets a clear error instead of
an audit line: the trajectory must be known (a launch record, a status snapshot or a log), the identity's
private key must exist, and approve/deny must name a held call (defaulting to the one held now).

Reads come from what the trajectory actors publish: the status snapshot hash ``tether:status:<id>``
(``TrajectoryStatus``), the live events on ``tether:events`` (``watch``) and the relays' audit stream
``tether:audit`` (``audit``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self, cast

import redis.asyncio as aioredis
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from pydantic import BaseModel, ConfigDict, JsonValue, ValidationError

from actors import aio
from actors.relay import AUDIT_STREAM, AuditEntry
from cluster.control import ControlAction, ControlMessage, ControlStream, LiveEvent
from cluster.embedded import redis_errors
from cluster.log_store import FIELD as LOG_FIELD
from cluster.log_store import log_key
from cluster.signing import keyring_path, load_private_key, sign
from runtime.clock import Clock, SystemClock
from runtime.codec import decode as decode_event_bytes
from runtime.errors import InputError
from runtime.events import ToolCallHeld
from runtime.snapshot import decode_snapshot, is_snapshot

__all__ = [
    "LAUNCH_PREFIX",
    "STATUS_PREFIX",
    "BulkSent",
    "ControlClient",
    "HeldCallView",
    "NoHeldCall",
    "Sent",
    "TrajectoryStatus",
    "UnknownTrajectory",
    "status_key",
]

STATUS_PREFIX = "tether:status:"
LAUNCH_PREFIX = "tether:launch:"


def status_key(trajectory_id: str) -> str:
    return f"{STATUS_PREFIX}{trajectory_id}"


class UnknownTrajectory(InputError):
    """No launch record, status snapshot or log exists for the trajectory id."""

    def __init__(self, trajectory_id: str) -> None:
        self.trajectory_id = trajectory_id
        super().__init__(
            "no such trajectory (no launch record, status or log in this Redis)",
            where=f"trajectory {trajectory_id!r}",
        )


class NoHeldCall(InputError):
    """approve/deny without ``--call`` while the trajectory holds nothing for approval."""


class HeldCallView(BaseModel):
    """A call held for approval, as the status snapshot shows it."""

    model_config = ConfigDict(frozen=True)

    trajectory_id: str
    digest: str
    tool: str
    arguments: str = ""  # a short summary; the full arguments stay in the trajectory's log
    expires_at: float | None = None


class TrajectoryStatus(BaseModel):
    """One trajectory's status snapshot (``tether:status:<id>``), as the trajectory actor writes it."""

    model_config = ConfigDict(frozen=True)

    trajectory_id: str
    state: str = "?"
    turns: int = 0
    rho: float = 0.0
    binding_dimension: str = ""
    exit_reason: str = ""
    held: HeldCallView | None = None
    pending_control: int = 0
    hibernated: bool = False
    updated_at: float | None = None
    # issue 12
    hold: str = ""  # watchdog, control, incident, or empty
    hold_reason: str = ""
    hold_incidents: tuple[str, ...] = ()
    rung: str = ""
    escalations_open: int = 0

    @classmethod
    def from_hash(cls, trajectory_id: str, raw: Mapping[bytes | str, bytes | str]) -> TrajectoryStatus:
        """Parse the hash tolerantly: a missing or odd field shows as empty, never breaks ``status``."""
        f = {_text(k): _text(v) for k, v in raw.items()}
        digest = f.get("held_digest") or ""
        held = None
        if digest:
            held = HeldCallView(
                trajectory_id=trajectory_id,
                digest=digest,
                tool=f.get("held_tool", ""),
                arguments=_summary(f.get("held_args") or f.get("held_arguments") or ""),
                expires_at=_float(f.get("held_expires_at") or f.get("held_expiry")),
            )
        return cls(
            trajectory_id=trajectory_id,
            state=f.get("state") or "?",
            turns=int(_float(f.get("turns")) or 0),
            rho=_float(f.get("rho")) or 0.0,
            binding_dimension=f.get("binding_dimension", ""),
            exit_reason=f.get("exit_reason", ""),
            held=held,
            pending_control=int(_float(f.get("pending_control")) or 0),
            hibernated=f.get("hibernated", "").lower() in ("1", "true", "yes"),
            updated_at=_float(f.get("updated_at")),
            hold=f.get("hold", ""),
            hold_reason=f.get("hold_reason", ""),
            hold_incidents=tuple(i for i in f.get("hold_incidents", "").split(",") if i),
            rung=f.get("rung", ""),
            escalations_open=int(_float(f.get("escalations_open")) or 0),
        )

    @property
    def pending_work(self) -> str:
        """What the trajectory is waiting on, in a few words."""
        parts = []
        if self.hold:
            held_by = f" by {', '.join(self.hold_incidents)}" if self.hold_incidents else ""
            parts.append(f"{self.hold} hold{held_by}")
        if self.escalations_open:
            parts.append(f"{self.escalations_open} open escalation(s)")
        if self.held is not None:
            parts.append(f"approval of {self.held.tool} {self.held.digest[:12]}")
        if self.pending_control:
            parts.append(f"{self.pending_control} control request(s)")
        if self.hibernated:
            parts.append("hibernated")
        return ", ".join(parts) or "-"

    def line(self) -> str:
        """The one-line form ``tether status`` prints."""
        binding = f" ({self.binding_dimension})" if self.binding_dimension else ""
        exit_reason = f" exit={self.exit_reason}" if self.exit_reason else ""
        if self.rung and self.rung != "full":
            exit_reason += f" rung={self.rung}"
        return (
            f"{self.trajectory_id}  {self.state}{exit_reason}  turns={self.turns}  "
            f"rho={self.rho:.2f}{binding}  pending: {self.pending_work}"
        )


@dataclass(frozen=True, slots=True)
class Sent:
    """A published control message and where it landed on the stream."""

    entry_id: str
    message: ControlMessage


@dataclass(frozen=True, slots=True)
class BulkSent:
    """What a bulk decision sent, and which trajectories it did not send to (and why)."""

    sent: list[Sent]
    refused: list[tuple[str, str]]


@dataclass(frozen=True, slots=True)
class _Refusal:
    why: str


class ControlClient:
    """Publish signed control messages and read the trajectories' status (async; one Redis pool)."""

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        url: str = "redis",
        keyring: Path | None = None,
        clock: Clock | None = None,
        ttl_s: float = 300.0,
        owns_client: bool = False,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self._client = client
        self._url = url
        self.keyring = keyring or keyring_path()
        self.clock = clock or SystemClock()
        self.ttl_s = ttl_s
        self._owns_client = owns_client
        self.stream = ControlStream(client, url=url)
        self._keys: dict[str, Ed25519PrivateKey] = {}

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> Self:
        client = aioredis.Redis.from_url(url, socket_timeout=10.0, socket_connect_timeout=5.0)
        return cls(client, url=url, owns_client=True, **kwargs)

    async def close(self) -> None:
        if self._owns_client:
            await self._client.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ publishing

    def _key(self, identity: str) -> Ed25519PrivateKey:
        if identity not in self._keys:
            self._keys[identity] = load_private_key(identity, self.keyring)  # InputError names the path
        return self._keys[identity]

    def build(
        self,
        trajectory_id: str,
        action: ControlAction | str,
        *,
        issuer: str,
        reason: str = "",
        payload: dict[str, JsonValue] | None = None,
        ttl_s: float | None = None,
    ) -> ControlMessage:
        """A signed message (not yet published). Bad fields raise ``InputError`` naming the field."""
        try:
            message = ControlMessage.create(
                trajectory_id,
                action,
                issuer,
                now=self.clock.wall(),
                ttl_s=ttl_s or self.ttl_s,
                reason=reason,
                payload=payload,
            )
        except ValidationError as e:
            first = e.errors()[0]
            field = ".".join(str(p) for p in first["loc"]) or "(message)"
            raise InputError(first["msg"], where=f"control message field {field!r}") from e
        return sign(message, issuer, self._key(issuer))

    async def send(
        self,
        trajectory_id: str,
        action: ControlAction | str,
        *,
        issuer: str,
        reason: str = "",
        payload: dict[str, JsonValue] | None = None,
        ttl_s: float | None = None,
        check_known: bool = True,
    ) -> Sent:
        """Sign and publish; ``UnknownTrajectory`` first if nothing in Redis knows the trajectory."""
        if check_known and not await self.known(trajectory_id):
            raise UnknownTrajectory(trajectory_id)
        message = self.build(
            trajectory_id, action, issuer=issuer, reason=reason, payload=payload, ttl_s=ttl_s
        )
        return Sent(await self.stream.publish(message), message)

    async def pause(self, trajectory_id: str, *, issuer: str, reason: str = "") -> Sent:
        return await self.send(trajectory_id, ControlAction.PAUSE, issuer=issuer, reason=reason)

    async def resume(self, trajectory_id: str, *, issuer: str, reason: str = "") -> Sent:
        return await self.send(trajectory_id, ControlAction.RESUME, issuer=issuer, reason=reason)

    async def cancel(self, trajectory_id: str, *, issuer: str, reason: str = "") -> Sent:
        return await self.send(trajectory_id, ControlAction.CANCEL, issuer=issuer, reason=reason)

    async def kill(self, trajectory_id: str, *, issuer: str, reason: str = "") -> Sent:
        return await self.send(trajectory_id, ControlAction.KILL, issuer=issuer, reason=reason)

    async def interrupt(self, trajectory_id: str, message: str, *, issuer: str, reason: str = "") -> Sent:
        """Deliver ``message`` as a user message into the trajectory's next turn."""
        return await self.send(
            trajectory_id, ControlAction.INTERRUPT, issuer=issuer, reason=reason, payload={"message": message}
        )

    async def approve(
        self, trajectory_id: str, *, issuer: str, call_digest: str | None = None, reason: str = ""
    ) -> Sent:
        """Approve the held call (``call_digest`` defaults to the one the status shows held now)."""
        digest = call_digest or await self._held_digest(trajectory_id)
        return await self.send(
            trajectory_id,
            ControlAction.APPROVE,
            issuer=issuer,
            reason=reason,
            payload={"call_digest": digest},
        )

    async def deny(
        self, trajectory_id: str, *, issuer: str, call_digest: str | None = None, reason: str = ""
    ) -> Sent:
        digest = call_digest or await self._held_digest(trajectory_id)
        return await self.send(
            trajectory_id, ControlAction.DENY, issuer=issuer, reason=reason, payload={"call_digest": digest}
        )

    async def decide_many(
        self,
        action: ControlAction | str,
        decisions: Sequence[tuple[str, str | None]],
        *,
        issuer: str,
        reason: str = "",
    ) -> BulkSent:
        """Approve or deny many held calls at once: one message per ``(trajectory, digest)``, each signed
        on its own, published in one round trip. A digest of None means the call held now (from the status
        snapshot); a trajectory that is unknown or holds nothing is refused (in ``refused``), not sent."""
        action = ControlAction(action)
        if action not in (ControlAction.APPROVE, ControlAction.DENY):
            raise InputError(f"only approve and deny are sent in bulk, not {action}", where="action")
        unresolved = [tid for tid, digest in decisions if not digest]
        held = await self._held_digests(unresolved)
        messages: list[ControlMessage] = []
        refused: list[tuple[str, str]] = []
        for tid, digest in decisions:
            chosen = digest or held.get(tid)
            if isinstance(chosen, _Refusal):
                refused.append((tid, chosen.why))
                continue
            assert chosen is not None
            payload: dict[str, JsonValue] = {"call_digest": chosen}
            messages.append(self.build(tid, action, issuer=issuer, reason=reason, payload=payload))
        entry_ids = await self.stream.publish_many(messages)
        return BulkSent([Sent(e, m) for e, m in zip(entry_ids, messages, strict=True)], refused)

    async def held_calls(self, *, tool: str | None = None) -> list[HeldCallView]:
        """Calls held for approval now (from the status snapshots; no log reads), optionally one tool's."""
        return [
            s.held
            for s in await self.statuses()
            if s.held is not None and s.state == "AWAITING_APPROVAL" and (tool is None or s.held.tool == tool)
        ]

    async def _held_digests(self, trajectory_ids: Sequence[str]) -> dict[str, str | _Refusal]:
        """The held digest of each trajectory, or why there is none (one pipelined round trip)."""
        if not trajectory_ids:
            return {}
        pipe = self._client.pipeline(transaction=False)
        for tid in trajectory_ids:
            pipe.hgetall(status_key(tid))
            pipe.exists(f"{LAUNCH_PREFIX}{tid}", log_key(tid))
        with redis_errors(self._url, f"reading the status of {len(trajectory_ids)} trajectories"):
            replies = await pipe.execute()
        out: dict[str, str | _Refusal] = {}
        for i, tid in enumerate(trajectory_ids):
            raw, exists = replies[2 * i], replies[2 * i + 1]
            status = TrajectoryStatus.from_hash(tid, raw) if raw else None
            if status is None and not exists:
                out[tid] = _Refusal("no such trajectory")
            elif status is None or status.held is None:
                state = status.state if status is not None else "?"
                out[tid] = _Refusal(f"holds no call for approval (state {state})")
            else:
                out[tid] = status.held.digest
        return out

    async def _held_digest(self, trajectory_id: str) -> str:
        status = await self.status(trajectory_id)
        if status is None:
            if not await self.known(trajectory_id):
                raise UnknownTrajectory(trajectory_id)
            status = TrajectoryStatus(trajectory_id=trajectory_id)
        if status.held is None:
            raise NoHeldCall(
                f"holds no call for approval (state {status.state}); pass --call DIGEST to decide anyway",
                where=f"trajectory {trajectory_id!r}",
            )
        return status.held.digest

    # ------------------------------------------------------------------ reading

    async def known(self, trajectory_id: str) -> bool:
        """True when a launch record, a status snapshot or a log exists for the id."""
        keys = (f"{LAUNCH_PREFIX}{trajectory_id}", status_key(trajectory_id), log_key(trajectory_id))
        with redis_errors(self._url, f"looking up trajectory {trajectory_id!r}"):
            return bool(await self._client.exists(*keys))

    async def status(self, trajectory_id: str) -> TrajectoryStatus | None:
        with redis_errors(self._url, f"reading the status of {trajectory_id!r}"):
            raw = await self._client.hgetall(status_key(trajectory_id))
        return TrajectoryStatus.from_hash(trajectory_id, raw) if raw else None

    async def statuses(self) -> list[TrajectoryStatus]:
        """Every trajectory with a status snapshot, sorted by id (SCAN, never KEYS)."""
        out: list[TrajectoryStatus] = []
        with redis_errors(self._url, "listing trajectory status"):
            keys = [_text(k) async for k in self._client.scan_iter(match=f"{STATUS_PREFIX}*", count=500)]
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.hgetall(key)
            hashes = await pipe.execute() if keys else []
        for key, raw in zip(keys, hashes, strict=True):
            if raw:
                out.append(TrajectoryStatus.from_hash(key.removeprefix(STATUS_PREFIX), raw))
        return sorted(out, key=lambda s: s.trajectory_id)

    async def pending(self) -> list[HeldCallView]:
        """Held calls awaiting a decision, soonest expiry first, with their arguments summarised from the
        trajectory's log (the snapshot carries only digest, tool and expiry)."""
        held = [
            s.held for s in await self.statuses() if s.held is not None and s.state == "AWAITING_APPROVAL"
        ]
        out = []
        for h in held:
            args = h.arguments or await self._held_arguments(h.trajectory_id, h.digest)
            out.append(h.model_copy(update={"arguments": args}))
        return sorted(out, key=lambda h: (h.expires_at or float("inf"), h.trajectory_id))

    async def _held_arguments(self, trajectory_id: str, digest: str, *, scan: int = 200) -> str:
        """Arguments of the newest ``ToolCallHeld`` with ``digest`` among the last ``scan`` log entries, or of
        the held call in the record snapshot a hibernated trajectory compacted its log to."""
        with redis_errors(self._url, f"reading the log of {trajectory_id!r}"):
            entries = cast(
                list[tuple[bytes, dict[bytes, bytes]]],
                await self._client.xrevrange(log_key(trajectory_id), count=scan),
            )
        for _, fields in entries:
            payload = (fields or {}).get(LOG_FIELD, b"")
            try:
                if is_snapshot(payload):  # older entries are covered by it: the record decides
                    held = decode_snapshot(payload).held
                    if held is not None and held.digest == digest:
                        return _summary(json.dumps(dict(held.arguments), default=str))
                    return ""
                event = decode_event_bytes(payload)
            except InputError:
                continue
            if isinstance(event, ToolCallHeld) and event.digest == digest:
                return _summary(json.dumps(dict(event.arguments), default=str))
        return ""

    async def watch(self, *, after: str = "$", block_ms: int = 1000) -> AsyncIterator[tuple[str, LiveEvent]]:
        """Live events as they are published (endless; the caller stops iterating)."""
        # pin "$" to a concrete id once, so events published between two reads are never missed
        cursor = await self._last_event_id() if after == "$" else after
        while True:
            events = await self.stream.read_events(cursor, block_ms=block_ms)
            if aio.cancel_requested():  # the read may have returned in place of the cancel (actors.aio)
                raise asyncio.CancelledError
            for entry_id, event in events:
                cursor = entry_id
                yield entry_id, event

    async def _last_event_id(self) -> str:
        with redis_errors(self._url, "reading the events stream"):
            entries = await self._client.xrevrange(self.stream.events_stream, count=1)
        return _text(cast(bytes, entries[0][0])) if entries else "0-0"

    async def audit(self, *, count: int = 100) -> list[AuditEntry]:
        """The newest relay audit entries, oldest first."""
        with redis_errors(self._url, f"reading {AUDIT_STREAM}"):
            entries = cast(
                list[tuple[bytes, dict[bytes, bytes]]],
                await self._client.xrevrange(AUDIT_STREAM, count=count),
            )
        return [
            AuditEntry.from_fields({_text(k): _text(v) for k, v in (fields or {}).items()})
            for _, fields in reversed(entries)
        ]


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _float(value: str | None) -> float | None:
    try:
        return float(value) if value not in (None, "") else None
    except ValueError:
        return None


def _summary(args: str, limit: int = 80) -> str:
    """Arguments as one short line (JSON compacted when it parses)."""
    try:
        args = json.dumps(json.loads(args), sort_keys=True, separators=(",", ":"))
    except (ValueError, TypeError):
        args = " ".join(args.split())
    return args if len(args) <= limit else args[: limit - 1] + "…"
