"""Scenario grammar and the stateless script decisions."""

from __future__ import annotations

import json
from typing import Any

import pytest

from testbed.provider.scenarios import (
    FinishReason,
    Scenario,
    ScenarioError,
    ScenarioKind,
    decide,
    parse_scenario,
)

EDIT = {
    "type": "function",
    "function": {
        "name": "edit",
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string"}, "line": {"type": "integer"}},
            "required": ["path", "line"],
        },
    },
}
DEPLOY = {
    "type": "function",
    "function": {"name": "deploy", "parameters": {"type": "object", "properties": {}}},
}


def conversation(tool_results: int, *, call_name: str = "edit") -> list[dict[str, Any]]:
    """A user task followed by ``tool_results`` assistant-call / tool-result exchanges."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "go"},
    ]
    for i in range(tool_results):
        call = {"id": f"c{i}", "type": "function", "function": {"name": call_name, "arguments": "{}"}}
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": f"c{i}", "content": "ok"})
    return messages


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (None, Scenario(ScenarioKind.FINISH_AFTER, count=0)),
        ("finish_after:3", Scenario(ScenarioKind.FINISH_AFTER, count=3)),
        (" repeat_forever ", Scenario(ScenarioKind.REPEAT_FOREVER)),
        ("oscillate", Scenario(ScenarioKind.OSCILLATE)),
        ("vary_args", Scenario(ScenarioKind.VARY_ARGS)),
        ("truncate", Scenario(ScenarioKind.TRUNCATE)),
        ("truncate:2", Scenario(ScenarioKind.TRUNCATE, count=2)),
        ("malformed_json:1", Scenario(ScenarioKind.MALFORMED_JSON, count=1)),
        ("refuse", Scenario(ScenarioKind.REFUSE)),
        ("irreversible:drop_table", Scenario(ScenarioKind.IRREVERSIBLE, tool="drop_table")),
        ("parallel:3", Scenario(ScenarioKind.PARALLEL, count=3)),
        ("slow", Scenario(ScenarioKind.SLOW)),
        ("slow:50", Scenario(ScenarioKind.SLOW, count=50)),
    ],
)
def test_grammar_parses(header: str | None, expected: Scenario) -> None:
    assert parse_scenario(header) == expected


@pytest.mark.parametrize(
    ("header", "message"),
    [
        ("dance", "unknown scenario 'dance'"),
        ("finish_after", "expected a non-negative integer"),
        ("finish_after:-1", "expected a non-negative integer"),
        ("parallel:0", "K >= 1"),
        ("irreversible", "needs a tool name"),
        ("refuse:3", "takes no argument"),
    ],
)
def test_grammar_errors_name_the_problem_and_the_header(header: str, message: str) -> None:
    with pytest.raises(ScenarioError, match=message) as info:
        parse_scenario(header)
    assert info.value.where == "X-Tether-Scenario"


def test_finish_after_calls_the_first_tool_n_times_with_step_numbers_then_stops() -> None:
    scenario = parse_scenario("finish_after:2")
    # Given conversations with 0, 1 and 2 tool results / When the model is asked
    plans = [decide(scenario, conversation(k), [EDIT, DEPLOY]) for k in range(3)]
    # Then two distinct calls carrying step 1 and 2, then a final answer
    assert [p.finish for p in plans] == [FinishReason.TOOL_CALLS, FinishReason.TOOL_CALLS, FinishReason.STOP]
    args = [json.loads(p.calls[0].arguments) for p in plans[:2]]
    assert [a["line"] for a in args] == [1, 2]
    assert [a["step"] for a in args] == [1, 2]
    assert all(p.calls[0].tool == "edit" for p in plans[:2])
    assert plans[2].calls == ()


def test_decisions_are_stateless_the_same_conversation_gets_the_same_plan() -> None:
    scenario = parse_scenario("finish_after:5")
    assert decide(scenario, conversation(3), [EDIT]) == decide(scenario, conversation(3), [EDIT])


def test_repeat_forever_proposes_the_identical_call_every_turn() -> None:
    plans = {decide(parse_scenario("repeat_forever"), conversation(k), [EDIT]).calls for k in range(6)}
    assert len(plans) == 1


def test_oscillate_alternates_two_edits() -> None:
    args = [decide(parse_scenario("oscillate"), conversation(k), [EDIT]).calls[0].arguments for k in range(4)]
    assert args[0] == args[2] and args[1] == args[3] and args[0] != args[1]


def test_vary_args_changes_only_text_form_and_volatile_keys() -> None:
    texts = [
        decide(parse_scenario("vary_args"), conversation(k), [EDIT]).calls[0].arguments for k in range(3)
    ]
    # Then the three texts differ, yet parse to the same intent once the volatile key is dropped
    assert len(set(texts)) == 3
    parsed = [json.loads(t) for t in texts]
    assert "timestamp" in parsed[2]
    parsed[2].pop("timestamp")
    assert parsed[0] == parsed[1] == parsed[2]


def test_truncate_cuts_inside_the_tool_call_json() -> None:
    plan = decide(parse_scenario("truncate"), conversation(0), [EDIT])
    assert plan.cut_after is not None and plan.calls


@pytest.mark.parametrize(
    ("header", "observations", "broken"),
    [("malformed_json:1", 0, True), ("malformed_json:1", 1, False), ("malformed_json", 7, True)],
)
def test_malformed_json_for_the_first_n_replies(header: str, observations: int, broken: bool) -> None:
    messages = conversation(0) + [{"role": "user", "content": "arguments were not JSON"}] * observations
    plan = decide(parse_scenario(header), messages, [EDIT])
    if broken:
        with pytest.raises(json.JSONDecodeError):
            json.loads(plan.calls[0].arguments)
    else:
        assert plan.finish is FinishReason.STOP


def test_refuse_is_a_content_filter_stop() -> None:
    plan = decide(parse_scenario("refuse"), conversation(0), [EDIT])
    assert plan.finish is FinishReason.CONTENT_FILTER and plan.text


def test_irreversible_proposes_the_named_tool_until_it_has_a_result() -> None:
    scenario = parse_scenario("irreversible:deploy")
    first = decide(scenario, conversation(0), [EDIT, DEPLOY])
    assert first.calls[0].tool == "deploy"
    # an unrelated tool result does not end it; a result for a deploy call does
    assert decide(scenario, conversation(1, call_name="edit"), [EDIT, DEPLOY]).calls[0].tool == "deploy"
    assert decide(scenario, conversation(1, call_name="deploy"), [EDIT, DEPLOY]).finish is FinishReason.STOP


def test_parallel_emits_k_calls_then_finishes() -> None:
    scenario = parse_scenario("parallel:3")
    first = decide(scenario, conversation(0), [EDIT, DEPLOY])
    assert [c.tool for c in first.calls] == ["edit", "deploy", "edit"]
    assert len({c.arguments for c in first.calls}) == 3
    assert decide(scenario, conversation(1), [EDIT, DEPLOY]).finish is FinishReason.STOP


def test_slow_answers_with_exactly_n_tokens() -> None:
    from testbed.provider.tokenizer import count_tokens

    plan = decide(parse_scenario("slow:37"), conversation(0))
    assert count_tokens(plan.text) == 37 and plan.finish is FinishReason.STOP


@pytest.mark.parametrize("tool_choice", ["none", {"type": "function", "function": {"name": "missing"}}])
def test_tool_scenarios_answer_in_text_when_no_tool_is_offered(tool_choice: Any) -> None:
    plan = decide(parse_scenario("finish_after:3"), conversation(0), [EDIT], tool_choice)
    assert plan.finish is FinishReason.STOP and plan.calls == ()


def test_tool_choice_naming_a_function_selects_it() -> None:
    choice = {"type": "function", "function": {"name": "deploy"}}
    plan = decide(parse_scenario("finish_after:1"), conversation(0), [EDIT, DEPLOY], choice)
    assert plan.calls[0].tool == "deploy"


def test_script_calls_each_step_with_its_exact_arguments_then_answers() -> None:
    # Given a two-step script
    scenario = parse_scenario(
        'script:[["git_add", {"repo_path": "/r", "files": ["a"]}], '
        '["git_commit", {"repo_path": "/r", "message": "m"}]]'
    )
    user = {"role": "user", "content": "go"}
    first = {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "git_add"}}]}
    # When the model is asked with no, one and two tool results
    plans = [
        decide(scenario, [user]),
        decide(scenario, [user, first, {"role": "tool", "tool_call_id": "c1", "content": "ok"}]),
        decide(
            scenario,
            [
                user,
                first,
                {"role": "tool", "tool_call_id": "c1"},
                first,
                {"role": "tool", "tool_call_id": "c1"},
            ],
        ),
    ]
    # Then it calls step 1, then step 2 with exactly the scripted arguments, then gives a final answer
    assert [(c.tool, json.loads(c.arguments)) for p in plans[:2] for c in p.calls] == [
        ("git_add", {"repo_path": "/r", "files": ["a"]}),
        ("git_commit", {"repo_path": "/r", "message": "m"}),
    ]
    assert plans[2].finish is FinishReason.STOP and not plans[2].calls


@pytest.mark.parametrize(
    "text", ["script:", "script:{}", "script:[[1, {}]]", 'script:[["t", []]]', "script:[not json"]
)
def test_bad_scripts_are_refused(text: str) -> None:
    # Given a malformed script, When parsed, Then it is refused naming the problem
    with pytest.raises(ScenarioError, match="script"):
        parse_scenario(text)
