"""In-memory stand-ins for the relay's ports: a partitioned consumer-group stream with leases and
membership, trajectory targets, an audit sink, and an actor runtime for ``actors.incarnation``."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from actors.incarnation import ActorBusy, ActorGone, TrajectoryInfo
from actors.ports import AuditEntry, ControlEnvelope, RelayClaim, RelayDelivery
from actors.relay import UNKNOWN
from cluster.adapters import relay_delivery
from cluster.control import (
    ControlMessage,
    Delivery,
    EntryProblem,
    decode_message,
    encode_message,
    partition_of,
)
from runtime.clock import FakeClock
from runtime.errors import CodecError


@dataclass
class _Pending:
    owner: str
    since: float
    deliveries: int = 1


@dataclass
class _Partition:
    entries: list[tuple[str, bytes | None, bool]] = field(default_factory=list)  # id, data, has the field
    pel: dict[str, _Pending] = field(default_factory=dict)
    next: int = 0  # index of the first entry never delivered to the group


@dataclass
class FakeStream:
    """Partitions of one consumer group (XREADGROUP / XACK / XAUTOCLAIM), leases and membership, all on the
    fake clock. New entries go to whichever consumer reads first, as in Redis: only the relays' leases
    keep a partition to one reader."""

    clock: FakeClock
    partitions: int = 4
    parts: dict[int, _Partition] = field(default_factory=dict)
    acked: list[str] = field(default_factory=list)
    groups: set[str] = field(default_factory=set)
    members: dict[str, float] = field(default_factory=dict)  # relay -> beat lapses at
    leases: dict[int, tuple[str, float]] = field(default_factory=dict)  # partition -> holder, lapses at
    reads: list[tuple[str, list[int]]] = field(default_factory=list)  # (consumer, partitions asked)
    down: bool = False  # Redis unreachable: every call raises ConnectionError
    _seq: int = 0

    def __post_init__(self) -> None:
        self.parts = {p: _Partition() for p in range(self.partitions)}

    def _check(self) -> None:
        if self.down:
            raise ConnectionError("redis is down (fake)")

    def add(self, data: bytes | None, partition: int = 0, *, field_present: bool = True) -> str:
        self._seq += 1
        entry_id = f"{self._seq}-0"
        self.parts[partition].entries.append((entry_id, data, field_present))
        return entry_id

    def publish(self, message: ControlMessage) -> str:
        p = partition_of(message.trajectory_id, self.partitions)
        return self.add(encode_message(message), p)

    def pending(self) -> int:
        return sum(len(part.pel) for part in self.parts.values())

    async def ensure_group(self, group: str, *, start_id: str = "0") -> bool:
        self._check()
        created = group not in self.groups
        self.groups.add(group)
        return created

    async def read(
        self,
        group: str,
        consumer: str,
        *,
        partitions: Sequence[int],
        count: int = 16,
        block_ms: int | None = None,
    ) -> list[RelayDelivery]:
        self._check()
        assert group in self.groups, "read before ensure_group"
        self.reads.append((consumer, list(partitions)))
        out: list[RelayDelivery] = []
        for p in partitions:
            part = self.parts[p]
            fresh = part.entries[part.next : part.next + count - len(out)]
            part.next += len(fresh)
            for entry_id, _, _ in fresh:
                part.pel[entry_id] = _Pending(consumer, self.clock.now())
                out.append(self._delivery(p, entry_id))
        if not out and block_ms:
            await asyncio.sleep(0)
        return out

    async def ack(self, group: str, partition: int, *entry_ids: str) -> int:
        self._check()
        n = 0
        for e in entry_ids:
            if self.parts[partition].pel.pop(e, None) is not None:
                self.acked.append(e)
                n += 1
        return n

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
        self._check()
        now = self.clock.now()
        part = self.parts[partition]
        stale = [e for e, p in part.pel.items() if (now - p.since) * 1000 >= min_idle_ms][:count]
        for e in stale:
            part.pel[e] = _Pending(consumer, now, part.pel[e].deliveries + 1)
        return RelayClaim([self._delivery(partition, e) for e in stale], "0-0", [])

    async def beat(self, name: str, ttl_ms: int) -> list[str]:
        self._check()
        now = self.clock.now()
        self.members[name] = now + ttl_ms / 1000
        self.members = {m: t for m, t in self.members.items() if t > now}
        return sorted(self.members)

    async def hold(self, name: str, partitions: Sequence[int], ttl_ms: int) -> set[int]:
        self._check()
        now = self.clock.now()
        held: set[int] = set()
        for p in partitions:
            holder = self.leases.get(p)
            if holder is None or holder[1] <= now or holder[0] == name:
                self.leases[p] = (name, now + ttl_ms / 1000)
                held.add(p)
        return held

    async def release(self, name: str, partitions: Sequence[int]) -> int:
        self._check()
        n = 0
        for p in partitions:
            if self.leases.get(p, ("", 0.0))[0] == name:
                del self.leases[p]
                n += 1
        return n

    async def close(self) -> None:
        return None

    def _delivery(self, partition: int, entry_id: str) -> RelayDelivery:
        # decoded as ControlStream does, then converted by the adapter the relay actor really uses
        data, present = next((d, f) for e, d, f in self.parts[partition].entries if e == entry_id)
        if not present:
            error = CodecError("the entry has no message field 'm'", where=entry_id)
            return relay_delivery(Delivery(entry_id, None, error, partition, EntryProblem.MISSING_FIELD))
        assert data is not None
        try:
            return relay_delivery(Delivery(entry_id, decode_message(data), None, partition))
        except CodecError as e:
            return relay_delivery(Delivery(entry_id, None, e, partition, EntryProblem.MALFORMED))


@dataclass
class FakeTargets:
    """Trajectory 'actors' that record each message id once; ``answer`` overrides per trajectory; ``fail``
    makes a delivery raise (the trajectory could not be reached); ``gate`` (by message id or trajectory)
    holds a delivery until the event is set."""

    known: set[str] = field(default_factory=set)
    records: dict[str, list[str]] = field(default_factory=dict)  # trajectory -> recorded message ids
    delivered: list[tuple[str, str]] = field(default_factory=list)  # (trajectory, action) in arrival order
    calls: dict[str, int] = field(default_factory=dict)
    answer: dict[str, str] = field(default_factory=dict)
    fail: Callable[[str], bool] = lambda _tid: False
    gate: dict[str, asyncio.Event] = field(default_factory=dict)
    received_at: dict[str, float] = field(default_factory=dict)  # message id -> first received_at seen

    async def deliver(self, envelope: ControlEnvelope, received_at: float) -> str:
        tid = envelope.trajectory_id
        self.received_at.setdefault(envelope.message_id, received_at)
        self.calls[tid] = self.calls.get(tid, 0) + 1
        held = self.gate.get(envelope.message_id) or self.gate.get(tid)
        if held is not None:
            await held.wait()
        if self.fail(tid):
            raise ConnectionError(f"traj:{tid} died mid-call")
        if tid in self.answer:
            return self.answer[tid]
        if tid not in self.known:
            return UNKNOWN
        log = self.records.setdefault(tid, [])
        if envelope.message_id in log:
            return "duplicate"
        log.append(envelope.message_id)
        self.delivered.append((tid, envelope.action))
        return "recorded"


@dataclass
class FakeAudit:
    entries: list[AuditEntry] = field(default_factory=list)

    async def write(self, entry: AuditEntry) -> None:
        self.entries.append(entry)

    async def close(self) -> None:
        return None

    def reasons(self) -> list[str]:
        return [e.reason for e in self.entries]


@dataclass(eq=False)
class FakeActor:
    tid: str
    incarnation: int
    state: str = "alive"  # alive | pending | exiting | dead
    calls: list[tuple[str, tuple[Any, ...]]] = field(default_factory=list)
    placed: asyncio.Event = field(default_factory=asyncio.Event)
    ended: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class FakeRuntime:
    """Names map to incarnations the way Ray's do: a dead actor keeps its name until it is killed (someone
    pins it with a handle); ``create`` returns whoever holds the name (``get_if_exists``)."""

    names: dict[str, FakeActor] = field(default_factory=dict)
    created: list[FakeActor] = field(default_factory=list)
    kill_frees_names: bool = True
    start_pending: bool = False
    running: int = 0
    peak_running: int = 0

    async def lookup(self, trajectory_id: str) -> FakeActor | None:
        return self.names.get(trajectory_id)

    async def create(self, launch: Any) -> FakeActor:
        tid = launch["id"]
        if tid in self.names:
            return self.names[tid]
        actor = FakeActor(tid, len(self.created) + 1, state="pending" if self.start_pending else "alive")
        if not self.start_pending:
            actor.placed.set()
        self.names[tid] = actor
        self.created.append(actor)
        return actor

    async def kill(self, handle: FakeActor) -> None:
        handle.state = "dead"
        handle.ended.set()
        handle.placed.set()
        if self.kill_frees_names and self.names.get(handle.tid) is handle:
            del self.names[handle.tid]

    async def call(self, handle: FakeActor, method: str, *args: Any) -> Any:
        await handle.placed.wait()  # as Ray: a call to an actor not placed yet waits in its queue
        if handle.state == "dead":
            raise ActorGone(f"incarnation {handle.incarnation} is dead")
        if handle.state == "exiting":
            raise ActorBusy("hibernating; deliver again")
        handle.calls.append((method, args))
        return "recorded"

    async def run(self, handle: FakeActor) -> None:
        self.running += 1
        self.peak_running = max(self.peak_running, self.running)
        try:
            await handle.ended.wait()
        finally:
            self.running -= 1


@dataclass
class Launches:
    infos: dict[str, TrajectoryInfo] = field(default_factory=dict)
    loads: int = 0

    def add(self, tid: str, state: str = "AWAITING_APPROVAL") -> None:
        self.infos[tid] = TrajectoryInfo({"id": tid}, state)

    async def __call__(self, tid: str) -> TrajectoryInfo | None:
        self.loads += 1
        return self.infos.get(tid)
