"""The adapter's contract against a server that misbehaves on purpose (a small aiohttp app in this file).

Whatever the server does (a stream line that is not JSON, a chunk of the wrong shape, a reset mid-stream,
an error event, an HTML 502 from a gateway, no usage report, odd rate-limit headers), ``complete`` raises
only ``runtime.errors`` types whose message says what failed and where, carries the usage it saw, and keeps
what the headers said. The control tests drive the bare ``openai`` SDK against the same server and show the
raw exceptions the adapter converts. Every test that takes the ``model`` fixture runs against the adapter in
process and one actor call away in the node's model client (``actors.model_client.RayModelClient``).
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any

import openai
import pytest
import redis.asyncio as aioredis
from aiohttp import web

from actors.model_client import ModelTarget, RayModelClient, node_client
from actors.model_openai import CallObserved, ModelCallFailed, OpenAIModel, estimate_prompt_tokens
from actors.provider_tally import RedisProviderTally, read_provider_tallies
from runtime.errors import DependencyError, ProviderRateLimited
from runtime.ports import CancelToken, ModelRequest, StopReason, Usage

pytestmark = pytest.mark.integration

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def chunk(content: str | None = None, finish: str | None = None, usage: dict[str, int] | None = None) -> str:
    choices = (
        []
        if content is None and finish is None
        else [{"index": 0, "delta": {"content": content} if content else {}, "finish_reason": finish}]
    )
    body: dict[str, Any] = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    body["choices"] = choices
    if usage is not None:
        body["usage"] = usage
    return json.dumps(body)


USAGE = {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14}


async def sse(request: web.Request, lines: list[str], *, end: str = "done", headers: Any = None) -> Any:
    """Stream ``lines`` as SSE data lines; ``end``: ``done`` ([DONE]), ``eof`` (clean end, no [DONE]),
    ``reset`` (the connection is cut mid-body)."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", **(headers or {})})
    await response.prepare(request)
    for line in lines:
        await response.write(f"data: {line}\n\n".encode())
    if end == "reset":
        assert request.transport is not None
        request.transport.abort()  # the chunked body never completes
        return response
    if end == "done":
        await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


BEHAVIOURS: dict[str, Handler] = {
    "ok": lambda r: sse(
        r,
        [chunk("Hel"), chunk("lo"), chunk(finish="stop"), chunk(usage=USAGE)],
        headers={
            "x-ratelimit-limit-requests": "100",
            "x-ratelimit-remaining-requests": "99",
            "x-ratelimit-reset-requests": "6m0s",
            "x-ratelimit-reset-tokens": "20ms",
        },
    ),
    "no_usage": lambda r: sse(r, [chunk("Hel"), chunk("lo"), chunk(finish="stop")]),
    "empty_no_usage": lambda r: sse(r, [chunk(finish="stop")]),
    "malformed": lambda r: sse(r, [chunk("Hel"), chunk("lo"), '{"id": "c1", "choices": [{"delta": {"cont']),
    "wrong_shape": lambda r: sse(r, [chunk("Hel"), json.dumps({"choices": [{"delta": 7}]})]),
    "choices_object": lambda r: sse(r, [chunk("Hel"), json.dumps({"choices": {"delta": {"content": "lo"}}})]),
    "text_number": lambda r: sse(r, [chunk("Hel"), json.dumps({"choices": [{"delta": {"content": 42}}]})]),
    "tool_index_text": lambda r: sse(
        r,
        [
            chunk("Hel"),
            json.dumps({"choices": [{"delta": {"tool_calls": [{"index": "0", "function": {"name": "f"}}]}}]}),
        ],
    ),
    "tool_name_object": lambda r: sse(
        r,
        [
            chunk("Hel"),
            json.dumps(
                {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"name": {"x": 1}}}]}}]}
            ),
        ],
    ),
    "usage_text": lambda r: sse(
        r, [chunk("Hel"), chunk(finish="stop"), json.dumps({"choices": [], "usage": {"prompt_tokens": "11"}})]
    ),
    "chunk_array": lambda r: sse(r, [chunk("Hel"), json.dumps([{"choices": []}])]),
    "text_true": lambda r: sse(r, [chunk("Hel"), json.dumps({"choices": [{"delta": {"content": True}}]})]),
    "tool_index_null": lambda r: sse(
        r, [chunk("Hel"), json.dumps({"choices": [{"delta": {"tool_calls": [{"index": None, "id": "c"}]}}]})]
    ),
    "sparse_chunks": lambda r: sse(  # what OpenAI-compatible servers omit or send as null
        r,
        [
            json.dumps({"choices": []}),  # a first chunk with no choices (Azure's prompt filter results)
            json.dumps({"choices": [{"index": 0, "delta": None}]}),
            json.dumps({"choices": [{"index": 0, "content_filter_results": {}}]}),  # no delta at all
            json.dumps({"choices": [{"delta": {"content": "Hi", "refusal": None, "tool_calls": None}}]}),
            json.dumps({"choices": [{"delta": {}, "finish_reason": "stop"}], "usage": None}),
            json.dumps({"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 1}}),
        ],
    ),
    "reset": lambda r: sse(r, [chunk("one"), chunk("two"), chunk("three")], end="reset"),
    "reset_after_usage": lambda r: sse(
        r, [chunk("Hi"), chunk(finish="stop"), chunk(usage=USAGE)], end="reset"
    ),
    "eof_early": lambda r: sse(r, [chunk("one"), chunk("two")], end="eof"),
    "error_event": lambda r: sse(r, [chunk("one"), json.dumps({"error": {"message": "upstream exploded"}})]),
    "odd_headers": lambda r: sse(
        r,
        [chunk("ok"), chunk(finish="stop"), chunk(usage=USAGE)],
        headers={"x-ratelimit-remaining-requests": "lots", "x-ratelimit-limit-requests": "50"},
    ),
}


async def status_reply(request: web.Request, status: int, body: str, headers: dict[str, str]) -> web.Response:
    return web.Response(status=status, text=body, headers=headers)


ERRORS: dict[str, tuple[int, str, dict[str, str]]] = {
    "litellm_429": (
        429,
        json.dumps(
            {"error": {"message": "No deployments available", "type": "throttling_error", "code": "429"}}
        ),
        {"llm_provider-retry-after": "60", "content-type": "application/json"},
    ),
    "html_502": (502, "<html><body>Bad Gateway</body></html>", {"content-type": "text/html"}),
    "bad_request": (
        400,
        json.dumps({"error": {"message": "bad max_tokens"}}),
        {"content-type": "application/json"},
    ),
}


async def dispatch(request: web.Request) -> web.StreamResponse:
    model = (await request.json())["model"]
    if model == "date_429":  # dated when answered, as a server does
        retry_at = email.utils.formatdate(time.time() + 30, usegmt=True)
        body = json.dumps({"error": {"message": "slow down"}})
        return await status_reply(
            request, 429, body, {"Retry-After": retry_at, "content-type": "application/json"}
        )
    if model in ERRORS:
        return await status_reply(request, *ERRORS[model])
    return await BEHAVIOURS[model](request)


@pytest.fixture
async def base_url() -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", dispatch)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)  # any free port, learnt from the bound socket
    await site.start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
    await runner.cleanup()


class Recorder:
    def __init__(self) -> None:
        self.calls: list[CallObserved] = []

    def observe(self, call: CallObserved) -> None:
        self.calls.append(call)


@pytest.fixture
async def recorder() -> Recorder:
    return Recorder()


Model = OpenAIModel | RayModelClient


@pytest.fixture
async def local_model(base_url: str, recorder: Recorder) -> AsyncIterator[OpenAIModel]:
    adapter = OpenAIModel(base_url=base_url, scope="misbehaving", observer=recorder)
    yield adapter
    await adapter.aclose()


@pytest.fixture(params=["in_process", "node_client"])
async def model(request: pytest.FixtureRequest, base_url: str, recorder: Recorder) -> AsyncIterator[Model]:
    if request.param == "node_client":
        request.getfixturevalue("ray_local")
        yield RayModelClient(ModelTarget(base_url, scope="misbehaving"), actor=node_client())
        return
    adapter = OpenAIModel(base_url=base_url, scope="misbehaving", observer=recorder)
    yield adapter
    await adapter.aclose()


def request(model: str) -> ModelRequest:
    return ModelRequest(
        trajectory_id="t1",
        model=model,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=64,
        deadline=time.time() + 30,
    )


async def failure(model: Model, name: str) -> ModelCallFailed:
    with pytest.raises(DependencyError) as info:
        await model.complete(request(name), CancelToken())
    assert isinstance(info.value, ModelCallFailed)
    return info.value


# --------------------------------------------------------------------------- replies


async def test_a_good_stream_carries_the_providers_usage_and_its_limits(model: Model) -> None:
    reply = await model.complete(request("ok"), CancelToken())
    assert (reply.stop_reason, reply.text) == (StopReason.END_TURN, "Hello")
    assert reply.usage == Usage(uncached_input=11, output=3) and not reply.usage_estimated
    assert reply.rate_limit is not None
    assert (reply.rate_limit.limit_requests, reply.rate_limit.remaining_requests) == (100, 99)
    assert reply.rate_limit.reset_requests_s == 360.0
    assert reply.rate_limit.reset_tokens_s == pytest.approx(0.02)


async def test_fields_a_server_omits_or_sends_as_null_are_read_as_empty(model: Model) -> None:
    reply = await model.complete(request("sparse_chunks"), CancelToken())
    assert (reply.stop_reason, reply.text, reply.tool_calls) == (StopReason.END_TURN, "Hi", [])
    assert reply.usage == Usage(uncached_input=11, output=1) and not reply.usage_estimated


async def test_a_provider_that_sends_no_usage_is_metered_from_the_estimate_and_flagged(
    model: Model,
) -> None:
    reply = await model.complete(request("no_usage"), CancelToken())
    assert reply.usage_estimated
    assert reply.usage == Usage(uncached_input=estimate_prompt_tokens(request("no_usage")), output=2)


async def test_an_empty_reply_without_usage_is_still_never_metered_as_zero(model: Model) -> None:
    reply = await model.complete(request("empty_no_usage"), CancelToken())
    assert reply.usage_estimated and reply.usage.total > 0


async def test_odd_header_values_are_ignored_and_named_and_the_reply_is_kept(
    local_model: OpenAIModel, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="actors.model_openai"):
        reply = await local_model.complete(request("odd_headers"), CancelToken())
    assert reply.text == "ok" and reply.usage.total == 14
    assert reply.rate_limit is not None
    assert (reply.rate_limit.limit_requests, reply.rate_limit.remaining_requests) == (50, None)
    assert "x-ratelimit-remaining-requests" in caplog.text and "'lots'" in caplog.text


# --------------------------------------------------------------------------- broken streams


async def test_a_malformed_sse_line_is_a_failed_call_naming_the_line_and_billing_what_streamed(
    model: Model,
) -> None:
    error = await failure(model, "malformed")
    text = str(error)
    assert "misbehaving" in text and "HTTP 200 stream at chunk 3" in text and "JSONDecodeError" in text
    assert '{"id": "c1", "choices": [{"delta": {"cont' in text  # the offending data, quoted
    assert not error.non_retryable and error.status == 200
    assert error.usage == Usage(uncached_input=estimate_prompt_tokens(request("malformed")), output=2)
    assert error.usage_estimated


async def test_a_chunk_of_the_wrong_shape_is_a_failed_call(model: Model) -> None:
    error = await failure(model, "wrong_shape")
    assert "at chunk 2" in str(error) and error.usage.output == 1
    assert "ChunkShapeError: choices[0].delta is a number 7, expected an object" in str(error)


@pytest.mark.parametrize(
    ("name", "at", "named"),
    [
        ("choices_object", 2, 'choices is an object {"delta": {"content": "lo"}}, expected an array'),
        ("text_number", 2, "choices[0].delta.content is a number 42, expected a string"),
        ("tool_index_text", 2, 'choices[0].delta.tool_calls[0].index is a string "0", expected an integer'),
        ("tool_name_object", 2, 'tool_calls[0].function.name is an object {"x": 1}, expected a string'),
        ("usage_text", 3, 'usage.prompt_tokens is a string "11", expected a non-negative integer'),
        ("chunk_array", 2, 'the chunk is an array [{"choices": []}], expected an object'),
        ("text_true", 2, "choices[0].delta.content is true, expected a string"),
        ("tool_index_null", 2, "choices[0].delta.tool_calls[0].index is null, expected an integer"),
    ],
)
async def test_every_field_the_adapter_reads_is_checked_and_a_wrong_one_is_named(
    model: Model, name: str, at: int, named: str
) -> None:
    """The adapter reads the chunks as JSON, not as the SDK's objects: whatever field it reads has the type
    it expects or the call fails naming the field, the value and the type wanted, billing what came first."""
    error = await failure(model, name)
    assert f"HTTP 200 stream at chunk {at}" in str(error) and named in str(error)
    assert not error.non_retryable and error.usage_estimated
    assert error.usage == Usage(uncached_input=estimate_prompt_tokens(request(name)), output=1)


async def test_a_reset_mid_stream_is_a_failed_call_billing_the_chunks_before_it(model: Model) -> None:
    error = await failure(model, "reset")
    assert "HTTP 200 stream" in str(error) and not error.non_retryable
    assert error.usage == Usage(uncached_input=estimate_prompt_tokens(request("reset")), output=3)


async def test_a_reset_after_the_usage_report_bills_the_report_exactly(model: Model) -> None:
    error = await failure(model, "reset_after_usage")
    assert error.usage == Usage(uncached_input=11, output=3) and not error.usage_estimated


async def test_a_stream_that_ends_without_a_finish_reason_is_a_failed_call(model: Model) -> None:
    error = await failure(model, "eof_early")
    assert "without a finish reason after 2 chunks" in str(error) and error.usage.output == 2


async def test_an_error_event_mid_stream_is_a_failed_call(model: Model) -> None:
    error = await failure(model, "error_event")
    assert "upstream exploded" in str(error) and error.usage.output == 1


# --------------------------------------------------------------------------- status answers


async def test_litellms_429_is_rate_limited_with_its_retry_hint(model: Model) -> None:
    with pytest.raises(ProviderRateLimited) as info:
        await model.complete(request("litellm_429"), CancelToken())
    limit = info.value.rate_limit
    assert info.value.retry_after == 60.0
    assert limit is not None and (limit.retry_after_s, limit.hint_source) == (
        60.0,
        "llm_provider-retry-after",
    )


async def test_a_retry_after_http_date_is_read_as_seconds_from_now(model: Model) -> None:
    with pytest.raises(ProviderRateLimited) as info:
        await model.complete(request("date_429"), CancelToken())
    assert info.value.retry_after is not None and 25 < info.value.retry_after <= 31


async def test_a_gateways_html_502_is_a_retryable_failure_naming_the_status(model: Model) -> None:
    error = await failure(model, "html_502")
    assert "HTTP 502" in str(error) and error.status == 502 and not error.non_retryable
    assert error.usage == Usage()  # no reply began: nothing is known to be billed


async def test_a_plain_4xx_is_not_retryable(model: Model) -> None:
    error = await failure(model, "bad_request")
    assert error.status == 400 and error.non_retryable and "bad max_tokens" in str(error)


async def test_the_observer_sees_every_call_with_its_status_and_outcome(
    local_model: OpenAIModel, recorder: Recorder
) -> None:
    for name in ("ok", "no_usage", "reset", "litellm_429", "html_502"):
        with contextlib.suppress(DependencyError):
            await local_model.complete(request(name), CancelToken())
    assert [(c.status, c.outcome, c.hint_source, c.usage_estimated) for c in recorder.calls] == [
        (200, "reply", None, False),
        (200, "reply", None, True),
        (200, "failed", None, True),
        (429, "rate_limited", "llm_provider-retry-after", False),
        (502, "failed", None, False),
    ]
    assert {c.provider for c in recorder.calls} == {"misbehaving"}


# --------------------------------------------------------------------------- control: the bare SDK


@pytest.mark.parametrize(
    ("name", "raw"),
    [("malformed", "JSONDecodeError"), ("wrong_shape", "AttributeError")],
)
async def test_control_the_bare_sdk_lets_these_escape_as_foreign_exceptions(
    base_url: str, name: str, raw: str
) -> None:
    """What the adapter's conversion is for: the same server through the SDK alone raises exceptions that
    are no ``runtime.errors`` type (the trajectory would be stranded in CALLING_MODEL)."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="k", max_retries=0)
    with pytest.raises(Exception) as info:  # the type is judged by name below
        stream = await client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "hi"}], stream=True
        )
        async for part in stream:
            for choice in part.choices:
                _ = choice.delta.content
    await client.close()
    assert type(info.value).__name__ == raw
    assert not isinstance(info.value, DependencyError | openai.APIError)


async def test_the_redis_tally_sums_what_every_trajectorys_adapter_saw(base_url: str, redis_url: str) -> None:
    # Given two trajectories' adapters publishing to the tally in Redis
    tally = RedisProviderTally.from_url(redis_url)
    adapter = OpenAIModel(base_url=base_url, scope="gateway", observer=tally)
    # When they make calls that end every way
    for trajectory, name in [("a", "ok"), ("a", "litellm_429"), ("b", "no_usage"), ("b", "html_502")]:
        with contextlib.suppress(DependencyError):
            await adapter.complete(replace(request(name), trajectory_id=trajectory), CancelToken())
    await adapter.aclose()
    await tally.aclose()
    # Then the report's reader sums them per provider, from Redis
    client = aioredis.Redis.from_url(redis_url)
    seen = await read_provider_tallies(client, ["a", "b", "never-ran"])
    await client.aclose()
    assert seen == {
        "gateway": {
            "requests": 4,
            "responses": {"200": 2, "429": 1, "502": 1},
            "outcomes": {"reply": 2, "rate_limited": 1, "failed": 1},
            "retry_hints": {"llm_provider-retry-after": 1},
            "usage_estimated": 1,
        }
    }


async def test_the_node_clients_tally_sums_what_it_saw_per_trajectory(
    base_url: str, redis_url: str, ray_local: None
) -> None:
    # Given two trajectories' calls carried out by the node's model client, counted in Redis
    target = ModelTarget(base_url, scope="gateway", tally_redis_url=redis_url)
    model = RayModelClient(target, actor=node_client())
    # When they make calls that end every way
    for trajectory, name in [("a", "ok"), ("a", "litellm_429"), ("b", "no_usage"), ("b", "html_502")]:
        with contextlib.suppress(DependencyError):
            await model.complete(replace(request(name), trajectory_id=trajectory), CancelToken())
    # Then the report's reader sums them per provider, as for the in-process adapter
    client = aioredis.Redis.from_url(redis_url)
    expected = {
        "gateway": {
            "requests": 4,
            "responses": {"200": 2, "429": 1, "502": 1},
            "outcomes": {"reply": 2, "rate_limited": 1, "failed": 1},
            "retry_hints": {"llm_provider-retry-after": 1},
            "usage_estimated": 1,
        }
    }
    seen: Any = None
    for _ in range(500):  # the tally is flushed off the call's path: bounded poll
        seen = await read_provider_tallies(client, ["a", "b"])
        if seen == expected:
            break
        await asyncio.sleep(0.01)
    await client.aclose()
    assert seen == expected
