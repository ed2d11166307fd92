"""Rendering a plan into one-token chunks, and cutting it at max_tokens."""

from __future__ import annotations

import json

from testbed.provider.reply import ArgsPiece, CallStart, TextPiece, call_id_for, render
from testbed.provider.scenarios import FinishReason, Plan, PlannedCall, decide, parse_scenario
from testbed.provider.tokenizer import count_tokens

CALL = PlannedCall("edit", json.dumps({"path": "src/app.py", "line": 12, "step": 1}))


def test_a_call_is_a_header_token_then_its_argument_tokens() -> None:
    reply = render(Plan("", (CALL,), FinishReason.TOOL_CALLS), max_tokens=100, trajectory_id="t", turn=0)
    assert isinstance(reply.pieces[0], CallStart)
    assert all(isinstance(p, ArgsPiece) for p in reply.pieces[1:])
    assert reply.completion_tokens == 1 + count_tokens(CALL.arguments)
    assert reply.calls() == [(call_id_for("t", 0, 0), "edit", CALL.arguments)]
    assert reply.finish is FinishReason.TOOL_CALLS


def test_max_tokens_cuts_the_reply_with_length() -> None:
    plan = Plan("one two three four", (), FinishReason.STOP)
    reply = render(plan, max_tokens=2, trajectory_id=None, turn=0)
    assert reply.finish is FinishReason.LENGTH
    assert reply.pieces == (TextPiece("one"), TextPiece(" two"))


def test_truncate_scenario_ends_mid_json() -> None:
    tools = [{"type": "function", "function": {"name": "edit", "parameters": {"type": "object"}}}]
    plan = decide(parse_scenario("truncate"), [{"role": "user", "content": "x"}], tools)
    reply = render(plan, max_tokens=1000, trajectory_id="t", turn=0)
    ((_, _, arguments),) = reply.calls()
    assert reply.finish is FinishReason.LENGTH
    assert arguments and arguments != plan.calls[0].arguments


def test_call_ids_are_deterministic_per_trajectory_turn_and_index() -> None:
    assert call_id_for("t", 2, 0) == call_id_for("t", 2, 0)
    assert (
        len({call_id_for("t", 2, 0), call_id_for("t", 2, 1), call_id_for("t", 3, 0), call_id_for("u", 2, 0)})
        == 4
    )
