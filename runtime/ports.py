"""Ports: the interfaces through which pure trajectory logic reaches the outside world.

Every adapter (OpenAI-compatible client, gRPC tool client, Redis log store, scheduler actor handle,
guard actor handle) implements one of these; every port has an in-process fake for unit tests.

Time convention: an *absolute deadline* is epoch seconds (``Clock.wall()``), because it crosses
processes and nodes and is persisted in the durable log. Monotonic time (``Clock.now()``) is used only
for local intervals inside one process (bucket refill, breaker cooldown, lease checks).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "AdmissionPort",
    "CancelToken",
    "ForwardingAdmission",
    "GuardPermit",
    "GuardPort",
    "LogStore",
    "ModelPort",
    "ModelReply",
    "ModelRequest",
    "OutcomeClass",
    "ProbeResult",
    "RateLimitInfo",
    "SandboxPermit",
    "Settlement",
    "StopReason",
    "ToolCallProposal",
    "ToolInvocation",
    "ToolOutcome",
    "ToolPort",
    "TurnGrant",
    "TurnRequest",
    "Usage",
]


# --------------------------------------------------------------------------- model


class StopReason(StrEnum):
    """Why a model reply ended, normalised from the provider's finish reason."""

    END_TURN = "end_turn"  # provider "stop"
    MAX_TOKENS = "max_tokens"  # provider "length": never dispatched
    TOOL_USE = "tool_use"  # provider "tool_calls"
    REFUSAL = "refusal"  # provider "content_filter"
    CANCELED = "canceled"  # the harness aborted the stream: never parsed into a call


@dataclass(frozen=True, slots=True)
class Usage:
    """Tokens as the provider reported them. ``uncached_input + cached_input`` is the prompt."""

    uncached_input: int = 0
    cached_input: int = 0
    output: int = 0

    @property
    def prompt(self) -> int:
        return self.uncached_input + self.cached_input

    @property
    def total(self) -> int:
        return self.prompt + self.output

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            self.uncached_input + other.uncached_input,
            self.cached_input + other.cached_input,
            self.output + other.output,
        )


@dataclass(frozen=True, slots=True)
class ToolCallProposal:
    """A tool call as the model proposed it. ``raw_arguments`` is the model's text, unparsed:
    the harness parses and validates it, and never dispatches what does not parse."""

    call_id: str
    tool: str
    raw_arguments: str


@dataclass(frozen=True, slots=True)
class ModelRequest:
    trajectory_id: str
    model: str
    messages: Sequence[Mapping[str, Any]]  # OpenAI chat messages
    max_tokens: int
    deadline: float  # absolute, epoch seconds (already clamped by the trajectory deadline)
    tools: Sequence[Mapping[str, Any]] = ()  # OpenAI tool specs
    metadata: Mapping[str, str] = field(default_factory=dict)  # e.g. testbed scenario selector


@dataclass(frozen=True, slots=True)
class RateLimitInfo:
    """What a provider said about its limits on one response, 429 or not, parsed from its headers.

    Every field is optional: providers and gateways send different subsets (OpenAI ``x-ratelimit-*`` and
    ``retry-after-ms``/``Retry-After``; LiteLLM ``llm_provider-retry-after``; others nothing). Counts are
    per the provider's own window; ``reset_*_s`` are seconds from the response until that count resets.
    ``retry_after_s`` is the server's minimum wait, whichever header carried it (``hint_source`` names it).
    """

    retry_after_s: float | None = None
    limit_requests: float | None = None
    limit_tokens: float | None = None
    remaining_requests: float | None = None
    remaining_tokens: float | None = None
    reset_requests_s: float | None = None
    reset_tokens_s: float | None = None
    hint_source: str | None = None

    @property
    def empty(self) -> bool:
        return all(
            getattr(self, name) is None
            for name in (
                "retry_after_s",
                "limit_requests",
                "limit_tokens",
                "remaining_requests",
                "remaining_tokens",
                "reset_requests_s",
                "reset_tokens_s",
            )
        )

    def remaining(self) -> dict[str, float]:
        """The ``remaining`` counts as the scheduler's ``observe_remaining`` takes them."""
        out: dict[str, float] = {}
        if self.remaining_requests is not None:
            out["requests"] = self.remaining_requests
        if self.remaining_tokens is not None:
            out["tokens"] = self.remaining_tokens
        return out


@dataclass(frozen=True, slots=True)
class ModelReply:
    stop_reason: StopReason
    text: str
    tool_calls: Sequence[ToolCallProposal]
    usage: Usage
    # What the provider said about its limits on this response, if anything.
    rate_limit: RateLimitInfo | None = None
    # True when the provider reported no usage and ``usage`` is the adapter's documented estimate.
    usage_estimated: bool = False


class CancelToken:
    """Set by the harness when a pending cancel, pause or kill must abort the call in flight."""

    def __init__(self) -> None:
        self._event = asyncio.Event()
        self.reason: str | None = None

    def cancel(self, reason: str) -> None:
        self.reason = reason
        self._event.set()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    async def wait(self) -> None:
        await self._event.wait()


@runtime_checkable
class ModelPort(Protocol):
    """Calls a model. Raises ``runtime.errors`` types only:

    - ``ModelCallCancelled`` (carries the ``Usage`` billed before the abort) when ``cancel`` fires;
    - ``ProviderRateLimited`` (``retry_after``) on HTTP 429;
    - ``DependencyError`` for timeouts, connection and 5xx failures (retry decided by the retry owner).
    The adapter never retries by itself.
    """

    async def complete(self, request: ModelRequest, cancel: CancelToken) -> ModelReply: ...


# --------------------------------------------------------------------------- tools


class Settlement(StrEnum):
    """The settlement rule of the recovery chapter: what is known about an effect."""

    ESTABLISHED = "established"
    ESTABLISHED_ABSENT = "established_absent"
    UNKNOWN = "unknown"


class OutcomeClass(StrEnum):
    """How a dispatched call's outcome counts for the dependency's breaker."""

    SUCCESS = "success"
    INFRASTRUCTURE_FAILURE = "infrastructure_failure"  # counts as a failure in the breaker window
    CLIENT_REJECTION = "client_rejection"  # dependency answered "no": a non-failure in the window


@dataclass(frozen=True, slots=True)
class ToolInvocation:
    trajectory_id: str
    call_id: str
    tool: str
    arguments: Mapping[str, Any]  # validated against the tool's schema, canonical
    effect_key: str  # derived from intent, never from attempt or time
    operation_id: str  # logical operation: the same across retries
    attempt_id: str  # fresh per attempt
    deadline: float  # absolute, epoch seconds


@dataclass(frozen=True, slots=True)
class ToolOutcome:
    settlement: Settlement
    outcome_class: OutcomeClass
    result: Any = None  # JSON-compatible payload when established
    error: str | None = None  # what went wrong, for the observation
    retry_after: float | None = None


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """What a result-recovery probe established about one effect key. ``result`` is the endpoint's stored
    reply when ``settlement`` is ESTABLISHED (so a recovered provisioning binds its resource id exactly as
    a delivered reply would); ``detail`` says what the endpoint answered, for the evidence trail."""

    settlement: Settlement
    result: Any = None
    detail: str = ""


@runtime_checkable
class ToolPort(Protocol):
    """Dispatches tool calls to a dependency. Timeouts settle nothing: they return UNKNOWN."""

    async def invoke(self, invocation: ToolInvocation) -> ToolOutcome: ...

    async def probe(self, tool: str, effect_key: str, deadline: float) -> ProbeResult: ...

    async def cancel(self, tool: str, effect_key: str) -> None: ...


# --------------------------------------------------------------------------- durable log


@runtime_checkable
class LogStore(Protocol):
    """Append-only per-trajectory log of encoded events.

    ``append`` returns only after the store has acknowledged the entry durably (intent before effect).
    Entry ids are opaque, strictly increasing per trajectory.
    """

    async def append(self, trajectory_id: str, payload: bytes) -> str: ...

    async def append_many(self, trajectory_id: str, payloads: Sequence[bytes]) -> list[str]:
        """Append in order as one durable batch (all or none); one acknowledgement for the batch."""
        ...

    async def read(self, trajectory_id: str, after: str | None = None) -> list[tuple[str, bytes]]: ...

    async def exists(self, trajectory_id: str) -> bool: ...

    async def trim(self, trajectory_id: str, before: str) -> int:
        """Remove every entry older than the entry ``before`` (which stays); returns how many went. Used
        only after a record snapshot was appended durably at ``before`` (``runtime.snapshot``)."""
        ...


# --------------------------------------------------------------------------- admission (scheduler)


@dataclass(frozen=True, slots=True)
class TurnRequest:
    trajectory_id: str
    priority_class: str  # "interactive" | "standard" | "batch" (configurable)
    provider_key: str  # base URL + model
    estimated_tokens: int  # prompt estimate + max_tokens
    deadline: float  # absolute, epoch seconds: no admission after it


@dataclass(frozen=True, slots=True)
class TurnGrant:
    grant_id: str
    reserved_tokens: int
    lease_expires_at: float  # epoch seconds; an unsettled grant past this is reclaimed


@dataclass(frozen=True, slots=True)
class SandboxPermit:
    permit_id: str
    pool: str
    lease_expires_at: float


@runtime_checkable
class AdmissionPort(Protocol):
    """The scheduler as seen by one trajectory. Refusals raise ``AdmissionRefused`` (a PolicyRefusal)."""

    async def admit_turn(self, request: TurnRequest) -> TurnGrant: ...

    async def settle_turn(self, grant_id: str, actual_tokens: int) -> None: ...

    async def report_rate_limited(
        self, provider_key: str, retry_after: float | None, remaining: Mapping[str, float]
    ) -> None: ...

    async def report_limits(
        self, provider_key: str, info: RateLimitInfo, rate_limited: bool, grant_id: str | None = None
    ) -> None:
        """Admission feedback from one provider response: a 429 (``rate_limited``) and/or the limits its
        headers stated. The scheduler learns the real limit from them (a configured limit may be wrong).
        ``grant_id``: the answered call's grant, so a 429 also tells how late our requests arrive."""
        ...

    async def acquire_sandbox(
        self, trajectory_id: str, pool: str, priority_class: str, deadline: float
    ) -> SandboxPermit: ...

    async def release_sandbox(self, permit_id: str) -> None: ...


class ForwardingAdmission:
    """An :class:`AdmissionPort` that passes every call to ``inner``: the base of wrappers that add to some
    of them (``actors.model_client.AdmitWhenWarm``, a benchmark's trace)."""

    def __init__(self, inner: AdmissionPort) -> None:
        self.inner = inner

    async def admit_turn(self, request: TurnRequest) -> TurnGrant:
        return await self.inner.admit_turn(request)

    async def settle_turn(self, grant_id: str, actual_tokens: int) -> None:
        await self.inner.settle_turn(grant_id, actual_tokens)

    async def report_rate_limited(
        self, provider_key: str, retry_after: float | None, remaining: Mapping[str, float]
    ) -> None:
        await self.inner.report_rate_limited(provider_key, retry_after, remaining)

    async def report_limits(
        self, provider_key: str, info: RateLimitInfo, rate_limited: bool, grant_id: str | None = None
    ) -> None:
        await self.inner.report_limits(provider_key, info, rate_limited, grant_id)

    async def acquire_sandbox(
        self, trajectory_id: str, pool: str, priority_class: str, deadline: float
    ) -> SandboxPermit:
        return await self.inner.acquire_sandbox(trajectory_id, pool, priority_class, deadline)

    async def release_sandbox(self, permit_id: str) -> None:
        await self.inner.release_sandbox(permit_id)


# --------------------------------------------------------------------------- dependency guard


@dataclass(frozen=True, slots=True)
class GuardPermit:
    permit_id: str
    scope: str
    breaker_generation: int
    probe: bool  # True when this call is the single half-open probe


@runtime_checkable
class GuardPort(Protocol):
    """Bulkhead + breaker for one dependency scope. ``admit`` raises ``BreakerOpen`` (scope, cooldown)
    or ``BulkheadFull`` (a PolicyRefusal) instead of queueing forever."""

    async def admit(self, scope: str, call_id: str, deadline: float) -> GuardPermit: ...

    async def record(self, permit: GuardPermit, outcome: OutcomeClass) -> None: ...

    async def release(self, permit: GuardPermit) -> None: ...

    async def settle(self, permit: GuardPermit, outcome: OutcomeClass | None) -> None:
        """``record`` the outcome (when there is one), then ``release``, as one step: a guard actor is
        reached once, not twice. The permit is released even when recording fails."""
        ...
