"""Trajectory events: every change to the record is one of these, appended to the log before its effect.

Each event is a frozen dataclass with a ``kind`` tag (its name in the log). ``runtime.fold.apply`` is the
single place an event changes the record, and it refuses (``IllegalEvent`` / ``IllegalTransition``) any
event whose guard fails, before anything is written. The trajectory id is not repeated per event: a log
belongs to one trajectory.

Lifecycle
  ``TrajectoryCreated``   identity, task contract, limits, ceilings, grants, pointers (first event only;
                          a retry is a new trajectory whose ``parent_id`` names the old one)
  ``StateChanged``        the only way ``state`` changes; ``exit_reason`` is given on entering FINALIZING,
                          ``approval_digest`` on leaving AWAITING_APPROVAL for dispatch
  ``CompletionChecked``   the externally evaluated completion check's verdict (FINALIZING only)
Model calls
  ``TurnStarted``         turn ``n`` begins (READY): counts one turn against the budget
  ``ModelCallIntent``     the admitted call is about to be sent (scheduler grant, ``max_tokens``, deadline)
  ``ModelCallSettled``    the reply ended with a stop reason; provider usage and its price are charged
  ``ModelCallCancelled``  the harness aborted the stream; billed usage is still charged, nothing is parsed
  ``ModelCallFailed``     error or timeout; any billed usage is charged (``rate_limited``: a 429, which is
                          admission feedback: no failure counted, and the turn is given back)
  ``TurnRequested``       the next turn asked the scheduler for admission (request id, estimate)
  ``TurnAbandoned``       that request no longer stands (refused, superseded by control, actor restarted)
  ``ObservationAppended`` something the harness chose to put in the context (user/interrupt message, the
                          model's reply, a notice, a refusal for a call id, an error)
Tools and approval
  ``CallObserved``        a proposed call as the watchdog saw it (fingerprints), valid or not
  ``ToolCallHeld``        an irreversible call goes to escrow (call, digest, expiry, quorum, roles)
  ``ApprovalVoted``       one verified approval of the held digest (approvals accumulate to the quorum)
  ``ApprovalDecided``     approved / denied / expired, with the issuers that formed the decision
  ``ApprovalRechecked``   the pre-dispatch re-check (digest, preconditions, grant, budget) passed or not
  ``ToolCallQueued``      an accepted call waits to be sent: for its permits, a retry backoff or a probe
  ``ToolCallWithdrawn``   a queued call will not be sent (stop requested, breaker open, not admitted)
  ``ToolDispatchIntent``  intent before effect: call, effect key, operation and attempt ids, deadline,
                          bounded liability, compensation template, repeat contract, approval digest,
                          the permits it holds
  ``ToolJobStarted``      a long-running call returned a job handle
  ``ToolResultAccepted``  a result for a still-pending call in WAITING_TOOL: settles the operation
  ``ToolCallTimedOut``    the deadline passed: the id leaves the pending set (this event is the timeout
                          observation, so a later result finds no pending id); the operation is in doubt
  ``ToolCallCancelled``   cancellation was requested (finalizing, kill): same effect on the operation
  ``OperationMarkedInDoubt`` / ``OperationSettled``  settlement machinery: owner, then correlated evidence
Control and audit
  ``ControlRequested`` / ``ControlApplied``  recorded on arrival, applied at a turn boundary
  ``ControlRejected``     audit: a message refused (forged, replayed, expired, terminal trajectory, ...)
Timers
  ``TimerStarted`` / ``TimerFired`` / ``TimerCancelled``  a timer armed, fired (an input), or disarmed
Obligations, cleanup and handoff (``runtime.obligations``)
  ``ObligationRegistered`` a compensation template, logged with the forward call's intent (before dispatch)
  ``ObligationBound``     correlated evidence bound the template's target (e.g. the created env id)
  ``ObligationUpdated``   its state moved (admitting, running, verifying, discharged, stuck, handed off...)
                          with the evidence that moved it
  ``CleanupDispatched`` / ``CleanupSettled``  the compensation's own operation: intent, then its outcome
  ``HandoffWritten``      the handoff packet (goal, what was done, what is pending, why it stopped, ...)
  ``OperatorActed``       an operator settled or handed off an operation or obligation (signed, audited)
  ``RepairEpisodeChanged`` a repair episode opened, counted an admitted attempt, closed or was exhausted
  ``CandidateRevised``    a tool that revises the candidate had an effect (or an unknown one): a new revision
  ``CandidateChecked``    a check's verdict, scoped to the revision it checked
  ``LateResultDropped``   audit: a result for a call that is not pending (never an accepted result)
Budget, grants, pointers
  ``BudgetCharged``       additive charge per dimension (tool charges, sandbox seconds, ...)
  ``WallClockMeasured``   elapsed wall-clock seconds (a gauge, never decreasing)
  ``BudgetStageChanged``  rho, its stage and the binding dimension after an assessment
  ``GrantNarrowed``       the grant shrinks (restrict stage, escalation); it never widens
  ``LeaseAcquired`` / ``LeaseReleased``  workspace, credential and sandbox leases
  ``PointerMoved``        context / workspace / snapshot / plan reference changed
Supervision (issue 12)
  ``HoldPlaced`` / ``HoldReleased``  the one hold flag (watchdog, control, incident) set and lifted
  ``WatchdogFired``       a detector fired; the ladder's answer (inform, constrain, hold) and the evidence
  ``ProgressObserved``    the declared task state's digest after a turn (turn-level detectors)
  ``CallWithheld``        supervision withheld a proposed call before dispatch
  ``EscalationOpened`` / ``EscalationAcknowledged`` / ``EscalationResolved``  owner, SLA, custody
  ``IncidentOpened``      this trajectory opened an incident (a disclosure rule)
  ``RungChanged``         the degradation ladder moved the trajectory down a rung
  ``ChildSpawned`` / ``ChildSettled`` / ``ChildCancelled``  delegation to child trajectories
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import ClassVar, TypeAlias

from runtime.budget import BudgetStage
from runtime.degradation import Rung
from runtime.incident import HoldKind
from runtime.obligations import ObligationState
from runtime.ports import (
    GuardPermit,
    OutcomeClass,
    SandboxPermit,
    Settlement,
    StopReason,
    ToolCallProposal,
    Usage,
)
from runtime.record import (
    ApprovalDecision,
    CallLimits,
    ControlAction,
    Grants,
    JsonValue,
    LeaseKind,
    QueueStage,
    TaskContract,
    TimerKind,
)
from runtime.repair import EpisodeState, RepairChoice
from runtime.states import ExitReason, TrajectoryState

__all__ = [
    "EVENT_TYPES",
    "ApprovalDecided",
    "ApprovalRechecked",
    "ApprovalVoted",
    "BudgetCharged",
    "BudgetStageChanged",
    "CallObserved",
    "CallWithheld",
    "CandidateChecked",
    "CandidateRevised",
    "ChildCancelled",
    "ChildSettled",
    "ChildSpawned",
    "CleanupDispatched",
    "CleanupSettled",
    "CompletionChecked",
    "ControlApplied",
    "ControlRejected",
    "ControlRequested",
    "EscalationAcknowledged",
    "EscalationOpened",
    "EscalationResolved",
    "Event",
    "GrantNarrowed",
    "HandoffWritten",
    "HoldPlaced",
    "HoldReleased",
    "IncidentOpened",
    "LateResultDropped",
    "LeaseAcquired",
    "LeaseReleased",
    "ModelCallCancelled",
    "ModelCallFailed",
    "ModelCallIntent",
    "ModelCallSettled",
    "ObligationBound",
    "ObligationRegistered",
    "ObligationUpdated",
    "ObservationAppended",
    "ObservationKind",
    "OperationMarkedInDoubt",
    "OperationSettled",
    "OperatorActed",
    "PointerMoved",
    "PointerName",
    "ProgressObserved",
    "RepairEpisodeChanged",
    "RungChanged",
    "StateChanged",
    "TimerCancelled",
    "TimerFired",
    "TimerStarted",
    "ToolCallCancelled",
    "ToolCallHeld",
    "ToolCallQueued",
    "ToolCallTimedOut",
    "ToolCallWithdrawn",
    "ToolDispatchIntent",
    "ToolJobStarted",
    "ToolResultAccepted",
    "TrajectoryCreated",
    "TurnAbandoned",
    "TurnRequested",
    "TurnStarted",
    "WallClockMeasured",
    "WatchdogFired",
]


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _id(value: str, name: str) -> None:
    _check(value != "", f"{name} must be non-empty")


def _amount(value: float, name: str) -> None:
    _check(math.isfinite(value) and value >= 0, f"{name} must be finite and >= 0, got {value!r}")


def _time(value: float, name: str) -> None:
    _check(math.isfinite(value), f"{name} must be finite, got {value!r}")


def _usage(usage: Usage) -> None:
    for name in ("uncached_input", "cached_input", "output"):
        _check(getattr(usage, name) >= 0, f"usage.{name} must be >= 0")


class ObservationKind(StrEnum):
    """What an appended observation is. Tool results and timeouts are not observations of their own:
    ``ToolResultAccepted`` and ``ToolCallTimedOut`` are, so no unguarded path can append a result."""

    USER = "user"  # the task, or an interrupt's message
    ASSISTANT = "assistant"  # the model's reply (text and proposed calls), as the harness parsed it
    NOTICE = "notice"  # budget notice, truncation notice, other harness notices
    REFUSAL = "refusal"  # structured refusal for a held or rejected call (``call_id`` set)
    ERROR = "error"  # a model or tool error the next call should see


class PointerName(StrEnum):
    CONTEXT = "context"
    WORKSPACE = "workspace"
    WORKSPACE_SNAPSHOT = "workspace_snapshot"
    PLAN = "plan"


# --------------------------------------------------------------------------- lifecycle


@dataclass(frozen=True, slots=True)
class TrajectoryCreated:
    kind: ClassVar[str] = "trajectory_created"
    trajectory_id: str
    parent_id: str | None
    tenant: str
    contract: TaskContract
    limits: CallLimits
    ceilings: Mapping[str, float]
    grants: Grants
    priority_class: str
    created_at: float
    deadline: float | None
    context_ref: str
    workspace_ref: str | None = None

    def __post_init__(self) -> None:
        _id(self.trajectory_id, "trajectory_id")
        _check(self.parent_id != self.trajectory_id, "a trajectory cannot be its own parent")
        _id(self.tenant, "tenant")
        _id(self.priority_class, "priority_class")
        _id(self.context_ref, "context_ref")
        _time(self.created_at, "created_at")
        if self.deadline is not None:
            _time(self.deadline, "deadline")
        _check(bool(self.ceilings), "at least one budget ceiling is required")
        for dim, limit in self.ceilings.items():
            _id(dim, "ceilings key")
            _check(math.isfinite(limit) and limit > 0, f"ceilings.{dim} must be finite and > 0")


@dataclass(frozen=True, slots=True)
class StateChanged:
    kind: ClassVar[str] = "state_changed"
    from_state: TrajectoryState
    to_state: TrajectoryState
    reason: str
    exit_reason: ExitReason | None = None
    approval_digest: str | None = None


@dataclass(frozen=True, slots=True)
class CompletionChecked:
    kind: ClassVar[str] = "completion_checked"
    check: str
    passed: bool
    detail: str = ""


# --------------------------------------------------------------------------- model calls


@dataclass(frozen=True, slots=True)
class TurnRequested:
    kind: ClassVar[str] = "turn_requested"
    request_id: str
    estimated_tokens: int  # prompt estimate + max_tokens: what admission reserves
    max_tokens: int
    prompt_tokens: int  # what admission reserves for the prompt (anchored to the provider's last count)
    prompt_basis: int = 0  # the prompt's plain character estimate, that reservation's starting point

    def __post_init__(self) -> None:
        _id(self.request_id, "request_id")
        _check(self.max_tokens > 0, "max_tokens must be > 0")
        _check(self.prompt_tokens >= 0, "prompt_tokens must be >= 0")
        _check(self.prompt_basis >= 0, "prompt_basis must be >= 0")
        _check(self.estimated_tokens >= self.max_tokens, "the estimate includes max_tokens")


@dataclass(frozen=True, slots=True)
class TurnAbandoned:
    kind: ClassVar[str] = "turn_abandoned"
    request_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class TurnStarted:
    kind: ClassVar[str] = "turn_started"
    turn: int

    def __post_init__(self) -> None:
        _check(self.turn >= 1, "turn must be >= 1")


@dataclass(frozen=True, slots=True)
class ModelCallIntent:
    kind: ClassVar[str] = "model_call_intent"
    grant_id: str
    model: str
    max_tokens: int
    deadline: float
    prompt_tokens: int = 0  # the admission estimate; charged with max_tokens if the reply is lost
    prompt_basis: int = 0  # the plain character estimate; the provider's count of this prompt anchors

    def __post_init__(self) -> None:
        _id(self.grant_id, "grant_id")
        _id(self.model, "model")
        _check(self.max_tokens > 0, "max_tokens must be > 0")
        _check(self.prompt_tokens >= 0, "prompt_tokens must be >= 0")
        _check(self.prompt_basis >= 0, "prompt_basis must be >= 0")
        _time(self.deadline, "deadline")


@dataclass(frozen=True, slots=True)
class ModelCallSettled:
    kind: ClassVar[str] = "model_call_settled"
    stop_reason: StopReason
    usage: Usage
    dollars: float
    usage_estimated: bool = False  # the provider reported no usage: metered from the adapter's estimate

    def __post_init__(self) -> None:
        _check(self.stop_reason is not StopReason.CANCELED, "an aborted stream is ModelCallCancelled")
        _usage(self.usage)
        _amount(self.dollars, "dollars")

    @property
    def counted_prompt(self) -> int:
        """The provider's own count of the call's prompt; 0 when it reported none (an estimate is not one)."""
        return 0 if self.usage_estimated else self.usage.prompt


@dataclass(frozen=True, slots=True)
class ModelCallCancelled:
    kind: ClassVar[str] = "model_call_cancelled"
    reason: str
    usage: Usage
    dollars: float

    def __post_init__(self) -> None:
        _usage(self.usage)
        _amount(self.dollars, "dollars")


@dataclass(frozen=True, slots=True)
class ModelCallFailed:
    kind: ClassVar[str] = "model_call_failed"
    error: str
    retryable: bool
    usage: Usage = field(default_factory=Usage)
    dollars: float = 0.0
    rate_limited: bool = False

    def __post_init__(self) -> None:
        _usage(self.usage)
        _amount(self.dollars, "dollars")


@dataclass(frozen=True, slots=True)
class ObservationAppended:
    kind: ClassVar[str] = "observation_appended"
    observation: ObservationKind
    content: str
    call_id: str | None = None
    tool_calls: tuple[ToolCallProposal, ...] = ()

    def __post_init__(self) -> None:
        _check(
            not self.tool_calls or self.observation is ObservationKind.ASSISTANT,
            "only an assistant observation carries proposed tool calls",
        )
        _check(
            (self.call_id is not None) == (self.observation is ObservationKind.REFUSAL),
            "call_id is set exactly on refusal observations",
        )


# --------------------------------------------------------------------------- tools and approval


@dataclass(frozen=True, slots=True)
class CallObserved:
    """A proposed call as the watchdog saw it, before anything else happened to it: fingerprints of the
    exact call and of its (tool, target) pair, the task-state digest when one is captured. Locally rejected
    calls are observed too: an invalid call repeated every turn is a loop like any other."""

    kind: ClassVar[str] = "call_observed"
    call_id: str
    tool: str
    call_fingerprint: str
    coarse_fingerprint: str | None = None
    state_digest: str | None = None
    waiting_on_job: bool = False
    fired: str | None = None  # the detector that fired on this step (evidence; the step is recorded anyway)


@dataclass(frozen=True, slots=True)
class ToolCallHeld:
    kind: ClassVar[str] = "tool_call_held"
    call_id: str
    tool: str
    arguments: Mapping[str, JsonValue]
    digest: str
    expires_at: float
    preconditions: Mapping[str, JsonValue] = field(default_factory=dict)
    requested_at: float = 0.0
    quorum: int = 1
    required_roles: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        _id(self.call_id, "call_id")
        _id(self.tool, "tool")
        _id(self.digest, "digest")
        _time(self.expires_at, "expires_at")
        _time(self.requested_at, "requested_at")
        _check(self.quorum >= 1, "quorum must be >= 1")


@dataclass(frozen=True, slots=True)
class ApprovalVoted:
    kind: ClassVar[str] = "approval_voted"
    digest: str
    issuer: str
    roles: frozenset[str]
    at: float

    def __post_init__(self) -> None:
        _id(self.issuer, "issuer")
        _time(self.at, "at")


@dataclass(frozen=True, slots=True)
class ApprovalDecided:
    kind: ClassVar[str] = "approval_decided"
    digest: str
    decision: ApprovalDecision
    issuers: tuple[str, ...]
    reason: str
    decided_at: float

    def __post_init__(self) -> None:
        _time(self.decided_at, "decided_at")
        _check(len(set(self.issuers)) == len(self.issuers), "issuers must be distinct identities")
        _check(
            self.decision is not ApprovalDecision.APPROVED or bool(self.issuers),
            "an approval names at least one issuer",
        )


@dataclass(frozen=True, slots=True)
class ApprovalRechecked:
    kind: ClassVar[str] = "approval_rechecked"
    digest: str
    passed: bool
    failed_check: str | None
    at: float

    def __post_init__(self) -> None:
        _time(self.at, "at")
        _check(
            self.passed == (self.failed_check is None), "failed_check is set exactly when the check failed"
        )


@dataclass(frozen=True, slots=True)
class ToolCallQueued:
    kind: ClassVar[str] = "tool_call_queued"
    call_id: str
    tool: str
    arguments: Mapping[str, JsonValue]
    stage: QueueStage
    request_id: str
    operation_id: str | None = None
    approval_digest: str | None = None

    def __post_init__(self) -> None:
        for name in ("call_id", "tool", "request_id"):
            _id(getattr(self, name), name)


@dataclass(frozen=True, slots=True)
class ToolCallWithdrawn:
    kind: ClassVar[str] = "tool_call_withdrawn"
    call_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class ToolDispatchIntent:
    kind: ClassVar[str] = "tool_dispatch_intent"
    call_id: str
    tool: str
    arguments: Mapping[str, JsonValue]
    effect_key: str
    operation_id: str
    attempt_id: str
    deadline: float
    liability: float = 0.0
    compensation: str | None = None
    repeat_safe: bool = False
    approval_digest: str | None = None
    guard_permit: GuardPermit | None = None
    sandbox_permit: SandboxPermit | None = None
    at: float = 0.0  # when the attempt was decided (epoch seconds): how long an unknown outcome has waited

    def __post_init__(self) -> None:
        for name in ("call_id", "tool", "effect_key", "operation_id", "attempt_id"):
            _id(getattr(self, name), name)
        _time(self.deadline, "deadline")
        _amount(self.liability, "liability")


@dataclass(frozen=True, slots=True)
class ToolJobStarted:
    kind: ClassVar[str] = "tool_job_started"
    call_id: str
    job_handle: str

    def __post_init__(self) -> None:
        _id(self.job_handle, "job_handle")


@dataclass(frozen=True, slots=True)
class ToolResultAccepted:
    kind: ClassVar[str] = "tool_result_accepted"
    call_id: str
    settlement: Settlement
    outcome_class: OutcomeClass
    result: JsonValue
    error: str | None
    charge: float = 0.0

    def __post_init__(self) -> None:
        _amount(self.charge, "charge")


@dataclass(frozen=True, slots=True)
class ToolCallTimedOut:
    kind: ClassVar[str] = "tool_call_timed_out"
    call_id: str


@dataclass(frozen=True, slots=True)
class ToolCallCancelled:
    kind: ClassVar[str] = "tool_call_cancelled"
    call_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class OperationMarkedInDoubt:
    kind: ClassVar[str] = "operation_marked_in_doubt"
    operation_id: str
    reason: str
    owner: str

    def __post_init__(self) -> None:
        _id(self.owner, "owner")


@dataclass(frozen=True, slots=True)
class OperationSettled:
    """Correlated evidence settled an operation: a late reply, a probe (``result``: the endpoint's stored
    reply, so a recovered provisioning binds its resource), or an operator (``by_operator``: accepted as
    their word, recorded as such)."""

    kind: ClassVar[str] = "operation_settled"
    operation_id: str
    settlement: Settlement
    evidence: str
    result: JsonValue = None
    call_id: str | None = None  # the model's call it answers (so its context shows the recovered result)
    by_operator: bool = False

    def __post_init__(self) -> None:
        _check(self.settlement is not Settlement.UNKNOWN, "only evidence of an outcome settles an operation")
        _id(self.evidence, "evidence")


# --------------------------------------------------------------------------- control and audit


@dataclass(frozen=True, slots=True)
class ControlRequested:
    kind: ClassVar[str] = "control_requested"
    message_id: str
    action: ControlAction
    issuer: str
    reason: str
    payload: Mapping[str, JsonValue] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _id(self.message_id, "message_id")
        _id(self.issuer, "issuer")


@dataclass(frozen=True, slots=True)
class ControlApplied:
    """A recorded request was applied, or (``refused`` set) recorded and then refused when applied: an
    approval naming a stale digest is audited and changes nothing else."""

    kind: ClassVar[str] = "control_applied"
    message_id: str
    refused: str | None = None
    detail: str = ""


@dataclass(frozen=True, slots=True)
class ControlRejected:
    """Audit of a refused control message. ``verified`` marks a message whose signature checked out but
    which could not apply (the trajectory had ended): only such a message spends its id. An unverified
    refusal (bad signature, unknown key, ...) never does: a tampered copy cannot pre-empt the genuine one."""

    kind: ClassVar[str] = "control_rejected"
    message_id: str
    reason: str
    detail: str = ""
    verified: bool = False

    def __post_init__(self) -> None:
        _id(self.message_id, "message_id")
        _id(self.reason, "reason")


@dataclass(frozen=True, slots=True)
class LateResultDropped:
    kind: ClassVar[str] = "late_result_dropped"
    call_id: str
    reason: str

    def __post_init__(self) -> None:
        _id(self.reason, "reason")


# --------------------------------------------------------------------------- timers


@dataclass(frozen=True, slots=True)
class TimerStarted:
    kind: ClassVar[str] = "timer_started"
    timer_id: str
    timer_kind: TimerKind
    due_at: float
    subject: str = ""

    def __post_init__(self) -> None:
        _id(self.timer_id, "timer_id")
        _check(not any(c.isspace() for c in self.timer_id), "timer_id must not contain spaces")
        _time(self.due_at, "due_at")


@dataclass(frozen=True, slots=True)
class TimerFired:
    kind: ClassVar[str] = "timer_fired"
    timer_id: str


@dataclass(frozen=True, slots=True)
class TimerCancelled:
    kind: ClassVar[str] = "timer_cancelled"
    timer_id: str


# --------------------------------------------------------------------------- obligations and handoff


@dataclass(frozen=True, slots=True)
class ObligationRegistered:
    kind: ClassVar[str] = "obligation_registered"
    obligation_id: str
    operation_id: str
    forward_tool: str
    tool: str
    arguments: Mapping[str, JsonValue]
    unbound: tuple[str, ...] = ()
    after: tuple[str, ...] = ()
    on_completion: bool = False
    postcondition: Mapping[str, JsonValue] = field(default_factory=dict)
    duty: str = "compensation"  # or "outbox": a pivot's follow-up duty
    at: float = 0.0  # when it was registered (epoch seconds)

    def __post_init__(self) -> None:
        for name in ("obligation_id", "operation_id", "forward_tool", "tool"):
            _id(getattr(self, name), name)


@dataclass(frozen=True, slots=True)
class ObligationBound:
    kind: ClassVar[str] = "obligation_bound"
    obligation_id: str
    arguments: Mapping[str, JsonValue]
    resource: str
    evidence: str


@dataclass(frozen=True, slots=True)
class ObligationUpdated:
    kind: ClassVar[str] = "obligation_updated"
    obligation_id: str
    state: ObligationState
    evidence: str
    owner: str = ""
    request_id: str | None = None
    accepted_risk: bool = False

    def __post_init__(self) -> None:
        _id(self.evidence, "evidence")


@dataclass(frozen=True, slots=True)
class CleanupDispatched:
    kind: ClassVar[str] = "cleanup_dispatched"
    obligation_id: str
    operation_id: str
    attempt_id: str
    effect_key: str
    tool: str
    arguments: Mapping[str, JsonValue]
    deadline: float
    guard_permit: GuardPermit | None = None
    sandbox_permit: SandboxPermit | None = None

    def __post_init__(self) -> None:
        for name in ("obligation_id", "operation_id", "attempt_id", "effect_key", "tool"):
            _id(getattr(self, name), name)
        _time(self.deadline, "deadline")


@dataclass(frozen=True, slots=True)
class CleanupSettled:
    kind: ClassVar[str] = "cleanup_settled"
    obligation_id: str
    settlement: Settlement
    outcome_class: OutcomeClass
    result: JsonValue = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class HandoffWritten:
    kind: ClassVar[str] = "handoff_written"
    packet: Mapping[str, JsonValue]


@dataclass(frozen=True, slots=True)
class OperatorActed:
    """An operator's signed decision about an effect (``tether settle``, ``tether handoff``), applied
    whatever state the trajectory is in (obligations outlive the loop)."""

    kind: ClassVar[str] = "operator_acted"
    message_id: str
    action: ControlAction
    issuer: str
    target: str
    detail: str = ""

    def __post_init__(self) -> None:
        _id(self.message_id, "message_id")
        _id(self.issuer, "issuer")


@dataclass(frozen=True, slots=True)
class RepairEpisodeChanged:
    kind: ClassVar[str] = "repair_episode_changed"
    tool: str
    episode_id: str
    state: EpisodeState
    attempts: int
    cap: int
    choice: RepairChoice
    reason: str

    def __post_init__(self) -> None:
        _check(self.attempts >= 0 and self.cap >= 0, "attempts and cap are >= 0")


@dataclass(frozen=True, slots=True)
class CandidateRevised:
    """The operation ``operation_id`` of a tool that revises the candidate took effect (``in_doubt``: its
    outcome is unknown): revision ``revision`` begins, and no earlier check speaks for it."""

    kind: ClassVar[str] = "candidate_revised"
    revision: int
    operation_id: str
    tool: str
    in_doubt: bool = False

    def __post_init__(self) -> None:
        _check(self.revision >= 1, "revision 0 is the candidate as given; a revision made by a tool is >= 1")
        _id(self.operation_id, "operation_id")


@dataclass(frozen=True, slots=True)
class CandidateChecked:
    """A check's verdict on revision ``revision`` (the one current when its result arrived)."""

    kind: ClassVar[str] = "candidate_checked"
    revision: int
    operation_id: str
    tool: str
    passed: bool
    detail: str
    call_id: str | None = None

    def __post_init__(self) -> None:
        _check(self.revision >= 0, "revisions are numbered from 0")
        _id(self.operation_id, "operation_id")


# --------------------------------------------------------------------------- budget, grants, pointers


@dataclass(frozen=True, slots=True)
class BudgetCharged:
    kind: ClassVar[str] = "budget_charged"
    amounts: Mapping[str, float]
    cause: str

    def __post_init__(self) -> None:
        for dim, amount in self.amounts.items():
            _id(dim, "amounts key")
            _amount(amount, f"amounts.{dim}")


@dataclass(frozen=True, slots=True)
class WallClockMeasured:
    kind: ClassVar[str] = "wall_clock_measured"
    elapsed_s: float

    def __post_init__(self) -> None:
        _amount(self.elapsed_s, "elapsed_s")


@dataclass(frozen=True, slots=True)
class BudgetStageChanged:
    kind: ClassVar[str] = "budget_stage_changed"
    stage: BudgetStage
    rho: float
    binding_dimension: str

    def __post_init__(self) -> None:
        _amount(self.rho, "rho")
        _id(self.binding_dimension, "binding_dimension")


@dataclass(frozen=True, slots=True)
class GrantNarrowed:
    kind: ClassVar[str] = "grant_narrowed"
    tools: frozenset[str]
    read_only: bool
    subagents_allowed: bool
    reason: str


@dataclass(frozen=True, slots=True)
class LeaseAcquired:
    kind: ClassVar[str] = "lease_acquired"
    lease_id: str
    lease_kind: LeaseKind
    resource: str
    expires_at: float

    def __post_init__(self) -> None:
        _id(self.lease_id, "lease_id")
        _time(self.expires_at, "expires_at")


@dataclass(frozen=True, slots=True)
class LeaseReleased:
    kind: ClassVar[str] = "lease_released"
    lease_id: str


@dataclass(frozen=True, slots=True)
class PointerMoved:
    kind: ClassVar[str] = "pointer_moved"
    pointer: PointerName
    ref: str

    def __post_init__(self) -> None:
        _id(self.ref, "ref")


# --------------------------------------------------------------------------- supervision (issue 12)
#
# Holds, the watchdog ladder, escalations, incidents, the degradation ladder and delegation. Their rules are
# in ``runtime._decide_supervise`` / ``runtime._decide_children``; their handlers in
# ``runtime._handlers_supervise``.


@dataclass(frozen=True, slots=True)
class HoldPlaced:
    """The hold flag is set: no new model-directed work (a watchdog's, an operator's or an incident's)."""

    kind: ClassVar[str] = "hold_placed"
    hold_kind: HoldKind
    reason: str
    issuer: str
    at: float
    incident_id: str | None = None
    escalation_id: str | None = None
    guard: str | None = None
    expires_at: float | None = None

    def __post_init__(self) -> None:
        _id(self.issuer, "issuer")
        _time(self.at, "at")
        _check(self.hold_kind is not HoldKind.INCIDENT or bool(self.incident_id), "an incident hold names it")


@dataclass(frozen=True, slots=True)
class HoldReleased:
    kind: ClassVar[str] = "hold_released"
    hold_kind: HoldKind
    issuer: str
    reason: str = ""
    incident_id: str | None = None  # an incident's hold lifts when its last incident is released

    def __post_init__(self) -> None:
        _id(self.issuer, "issuer")


@dataclass(frozen=True, slots=True)
class WatchdogFired:
    """A detector fired and the ladder answered with ``rung`` (its ``count``-th firing since a release).
    ``evidence``: the finding (window indices, fingerprints or digests), as the escalation carries it."""

    kind: ClassVar[str] = "watchdog_fired"
    guard: str
    rung: str
    count: int
    detail: str
    call_id: str | None = None
    evidence: Mapping[str, JsonValue] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _id(self.guard, "guard")
        _check(self.count >= 1, "count must be >= 1")


@dataclass(frozen=True, slots=True)
class ProgressObserved:
    """The declared task state's digest after turn ``turn`` (None: no projection declared), one step of
    the turn-level detectors; ``waiting_on_job``: the turn only polled a running job (exempt)."""

    kind: ClassVar[str] = "progress_observed"
    turn: int
    digest: str | None
    waiting_on_job: bool
    results_seen: int

    def __post_init__(self) -> None:
        _check(self.turn >= 1 and self.results_seen >= 0, "turn >= 1 and results_seen >= 0")


@dataclass(frozen=True, slots=True)
class CallWithheld:
    """Supervision withheld a proposed call before dispatch (watchdog, disclosure rule, hold)."""

    kind: ClassVar[str] = "call_withheld"
    call_id: str
    tool: str
    by: str
    detail: str = ""


@dataclass(frozen=True, slots=True)
class EscalationOpened:
    kind: ClassVar[str] = "escalation_opened"
    escalation_id: str
    trigger: str
    summary: str
    owner: str
    opened_at: float
    due_at: float
    evidence: Mapping[str, JsonValue] = field(default_factory=dict)
    handoff: Mapping[str, JsonValue] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("escalation_id", "trigger", "owner"):
            _id(getattr(self, name), name)
        _time(self.opened_at, "opened_at")
        _time(self.due_at, "due_at")
        _check(self.due_at >= self.opened_at, "due_at is not before opened_at")


@dataclass(frozen=True, slots=True)
class EscalationAcknowledged:
    """Custody transferred to ``custodian``, the verified signer of control message ``message_id``."""

    kind: ClassVar[str] = "escalation_acknowledged"
    escalation_id: str
    custodian: str
    at: float
    message_id: str

    def __post_init__(self) -> None:
        _id(self.custodian, "custodian")
        _time(self.at, "at")


@dataclass(frozen=True, slots=True)
class EscalationResolved:
    kind: ClassVar[str] = "escalation_resolved"
    escalation_id: str
    resolution: str


@dataclass(frozen=True, slots=True)
class IncidentOpened:
    """This trajectory opened an incident itself (a disclosure rule): symptom and suspected cause apart."""

    kind: ClassVar[str] = "incident_opened"
    incident_id: str
    symptom: str
    suspected_cause: str
    evidence: Mapping[str, JsonValue] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _id(self.incident_id, "incident_id")
        _id(self.symptom, "symptom")


@dataclass(frozen=True, slots=True)
class RungChanged:
    """The degradation ladder moved the trajectory to ``rung`` on ``trigger``."""

    kind: ClassVar[str] = "rung_changed"
    rung: Rung
    trigger: str
    detail: str = ""


@dataclass(frozen=True, slots=True)
class ChildSpawned:
    """A delegated call became a child trajectory; its allocation is charged to this one at once."""

    kind: ClassVar[str] = "child_spawned"
    child_id: str
    call_id: str
    goal: str
    allocation: Mapping[str, float]
    deadline: float

    def __post_init__(self) -> None:
        _id(self.child_id, "child_id")
        _time(self.deadline, "deadline")
        for dim, amount in self.allocation.items():
            _amount(amount, f"allocation.{dim}")


@dataclass(frozen=True, slots=True)
class ChildSettled:
    """A child ended: the parent's verdict on its evidence, and what it really spent (which replaces its
    allocation in this trajectory's spend). ``report`` is what the parent's model is told."""

    kind: ClassVar[str] = "child_settled"
    child_id: str
    call_id: str
    verified: bool
    detail: str
    spent: Mapping[str, float]
    report: Mapping[str, JsonValue] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for dim, amount in self.spent.items():
            _amount(amount, f"spent.{dim}")


@dataclass(frozen=True, slots=True)
class ChildCancelled:
    """Cancel or kill cascaded to a child: the parent stops waiting for it (its allocation stays charged
    until its evidence arrives)."""

    kind: ClassVar[str] = "child_cancelled"
    child_id: str
    call_id: str
    reason: str


Event: TypeAlias = (
    TrajectoryCreated
    | StateChanged
    | CompletionChecked
    | TurnRequested
    | TurnAbandoned
    | TurnStarted
    | ModelCallIntent
    | ModelCallSettled
    | ModelCallCancelled
    | ModelCallFailed
    | ObservationAppended
    | CallObserved
    | ToolCallHeld
    | ApprovalVoted
    | ApprovalDecided
    | ApprovalRechecked
    | ToolCallQueued
    | ToolCallWithdrawn
    | ToolDispatchIntent
    | ToolJobStarted
    | ToolResultAccepted
    | ToolCallTimedOut
    | ToolCallCancelled
    | OperationMarkedInDoubt
    | OperationSettled
    | ControlRequested
    | ControlApplied
    | ControlRejected
    | LateResultDropped
    | TimerStarted
    | TimerFired
    | TimerCancelled
    | ObligationRegistered
    | ObligationBound
    | ObligationUpdated
    | CleanupDispatched
    | CleanupSettled
    | HandoffWritten
    | OperatorActed
    | RepairEpisodeChanged
    | CandidateRevised
    | CandidateChecked
    | BudgetCharged
    | WallClockMeasured
    | BudgetStageChanged
    | GrantNarrowed
    | LeaseAcquired
    | LeaseReleased
    | PointerMoved
    | HoldPlaced
    | HoldReleased
    | WatchdogFired
    | ProgressObserved
    | CallWithheld
    | EscalationOpened
    | EscalationAcknowledged
    | EscalationResolved
    | IncidentOpened
    | RungChanged
    | ChildSpawned
    | ChildSettled
    | ChildCancelled
)
"""Any trajectory event."""

EVENT_TYPES: Mapping[str, type[Event]] = {
    cls.kind: cls
    for cls in (
        TrajectoryCreated,
        StateChanged,
        CompletionChecked,
        TurnRequested,
        TurnAbandoned,
        TurnStarted,
        ModelCallIntent,
        ModelCallSettled,
        ModelCallCancelled,
        ModelCallFailed,
        ObservationAppended,
        CallObserved,
        ToolCallHeld,
        ApprovalVoted,
        ApprovalDecided,
        ApprovalRechecked,
        ToolCallQueued,
        ToolCallWithdrawn,
        ToolDispatchIntent,
        ToolJobStarted,
        ToolResultAccepted,
        ToolCallTimedOut,
        ToolCallCancelled,
        OperationMarkedInDoubt,
        OperationSettled,
        ControlRequested,
        ControlApplied,
        ControlRejected,
        LateResultDropped,
        TimerStarted,
        TimerFired,
        TimerCancelled,
        ObligationRegistered,
        ObligationBound,
        ObligationUpdated,
        CleanupDispatched,
        CleanupSettled,
        HandoffWritten,
        OperatorActed,
        RepairEpisodeChanged,
        CandidateRevised,
        CandidateChecked,
        BudgetCharged,
        WallClockMeasured,
        BudgetStageChanged,
        GrantNarrowed,
        LeaseAcquired,
        LeaseReleased,
        PointerMoved,
        HoldPlaced,
        HoldReleased,
        WatchdogFired,
        ProgressObserved,
        CallWithheld,
        EscalationOpened,
        EscalationAcknowledged,
        EscalationResolved,
        IncidentOpened,
        RungChanged,
        ChildSpawned,
        ChildSettled,
        ChildCancelled,
    )
}
"""Event class by its ``kind`` tag (what the codec writes and reads)."""
