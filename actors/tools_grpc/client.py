"""``GrpcToolPort``: the trajectory actor's ``ToolPort`` over the ``ToolService`` gRPC protocol.

- Routes each tool name to a service address (``host:port``).
- Sets the gRPC deadline from the invocation's absolute deadline; a deadline already past raises
  ``DeadlinePassed`` and nothing is sent (a local refusal never enters the breaker window).
- Never retries: gRPC's built-in retries are disabled per channel (``grpc.enable_retries=0``); the
  single retry owner in ``breakers/`` decides every further attempt.
- Classifies failures with ``status_map``: DEADLINE_EXCEEDED / UNAVAILABLE after send are UNKNOWN
  (settlement rule: a timeout settles nothing). A connection that could not be made means the request
  was never sent, so that one is established absent.
- Remembers the fence each Probe/Cancel returns per effect key and sends it with later attempts, so
  the server refuses only attempts that were issued before the probe (see ``effects``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from types import TracebackType
from typing import Any

import grpc

from actors.tools_grpc import tether_tools_pb2 as pb
from actors.tools_grpc import tether_tools_pb2_grpc as pb_grpc
from actors.tools_grpc.codec import parse_json, request_from_invocation, settlement_from_probe_state
from actors.tools_grpc.errors import DeadlinePassed, NoToolRoute
from actors.tools_grpc.status_map import classify_status, retry_after_from_metadata
from runtime.clock import Clock, SystemClock
from runtime.errors import CodecError, DependencyError
from runtime.ports import OutcomeClass, Settlement, ToolInvocation, ToolOutcome
from runtime.ports import ProbeResult as PortProbeResult

__all__ = ["CHANNEL_OPTIONS", "CancelResult", "CancelState", "GrpcToolPort", "ProbeResult"]

CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.enable_retries", 0),  # one retry owner: no transparent or configured retries underneath
    # Reconnect quickly after a dependency comes back; how often to *call* is the breaker's business.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # Not "grpc.min_reconnect_backoff_ms": gRPC gives every connection attempt at least that long (its
    # minimum connect timeout, 20 s by default). At 100 ms a server that took longer to send its first
    # HTTP/2 frame (a busy host, a far one) failed the call as "not sent" and counted against the
    # dependency's breaker; now the call's own deadline bounds the connect, and a refused connection still
    # fails at once.
)


_tool_stub: Callable[[grpc.aio.Channel], Any] = pb_grpc.ToolServiceStub


class CancelState(StrEnum):
    """The endpoint's answer to Cancel (cancellation is a request, not proof: see ``detail``)."""

    FENCED = "fenced"
    CANCELLED = "cancelled"
    ALREADY_APPLIED = "already_applied"
    ALREADY_ABSENT = "already_absent"
    NOT_CANCELLABLE = "not_cancellable"


_CANCEL_STATES = {
    pb.FENCED: CancelState.FENCED,
    pb.CANCELLED: CancelState.CANCELLED,
    pb.ALREADY_APPLIED: CancelState.ALREADY_APPLIED,
    pb.ALREADY_ABSENT: CancelState.ALREADY_ABSENT,
    pb.NOT_CANCELLABLE: CancelState.NOT_CANCELLABLE,
}


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """What a Probe established; ``result`` is the stored reply when ``settlement`` is ESTABLISHED."""

    settlement: Settlement
    result: Any = None
    fence: int = 0
    detail: str = ""


@dataclass(frozen=True, slots=True)
class CancelResult:
    state: CancelState
    fence: int = 0
    detail: str = ""


class GrpcToolPort:
    """``runtime.ports.ToolPort`` over gRPC.

    ``routes`` maps tool name -> ``host:port``; ``default_address`` serves tools not in it (``None``:
    an unrouted tool raises ``NoToolRoute``). Channels open lazily on the running loop; call
    ``close()`` (or use ``async with``) when done.
    """

    def __init__(
        self,
        routes: Mapping[str, str],
        *,
        default_address: str | None = None,
        clock: Clock | None = None,
        cancel_timeout_s: float = 5.0,
        channel_options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        self._routes = dict(routes)
        self._default = default_address
        self._clock: Clock = clock or SystemClock()
        self._cancel_timeout_s = cancel_timeout_s
        self._options = (*CHANNEL_OPTIONS, *channel_options)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._fences: dict[tuple[str, str], int] = {}

    def address_for(self, tool: str) -> str:
        """The service address that hosts ``tool``."""
        address = self._routes.get(tool, self._default)
        if address is None:
            raise NoToolRoute(tool, list(self._routes))
        return address

    def _stub(self, address: str) -> tuple[grpc.aio.Channel, Any]:
        channel = self._channels.get(address)
        if channel is None:
            channel = grpc.aio.insecure_channel(address, options=list(self._options))
            self._channels[address] = channel
        return channel, _tool_stub(channel)

    def _remaining(self, tool: str, deadline: float) -> float:
        remaining = deadline - self._clock.wall()
        if remaining <= 0:
            raise DeadlinePassed(tool, -remaining)
        return remaining

    # ------------------------------------------------------------------ ToolPort

    async def invoke(self, invocation: ToolInvocation) -> ToolOutcome:
        """One attempt of ``invocation``; never retried here."""
        tool = invocation.tool
        address = self.address_for(tool)
        remaining = self._remaining(tool, invocation.deadline)
        request = request_from_invocation(
            invocation, fence=self._fences.get((tool, invocation.effect_key), 0)
        )
        channel, stub = self._stub(address)
        if not await _connected(channel, remaining):
            # Nothing crossed the wire: absence is established, but the dependency is unhealthy.
            return ToolOutcome(
                settlement=Settlement.ESTABLISHED_ABSENT,
                outcome_class=OutcomeClass.INFRASTRUCTURE_FAILURE,
                error=f"UNAVAILABLE: could not connect to {address} for {tool!r}; not sent",
            )
        remaining = invocation.deadline - self._clock.wall()
        if remaining <= 0:
            return ToolOutcome(
                settlement=Settlement.ESTABLISHED_ABSENT,
                outcome_class=OutcomeClass.INFRASTRUCTURE_FAILURE,
                error=f"DEADLINE_EXCEEDED: connecting to {address} used the whole deadline; not sent",
            )
        try:
            reply: pb.InvokeReply = await stub.Invoke(request, timeout=remaining)
        except grpc.aio.AioRpcError as e:
            return classify_status(
                e.code(), e.details(), retry_after=retry_after_from_metadata(e.trailing_metadata())
            )
        try:
            result = parse_json(reply.result_json, where=f"{tool} reply")
        except CodecError as e:
            # The endpoint says it applied the effect but its result is unreadable: probe to recover it.
            return ToolOutcome(
                settlement=Settlement.UNKNOWN,
                outcome_class=OutcomeClass.INFRASTRUCTURE_FAILURE,
                error=str(e),
            )
        return ToolOutcome(
            settlement=Settlement.ESTABLISHED, outcome_class=OutcomeClass.SUCCESS, result=result
        )

    async def probe(self, tool: str, effect_key: str, deadline: float) -> PortProbeResult:
        """The endpoint's evidence about ``effect_key`` with the recovered result; a failed probe settles
        nothing (UNKNOWN)."""
        found = await self.probe_result(tool, effect_key, deadline)
        return PortProbeResult(found.settlement, found.result, found.detail)

    async def probe_result(self, tool: str, effect_key: str, deadline: float) -> ProbeResult:
        """Like ``probe`` but with the recovered result, the fence and the endpoint's detail."""
        address = self.address_for(tool)
        remaining = self._remaining(tool, deadline)
        _, stub = self._stub(address)
        try:
            reply: pb.ProbeReply = await stub.Probe(
                pb.ProbeRequest(tool=tool, effect_key=effect_key), timeout=remaining
            )
        except grpc.aio.AioRpcError as e:
            return ProbeResult(Settlement.UNKNOWN, detail=f"probe failed: {e.code().name}: {e.details()}")
        self._remember_fence(tool, effect_key, reply.fence)
        settlement = settlement_from_probe_state(reply.state)
        result: Any = None
        if settlement is Settlement.ESTABLISHED:
            try:
                result = parse_json(reply.result_json, where=f"{tool} probe reply")
            except CodecError as e:
                return ProbeResult(settlement, None, reply.fence, f"established; result unreadable: {e}")
        return ProbeResult(settlement, result, reply.fence, reply.detail)

    async def cancel(self, tool: str, effect_key: str) -> None:
        """Ask the endpoint to stop ``effect_key``; raises ``DependencyError`` if it could not be asked."""
        await self.cancel_result(tool, effect_key)

    async def cancel_result(self, tool: str, effect_key: str) -> CancelResult:
        """Like ``cancel`` but returns the endpoint's answer."""
        address = self.address_for(tool)
        _, stub = self._stub(address)
        try:
            reply: pb.CancelReply = await stub.Cancel(
                pb.CancelRequest(tool=tool, effect_key=effect_key), timeout=self._cancel_timeout_s
            )
        except grpc.aio.AioRpcError as e:
            raise DependencyError(
                f"cancel of {tool!r} effect {effect_key!r} at {address} failed: "
                f"{e.code().name}: {e.details()}",
                scope=address,
            ) from e
        self._remember_fence(tool, effect_key, reply.fence)
        return CancelResult(
            _CANCEL_STATES.get(reply.state, CancelState.NOT_CANCELLABLE), reply.fence, reply.detail
        )

    def _remember_fence(self, tool: str, effect_key: str, fence: int) -> None:
        key = (tool, effect_key)
        self._fences[key] = max(self._fences.get(key, 0), fence)

    # ------------------------------------------------------------------ lifecycle

    async def close(self) -> None:
        """Close every channel."""
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()

    async def __aenter__(self) -> GrpcToolPort:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


async def _connected(channel: grpc.aio.Channel, timeout: float) -> bool:
    """Whether ``channel`` is connected (connecting now if idle) within ``timeout``.

    A channel that fails to connect reports TRANSIENT_FAILURE quickly; treating that as "not sent"
    lets an unreachable dependency fail fast instead of consuming the whole deadline.
    """
    loop = asyncio.get_running_loop()
    give_up = loop.time() + timeout
    state = channel.get_state(try_to_connect=True)
    while state is not grpc.ChannelConnectivity.READY:
        if state in (grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.SHUTDOWN):
            return False
        left = give_up - loop.time()
        if left <= 0:
            return False
        try:
            await asyncio.wait_for(channel.wait_for_state_change(state), left)
        except TimeoutError:
            return False
        state = channel.get_state(try_to_connect=True)
    return True
