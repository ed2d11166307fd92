"""Builders for trajectory logs in unit tests: a created event, and a ``Log`` that applies events the way the
live harness does (``apply`` first, then keep the event), so every test drives the real rules."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from runtime import (
    ApprovalDecided,
    ApprovalDecision,
    ApprovalRechecked,
    BudgetStage,
    BudgetStageChanged,
    CallLimits,
    CompletionCheck,
    CompletionChecked,
    Event,
    ExitReason,
    Grants,
    ModelCallIntent,
    ModelCallSettled,
    StateChanged,
    TaskContract,
    ToolCallHeld,
    ToolDispatchIntent,
    TrajectoryCreated,
    TrajectoryRecord,
    TrajectoryState,
    TurnStarted,
    apply,
    start,
)
from runtime.ports import StopReason, Usage

S = TrajectoryState
T0 = 1_700_000_000.0
DROP_ARGS: dict[str, Any] = {"db": "prod", "table": "orders_staging"}
DIGEST = "sha256:drop-orders-staging"
GRANTS = Grants(
    tools=frozenset({"read_file", "write_file", "drop_table"}),
    read_only_tools=frozenset({"read_file"}),
    approval_required=frozenset({"drop_table"}),
)


def created(**overrides: Any) -> TrajectoryCreated:
    fields: dict[str, Any] = {
        "trajectory_id": "traj-1",
        "parent_id": None,
        "tenant": "acme",
        "contract": TaskContract(
            goal="Fix the failing test in  tests/test_io.py\n(keep the API).",
            completion_check=CompletionCheck("pytest", {"paths": ["tests/test_io.py"]}),
        ),
        "limits": CallLimits(model="m-1", max_output_tokens=1024, call_deadline_s=60.0),
        "ceilings": {"turns": 40.0, "tokens": 2_000_000.0, "wall_seconds": 900.0, "dollars": 3.5},
        "grants": GRANTS,
        "priority_class": "standard",
        "created_at": T0,
        "deadline": T0 + 900.0,
        "context_ref": "ctx://traj-1",
    }
    fields.update(overrides)
    return TrajectoryCreated(**fields)


@dataclass
class Log:
    """A trajectory's log and its live record, grown one applied event at a time."""

    events: list[Event] = field(default_factory=lambda: [created()])
    record: TrajectoryRecord = field(init=False)

    def __post_init__(self) -> None:
        first = self.events[0]
        assert isinstance(first, TrajectoryCreated)
        self.record = start(first)
        for event in self.events[1:]:
            self.record = apply(self.record, event)

    def add(self, *events: Event) -> TrajectoryRecord:
        for event in events:
            self.record = apply(self.record, event)
            self.events.append(event)
        return self.record

    def to(self, to_state: TrajectoryState, reason: str = "test", **extra: Any) -> TrajectoryRecord:
        return self.add(StateChanged(self.record.state, to_state, reason, **extra))

    # -- common paths ------------------------------------------------------------------------------

    def call_model(self, stop: StopReason = StopReason.TOOL_USE) -> TrajectoryRecord:
        """READY -> CALLING_MODEL, one call that ends with ``stop``."""
        self.add(TurnStarted(self.record.turn_count + 1))
        self.to(S.CALLING_MODEL, "turn")
        return self.add(
            ModelCallIntent("grant-1", "m-1", 512, T0 + 60.0),
            ModelCallSettled(stop, Usage(1000, 0, 200), 0.006),
        )

    def dispatch(self, call_id: str = "c1", tool: str = "read_file", **extra: Any) -> TrajectoryRecord:
        """From CALLING_MODEL (tool_use): WAITING_TOOL with ``call_id`` pending."""
        if self.record.state is S.CALLING_MODEL:
            self.to(S.WAITING_TOOL, "dispatch")
        return self.add(intent(call_id, tool, **extra))

    def hold(self, expires_at: float = T0 + 600.0) -> TrajectoryRecord:
        """From CALLING_MODEL (tool_use): drop_table held, AWAITING_APPROVAL."""
        self.add(ToolCallHeld("c-drop", "drop_table", dict(DROP_ARGS), DIGEST, expires_at))
        return self.to(S.AWAITING_APPROVAL, "irreversible call")

    def approve(self, at: float = T0 + 100.0, recheck: bool = True) -> TrajectoryRecord:
        self.add(ApprovalDecided(DIGEST, ApprovalDecision.APPROVED, ("alice",), "ok", at))
        failed = None if recheck else "preconditions_changed"
        return self.add(ApprovalRechecked(DIGEST, recheck, failed, at + 1.0))

    def finalize(self, reason: ExitReason) -> TrajectoryRecord:
        if reason is ExitReason.BUDGET_EXCEEDED:
            self.add(BudgetStageChanged(BudgetStage.HALT, 1.0, "turns"))
        return self.to(S.FINALIZING, "exit", exit_reason=reason)


def intent(call_id: str = "c1", tool: str = "read_file", **extra: Any) -> ToolDispatchIntent:
    fields: dict[str, Any] = {
        "call_id": call_id,
        "tool": tool,
        "arguments": {"path": "a.txt"},
        "effect_key": f"ek-{call_id}",
        "operation_id": f"op-{call_id}",
        "attempt_id": f"at-{call_id}-1",
        "deadline": T0 + 120.0,
    }
    fields.update(extra)
    return ToolDispatchIntent(**fields)


def held_dispatch() -> ToolDispatchIntent:
    """The dispatch intent of the exact call that was held and approved."""
    return intent("c-drop", "drop_table", arguments=dict(DROP_ARGS), approval_digest=DIGEST)


def in_state(state: TrajectoryState) -> Log:
    """A log whose record is in ``state`` by an ordinary path."""
    log = Log()
    if state is S.READY:
        return log
    if state is S.PAUSED:
        log.to(S.PAUSED, "operator pause")
        return log
    if state in (S.FINALIZING, S.COMPLETED, S.FAILED, S.CANCELED):
        log.finalize({S.CANCELED: ExitReason.CANCELED}.get(state, ExitReason.ERROR))
        if state is S.COMPLETED:
            log = Log()
            log.finalize(ExitReason.COMPLETED)
            log.add(CompletionChecked("pytest", True))
        if state is not S.FINALIZING:
            log.to(state, "settled")
        return log
    log.call_model()
    if state is S.WAITING_TOOL:
        log.dispatch()
    elif state is S.AWAITING_APPROVAL:
        log.hold()
    return log


def with_record(log: Log, **changes: Any) -> TrajectoryRecord:
    return replace(log.record, **changes)


def examples() -> list[Event]:
    """One valid instance of every event kind (for codec tables and absorption checks)."""
    from runtime import (
        BudgetCharged,
        ControlAction,
        ControlApplied,
        ControlRejected,
        ControlRequested,
        GrantNarrowed,
        LateResultDropped,
        LeaseAcquired,
        LeaseKind,
        LeaseReleased,
        ModelCallCancelled,
        ModelCallFailed,
        ObservationAppended,
        ObservationKind,
        OperationMarkedInDoubt,
        OperationSettled,
        PointerMoved,
        PointerName,
        ToolCallCancelled,
        ToolCallTimedOut,
        ToolJobStarted,
        ToolResultAccepted,
        WallClockMeasured,
    )
    from runtime.degradation import Rung
    from runtime.events import (
        ApprovalVoted,
        CallObserved,
        CallWithheld,
        CandidateChecked,
        CandidateRevised,
        ChildCancelled,
        ChildSettled,
        ChildSpawned,
        CleanupDispatched,
        CleanupSettled,
        EscalationAcknowledged,
        EscalationOpened,
        EscalationResolved,
        HandoffWritten,
        HoldPlaced,
        HoldReleased,
        IncidentOpened,
        ObligationBound,
        ObligationRegistered,
        ObligationUpdated,
        OperatorActed,
        ProgressObserved,
        RepairEpisodeChanged,
        RungChanged,
        TimerCancelled,
        TimerFired,
        TimerStarted,
        ToolCallQueued,
        ToolCallWithdrawn,
        TurnAbandoned,
        TurnRequested,
        WatchdogFired,
    )
    from runtime.incident import HoldKind
    from runtime.obligations import ObligationState
    from runtime.ports import GuardPermit, OutcomeClass, SandboxPermit, Settlement, ToolCallProposal
    from runtime.record import QueueStage, TimerKind
    from runtime.repair import EpisodeState, RepairChoice

    return [
        created(parent_id="traj-0", workspace_ref="ws://1"),
        StateChanged(S.READY, S.FINALIZING, "cancel 3-0", exit_reason=ExitReason.CANCELED),
        StateChanged(S.AWAITING_APPROVAL, S.WAITING_TOOL, "approved", approval_digest=DIGEST),
        CompletionChecked("pytest", False, "2 failed"),
        TurnStarted(3),
        ModelCallIntent("grant-9", "m-1", 512, T0 + 30.5),
        ModelCallSettled(StopReason.TOOL_USE, Usage(1200, 800, 150), 0.0123),
        ModelCallCancelled("kill", Usage(10, 0, 3), 0.0001),
        ModelCallFailed("HTTP 503", True),
        ObservationAppended(
            ObservationKind.ASSISTANT,
            "let me look",
            tool_calls=(ToolCallProposal("c1", "read_file", '{"p": 1}'),),
        ),
        ObservationAppended(ObservationKind.REFUSAL, '{"status": "REFUSED"}', call_id="c-drop"),
        ToolCallHeld(
            "c-drop", "drop_table", dict(DROP_ARGS), DIGEST, T0 + 600, {"rows": 0, "ok": [True, None]}
        ),
        ApprovalDecided(DIGEST, ApprovalDecision.APPROVED, ("alice", "bob"), "quorum", T0 + 60),
        ApprovalRechecked(DIGEST, False, "preconditions_changed", T0 + 61),
        intent("c2", "write_file", compensation="delete c2", repeat_safe=True, liability=0.5),
        ToolJobStarted("c2", "job-77"),
        ToolResultAccepted(
            "c2", Settlement.ESTABLISHED, OutcomeClass.SUCCESS, {"n": [1, 2.5, "x"]}, None, 0.01
        ),
        ToolCallTimedOut("c3"),
        ToolCallCancelled("c4", "finalizing"),
        OperationMarkedInDoubt("op-c4", "kill", "operator:oncall"),
        OperationSettled("op-c4", Settlement.ESTABLISHED_ABSENT, "probe"),
        ControlRequested("5-0", ControlAction.INTERRUPT, "user:u1", "new info", {"message": "use v2"}),
        ControlApplied("5-0"),
        ControlRejected("6-0", "bad_signature", "ed25519 verify failed"),
        LateResultDropped("c3", "call_not_pending"),
        BudgetCharged({"dollars": 0.02, "sandbox_seconds": 12.5}, "tool c2"),
        WallClockMeasured(460.0),
        BudgetStageChanged(BudgetStage.STEER, 0.75, "turns"),
        GrantNarrowed(frozenset({"read_file"}), True, False, "restrict stage"),
        LeaseAcquired("lease-1", LeaseKind.WORKSPACE, "ws://1", T0 + 900),
        LeaseReleased("lease-1"),
        PointerMoved(PointerName.WORKSPACE_SNAPSHOT, "snap://3"),
        TurnRequested("turn-7", 1500, 512, 988),
        TurnAbandoned("turn-7", "paused"),
        ModelCallFailed("HTTP 429", True, rate_limited=True),
        CallObserved("c5", "run_tests", "fp-1", "coarse-1", None, False, "exact_repeat"),
        ApprovalVoted(DIGEST, "alice", frozenset({"secops"}), T0 + 30),
        ToolCallQueued("c6", "run_tests", {"suite": "unit"}, QueueStage.PERMIT, "permit-3", None, DIGEST),
        ToolCallWithdrawn("c6", "pause requested"),
        ControlApplied("7-0", refused="STALE_DIGEST", detail="approval for another call"),
        ControlRejected("8-0", "trajectory_terminal", "ended", verified=True),
        TimerStarted("deadline-1", TimerKind.DEADLINE, T0 + 3600),
        TimerFired("deadline-1"),
        TimerCancelled("hib-2"),
        intent(
            "c7",
            "run_tests",
            guard_permit=GuardPermit("g-1", "test-service", 2, False),
            sandbox_permit=SandboxPermit("s-1", "default", T0 + 60),
        ),
        ObligationRegistered(
            "obl-op-c2", "op-c2", "write_file", "delete_file", {"path": "a.txt"}, ("token",), ("run_tests",)
        ),
        ObligationBound("obl-op-c2", {"path": "a.txt", "token": "t-1"}, "delete_file:{}", "result of c2"),
        ObligationUpdated("obl-op-c2", ObligationState.ADMITTING, "finalizing", request_id="permit-9"),
        CleanupDispatched(
            "obl-op-c2", "cop-obl-op-c2", "cop-obl-op-c2#a1", "ek-cop", "delete_file", {}, T0 + 30
        ),
        CleanupSettled("obl-op-c2", Settlement.ESTABLISHED, OutcomeClass.SUCCESS, {"deleted": True}),
        HandoffWritten({"goal": "x", "pending": {"obligations": []}}),
        OperatorActed("9-0", ControlAction.SETTLE, "op:alice", "op-c4", "checked by hand"),
        OperationSettled("op-c5", Settlement.ESTABLISHED, "probe", {"env_id": "e-1"}, "c5", False),
        RepairEpisodeChanged("write_file", "repair-4.1", EpisodeState.OPEN, 1, 3, RepairChoice.REPAIR, "x"),
        CandidateRevised(1, "op-c2", "write_file"),
        CandidateChecked(1, "op-c5", "run_tests", True, "passed", "c5"),
        # issue 12: supervision
        HoldPlaced(HoldKind.INCIDENT, "disclosure", "policy:disclosure", T0 + 5, "inc-1", "esc-1"),
        HoldReleased(HoldKind.INCIDENT, "op:alice", "reviewed", "inc-1"),
        WatchdogFired("exact_repeat", "inform", 1, "identical call 3 times", "c5", {"steps": [1, 2, 3]}),
        ProgressObserved(4, "digest-4", False, 3),
        CallWithheld("c5", "run_tests", "watchdog exact_repeat (inform)"),
        EscalationOpened("esc-1", "guard", "loop", "oncall", T0, T0 + 900, {"key": "k"}, {"goal": "g"}),
        EscalationAcknowledged("esc-1", "op:alice", T0 + 60, "9-0"),
        EscalationResolved("esc-1", "released"),
        IncidentOpened("inc-1", "fixture data to search", "unknown", {"path": "$.query"}),
        RungChanged(Rung.CONSTRAINED, "breaker_open", "env-provisioner open"),
        ChildSpawned("traj-1.c1", "c8", "run the suite", {"turns": 3.0, "dollars": 0.1}, T0 + 300),
        ChildSettled("traj-1.c1", "c8", False, "ended FAILED", {"turns": 2.0}, {"status": "FAILED_CHECK"}),
        ChildCancelled("traj-1.c2", "c9", "parent killed"),
    ]
