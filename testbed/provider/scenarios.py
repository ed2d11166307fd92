"""Scripted model behaviours, chosen per request by the ``X-Tether-Scenario`` header (pure).

The provider keeps no script state between requests: every decision is a function of the request's
conversation, so a client that crashed and resent its log-rebuilt conversation gets the reply it
would have got. Two counts drive the scripts:

- ``tool_results``: messages with role ``tool``;
- ``observations``: messages with role ``tool`` or ``user`` after the first ``user`` message (whatever
  the harness fed back after a reply, e.g. a note that a truncated or malformed call was not run).

Grammar (``name`` or ``name:argument``; no header means ``finish_after:0``)::

    finish_after:N      N >= 0. While tool_results < N: call the first offered tool with arguments
                        carrying step = tool_results + 1; then a final answer (finish_reason "stop").
    repeat_forever      the same call (same arguments) every turn.
    oscillate           two edits alternating A, B, A, B ... (by parity of tool_results).
    vary_args           one call whose argument TEXT varies trivially, cycling by tool_results mod 3:
                        compact JSON; indented JSON with a trailing newline; keys in reverse order
                        plus a volatile ``"timestamp"`` key (the key only when the schema allows it).
    truncate[:N]        output cut with finish_reason "length" (mid tool-call JSON when a tool is
                        offered); the first N replies (observations < N), or every reply without N.
    malformed_json[:N]  a tool call whose arguments are not valid JSON (a trailing comma); first N
                        replies or every reply, as for truncate; then a final answer.
    refuse              finish_reason "content_filter" with a short refusal text, every turn.
    irreversible:TOOL   propose a call to TOOL (offered or not) until a tool result answers a TOOL
                        call (approved result or denial), then a final answer.
    parallel:K          K >= 1 calls in one reply (cycling through offered tools), then a final answer.
    slow[:N]            a plain text answer of N tokens (default 400), finish_reason "stop".
    script:JSON         exact calls, one per reply: JSON is a list of [TOOL, ARGUMENTS] pairs; reply k
                        (k = tool_results) calls pair k with those arguments, then a final answer. For
                        tools whose arguments must be real (a repository path, a timezone).

"The first offered tool" honours ``tool_choice``: ``"none"`` offers nothing and a named function
offers only that one. When a scenario needs a tool and none is offered, it answers in text instead.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from runtime.errors import InputError
from testbed.provider.arguments import example_arguments
from testbed.provider.tokenizer import count_tokens

__all__ = [
    "DEFAULT_SCENARIO",
    "FinishReason",
    "Plan",
    "PlannedCall",
    "Scenario",
    "ScenarioError",
    "ScenarioKind",
    "decide",
    "parse_scenario",
]

DEFAULT_SCENARIO = "finish_after:0"
_SLOW_DEFAULT_TOKENS = 400
_FILLER_WORDS = ("the", "slow", "run", "goes", "on", "and", "each", "word", "is", "one", "tok")
_REFUSAL_TEXT = "I can't help with that request."


class ScenarioError(InputError):
    """The ``X-Tether-Scenario`` header does not follow the grammar."""


class ScenarioKind(StrEnum):
    FINISH_AFTER = "finish_after"
    REPEAT_FOREVER = "repeat_forever"
    OSCILLATE = "oscillate"
    VARY_ARGS = "vary_args"
    TRUNCATE = "truncate"
    MALFORMED_JSON = "malformed_json"
    REFUSE = "refuse"
    IRREVERSIBLE = "irreversible"
    PARALLEL = "parallel"
    SLOW = "slow"
    SCRIPT = "script"


class FinishReason(StrEnum):
    """OpenAI ``finish_reason`` values the simulator emits."""

    STOP = "stop"
    LENGTH = "length"
    TOOL_CALLS = "tool_calls"
    CONTENT_FILTER = "content_filter"


@dataclass(frozen=True, slots=True)
class Scenario:
    """A parsed scenario: ``count`` is N/K where the grammar has one, ``tool`` for irreversible, ``script``
    the calls of a script (tool, arguments as JSON text)."""

    kind: ScenarioKind
    count: int | None = None
    tool: str | None = None
    script: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class PlannedCall:
    tool: str
    arguments: str  # the exact text the model emits (possibly not JSON, on purpose)


@dataclass(frozen=True, slots=True)
class Plan:
    """The reply before latency and ``max_tokens`` apply. ``cut_after`` forces a length stop."""

    text: str
    calls: tuple[PlannedCall, ...]
    finish: FinishReason
    cut_after: int | None = None


_COUNTED = {ScenarioKind.FINISH_AFTER, ScenarioKind.PARALLEL}
_OPTIONAL_COUNT = {ScenarioKind.TRUNCATE, ScenarioKind.MALFORMED_JSON, ScenarioKind.SLOW}


def parse_scenario(header: str | None) -> Scenario:
    """Parse the header value; raise :class:`ScenarioError` naming what is wrong."""
    text = (header or DEFAULT_SCENARIO).strip()
    name, sep, arg = text.partition(":")
    try:
        kind = ScenarioKind(name.strip())
    except ValueError:
        known = ", ".join(k.value for k in ScenarioKind)
        raise ScenarioError(f"unknown scenario {name!r}; known: {known}", where="X-Tether-Scenario") from None
    arg = arg.strip()
    if kind is ScenarioKind.SCRIPT:
        return Scenario(kind, script=_parse_script(arg))
    if kind is ScenarioKind.IRREVERSIBLE:
        if not arg:
            raise ScenarioError(
                "irreversible needs a tool name: irreversible:TOOL", where="X-Tether-Scenario"
            )
        return Scenario(kind, tool=arg)
    if kind in _COUNTED or (kind in _OPTIONAL_COUNT and sep):
        if not arg.isdigit():
            raise ScenarioError(
                f"{kind}: expected a non-negative integer, got {arg!r}", where="X-Tether-Scenario"
            )
        count = int(arg)
        if kind is ScenarioKind.PARALLEL and count < 1:
            raise ScenarioError("parallel:K needs K >= 1", where="X-Tether-Scenario")
        return Scenario(kind, count=count)
    if sep:
        raise ScenarioError(f"{kind} takes no argument, got {arg!r}", where="X-Tether-Scenario")
    return Scenario(kind)


def _parse_script(text: str) -> tuple[tuple[str, str], ...]:
    where = "X-Tether-Scenario"
    try:
        steps = json.loads(text)
    except ValueError as e:
        raise ScenarioError(f"script: not JSON: {e}", where=where) from None
    if not isinstance(steps, list) or not steps:
        raise ScenarioError("script: expected a non-empty list of [TOOL, ARGUMENTS] pairs", where=where)
    calls = []
    for i, step in enumerate(steps):
        ok = isinstance(step, list) and len(step) == 2 and isinstance(step[0], str) and step[0]
        if not ok or not isinstance(step[1], dict):
            raise ScenarioError(f"script[{i}]: expected [TOOL, {{arguments}}], got {step!r}", where=where)
        calls.append((step[0], json.dumps(step[1])))
    return tuple(calls)


@dataclass(frozen=True, slots=True)
class _Facts:
    tool_results: int
    observations: int
    answered_tools: frozenset[str]


def _facts(messages: Sequence[Mapping[str, Any]]) -> _Facts:
    call_names: dict[str, str] = {}
    answered: set[str] = set()
    tool_results = observations = 0
    seen_first_user = False
    for message in messages:
        role = message.get("role")
        for call in message.get("tool_calls") or ():
            call_names[str(call.get("id"))] = str((call.get("function") or {}).get("name"))
        if role == "tool":
            tool_results += 1
            name = call_names.get(str(message.get("tool_call_id")))
            if name is not None:
                answered.add(name)
        if role in ("tool", "user"):
            if seen_first_user:
                observations += 1
            seen_first_user = seen_first_user or role == "user"
    return _Facts(tool_results, observations, frozenset(answered))


def _offered(tools: Sequence[Mapping[str, Any]], tool_choice: Any) -> list[Mapping[str, Any]]:
    functions = [t.get("function") or {} for t in tools if t.get("type", "function") == "function"]
    if tool_choice == "none":
        return []
    if isinstance(tool_choice, Mapping):
        wanted = (tool_choice.get("function") or {}).get("name")
        return [f for f in functions if f.get("name") == wanted]
    return functions


def _final(tool_results: int) -> Plan:
    return Plan(f"Done after {tool_results} tool calls.", (), FinishReason.STOP)


def _call(function: Mapping[str, Any], *, step: int, tag: str) -> PlannedCall:
    args = example_arguments(function.get("parameters"), step=step, tag=tag)
    return PlannedCall(str(function.get("name")), json.dumps(args))


def decide(
    scenario: Scenario,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] = (),
    tool_choice: Any = None,
) -> Plan:
    """What the scripted model replies to this conversation."""
    facts = _facts(messages)
    offered = _offered(tools, tool_choice)
    kind = scenario.kind
    if kind is ScenarioKind.REFUSE:
        return Plan(_REFUSAL_TEXT, (), FinishReason.CONTENT_FILTER)
    if kind is ScenarioKind.SLOW:
        n = _SLOW_DEFAULT_TOKENS if scenario.count is None else scenario.count
        words = (_FILLER_WORDS[i % len(_FILLER_WORDS)] for i in range(n))
        return Plan(" ".join(words), (), FinishReason.STOP)
    if kind is ScenarioKind.IRREVERSIBLE:
        assert scenario.tool is not None
        if scenario.tool in facts.answered_tools:
            return _final(facts.tool_results)
        spec = next((f for f in offered if f.get("name") == scenario.tool), {"name": scenario.tool})
        return Plan("", (_call(spec, step=1, tag="irreversible"),), FinishReason.TOOL_CALLS)
    if kind is ScenarioKind.SCRIPT:
        if facts.tool_results >= len(scenario.script):
            return _final(facts.tool_results)
        tool, arguments = scenario.script[facts.tool_results]
        return Plan("", (PlannedCall(tool, arguments),), FinishReason.TOOL_CALLS)
    if kind in (ScenarioKind.TRUNCATE, ScenarioKind.MALFORMED_JSON) and (
        scenario.count is not None and facts.observations >= scenario.count
    ):
        return _final(facts.tool_results)
    if not offered:
        if kind is ScenarioKind.TRUNCATE:
            return Plan(" ".join(_FILLER_WORDS * 4), (), FinishReason.STOP, cut_after=len(_FILLER_WORDS))
        return _final(facts.tool_results)
    first = offered[0]
    return _with_tools(scenario, facts, first, offered)


def _with_tools(
    scenario: Scenario, facts: _Facts, first: Mapping[str, Any], offered: Sequence[Mapping[str, Any]]
) -> Plan:
    kind = scenario.kind
    k = facts.tool_results
    if kind is ScenarioKind.FINISH_AFTER:
        assert scenario.count is not None
        if k >= scenario.count:
            return _final(k)
        return Plan("", (_call(first, step=k + 1, tag=f"step{k + 1}"),), FinishReason.TOOL_CALLS)
    if kind is ScenarioKind.REPEAT_FOREVER:
        return Plan("", (_call(first, step=1, tag="same"),), FinishReason.TOOL_CALLS)
    if kind is ScenarioKind.OSCILLATE:
        tag = "A" if k % 2 == 0 else "B"
        return Plan("", (_call(first, step=1 if tag == "A" else 2, tag=tag),), FinishReason.TOOL_CALLS)
    if kind is ScenarioKind.VARY_ARGS:
        return Plan("", (PlannedCall(str(first.get("name")), _varied(first, k)),), FinishReason.TOOL_CALLS)
    if kind is ScenarioKind.PARALLEL:
        assert scenario.count is not None
        if k > 0:
            return _final(k)
        calls = tuple(
            _call(offered[i % len(offered)], step=i + 1, tag=f"part{i + 1}") for i in range(scenario.count)
        )
        return Plan("", calls, FinishReason.TOOL_CALLS)
    if kind is ScenarioKind.MALFORMED_JSON:
        valid = _call(first, step=1, tag="broken")
        return Plan("", (PlannedCall(valid.tool, valid.arguments[:-1] + ", }"),), FinishReason.TOOL_CALLS)
    # TRUNCATE: cut inside the arguments (after the call header token and half the argument tokens).
    call = _call(first, step=1, tag="truncated")
    return Plan("", (call,), FinishReason.TOOL_CALLS, cut_after=1 + max(1, count_tokens(call.arguments) // 2))


def _varied(function: Mapping[str, Any], k: int) -> str:
    args = example_arguments(function.get("parameters"), step=1, tag="same")
    allows_extra = (function.get("parameters") or {}).get("additionalProperties", True) is not False
    variant = k % 3
    if variant == 0:
        return json.dumps(args, separators=(",", ":"))
    if variant == 1:
        return json.dumps(args, indent=2) + "\n"
    reordered = dict(reversed(list(args.items())))
    if allows_extra:
        reordered["timestamp"] = 1_700_000_000 + k
    return json.dumps(reordered)
