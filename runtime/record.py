"""The trajectory record: the small control state the harness reads on every turn (harness chapter, Table 2).

The record is a frozen value. It changes only by ``runtime.fold.apply(record, event)``, which returns a new
record, and ``runtime.fold.fold(events)`` rebuilds it from the log, so the live record and the folded one
are equal by construction. Nothing the model emits writes it: model output reaches the trajectory only as
observation events the harness chose to append, and the record keeps pointers to that context, not the text.

Field groups (Table 2): identity, status, per-call limits, budgets and spend, grants and leases, pending work,
pointers; plus the operation table (settlement rule, recovery chapter), the audit trail, and the control
message ids already seen (delivery is at-least-once, so applying a message is idempotent by its id).
Mapping fields are never mutated after construction: ``apply`` always builds fresh ones.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, TypeAlias

from runtime.budget import BudgetCeilings, BudgetStage, Spend
from runtime.incident import Hold
from runtime.obligations import Obligation
from runtime.operations import Operation
from runtime.ports import GuardPermit, SandboxPermit
from runtime.repair import RepairEpisode
from runtime.states import TERMINAL_STATES, ExitReason, TrajectoryState
from runtime.supervision import SupervisionState
from runtime.watchdog import WatchdogState

if TYPE_CHECKING:
    from runtime.policy import TrajectoryPolicy

__all__ = [
    "ANY_STATE_ACTIONS",
    "ApprovalDecision",
    "AuditEntry",
    "AuditKind",
    "CallLimits",
    "CheckEvidence",
    "CompletionCheck",
    "ControlAction",
    "Grants",
    "HeldCall",
    "HeldVote",
    "JsonValue",
    "Lease",
    "LeaseKind",
    "ModelCall",
    "ModelOutcome",
    "PendingCall",
    "PendingControl",
    "Pointers",
    "PromptAnchor",
    "QueueStage",
    "QueuedCall",
    "Revision",
    "TaskContract",
    "Timer",
    "TimerKind",
    "TrajectoryRecord",
    "Transition",
    "TurnRequestState",
]

JsonValue: TypeAlias = "bool | int | float | str | Sequence[JsonValue] | Mapping[str, JsonValue] | None"
"""A JSON-compatible value (tool arguments, tool results, control payloads). Floats must be finite."""


def _require(condition: bool, message: str) -> None:
    # Value constructors validate eagerly so a malformed value never exists; the codec turns the
    # ValueError into a CodecError naming the field path.
    if not condition:
        raise ValueError(message)


def _non_empty(value: str, name: str) -> None:
    _require(isinstance(value, str) and value != "", f"{name} must be a non-empty string")


def _finite_non_negative(value: float, name: str) -> None:
    _require(math.isfinite(value) and value >= 0, f"{name} must be finite and >= 0, got {value!r}")


# --------------------------------------------------------------------------- vocabularies


class ControlAction(StrEnum):
    """Requests accepted from outside the loop (harness chapter, Table 6; approvals from the gate)."""

    CANCEL = "cancel"
    INTERRUPT = "interrupt"
    PAUSE = "pause"
    RESUME = "resume"
    KILL = "kill"
    APPROVE = "approve"
    DENY = "deny"
    SETTLE = "settle"  # an operator settles an unknown operation or a stuck obligation (with evidence)
    HANDOFF = "handoff"  # an operator takes (or assigns) custody of what the trajectory still owes
    # issue 12: holds and custody (applied on arrival, never left pending)
    HOLD = "hold"  # place a control hold, or an incident's hold (payload ``incident_id``)
    RELEASE = "release"  # lift a hold (an incident's only with its ``incident_id``)
    ACKNOWLEDGE = "acknowledge"  # take custody of an escalation (payload ``escalation_id``)


ANY_STATE_ACTIONS: frozenset[ControlAction] = frozenset({ControlAction.SETTLE, ControlAction.HANDOFF})
"""An operator's word on what the trajectory owes: applied at once in any state, terminal included (liability
outlives the loop), so the relays deliver these to an ended trajectory too, waking it from its log."""


class ApprovalDecision(StrEnum):
    """What happened to a held call's approval request. Silence is denial: expiry counts as a refusal."""

    APPROVED = "approved"
    DENIED = "denied"
    EXPIRED = "expired"


class ModelOutcome(StrEnum):
    """How the model call of the current CALLING_MODEL episode ended (stop reasons plus failure)."""

    END_TURN = "end_turn"
    MAX_TOKENS = "max_tokens"
    TOOL_USE = "tool_use"
    REFUSAL = "refusal"
    CANCELED = "canceled"  # aborted by the harness; the partial reply is never parsed
    FAILED = "failed"  # error or timeout from the provider


class LeaseKind(StrEnum):
    WORKSPACE = "workspace"
    CREDENTIAL = "credential"
    SANDBOX = "sandbox"


class AuditKind(StrEnum):
    """Why an audit entry exists. Audit entries never change state; they explain what was refused."""

    LATE_RESULT_DROPPED = "late_result_dropped"
    CONTROL_REJECTED = "control_rejected"
    CONTROL_REFUSED = "control_refused"  # recorded, then refused when applied (e.g. a stale-digest approval)
    OPERATOR_ACTED = "operator_acted"  # an operator settled or took custody of an effect


class TimerKind(StrEnum):
    """What a timer is for. Durable kinds live in the cluster's timer store and fire even when the actor is
    gone (waking a hibernated trajectory); the others live only as long as the actor, and recovery re-arms
    them from the record."""

    DEADLINE = "deadline"  # the trajectory's absolute deadline: cleanup must end by it (durable)
    RESERVE = "reserve"  # forward work ends here; the finalization reserve funds the way out (durable)
    APPROVAL_EXPIRY = "approval_expiry"  # a held call's expiry: silence is denial (durable)
    HIBERNATE = "hibernate"  # idle long enough in a wait: the actor may exit
    BACKOFF = "backoff"  # the next model call waits out a backoff
    CALL_DEADLINE = "call_deadline"  # a dispatched tool call's deadline
    RETRY = "retry"  # a tool operation's next attempt waits out its backoff
    HOLD_EXPIRY = "hold_expiry"  # a watchdog hold the policy ends if nobody resumed it (durable)

    @property
    def durable(self) -> bool:
        return self in (
            TimerKind.DEADLINE,
            TimerKind.RESERVE,
            TimerKind.APPROVAL_EXPIRY,
            TimerKind.HOLD_EXPIRY,
        )


class QueueStage(StrEnum):
    """Where an accepted, not yet dispatched tool call waits."""

    PERMIT = "permit"  # the dependency guard's permit (and the sandbox permit, when the tool needs one)
    BACKOFF = "backoff"  # a retry of an earlier attempt waits out its backoff
    PROBING = "probing"  # result recovery: the endpoint is asked what became of the last attempt


# --------------------------------------------------------------------------- identity and limits


@dataclass(frozen=True, slots=True)
class CompletionCheck:
    """Names the check FINALIZING runs on an ``end_turn`` claim. The harness evaluates it; the record
    only names it (``name``) and keeps its parameters."""

    name: str
    params: Mapping[str, JsonValue] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _non_empty(self.name, "completion_check.name")


@dataclass(frozen=True, slots=True)
class TaskContract:
    """What was asked, kept verbatim, and how success is judged."""

    goal: str
    completion_check: CompletionCheck

    def __post_init__(self) -> None:
        _non_empty(self.goal, "goal")


@dataclass(frozen=True, slots=True)
class CallLimits:
    """Per-call ceilings set on every model request (the invocation contract)."""

    model: str
    max_output_tokens: int
    call_deadline_s: float
    sampling: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _non_empty(self.model, "model")
        _require(self.max_output_tokens > 0, "max_output_tokens must be > 0")
        _require(
            math.isfinite(self.call_deadline_s) and self.call_deadline_s > 0, "call_deadline_s must be > 0"
        )


@dataclass(frozen=True, slots=True)
class Grants:
    """The tool authority the harness grants. It only ever narrows (``GrantNarrowed``).

    ``approval_required`` names tools whose calls must pass the approval gate before dispatch;
    ``read_only_tools`` is the subset the restrict stage keeps.
    """

    tools: frozenset[str]
    read_only_tools: frozenset[str] = frozenset()
    approval_required: frozenset[str] = frozenset()
    read_only: bool = False
    subagents_allowed: bool = True

    def __post_init__(self) -> None:
        _require(self.read_only_tools <= self.tools, "read_only_tools must be a subset of tools")

    def allows(self, tool: str) -> bool:
        """Whether a call to ``tool`` is within the grant right now."""
        return tool in self.tools and (not self.read_only or tool in self.read_only_tools)


@dataclass(frozen=True, slots=True)
class Lease:
    lease_id: str
    kind: LeaseKind
    resource: str
    expires_at: float  # epoch seconds


# --------------------------------------------------------------------------- pending work


@dataclass(frozen=True, slots=True)
class ModelCall:
    """The model call of the current CALLING_MODEL episode; ``outcome is None`` while it is in flight."""

    grant_id: str
    model: str
    max_tokens: int
    deadline: float
    outcome: ModelOutcome | None = None
    prompt_tokens: int = 0
    prompt_basis: int = 0


@dataclass(frozen=True, slots=True)
class PendingCall:
    """A dispatched tool call whose result is still accepted."""

    call_id: str
    tool: str
    operation_id: str
    attempt_id: str
    deadline: float  # absolute, epoch seconds
    job_handle: str | None = None
    guard_permit: GuardPermit | None = None  # released with the attempt's classified outcome
    sandbox_permit: SandboxPermit | None = None


@dataclass(frozen=True, slots=True)
class HeldVote:
    """One authenticated approval of a held call's digest (the control plane verified the signature)."""

    issuer: str
    roles: frozenset[str]
    at: float  # epoch seconds


@dataclass(frozen=True, slots=True)
class HeldCall:
    """An irreversible call held in escrow: undispatched until an approval that passes its re-check.

    Approvals accumulate in ``votes`` until the quorum (distinct signers) and the required roles are
    covered; a partial approval keeps the call held (approval chapter, Table 10)."""

    call_id: str
    tool: str
    arguments: Mapping[str, JsonValue]
    digest: str  # digest of the canonical call: the approval binds to it
    expires_at: float  # epoch seconds; silence until then is denial
    preconditions: Mapping[str, JsonValue] = field(default_factory=dict)
    decision: ApprovalDecision | None = None
    issuers: tuple[str, ...] = ()
    recheck_passed: bool | None = None
    requested_at: float = 0.0
    quorum: int = 1
    required_roles: frozenset[str] = frozenset()
    votes: tuple[HeldVote, ...] = ()

    @property
    def cleared_for_dispatch(self) -> bool:
        """Approved and re-checked: the only state in which the held call may be dispatched."""
        return self.decision is ApprovalDecision.APPROVED and self.recheck_passed is True


@dataclass(frozen=True, slots=True)
class QueuedCall:
    """An accepted tool call (validated, within the grant, past the watchdog and the approval gate) that is
    not in flight: waiting for its permits, a retry backoff, or a probe. ``operation_id`` is set once the
    call has been dispatched before (a retry keeps the operation). Nothing here has reached the dependency."""

    call_id: str
    tool: str
    arguments: Mapping[str, JsonValue]
    stage: QueueStage
    request_id: str  # the permit request, probe or timer this stage waits for (stale answers are ignored)
    operation_id: str | None = None
    approval_digest: str | None = None


@dataclass(frozen=True, slots=True)
class Timer:
    """A timer the trajectory armed (``TimerStarted``); it fires as an input (``TimerFired``)."""

    timer_id: str
    kind: TimerKind
    due_at: float  # epoch seconds
    subject: str = ""  # what it concerns: a call id, a held call's digest, ...


@dataclass(frozen=True, slots=True)
class TurnRequestState:
    """The admission request of the next turn, asked of the scheduler and not yet answered."""

    request_id: str
    estimated_tokens: int
    max_tokens: int
    prompt_tokens: int
    prompt_basis: int = 0


@dataclass(frozen=True, slots=True)
class PromptAnchor:
    """The provider's count of the last metered prompt, and that prompt's plain character estimate.

    The next prompt is this one plus what the transcript gained since, so its estimate is ``reported`` plus
    the character estimate of the growth (``runtime.context.anchored_estimate``)."""

    basis: int  # estimate_from_chars of the metered prompt
    reported: int  # uncached + cached input tokens, as the provider reported them


@dataclass(frozen=True, slots=True)
class PendingControl:
    """A control request recorded on arrival, applied at the next turn boundary (kill: at once)."""

    message_id: str
    action: ControlAction
    issuer: str
    reason: str
    payload: Mapping[str, JsonValue] = field(default_factory=dict)


# --------------------------------------------------------------------------- pointers, history, audit


@dataclass(frozen=True, slots=True)
class Pointers:
    """References to bulky state owned elsewhere; the record never copies it."""

    context_ref: str
    workspace_ref: str | None = None
    workspace_snapshot: str | None = None
    plan_ref: str | None = None


@dataclass(frozen=True, slots=True)
class Transition:
    """One entry of the state history; ``seq`` is the log position of the ``StateChanged`` event."""

    seq: int
    from_state: TrajectoryState
    to_state: TrajectoryState
    reason: str


@dataclass(frozen=True, slots=True)
class AuditEntry:
    seq: int
    kind: AuditKind
    subject: str  # call id or control message id
    reason: str


@dataclass(frozen=True, slots=True)
class CheckEvidence:
    """One check's verdict on one candidate revision (recovery chapter §12.9.3, table 10, row 5): it stays
    with the revision it checked, so it never certifies a later one."""

    operation_id: str
    call_id: str | None
    tool: str
    passed: bool
    detail: str


@dataclass(frozen=True, slots=True)
class Revision:
    """A version of the candidate: ``number`` 0 is the candidate as the task gave it; each result (or unknown
    outcome) of a tool that revises the candidate opens the next one. ``in_doubt``: opened by an outcome
    nobody knows (the candidate may or may not have changed, so earlier evidence cannot vouch for it)."""

    number: int
    operation_id: str | None  # the operation that made it (None: the candidate as given)
    tool: str | None
    in_doubt: bool = False
    checks: tuple[CheckEvidence, ...] = ()


# --------------------------------------------------------------------------- the record


@dataclass(frozen=True, slots=True)
class TrajectoryRecord:
    """Everything the harness needs to control one trajectory (Table 2), as a frozen value."""

    # identity
    trajectory_id: str
    parent_id: str | None
    tenant: str
    contract: TaskContract
    priority_class: str
    created_at: float
    deadline: float | None  # absolute trajectory deadline, epoch seconds
    # status
    state: TrajectoryState
    exit_reason: ExitReason | None
    check_passed: bool | None
    turn_count: int
    history: tuple[Transition, ...]
    # per-call limits
    limits: CallLimits
    # budgets and spend
    ceilings: BudgetCeilings
    spend: Spend
    budget_stage: BudgetStage
    rho: float
    binding_dimension: str | None
    # grants and leases
    grants: Grants
    leases: Mapping[str, Lease]
    # pending work
    model_call: ModelCall | None
    pending_calls: Mapping[str, PendingCall]
    held: HeldCall | None
    pending_control: tuple[PendingControl, ...]
    # pointers
    pointers: Pointers
    log_position: int  # events applied so far (the next event's seq)
    # operations, audit, control idempotency
    operations: Mapping[str, Operation]
    audit: tuple[AuditEntry, ...]
    seen_control_ids: frozenset[str]
    applied_control_ids: frozenset[str]
    # what the decider needs beyond the chapter's Table 2 (all folded from the log like everything else)
    transcript: tuple[object, ...] = ()  # the events the model's context is rebuilt from (runtime.context)
    model_failures: int = 0  # consecutive failed model calls (a 429 is admission feedback, not a failure)
    refusals: int = 0  # replies the provider refused
    turn_request: TurnRequestState | None = None
    prompt_anchor: PromptAnchor | None = None  # the provider's count of the last prompt (see PromptAnchor)
    queued: Mapping[str, QueuedCall] = field(default_factory=dict)
    timers: Mapping[str, Timer] = field(default_factory=dict)
    watchdog: WatchdogState = field(default_factory=WatchdogState)
    excluded_wait_s: float = 0.0  # time spent awaiting approval: charged to the request, not the budget
    obligations: Mapping[str, Obligation] = field(default_factory=dict)  # compensations owed, by id
    handoff: Mapping[str, JsonValue] | None = None  # the packet written on an exit that was not clean
    repairs: Mapping[str, RepairEpisode] = field(default_factory=dict)  # the latest episode per tool
    revisions: tuple[Revision, ...] = ()  # the candidate's revisions and the checks of each (table 10 row 5)
    # the workload's policy for this trajectory (not folded: it comes from the launch, see runtime.policy)
    policy: TrajectoryPolicy = field(default=None, compare=False, repr=False)  # type: ignore[assignment]
    # issue 12: the one hold flag (watchdog, control, incident) and what supervision folds from the log
    hold: Hold | None = None
    supervision: SupervisionState = field(default_factory=SupervisionState)

    @property
    def is_terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    def timer_of(self, kind: TimerKind, subject: str = "") -> Timer | None:
        """The armed timer of ``kind`` (for ``subject``), if any."""
        return next((t for t in self.timers.values() if t.kind is kind and t.subject == subject), None)

    def operation_for_call(self, call_id: str) -> Operation | None:
        """The most recently dispatched operation for ``call_id``, if any (the last one of the call in
        dispatch order: searched from the newest, so a turn's own call is found at once)."""
        ops: Mapping[str, Operation] = self.operations
        for key in reversed(ops.keys() if isinstance(ops, dict) else list(ops)):
            op = ops[key]
            if op.call_id == call_id:
                return op
        return None

    def operations_by_call(self) -> dict[str, Operation]:
        """``operation_for_call`` for every call at once (one pass, for loops over the transcript)."""
        return {op.call_id: op for op in self.operations.values()}
