"""Record snapshots (``runtime.snapshot``): recovery from a snapshot plus the tail after it is exact.

The contract: for any log the live harness could have written and any point at which it is compacted,
folding the snapshot of the prefix and then the rest gives the record folding the whole log gives; a log
whose trim never happened (a crash after the snapshot's append) folds the same; malformed snapshots are
refused by name.
"""

from __future__ import annotations

import zlib
from dataclasses import replace
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.codec import decode, encode
from runtime.errors import CodecError
from runtime.events import Event
from runtime.fold import fold
from runtime.record import PromptAnchor
from runtime.snapshot import (
    MAGIC,
    decode_snapshot,
    encode_snapshot,
    events_after_snapshot,
    fold_entries,
    is_snapshot,
)
from tests.unit.runtime.scenario import Log, examples
from tests.unit.runtime.test_fold import legal_logs


def _entries(events: list[Event], start: int = 0) -> list[tuple[str, bytes]]:
    return [(f"0-{start + i}", encode(e)) for i, e in enumerate(events)]


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(legal_logs(), st.data())
def test_snapshot_plus_tail_folds_to_the_record_of_the_whole_log(log: Any, data: st.DataObject) -> None:
    # Given a legal log, compacted at its first and last entries and at five points drawn between them
    # (every point of every log made this test quadratic: 68 s of the suite for the same property)
    events, records = log
    whole = fold(events)
    n = len(events)
    drawn = data.draw(st.lists(st.integers(1, n), min_size=5, max_size=5), label="cut points")
    for k in sorted({1, n, *drawn}):
        snapshot = encode_snapshot(records[k - 1])  # the live record after events[:k]
        # When the trimmed log (snapshot, then the tail) is folded
        trimmed = [("1-0", snapshot), *_entries(events[k:], start=1)]
        # Then it is the record of the whole log, and so is the untrimmed one (a crash before the trim)
        assert fold_entries(trimmed) == whole
        untrimmed = [*_entries(events[:k]), (f"0-{k}", snapshot), *_entries(events[k:], start=k + 1)]
        assert fold_entries(untrimmed) == whole
        assert events_after_snapshot(trimmed) == events[k:]


def test_a_record_with_every_event_kind_in_its_transcript_round_trips() -> None:
    # Given a record whose transcript holds events of every registered kind
    log = Log()
    log.call_model()
    log.hold()
    record = log.record
    record = type(record)(
        **{f: getattr(record, f) for f in record.__dataclass_fields__ if f != "transcript"},
        transcript=tuple(examples()),
    )
    # When it is snapshotted and read back
    back = decode_snapshot(encode_snapshot(record), record.policy)
    # Then nothing changed: spend, the held call, the transcript
    assert back == record
    assert back.spend == record.spend and back.held == record.held and back.transcript == record.transcript
    assert back.policy is record.policy


def test_a_log_without_a_snapshot_folds_as_before() -> None:
    log = Log()
    log.call_model()
    assert fold_entries(_entries(log.events)) == log.record


def test_the_event_codec_refuses_a_snapshot_and_a_snapshot_is_told_from_an_event() -> None:
    log = Log()
    snapshot = encode_snapshot(log.record)
    assert is_snapshot(snapshot) and not is_snapshot(encode(log.events[0]))
    with pytest.raises(CodecError):
        decode(snapshot)


def _packed(body: dict[str, Any]) -> bytes:
    return MAGIC + b"z" + zlib.compress(msgpack.packb(body, use_bin_type=True))


def _valid_body() -> dict[str, Any]:
    raw = zlib.decompress(encode_snapshot(Log().record)[2:])
    body: dict[str, Any] = msgpack.unpackb(raw, raw=False)
    return body


def _without(record: dict[str, Any], name: str) -> dict[str, Any]:
    return {k: v for k, v in record.items() if k != name}


def test_a_snapshot_written_before_a_defaulted_record_field_existed_still_decodes() -> None:
    # Given a snapshot of a record with a prompt anchor, the field removed (as written before it existed)
    record = replace(Log().record, prompt_anchor=PromptAnchor(basis=900, reported=310))
    assert decode_snapshot(encode_snapshot(record)) == record
    raw = msgpack.unpackb(zlib.decompress(encode_snapshot(record)[2:]), raw=False)
    old = _packed({**raw, "record": _without(raw["record"], "prompt_anchor")})
    # When it is decoded / Then the field takes its default and everything else is as it was
    assert decode_snapshot(old) == replace(record, prompt_anchor=None)


@pytest.mark.parametrize(
    ("mangle", "where"),
    [
        (lambda b: b"x" + b, "snapshot"),
        (lambda b: MAGIC + b"q" + b[2:], "snapshot"),
        (lambda b: MAGIC + b"z" + b"not zlib", "snapshot"),
        (lambda b: _packed({**_valid_body(), "v": 2}), "snapshot.v"),
        (lambda b: _packed({**_valid_body(), "event_schema": 99}), "snapshot.event_schema"),
        (lambda b: _packed({k: v for k, v in _valid_body().items() if k != "transcript"}), "snapshot"),
        (
            lambda b: _packed({**_valid_body(), "record": {**_valid_body()["record"], "turn_count": "1"}}),
            "record.turn_count",
        ),
        (
            lambda b: _packed({**_valid_body(), "record": {**_valid_body()["record"], "extra": 1}}),
            "snapshot.record",
        ),
        (  # a field without a default is required
            lambda b: _packed({**_valid_body(), "record": _without(_valid_body()["record"], "turn_count")}),
            "snapshot.record",
        ),
        (lambda b: _packed({**_valid_body(), "transcript": [["no_such_kind", {}]]}), "transcript[0]"),
    ],
)
def test_a_malformed_snapshot_is_refused_by_name(mangle: Any, where: str) -> None:
    bad = mangle(encode_snapshot(Log().record))
    with pytest.raises(CodecError) as info:
        decode_snapshot(bad)
    assert info.value.where is not None and info.value.where.startswith(where)
