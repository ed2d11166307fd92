"""A small framework to host Python tool functions behind the ``ToolService`` gRPC protocol.

A tool is a function ``fn(arguments, ctx)`` (sync or async) that applies its effect and returns a
JSON-compatible result, or raises ``ToolError`` to refuse without applying anything. The server:

- decodes and validates the request (bad input -> INVALID_ARGUMENT, unknown tool -> NOT_FOUND);
- propagates the deadline: the tool gets ``ctx.time_remaining()`` from the earlier of the gRPC deadline
  (``context.time_remaining()``) and the request's absolute deadline, and a call that arrives past its
  deadline is refused before any effect;
- deduplicates by effect key only when asked to (``dedupe_effect_keys=True``: an applied key returns
  its stored result, a running key is joined, never applied twice). The default is off: a service
  that promises deduplication says so, and a test service that must show a re-dispatch (the testbed)
  applies every delivery;
- tells its hooks about every physical delivery (``arrived``) and what became of it (``disposed``),
  before any check, so an independent record can count deliveries apart from applied effects;
- answers Probe and Cancel from its effect table, fencing unseen keys so "absent" stays true;
- offers ``ServerHooks`` (no-op by default) where a testbed injects faults.

Sync tools run in a worker thread; they can never be cancelled mid-way.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from types import TracebackType
from typing import Any

import grpc
import pydantic

from actors.tools_grpc import tether_tools_pb2 as pb
from actors.tools_grpc import tether_tools_pb2_grpc as pb_grpc
from actors.tools_grpc.codec import ToolCall, call_from_request, canonical_json
from actors.tools_grpc.effects import EffectOutcome, EffectState, EffectTable
from actors.tools_grpc.errors import ToolError
from actors.tools_grpc.status_map import RETRY_AFTER_KEY
from runtime.clock import Clock, SystemClock
from runtime.errors import InputError

__all__ = ["Disposition", "ServerHooks", "ToolContext", "ToolFn", "ToolServer", "ToolSpec"]

log = logging.getLogger(__name__)

ToolFn = Callable[[Mapping[str, Any], "ToolContext"], Any]
AddServicer = Callable[[grpc.aio.Server], None]

_add_tool_servicer: Callable[[Any, grpc.aio.Server], None] = pb_grpc.add_ToolServiceServicer_to_server

# A call without any deadline still gets one: nothing on the server runs unbounded.
DEFAULT_DEADLINE_S = 60.0


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """One hosted tool.

    ``cancellable`` is a promise by an *async* tool: it commits its effect in one synchronous step
    after its last ``await``, so cancelling it at an ``await`` leaves no effect behind.
    """

    name: str
    fn: ToolFn
    cancellable: bool = False
    description: str = ""

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.fn)


class ToolContext:
    """What a running tool knows about its call: identities and the propagated deadline."""

    def __init__(self, call: ToolCall, deadline: float, clock: Clock) -> None:
        self.call = call
        self.deadline = deadline  # on ``clock.now()``'s monotonic axis
        self._clock = clock

    def time_remaining(self) -> float:
        """Seconds left before the caller gives up (may be negative)."""
        return self.deadline - self._clock.now()

    def check_deadline(self) -> None:
        """Refuse to commit once the caller's deadline has passed: no one is waiting for the effect."""
        late = -self.time_remaining()
        if late >= 0:
            raise ToolError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"deadline passed {late:.3f}s before {self.call.tool!r} committed; not applied",
            )

    async def sleep(self, seconds: float) -> None:
        """Wait on the server clock (simulated work in testbed tools)."""
        await self._clock.sleep(seconds)


class Disposition(StrEnum):
    """What the server did with one delivery of an Invoke."""

    LATE = "late"  # arrived past its deadline: refused before any effect
    FENCED = "fenced"  # carried a fence below the key's (issued before a probe/cancel): refused
    APPLIED = "applied"  # handed to the tool, which applied the effect
    DEDUPLICATED = "deduplicated"  # answered from (or joined to) an earlier delivery of the key
    REFUSED = "refused"  # handed to the tool, which refused before any effect (established absent)
    UNKNOWN = "unknown"  # handed to the tool, which crashed mid-way


class ServerHooks:
    """Extension points around each call; the defaults do nothing. A fault injector overrides them."""

    def arrived(self, call: ToolCall, prior: EffectState | None) -> object:
        """A decoded Invoke reached the server, before any check; ``prior`` is the key's state then
        (``None``: no earlier delivery). Returns a token handed back to ``disposed``."""
        return None

    def disposed(self, token: object, disposition: Disposition, reply: str) -> None:
        """What became of the delivery ``token``: its disposition and its reply (``answered``,
        ``dropped``, ``abandoned`` (the caller stopped waiting first) or ``error:<STATUS>``)."""

    def honour_effect_keys(self, call: ToolCall) -> bool | None:
        """Whether this call is deduplicated by its effect key; ``None``: the server's
        ``dedupe_effect_keys`` decides."""
        return None

    def deliveries(self, call: ToolCall) -> int:
        """How many times the request is handed to the tool (> 1 simulates duplicate delivery)."""
        return 1

    async def before_effect(self, call: ToolCall, ctx: ToolContext) -> None:
        """Runs inside the effect task before the tool; may wait or raise ``ToolError``."""

    async def after_effect(
        self, call: ToolCall, ctx: ToolContext, reply: pb.InvokeReply
    ) -> pb.InvokeReply | None:
        """Runs after an applied effect; may rewrite the reply, or return ``None`` to drop it."""
        return reply


class ToolServer:
    """A real ``grpc.aio`` server hosting ``tools`` (plus any extra servicers) on one port."""

    def __init__(
        self,
        tools: Iterable[ToolSpec],
        *,
        dedupe_effect_keys: bool = False,
        hooks: ServerHooks | None = None,
        clock: Clock | None = None,
        extra_servicers: Sequence[AddServicer] = (),
    ) -> None:
        self._tools: dict[str, ToolSpec] = {}
        for spec in tools:
            if spec.name in self._tools:
                raise InputError(f"tool {spec.name!r} registered twice", where="ToolServer.tools")
            self._tools[spec.name] = spec
        self.dedupe_effect_keys = dedupe_effect_keys
        self.hooks = hooks or ServerHooks()
        self.clock: Clock = clock or SystemClock()
        self.effects = EffectTable()
        self._extra = tuple(extra_servicers)
        self._server: grpc.aio.Server | None = None
        self.port = 0
        self.host = "127.0.0.1"

    @property
    def tools(self) -> Sequence[str]:
        """Names of the hosted tools."""
        return tuple(self._tools)

    @property
    def address(self) -> str:
        """``host:port`` once started."""
        if self._server is None:
            raise RuntimeError("ToolServer is not started")
        return f"{self.host}:{self.port}"

    async def start(self, port: int = 0, host: str = "127.0.0.1") -> int:
        """Bind ``host:port`` (0 picks a free port), start serving, and return the bound port."""
        if self._server is not None:
            raise RuntimeError("ToolServer already started")
        # so_reuseport off: a second server on a taken port must fail, not share it silently.
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        _add_tool_servicer(_ToolServicer(self), server)
        for add in self._extra:
            add(server)
        try:
            bound = server.add_insecure_port(f"{host}:{port}")
        except RuntimeError as e:  # grpcio >= 1.5x raises instead of returning 0
            bound, reason = 0, str(e).split(";")[0]
        else:
            reason = "bind failed"
        if bound == 0:
            raise OSError(f"could not bind gRPC tool server to {host}:{port} ({reason}; is the port taken?)")
        await server.start()
        self._server, self.port, self.host = server, int(bound), host
        log.info("tool server on %s:%d hosting %s", host, bound, sorted(self._tools))
        return self.port

    async def stop(self, grace: float | None = 0.5) -> None:
        """Stop serving, then let running effect tasks finish so the effect table is final."""
        if self._server is None:
            return
        server, self._server = self._server, None
        await server.stop(grace)
        await self.effects.drain()

    async def wait_for_termination(self) -> None:
        """Block until the server stops (used by ``python -m testbed.tools``)."""
        if self._server is not None:
            await self._server.wait_for_termination()

    async def __aenter__(self) -> ToolServer:
        if self._server is None:
            await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    # ------------------------------------------------------------------ effect execution

    def spec(self, tool: str) -> ToolSpec | None:
        return self._tools.get(tool)

    def remaining(self, call: ToolCall, grpc_remaining: float | None) -> float:
        """Seconds left for ``call``: the earlier of the gRPC and the absolute deadline."""
        candidates = [DEFAULT_DEADLINE_S]
        if grpc_remaining is not None:
            candidates.append(grpc_remaining)
        if call.deadline_epoch_s > 0 and math.isfinite(call.deadline_epoch_s):
            candidates.append(call.deadline_epoch_s - self.clock.wall())
        return min(candidates)

    async def deliver(self, spec: ToolSpec, call: ToolCall, ctx: ToolContext) -> tuple[EffectOutcome, bool]:
        """Hand ``call`` to its tool once; return the outcome and whether it was deduplicated."""
        settles, deduplicated = self.start_delivery(spec, call, ctx)
        # Shielded: when the caller's deadline cancels this RPC, the effect still settles its entry.
        return await asyncio.shield(settles), deduplicated

    def start_delivery(
        self, spec: ToolSpec, call: ToolCall, ctx: ToolContext
    ) -> tuple[asyncio.Future[EffectOutcome], bool]:
        """Start (or, when the key is honoured, join) the effect of ``call``: the future that settles it,
        and whether this delivery was deduplicated."""
        entry = self.effects.get(call.tool, call.effect_key)
        honour = self.hooks.honour_effect_keys(call)
        if honour is None:
            honour = self.dedupe_effect_keys
        if entry is not None and honour:
            if entry.state is EffectState.APPLIED:
                done: asyncio.Future[EffectOutcome] = asyncio.get_running_loop().create_future()
                done.set_result(EffectOutcome(EffectState.APPLIED, result_json=entry.result_json))
                return done, True
            if entry.state is EffectState.IN_FLIGHT and entry.task is not None:
                return entry.task, True
        task = self.effects.start(
            call.tool,
            call.effect_key,
            self._effect(spec, call, ctx),
            cancellable=spec.cancellable and spec.is_async,
        )
        return task, False

    async def _effect(self, spec: ToolSpec, call: ToolCall, ctx: ToolContext) -> EffectOutcome:
        try:
            await self.hooks.before_effect(call, ctx)
            ctx.check_deadline()  # a call that waited past its deadline is not applied
            if spec.is_async:
                value = await spec.fn(call.arguments, ctx)
            else:
                value = await asyncio.to_thread(spec.fn, call.arguments, ctx)
        except ToolError as e:
            return EffectOutcome(EffectState.ABSENT, detail=e.message, code=e.code, retry_after=e.retry_after)
        except (InputError, pydantic.ValidationError) as e:
            return EffectOutcome(EffectState.ABSENT, detail=str(e), code=grpc.StatusCode.INVALID_ARGUMENT)
        except Exception as e:
            log.exception("tool %s crashed for effect key %s", call.tool, call.effect_key)
            return EffectOutcome(
                EffectState.UNKNOWN, detail=f"tool crashed: {e!r}", code=grpc.StatusCode.INTERNAL
            )
        try:
            result_json = canonical_json(value, where=f"{call.tool} result")
        except InputError as e:
            return EffectOutcome(EffectState.UNKNOWN, detail=str(e), code=grpc.StatusCode.INTERNAL)
        return EffectOutcome(EffectState.APPLIED, result_json=result_json)


def _disposition(state: EffectState, deduplicated: bool) -> Disposition:
    if deduplicated:
        return Disposition.DEDUPLICATED
    if state is EffectState.APPLIED:
        return Disposition.APPLIED
    if state is EffectState.ABSENT:
        return Disposition.REFUSED
    return Disposition.UNKNOWN


class _ToolServicer(pb_grpc.ToolServiceServicer):
    """The gRPC face of a ``ToolServer``: decoding, status codes, metadata."""

    def __init__(self, server: ToolServer) -> None:
        self._s = server

    async def _spec(self, tool: str, context: grpc.aio.ServicerContext[Any, Any]) -> ToolSpec:
        spec = self._s.spec(tool)
        if spec is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no tool named {tool!r} on this server")
            raise AssertionError("unreachable: abort raises")
        return spec

    async def Invoke(
        self, request: pb.InvokeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.InvokeReply:
        try:
            call = call_from_request(request)
        except InputError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            raise AssertionError("unreachable: abort raises") from e
        spec = await self._spec(call.tool, context)
        s = self._s
        entry = s.effects.get(call.tool, call.effect_key)
        token = s.hooks.arrived(call, entry.state if entry is not None else None)
        remaining = s.remaining(call, context.time_remaining())
        if remaining <= 0:
            s.hooks.disposed(token, Disposition.LATE, "error:DEADLINE_EXCEEDED")
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"deadline passed {-remaining:.3f}s before arrival; not applied",
            )
        if call.fence < s.effects.fence(call.tool, call.effect_key):
            s.hooks.disposed(token, Disposition.FENCED, "error:FAILED_PRECONDITION")
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"effect key {call.effect_key!r} was fenced by a probe or cancel; this attempt is refused",
            )
        ctx = ToolContext(call, s.clock.now() + remaining, s.clock)
        settles, deduplicated = s.start_delivery(spec, call, ctx)
        try:
            # Shielded: when the caller's deadline cancels this RPC, the effect still settles its entry.
            outcome = await asyncio.shield(settles)
        except asyncio.CancelledError:
            # The caller stopped waiting (its deadline, a cancel): the delivery's fate is still recorded.
            def abandoned(done: asyncio.Future[EffectOutcome]) -> None:
                state = done.result().state if not done.cancelled() else EffectState.UNKNOWN
                s.hooks.disposed(token, _disposition(state, deduplicated), "abandoned")

            settles.add_done_callback(abandoned)
            raise
        for _ in range(s.hooks.deliveries(call) - 1):
            await s.deliver(spec, call, ctx)
        disposition = _disposition(outcome.state, deduplicated)
        if outcome.state is EffectState.APPLIED:
            reply = await s.hooks.after_effect(
                call,
                ctx,
                pb.InvokeReply(
                    result_json=outcome.result_json, deduplicated=deduplicated, effect_key=call.effect_key
                ),
            )
            if reply is None:
                s.hooks.disposed(token, disposition, "dropped")
                return await self._drop(ctx, context)
            s.hooks.disposed(token, disposition, "answered")
            return reply
        code = outcome.code or grpc.StatusCode.INTERNAL
        s.hooks.disposed(token, disposition, f"error:{code.name}")
        if outcome.retry_after is not None:
            context.set_trailing_metadata(((RETRY_AFTER_KEY, f"{outcome.retry_after:.3f}"),))
        await context.abort(code, outcome.detail)
        raise AssertionError("unreachable: abort raises")

    @staticmethod
    async def _drop(ctx: ToolContext, context: grpc.aio.ServicerContext[Any, Any]) -> pb.InvokeReply:
        # The reply is lost: the caller hears nothing until its deadline (gRPC cancels us then).
        await asyncio.sleep(max(0.0, ctx.time_remaining()) + 1.0)
        await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "reply dropped")
        raise AssertionError("unreachable: abort raises")

    async def Probe(
        self, request: pb.ProbeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ProbeReply:
        await self._spec(request.tool, context)
        effects = self._s.effects
        entry = effects.get(request.tool, request.effect_key)
        fence = effects.fence(request.tool, request.effect_key)
        if entry is None:
            # Nothing arrived yet; fence so a late attempt cannot make "absent" false.
            fence = effects.raise_fence(request.tool, request.effect_key)
            return pb.ProbeReply(state=pb.ESTABLISHED_ABSENT, fence=fence, detail="never received; fenced")
        if entry.state is EffectState.APPLIED:
            return pb.ProbeReply(state=pb.ESTABLISHED, result_json=entry.result_json, fence=fence)
        if entry.state is EffectState.ABSENT:
            return pb.ProbeReply(state=pb.ESTABLISHED_ABSENT, fence=fence, detail=entry.detail)
        return pb.ProbeReply(state=pb.UNKNOWN, fence=fence, detail=f"{entry.state.value}: {entry.detail}")

    async def Cancel(
        self, request: pb.CancelRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.CancelReply:
        await self._spec(request.tool, context)
        effects = self._s.effects
        entry = effects.get(request.tool, request.effect_key)
        if entry is None:
            fence = effects.raise_fence(request.tool, request.effect_key)
            return pb.CancelReply(state=pb.FENCED, fence=fence, detail="never received; fenced")
        if entry.state is EffectState.APPLIED:
            return pb.CancelReply(
                state=pb.ALREADY_APPLIED, fence=effects.fence(request.tool, request.effect_key)
            )
        if entry.state is EffectState.ABSENT:
            fence = effects.raise_fence(request.tool, request.effect_key)
            return pb.CancelReply(state=pb.ALREADY_ABSENT, fence=fence, detail=entry.detail)
        if entry.state is EffectState.IN_FLIGHT and entry.cancellable and entry.task is not None:
            effects.cancel_work(request.tool, request.effect_key)
            outcome = await asyncio.shield(entry.task)
            fence = effects.raise_fence(request.tool, request.effect_key)
            state = pb.ALREADY_APPLIED if outcome.state is EffectState.APPLIED else pb.CANCELLED
            return pb.CancelReply(state=state, fence=fence, detail=outcome.detail)
        return pb.CancelReply(
            state=pb.NOT_CANCELLABLE,
            fence=effects.fence(request.tool, request.effect_key),
            detail=f"{entry.state.value}; probe later",
        )
