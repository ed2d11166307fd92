"""``ModelPort`` over the official ``openai`` async client, for any OpenAI-compatible base URL.

- The SDK's own retries are off (``max_retries=0``): Tether's retry owner is the only one.
- Every call streams with ``stream_options={"include_usage": True}`` and honours ``max_tokens`` and the
  absolute deadline (the SDK timeout and a timer on the injected clock are both ``deadline - now``).
- Cancellation (harness chapter, streaming cancellation): when the ``CancelToken`` fires the stream is
  closed mid-way, the partial reply is discarded (never parsed into a call) and
  ``ModelCallCancelled(reason, usage)`` is raised. An aborted stream carries no usage report, so the
  usage billed is *output = content-bearing chunks received* (one chunk is one token on the testbed;
  an approximation on real providers) and *uncached input = the prompt estimate* of
  ``prompt_estimator`` (default: JSON characters / 4). This is the only place usage is estimated.
- Tool-call deltas are assembled into ``ToolCallProposal(call_id, tool, raw_arguments)``; arguments
  are passed through as text, never parsed or repaired.
- Errors map onto ``runtime.errors``: 429 → :class:`ModelRateLimited` (a ``ProviderRateLimited``
  with ``retry_after`` from ``retry-after-ms``/``Retry-After`` and the ``x-ratelimit-remaining-*``
  values); timeouts, connection failures, 408/409/5xx and a broken stream → :class:`ModelCallFailed`
  (a retryable ``DependencyError``); other 4xx → ``ModelCallFailed(non_retryable=True)``. Both
  carry ``usage``: what was billed before the failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import openai

from runtime.clock import Clock, SystemClock
from runtime.errors import DependencyError, ModelCallCancelled, ProviderRateLimited
from runtime.ports import (
    CancelToken,
    ModelReply,
    ModelRequest,
    RateLimitInfo,
    StopReason,
    ToolCallProposal,
    Usage,
)

__all__ = [
    "SCENARIO_HEADER",
    "TRAJECTORY_HEADER",
    "ModelCallFailed",
    "ModelRateLimited",
    "OpenAIModel",
    "estimate_prompt_tokens",
]

SCENARIO_HEADER = "X-Tether-Scenario"
TRAJECTORY_HEADER = "X-Tether-Trajectory"
_REMAINING_PREFIX = "x-ratelimit-remaining-"

_STOP_REASONS: Mapping[str, StopReason] = {
    "stop": StopReason.END_TURN,
    "length": StopReason.MAX_TOKENS,
    "tool_calls": StopReason.TOOL_USE,
    "function_call": StopReason.TOOL_USE,  # the legacy name of tool_calls
    "content_filter": StopReason.REFUSAL,
}


class ModelRateLimited(ProviderRateLimited):
    """HTTP 429 from the provider, with what it said about its limits (``x-ratelimit-remaining-*``)."""

    def __init__(
        self, message: str, *, scope: str | None, retry_after: float | None, remaining: Mapping[str, float]
    ) -> None:
        super().__init__(message, scope=scope, retry_after=retry_after)
        self.remaining = dict(remaining)


class ModelCallFailed(DependencyError):
    """The model call failed outside the harness's control; ``usage`` is what was billed before it."""

    def __init__(
        self,
        message: str,
        *,
        scope: str | None,
        usage: Usage,
        non_retryable: bool = False,
        status: int | None = None,
    ) -> None:
        super().__init__(message, scope=scope, non_retryable=non_retryable)
        self.usage = usage
        self.status = status


def estimate_prompt_tokens(request: ModelRequest) -> int:
    """A rough prompt size (JSON characters / 4), used only when the provider reports no usage."""
    text = json.dumps(list(request.messages), default=str) + json.dumps(list(request.tools), default=str)
    return math.ceil(len(text) / 4)


@dataclass(slots=True)
class _CallSlot:
    call_id: str = ""
    name: str = ""
    arguments: list[str] = field(default_factory=list)


@dataclass(slots=True)
class _Stream:
    """What has arrived so far on one streamed call."""

    text: list[str] = field(default_factory=list)
    calls: dict[int, _CallSlot] = field(default_factory=dict)
    chunks: int = 0  # content-bearing chunks: the output tokens billed if the stream is cut
    finish_reason: str | None = None
    usage: Any = None  # the SDK's CompletionUsage from the final chunk
    remaining: dict[str, float] = field(default_factory=dict)


class OpenAIModel:
    """Calls an OpenAI-compatible chat-completions endpoint as a :class:`runtime.ports.ModelPort`.

    ``client`` may be injected (it must have ``max_retries=0``); otherwise one is built from
    ``base_url``/``api_key``. ``on_chunk`` is a hook called with the running count of
    content-bearing chunks (no-op by default; tests and progress meters use it). ``scope`` names the
    provider in raised errors (default: ``base_url``).
    """

    def __init__(
        self,
        *,
        base_url: str,
        api_key: str = "tether-unused",
        clock: Clock | None = None,
        client: openai.AsyncOpenAI | None = None,
        prompt_estimator: Callable[[ModelRequest], int] = estimate_prompt_tokens,
        on_chunk: Callable[[int], None] | None = None,
        scope: str | None = None,
        max_tokens_field: Literal["max_tokens", "max_completion_tokens"] = "max_tokens",
    ) -> None:
        if client is not None and client.max_retries != 0:
            raise ValueError("the injected openai client must have max_retries=0 (Tether owns retries)")
        self._client = client or openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        self._clock: Clock = clock or SystemClock()
        self._estimate = prompt_estimator
        self._on_chunk = on_chunk or (lambda _n: None)
        self.scope = scope or base_url
        self._max_tokens_field = max_tokens_field

    async def aclose(self) -> None:
        """Close the underlying HTTP client."""
        await self._client.close()

    async def complete(self, request: ModelRequest, cancel: CancelToken) -> ModelReply:
        """Stream one completion; see the module docstring for cancellation, deadline and errors."""
        if cancel.cancelled:
            raise ModelCallCancelled(cancel.reason or "cancelled", Usage())
        remaining = request.deadline - self._clock.wall()
        if remaining <= 0:
            raise ModelCallFailed(
                f"deadline passed {-remaining:.3f}s before the model call started",
                scope=self.scope,
                usage=Usage(),
            )
        state = _Stream()
        call = asyncio.create_task(self._stream(request, remaining, state))
        cancelled = asyncio.create_task(cancel.wait())
        expired = asyncio.create_task(self._clock.sleep(remaining))
        try:
            await asyncio.wait({call, cancelled, expired}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            finished_first = call.done()
            for task in (call, cancelled, expired):
                task.cancel()  # on the call: leaves the response context, closing the HTTP stream
            await asyncio.wait({call, cancelled, expired})
            if not finished_first and not call.cancelled():
                call.exception()  # an outcome that raced our abort: consumed, superseded by it
        if finished_first:
            return call.result()  # a reply that finished wins over a cancel or deadline that raced it
        if cancel.cancelled:
            raise ModelCallCancelled(cancel.reason or "cancelled", self._partial_usage(request, state))
        raise ModelCallFailed(
            f"model call exceeded its deadline after {remaining:.3f}s ({state.chunks} chunks received)",
            scope=self.scope,
            usage=self._partial_usage(request, state),
        )

    # ------------------------------------------------------------------ internals

    def _partial_usage(self, request: ModelRequest, state: _Stream) -> Usage:
        # An aborted stream has no usage chunk: charge the prompt estimate and the chunks received.
        return Usage(uncached_input=self._estimate(request), output=state.chunks)

    async def _stream(self, request: ModelRequest, timeout: float, state: _Stream) -> ModelReply:
        headers = {TRAJECTORY_HEADER: request.trajectory_id}
        if scenario := request.metadata.get("scenario"):
            headers[SCENARIO_HEADER] = scenario
        kwargs: dict[str, Any] = {
            "model": request.model,
            "messages": list(request.messages),
            self._max_tokens_field: request.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "timeout": timeout,
            "extra_headers": headers,
        }
        if request.tools:
            kwargs["tools"] = list(request.tools)
        try:
            async with self._client.chat.completions.with_streaming_response.create(**kwargs) as response:
                state.remaining = _remaining(response.headers)
                stream = await response.parse()
                async for chunk in stream:
                    self._absorb(chunk, state)
        except openai.RateLimitError as e:
            raise self._rate_limited(e) from e
        except openai.APIStatusError as e:
            retryable = e.status_code >= 500 or e.status_code in (408, 409)
            raise ModelCallFailed(
                f"provider answered {e.status_code}: {e.message}",
                scope=self.scope,
                usage=self._partial_usage(request, state) if state.chunks else Usage(),
                non_retryable=not retryable,
                status=e.status_code,
            ) from e
        except openai.APIError as e:  # connection, timeout, an error event mid-stream
            raise ModelCallFailed(
                f"model call failed: {type(e).__name__}: {e.message}",
                scope=self.scope,
                usage=self._partial_usage(request, state) if state.chunks else Usage(),
            ) from e
        return self._reply(request, state)

    def _absorb(self, chunk: Any, state: _Stream) -> None:
        if chunk.usage is not None:
            state.usage = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta
            carried = False
            for text in (delta.content, getattr(delta, "refusal", None)):
                if text:
                    state.text.append(text)
                    carried = True
            for tool_call in delta.tool_calls or ():
                slot = state.calls.setdefault(tool_call.index, _CallSlot())
                if tool_call.id:
                    slot.call_id = tool_call.id
                if tool_call.function is not None:
                    slot.name += tool_call.function.name or ""
                    if tool_call.function.arguments:
                        slot.arguments.append(tool_call.function.arguments)
                carried = True
            if carried:
                state.chunks += 1
                self._on_chunk(state.chunks)
            if choice.finish_reason:
                state.finish_reason = choice.finish_reason

    def _reply(self, request: ModelRequest, state: _Stream) -> ModelReply:
        if state.finish_reason is None:
            raise ModelCallFailed(
                f"stream ended without a finish reason after {state.chunks} chunks",
                scope=self.scope,
                usage=self._partial_usage(request, state),
            )
        stop = _STOP_REASONS.get(state.finish_reason)
        if stop is None:
            raise ModelCallFailed(
                f"unknown finish_reason {state.finish_reason!r} (expected one of {sorted(_STOP_REASONS)})",
                scope=self.scope,
                usage=self._partial_usage(request, state),
                non_retryable=True,
            )
        calls = [
            ToolCallProposal(
                call_id=slot.call_id or f"call_{index}", tool=slot.name, raw_arguments="".join(slot.arguments)
            )
            for index, slot in sorted(state.calls.items())
        ]
        return ModelReply(
            stop_reason=stop,
            text="".join(state.text),
            tool_calls=calls,
            usage=self._usage(request, state),
            rate_limit=_limit_info(state.remaining),
        )

    def _usage(self, request: ModelRequest, state: _Stream) -> Usage:
        reported = state.usage
        if reported is None:  # a provider that ignores include_usage: the documented fallback
            return self._partial_usage(request, state)
        details = getattr(reported, "prompt_tokens_details", None)
        cached = int(getattr(details, "cached_tokens", 0) or 0)
        prompt = int(reported.prompt_tokens)
        return Usage(
            uncached_input=max(0, prompt - cached),
            cached_input=cached,
            output=int(reported.completion_tokens),
        )

    def _rate_limited(self, error: openai.RateLimitError) -> ModelRateLimited:
        headers = error.response.headers
        return ModelRateLimited(
            f"provider rate limited the call: {error.message}",
            scope=self.scope,
            retry_after=_retry_after(headers, self._clock.wall()),
            remaining=_remaining(headers),
        )


def _limit_info(remaining: Mapping[str, float]) -> RateLimitInfo | None:
    if not remaining:
        return None
    return RateLimitInfo(
        remaining_requests=remaining.get("requests"), remaining_tokens=remaining.get("tokens")
    )


def _remaining(headers: Mapping[str, str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, value in headers.items():
        key = name.lower()
        if key.startswith(_REMAINING_PREFIX):
            with contextlib.suppress(ValueError):
                out[key[len(_REMAINING_PREFIX) :]] = float(value)
    return out


def _retry_after(headers: Mapping[str, str], now_wall: float) -> float | None:
    """Seconds to wait: ``retry-after-ms`` first (precise), then ``Retry-After`` (seconds or HTTP date)."""
    millis = headers.get("retry-after-ms")
    if millis is not None:
        with contextlib.suppress(ValueError):
            return max(0.0, float(millis) / 1000.0)
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    with contextlib.suppress(TypeError, ValueError):
        when = email.utils.parsedate_to_datetime(value)
        return max(0.0, when.timestamp() - now_wall)
    return None
