"""The control message schema and its msgpack codec: round trips, and bad bytes named by field."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from cluster.control import (
    MAX_MESSAGE_BYTES,
    ControlAction,
    ControlMessage,
    LiveEvent,
    decode_event,
    decode_message,
    encode_event,
    encode_message,
)
from cluster.signing import canonical_bytes
from runtime.errors import CodecError

IDENTITY = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,20}", fullmatch=True)
JSON_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
JSON = st.recursive(
    JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=12,
)
PAYLOAD_KEYS = st.text(max_size=12).filter(lambda k: k not in ("call_digest", "message", "escalation_id"))


@st.composite
def messages(draw: st.DrawFn) -> ControlMessage:
    action = draw(st.sampled_from(ControlAction))
    payload: dict[str, Any] = draw(st.dictionaries(PAYLOAD_KEYS, JSON, max_size=4))
    if action in (ControlAction.APPROVE, ControlAction.DENY):
        payload["call_digest"] = draw(st.from_regex(r"[0-9a-f]{64}", fullmatch=True))
    if action is ControlAction.INTERRUPT and draw(st.booleans()):
        payload["message"] = draw(st.text(max_size=50))
    if action is ControlAction.ACKNOWLEDGE:
        payload["escalation_id"] = draw(st.from_regex(r"esc-[!-~]{1,60}", fullmatch=True))
    issued = draw(st.floats(min_value=0, max_value=4e9))
    return ControlMessage(
        message_id=draw(st.from_regex(r"[A-Za-z0-9._:-]{8,40}", fullmatch=True)),
        trajectory_id=draw(st.from_regex(r"[!-~]{1,60}", fullmatch=True)),
        action=action,
        issuer=draw(IDENTITY),
        reason=draw(st.text(max_size=100)),
        issued_at=issued,
        expires_at=issued + draw(st.floats(min_value=1.0, max_value=1e6)),
        nonce=draw(st.from_regex(r"[A-Za-z0-9_-]{16,40}", fullmatch=True)),
        payload=payload,
        signatures=tuple(
            draw(st.lists(st.tuples(IDENTITY, st.binary(min_size=64, max_size=64)), max_size=3))
        ),
    )


@given(messages())
def test_every_valid_message_survives_the_codec_unchanged(message: ControlMessage) -> None:
    # Given any valid message
    # When it is encoded and decoded
    decoded = decode_message(encode_message(message))

    # Then it is equal, and the bytes its signatures cover are the same
    assert decoded == message
    assert canonical_bytes(decoded) == canonical_bytes(message)


@given(messages(), st.randoms())
def test_the_signed_bytes_do_not_depend_on_payload_key_order(message: ControlMessage, rnd: Any) -> None:
    # Given the same payload built with its keys in another order
    items = list(message.payload.items())
    rnd.shuffle(items)
    reordered = message.model_copy(update={"payload": dict(items)})

    # When the canonical signing bytes are computed
    # Then they are identical
    assert canonical_bytes(reordered) == canonical_bytes(message)


def _valid_doc(**changes: Any) -> dict[str, Any]:
    message = ControlMessage.create(
        "t-1", ControlAction.APPROVE, "alice", now=1000.0, payload={"call_digest": "ab"}
    )
    doc: dict[str, Any] = msgpack.unpackb(encode_message(message))
    doc.update(changes)
    return doc


def _without(key: str) -> dict[str, Any]:
    doc = _valid_doc()
    del doc[key]
    return doc


@pytest.mark.parametrize(
    ("data", "where"),
    [
        (b"\xc1", "control message"),
        (msgpack.packb([1, 2, 3]), "control message"),
        (msgpack.packb(_valid_doc(schema_version=2)), "'schema_version'"),
        (msgpack.packb(_without("schema_version")), "'schema_version'"),
        (msgpack.packb(_valid_doc(action="explode")), "'action'"),
        (msgpack.packb(_without("nonce")), "'nonce'"),
        (msgpack.packb(_valid_doc(nonce="short")), "'nonce'"),
        (msgpack.packb(_valid_doc(trajectory_id="has space")), "'trajectory_id'"),
        (msgpack.packb(_valid_doc(issuer="-leading-dash")), "'issuer'"),
        (msgpack.packb(_valid_doc(issued_at=float("nan"))), "'issued_at'"),
        (msgpack.packb(_valid_doc(signatures=[["alice", b"short"]])), "'signatures.0.1'"),
        (msgpack.packb(_valid_doc(signatures=[["alice"]])), "'signatures.0"),
        (msgpack.packb(_valid_doc(sudo=True)), "'sudo'"),
        (msgpack.packb(_valid_doc(expires_at=999.0)), "expires_at"),
        (msgpack.packb(_valid_doc(payload={})), "call_digest"),
        (msgpack.packb(_valid_doc(reason="x" * (MAX_MESSAGE_BYTES + 1))), "limit"),
    ],
    ids=[
        "not-msgpack",
        "not-a-map",
        "future-version",
        "no-version",
        "unknown-action",
        "missing-nonce",
        "short-nonce",
        "bad-trajectory-id",
        "bad-issuer",
        "nan-time",
        "short-signature",
        "signature-not-a-pair",
        "unknown-field",
        "expiry-before-issue",
        "approve-without-digest",
        "oversized",
    ],
)
def test_bad_bytes_are_a_codec_error_naming_the_field(data: bytes, where: str) -> None:
    # Given bytes that are not a valid version-1 control message
    # When decoded
    # Then CodecError says where the problem is
    with pytest.raises(CodecError) as caught:
        decode_message(data)
    assert where in str(caught.value)


@pytest.mark.parametrize(
    ("action", "payload", "ok"),
    [
        (ControlAction.APPROVE, {"call_digest": "d1"}, True),
        (ControlAction.DENY, {"call_digest": "d1"}, True),
        (ControlAction.APPROVE, {}, False),
        (ControlAction.DENY, {"call_digest": 7}, False),
        (ControlAction.INTERRUPT, {"message": "please re-check the tests"}, True),
        (ControlAction.INTERRUPT, {"message": ["not", "text"]}, False),
        (ControlAction.KILL, {}, True),
    ],
)
def test_action_specific_payload_rules(action: ControlAction, payload: dict[str, Any], ok: bool) -> None:
    # Given a payload for an action
    # When a message is built
    # Then approvals must bind to a call digest and an interrupt's message must be text
    if ok:
        assert ControlMessage.create("t", action, "alice", now=1.0, payload=payload).payload == payload
    else:
        with pytest.raises(ValidationError):
            ControlMessage.create("t", action, "alice", now=1.0, payload=payload)


def test_create_makes_fresh_ids_and_a_window_from_now() -> None:
    # Given two messages created at the same instant
    a = ControlMessage.create("t", "pause", "alice", now=500.0, ttl_s=30.0)
    b = ControlMessage.create("t", "pause", "alice", now=500.0, ttl_s=30.0)

    # Then each has its own id and nonce, and is valid for 30 s from now, unsigned
    assert a.message_id != b.message_id and a.nonce != b.nonce
    assert (a.issued_at, a.expires_at, a.signatures) == (500.0, 530.0, ())


def test_a_message_is_immutable() -> None:
    message = ControlMessage.create("t", "pause", "alice", now=1.0)
    with pytest.raises(ValidationError):
        message.reason = "changed"  # type: ignore[misc]


@given(
    st.builds(
        LiveEvent,
        trajectory_id=st.from_regex(r"[!-~]{1,40}", fullmatch=True),
        kind=st.sampled_from(["state", "control_rejected", "budget.stage"]),
        at=st.floats(min_value=0, max_value=4e9),
        data=st.dictionaries(st.text(max_size=8), JSON, max_size=4),
    )
)
def test_live_events_survive_the_codec(event: LiveEvent) -> None:
    assert decode_event(encode_event(event)) == event


def test_a_bad_live_event_names_the_field() -> None:
    data = msgpack.packb({"trajectory_id": "t", "kind": "State!", "at": 1.0})
    with pytest.raises(CodecError, match="'kind'"):
        decode_event(data)
