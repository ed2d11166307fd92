"""The closed set of inputs a trajectory's decider takes: everything that can happen to a trajectory.

Each input is a frozen value. The interpreter (``actors.interpreter``) makes one from whatever happened —
the actor started, an effect finished, a control message arrived, a timer fired — and hands it to
``runtime.decide(record, input, now)``.

- ``Started``             a new trajectory's first two events (creation, the goal) are durable
- ``Recovered``           an incarnation folded an existing log: whatever was in flight is lost
- ``AdmissionGranted``    the scheduler admitted the requested turn (a grant reserving tokens)
- ``AdmissionDenied``     the scheduler refused the requested turn (the predicate that failed)
- ``ModelReplied``        the model call ended with a reply (stop reason, text, calls, usage, limits)
- ``ModelFailed``         the model call failed: error, 429, reset, malformed stream (partial usage)
- ``ModelCancelled``      the model call was aborted mid-stream on the decider's request
- ``PermitGranted``       a queued call got its dependency guard permit (and sandbox permit)
- ``PermitRefused``       a queued call's permit was refused (breaker open, bulkhead full, deadline)
- ``ToolOutcomeReceived`` a dispatched attempt ended (settlement, outcome class, result or error)
- ``ProbeAnswered``       a result-recovery probe answered (settlement and the recovered result)
- ``ControlReceived``     a verified control message arrived (pause, resume, cancel, kill, approve, ...)
- ``ControlRefused``      the shell refused a control message before the record (signature, role, ...)
- ``TimerDue``            an armed timer came due (locally, or from the cluster's timer service)
- ``ChildFinished``       a child trajectory ended: the evidence its parent read from the child's own log
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TypeAlias

from runtime.delegation import ChildEvidence
from runtime.ports import (
    GuardPermit,
    ModelReply,
    ProbeResult,
    RateLimitInfo,
    SandboxPermit,
    ToolOutcome,
    TurnGrant,
    Usage,
)
from runtime.record import ControlAction, JsonValue

__all__ = [
    "AdmissionDenied",
    "AdmissionGranted",
    "ChildFinished",
    "ControlReceived",
    "ControlRefused",
    "Input",
    "ModelCancelled",
    "ModelFailed",
    "ModelReplied",
    "PermitGranted",
    "PermitRefused",
    "ProbeAnswered",
    "Recovered",
    "Started",
    "TimerDue",
    "ToolOutcomeReceived",
]


@dataclass(frozen=True, slots=True)
class Started:
    """A new trajectory: its creation and its goal are durable; nothing has happened yet."""


@dataclass(frozen=True, slots=True)
class Recovered:
    """An incarnation folded the log of an existing trajectory. Nothing it launched is still running."""


@dataclass(frozen=True, slots=True)
class AdmissionGranted:
    request_id: str
    grant: TurnGrant


@dataclass(frozen=True, slots=True)
class AdmissionDenied:
    request_id: str
    predicate: str  # the scheduler's failing predicate ("deadline", "exceeds_capacity", ...)
    message: str
    retry_after: float | None = None


@dataclass(frozen=True, slots=True)
class ModelReplied:
    grant_id: str
    reply: ModelReply


@dataclass(frozen=True, slots=True)
class ModelFailed:
    """The call failed. ``rate_limited``: the provider said 429 (admission feedback, not a model failure).
    ``usage``: what the adapter saw billed before the failure (streamed chunks), charged like any usage."""

    grant_id: str
    error: str
    retryable: bool = True
    rate_limited: bool = False
    retry_after: float | None = None
    usage: Usage = field(default_factory=Usage)
    rate_limit: RateLimitInfo | None = None


@dataclass(frozen=True, slots=True)
class ModelCancelled:
    grant_id: str
    reason: str
    usage: Usage = field(default_factory=Usage)


@dataclass(frozen=True, slots=True)
class PermitGranted:
    call_id: str
    request_id: str
    guard: GuardPermit | None
    sandbox: SandboxPermit | None = None


@dataclass(frozen=True, slots=True)
class PermitRefused:
    """The permit was refused before anything was sent. ``reason`` names the refusal (``BreakerOpen``,
    ``BulkheadFull``, ``AdmissionRefused``...), ``message`` what the model is told."""

    call_id: str
    request_id: str
    reason: str
    message: str
    retry_after: float | None = None


@dataclass(frozen=True, slots=True)
class ToolOutcomeReceived:
    """One dispatched attempt ended. ``dispatched`` is False when the adapter refused it locally before
    anything was sent (known absent, outside the breaker's window). The permits the attempt held come back
    with it, so they are released exactly once whether or not the result is still wanted."""

    call_id: str
    operation_id: str
    attempt_id: str
    outcome: ToolOutcome
    dispatched: bool = True
    guard: GuardPermit | None = None
    sandbox: SandboxPermit | None = None


@dataclass(frozen=True, slots=True)
class ProbeAnswered:
    operation_id: str
    result: ProbeResult
    request_id: str = ""


@dataclass(frozen=True, slots=True)
class ControlReceived:
    """A control message whose signatures, roles, validity window and freshness the shell verified.

    ``signer_roles`` maps each verified signer to the roles the keyring gives it (approvals need them for
    role coverage); ``payload`` is the message's own payload (an approval's ``call_digest``, an interrupt's
    ``message``)."""

    message_id: str
    action: ControlAction
    issuer: str
    reason: str
    payload: Mapping[str, JsonValue] = field(default_factory=dict)
    signer_roles: Mapping[str, frozenset[str]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ControlRefused:
    """The shell refused a control message before it reached the record (bad signature, wrong role,
    expired, replayed nonce...). It is audited; an unverified message never spends its id."""

    message_id: str
    reason: str
    detail: str = ""


@dataclass(frozen=True, slots=True)
class TimerDue:
    """A timer armed by ``TimerStarted`` came due (the event of the same name records that it fired)."""

    timer_id: str


@dataclass(frozen=True, slots=True)
class ChildFinished:
    """A child trajectory ended (issue 12). ``evidence`` is what the parent's interpreter read from the
    child's durable log; the child's own claim about its work is in it, marked untrusted."""

    child_id: str
    evidence: ChildEvidence


Input: TypeAlias = (
    Started
    | Recovered
    | AdmissionGranted
    | AdmissionDenied
    | ModelReplied
    | ModelFailed
    | ModelCancelled
    | PermitGranted
    | PermitRefused
    | ToolOutcomeReceived
    | ProbeAnswered
    | ControlReceived
    | ControlRefused
    | TimerDue
    | ChildFinished
)
"""Any input of the decider."""
