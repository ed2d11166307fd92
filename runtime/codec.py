"""The log codec: events to msgpack bytes and back, with a schema version and exact validation.

Wire shape: a msgpack map ``{"v": SCHEMA_VERSION, "kind": <event kind>, "data": {<field>: <value>}}``.
Values are encoded by the field's declared type: nested dataclasses as maps of their fields, ``StrEnum`` as
its value, tuples as arrays, frozensets as sorted arrays, mappings as maps with string keys, and JSON values
(``runtime.record.JsonValue``) as themselves.

``decode`` trusts nothing. It checks the version, the kind, that every declared field is present and no other
field is, each value's type (``bool`` is not an ``int``; an ``int`` is accepted for a ``float``; floats must
be finite; no bytes, no msgpack extension types), enum membership, and finally the event's own invariants
(its ``__post_init__``). Any failure raises ``runtime.errors.CodecError`` whose ``where`` is the field path
(``data.contract.completion_check.name``). No other exception type leaves ``decode``, and it never returns
an event that differs from what the bytes say.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from collections.abc import Callable, Mapping
from enum import Enum
from typing import Any, cast

import msgpack

from runtime.errors import CodecError
from runtime.events import EVENT_TYPES, Event

__all__ = [
    "SCHEMA_VERSION",
    "decode",
    "decode_value",
    "defaulted_fields",
    "encode",
    "encode_value",
    "field_types",
]

SCHEMA_VERSION = 1
"""Bumped whenever an event's fields change meaning; older logs then need an explicit migration."""

_MAX_JSON_DEPTH = 64  # deeper JSON is refused rather than risking the interpreter's recursion limit


class _Json:
    """Stand-in for the recursive ``JsonValue`` alias while resolving type hints."""


@functools.cache
def _field_types(cls: type) -> tuple[tuple[str, Any], ...]:
    hints = typing.get_type_hints(cls, localns={"JsonValue": _Json})
    return tuple((f.name, hints[f.name]) for f in dataclasses.fields(cls) if f.init)


def field_types(cls: type, localns: Mapping[str, Any] | None = None) -> tuple[tuple[str, Any], ...]:
    """The ``(name, type)`` of each constructor field of a value dataclass, as the codec resolves them
    (``localns``: names its annotations use that its module imports only for type checking)."""
    if localns is None:
        return _field_types(cls)
    hints = typing.get_type_hints(cls, localns={"JsonValue": _Json, **localns})
    return tuple((f.name, hints[f.name]) for f in dataclasses.fields(cls) if f.init)


def encode_value(tp: Any, value: Any, path: str) -> Any:
    """``value`` of declared type ``tp`` as msgpack-ready data, by the rules events are encoded with
    (``object`` and ``Any`` hold JSON values). ``CodecError`` names ``path`` and below."""
    return _encode(tp, value, path)


def decode_value(tp: Any, raw: Any, path: str) -> Any:
    """The inverse of ``encode_value``, validating as ``decode`` does."""
    return _decode(tp, raw, path)


# --------------------------------------------------------------------------- encode


def encode(event: Event) -> bytes:
    """Serialise ``event`` for the log. Raises ``CodecError`` if it holds a value its type does not allow
    (for example a non-finite float or a non-JSON object in a JSON field)."""
    cls = type(event)
    if EVENT_TYPES.get(getattr(cls, "kind", "")) is not cls:
        raise CodecError(f"{cls.__name__} is not a registered event type", where="kind")
    try:
        data = _encoder(cast(Any, cls))(event)
    except Exception:  # the rules below again, naming where the value breaks them (or the same data)
        data = _encode(cls, event, "data")
    envelope = {"v": SCHEMA_VERSION, "kind": event.kind, "data": data}
    packed: bytes = msgpack.packb(envelope, use_bin_type=True)
    return packed


# Every appended event is encoded, about 17 in a tool turn: interpreting its declared types value by value
# (``_encode``: type inspection and a path string per field) was a tenth of a turn's own compute. So each
# type's rules are compiled once into a function that applies them without tracking the path; when it
# refuses a value, ``encode`` runs ``_encode`` to say where. Both apply the same rules (``_encode`` is the
# reference, and decides anything the fast one does not accept).
_Encoder = Callable[[Any], Any]


@functools.cache
def _encoder(tp: Any) -> _Encoder:
    if tp is _Json or tp is object or tp is Any:
        return _checked_json
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        (arm,) = [a for a in typing.get_args(tp) if a is not type(None)]
        arm_encoder = _encoder(arm)
        return lambda v: None if v is None else arm_encoder(v)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return _dataclass_encoder(tp)
    if isinstance(tp, type) and issubclass(tp, Enum):
        return lambda v: v.value
    if origin is tuple:
        items = _encoder(typing.get_args(tp)[0])
        return lambda v: [items(x) for x in v]
    if origin is frozenset:
        members = _encoder(typing.get_args(tp)[0])
        return lambda v: sorted(members(x) for x in v)
    if origin in (Mapping, dict):
        values = _encoder(typing.get_args(tp)[1])
        return lambda v: {str(k): values(x) for k, x in v.items()}
    if tp is float:
        return _finite
    return _same


def _dataclass_encoder(cls: type) -> _Encoder:
    fields: list[tuple[str, _Encoder]] | None = None  # resolved on first use: a type may contain itself

    def encode_fields(value: Any) -> dict[str, Any]:
        nonlocal fields
        if fields is None:
            fields = [(name, _encoder(ftp)) for name, ftp in _field_types(cls)]
        return {name: enc(getattr(value, name)) for name, enc in fields}

    return encode_fields


def _finite(value: Any) -> float:
    if not math.isfinite(value):
        raise CodecError(f"non-finite float {value!r}")
    return float(value)


def _same(value: Any) -> Any:
    return value


def _checked_json(value: Any) -> Any:
    return _encode_json(value, "", 0)


def _encode(tp: Any, value: Any, path: str) -> Any:
    if tp is _Json or tp is object or tp is Any:
        return _encode_json(value, path, 0)
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        if value is None:
            return None
        (arm,) = [a for a in typing.get_args(tp) if a is not type(None)]
        return _encode(arm, value, path)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return {name: _encode(ftp, getattr(value, name), f"{path}.{name}") for name, ftp in _field_types(tp)}
    if isinstance(tp, type) and issubclass(tp, Enum):
        return value.value
    if origin is tuple:
        (item_tp, _) = typing.get_args(tp)
        return [_encode(item_tp, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is frozenset:
        (item_tp,) = typing.get_args(tp)
        return sorted(_encode(item_tp, v, f"{path}[]") for v in value)
    if origin in (Mapping, dict):
        _, value_tp = typing.get_args(tp)
        return {str(k): _encode(value_tp, v, f"{path}.{k}") for k, v in value.items()}
    if tp is float:
        if not math.isfinite(value):
            raise CodecError(f"non-finite float {value!r}", where=path)
        return float(value)
    return value


def _encode_json(value: Any, path: str, depth: int) -> Any:
    if depth > _MAX_JSON_DEPTH:
        raise CodecError(f"JSON nested deeper than {_MAX_JSON_DEPTH}", where=path)
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise CodecError(f"non-finite float {value!r}", where=path)
        return value
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise CodecError(f"JSON object keys must be strings, got {k!r}", where=path)
            out[k] = _encode_json(v, f"{path}.{k}", depth + 1)
        return out
    if isinstance(value, list | tuple):
        return [_encode_json(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value)]
    raise CodecError(f"not a JSON value: {type(value).__name__}", where=path)


# --------------------------------------------------------------------------- decode


def decode(payload: bytes) -> Event:
    """Parse and validate one log entry. Raises ``CodecError`` (an ``InputError``) naming the field path."""
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise CodecError(f"expected bytes, got {type(payload).__name__}", where="payload")
    try:
        raw = msgpack.unpackb(bytes(payload), raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises many unrelated types (ValueError, StackError, ...)
        raise CodecError(f"not a msgpack document ({type(exc).__name__}: {exc})", where="payload") from exc
    if not isinstance(raw, dict):
        raise CodecError(f"expected a map, got {_kind(raw)}", where="envelope")
    raw = _string_keyed(raw, "envelope")
    _exact_keys(raw, ("v", "kind", "data"), "envelope")
    version = raw["v"]
    if type(version) is not int or version != SCHEMA_VERSION:
        raise CodecError(
            f"unsupported schema version {version!r} (this build reads {SCHEMA_VERSION})", where="v"
        )
    kind = raw["kind"]
    if not isinstance(kind, str):
        raise CodecError(f"expected a string, got {_kind(kind)}", where="kind")
    cls = EVENT_TYPES.get(kind)
    if cls is None:
        raise CodecError(f"unknown event kind {kind!r}", where="kind")
    event: Event = _decode(cls, raw["data"], "data")
    return event


def _kind(value: Any) -> str:
    return "nil" if value is None else type(value).__name__


def _exact_keys(
    value: dict[str, Any], expected: tuple[str, ...], path: str, optional: frozenset[str] = frozenset()
) -> None:
    """Every expected key present (except ``optional`` ones, which have defaults), no unknown key."""
    for key in expected:
        if key not in value and key not in optional:
            raise CodecError("missing field", where=f"{path}.{key}")
    for key in value:
        if key not in expected:
            raise CodecError("unknown field", where=f"{path}.{key}")


def _decode(tp: Any, value: Any, path: str) -> Any:
    if tp is _Json or tp is object or tp is Any:
        return _decode_json(value, path, 0)
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        if value is None:
            return None
        (arm,) = [a for a in typing.get_args(tp) if a is not type(None)]
        return _decode(arm, value, path)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return _decode_dataclass(tp, value, path)
    if isinstance(tp, type) and issubclass(tp, Enum):
        if not isinstance(value, str):
            raise CodecError(f"expected a {tp.__name__} string, got {_kind(value)}", where=path)
        try:
            return tp(value)
        except ValueError:
            allowed = ", ".join(str(m.value) for m in tp)
            raise CodecError(f"{value!r} is not a {tp.__name__} (one of: {allowed})", where=path) from None
    if origin is tuple:
        (item_tp, _) = typing.get_args(tp)
        items = _expect(list, value, path)
        return tuple(_decode(item_tp, v, f"{path}[{i}]") for i, v in enumerate(items))
    if origin is frozenset:
        (item_tp,) = typing.get_args(tp)
        items = [_decode(item_tp, v, f"{path}[{i}]") for i, v in enumerate(_expect(list, value, path))]
        result = frozenset(items)
        if len(result) != len(items):
            raise CodecError("duplicate set member", where=path)
        return result
    if origin in (Mapping, dict):
        key_tp, value_tp = typing.get_args(tp)
        assert key_tp is str, f"codec supports string-keyed mappings only, not {tp}"
        entries = _string_keyed(value, path)
        return {k: _decode(value_tp, v, f"{path}.{k}") for k, v in entries.items()}
    if tp is bool:
        return _expect(bool, value, path)
    if tp is int:
        if type(value) is not int:
            raise CodecError(f"expected an int, got {_kind(value)}", where=path)
        return value
    if tp is float:
        if type(value) not in (int, float):
            raise CodecError(f"expected a number, got {_kind(value)}", where=path)
        number = float(value)
        if not math.isfinite(number):
            raise CodecError(f"non-finite number {number!r}", where=path)
        return number
    if tp is str:
        return _expect(str, value, path)
    raise AssertionError(f"codec has no rule for type {tp!r} at {path}")  # a schema bug, found by tests


def _expect(tp: type, value: Any, path: str) -> Any:
    if type(value) is not tp:
        raise CodecError(f"expected {tp.__name__}, got {_kind(value)}", where=path)
    return value


def _string_keyed(value: Any, path: str) -> dict[str, Any]:
    entries: dict[Any, Any] = _expect(dict, value, path)
    for key in entries:
        if type(key) is not str:
            raise CodecError(f"map keys must be strings, got {_kind(key)} {key!r}", where=path)
    return entries


@functools.cache
def defaulted_fields(cls: type) -> frozenset[str]:
    """The fields of dataclass ``cls`` with a default: an entry written before one existed may omit it."""
    return frozenset(
        f.name
        for f in dataclasses.fields(cls)
        if f.init and (f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING)
    )


def _decode_dataclass(cls: type, value: Any, path: str) -> Any:
    fields = _field_types(cls)
    entries = _string_keyed(value, path)
    # A field added later within one schema version has a default: entries written before it may omit it.
    optional = defaulted_fields(cls)
    _exact_keys(entries, tuple(name for name, _ in fields), path, optional)
    kwargs = {name: _decode(ftp, entries[name], f"{path}.{name}") for name, ftp in fields if name in entries}
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:  # the value type's own invariants
        raise CodecError(str(exc), where=path) from exc


def _decode_json(value: Any, path: str, depth: int) -> Any:
    if depth > _MAX_JSON_DEPTH:
        raise CodecError(f"JSON nested deeper than {_MAX_JSON_DEPTH}", where=path)
    if value is None or type(value) in (bool, int, str):
        return value
    if type(value) is float:
        if not math.isfinite(value):
            raise CodecError(f"non-finite number {value!r}", where=path)
        return value
    if type(value) is list:
        return [_decode_json(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value)]
    if type(value) is dict:
        entries = _string_keyed(value, path)
        return {k: _decode_json(v, f"{path}.{k}", depth + 1) for k, v in entries.items()}
    raise CodecError(f"not a JSON value: {_kind(value)}", where=path)
