"""In-memory stand-ins for the relay's ports: a consumer-group stream, trajectory targets, an audit sink."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from actors.ports import AuditEntry, RelayClaim, RelayDelivery
from actors.relay import UNKNOWN
from cluster.adapters import relay_delivery
from cluster.control import ControlMessage, Delivery, decode_message, encode_message
from runtime.clock import FakeClock
from runtime.errors import CodecError


@dataclass
class _Pending:
    owner: str
    since: float
    deliveries: int = 1


@dataclass
class FakeStream:
    """One stream, one consumer group: new entries go to the first reader; a pending entry stays with its
    owner until acked or claimed after ``min_idle_ms`` on the fake clock (XREADGROUP / XACK / XAUTOCLAIM)."""

    clock: FakeClock
    entries: list[tuple[str, bytes]] = field(default_factory=list)
    pel: dict[str, _Pending] = field(default_factory=dict)
    acked: list[str] = field(default_factory=list)
    groups: set[str] = field(default_factory=set)
    _next: int = 0  # index of the first entry never delivered to the group

    def add(self, data: bytes) -> str:
        entry_id = f"{len(self.entries) + 1}-0"
        self.entries.append((entry_id, data))
        return entry_id

    def publish(self, message: ControlMessage) -> str:
        return self.add(encode_message(message))

    async def ensure_group(self, group: str, *, start_id: str = "0") -> bool:
        created = group not in self.groups
        self.groups.add(group)
        return created

    async def read(
        self,
        group: str,
        consumer: str,
        *,
        count: int = 16,
        block_ms: int | None = None,
        pending: bool = False,
    ) -> list[RelayDelivery]:
        assert group in self.groups, "read before ensure_group"
        if pending:
            ids = [e for e, p in self.pel.items() if p.owner == consumer][:count]
            return [self._delivery(e) for e in ids]
        fresh = self.entries[self._next : self._next + count]
        self._next += len(fresh)
        for entry_id, _ in fresh:
            self.pel[entry_id] = _Pending(consumer, self.clock.now())
        return [self._delivery(e) for e, _ in fresh]

    async def ack(self, group: str, *entry_ids: str) -> int:
        n = 0
        for e in entry_ids:
            if self.pel.pop(e, None) is not None:
                self.acked.append(e)
                n += 1
        return n

    async def claim_stale(
        self, group: str, consumer: str, *, min_idle_ms: int, count: int = 16, start_id: str = "0-0"
    ) -> RelayClaim:
        now = self.clock.now()
        stale = [e for e, p in self.pel.items() if (now - p.since) * 1000 >= min_idle_ms][:count]
        for e in stale:
            p = self.pel[e]
            self.pel[e] = _Pending(consumer, now, p.deliveries + 1)
        return RelayClaim([self._delivery(e) for e in stale], "0-0", [])

    async def close(self) -> None:
        return None

    def _delivery(self, entry_id: str) -> RelayDelivery:
        # decoded as ControlStream does, then converted by the adapter the relay actor really uses
        data = dict(self.entries)[entry_id]
        try:
            return relay_delivery(Delivery(entry_id, decode_message(data), None))
        except CodecError as e:
            return relay_delivery(Delivery(entry_id, None, e))


@dataclass
class FakeTargets:
    """Trajectory 'actors' that record each message id once; ``answer`` overrides per trajectory."""

    known: set[str] = field(default_factory=set)
    records: dict[str, list[str]] = field(default_factory=dict)  # trajectory -> recorded message ids
    calls: int = 0
    answer: dict[str, str] = field(default_factory=dict)
    fail: Callable[[str], bool] = lambda _tid: False

    async def deliver(self, trajectory_id: str, data: bytes) -> str:
        self.calls += 1
        if self.fail(trajectory_id):
            raise ConnectionError(f"traj:{trajectory_id} died mid-call")
        if trajectory_id in self.answer:
            return self.answer[trajectory_id]
        if trajectory_id not in self.known:
            return UNKNOWN
        message_id = decode_message(data).message_id
        log = self.records.setdefault(trajectory_id, [])
        if message_id in log:
            return "duplicate"
        log.append(message_id)
        return "recorded"


@dataclass
class FakeAudit:
    entries: list[AuditEntry] = field(default_factory=list)

    async def write(self, entry: AuditEntry) -> None:
        self.entries.append(entry)

    async def close(self) -> None:
        return None
