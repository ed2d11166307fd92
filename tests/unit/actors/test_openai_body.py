"""The body ``OpenAIModel`` posts is what the SDK's typed ``chat.completions.create`` would have sent.

The adapter posts its body through the client's ``post`` instead of ``create``, because ``create`` first walks
the whole body against its typed parameters (``async_maybe_transform``), at a CPU cost that grows with the
transcript. That is only sound while the walk changes nothing in what Tether sends: no key renamed, no value
reformatted, nothing dropped. Here every request of a trajectory with tool calls, a rejected call, text and a
final answer is built the product's way (the decider renders the messages and the registry the tools) and
put through the SDK's own transform: it must come back equal. An SDK version that starts rewriting any of it
fails this test before it changes a request on the wire.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import openai
import pytest
from openai._utils import async_maybe_transform
from openai.types.chat import completion_create_params

from actors.model_openai import OpenAIModel
from runtime.clock import FakeClock
from runtime.effects import CallModel
from runtime.ports import ModelReply, ModelRequest, StopReason, ToolCallProposal, Usage
from runtime.states import TrajectoryState
from tests.unit.trajectory.sim import Sim, created, tool_results


def _script(messages: Sequence[Mapping[str, Any]]) -> ModelReply:
    """Two good calls with text beside them, one with arguments that are not JSON, then an answer."""
    k = tool_results(messages)
    usage = Usage(100 + 10 * k, 0, 20)
    if k == 0:
        call = ToolCallProposal("call-0", "run_tests", json.dumps({"suite": "unit"}))
        return ModelReply(StopReason.TOOL_USE, "Running the unit suite first.", [call], usage)
    if k == 1:
        call = ToolCallProposal("call-1", "run_tests", '{"suite": ')  # cut off: rejected, the error goes back
        return ModelReply(StopReason.TOOL_USE, "", [call], usage)
    if k == 2:
        calls = [
            ToolCallProposal("call-2", "run_tests", json.dumps({"suite": "integration"})),
            ToolCallProposal("call-3", "notify", json.dumps({"channel": "ops", "text": "½ way ✓ ünï"})),
        ]
        return ModelReply(StopReason.TOOL_USE, "", calls, usage)
    return ModelReply(StopReason.END_TURN, "All suites pass.", [], usage)


def _requests() -> list[ModelRequest]:
    clock = FakeClock()
    sim = Sim(_script, clock)
    sim.start(created(clock))
    assert sim.run().state is TrajectoryState.COMPLETED
    return [e.request for e in sim.effects if isinstance(e, CallModel)]


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
async def test_the_sdks_transform_leaves_every_body_the_adapter_builds_unchanged(
    field: Literal["max_tokens", "max_completion_tokens"],
) -> None:
    model = OpenAIModel(base_url="http://127.0.0.1:9/v1", max_tokens_field=field)
    requests = _requests()
    # the trajectory's prompts hold every message shape the decider renders
    last = requests[-1].messages
    assert {m["role"] for m in last} == {"user", "assistant", "tool"}
    assert any(m["role"] == "assistant" and m.get("content") for m in last)  # text beside a call
    assert sum(len(m.get("tool_calls") or ()) for m in last) == 4
    assert len(requests) == 4 and all(r.tools for r in requests)
    for request in requests:
        body = model.body(request)
        sent = json.loads(json.dumps(body))  # what goes on the wire
        transformed = await async_maybe_transform(
            body, completion_create_params.CompletionCreateParamsStreaming
        )
        assert transformed == sent, request.messages
        assert body[field] == request.max_tokens and body["stream"] is True


async def test_control_a_body_the_transform_rewrites_is_caught() -> None:
    # Given a body the SDK's walk does change: a parameter marked "not given" is dropped from it
    body: dict[str, Any] = {
        "model": "m",
        "messages": [{"role": "user", "content": "hello"}],
        "stream": True,
        "temperature": openai.NOT_GIVEN,
    }
    transformed = await async_maybe_transform(body, completion_create_params.CompletionCreateParamsStreaming)
    # Then the comparison the test above makes sees the difference
    assert transformed != body
    assert transformed is not None and "temperature" not in transformed
