"""Record snapshots: a folded record written into its own log, so the entries before it can be trimmed.

A hibernating trajectory's cost at rest is its log (about 200 bytes per event; a few dozen events per turn).
Its record is the fold of that log, so the log can be compacted: the record is written as one *snapshot
entry* at the end of the log, and the entries before it are then trimmed (``LogStore.trim``). Recovery is
the snapshot plus the tail after it, and gives the same record as folding the whole log would
(``fold_entries``; the contract test in ``tests/unit/runtime/test_snapshot.py`` checks it for generated
logs).

Crash safety comes from the order: the snapshot is appended (durably, like any batch) *before* the trim,
and the trim removes only entries older than the snapshot. A log whose trim never happened (a crash between
the two) holds the whole history and then the snapshot; ``fold_entries`` starts from the last snapshot in
the log and ignores what it covers, so nothing is lost and nothing is applied twice.

Wire shape: ``MAGIC`` (``0xc1``, a byte msgpack never produces, so no event payload starts with it; the
event codec refuses a snapshot with a clear error), one format byte, then a zlib-compressed msgpack map
``{"v": SNAPSHOT_VERSION, "event_schema": <codec SCHEMA_VERSION>, "record": {<field>: <value>},
"transcript": [[<kind>, <data>], ...]}``. The record's fields are encoded by the event codec's rules; the
transcript (events the model's context is rebuilt from) as the events themselves; the policy is not stored
(it comes from the launch, as it does for ``fold``). Decoding validates as strictly as the event codec.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Iterable, Sequence
from typing import Any

import msgpack

from runtime.codec import SCHEMA_VERSION, decode, decode_value, defaulted_fields, encode_value, field_types
from runtime.errors import CodecError, IllegalEvent, InvalidLog
from runtime.events import EVENT_TYPES, Event
from runtime.fold import apply, fold
from runtime.policy import TrajectoryPolicy
from runtime.record import TrajectoryRecord

__all__ = [
    "MAGIC",
    "SNAPSHOT_VERSION",
    "decode_snapshot",
    "encode_snapshot",
    "events_after_snapshot",
    "fold_entries",
    "is_snapshot",
    "last_snapshot",
    "resume",
]

MAGIC = b"\xc1"
"""First byte of a snapshot payload: msgpack never emits 0xc1, so an event payload cannot start with it."""
SNAPSHOT_VERSION = 1
_ZLIB = b"z"  # the format byte: zlib-compressed msgpack
_NOT_STORED = frozenset({"policy", "transcript"})  # the policy comes from the launch; transcript below


@functools.cache
def _record_fields() -> tuple[tuple[str, Any], ...]:
    fields = field_types(TrajectoryRecord, {"TrajectoryPolicy": TrajectoryPolicy})
    return tuple((name, tp) for name, tp in fields if name not in _NOT_STORED)


def is_snapshot(payload: bytes) -> bool:
    """Whether a log payload is a record snapshot (not an event)."""
    return bytes(payload[:1]) == MAGIC


def encode_snapshot(record: TrajectoryRecord) -> bytes:
    """``record`` as one log payload. Raises ``CodecError`` if it holds a value the codec cannot store."""
    body = {name: encode_value(tp, getattr(record, name), f"record.{name}") for name, tp in _record_fields()}
    transcript = []
    for i, event in enumerate(record.transcript):
        cls = type(event)
        if EVENT_TYPES.get(getattr(cls, "kind", "")) is not cls:
            raise CodecError(f"{cls.__name__} is not a registered event type", where=f"transcript[{i}]")
        assert isinstance(event, Event)
        transcript.append([event.kind, encode_value(cls, event, f"transcript[{i}]")])
    packed = msgpack.packb(
        {"v": SNAPSHOT_VERSION, "event_schema": SCHEMA_VERSION, "record": body, "transcript": transcript},
        use_bin_type=True,
    )
    return MAGIC + _ZLIB + zlib.compress(packed, 6)


def decode_snapshot(payload: bytes, policy: TrajectoryPolicy | None = None) -> TrajectoryRecord:
    """The record a snapshot holds, governed by ``policy`` (defaults without one, as ``fold``).
    Raises ``CodecError`` naming the field path for anything malformed."""
    data = bytes(payload)
    if data[:1] != MAGIC:
        raise CodecError("not a record snapshot", where="snapshot")
    if data[1:2] != _ZLIB:
        raise CodecError(f"unknown snapshot format {data[1:2]!r}", where="snapshot")
    try:
        raw = msgpack.unpackb(zlib.decompress(data[2:]), raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # zlib.error, msgpack's many exception types
        raise CodecError(f"snapshot does not unpack ({type(exc).__name__}: {exc})", where="snapshot") from exc
    if not isinstance(raw, dict) or set(raw) != {"v", "event_schema", "record", "transcript"}:
        raise CodecError("expected a map of v, event_schema, record, transcript", where="snapshot")
    if raw["v"] != SNAPSHOT_VERSION or type(raw["v"]) is not int:
        raise CodecError(f"unsupported snapshot version {raw['v']!r}", where="snapshot.v")
    if raw["event_schema"] != SCHEMA_VERSION or type(raw["event_schema"]) is not int:
        raise CodecError(
            f"snapshot of event schema {raw['event_schema']!r} (this build reads {SCHEMA_VERSION})",
            where="snapshot.event_schema",
        )
    body, transcript = raw["record"], raw["transcript"]
    if not isinstance(body, dict) or not isinstance(transcript, list):
        raise CodecError("record must be a map and transcript a list", where="snapshot")
    fields = _record_fields()
    names = {name for name, _ in fields}
    # a field added with a default may be absent (snapshots written before it existed)
    missing = names - set(body) - defaulted_fields(TrajectoryRecord)
    unknown = set(body) - names
    if missing or unknown:
        raise CodecError(f"missing {sorted(missing)}, unknown {sorted(unknown)}", where="snapshot.record")
    kwargs = {name: decode_value(tp, body[name], f"record.{name}") for name, tp in fields if name in body}
    events: list[Event] = []
    for i, item in enumerate(transcript):
        if not isinstance(item, list) or len(item) != 2 or not isinstance(item[0], str):
            raise CodecError("expected [kind, data]", where=f"transcript[{i}]")
        cls = EVENT_TYPES.get(item[0])
        if cls is None:
            raise CodecError(f"unknown event kind {item[0]!r}", where=f"transcript[{i}]")
        events.append(decode_value(cls, item[1], f"transcript[{i}]"))
    policy = policy if policy is not None else TrajectoryPolicy()
    try:
        return TrajectoryRecord(**kwargs, transcript=tuple(events), policy=policy)
    except (ValueError, TypeError) as exc:
        raise CodecError(str(exc), where="snapshot.record") from exc


def last_snapshot(entries: Sequence[tuple[str, bytes]]) -> int | None:
    """Index of the newest snapshot entry among ``(entry_id, payload)`` pairs, or None."""
    for i in range(len(entries) - 1, -1, -1):
        if is_snapshot(entries[i][1]):
            return i
    return None


def resume(record: TrajectoryRecord, events: Iterable[Event], *, first_index: int = 0) -> TrajectoryRecord:
    """``record`` with ``events`` applied in order; ``InvalidLog`` names the entry (counted from
    ``first_index``) that ``apply`` refuses."""
    for index, event in enumerate(events, start=first_index):
        try:
            record = apply(record, event)
        except IllegalEvent as exc:
            raise InvalidLog(str(exc), where=f"event[{index}]") from exc
    return record


def fold_entries(
    entries: Sequence[tuple[str, bytes]], policy: TrajectoryPolicy | None = None
) -> TrajectoryRecord:
    """The record of a stored log: the newest snapshot plus the events after it, or the fold of every event
    when the log holds no snapshot. Equal to folding the whole history the snapshot was taken from."""
    at = last_snapshot(entries)
    if at is None:
        return fold((decode(payload) for _, payload in entries), policy)
    record = decode_snapshot(entries[at][1], policy)
    tail = (decode(payload) for _, payload in entries[at + 1 :])
    return resume(record, tail, first_index=at + 1)


def events_after_snapshot(entries: Sequence[tuple[str, bytes]]) -> list[Event]:
    """The events a stored log holds after its newest snapshot (all of them when it has none)."""
    at = last_snapshot(entries)
    start = 0 if at is None else at + 1
    return [decode(payload) for _, payload in entries[start:]]
