"""The log codec: every event kind round-trips; malformed or unknown input raises ``CodecError`` naming
the field path, and nothing else ever escapes ``decode``."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime import SCHEMA_VERSION, CodecError, CompletionCheck, Event, TaskContract, decode, encode
from runtime.errors import InputError
from tests.unit.runtime.scenario import created, examples

EXAMPLES = examples()


def _raw(event: Event) -> dict[str, Any]:
    unpacked: dict[str, Any] = msgpack.unpackb(encode(event))
    return unpacked


def _pack(obj: Any) -> bytes:
    packed: bytes = msgpack.packb(obj, use_bin_type=True)
    return packed


@pytest.mark.parametrize("event", EXAMPLES, ids=[f"{i}-{e.kind}" for i, e in enumerate(EXAMPLES)])
def test_every_event_kind_round_trips(event: Event) -> None:
    # Given an event, when it is encoded and decoded, then the same event comes back
    decoded = decode(encode(event))
    assert decoded == event
    assert type(decoded) is type(event)
    assert _raw(event)["v"] == SCHEMA_VERSION and _raw(event)["kind"] == event.kind


@pytest.mark.parametrize("event", EXAMPLES, ids=[f"{i}-{e.kind}" for i, e in enumerate(EXAMPLES)])
def test_the_compiled_encoder_writes_what_the_reference_rules_write(event: Event) -> None:
    # encode() runs each type's compiled encoder and falls back to the reference (_encode) only on a refusal
    from runtime.codec import _encode, _encoder

    assert _encoder(type(event))(event) == _encode(type(event), event, "data")


def _mutated(change: Any) -> bytes:
    raw = _raw(created())
    change(raw)
    return _pack(raw)


def _set(path: str, value: Any) -> Any:
    def change(raw: dict[str, Any]) -> None:
        *parents, leaf = path.split(".")
        node = raw
        for key in parents:
            node = node[key]
        node[leaf] = value

    return change


def _delete(path: str) -> Any:
    def change(raw: dict[str, Any]) -> None:
        *parents, leaf = path.split(".")
        node = raw
        for key in parents:
            node = node[key]
        del node[leaf]

    return change


@pytest.mark.parametrize(
    ("payload", "where", "fragment"),
    [
        (b"", "payload", "not a msgpack document"),
        (b"\xc1", "payload", "not a msgpack document"),
        (_pack([1, "trajectory_created", {}]), "envelope", "expected a map"),
        (_mutated(_set("v", 2)), "v", "unsupported schema version"),
        (_mutated(_set("v", True)), "v", "unsupported schema version"),
        (_mutated(_set("kind", "trajectory_resurrected")), "kind", "unknown event kind"),
        (_mutated(_set("extra", 1)), "envelope.extra", "unknown field"),
        (_mutated(_delete("data.tenant")), "data.tenant", "missing field"),
        (_mutated(_set("data.colour", "red")), "data.colour", "unknown field"),
        (_mutated(_set("data.tenant", 7)), "data.tenant", "expected str"),
        (_mutated(_set("data.tenant", "")), "data", "tenant must be non-empty"),
        (_mutated(_set("data.created_at", "1700000000")), "data.created_at", "expected a number"),
        (_mutated(_set("data.created_at", float("nan"))), "data.created_at", "non-finite"),
        (
            _mutated(_set("data.limits.max_output_tokens", True)),
            "data.limits.max_output_tokens",
            "expected an int",
        ),
        (
            _mutated(_set("data.limits.max_output_tokens", 1.5)),
            "data.limits.max_output_tokens",
            "expected an int",
        ),
        (_mutated(_set("data.limits.max_output_tokens", 0)), "data.limits", "max_output_tokens must be > 0"),
        (
            _mutated(_set("data.contract.completion_check.name", None)),
            "data.contract.completion_check.name",
            "nil",
        ),
        (_mutated(_set("data.grants.tools", ["a", "a"])), "data.grants.tools", "duplicate"),
        (_mutated(_set("data.grants.tools", "read_file")), "data.grants.tools", "expected list"),
        (_mutated(_set("data.ceilings.turns", -1)), "data", "ceilings.turns must be finite and > 0"),
        (
            _mutated(_set("data.contract.completion_check.params", {"k": b"\x00"})),
            "params.k",
            "not a JSON value",
        ),
        (_mutated(_set("data.grants.read_only_tools", ["nope"])), "data.grants", "subset"),
    ],
)
def test_malformed_input_names_the_field(payload: bytes, where: str, fragment: str) -> None:
    with pytest.raises(CodecError) as info:
        decode(payload)
    assert isinstance(info.value, InputError)
    assert info.value.where is not None and info.value.where.endswith(where), info.value.where
    assert fragment in str(info.value)


def test_a_bad_enum_value_lists_the_allowed_values() -> None:
    raw = _raw(EXAMPLES[1])  # StateChanged
    raw["data"]["to_state"] = "RESURRECTED"
    with pytest.raises(CodecError) as info:
        decode(_pack(raw))
    assert info.value.where == "data.to_state" and "FINALIZING" in str(info.value)


def test_non_string_map_keys_and_extension_types_are_refused() -> None:
    raw = _raw(EXAMPLES[0])
    raw["data"]["ceilings"] = {b"turns": 1.0}
    with pytest.raises(CodecError, match="map keys must be strings"):
        decode(_pack(raw))
    raw = _raw(EXAMPLES[0])
    raw["data"]["tenant"] = msgpack.ExtType(5, b"x")
    with pytest.raises(CodecError, match="expected str"):
        decode(_pack(raw))


def test_deep_json_is_refused_not_crashed() -> None:
    raw = _raw(EXAMPLES[0])
    deep: Any = "leaf"
    for _ in range(200):
        deep = [deep]
    raw["data"]["contract"]["completion_check"]["params"] = {"deep": deep}
    with pytest.raises(CodecError, match="nested deeper"):
        decode(_pack(raw))


def test_encode_refuses_values_the_log_cannot_hold() -> None:
    # Given an event whose JSON field holds something JSON cannot represent
    check = CompletionCheck("pytest", {"when": object()})  # type: ignore[dict-item]
    event = created(contract=TaskContract("goal", check))
    # When it is encoded, then the codec refuses it rather than writing an unreadable entry
    with pytest.raises(CodecError, match="not a JSON value") as info:
        encode(event)
    assert info.value.where == "data.contract.completion_check.params.when"
    # and a non-finite float is refused where it is, as before the encoders were compiled
    nan = TaskContract("goal", CompletionCheck("pytest", {"x": [1.0, float("nan")]}))
    with pytest.raises(CodecError, match="non-finite") as info:
        encode(created(contract=nan))
    assert info.value.where == "data.contract.completion_check.params.x[1]"


def test_an_int_is_accepted_where_a_float_is_declared() -> None:
    raw = _raw(EXAMPLES[0])
    raw["data"]["created_at"] = 1_700_000_000
    event = decode(_pack(raw))
    assert event == EXAMPLES[0] and isinstance(event.created_at, float)  # type: ignore[union-attr]


# --------------------------------------------------------------------------- fuzzing


def _only_codec_errors(payload: bytes) -> None:
    try:
        event = decode(payload)
    except CodecError:
        return
    # Anything accepted must be a well-formed event that survives its own round trip.
    assert decode(encode(event)) == event


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=256))
def test_random_bytes_raise_only_codec_errors(payload: bytes) -> None:
    _only_codec_errors(payload)


@settings(max_examples=400)
@given(st.sampled_from(EXAMPLES).map(encode), st.data())
def test_byte_mutations_of_valid_encodings_raise_only_codec_errors(
    encoded: bytes, data: st.DataObject
) -> None:
    blob = bytearray(encoded)
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        pos = data.draw(st.integers(0, max(0, len(blob) - 1)))
        if op == "flip" and blob:
            blob[pos] ^= data.draw(st.integers(1, 255))
        elif op == "cut":
            del blob[pos:]
        else:
            blob[pos:pos] = data.draw(st.binary(min_size=1, max_size=4))
    _only_codec_errors(bytes(blob))


_MSGPACK_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=8)
    | st.binary(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


def _leaf_paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    paths = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            paths += _leaf_paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            paths += _leaf_paths(v, (*prefix, i))
    return paths


@settings(max_examples=600)
@given(st.sampled_from(EXAMPLES), st.data())
def test_structural_mutations_raise_only_codec_errors(event: Event, data: st.DataObject) -> None:
    # Given a valid encoding, replace one node anywhere in it by an arbitrary msgpack value
    raw: Any = _raw(event)
    path = data.draw(st.sampled_from(_leaf_paths(raw)))
    replacement = data.draw(_MSGPACK_VALUES)
    if not path:
        raw = replacement
    else:
        node = raw
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = replacement
    # When it is decoded, then it is either refused with a CodecError or is a valid event
    _only_codec_errors(_pack(raw))
