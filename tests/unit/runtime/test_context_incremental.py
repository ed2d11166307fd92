"""``runtime.context.context_of`` (the turn's cached, incremental build) against ``build_messages`` (the
projection from scratch): for every transcript a trajectory can grow, turn after turn, the same messages
and the same prompt estimate; handed-out messages never change afterwards."""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.context import build_messages, context_of, estimate_from_chars, estimate_tokens
from runtime.events import (
    ChildCancelled,
    ChildSettled,
    ObservationAppended,
    ObservationKind,
    OperationSettled,
    ToolCallCancelled,
    ToolCallTimedOut,
    ToolResultAccepted,
)
from runtime.ports import OutcomeClass, Settlement, ToolCallProposal

from ..trajectory.sim import registry as sim_registry

K = ObservationKind
CALLS = ("c1", "c2", "c3")


def _event(kind: str, call: str, n: int) -> Any:
    """One transcript event of ``kind`` about call ``call`` (the n-th drawn, for distinct contents)."""
    if kind == "assistant":
        return ObservationAppended(
            K.ASSISTANT, f"thinking {n}", tool_calls=(ToolCallProposal(call, "t", "{}"),)
        )
    if kind == "user":
        return ObservationAppended(K.USER, f"goal {n}")
    if kind == "notice":
        return ObservationAppended(K.NOTICE, f"notice {n}")
    if kind == "error":
        return ObservationAppended(K.ERROR, f"error {n}")
    if kind == "refusal":
        return ObservationAppended(K.REFUSAL, f"refused {n}", call_id=call)
    if kind == "result":
        return ToolResultAccepted(call, Settlement.ESTABLISHED, OutcomeClass.SUCCESS, {"n": n}, None)
    if kind == "timeout":
        return ToolCallTimedOut(call)
    if kind == "cancel":
        return ToolCallCancelled(call, f"kill {n}")
    if kind == "settled":
        return OperationSettled(f"op-{call}", Settlement.ESTABLISHED, f"probe {n}", {"n": n}, call_id=call)
    if kind == "child":
        return ChildSettled(f"ch-{n}", call, True, "ok", {"tokens": 1.0}, {"answer": n})
    return ChildCancelled(f"ch-{n}", call, f"stopped {n}")


KINDS = (
    "assistant",
    "user",
    "notice",
    "error",
    "refusal",
    "result",
    "timeout",
    "cancel",
    "settled",
    "child",
    "child_cancel",
)
steps = st.lists(st.tuples(st.sampled_from(KINDS), st.sampled_from(CALLS)), max_size=30)


@settings(max_examples=150, deadline=None)
@given(steps=steps, prompt=st.sampled_from([None, "", "You are careful."]), every=st.integers(1, 4))
def test_the_incremental_context_is_the_projection_from_scratch(
    steps: list[tuple[str, str]], prompt: str | None, every: int
) -> None:
    # Given a transcript that grows one event at a time (a turn builds after every few events)
    transcript: tuple[object, ...] = (ObservationAppended(K.USER, "the goal"),)
    handed_out: list[tuple[list[dict[str, Any]], list[dict[str, Any]]]] = []
    for n, (kind, call) in enumerate(steps):
        transcript = (*transcript, _event(kind, call, n))
        if n % every:
            continue
        # When the turn's context is built from the cache
        messages, chars = context_of(transcript, prompt)
        # Then it is exactly the projection from scratch, and so is the estimate
        fresh = build_messages(transcript, prompt)  # type: ignore[arg-type]
        assert messages == fresh
        assert estimate_from_chars(chars, len(messages)) == estimate_tokens(fresh)
        handed_out.append((messages, copy.deepcopy(messages)))
    # and nothing handed out with an earlier turn changed as later answers arrived
    for messages, as_built in handed_out:
        assert messages == as_built


def test_a_transcript_that_does_not_extend_the_cached_one_is_built_from_scratch() -> None:
    # Given the context built for a longer transcript of the same trajectory
    goal = ObservationAppended(K.USER, "the goal")
    call = ObservationAppended(K.ASSISTANT, "", tool_calls=(ToolCallProposal("c1", "t", "{}"),))
    result = ToolResultAccepted("c1", Settlement.ESTABLISHED, OutcomeClass.SUCCESS, {"ok": 1}, None)
    context_of((goal, call, result))
    # When an older record (a branch, or one folded before the result) asks
    messages, chars = context_of((goal, call))
    # Then it gets its own projection, not the cached one
    assert messages == build_messages((goal, call))
    assert estimate_from_chars(chars, len(messages)) == estimate_tokens(messages)


def test_the_registry_counts_its_specs_as_the_estimate_does() -> None:
    # Given a registry's specs for two tools, asked for twice (the second from its cache)
    registry = sim_registry()
    names = ["notify", "run_tests"]
    first = registry.openai_tool_specs(names)
    # When the estimate is made from the registry's count rather than from the specs
    counted = estimate_from_chars(registry.spec_chars(names), 0)
    # Then it is the estimate of the specs themselves, and the cached specs are the ones built first
    assert counted == estimate_tokens([], first)
    assert registry.openai_tool_specs(names) == first == [registry.get(n).openai_spec() for n in names]
