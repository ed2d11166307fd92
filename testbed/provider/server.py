"""The simulated OpenAI-compatible provider: an aiohttp application and an in-process server object.

Routes:

- ``POST /v1/chat/completions``: streaming (SSE, one token per chunk; with
  ``stream_options.include_usage`` a final chunk with empty ``choices`` carries ``usage``) and
  non-streaming. The reply is scripted by ``X-Tether-Scenario`` (see :mod:`.scenarios`); the prefix
  cache and per-trajectory counters are keyed by ``X-Tether-Trajectory``.
- ``GET /v1/models``.
- ``GET /testbed/stats`` (shape in :mod:`.stats`), ``POST /testbed/reset`` (counters, limiter window,
  prefix cache and fault cleared), ``GET``/``POST /testbed/config`` (a :class:`.config.ConfigPatch`).

Every chat response, successful or not, carries the ``x-ratelimit-*`` headers of :mod:`.limits`. A 429
also carries ``Retry-After`` (whole seconds, rounded up) and ``retry-after-ms``. A request whose
``prompt + max_tokens`` exceeds the TPM limit on its own is answered 400 ``request_too_large``: it
could never be admitted, and a 429 would invite retries forever. The limiter mode (OpenAI-like sliding
windows or Anthropic-like token bucket) and whether a 429 still costs its request are set by
:class:`.config.ProviderConfig`.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from runtime.clock import Clock, SystemClock
from runtime.errors import InputError
from testbed.provider.config import ConfigPatch, Fault, ProviderConfig
from testbed.provider.limits import LimiterMode, LimitSnapshot, RateLimiter, Rejected
from testbed.provider.prefix_cache import PrefixCache
from testbed.provider.reply import RenderedReply, render
from testbed.provider.scenarios import ScenarioError, decide, parse_scenario
from testbed.provider.sliding_window import SlidingWindowLimiter
from testbed.provider.stats import ProviderStats
from testbed.provider.token_bucket import TokenBucketLimiter
from testbed.provider.tokenizer import REPLY_PRIMING_TOKENS, count_tokens, prompt_blocks
from testbed.provider.wire import (
    ChatRequest,
    chunk,
    completion_body,
    error_body,
    parse_chat_request,
    sse,
    usage_body,
)

__all__ = ["SCENARIO_HEADER", "TRAJECTORY_HEADER", "ProviderServer", "make_limiter"]

SCENARIO_HEADER = "X-Tether-Scenario"
TRAJECTORY_HEADER = "X-Tether-Trajectory"


@dataclass(slots=True)
class _Billing:
    """Output tokens sent so far for one accepted request, and whether its client went away."""

    emitted: int = 0
    aborted: bool = False


@dataclass(slots=True)
class _ActiveFault:
    fault: Fault
    until: float | None
    remaining: int | None


class ProviderServer:
    """The simulated provider, runnable inside any asyncio event loop.

    >>> server = ProviderServer(ProviderConfig(rpm=60, tpm=100_000))   # doctest: +SKIP
    >>> await server.start(); server.base_url                          # doctest: +SKIP
    'http://127.0.0.1:PORT/v1'
    """

    def __init__(
        self,
        config: ProviderConfig | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        clock: Clock | None = None,
    ) -> None:
        self._config = config or ProviderConfig()
        self._host = host
        self._port = port
        self._clock: Clock = clock or SystemClock()
        self._limiter = make_limiter(self._config, self._clock)
        self._cache = PrefixCache(self._config.cache_max_trajectories)
        self._stats = ProviderStats(self._clock)
        self._fault: _ActiveFault | None = None
        self._runner: web.AppRunner | None = None
        self.app = self._build_app()

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Bind and serve; with ``port=0`` the OS picks a free port (see :attr:`port`)."""
        if self._runner is not None:
            raise RuntimeError("provider already started")
        # handler_cancellation: a client that goes away stops its generation at once (as on a real
        # provider) instead of holding a task until the next token is due.
        runner = web.AppRunner(self.app, access_log=None, shutdown_timeout=1.0, handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, self._host, self._port)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._port = int(runner.addresses[0][1])
        self._runner = runner

    async def stop(self) -> None:
        """Stop serving and close open connections."""
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    async def __aenter__(self) -> ProviderServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        """Root URL, e.g. ``http://127.0.0.1:PORT`` (testbed endpoints live here)."""
        return f"http://{self._host}:{self._port}"

    @property
    def base_url(self) -> str:
        """What an OpenAI client takes as ``base_url``: ``http://HOST:PORT/v1``."""
        return self.url + "/v1"

    @property
    def config(self) -> ProviderConfig:
        return self._config

    # ------------------------------------------------------------------ direct control (in-process)

    def stats(self) -> dict[str, Any]:
        """The same JSON as ``GET /testbed/stats``."""
        return self._stats.to_json()

    def reset(self) -> None:
        """Clear counters, the limiter window, the prefix cache and any fault."""
        self._stats.reset()
        self._limiter.reset()
        self._cache.clear()
        self._fault = None

    def configure(self, patch: ConfigPatch) -> ProviderConfig:
        """Apply a patch (limits, latency, fault) and return the new config."""
        self._config = patch.apply(self._config)
        if patch.rebuilds_limiter:
            self._limiter = make_limiter(self._config, self._clock)
        else:
            self._limiter.set_limits(rpm=self._config.rpm or None, tpm=self._config.tpm or None)
        if patch.clear_fault:
            self._fault = None
        if patch.fault is not None:
            until = None if patch.fault.for_s is None else self._clock.now() + patch.fault.for_s
            self._fault = _ActiveFault(patch.fault, until, patch.fault.count)
        return self._config

    # ------------------------------------------------------------------ HTTP

    def _build_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/testbed/stats", self._get_stats)
        app.router.add_post("/testbed/reset", self._post_reset)
        app.router.add_get("/testbed/config", self._get_config)
        app.router.add_post("/testbed/config", self._post_config)
        return app

    async def _models(self, _: web.Request) -> web.Response:
        created = int(time.time())
        data = [
            {"id": m, "object": "model", "created": created, "owned_by": "tether-testbed"}
            for m in self._config.models
        ]
        return web.json_response({"object": "list", "data": data})

    async def _get_stats(self, _: web.Request) -> web.Response:
        return web.json_response(self.stats())

    async def _post_reset(self, _: web.Request) -> web.Response:
        self.reset()
        return web.json_response({"ok": True})

    async def _get_config(self, _: web.Request) -> web.Response:
        return web.json_response(self._config_json())

    async def _post_config(self, request: web.Request) -> web.Response:
        try:
            patch = ConfigPatch.model_validate(await request.json())
        except (ValidationError, json.JSONDecodeError, ValueError) as e:
            return web.json_response(
                error_body(f"bad config patch: {e}", kind="invalid_request_error"), status=400
            )
        self.configure(patch)
        return web.json_response(self._config_json())

    def _config_json(self) -> dict[str, Any]:
        fault = None if self._fault is None else self._fault.fault.model_dump()
        return {**self._config.model_dump(exclude={"api_key"}), "fault": fault}

    # ------------------------------------------------------------------ chat completions

    def _error(
        self, status: int, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> web.Response:
        merged = {**self._limiter.snapshot().headers(), **(headers or {})}
        return web.json_response(body, status=status, headers=merged)

    def _take_fault(self) -> Fault | None:
        active = self._fault
        if active is None:
            return None
        if active.until is not None and self._clock.now() >= active.until:
            self._fault = None
            return None
        if active.remaining is not None:
            active.remaining -= 1
            if active.remaining <= 0:
                self._fault = None
        return active.fault

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        trajectory_header = request.headers.get(TRAJECTORY_HEADER)
        trajectory = trajectory_header or "-"
        self._stats.on_request(trajectory)
        if (
            self._config.api_key is not None
            and request.headers.get("Authorization") != f"Bearer {self._config.api_key}"
        ):
            self._stats.on_rejected()
            return self._error(
                401, error_body("invalid API key", kind="invalid_request_error", code="invalid_api_key")
            )
        try:
            body = await request.json()
            chat = parse_chat_request(body)
            scenario = parse_scenario(request.headers.get(SCENARIO_HEADER))
        except (InputError, ScenarioError) as e:
            self._stats.on_rejected()
            param = getattr(e, "where", None)
            return self._error(400, error_body(str(e), kind="invalid_request_error", param=param))
        except (json.JSONDecodeError, ValueError) as e:
            self._stats.on_rejected()
            return self._error(400, error_body(f"body is not JSON: {e}", kind="invalid_request_error"))

        fault = self._take_fault()
        if fault is not None:
            return self._fault_response(fault, trajectory)

        max_tokens = chat.max_completion_tokens or chat.max_tokens or self._config.default_max_tokens
        blocks = prompt_blocks(chat.messages, chat.tools)
        prompt_tokens = sum(count_tokens(b) for b in blocks) + REPLY_PRIMING_TOKENS
        # limits: a refused request still costs its prompt (unsuccessful requests count, see limits.py)
        decision = self._limiter.try_admit(prompt_tokens + max_tokens, rejected_tokens=prompt_tokens)
        if isinstance(decision, Rejected):
            return self._rejected(decision, trajectory, prompt_tokens, max_tokens)

        cached = self._cache.measure(trajectory_header, blocks, REPLY_PRIMING_TOKENS).cached
        turn = sum(1 for m in chat.messages if m.get("role") == "assistant")
        reply = render(
            decide(scenario, chat.messages, chat.tools, chat.tool_choice),
            max_tokens=max_tokens,
            trajectory_id=trajectory_header,
            turn=turn,
        )
        self._stats.on_accepted(trajectory)
        billing = _Billing()
        try:
            if chat.stream:
                return await self._stream(
                    request, chat, reply, prompt_tokens, cached, decision.snapshot, billing
                )
            await self._wait_until(self._clock.now(), reply.completion_tokens)
            billing.emitted = reply.completion_tokens
            usage = usage_body(prompt_tokens, cached, billing.emitted)
            body_out = completion_body(
                completion_id=_completion_id(),
                created=int(time.time()),
                model=chat.model,
                reply=reply,
                usage=usage,
            )
            return web.json_response(body_out, headers=decision.snapshot.headers())
        except asyncio.CancelledError:
            billing.aborted = True  # the client disconnected while we waited or streamed
            raise
        finally:
            # limits: the admission charge (prompt + max_tokens) is corrected to what was really produced
            self._limiter.settle(decision.ticket, prompt_tokens + billing.emitted)
            self._stats.on_finished(
                trajectory,
                prompt=prompt_tokens,
                cached=cached,
                completion=billing.emitted,
                aborted=billing.aborted,
            )

    async def _stream(
        self,
        request: web.Request,
        chat: ChatRequest,
        reply: RenderedReply,
        prompt_tokens: int,
        cached: int,
        snapshot: LimitSnapshot,
        billing: _Billing,
    ) -> web.StreamResponse:
        """Send the reply as SSE, one token per chunk, counting into ``billing`` as chunks go out."""
        response = web.StreamResponse(
            status=200,
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **snapshot.headers()},
        )
        await response.prepare(request)
        make = functools.partial(
            chunk, completion_id=_completion_id(), created=int(time.time()), model=chat.model
        )
        start = self._clock.now()
        try:
            for i, piece in enumerate(reply.pieces):
                await self._wait_until(start, i + 1)
                await response.write(sse(make(piece=piece, first=i == 0)))
                billing.emitted += 1
            await response.write(
                sse(make(piece=None, first=not reply.pieces, finish_reason=reply.finish.value))
            )
            if chat.stream_options is not None and chat.stream_options.include_usage:
                final = {**make(piece=None, first=False), "choices": []}
                final["usage"] = usage_body(prompt_tokens, cached, billing.emitted)
                await response.write(sse(final))
            await response.write(sse("[DONE]"))
            await response.write_eof()
        except ConnectionError:
            billing.aborted = True  # the client went away: it is billed for what was sent
        return response

    async def _wait_until(self, start: float, tokens: int) -> None:
        """Sleep until token number ``tokens`` is due: ttft, then one token per 1/tokens_per_s."""
        config = self._config
        due = start + config.ttft_ms / 1000.0
        if config.tokens_per_s > 0 and tokens > 1:
            due += (tokens - 1) / config.tokens_per_s
        delay = due - self._clock.now()
        if delay > 0:
            await self._clock.sleep(delay)

    def _rejected(
        self, decision: Rejected, trajectory: str, prompt_tokens: int, max_tokens: int
    ) -> web.Response:
        if decision.too_large:
            self._stats.on_rejected()
            message = (
                f"request too large: prompt {prompt_tokens} + max_tokens {max_tokens} tokens exceeds the "
                f"limit of {self._config.tpm} tokens per {self._config.window_s:g}s"
            )
            return self._error(
                400, error_body(message, kind="invalid_request_error", code="request_too_large")
            )
        self._stats.on_rate_limited(trajectory)
        limit = self._config.rpm if decision.dimension == "requests" else self._config.tpm
        message = (
            f"Rate limit reached for {decision.dimension} (limit: {limit} per {self._config.window_s:g}s, "
            f"{self._config.limiter}). Requested: {prompt_tokens + max_tokens} tokens. "
            f"Please try again in {decision.retry_after_s:.3f}s."
        )
        return self._error(
            429,
            error_body(message, kind=str(decision.dimension), code="rate_limit_exceeded"),
            _retry_after_headers(decision.retry_after_s),
        )

    def _fault_response(self, fault: Fault, trajectory: str) -> web.Response:
        if fault.status == 429:
            self._stats.on_rate_limited(trajectory)
            body = error_body(
                "forced rate limit (testbed fault)", kind="requests", code="rate_limit_exceeded"
            )
            return self._error(429, body, _retry_after_headers(fault.retry_after_s))
        self._stats.on_failed()
        return self._error(
            fault.status, error_body("forced server error (testbed fault)", kind="server_error")
        )


def make_limiter(config: ProviderConfig, clock: Clock) -> RateLimiter:
    """The limiter ``config`` asks for (a limit of 0 is unlimited)."""
    rpm, tpm = config.rpm or None, config.tpm or None
    if config.limiter is LimiterMode.TOKEN_BUCKET:
        return TokenBucketLimiter(
            clock, rpm=rpm, tpm=tpm, window_s=config.window_s, count_rejected=config.count_rejected
        )
    return SlidingWindowLimiter(
        clock,
        rpm=rpm,
        tpm=tpm,
        window_s=config.window_s,
        sub_window_s=config.sub_window_s,
        sub_window_tokens=config.sub_window_tokens,
        count_rejected=config.count_rejected,
    )


def _retry_after_headers(seconds: float) -> dict[str, str]:
    # Rounded to the microsecond before the ceiling: a wait of exactly 60 s computed from clock readings
    # (60.00000000000001) is still "60" and "60000", as the message's "60.000s" says.
    return {
        "Retry-After": str(max(1, math.ceil(round(seconds, 6)))),
        "retry-after-ms": str(max(1, math.ceil(round(seconds * 1000, 3)))),
    }


def _completion_id() -> str:
    return "chatcmpl-" + uuid.uuid4().hex[:24]
