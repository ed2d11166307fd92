"""Protocol compliance of the simulated provider, judged by the official ``openai`` SDK as the client."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import openai
import pytest

from runtime.clock import FakeClock
from testbed.provider import (
    SCENARIO_HEADER,
    TRAJECTORY_HEADER,
    ConfigPatch,
    Fault,
    LimiterMode,
    ProviderConfig,
    ProviderServer,
    ProviderThread,
    start_provider_subprocess,
    start_provider_thread,
)

pytestmark = pytest.mark.integration

EDIT = {
    "type": "function",
    "function": {
        "name": "edit",
        "description": "edit a file",
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string"}, "line": {"type": "integer"}},
            "required": ["path", "line"],
        },
    },
}
TASK = [
    {"role": "system", "content": "You edit files."},
    {"role": "user", "content": "Fix the bug in app.py"},
]


def headers(scenario: str, trajectory: str = "traj-1") -> dict[str, str]:
    return {SCENARIO_HEADER: scenario, TRAJECTORY_HEADER: trajectory}


@pytest.fixture
def provider() -> Iterator[ProviderThread]:
    with start_provider_thread(ProviderConfig(rpm=1000, tpm=1_000_000)) as handle:
        yield handle


@pytest.fixture
def client(provider: ProviderThread) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=provider.base_url, api_key="sk-test", max_retries=0) as c:
        yield c


async def wait_for(predicate: Any, what: str, attempts: int = 500) -> None:
    """Poll a condition (not a timing assertion: only bounds how long we wait for it)."""
    for _ in range(attempts):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never became true: {what}")


# --------------------------------------------------------------------------- sync SDK


def test_sync_non_streaming_tool_call_then_final_answer_with_cached_prefix(
    client: openai.OpenAI, provider: ProviderThread
) -> None:
    # Given a trajectory scripted to finish after one tool call
    first = client.chat.completions.create(
        model="tether-sim", messages=TASK, tools=[EDIT], extra_headers=headers("finish_after:1")
    )
    # Then the first reply is a tool call with JSON arguments that follow the schema
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.function.name == "edit"
    assert json.loads(call.function.arguments) == {"path": "path-step1", "line": 1, "step": 1}
    assert first.usage is not None and first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # When the tool result is sent back in the same trajectory
    follow_up = [
        *TASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "edited"},
    ]
    second = client.chat.completions.create(
        model="tether-sim", messages=follow_up, tools=[EDIT], extra_headers=headers("finish_after:1")
    )
    # Then the model finishes, and the earlier prompt is reported as cached
    assert second.choices[0].finish_reason == "stop"
    assert second.choices[0].message.content == "Done after 1 tool calls."
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens
    assert cached == first.usage.prompt_tokens - 3  # everything but the reply priming
    # And the provider's own counters agree with what the client saw
    stats = provider.stats()
    assert stats["accepted"] == 2 and stats["requests"] == 2
    assert stats["tokens"] == {
        "prompt": first.usage.prompt_tokens + second.usage.prompt_tokens,
        "cached": cached,
        "completion": first.usage.completion_tokens + second.usage.completion_tokens,
    }
    assert stats["trajectories"]["traj-1"]["accepted"] == 2


def test_sync_streaming_one_token_per_chunk_and_final_usage_chunk(client: openai.OpenAI) -> None:
    # Given a long text answer streamed with usage included
    stream = client.chat.completions.create(
        model="tether-sim",
        messages=TASK,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers=headers("slow:25"),
    )
    chunks = list(stream)
    # Then every content chunk is one token, a finish chunk says stop, and the last chunk carries usage only
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(content) == 25
    assert finishes == ["stop"]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 25
    assert all(c.usage is None for c in chunks[:-1])


def test_streaming_without_include_usage_sends_no_usage_chunk(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(model="m", messages=TASK, stream=True, extra_headers=headers("slow:3"))
    )
    assert all(c.choices for c in chunks)


def test_max_tokens_truncates_with_finish_reason_length(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="m", messages=TASK, max_tokens=4, extra_headers=headers("slow:50")
    )
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 4


@pytest.mark.parametrize(
    ("scenario", "finish_reason"),
    [
        ("refuse", "content_filter"),
        ("truncate", "length"),
        ("malformed_json", "tool_calls"),
        ("oscillate", "tool_calls"),
    ],
)
def test_scenarios_reach_the_client_with_their_finish_reason(
    client: openai.OpenAI, scenario: str, finish_reason: str
) -> None:
    reply = client.chat.completions.create(
        model="m", messages=TASK, tools=[EDIT], extra_headers=headers(scenario)
    )
    assert reply.choices[0].finish_reason == finish_reason


def test_malformed_json_arrives_as_unparseable_text(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="m", messages=TASK, tools=[EDIT], extra_headers=headers("malformed_json")
    )
    (call,) = reply.choices[0].message.tool_calls or []
    with pytest.raises(json.JSONDecodeError):
        json.loads(call.function.arguments)


def test_unknown_scenario_is_a_400_naming_it(client: openai.OpenAI, provider: ProviderThread) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=TASK, extra_headers=headers("dance"))
    assert "unknown scenario 'dance'" in info.value.message
    assert provider.stats()["rejected"] == 1


def test_bad_request_body_is_a_400_naming_the_field(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=[{"role": "wizard", "content": "x"}])
    assert "messages" in info.value.message and "wizard" in info.value.message


def test_models_are_listed(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == ["tether-sim"]


def test_rate_limit_429_carries_retry_after_and_ratelimit_headers(
    client: openai.OpenAI, provider: ProviderThread
) -> None:
    # Given a limit of 2 requests per minute, counted over the minute only (this test pins the minute)
    provider.configure(rpm=2, sub_window_s=0)
    ok = client.chat.completions.with_raw_response.create(
        model="m", messages=TASK, extra_headers=headers("slow:1")
    )
    assert ok.headers["x-ratelimit-limit-requests"] == "2"
    assert ok.headers["x-ratelimit-remaining-requests"] == "1"
    client.chat.completions.create(model="m", messages=TASK, extra_headers=headers("slow:1"))
    # When a third request arrives within the minute
    with pytest.raises(openai.RateLimitError) as info:
        client.chat.completions.create(model="m", messages=TASK, extra_headers=headers("slow:1"))
    # Then it is refused with 429, Retry-After, and the limit headers
    h = info.value.response.headers
    assert info.value.status_code == 429
    assert 1 <= int(h["retry-after"]) <= 60
    assert 0 < int(h["retry-after-ms"]) <= 60_000
    assert h["x-ratelimit-remaining-requests"] == "0"
    assert h["x-ratelimit-reset-requests"].endswith("s")
    assert "x-ratelimit-remaining-tokens" in h
    stats = provider.stats()
    assert (stats["accepted"], stats["rate_limited"]) == (2, 1)
    assert stats["trajectories"]["traj-1"]["rate_limited"] == 1
    assert sum(row["rate_limited"] for row in stats["timeline"]) == 1


def test_tpm_reservation_and_too_large_requests(client: openai.OpenAI, provider: ProviderThread) -> None:
    # Given tpm=500 over the minute only: a request reserving prompt + 2000 max_tokens can never fit
    provider.configure(tpm=500, sub_window_s=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="m", messages=TASK, max_tokens=2000, extra_headers=headers("slow:1")
        )
    assert "request too large" in info.value.message
    # And a request reserving 400 output tokens is admitted, then refunded to what it used
    reply = client.chat.completions.with_raw_response.create(
        model="m", messages=TASK, max_tokens=400, extra_headers=headers("slow:1")
    )
    prompt = reply.parse().usage.prompt_tokens  # type: ignore[union-attr]
    assert int(reply.headers["x-ratelimit-remaining-tokens"]) == 500 - prompt - 400
    after = client.chat.completions.with_raw_response.create(
        model="m", messages=TASK, max_tokens=10, extra_headers=headers("slow:1")
    )
    assert int(after.headers["x-ratelimit-remaining-tokens"]) == 500 - (prompt + 1) - (prompt + 10)


def test_forced_fault_then_recovery(client: openai.OpenAI, provider: ProviderThread) -> None:
    provider.configure(fault={"status": 503, "count": 1})
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(model="m", messages=TASK, extra_headers=headers("slow:1"))
    client.chat.completions.create(model="m", messages=TASK, extra_headers=headers("slow:1"))
    stats = provider.stats()
    assert (stats["failed"], stats["accepted"]) == (1, 1)


def test_reset_clears_counters(client: openai.OpenAI, provider: ProviderThread) -> None:
    client.chat.completions.create(model="m", messages=TASK, extra_headers=headers("slow:1"))
    provider.reset()
    stats = provider.stats()
    assert (stats["requests"], stats["trajectories"], stats["timeline"]) == (0, {}, [])


# --------------------------------------------------------------------------- async SDK, in-process server


@pytest.fixture
async def server() -> AsyncIterator[ProviderServer]:
    async with ProviderServer(ProviderConfig()) as s:
        yield s


async def test_async_streaming_parallel_tool_calls_assemble_by_index(server: ProviderServer) -> None:
    async with openai.AsyncOpenAI(base_url=server.base_url, api_key="k", max_retries=0) as client:
        stream = await client.chat.completions.create(
            model="m",
            messages=TASK,
            tools=[EDIT],
            stream=True,
            stream_options={"include_usage": True},
            extra_headers=headers("parallel:2"),
        )
        calls: dict[int, dict[str, str]] = {}
        finish = None
        async for chunk in stream:
            for choice in chunk.choices:
                for tc in choice.delta.tool_calls or ():
                    slot = calls.setdefault(tc.index, {"id": "", "name": "", "args": ""})
                    slot["id"] += tc.id or ""
                    slot["name"] += (tc.function.name or "") if tc.function else ""
                    slot["args"] += (tc.function.arguments or "") if tc.function else ""
                finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert sorted(calls) == [0, 1]
    assert calls[0]["id"] != calls[1]["id"]
    assert [json.loads(calls[i]["args"])["step"] for i in (0, 1)] == [1, 2]


async def test_async_client_abort_mid_stream_is_billed_for_what_was_sent(server: ProviderServer) -> None:
    # Given a slow stream of 200 tokens
    server.configure(ConfigPatch(tokens_per_s=100))
    async with openai.AsyncOpenAI(base_url=server.base_url, api_key="k", max_retries=0) as client:
        stream = await client.chat.completions.create(
            model="m", messages=TASK, stream=True, extra_headers=headers("slow:200", "aborter")
        )
        seen = 0
        # When the client closes the stream after 5 tokens
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                seen += 1
            if seen == 5:
                await stream.close()
                break
    await wait_for(lambda: server.stats()["in_flight"] == 0, "the provider noticed the abort")
    # Then the provider records an abort billed at least what the client saw, far short of the whole reply
    stats = server.stats()
    billed = stats["trajectories"]["aborter"]["completion_tokens"]
    assert stats["aborted"] == 1
    assert 5 <= billed < 200


async def test_window_slides_on_the_injected_clock() -> None:
    # Given a provider on a fake clock with 1 request per minute
    clock = FakeClock()
    async with (
        ProviderServer(ProviderConfig(rpm=1), clock=clock) as server,
        openai.AsyncOpenAI(base_url=server.base_url, api_key="k", max_retries=0) as client,
    ):
        await client.chat.completions.create(model="m", messages=TASK, extra_headers=headers("slow:1"))
        with pytest.raises(openai.RateLimitError) as info:
            await client.chat.completions.create(model="m", messages=TASK, extra_headers=headers("slow:1"))
        assert info.value.response.headers["retry-after"] == "60"
        # When a minute passes on the provider's clock
        clock.advance(60)
        # Then the next request is admitted
        reply = await client.chat.completions.create(
            model="m", messages=TASK, extra_headers=headers("slow:1")
        )
        assert reply.choices[0].finish_reason == "stop"


def _seconds(value: str) -> float:
    return float(value.removesuffix("s"))


@pytest.mark.parametrize(
    ("mode", "sub_window_s", "refusals_allowed"),
    [
        (LimiterMode.TOKEN_BUCKET, None, False),
        (LimiterMode.SLIDING_WINDOW, 0.0, False),
        # the default per-second share does not show in the headers (as at OpenAI): a burst may be refused
        # once, and its Retry-After then admits the retry
        (LimiterMode.SLIDING_WINDOW, None, True),
    ],
)
async def test_a_client_honouring_the_headers_is_never_refused(
    mode: LimiterMode, sub_window_s: float | None, refusals_allowed: bool
) -> None:
    # Given a provider on a fake clock (refusals counted) and a client that sends only what the last
    # reply's x-ratelimit-remaining-* allow, else waits the x-ratelimit-reset-* named, and after a 429
    # waits its retry-after-ms
    clock = FakeClock()
    config = ProviderConfig(rpm=30, tpm=3_000, limiter=mode, sub_window_s=sub_window_s)
    async with (
        ProviderServer(config, clock=clock) as server,
        openai.AsyncOpenAI(base_url=server.base_url, api_key="k", max_retries=0) as client,
    ):
        charge = None
        remaining: tuple[int, int] | None = None
        resets = (0.0, 0.0)
        waits = refusals = 0
        for i in range(60):
            clock.advance(0.05 * (i % 4))  # a little time passes between sends, sometimes none
            if remaining is not None and charge is not None and (remaining[0] < 1 or remaining[1] < charge):
                clock.advance(max(resets))
                waits += 1
            # When it sends (a second refusal in a row raises RateLimitError and fails the test)
            try:
                raw = await client.chat.completions.with_raw_response.create(
                    model="m", messages=TASK, max_tokens=150, extra_headers=headers("slow:20")
                )
            except openai.RateLimitError as refused:
                refusals += 1
                clock.advance(int(refused.response.headers["retry-after-ms"]) / 1000)
                raw = await client.chat.completions.with_raw_response.create(
                    model="m", messages=TASK, max_tokens=150, extra_headers=headers("slow:20")
                )
            h = raw.headers
            remaining = (int(h["x-ratelimit-remaining-requests"]), int(h["x-ratelimit-remaining-tokens"]))
            resets = (_seconds(h["x-ratelimit-reset-requests"]), _seconds(h["x-ratelimit-reset-tokens"]))
            charge = raw.parse().usage.prompt_tokens + 150  # type: ignore[union-attr]
        # Then every request was admitted (at once, or on its one retry where the per-second share applies),
        # and the limits did bind (it had to wait)
        stats = server.stats()
        assert stats["accepted"] == 60
        assert stats["rate_limited"] == refusals
        assert refusals == 0 or refusals_allowed
        assert waits >= 1


@pytest.mark.parametrize("mode", [LimiterMode.SLIDING_WINDOW, LimiterMode.TOKEN_BUCKET])
async def test_retry_after_admits_the_retry_even_though_the_refusal_counted(mode: LimiterMode) -> None:
    # Given a saturated key whose refusals cost a request
    clock = FakeClock()
    async with (
        ProviderServer(ProviderConfig(rpm=2, limiter=mode), clock=clock) as server,
        openai.AsyncOpenAI(base_url=server.base_url, api_key="k", max_retries=0) as client,
    ):
        for _ in range(3):
            with contextlib.suppress(openai.RateLimitError):
                await client.chat.completions.create(
                    model="m", messages=TASK, extra_headers=headers("slow:1")
                )
        with pytest.raises(openai.RateLimitError) as info:
            await client.chat.completions.create(model="m", messages=TASK, extra_headers=headers("slow:1"))
        # When the client waits exactly retry-after-ms
        clock.advance(int(info.value.response.headers["retry-after-ms"]) / 1000)
        # Then its retry is admitted
        await client.chat.completions.create(model="m", messages=TASK, extra_headers=headers("slow:1"))


@pytest.mark.parametrize("count_rejected", [True, False])
async def test_refusals_count_against_the_minute(count_rejected: bool) -> None:
    # Given 3 requests per minute (minute only) spent at t=0 and one refusal at t=30
    clock = FakeClock()
    config = ProviderConfig(rpm=3, sub_window_s=0, count_rejected=count_rejected)
    async with (
        ProviderServer(config, clock=clock) as server,
        openai.AsyncOpenAI(base_url=server.base_url, api_key="k", max_retries=0) as client,
    ):

        async def send() -> bool:
            try:
                await client.chat.completions.create(
                    model="m", messages=TASK, extra_headers=headers("slow:1")
                )
            except openai.RateLimitError:
                return False
            return True

        assert [await send() for _ in range(3)] == [True, True, True]
        clock.advance(30)
        assert not await send()
        # When the first three leave the window
        clock.advance(30.001)
        # Then the refusal still holds one of the three places (and none when refusals are free: control run)
        admitted = [await send() for _ in range(3)]
    assert admitted == ([True, True, False] if count_rejected else [True, True, True])


async def test_forced_429_fault_is_a_rate_limit_with_its_retry_after(server: ProviderServer) -> None:
    server.configure(ConfigPatch(fault=Fault(status=429, count=1, retry_after_s=2.5)))
    async with openai.AsyncOpenAI(base_url=server.base_url, api_key="k", max_retries=0) as client:
        with pytest.raises(openai.RateLimitError) as info:
            await client.chat.completions.create(model="m", messages=TASK)
    assert info.value.response.headers["retry-after-ms"] == "2500"
    assert server.stats()["rate_limited"] == 1


async def test_api_key_is_enforced_when_configured() -> None:
    async with ProviderServer(ProviderConfig(api_key="secret")) as server:
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key="wrong", max_retries=0) as client:
            with pytest.raises(openai.AuthenticationError):
                await client.chat.completions.create(model="m", messages=TASK)
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key="secret", max_retries=0) as client:
            await client.chat.completions.create(model="m", messages=TASK)


# --------------------------------------------------------------------------- standalone CLI


def test_cli_subprocess_serves_the_protocol_and_stops() -> None:
    # Given the provider started as `python -m testbed.provider` on a free port
    config = ProviderConfig(
        rpm=100, tpm=50_000, ttft_ms=1.0, tokens_per_s=1000.0, limiter=LimiterMode.TOKEN_BUCKET
    )
    with start_provider_subprocess(config) as process:
        with openai.OpenAI(base_url=process.base_url, api_key="k", max_retries=0) as client:
            # When a client calls it
            reply = client.chat.completions.create(model="m", messages=TASK, extra_headers=headers("slow:3"))
        # Then it answers and counts from its own side
        assert reply.choices[0].finish_reason == "stop"
        assert process.stats()["accepted"] == 1
        assert process.configure(rpm=7)["rpm"] == 7
        assert process.configure()["limiter"] == "token_bucket"  # the mode reached the child's command line
    # And it is gone once stopped
    assert process.process.returncode is not None
