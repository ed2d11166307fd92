"""``ModelPort`` over the official ``openai`` async client, for any OpenAI-compatible base URL.

- The SDK's own retries are off (``max_retries=0``): Tether's retry owner is the only one.
- Every call streams with ``stream_options={"include_usage": True}`` and honours ``max_tokens`` and the
  absolute deadline (the SDK timeout and a timer on the injected clock are both ``deadline - now``).
- Cancellation (harness chapter, streaming cancellation): when the ``CancelToken`` fires the stream is
  closed mid-way, the partial reply is discarded (never parsed into a call) and
  ``ModelCallCancelled(reason, usage)`` is raised.
- Tool-call deltas are assembled into ``ToolCallProposal(call_id, tool, raw_arguments)``; arguments
  are passed through as text, never parsed or repaired.
- Every response's rate-limit headers are parsed (``actors.provider_headers``) into a
  ``RateLimitInfo``: on a reply as ``ModelReply.rate_limit``, on an error as ``.rate_limit``.
- The request goes out through the client's own ``post`` (the SDK's documented path for a request it has no
  typed method for), not ``chat.completions.create``: ``create`` first walks the whole body against its
  typed parameters (``async_maybe_transform``), which renames and reformats nothing in the chat messages and
  tools Tether sends, yet costs 2 ms of CPU for a six-message prompt and grows with the transcript (74 ms at
  400 messages; a node's model client pays it for every trajectory on the node). Everything else is the
  SDK's as before: auth and default headers, timeout, HTTP errors as its exception types, the SSE stream
  with its error events. ``tests/unit/actors/test_openai_body.py`` keeps the claim honest: the SDK's
  transform leaves every body shape this adapter builds unchanged.
- The stream's chunks come as the SDK's parsed JSON (``AsyncStream[object]``), not as ``ChatCompletionChunk``
  objects: the SDK builds those without validating them (``construct``), which cost a third of a streamed
  call's remaining CPU, and this adapter reads five fields of each. It checks the shape of what it reads
  instead (:class:`ChunkShapeError` names the field, its type and the expected one).

Errors: nothing but ``runtime.errors`` types leaves ``complete``. A 429 is :class:`ModelRateLimited` (a
``ProviderRateLimited``: admission feedback, with the parsed ``RateLimitInfo``). Everything else that goes
wrong, whatever raised it (the SDK, the HTTP transport, a stream line that is not JSON, a chunk of an
unexpected shape, a reset mid-stream), is :class:`ModelCallFailed` (a ``DependencyError``) whose message
names the provider, what failed and where (HTTP status, chunk number, the offending data), with
``non_retryable`` only for a 4xx other than 408/409/429 or an unknown finish reason.

Metering (the only place usage is estimated, always flagged):

- a reply whose provider reports usage is metered from that report, exactly;
- a reply without a usage report (a provider that ignores ``include_usage``) is metered from the estimate
  below and carries ``usage_estimated=True``: never zero;
- a failed or cancelled call carries the usage it saw: the provider's report if it arrived before the
  break, else the estimate once the server accepted the call (a 2xx status: it has the prompt, and may
  have streamed), else nothing (an error status or no answer: nothing is known to be billed);
- the estimate: *uncached input* = ``prompt_estimator(request)`` (default: JSON characters of messages
  and tools / 4) and *output* = content-bearing chunks received (one chunk is one token on OpenAI-style
  streams and on the testbed).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from actors.model_outcomes import CallObserved, CallObserver, ModelCallFailed, ModelRateLimited
from actors.provider_headers import parse_rate_limit
from runtime.clock import Clock, SystemClock
from runtime.errors import ModelCallCancelled, ProviderRateLimited
from runtime.ports import (
    CancelToken,
    ModelReply,
    ModelRequest,
    RateLimitInfo,
    StopReason,
    ToolCallProposal,
    Usage,
)

if TYPE_CHECKING:  # imported on the first call: a woken trajectory that only answers a signal never needs it
    import openai

__all__ = [
    "SCENARIO_HEADER",
    "TRAJECTORY_HEADER",
    "CallObserved",
    "CallObserver",
    "ChunkShapeError",
    "ModelCallFailed",
    "ModelRateLimited",
    "OpenAIModel",
    "estimate_prompt_tokens",
]

SCENARIO_HEADER = "X-Tether-Scenario"
TRAJECTORY_HEADER = "X-Tether-Trajectory"

_log = logging.getLogger(__name__)

_STOP_REASONS: Mapping[str, StopReason] = {
    "stop": StopReason.END_TURN,
    "length": StopReason.MAX_TOKENS,
    "tool_calls": StopReason.TOOL_USE,
    "function_call": StopReason.TOOL_USE,  # the legacy name of tool_calls
    "content_filter": StopReason.REFUSAL,
}
_EXCERPT = 120  # characters of offending data quoted in an error message
_CONNECT_TIMEOUT_S = 5.0  # opening a connection ahead of the first call (``connect``) is given up after this


class _NoObserver:
    def observe(self, call: CallObserved) -> None:
        pass


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
    received: int = 0  # every chunk parsed, content or not (names the place a bad one broke the stream)
    chunks: int = 0  # content-bearing chunks: the output estimate when the provider reports no usage
    finish_reason: str | None = None
    usage: Usage | None = None  # the provider's report, from the final chunk
    status: int | None = None  # the HTTP status, once the headers arrived
    rate_limit: RateLimitInfo | None = None


class OpenAIModel:
    """Calls an OpenAI-compatible chat-completions endpoint as a :class:`runtime.ports.ModelPort`.

    ``client`` may be injected (it must have ``max_retries=0``); otherwise one is built from
    ``base_url``/``api_key``. ``on_chunk`` is a hook called with the running count of
    content-bearing chunks (no-op by default; tests and progress meters use it). ``scope`` names the
    provider in raised errors (default: ``base_url``). ``observer`` is told how every call ended
    (no-op by default; ``actors.provider_tally.RedisProviderTally`` publishes the run report's counts).
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
        observer: CallObserver | None = None,
    ) -> None:
        if client is not None and client.max_retries != 0:
            raise ValueError("the injected openai client must have max_retries=0 (Tether owns retries)")
        # built on the first call: importing openai is about half of a trajectory actor's import time, which
        # a woken trajectory that only records a signal (or answers its status) would pay for nothing
        self._client: openai.AsyncOpenAI | None = client
        self._base_url = base_url
        self._api_key = api_key
        self._clock: Clock = clock or SystemClock()
        self._estimate = prompt_estimator
        self._on_chunk = on_chunk or (lambda _n: None)
        self.scope = scope or base_url
        self._max_tokens_field = max_tokens_field
        self._observer: CallObserver = observer or _NoObserver()
        self._warned_headers: set[str] = set()

    def body(self, request: ModelRequest) -> dict[str, Any]:
        """The JSON body of ``POST /chat/completions`` for ``request``: the OpenAI wire format, as sent."""
        body: dict[str, Any] = {
            "model": request.model,
            "messages": list(request.messages),
            self._max_tokens_field: request.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if request.tools:
            body["tools"] = list(request.tools)
        return body

    def _api(self) -> openai.AsyncOpenAI:
        if self._client is None:
            import openai

            self._client = openai.AsyncOpenAI(base_url=self._base_url, api_key=self._api_key, max_retries=0)
        return self._client

    def warm(self) -> None:
        """Build the HTTP client now, not on the first call (importing ``openai`` loads its chat types)."""
        self._api()

    async def connect(self) -> bool:
        """Open a connection to the provider ahead of the first call, with ``GET /models`` (the API's model
        list: no tokens, outside the completion limits); False when that failed (only logged: the first
        call opens its own). A first call that opens the connection reaches the provider 30-80 ms later
        than the calls after it, longer than the 50 ms the scheduler allows a sub-window's calls to arrive
        late (``ProviderLimits.sub_window_margin``): the call granted a sub-window after it met it there."""
        try:
            await asyncio.wait_for(self._api().models.list(), _CONNECT_TIMEOUT_S)
        except Exception as e:  # any answer, even an error status, leaves the connection open
            _log.debug("%s: no connection opened ahead of the first call: %r", self.scope, e)
            return False
        return True

    async def aclose(self) -> None:
        """Close the underlying HTTP client (if a call ever built it)."""
        if self._client is not None:
            await self._client.close()

    async def complete(self, request: ModelRequest, cancel: CancelToken) -> ModelReply:
        """Stream one completion; see the module docstring for cancellation, deadline, errors and metering."""
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
        try:
            reply = await self._complete(request, cancel, remaining, state)
        except ModelCallCancelled:
            self._observe(request, state, "cancelled", None)
            raise
        except ProviderRateLimited as e:
            self._observe(request, state, "rate_limited", e.rate_limit)
            raise
        except ModelCallFailed as e:
            self._observe(request, state, "failed", e.rate_limit, e.usage_estimated)
            raise
        self._observe(request, state, "reply", reply.rate_limit, reply.usage_estimated)
        return reply

    # ------------------------------------------------------------------ internals

    async def _complete(
        self, request: ModelRequest, cancel: CancelToken, remaining: float, state: _Stream
    ) -> ModelReply:
        call = asyncio.create_task(self._stream(request, remaining, state, cancel))
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
            usage, _ = self._failed_usage(request, state)
            raise ModelCallCancelled(cancel.reason or "cancelled", usage)
        usage, estimated = self._failed_usage(request, state)
        raise ModelCallFailed(
            f"model call to {self.scope} exceeded its deadline after {remaining:.3f}s "
            f"({state.chunks} content chunks received)",
            scope=self.scope,
            usage=usage,
            usage_estimated=estimated,
            status=state.status,
            rate_limit=state.rate_limit,
        )

    def _observe(
        self,
        request: ModelRequest,
        state: _Stream,
        outcome: Literal["reply", "rate_limited", "failed", "cancelled"],
        info: object,
        usage_estimated: bool = False,
    ) -> None:
        limit = info if isinstance(info, RateLimitInfo) else None
        seen = CallObserved(
            provider=self.scope,
            trajectory_id=request.trajectory_id,
            status=state.status,
            outcome=outcome,
            hint_source=limit.hint_source if limit is not None else None,
            retry_after_s=limit.retry_after_s if limit is not None else None,
            usage_estimated=usage_estimated,
        )
        try:
            self._observer.observe(seen)
        except Exception:  # counters are a view: a failing one never fails the call
            _log.warning("model call observer failed", exc_info=True)

    def _estimated_usage(self, request: ModelRequest, state: _Stream) -> Usage:
        return Usage(uncached_input=self._estimate(request), output=state.chunks)

    def _failed_usage(self, request: ModelRequest, state: _Stream) -> tuple[Usage, bool]:
        """The usage a failed or aborted call carries, and whether it is estimated (module docstring)."""
        if state.usage is not None:
            return state.usage, False
        if state.status is None or not 200 <= state.status < 300:
            return Usage(), False  # no reply began: nothing is known to be billed
        return self._estimated_usage(request, state), True

    def _limits(self, headers: Mapping[str, str], where: str) -> RateLimitInfo | None:
        parsed = parse_rate_limit(headers, self._clock.wall())
        for name, value in parsed.unreadable:
            if name not in self._warned_headers:  # once per header name: a server sends it on every reply
                self._warned_headers.add(name)
                _log.warning(
                    "%s: ignored unreadable header %s: %r on %s", self.scope, name, value[:_EXCERPT], where
                )
        return parsed.info

    async def _stream(
        self, request: ModelRequest, timeout: float, state: _Stream, cancel: CancelToken
    ) -> ModelReply:
        headers = {TRAJECTORY_HEADER: request.trajectory_id}
        if scenario := request.metadata.get("scenario"):
            headers[SCENARIO_HEADER] = scenario
        client = self._api()
        import openai  # loaded by _api(): the except clauses below name its error types
        from openai.types.chat import ChatCompletion

        try:
            stream = await client.post(
                "/chat/completions",
                body=self.body(request),
                cast_to=ChatCompletion,
                options={"headers": headers, "timeout": timeout},
                stream=True,
                stream_cls=openai.AsyncStream[object],  # each chunk as parsed JSON
            )
            async with stream:  # leaving it closes the HTTP stream, mid-way on a cancel
                state.status = stream.response.status_code
                state.rate_limit = self._limits(stream.response.headers, f"HTTP {state.status}")
                async for chunk in stream:
                    self._absorb(chunk, state)
                    if cancel.cancelled:
                        # chunks already buffered are read without yielding to the loop: stop here, so the
                        # abort bills what had arrived when it was asked for, not what the buffer held
                        break
        except asyncio.CancelledError:
            raise  # our own abort (cancel or deadline): complete() decides what it was
        except openai.RateLimitError as e:
            state.status = e.status_code
            raise self._rate_limited(e) from e
        except openai.APIStatusError as e:
            raise self._status_failed(request, state, e) from e
        except Exception as e:  # the transport, the SDK, or the stream's content: all are a failed call
            raise self._stream_failed(request, state, e) from e
        if cancel.cancelled:
            usage, _ = self._failed_usage(request, state)
            raise ModelCallCancelled(cancel.reason or "cancelled", usage)
        return self._reply(request, state)

    def _absorb(self, chunk: object, state: _Stream) -> None:
        fields = _object(chunk, "the chunk")
        usage = fields.get("usage")
        if usage is not None:
            state.usage = _usage_of(_object(usage, "usage"))
        for number, listed in enumerate(_array(fields.get("choices"), "choices")):
            where = f"choices[{number}]"
            choice = _object(listed, where)
            delta = choice.get("delta")
            delta = {} if delta is None else _object(delta, f"{where}.delta")  # absent or null: no content
            carried = False
            for key in ("content", "refusal"):
                if text := _text(delta.get(key), f"{where}.delta.{key}"):
                    state.text.append(text)
                    carried = True
            for place, listed_call in enumerate(_array(delta.get("tool_calls"), f"{where}.delta.tool_calls")):
                at = f"{where}.delta.tool_calls[{place}]"
                tool_call = _object(listed_call, at)
                index = tool_call.get("index")
                if type(index) is not int:
                    raise ChunkShapeError(f"{at}.index", index, "an integer")
                slot = state.calls.setdefault(index, _CallSlot())
                if call_id := _text(tool_call.get("id"), f"{at}.id"):
                    slot.call_id = call_id
                function = tool_call.get("function")
                if function is not None:
                    function = _object(function, f"{at}.function")
                    slot.name += _text(function.get("name"), f"{at}.function.name")
                    if arguments := _text(function.get("arguments"), f"{at}.function.arguments"):
                        slot.arguments.append(arguments)
                carried = True
            if carried:
                state.chunks += 1
                self._on_chunk(state.chunks)
            if finish_reason := _text(choice.get("finish_reason"), f"{where}.finish_reason"):
                state.finish_reason = finish_reason
        state.received += 1

    def _reply(self, request: ModelRequest, state: _Stream) -> ModelReply:
        if state.finish_reason is None:
            usage, estimated = self._failed_usage(request, state)
            raise ModelCallFailed(
                f"stream from {self.scope} ended without a finish reason after {state.received} chunks "
                f"({state.chunks} with content)",
                scope=self.scope,
                usage=usage,
                usage_estimated=estimated,
                status=state.status,
                rate_limit=state.rate_limit,
            )
        stop = _STOP_REASONS.get(state.finish_reason)
        if stop is None:
            usage, estimated = self._failed_usage(request, state)
            raise ModelCallFailed(
                f"unknown finish_reason {state.finish_reason!r} from {self.scope} "
                f"(expected one of {sorted(_STOP_REASONS)})",
                scope=self.scope,
                usage=usage,
                usage_estimated=estimated,
                non_retryable=True,
                status=state.status,
                rate_limit=state.rate_limit,
            )
        calls = [
            ToolCallProposal(
                call_id=slot.call_id or f"call_{index}", tool=slot.name, raw_arguments="".join(slot.arguments)
            )
            for index, slot in sorted(state.calls.items())
        ]
        estimated = state.usage is None  # a provider that ignores include_usage: the documented estimate
        usage = self._estimated_usage(request, state) if state.usage is None else state.usage
        return ModelReply(
            stop_reason=stop,
            text="".join(state.text),
            tool_calls=calls,
            usage=usage,
            rate_limit=state.rate_limit,
            usage_estimated=estimated,
        )

    def _rate_limited(self, error: openai.RateLimitError) -> ModelRateLimited:
        info = self._limits(error.response.headers, "HTTP 429")
        return ModelRateLimited(
            f"{self.scope} rate limited the call (HTTP 429): {error.message}",
            scope=self.scope,
            retry_after=info.retry_after_s if info is not None else None,
            remaining=info.remaining() if info is not None else {},
            rate_limit=info,
        )

    def _status_failed(
        self, request: ModelRequest, state: _Stream, error: openai.APIStatusError
    ) -> ModelCallFailed:
        state.status = error.status_code
        state.rate_limit = self._limits(error.response.headers, f"HTTP {error.status_code}")
        retryable = error.status_code >= 500 or error.status_code in (408, 409)
        usage, estimated = self._failed_usage(request, state)
        return ModelCallFailed(
            f"{self.scope} answered HTTP {error.status_code}: {error.message}",
            scope=self.scope,
            usage=usage,
            usage_estimated=estimated,
            non_retryable=not retryable,
            status=error.status_code,
            rate_limit=state.rate_limit,
        )

    def _stream_failed(self, request: ModelRequest, state: _Stream, error: Exception) -> ModelCallFailed:
        usage, estimated = self._failed_usage(request, state)
        return ModelCallFailed(
            f"model call to {self.scope} failed {_where(state)}: {_describe(error)}",
            scope=self.scope,
            usage=usage,
            usage_estimated=estimated,
            status=state.status,
            rate_limit=state.rate_limit,
        )


def _where(state: _Stream) -> str:
    if state.status is None:
        return "before any response"
    return f"in the HTTP {state.status} stream at chunk {state.received + 1}"


def _describe(error: Exception) -> str:
    """The error's type and message, plus the data it choked on when there is some (a JSON error)."""
    text = f"{type(error).__name__}: {getattr(error, 'message', None) or error}"
    if isinstance(error, json.JSONDecodeError):
        text += f"; the line's data was {error.doc[:_EXCERPT]!r}"
    return text


class ChunkShapeError(ValueError):
    """A stream chunk that parsed as JSON but is not shaped like a chat completion chunk where it is read."""

    def __init__(self, where: str, value: object, expected: str) -> None:
        shown = json.dumps(value, default=str)
        if len(shown) > _EXCERPT:
            shown = shown[:_EXCERPT] + "..."
        kind = _JSON_KINDS.get(type(value))
        super().__init__(f"{where} is {f'{kind} {shown}' if kind else shown}, expected {expected}")


_JSON_KINDS: Mapping[type, str] = {
    dict: "an object",
    list: "an array",
    str: "a string",
    int: "a number",
    float: "a number",
}


def _object(value: object, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ChunkShapeError(where, value, "an object")
    return value


def _array(value: object, where: str) -> list[Any]:
    """A list, or none at all (absent or null)."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise ChunkShapeError(where, value, "an array")
    return value


def _text(value: object, where: str) -> str:
    """A string, or the empty string for absent or null."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ChunkShapeError(where, value, "a string")
    return value


def _count(value: object, where: str) -> int:
    """A token count: a non-negative integer, or 0 for absent or null."""
    if value is None:
        return 0
    if type(value) is not int or value < 0:
        raise ChunkShapeError(where, value, "a non-negative integer")
    return value


def _usage_of(reported: dict[str, Any]) -> Usage:
    """``Usage`` from the final chunk's ``usage`` (cached tokens split out of the prompt)."""
    details = reported.get("prompt_tokens_details")
    cached = (
        0
        if details is None
        else _count(
            _object(details, "usage.prompt_tokens_details").get("cached_tokens"),
            "usage.prompt_tokens_details.cached_tokens",
        )
    )
    prompt = _count(reported.get("prompt_tokens"), "usage.prompt_tokens")
    return Usage(
        uncached_input=max(0, prompt - cached),
        cached_input=cached,
        output=_count(reported.get("completion_tokens"), "usage.completion_tokens"),
    )
