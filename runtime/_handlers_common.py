"""What every per-event handler of ``runtime.fold.apply`` shares: the refusal, and small pure record updates.

A handler takes the current record and one event and returns the next record, or refuses the event with
``IllegalEvent`` naming the failed rule. Handlers never touch ``log_position``: ``apply`` advances it once per
accepted event.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NoReturn, TypeVar

from runtime.budget import Spend
from runtime.errors import IllegalEvent
from runtime.events import Event
from runtime.record import AuditEntry, AuditKind, TrajectoryRecord
from runtime.states import TrajectoryState

E = TypeVar("E")

Handler = Callable[[TrajectoryRecord, Any], TrajectoryRecord]
"""The shape of every rule in ``apply``'s table: the record and one event of the handler's type."""


def refuse(record: TrajectoryRecord, event: Event, rule: str, message: str) -> NoReturn:
    """Refuse ``event`` before anything is written, naming the failed ``rule``."""
    raise IllegalEvent(event.kind, record.state, rule, message)


def require_state(record: TrajectoryRecord, event: Event, *states: TrajectoryState) -> None:
    """Refuse ``event`` unless the record is in one of ``states``."""
    if record.state not in states:
        allowed = ", ".join(states)
        refuse(record, event, "wrong_state", f"accepted only in {allowed}")


def charged(record: TrajectoryRecord, amounts: Mapping[str, float]) -> Spend:
    """The record's spend after adding the positive ``amounts`` (zero charges leave it as it is)."""
    positive = {dim: amount for dim, amount in amounts.items() if amount > 0}
    return record.spend.add(Spend(positive)) if positive else record.spend


def without_item(mapping: Mapping[str, E], key: str) -> dict[str, E]:
    """A copy of ``mapping`` without ``key``."""
    return {k: v for k, v in mapping.items() if k != key}


def appended(items: tuple[E, ...], item: E) -> tuple[E, ...]:
    """``items`` with ``item`` at the end. For the record's sequences that grow with the trajectory (its
    transcript, transition history and audit): one concatenation copies the tuple once, where
    ``(*items, item)`` builds a list first and copies twice (14 against 36 us at 9,000 entries)."""
    return items + (item,)  # noqa: RUF005 - see the docstring


def with_item(mapping: Mapping[str, E], key: str, value: E) -> dict[str, E]:
    """A copy of ``mapping`` with ``key`` set to ``value``."""
    return {**mapping, key: value}


def audit(record: TrajectoryRecord, kind: AuditKind, subject: str, reason: str) -> tuple[AuditEntry, ...]:
    """The record's audit trail with one entry appended at the current log position."""
    return appended(record.audit, AuditEntry(record.log_position, kind, subject, reason))
