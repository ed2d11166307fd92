"""Canonical call fingerprints, coarse fingerprints, state digests, effect keys and approval digests.

Reliability guide §4.2: tool arguments are model-generated JSON, and semantically identical arguments
arrive serialised differently (key order, whitespace, ``\\u00e9`` vs ``é``, ``\\/`` vs ``/``). So we
never hash the raw text: parse it, drop volatile keys, normalise every string (keys too) to Unicode NFC,
and serialise with sorted keys, compact separators and ``ensure_ascii=False``.

§4.5: run a coarser fingerprint in parallel — (tool, target resource) with case and whitespace folded —
so trivial variations of one action still look alike to the watchdog.

§6.2: an effect key is derived from the *intent* (trajectory id, step index, tool, canonical args) and
deliberately excludes the attempt number, the time and any random id, so a retry of the same step is
recognised as a repeat and two different intents are never collapsed.
"""

from __future__ import annotations

import hashlib
import json
import math
import unicodedata
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from runtime.errors import InputError

__all__ = [
    "DEFAULT_VOLATILE_KEYS",
    "CanonicalForm",
    "FingerprintInputError",
    "call_digest",
    "call_fingerprint",
    "canonical_args",
    "canonical_json",
    "canonical_value",
    "coarse_fingerprint",
    "effect_key",
    "state_digest",
]

# The reliability guide's list (§4.2): fields a retry wrapper or the model re-generates per attempt.
DEFAULT_VOLATILE_KEYS: frozenset[str] = frozenset({"request_id", "timestamp", "trace_id", "attempt", "nonce"})

_SEP = "\x00"  # cannot occur in a tool name; separates the hashed fields unambiguously
_MAX_SAFE_INT = 2**53  # integral floats below this are exactly representable as ints


class FingerprintInputError(InputError):
    """A value cannot be canonicalised (not JSON-shaped, NaN, colliding keys); ``where`` is its path."""


@dataclass(frozen=True, slots=True)
class CanonicalForm:
    """Which keys are noise for a fingerprint. ``nested`` drops them at every depth, not only at top
    level; off by default because a nested ``timestamp`` is often part of the intent."""

    volatile_keys: frozenset[str] = DEFAULT_VOLATILE_KEYS
    nested: bool = False


_DEFAULT_FORM = CanonicalForm()
_EXACT_FORM = CanonicalForm(volatile_keys=frozenset())


def _nfc(text: str) -> str:
    return unicodedata.normalize("NFC", text)


def canonical_value(value: Any, form: CanonicalForm = _EXACT_FORM, *, where: str = "$") -> Any:
    """A JSON-shaped value with every string NFC-normalised, volatile keys dropped per ``form``,
    tuples as lists, and integral floats as ints (``1.0`` and ``1`` are one JSON number)."""
    return _canon(value, form, where, top=True)


def _canon(value: Any, form: CanonicalForm, where: str, *, top: bool) -> Any:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return _nfc(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise FingerprintInputError(f"{value!r} is not a JSON number", where=where)
        if value.is_integer() and abs(value) < _MAX_SAFE_INT:
            return int(value)
        return value
    if isinstance(value, Mapping):
        drop = form.volatile_keys if (top or form.nested) else frozenset()
        out: dict[str, Any] = {}
        for raw_key, item in value.items():
            if not isinstance(raw_key, str):
                raise FingerprintInputError(f"object keys must be strings, got {raw_key!r}", where=where)
            key = _nfc(raw_key)
            if key in drop:
                continue
            if key in out:
                raise FingerprintInputError(
                    f"keys {raw_key!r} and another key are the same after Unicode normalisation",
                    where=f"{where}.{key}",
                )
            out[key] = _canon(item, form, f"{where}.{key}", top=False)
        return out
    if isinstance(value, list | tuple):
        return [_canon(item, form, f"{where}[{i}]", top=False) for i, item in enumerate(value)]
    raise FingerprintInputError(f"{type(value).__name__} is not JSON-shaped", where=where)


def canonical_json(value: Any, form: CanonicalForm = _EXACT_FORM) -> str:
    """The one serialisation of ``value``: canonicalised, sorted keys, no whitespace, raw Unicode."""
    return json.dumps(
        canonical_value(value, form),
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
        allow_nan=False,
    )


def canonical_args(args: Mapping[str, Any], form: CanonicalForm = _DEFAULT_FORM) -> dict[str, Any]:
    """Arguments as the fingerprint sees them (volatile keys dropped, strings NFC)."""
    if not isinstance(args, Mapping):
        raise FingerprintInputError(f"tool arguments must be an object, got {type(args).__name__}")
    result: dict[str, Any] = canonical_value(args, form)
    return result


def _sha256(*parts: str) -> str:
    return hashlib.sha256(_SEP.join(parts).encode("utf-8")).hexdigest()


def _tool(tool: str) -> str:
    if not isinstance(tool, str) or not tool or _SEP in tool:
        raise FingerprintInputError(f"invalid tool name {tool!r}", where="tool")
    return _nfc(tool)


def call_fingerprint(tool: str, args: Mapping[str, Any], form: CanonicalForm = _DEFAULT_FORM) -> str:
    """Identity of "the agent tried this exact thing": sha256 hex of tool + canonical args."""
    return _sha256(_tool(tool), canonical_json(canonical_args(args, form)))


def _fold_text(value: Any) -> Any:
    # §4.5 "canonicalise aggressively, including case, whitespace": only for the coarse identity.
    if isinstance(value, str):
        return " ".join(value.casefold().split())
    if isinstance(value, list):
        return [_fold_text(v) for v in value]
    if isinstance(value, dict):
        return {k: _fold_text(v) for k, v in value.items()}
    return value


def coarse_fingerprint(tool: str, args: Mapping[str, Any], target_keys: Iterable[str]) -> str:
    """(tool, target resource) identity, ignoring every other argument. ``target_keys`` name the
    arguments that identify the resource acted on (e.g. ``("path",)`` or ``("db", "table")``); a missing
    key counts as null. String values are case- and whitespace-folded."""
    canon = canonical_args(args, CanonicalForm(volatile_keys=frozenset()))
    keys = sorted({_nfc(k) for k in target_keys})
    target = {k: _fold_text(canon.get(k)) for k in keys}
    return _sha256("coarse", _tool(tool), canonical_json(target))


def state_digest(state: Any, form: CanonicalForm = _EXACT_FORM) -> str:
    """Digest of a canonicalised state projection (recovery chapter §12.6.1): equal projections give
    equal digests whatever their key order or serialisation."""
    return _sha256("state", canonical_json(state, form))


def effect_key(trajectory_id: str, step_index: int, tool: str, args: Mapping[str, Any]) -> str:
    """Deduplication key from intent (§6.2): stable across attempts of one step, distinct across
    intents. Never includes an attempt number, a time or a random id (volatile keys are dropped)."""
    if not isinstance(trajectory_id, str) or not trajectory_id or _SEP in trajectory_id:
        raise FingerprintInputError(f"invalid trajectory id {trajectory_id!r}", where="trajectory_id")
    if isinstance(step_index, bool) or not isinstance(step_index, int) or step_index < 0:
        raise FingerprintInputError(f"must be an int ≥ 0, got {step_index!r}", where="step_index")
    material = canonical_json(canonical_args(args))
    return _sha256(trajectory_id, str(step_index), _tool(tool), material)[:32]


def call_digest(tool: str, args: Mapping[str, Any]) -> str:
    """Digest an approval binds to (harness chapter, "Approval Gates"): every argument counts, no key is
    treated as volatile, so changing any argument of the held call voids the approval."""
    exact = canonical_args(args, _EXACT_FORM)
    return "sha256:" + _sha256("call", _tool(tool), canonical_json(exact))
