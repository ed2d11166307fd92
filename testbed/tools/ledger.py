"""The testbed's own, independent ledger of external effects.

This is the ground truth fault tests judge by (recovery chapter, fault-test plan: duplicate external
effects, orphaned resources, billed charges), kept by the simulated dependency itself and never by
the runtime under test. It is read over gRPC (``LedgerService.Query``) as a ``LedgerSnapshot``.

Two records, kept apart:

- **deliveries**: every physical arrival of an Invoke (tool, effect key, call id, attempt id, arrival
  time), with the key's state when it arrived and what the service then did with it. This is what the
  runtime *sent*, whatever the service made of it.
- **effects**: what the services really *applied* (environments, notifications, effect counts).

A runtime that re-dispatches a call it has no right to repeat shows up in the deliveries even when a
service honours effect keys and applies nothing twice: ``duplicate_deliveries()`` is the judge of "no
duplicate", and it cannot be hidden by deduplication on the service's side.
"""

from __future__ import annotations

import itertools
import threading
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict

from runtime.clock import Clock, SystemClock
from testbed.tools import testbed_tools_pb2 as tpb

__all__ = [
    "NOT_REPEATABLE",
    "DeliveryRecord",
    "EffectCount",
    "EnvironmentRecord",
    "Ledger",
    "LedgerSnapshot",
    "NoteRead",
    "NoteRecord",
    "NotificationRecord",
]

# Tools whose repeat is a second effect: each provisioning allocates (and bills) a new environment, each
# notification is sent again. ``release_env`` is idempotent by nature (releasing twice changes nothing)
# and ``run_tests``/``search_packages`` are read-only: repeating those is no defect.
NOT_REPEATABLE: frozenset[str] = frozenset({"provision_env", "send_notification"})

# A delivery that reaches the tool while its key is already applied, still being applied, or left
# half-done is a repeat of an effect nobody established absent: a duplicate delivery.
_REPEAT_PRIORS = frozenset({"in_flight", "applied", "unknown"})
# ...unless the service refused it before looking at the key (past its deadline, or fenced by a probe).
_REFUSED_ON_ARRIVAL = frozenset({"late", "fenced"})


class DeliveryRecord(BaseModel):
    """One physical arrival of an Invoke, and what the service did with it."""

    model_config = ConfigDict(frozen=True)

    seq: int
    tool: str
    effect_key: str
    call_id: str
    attempt_id: str
    operation_id: str
    trajectory_id: str
    arrived_at: float
    prior: str  # new | in_flight | applied | absent | unknown: the key's state on arrival
    disposition: str = "pending"  # pending | late | fenced | applied | deduplicated | refused | unknown
    reply: str = "pending"  # pending | answered | dropped | abandoned | error:<STATUS>
    deadline: float = 0.0  # the absolute deadline the request carried (0: none)
    disposed_at: float | None = None  # when the service was done with it (None: still pending)

    @property
    def repeats_an_effect(self) -> bool:
        """Whether this delivery asked again for an effect that had happened (or might have)."""
        return self.prior in _REPEAT_PRIORS and self.disposition not in _REFUSED_ON_ARRIVAL


class EnvironmentRecord(BaseModel):
    """One environment the provisioner allocated (and maybe released)."""

    model_config = ConfigDict(frozen=True)

    env_id: str
    tenant: str
    effect_key: str
    allocated_at: float
    released_at: float | None = None
    billed_seconds: float = 0.0

    @property
    def allocated(self) -> bool:
        return self.released_at is None


class NotificationRecord(BaseModel):
    model_config = ConfigDict(frozen=True)

    notification_id: str
    recipient: str
    message: str
    effect_key: str
    sent_at: float


class NoteRecord(BaseModel):
    """A note the notes service holds (an artifact other trajectories may read)."""

    model_config = ConfigDict(frozen=True)

    note_id: str
    title: str
    effect_key: str
    written_at: float
    deleted_at: float | None = None


class NoteRead(BaseModel):
    """One read of a note that reached the service (a quarantined note read here is a containment breach)."""

    model_config = ConfigDict(frozen=True)

    note_id: str
    effect_key: str
    read_at: float


class EffectCount(BaseModel):
    """How many times one effect key was really applied by one tool (> 1 is a duplicate effect)."""

    model_config = ConfigDict(frozen=True)

    tool: str
    effect_key: str
    applications: int


class LedgerSnapshot(BaseModel):
    """The ledger at one moment, as a fault test reads it."""

    model_config = ConfigDict(frozen=True)

    environments: tuple[EnvironmentRecord, ...] = ()
    notifications: tuple[NotificationRecord, ...] = ()
    effects: tuple[EffectCount, ...] = ()
    billed_seconds: float = 0.0
    test_runs: int = 0
    searches: int = 0
    notes: tuple[NoteRecord, ...] = ()
    note_reads: tuple[NoteRead, ...] = ()

    def reads_of(self, note_id: str) -> list[NoteRead]:
        """Every read of ``note_id`` that reached the service."""
        return [r for r in self.note_reads if r.note_id == note_id]

    deliveries: tuple[DeliveryRecord, ...] = ()
    effect_keys: str = "ignore"  # the services' mode: "ignore" applies every delivery, "honour" dedupes

    def duplicate_effects(self) -> list[EffectCount]:
        """Effect keys applied more than once."""
        return [e for e in self.effects if e.applications > 1]

    def duplicate_deliveries(self, tools: Iterable[str] = NOT_REPEATABLE) -> list[DeliveryRecord]:
        """Deliveries of a non-repeatable tool that asked again for an effect already applied, still in
        flight or left unknown: a re-dispatch the settlement rules forbid, whatever the service applied.
        A repeat after the service refused the key (established absent) is a legitimate retry."""
        wanted = frozenset(tools)
        return [d for d in self.deliveries if d.tool in wanted and d.repeats_an_effect]

    def deliveries_for(self, effect_key: str) -> list[DeliveryRecord]:
        """Every delivery that carried ``effect_key``, in arrival order."""
        return [d for d in self.deliveries if d.effect_key == effect_key]

    def orphaned_environments(self) -> list[EnvironmentRecord]:
        """Environments still allocated (nobody released them)."""
        return [e for e in self.environments if e.allocated]

    def environments_for(self, effect_key: str) -> list[EnvironmentRecord]:
        """Every environment created under ``effect_key``."""
        return [e for e in self.environments if e.effect_key == effect_key]

    @classmethod
    def from_proto(cls, reply: tpb.LedgerReply) -> LedgerSnapshot:
        return cls(
            environments=tuple(
                EnvironmentRecord(
                    env_id=e.env_id,
                    tenant=e.tenant,
                    effect_key=e.effect_key,
                    allocated_at=e.allocated_at,
                    released_at=e.released_at or None,
                    billed_seconds=e.billed_seconds,
                )
                for e in reply.environments
            ),
            notifications=tuple(
                NotificationRecord(
                    notification_id=n.notification_id,
                    recipient=n.recipient,
                    message=n.message,
                    effect_key=n.effect_key,
                    sent_at=n.sent_at,
                )
                for n in reply.notifications
            ),
            effects=tuple(
                EffectCount(tool=e.tool, effect_key=e.effect_key, applications=e.applications)
                for e in reply.effects
            ),
            billed_seconds=reply.billed_seconds,
            test_runs=reply.test_runs,
            searches=reply.searches,
            notes=tuple(
                NoteRecord(
                    note_id=n.note_id,
                    title=n.title,
                    effect_key=n.effect_key,
                    written_at=n.written_at,
                    deleted_at=n.deleted_at or None,
                )
                for n in reply.notes
            ),
            note_reads=tuple(
                NoteRead(note_id=r.note_id, effect_key=r.effect_key, read_at=r.read_at)
                for r in reply.note_reads
            ),
            deliveries=tuple(
                DeliveryRecord(
                    seq=d.seq,
                    tool=d.tool,
                    effect_key=d.effect_key,
                    call_id=d.call_id,
                    attempt_id=d.attempt_id,
                    operation_id=d.operation_id,
                    trajectory_id=d.trajectory_id,
                    arrived_at=d.arrived_at,
                    prior=d.prior,
                    disposition=d.disposition,
                    reply=d.reply,
                    deadline=d.deadline,
                    disposed_at=d.disposed_at or None,
                )
                for d in reply.deliveries
            ),
            effect_keys=reply.effect_keys or "ignore",
        )


@dataclass
class _Env:
    env_id: str
    tenant: str
    effect_key: str
    allocated_at: float
    released_at: float | None = None


class Ledger:
    """Thread-safe (sync tools run in worker threads) record of every delivery the testbed received
    and every effect it applied."""

    def __init__(self, clock: Clock | None = None, *, effect_keys: str = "ignore") -> None:
        self._clock: Clock = clock or SystemClock()
        self._lock = threading.Lock()
        self.effect_keys = effect_keys
        self._deliveries: list[DeliveryRecord] = []
        self._envs: dict[str, _Env] = {}
        self._notifications: list[NotificationRecord] = []
        self._effects: Counter[tuple[str, str]] = Counter()
        self._notes: dict[str, tuple[NoteRecord, str]] = {}  # note id -> (record, body)
        self._note_reads: list[NoteRead] = []
        self._ids = itertools.count(1)
        self.test_runs = 0
        self.searches = 0

    def arrived(
        self,
        *,
        tool: str,
        effect_key: str,
        call_id: str,
        attempt_id: str,
        operation_id: str,
        trajectory_id: str,
        prior: str,
        deadline: float = 0.0,
    ) -> int:
        """Record one physical delivery; returns its sequence number (for ``disposed``)."""
        with self._lock:
            seq = len(self._deliveries)
            self._deliveries.append(
                DeliveryRecord(
                    seq=seq,
                    tool=tool,
                    effect_key=effect_key,
                    call_id=call_id,
                    attempt_id=attempt_id,
                    operation_id=operation_id,
                    trajectory_id=trajectory_id,
                    arrived_at=self._clock.wall(),
                    prior=prior,
                    deadline=deadline,
                )
            )
            return seq

    def disposed(self, seq: int, disposition: str, reply: str) -> None:
        """What became of delivery ``seq``."""
        with self._lock:
            self._deliveries[seq] = self._deliveries[seq].model_copy(
                update={"disposition": disposition, "reply": reply, "disposed_at": self._clock.wall()}
            )

    def record_effect(self, tool: str, effect_key: str) -> None:
        """Count one real application of ``effect_key`` by ``tool``."""
        with self._lock:
            self._effects[(tool, effect_key)] += 1

    def allocate(self, tenant: str, effect_key: str) -> str:
        """Allocate a new environment; billing starts now. Returns its id."""
        with self._lock:
            env_id = f"env-{next(self._ids):05d}"
            self._envs[env_id] = _Env(env_id, tenant, effect_key, self._clock.wall())
            self._effects[("provision_env", effect_key)] += 1
            return env_id

    def release(self, env_id: str, effect_key: str) -> float | None:
        """Stop billing ``env_id``; returns its billed seconds, or ``None`` if there is no such env.

        Releasing twice is harmless (the first release time stands): release is idempotent by nature.
        """
        with self._lock:
            env = self._envs.get(env_id)
            if env is None:
                return None
            if env.released_at is None:
                env.released_at = self._clock.wall()
                self._effects[("release_env", effect_key)] += 1
            return env.released_at - env.allocated_at

    def notify(self, recipient: str, message: str, effect_key: str) -> str:
        with self._lock:
            notification_id = f"ntf-{next(self._ids):05d}"
            self._notifications.append(
                NotificationRecord(
                    notification_id=notification_id,
                    recipient=recipient,
                    message=message,
                    effect_key=effect_key,
                    sent_at=self._clock.wall(),
                )
            )
            self._effects[("send_notification", effect_key)] += 1
            return notification_id

    def write_note(self, note_id: str, title: str, body: str, effect_key: str) -> bool:
        """Store a note under its content address; False when it already existed (writing is idempotent)."""
        with self._lock:
            existing = self._notes.get(note_id)
            if existing is not None and existing[0].deleted_at is None:
                return False
            record = NoteRecord(
                note_id=note_id, title=title, effect_key=effect_key, written_at=self._clock.wall()
            )
            self._notes[note_id] = (record, body)
            self._effects[("write_note", effect_key)] += 1
            return True

    def read_note(self, note_id: str, effect_key: str) -> tuple[str, str] | None:
        """(title, body) of a live note, recording the read; None when there is no such note."""
        with self._lock:
            found = self._notes.get(note_id)
            if found is None or found[0].deleted_at is not None:
                return None
            self._note_reads.append(
                NoteRead(note_id=note_id, effect_key=effect_key, read_at=self._clock.wall())
            )
            return found[0].title, found[1]

    def delete_note(self, note_id: str, effect_key: str) -> bool:
        with self._lock:
            found = self._notes.get(note_id)
            if found is None:
                return False
            if found[0].deleted_at is None:
                record = found[0].model_copy(update={"deleted_at": self._clock.wall()})
                self._notes[note_id] = (record, found[1])
                self._effects[("delete_note", effect_key)] += 1
            return True

    def count_test_run(self) -> None:
        with self._lock:
            self.test_runs += 1

    def count_search(self) -> None:
        with self._lock:
            self.searches += 1

    def snapshot(self) -> LedgerSnapshot:
        """A consistent copy; billed seconds of live environments run up to now."""
        with self._lock:
            now = self._clock.wall()
            envs = tuple(
                EnvironmentRecord(
                    env_id=e.env_id,
                    tenant=e.tenant,
                    effect_key=e.effect_key,
                    allocated_at=e.allocated_at,
                    released_at=e.released_at,
                    billed_seconds=(e.released_at if e.released_at is not None else now) - e.allocated_at,
                )
                for e in self._envs.values()
            )
            return LedgerSnapshot(
                environments=envs,
                notifications=tuple(self._notifications),
                effects=tuple(
                    EffectCount(tool=tool, effect_key=key, applications=n)
                    for (tool, key), n in self._effects.items()
                ),
                billed_seconds=sum(e.billed_seconds for e in envs),
                test_runs=self.test_runs,
                searches=self.searches,
                notes=tuple(record for record, _ in self._notes.values()),
                note_reads=tuple(self._note_reads),
                deliveries=tuple(self._deliveries),
                effect_keys=self.effect_keys,
            )

    def to_proto(self) -> tpb.LedgerReply:
        snap = self.snapshot()
        return tpb.LedgerReply(
            environments=[
                tpb.Environment(
                    env_id=e.env_id,
                    tenant=e.tenant,
                    effect_key=e.effect_key,
                    allocated_at=e.allocated_at,
                    released_at=e.released_at or 0.0,
                    billed_seconds=e.billed_seconds,
                )
                for e in snap.environments
            ],
            notifications=[
                tpb.Notification(
                    notification_id=n.notification_id,
                    recipient=n.recipient,
                    message=n.message,
                    effect_key=n.effect_key,
                    sent_at=n.sent_at,
                )
                for n in snap.notifications
            ],
            effects=[
                tpb.EffectCount(tool=e.tool, effect_key=e.effect_key, applications=e.applications)
                for e in snap.effects
            ],
            billed_seconds=snap.billed_seconds,
            test_runs=snap.test_runs,
            searches=snap.searches,
            notes=[
                tpb.Note(
                    note_id=n.note_id,
                    title=n.title,
                    effect_key=n.effect_key,
                    written_at=n.written_at,
                    deleted_at=n.deleted_at or 0.0,
                )
                for n in snap.notes
            ],
            note_reads=[
                tpb.NoteRead(note_id=r.note_id, effect_key=r.effect_key, read_at=r.read_at)
                for r in snap.note_reads
            ],
            deliveries=[
                tpb.Delivery(
                    seq=d.seq,
                    tool=d.tool,
                    effect_key=d.effect_key,
                    call_id=d.call_id,
                    attempt_id=d.attempt_id,
                    operation_id=d.operation_id,
                    trajectory_id=d.trajectory_id,
                    arrived_at=d.arrived_at,
                    prior=d.prior,
                    disposition=d.disposition,
                    reply=d.reply,
                    deadline=d.deadline,
                    disposed_at=d.disposed_at or 0.0,
                )
                for d in snap.deliveries
            ],
            effect_keys=snap.effect_keys,
        )
