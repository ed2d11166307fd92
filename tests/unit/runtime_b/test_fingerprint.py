"""Fingerprints and effect keys (reliability guide §4.2, §4.5, §6.2)."""

from __future__ import annotations

import json
import unicodedata
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from runtime.fingerprint import (
    CanonicalForm,
    FingerprintInputError,
    call_digest,
    call_fingerprint,
    canonical_json,
    coarse_fingerprint,
    effect_key,
    state_digest,
)

# One intent, serialised the ways a model may emit it between attempts.
SAME_CALL_TEXTS = [
    '{"path": "src/café.py", "mode": "w"}',
    '{"mode":"w","path":"src/café.py"}',  # key order, whitespace
    '{ "mode" : "w" ,\n  "path" : "src\\/café.py" }',  # \/ escaping
    '{"mode": "w", "path": "src/caf\\u00e9.py"}',  # \u00e9 escaping
    json.dumps(
        {"mode": "w", "path": unicodedata.normalize("NFD", "src/café.py")}
    ),  # NFD e + combining accent
    '{"mode": "w", "path": "src/café.py", "request_id": "r-17", "nonce": "x9", "trace_id": "t"}',  # volatile
    '{"mode": "w", "path": "src/café.py", "timestamp": 1700000000, "attempt": 3}',
]


def test_serialisation_variants_give_one_fingerprint() -> None:
    # Given the same call serialised seven ways
    parsed = [json.loads(text) for text in SAME_CALL_TEXTS]
    # When fingerprinted
    prints = {call_fingerprint("write_file", args) for args in parsed}
    # Then there is exactly one fingerprint
    assert len(prints) == 1


def test_nfd_and_nfc_keys_agree() -> None:
    nfc, nfd = unicodedata.normalize("NFC", "é"), unicodedata.normalize("NFD", "é")
    assert nfc != nfd
    assert call_fingerprint("t", {nfc: 1}) == call_fingerprint("t", {nfd: 1})


def test_integral_float_and_int_are_one_json_number() -> None:
    assert call_fingerprint("t", {"n": 1}) == call_fingerprint("t", {"n": 1.0})
    assert call_fingerprint("t", {"n": 1}) != call_fingerprint("t", {"n": 1.5})


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ({"path": "a.py"}, {"path": "b.py"}),
        ({"path": "a.py"}, {"path": "A.py"}),  # exact fingerprint is case sensitive
        ({"n": 1}, {"n": "1"}),
        ({"n": True}, {"n": 1}),
        ({"x": None}, {}),
    ],
)
def test_different_arguments_give_different_fingerprints(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert call_fingerprint("t", a) != call_fingerprint("t", b)


def test_tool_name_is_part_of_the_fingerprint() -> None:
    assert call_fingerprint("read", {"p": 1}) != call_fingerprint("write", {"p": 1})


def test_volatile_set_is_configurable_and_top_level_by_default() -> None:
    # Given a nested timestamp, which is often intent (schedule at this time)
    a = {"event": {"timestamp": 1}, "session": "s1"}
    b = {"event": {"timestamp": 2}, "session": "s2"}
    # Then by default it counts; a form dropping nested and session keys makes them equal
    assert call_fingerprint("t", a) != call_fingerprint("t", b)
    form = CanonicalForm(volatile_keys=frozenset({"timestamp", "session"}), nested=True)
    assert call_fingerprint("t", a, form) == call_fingerprint("t", b, form)


def test_canonical_json_is_compact_sorted_and_unescaped() -> None:
    assert canonical_json({"b": [1, 2.5], "a": "é/"}) == '{"a":"é/","b":[1,2.5]}'


def test_coarse_fingerprint_ignores_everything_but_the_target() -> None:
    # Given trivial variations of one action on one file (§4.5: a space, a comment, case)
    variants = [
        {"path": "src/app.py", "pattern": "TODO"},
        {"path": "src/app.py ", "pattern": "TODO ", "comment": "try again"},
        {"path": "SRC/App.py", "pattern": "todo"},
    ]
    # When coarse-fingerprinted on the path; Then all agree, and another file differs
    coarse = {coarse_fingerprint("grep", v, ["path"]) for v in variants}
    assert len(coarse) == 1
    assert coarse_fingerprint("grep", {"path": "src/db.py"}, ["path"]) not in coarse
    # while the exact fingerprints all differ
    assert len({call_fingerprint("grep", v) for v in variants}) == 3


def test_state_digest_ignores_key_order_but_not_content() -> None:
    assert state_digest({"files": {"a": "1", "b": "2"}}) == state_digest({"files": {"b": "2", "a": "1"}})
    assert state_digest({"files": {"a": "1"}}) != state_digest({"files": {"a": "2"}})


def test_effect_key_is_stable_across_attempts_and_time() -> None:
    # Given two attempts of step 3 that differ only in attempt number, time and request id
    first = effect_key("traj-1", 3, "provision_env", {"size": "m", "attempt": 1, "request_id": "a"})
    second = effect_key("traj-1", 3, "provision_env", {"request_id": "b", "size": "m", "attempt": 2})
    # Then they share one effect key
    assert first == second
    assert len(first) == 32


@pytest.mark.parametrize(
    "other",
    [
        ("traj-2", 3, "provision_env", {"size": "m"}),  # another trajectory
        ("traj-1", 4, "provision_env", {"size": "m"}),  # another step
        ("traj-1", 3, "release_env", {"size": "m"}),  # another tool
        ("traj-1", 3, "provision_env", {"size": "l"}),  # another argument
    ],
)
def test_different_intents_give_different_effect_keys(other: tuple[str, int, str, dict[str, Any]]) -> None:
    assert effect_key("traj-1", 3, "provision_env", {"size": "m"}) != effect_key(*other)


def test_call_digest_binds_every_argument_including_volatile_ones() -> None:
    base = call_digest("drop_table", {"db": "prod", "table": "orders_staging"})
    assert base.startswith("sha256:")
    assert base == call_digest("drop_table", {"table": "orders_staging", "db": "prod"})
    assert base != call_digest("drop_table", {"db": "prod", "table": "orders"})
    assert base != call_digest("drop_table", {"db": "prod", "table": "orders_staging", "nonce": "1"})


@pytest.mark.parametrize(
    ("args", "where"),
    [
        ({"x": float("nan")}, "$.x"),
        ({"x": {1: "a"}}, "$.x"),
        ({"x": [object()]}, "$.x[0]"),
        ({"é": 1, unicodedata.normalize("NFD", "é"): 2}, "$.é"),
    ],
)
def test_non_json_input_is_rejected_with_its_path(args: dict[str, Any], where: str) -> None:
    with pytest.raises(FingerprintInputError) as err:
        call_fingerprint("t", args)
    assert err.value.where == where


@pytest.mark.parametrize(("trajectory", "step"), [("", 0), ("t", -1), ("t", True)])
def test_effect_key_rejects_bad_identity(trajectory: str, step: int) -> None:
    with pytest.raises(FingerprintInputError):
        effect_key(trajectory, step, "tool", {})


# Keys are NFC already, so no two keys of one object collide after normalisation.
nfc_keys = st.text(max_size=6).map(lambda k: unicodedata.normalize("NFC", k))
json_scalars = (
    st.none() | st.booleans() | st.integers() | st.text() | st.floats(allow_nan=False, allow_infinity=False)
)
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(nfc_keys, children, max_size=4),
    max_leaves=20,
)
json_objects = st.dictionaries(nfc_keys, json_values, max_size=6)


def _shuffled(value: Any, rnd: Any) -> Any:
    if isinstance(value, dict):
        items = list(value.items())
        rnd.shuffle(items)
        return {k: _shuffled(v, rnd) for k, v in items}
    if isinstance(value, list):
        return [_shuffled(v, rnd) for v in value]
    return value


@given(json_objects, st.randoms())
def test_permuting_keys_and_reserialising_never_changes_the_fingerprint(
    args: dict[str, Any], rnd: Any
) -> None:
    # Given any JSON object, its keys permuted at every level, and a different serialisation of it
    permuted = _shuffled(args, rnd)
    reparsed = json.loads(json.dumps(permuted, ensure_ascii=True, indent=1))
    # Then the fingerprint is the same
    assert (
        call_fingerprint("tool", args)
        == call_fingerprint("tool", permuted)
        == call_fingerprint("tool", reparsed)
    )
