"""Deterministic example arguments for a tool, built from its JSON Schema (pure).

Scripted scenarios must propose calls the harness can validate, so arguments follow the tool's
``parameters`` schema: required properties are filled (all properties when none are required), enums
and consts take their first value, integers carry the step number (clamped to ``minimum``/``maximum``),
strings are ``"<name>-<tag>"``. A ``"step"`` key is added when the schema neither has one nor forbids
extra properties. ``$ref``/``anyOf``/``oneOf`` take their first non-null branch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["example_arguments"]

_MAX_DEPTH = 4


def example_arguments(parameters: Mapping[str, Any] | None, *, step: int, tag: str) -> dict[str, Any]:
    """Arguments that satisfy ``parameters`` (an object schema), varying with ``step`` and ``tag``."""
    schema = dict(parameters or {})
    defs = {**schema.get("$defs", {}), **schema.get("definitions", {})}
    value = _object(schema, defs, step, tag, depth=0)
    properties = schema.get("properties") or {}
    if "step" not in properties and schema.get("additionalProperties", True) is not False:
        value["step"] = step
    return value


def _resolve(schema: Mapping[str, Any], defs: Mapping[str, Any]) -> Mapping[str, Any]:
    ref = schema.get("$ref")
    if isinstance(ref, str):
        target = defs.get(ref.rsplit("/", 1)[-1])
        if isinstance(target, Mapping):
            return _resolve(target, defs)
    for key in ("anyOf", "oneOf", "allOf"):
        branches = schema.get(key)
        if isinstance(branches, list):
            for branch in branches:
                if isinstance(branch, Mapping) and branch.get("type") != "null":
                    return _resolve(branch, defs)
    return schema


def _object(
    schema: Mapping[str, Any], defs: Mapping[str, Any], step: int, tag: str, depth: int
) -> dict[str, Any]:
    properties: Mapping[str, Any] = schema.get("properties") or {}
    required = [name for name in schema.get("required", []) if name in properties] or list(properties)
    return {name: _value(name, properties[name], defs, step, tag, depth + 1) for name in required}


def _value(name: str, raw: Any, defs: Mapping[str, Any], step: int, tag: str, depth: int) -> Any:
    schema = _resolve(raw if isinstance(raw, Mapping) else {}, defs)
    if "const" in schema:
        return schema["const"]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    kind = schema.get("type", "string")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    if kind == "integer" or kind == "number":
        value: float = step
        if "minimum" in schema:
            value = max(value, schema["minimum"])
        if "maximum" in schema:
            value = min(value, schema["maximum"])
        return int(value) if kind == "integer" else float(value)
    if kind == "boolean":
        return True
    if kind == "array":
        return []
    if kind == "object":
        return _object(schema, defs, step, tag, depth) if depth < _MAX_DEPTH else {}
    return f"{name}-{tag}"
