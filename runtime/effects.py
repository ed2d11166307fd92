"""The closed set of effects a trajectory's decider asks for: everything the interpreter does to the world.

An effect is a command, not a fact: the decider's events say what happened (and are durable before any
effect of the same decision runs); the effects say what to do next. The interpreter (``actors.interpreter``)
carries each out through a port and turns its result into the next input.

Each line: the effect — what the interpreter does — the input its result becomes.

- ``RequestAdmission``  — asks the scheduler to admit the next turn — ``AdmissionGranted``/``AdmissionDenied``
- ``CallModel``         — streams one model call — ``ModelReplied``/``ModelFailed``/``ModelCancelled``
- ``CancelModelStream`` — aborts the model call in flight — (that call's own result)
- ``SettleAdmission``   — settles a grant with the tokens actually used (refund or debit) — none
- ``ReportLimits``      — tells the scheduler what a response said of the provider's limits — none
- ``AcquirePermit``     — the guard's permit, then a sandbox permit — ``PermitGranted``/``PermitRefused``
- ``ReleasePermit``     — releases an attempt's permits; records its outcome in the breaker — none
- ``DispatchTool``      — sends one attempt of a tool call — ``ToolOutcomeReceived``
- ``ProbeTool``         — asks the endpoint what became of an effect key (result recovery) — ``ProbeAnswered``
- ``CancelToolCall``    — asks the endpoint to stop an effect key — none
- ``StartTimer``        — arms a timer (durable kinds also in the cluster's timer store) — ``TimerDue``
- ``CancelTimer``       — disarms a timer — none
- ``KillProcesses``     — kills the trajectory's sandboxed process groups at once — none
- ``Hibernate``         — the actor exits; the record stays in Redis; timers and signals wake it — none
- ``ReleaseLease``      — gives a lease back (a workspace is torn down and removed) — none
- ``PublishEscalation`` — writes an escalation (opened, taken into custody, resolved) to the cluster's
                          escalation registry (``tether escalations``) — none
- ``OpenIncident``      — records an incident this trajectory opened (a disclosure rule) in the incident
                          store (``tether incident``), quarantining what the trajectory produced — none
- ``SpawnChild``        — starts a child trajectory (its own actor) under a delegation contract and waits
                          for it — ``ChildFinished``
- ``CancelChild``       — cancels or kills a child trajectory (the cascade of cancel and kill) — none
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from runtime.delegation import DelegationContract
from runtime.escalation import Escalation
from runtime.ports import (
    GuardPermit,
    ModelRequest,
    OutcomeClass,
    RateLimitInfo,
    SandboxPermit,
    ToolInvocation,
    TurnRequest,
)
from runtime.record import Lease, Timer

__all__ = [
    "AcquirePermit",
    "CallModel",
    "CancelChild",
    "CancelModelStream",
    "CancelTimer",
    "CancelToolCall",
    "DispatchTool",
    "Effect",
    "Hibernate",
    "KillProcesses",
    "OpenIncident",
    "ProbeTool",
    "PublishEscalation",
    "ReleaseLease",
    "ReleasePermit",
    "ReportLimits",
    "RequestAdmission",
    "SettleAdmission",
    "SpawnChild",
    "StartTimer",
]


@dataclass(frozen=True, slots=True)
class RequestAdmission:
    request_id: str
    request: TurnRequest


@dataclass(frozen=True, slots=True)
class CallModel:
    grant_id: str
    request: ModelRequest


@dataclass(frozen=True, slots=True)
class CancelModelStream:
    reason: str


@dataclass(frozen=True, slots=True)
class SettleAdmission:
    grant_id: str
    actual_tokens: int


@dataclass(frozen=True, slots=True)
class ReportLimits:
    provider_key: str
    info: RateLimitInfo
    rate_limited: bool
    grant_id: str | None = None  # the answered call's grant: dates a 429 against its admission


@dataclass(frozen=True, slots=True)
class AcquirePermit:
    """The guard permit of ``scope`` (bulkhead + breaker), then, when ``pool`` is set, a sandbox permit.
    The interpreter releases the guard permit itself if the sandbox permit is refused."""

    call_id: str
    request_id: str
    scope: str
    pool: str | None
    priority_class: str
    deadline: float  # epoch seconds: no permit after it


@dataclass(frozen=True, slots=True)
class ReleasePermit:
    """Release the permits of one attempt. ``outcome`` is recorded in the breaker's window when the attempt
    reached the dependency (None: it was never sent, so it is no observation of the dependency)."""

    guard: GuardPermit | None
    sandbox: SandboxPermit | None
    outcome: OutcomeClass | None


@dataclass(frozen=True, slots=True)
class DispatchTool:
    invocation: ToolInvocation
    guard: GuardPermit | None = None
    sandbox: SandboxPermit | None = None


@dataclass(frozen=True, slots=True)
class ProbeTool:
    operation_id: str
    tool: str
    effect_key: str
    deadline: float
    request_id: str = ""


@dataclass(frozen=True, slots=True)
class CancelToolCall:
    tool: str
    effect_key: str


@dataclass(frozen=True, slots=True)
class StartTimer:
    timer: Timer

    @property
    def durable(self) -> bool:
        return self.timer.kind.durable


@dataclass(frozen=True, slots=True)
class CancelTimer:
    timer: Timer


@dataclass(frozen=True, slots=True)
class KillProcesses:
    reason: str


@dataclass(frozen=True, slots=True)
class Hibernate:
    reason: str


@dataclass(frozen=True, slots=True)
class ReleaseLease:
    lease: Lease


# --------------------------------------------------------------------------- supervision (issue 12)


@dataclass(frozen=True, slots=True)
class PublishEscalation:
    escalation: Escalation


@dataclass(frozen=True, slots=True)
class OpenIncident:
    """An incident this trajectory opened itself. ``member`` is its metadata (``runtime.incident``);
    ``artifacts``: what it produced so far (result digests and ids), to quarantine."""

    incident_id: str
    trajectory_id: str
    symptom: str
    suspected_cause: str
    evidence: Mapping[str, Any] = field(default_factory=dict)
    member: Mapping[str, Any] = field(default_factory=dict)
    artifacts: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class SpawnChild:
    contract: DelegationContract


@dataclass(frozen=True, slots=True)
class CancelChild:
    child_id: str
    kill: bool
    reason: str


Effect: TypeAlias = (
    RequestAdmission
    | CallModel
    | CancelModelStream
    | SettleAdmission
    | ReportLimits
    | AcquirePermit
    | ReleasePermit
    | DispatchTool
    | ProbeTool
    | CancelToolCall
    | StartTimer
    | CancelTimer
    | KillProcesses
    | Hibernate
    | ReleaseLease
    | PublishEscalation
    | OpenIncident
    | SpawnChild
    | CancelChild
)
"""Any effect of the decider."""
