"""The OpenAI adapter against the simulated provider: in process (``actors.model_openai.OpenAIModel``) and
one actor call away in the node's model client (``actors.model_client.RayModelClient``); every test that
takes the ``model`` fixture runs against both."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest

from actors.model_client import ModelTarget, RayModelClient, node_client
from actors.model_openai import ModelCallFailed, ModelRateLimited, OpenAIModel, estimate_prompt_tokens
from cluster.redis_server import free_port
from runtime.clock import FakeClock, SystemClock
from runtime.errors import DependencyError, ModelCallCancelled, ProviderRateLimited
from runtime.ports import CancelToken, ModelPort, ModelRequest, StopReason
from testbed.provider import ConfigPatch, Fault, ProviderConfig, ProviderServer
from testbed.provider.reply import render
from testbed.provider.scenarios import decide, parse_scenario

pytestmark = pytest.mark.integration

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
TASK = (
    {"role": "system", "content": "You edit files."},
    {"role": "user", "content": "Fix the bug in app.py"},
)


def request(
    scenario: str,
    *,
    trajectory: str = "t1",
    max_tokens: int = 256,
    deadline: float | None = None,
    messages: Any = TASK,
) -> ModelRequest:
    return ModelRequest(
        trajectory_id=trajectory,
        model="tether-sim",
        messages=list(messages),
        max_tokens=max_tokens,
        deadline=deadline if deadline is not None else SystemClock().wall() + 60,
        tools=[EDIT],
        metadata={"scenario": scenario},
    )


@pytest.fixture
async def server() -> AsyncIterator[ProviderServer]:
    async with ProviderServer(ProviderConfig(rpm=1000, tpm=1_000_000)) as s:
        yield s


Model = OpenAIModel | RayModelClient


@pytest.fixture(params=["in_process", "node_client"])
async def model(request: pytest.FixtureRequest, server: ProviderServer) -> AsyncIterator[Model]:
    if request.param == "node_client":
        request.getfixturevalue("ray_local")
        yield RayModelClient(ModelTarget(server.base_url), actor=node_client())
        return
    adapter = OpenAIModel(base_url=server.base_url)
    yield adapter
    await adapter.aclose()


async def wait_for(predicate: Any, what: str, attempts: int = 500) -> None:
    """Poll a condition (bounds the wait; asserts nothing about time)."""
    for _ in range(attempts):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never became true: {what}")


def test_adapter_is_a_model_port() -> None:
    assert isinstance(OpenAIModel(base_url="http://127.0.0.1:9/v1"), ModelPort)
    assert isinstance(RayModelClient(ModelTarget("http://127.0.0.1:9/v1"), actor=object()), ModelPort)


def test_an_injected_client_with_sdk_retries_is_refused() -> None:
    with pytest.raises(ValueError, match="max_retries=0"):
        OpenAIModel(base_url="x", client=openai.AsyncOpenAI(base_url="http://127.0.0.1:9/v1", api_key="k"))


@pytest.mark.parametrize(
    ("scenario", "max_tokens", "stop"),
    [
        ("finish_after:0", 256, StopReason.END_TURN),
        ("finish_after:1", 256, StopReason.TOOL_USE),
        ("truncate", 256, StopReason.MAX_TOKENS),
        ("slow:40", 5, StopReason.MAX_TOKENS),
        ("refuse", 256, StopReason.REFUSAL),
    ],
)
async def test_finish_reasons_map_to_stop_reasons(
    model: Model, scenario: str, max_tokens: int, stop: StopReason
) -> None:
    reply = await model.complete(request(scenario, max_tokens=max_tokens), CancelToken())
    assert reply.stop_reason is stop


async def test_usage_comes_from_the_provider_with_cached_input(model: Model, server: ProviderServer) -> None:
    # Given a first call and a follow-up that extends the same conversation
    first = await model.complete(request("finish_after:1"), CancelToken())
    (call,) = first.tool_calls
    follow_up = [
        *TASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": call.tool, "arguments": call.raw_arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "edited"},
    ]
    second = await model.complete(request("finish_after:1", messages=follow_up), CancelToken())
    # Then the second reply ends the turn, its prompt is split into cached and uncached input,
    # and the adapter's usage equals the provider's own ledger exactly
    assert second.stop_reason is StopReason.END_TURN and second.text == "Done after 1 tool calls."
    assert first.usage.cached_input == 0
    assert second.usage.cached_input > 0 and second.usage.uncached_input > 0
    ledger = server.stats()["trajectories"]["t1"]
    total = first.usage + second.usage
    assert (total.uncached_input + total.cached_input, total.cached_input, total.output) == (
        ledger["prompt_tokens"],
        ledger["cached_tokens"],
        ledger["completion_tokens"],
    )


async def test_rate_limit_remaining_is_reported_on_success(model: Model, server: ProviderServer) -> None:
    reply = await model.complete(request("finish_after:0"), CancelToken())
    assert reply.rate_limit is not None
    assert reply.rate_limit.remaining_requests == 999
    assert reply.rate_limit.remaining_tokens is not None and 0 < reply.rate_limit.remaining_tokens < 1_000_000


@pytest.mark.parametrize("scenario", ["malformed_json", "truncate"])
async def test_broken_arguments_are_passed_through_raw_and_untouched(model: Model, scenario: str) -> None:
    # Given what the scripted model emits for this conversation
    req = request(scenario)
    emitted = render(
        decide(parse_scenario(scenario), req.messages, req.tools),
        max_tokens=req.max_tokens,
        trajectory_id="t1",
        turn=0,
    )
    ((call_id, name, arguments),) = emitted.calls()
    # When the adapter receives it
    reply = await model.complete(req, CancelToken())
    # Then the proposal carries exactly the emitted text, which does not parse
    (proposal,) = reply.tool_calls
    assert (proposal.call_id, proposal.tool, proposal.raw_arguments) == (call_id, name, arguments)
    with pytest.raises(json.JSONDecodeError):
        json.loads(proposal.raw_arguments)


async def test_parallel_calls_become_separate_proposals(model: Model) -> None:
    reply = await model.complete(request("parallel:3"), CancelToken())
    assert reply.stop_reason is StopReason.TOOL_USE
    assert len({c.call_id for c in reply.tool_calls}) == 3
    assert [json.loads(c.raw_arguments)["step"] for c in reply.tool_calls] == [1, 2, 3]


async def test_cancel_mid_stream_raises_with_the_emitted_chunks_billed(server: ProviderServer) -> None:
    # Given a slow 300-token reply and a cancel that fires when the 5th token arrives
    server.configure(ConfigPatch(tokens_per_s=100))
    token = CancelToken()
    seen: list[int] = []

    def on_chunk(n: int) -> None:
        seen.append(n)
        if n == 5:
            token.cancel("operator pause")

    model = OpenAIModel(base_url=server.base_url, on_chunk=on_chunk)
    req = request("slow:300", trajectory="cancelled")
    # When the call runs
    with pytest.raises(ModelCallCancelled) as info:
        await model.complete(req, token)
    await model.aclose()
    # Then the partial reply is discarded and the usage bills the 5 chunks plus the prompt estimate
    assert info.value.reason == "operator pause"
    assert info.value.usage.output == 5 == seen[-1]
    assert info.value.usage.uncached_input == estimate_prompt_tokens(req)
    # And the provider saw the stream aborted, having sent at least those 5 and far fewer than 300
    await wait_for(lambda: server.stats()["in_flight"] == 0, "the provider noticed the abort")
    ledger = server.stats()["trajectories"]["cancelled"]
    assert ledger["aborted"] == 1
    assert 5 <= ledger["completion_tokens"] < 300


async def test_cancel_before_the_first_token(server: ProviderServer, model: Model) -> None:
    # Given a provider that takes a minute to the first token
    server.configure(ConfigPatch(ttft_ms=60_000))
    token = CancelToken()
    call = asyncio.create_task(model.complete(request("slow:10", trajectory="early"), token))
    await wait_for(lambda: server.stats()["in_flight"] == 1, "the request reached the provider")
    # When the harness cancels
    token.cancel("kill")
    # Then the call ends at once with nothing emitted
    with pytest.raises(ModelCallCancelled) as info:
        await call
    assert info.value.usage.output == 0
    # And the provider stops working on it too (the connection was closed)
    await wait_for(lambda: server.stats()["in_flight"] == 0, "the provider noticed the abort")
    assert server.stats()["trajectories"]["early"] == {
        "requests": 1,
        "accepted": 1,
        "rate_limited": 0,
        "aborted": 1,
        "prompt_tokens": server.stats()["tokens"]["prompt"],
        "cached_tokens": 0,
        "completion_tokens": 0,
    }


async def test_already_cancelled_token_makes_no_call(model: Model, server: ProviderServer) -> None:
    token = CancelToken()
    token.cancel("paused")
    with pytest.raises(ModelCallCancelled):
        await model.complete(request("finish_after:0"), token)
    assert server.stats()["requests"] == 0


async def test_deadline_on_the_injected_clock_aborts_as_a_retryable_dependency_error(
    server: ProviderServer,
) -> None:
    # Given an adapter on a fake clock and a provider that is slow to answer
    server.configure(ConfigPatch(ttft_ms=60_000))
    clock = FakeClock(wall_start=SystemClock().wall())
    model = OpenAIModel(base_url=server.base_url, clock=clock)
    call = asyncio.create_task(model.complete(request("slow:5", deadline=clock.wall() + 30), CancelToken()))
    await wait_for(lambda: server.stats()["in_flight"] == 1, "the request reached the provider")
    # When the deadline passes on the adapter's clock
    clock.advance(31)
    # Then the call fails as a retryable dependency error naming the deadline
    with pytest.raises(DependencyError) as info:
        await call
    await model.aclose()
    assert "deadline" in str(info.value) and not info.value.non_retryable
    await wait_for(lambda: server.stats()["aborted"] == 1, "the provider noticed the abort")


async def test_a_deadline_already_passed_makes_no_call(model: Model, server: ProviderServer) -> None:
    with pytest.raises(ModelCallFailed, match="deadline passed"):
        await model.complete(request("finish_after:0", deadline=SystemClock().wall() - 1), CancelToken())
    assert server.stats()["requests"] == 0


async def test_429_becomes_provider_rate_limited_with_retry_after_and_remaining(
    model: Model, server: ProviderServer
) -> None:
    server.configure(ConfigPatch(rpm=1))
    await model.complete(request("finish_after:0"), CancelToken())
    with pytest.raises(ProviderRateLimited) as info:
        await model.complete(request("finish_after:0"), CancelToken())
    error = info.value
    assert isinstance(error, ModelRateLimited)
    assert error.retry_after is not None and 0 < error.retry_after <= 60
    assert error.remaining["requests"] == 0
    assert not error.non_retryable


@pytest.mark.parametrize(("status", "non_retryable"), [(500, False), (503, False)])
async def test_server_errors_are_retryable(
    model: Model, server: ProviderServer, status: int, non_retryable: bool
) -> None:
    server.configure(ConfigPatch(fault=Fault(status=status, count=1)))  # type: ignore[arg-type]
    with pytest.raises(ModelCallFailed) as info:
        await model.complete(request("finish_after:0"), CancelToken())
    assert (info.value.status, info.value.non_retryable) == (status, non_retryable)


async def test_other_4xx_is_not_retryable(model: Model) -> None:
    with pytest.raises(ModelCallFailed) as info:
        await model.complete(request("no_such_scenario"), CancelToken())
    assert info.value.status == 400 and info.value.non_retryable
    assert "unknown scenario" in str(info.value)


async def test_the_api_key_goes_with_every_call_and_a_wrong_one_is_not_retryable() -> None:
    # Given a provider that answers only requests carrying its key (``Authorization: Bearer``)
    config = ProviderConfig(rpm=1000, tpm=1_000_000, api_key="sk-tether-test")
    async with ProviderServer(config) as server:
        right = OpenAIModel(base_url=server.base_url, api_key="sk-tether-test")
        wrong = OpenAIModel(base_url=server.base_url, api_key="sk-someone-else")
        try:
            # Then the adapter's key is sent: the call is answered
            reply = await right.complete(request("finish_after:0"), CancelToken())
            assert reply.stop_reason is StopReason.END_TURN
            # and a wrong key is the provider's 401, which no retry can fix
            with pytest.raises(ModelCallFailed) as info:
                await wrong.complete(request("finish_after:0"), CancelToken())
            assert info.value.status == 401 and info.value.non_retryable
        finally:
            await right.aclose()
            await wrong.aclose()


async def test_connection_refused_is_retryable() -> None:
    model = OpenAIModel(base_url=f"http://127.0.0.1:{free_port()}/v1")
    with pytest.raises(ModelCallFailed) as info:
        await model.complete(request("finish_after:0"), CancelToken())
    await model.aclose()
    assert not info.value.non_retryable and info.value.status is None


async def test_connect_opens_a_connection_without_a_completion(server: ProviderServer) -> None:
    # Given an adapter that has made no call yet
    model = OpenAIModel(base_url=server.base_url)
    # When it connects ahead of its first call (GET /models)
    assert await model.connect()
    # Then the provider counted no completion request and no limit was touched
    stats = server.stats()
    assert (stats["requests"], stats["accepted"], stats["rate_limited"]) == (0, 0, 0)
    reply = await model.complete(request("finish_after:0"), CancelToken())
    assert reply.usage.output > 0
    assert server.stats()["requests"] == 1
    await model.aclose()


async def test_connect_to_nothing_is_given_up_and_said() -> None:
    model = OpenAIModel(base_url=f"http://127.0.0.1:{free_port()}/v1")
    assert not await model.connect()  # refused at once: the first call will open its own connection
    await model.aclose()


# --------------------------------------------------------------------------- the node's model client


@pytest.fixture
def client(ray_local: None) -> Any:
    return node_client()


async def test_node_client_cancel_mid_stream_bills_what_streamed_and_aborts_the_provider(
    server: ProviderServer, client: Any
) -> None:
    # Given a slow 300-token reply streaming through the node's model client
    server.configure(ConfigPatch(tokens_per_s=100))
    model = RayModelClient(ModelTarget(server.base_url), actor=client)
    token = CancelToken()
    req = request("slow:300", trajectory="hop-cancelled")
    before = await client.chunks_received.remote()
    call = asyncio.create_task(model.complete(req, token))
    for _ in range(500):  # bounded poll: until 5 chunks reached the client
        if await client.chunks_received.remote() >= before + 5:
            break
        await asyncio.sleep(0.01)
    # When the trajectory cancels
    token.cancel("operator pause")
    # Then the call ends cancelled, billing the prompt estimate and the chunks the client received
    with pytest.raises(ModelCallCancelled) as info:
        await call
    assert info.value.reason == "operator pause"
    assert 5 <= info.value.usage.output < 300
    assert info.value.usage.uncached_input == estimate_prompt_tokens(req)
    # And the provider saw the stream aborted, far short of 300 tokens
    await wait_for(lambda: server.stats()["in_flight"] == 0, "the provider noticed the abort")
    ledger = server.stats()["trajectories"]["hop-cancelled"]
    assert ledger["aborted"] == 1 and ledger["completion_tokens"] < 300
    assert await client.in_flight.remote() == 0


async def test_node_client_stops_the_stream_when_the_callers_await_is_cancelled(
    server: ProviderServer, client: Any
) -> None:
    # Given a call waiting a minute for its first token in the node's model client
    server.configure(ConfigPatch(ttft_ms=60_000))
    model = RayModelClient(ModelTarget(server.base_url), actor=client)
    call = asyncio.create_task(model.complete(request("slow:10", trajectory="hop-dropped"), CancelToken()))
    await wait_for(lambda: server.stats()["in_flight"] == 1, "the request reached the provider")
    # When the coroutine awaiting it is cancelled (the trajectory actor closing, recovery)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    # Then the client closes the provider's stream too, and holds no call any more
    await wait_for(lambda: server.stats()["in_flight"] == 0, "the provider noticed the abort")
    assert server.stats()["trajectories"]["hop-dropped"]["aborted"] == 1
    assert await client.in_flight.remote() == 0


async def test_node_client_connection_refused_is_retryable(client: Any) -> None:
    model = RayModelClient(ModelTarget(f"http://127.0.0.1:{free_port()}/v1"), actor=client)
    with pytest.raises(ModelCallFailed) as info:
        await model.complete(request("finish_after:0"), CancelToken())
    assert not info.value.non_retryable and info.value.status is None


async def test_node_client_that_died_mid_call_is_a_retryable_failure(
    server: ProviderServer, ray_local: None
) -> None:
    # Given a call in flight in a model client actor
    server.configure(ConfigPatch(ttft_ms=60_000))
    import ray

    from actors.model_client import ModelClientActor

    actor_class: Any = ModelClientActor
    actor = actor_class.options(max_restarts=0).remote()
    model = RayModelClient(ModelTarget(server.base_url), actor=actor)
    call = asyncio.create_task(model.complete(request("slow:10", trajectory="hop-died"), CancelToken()))
    await wait_for(lambda: server.stats()["in_flight"] == 1, "the request reached the provider")
    # When the client actor dies
    ray.kill(actor)
    # Then the caller gets a retryable dependency failure naming the client, never a foreign exception
    with pytest.raises(ModelCallFailed) as info:
        await call
    assert "model client" in str(info.value) and not info.value.non_retryable


async def test_an_idle_node_client_retires_and_the_next_call_goes_to_its_successor(
    server: ProviderServer, ray_local: None
) -> None:
    # Given a model client that retires after half a second without a call (an actor on a node keeps the
    # autoscaler from removing the node), and a trajectory's handle that still points at it
    import ray

    from actors.model_client import ModelClientActor

    actor_class: Any = ModelClientActor
    retiring = actor_class.options(max_restarts=0).remote(0.5)
    model = RayModelClient(ModelTarget(server.base_url), actor=retiring)
    await model.complete(request("finish_after:0", trajectory="before-retiring"), CancelToken())
    # When the node has made no call for longer than that
    await wait_for(lambda: _dead(retiring), "the idle client exited")
    # Then the next call is carried out, once, by the node's client found again (the retired one never
    # started it: the provider saw exactly one request for it)
    reply = await model.complete(request("finish_after:0", trajectory="after-retiring"), CancelToken())
    assert reply.usage.output > 0
    assert server.stats()["trajectories"]["after-retiring"]["requests"] == 1
    # the control: the retired client itself answers no call any more
    with pytest.raises(ray.exceptions.RayActorError):
        await retiring.in_flight.remote()


def _dead(actor: Any) -> bool:
    import ray

    try:
        ray.get(actor.in_flight.remote(), timeout=5)
    except ray.exceptions.RayActorError:
        return True
    return False
