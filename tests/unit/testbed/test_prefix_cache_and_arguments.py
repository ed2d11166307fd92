"""Prefix cache accounting and schema-driven example arguments."""

from __future__ import annotations

from typing import Any

import pytest

from testbed.provider.arguments import example_arguments
from testbed.provider.prefix_cache import PrefixCache
from testbed.provider.tokenizer import count_tokens


def test_earlier_prompt_prefix_of_the_same_trajectory_counts_as_cached() -> None:
    cache = PrefixCache()
    first = ["<|system|> rules", "<|user|> task"]
    second = [*first, "<|assistant|> call", "<|tool|> result"]
    # Given a first request / Then nothing is cached
    assert cache.measure("t1", first, 3).cached == 0
    # When the conversation grows / Then exactly the earlier blocks are cached, priming never
    measured = cache.measure("t1", second, 3)
    assert measured.cached == sum(count_tokens(b) for b in first)
    assert measured.total == sum(count_tokens(b) for b in second) + 3


def test_cache_is_per_trajectory_and_breaks_at_the_first_changed_block() -> None:
    cache = PrefixCache()
    cache.measure("t1", ["<|system|> a", "<|user|> b"], 0)
    assert cache.measure("t2", ["<|system|> a", "<|user|> b"], 0).cached == 0
    assert cache.measure("t1", ["<|system|> a", "<|user|> CHANGED"], 0).cached == count_tokens("<|system|> a")
    assert cache.measure(None, ["<|system|> a"], 0).cached == 0


def test_cache_evicts_least_recently_used_trajectories() -> None:
    cache = PrefixCache(max_trajectories=2)
    for t in ("a", "b", "c"):
        cache.measure(t, ["<|user|> x"], 0)
    assert cache.measure("a", ["<|user|> x"], 0).cached == 0  # evicted
    assert cache.measure("c", ["<|user|> x"], 0).cached > 0


PYDANTIC_LIKE: dict[str, Any] = {
    "type": "object",
    "properties": {
        "path": {"type": "string"},
        "mode": {"enum": ["append", "overwrite"]},
        "count": {"type": "integer", "minimum": 5},
        "dry_run": {"anyOf": [{"type": "boolean"}, {"type": "null"}], "default": None},
        "target": {"$ref": "#/$defs/Target"},
    },
    "required": ["path", "mode", "count", "target"],
    "$defs": {"Target": {"type": "object", "properties": {"host": {"type": "string"}}, "required": ["host"]}},
}


def test_required_fields_are_filled_by_type_with_step_and_tag() -> None:
    args = example_arguments(PYDANTIC_LIKE, step=2, tag="step2")
    assert args == {
        "path": "path-step2",
        "mode": "append",
        "count": 5,
        "target": {"host": "host-step2"},
        "step": 2,
    }


@pytest.mark.parametrize(
    ("schema", "expected"),
    [
        (None, {"step": 3}),
        ({"type": "object", "properties": {}, "additionalProperties": False}, {}),
        ({"type": "object", "properties": {"step": {"type": "integer"}}}, {"step": 3}),
    ],
)
def test_step_key_is_added_only_where_the_schema_allows(
    schema: dict[str, Any] | None, expected: dict[str, Any]
) -> None:
    assert example_arguments(schema, step=3, tag="x") == expected
