"""An in-memory interpreter for the decider: whole trajectories on a fake clock, no event loop spinning.

``Sim`` is what ``actors.interpreter.Interpreter`` is, minus I/O: it feeds an input to ``runtime.decide``,
applies the events to an in-memory log, and carries out each effect against scripted fakes, turning their
results into the next inputs. Effects complete at once unless a test holds them (a gated model call, a
hanging tool); timers fire when nothing else is left to do, by moving the fake clock to the earliest one.
Everything is synchronous and deterministic, so a test reads as a sequence of inputs and checks end state.

The tool fake counts every delivery it receives (``SimTools.deliveries``) separately from the effects it
applied, and by default does not honour effect keys: a runtime that re-sends an effect shows up as a
duplicate delivery, whatever the service did with it (issue 13: judges that can fail).
"""

from __future__ import annotations

import json
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict

from runtime.budget import PriceTable
from runtime.clock import FakeClock
from runtime.decider import Decision, decide
from runtime.effects import (
    AcquirePermit,
    CallModel,
    CancelChild,
    CancelModelStream,
    CancelTimer,
    CancelToolCall,
    DispatchTool,
    Effect,
    Hibernate,
    KillProcesses,
    OpenIncident,
    ProbeTool,
    PublishEscalation,
    ReleaseLease,
    ReleasePermit,
    ReportLimits,
    RequestAdmission,
    SettleAdmission,
    SpawnChild,
    StartTimer,
)
from runtime.events import Event, ObservationAppended, ObservationKind, TrajectoryCreated
from runtime.fold import fold
from runtime.inputs import (
    AdmissionDenied,
    AdmissionGranted,
    ControlReceived,
    ControlRefused,
    Input,
    ModelCancelled,
    ModelFailed,
    ModelReplied,
    PermitGranted,
    PermitRefused,
    ProbeAnswered,
    Recovered,
    Started,
    TimerDue,
    ToolOutcomeReceived,
)
from runtime.policy import TrajectoryPolicy
from runtime.ports import (
    GuardPermit,
    ModelReply,
    OutcomeClass,
    ProbeResult,
    SandboxPermit,
    Settlement,
    StopReason,
    ToolCallProposal,
    ToolInvocation,
    ToolOutcome,
    TurnGrant,
    Usage,
)
from runtime.record import CallLimits, CompletionCheck, ControlAction, Grants, TaskContract, Timer
from runtime.record import TrajectoryRecord as Record
from runtime.tools import Compensation, RepeatContract, SideEffect, ToolContract, ToolRegistry

Script = Callable[[Sequence[Mapping[str, Any]]], ModelReply]

PRICES = PriceTable(3.0, 0.3, 15.0)


# --------------------------------------------------------------------------- scripts


def tool_results(messages: Sequence[Mapping[str, Any]]) -> int:
    return sum(1 for m in messages if m.get("role") == "tool")


def call(tool: str, args: Mapping[str, Any] | str, n: int) -> ModelReply:
    raw = args if isinstance(args, str) else json.dumps(args)
    return ModelReply(StopReason.TOOL_USE, "", [ToolCallProposal(f"call-{n}", tool, raw)], Usage(100, 0, 20))


def done() -> ModelReply:
    return ModelReply(StopReason.END_TURN, "done", [], Usage(100, 0, 5))


def finish_after(n_calls: int, tool: str = "run_tests") -> Script:
    def script(messages: Sequence[Mapping[str, Any]]) -> ModelReply:
        k = tool_results(messages)
        return call(tool, {"suite": f"s{k}"}, k) if k < n_calls else done()

    return script


# --------------------------------------------------------------------------- tools and their ledger


@dataclass(frozen=True)
class Delivery:
    """One physical delivery as the service saw it (independent of what the runtime recorded)."""

    tool: str
    call_id: str
    effect_key: str
    attempt_id: str
    at: float


@dataclass
class SimTools:
    """Tool services with an independent ledger. ``honour_effect_keys`` is off unless a test says so.

    ``behaviour[tool]`` may return a ``ToolOutcome`` for an invocation (the effect is applied unless the
    outcome says ESTABLISHED_ABSENT), or None to hang the call until ``release``."""

    honour_effect_keys: bool = False
    deliveries: list[Delivery] = field(default_factory=list)
    applied: Counter[str] = field(default_factory=Counter)  # effect key -> times applied
    results: dict[str, Any] = field(default_factory=dict)  # effect key -> stored result
    behaviour: dict[str, Callable[[ToolInvocation], ToolOutcome | None]] = field(default_factory=dict)
    probe_answers: dict[str, ProbeResult] = field(default_factory=dict)  # tool -> fixed probe answer
    probes: list[str] = field(default_factory=list)
    unanswered_probes: Counter[str] = field(default_factory=Counter)  # tool -> probe answers never returned
    cancels: list[str] = field(default_factory=list)
    # tool -> requests lost on the way, before the service saw them: the caller gets a timeout, the
    # service's ledger shows no delivery (a network drop)
    lost_on_the_way: Counter[str] = field(default_factory=Counter)
    allocated: set[str] = field(default_factory=set)  # the env service's own view: environments still billed
    released: set[str] = field(default_factory=set)

    def invoke(self, inv: ToolInvocation, now: float) -> ToolOutcome | None:
        if self.lost_on_the_way[inv.tool] > 0:
            self.lost_on_the_way[inv.tool] -= 1
            return ToolOutcome(
                Settlement.UNKNOWN, OutcomeClass.INFRASTRUCTURE_FAILURE, None, error="timed out"
            )
        self.deliveries.append(Delivery(inv.tool, inv.call_id, inv.effect_key, inv.attempt_id, now))
        if self.honour_effect_keys and self.applied[inv.effect_key]:
            return ToolOutcome(Settlement.ESTABLISHED, OutcomeClass.SUCCESS, self.results[inv.effect_key])
        behave = self.behaviour.get(inv.tool)
        outcome = behave(inv) if behave is not None else None
        if outcome is None and behave is not None:
            return None  # hangs
        if outcome is None:
            outcome = ToolOutcome(
                Settlement.ESTABLISHED, OutcomeClass.SUCCESS, {"ok": True, "tool": inv.tool}
            )
        if outcome.settlement is not Settlement.ESTABLISHED_ABSENT:
            self.applied[inv.effect_key] += 1
            self.results[inv.effect_key] = outcome.result if outcome.result is not None else {"ok": True}
        return outcome

    def probe(self, tool: str, effect_key: str) -> ProbeResult:
        self.probes.append(effect_key)
        if tool in self.probe_answers:
            return self.probe_answers[tool]
        if self.applied[effect_key]:
            return ProbeResult(Settlement.ESTABLISHED, self.results.get(effect_key), "applied")
        return ProbeResult(Settlement.ESTABLISHED_ABSENT, None, "never applied")

    def delivered(self, tool: str) -> int:
        return sum(1 for d in self.deliveries if d.tool == tool)

    def duplicate_deliveries(self) -> int:
        """Deliveries of an effect key beyond its first: what a re-sending runtime leaves behind."""
        per_key = Counter(d.effect_key for d in self.deliveries)
        return sum(n - 1 for n in per_key.values() if n > 1)


# --------------------------------------------------------------------------- contracts


class SuiteArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    suite: str


class NotifyArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    channel: str
    text: str


class EnvArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class ReleaseArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    env_id: str


def registry(*extra: ToolContract) -> ToolRegistry:
    reg = ToolRegistry()
    reg.register(
        ToolContract(
            name="run_tests",
            description="Run a test suite.",
            arguments=SuiteArgs,
            side_effect=SideEffect.READ_ONLY,
            repeat=RepeatContract.IDEMPOTENT,
            dependency_scope="test-service",
        )
    )
    reg.register(
        ToolContract(
            name="notify",
            description="Send a notification (irreversible).",
            arguments=NotifyArgs,
            side_effect=SideEffect.IRREVERSIBLE,
            repeat=RepeatContract.NEVER_REPEAT,
            dependency_scope="notifier",
        )
    )
    for contract in extra:
        reg.register(contract)
    return reg


def provision_contracts(
    repeat: RepeatContract = RepeatContract.PROBE_THEN_RETRY,
    *,
    probe: bool = True,
    release_probe: bool = True,
    postcondition: Mapping[str, Any] | None = None,
    on_completion: bool = True,
    after: tuple[str, ...] = (),
) -> list[ToolContract]:
    """provision_env (compensated by release_env, bound from its result's env_id) and release_env."""
    return [
        ToolContract(
            name="provision_env",
            description="Provision an environment.",
            arguments=EnvArgs,
            side_effect=SideEffect.REVERSIBLE,
            repeat=repeat,
            probe=probe,
            dependency_scope="env-service",
            compensation=Compensation(
                tool="release_env",
                from_result={"env_id": "env_id"},
                postcondition={"released": True} if postcondition is None else postcondition,
                on_completion=on_completion,
                after=after,
            ),
        ),
        ToolContract(
            name="release_env",
            description="Release an environment.",
            arguments=ReleaseArgs,
            side_effect=SideEffect.IRREVERSIBLE,
            needs_approval=False,
            repeat=RepeatContract.IDEMPOTENT,
            probe=release_probe,
            dependency_scope="env-service",
        ),
    ]


def env_service(tools: SimTools) -> None:
    """provision_env allocates env-<n> (its result names it); release_env releases it (the ledger keeps
    which are still allocated: ``tools.allocated``)."""

    def provision(inv: ToolInvocation) -> ToolOutcome:
        env_id = f"env-{len(tools.allocated) + len(tools.released) + 1}"
        tools.allocated.add(env_id)
        return ToolOutcome(Settlement.ESTABLISHED, OutcomeClass.SUCCESS, {"env_id": env_id})

    def release(inv: ToolInvocation) -> ToolOutcome:
        env_id = str(inv.arguments["env_id"])
        if env_id not in tools.allocated and env_id not in tools.released:
            return ToolOutcome(
                Settlement.ESTABLISHED_ABSENT, OutcomeClass.CLIENT_REJECTION, error="no such env"
            )
        tools.allocated.discard(env_id)
        tools.released.add(env_id)
        return ToolOutcome(Settlement.ESTABLISHED, OutcomeClass.SUCCESS, {"env_id": env_id, "released": True})

    tools.behaviour.setdefault("provision_env", provision)
    tools.behaviour.setdefault("release_env", release)


def created(
    clock: FakeClock,
    *,
    tid: str = "t1",
    ceilings: Mapping[str, float] | None = None,
    check: str = "min_tool_results",
    tools: frozenset[str] = frozenset({"run_tests", "notify"}),
    deadline_s: float | None = 3600.0,
) -> TrajectoryCreated:
    return TrajectoryCreated(
        trajectory_id=tid,
        parent_id=None,
        tenant="acme",
        contract=TaskContract("Make the tests pass.", CompletionCheck(check, {"count": 1})),
        limits=CallLimits("sim-small", 256, 30.0),
        ceilings=dict(ceilings or {"turns": 20, "tokens": 100_000, "wall_seconds": 600, "dollars": 5.0}),
        grants=Grants(tools=tools, read_only_tools=frozenset({"run_tests"}) & tools),
        priority_class="standard",
        created_at=clock.wall(),
        deadline=None if deadline_s is None else clock.wall() + deadline_s,
        context_ref=f"ctx:{tid}",
    )


def policy(reg: ToolRegistry | None = None, **settings: Any) -> TrajectoryPolicy:
    settings.setdefault("provider_key", "sim")
    settings.setdefault("prices", PRICES)
    return TrajectoryPolicy(registry=reg if reg is not None else registry(), **settings)


# --------------------------------------------------------------------------- the interpreter


Admit = Callable[[RequestAdmission], AdmissionGranted | AdmissionDenied | None]
Guard = Callable[[AcquirePermit], PermitGranted | PermitRefused | str | None]
HOLD = "hold"  # a guard answer that parks the permit request (a bulkhead queue) until grant_permits()


class Sim:
    """One trajectory driven through ``decide``; see the module docstring."""

    def __init__(
        self,
        script: Script,
        clock: FakeClock | None = None,
        *,
        tools: SimTools | None = None,
        pol: TrajectoryPolicy | None = None,
        admit: Admit | None = None,
        guard: Guard | None = None,
        hold_model: bool = False,
        hooks: Any = None,
    ) -> None:
        self.script = script
        self.clock = clock or FakeClock()
        self.tools = tools or SimTools()
        self.policy = pol or policy()
        self.admit = admit
        self.guard = guard
        self.hold_model = hold_model
        self.hooks = hooks  # a TrajectoryHooks (runtime.observe), told of every durable event
        self.log: list[Event] = []
        self.record: Record | None = None
        self.inputs: deque[Input] = deque()
        self.timers: dict[str, Timer] = {}  # what the interpreter has armed (local and durable)
        self.durable_timers: dict[str, Timer] = {}  # what the cluster's timer store holds
        self.held_model: list[CallModel] = []
        self.hung: list[DispatchTool] = []
        self.parked_permits: list[AcquirePermit] = []
        self.decisions: list[tuple[Input, Decision]] = []
        self.effects: list[Effect] = []
        self.settled_grants: dict[str, int] = {}
        self.reported: list[ReportLimits] = []
        self.released: list[ReleasePermit] = []
        self.kills = 0
        self.released_leases: list[Any] = []
        self.hibernated = False
        self._ids = 0
        # issue 12: what the cluster's registries would hold, and the children asked for
        self.escalations: dict[str, Any] = {}  # escalation id -> the latest published escalation
        self.incidents: list[OpenIncident] = []
        self.spawned: list[SpawnChild] = []
        self.cancelled_children: list[CancelChild] = []

    # ------------------------------------------------------------------ lifecycle

    def start(self, created_event: TrajectoryCreated, goal: str | None = None) -> Record:
        events: list[Event] = [
            created_event,
            ObservationAppended(ObservationKind.USER, goal or created_event.contract.goal),
        ]
        self.log.extend(events)
        self.record = fold(events, self.policy)
        if self.hooks is not None:
            for event in events:
                self.hooks.on_event(self.record, event)
        self.feed(Started())
        return self.rec

    def restart(self, *, script: Script | None = None, tools: SimTools | None = None) -> Record:
        """A new incarnation: everything in flight is lost (held calls, hung tools, local timers); the log
        and the durable timers survive. Folds the log and feeds ``Recovered``."""
        self.script = script or self.script
        if tools is not None:
            self.tools = tools
        self.inputs.clear()
        self.held_model.clear()
        self.hung.clear()
        self.parked_permits.clear()
        self.timers = dict(self.durable_timers)
        self.hibernated = False
        self.record = fold(self.log, self.policy)
        self.feed(Recovered())
        return self.rec

    @property
    def rec(self) -> Record:
        assert self.record is not None, "start() first"
        return self.record

    # ------------------------------------------------------------------ inputs

    def feed(self, inp: Input) -> Decision:
        """Decide one input now, append its events, carry out its effects (their results are queued)."""
        decision = decide(self.rec, inp, self.clock.wall())
        self.decisions.append((inp, decision))
        for event in decision.events:
            self.record = fold_one(self.rec, event)
            self.log.append(event)
            if self.hooks is not None:
                self.hooks.on_event(self.record, event)
        for effect in decision.effects:
            self.effects.append(effect)
            self.carry(effect)
        return decision

    def control(
        self,
        message_id: str,
        action: ControlAction,
        issuer: str = "alice",
        reason: str = "test",
        payload: Mapping[str, Any] | None = None,
        roles: Mapping[str, frozenset[str]] | None = None,
    ) -> str | None:
        signer_roles = dict(roles) if roles is not None else {issuer: frozenset({"operator"})}
        inp = ControlReceived(message_id, action, issuer, reason, dict(payload or {}), signer_roles)
        return self.feed(inp).reply

    def refuse(self, message_id: str, reason: str, detail: str = "") -> str | None:
        return self.feed(ControlRefused(message_id, reason, detail)).reply

    def run(self, *, max_steps: int = 10_000, until: float | None = None) -> Record:
        """Process queued inputs, then fire timers (moving the clock), until nothing is left, the record is
        terminal or hibernated, a model call is held, or the clock would pass ``until``."""
        for _ in range(max_steps):
            if self.inputs:
                self.feed(self.inputs.popleft())
                continue
            if self.rec.is_terminal or self.hibernated:
                return self.rec
            if not self.timers or self.held_model:
                return self.rec  # a held model call waits for the test (release_model or a cancel)
            timer = min(self.timers.values(), key=lambda t: (t.due_at, t.timer_id))
            if until is not None and timer.due_at > until:
                self.clock.advance(max(0.0, until - self.clock.wall()))
                return self.rec
            self.clock.advance(max(0.0, timer.due_at - self.clock.wall()))
            del self.timers[timer.timer_id]
            self.durable_timers.pop(timer.timer_id, None)
            self.inputs.append(TimerDue(timer.timer_id))
        raise AssertionError("the trajectory did not settle within the step limit")

    def fire_durable(self) -> None:
        """What the cluster's timer service does for a hibernated trajectory: deliver the due durable
        timers to a fresh incarnation."""
        for timer in sorted(self.durable_timers.values(), key=lambda t: t.due_at):
            if timer.due_at <= self.clock.wall():
                self.inputs.append(TimerDue(timer.timer_id))

    # ------------------------------------------------------------------ holding effects

    def release_model(self, reply: ModelReply | None = None) -> None:
        for effect in self.held_model:
            self.inputs.append(ModelReplied(effect.grant_id, reply or self.script(effect.request.messages)))
        self.held_model.clear()

    def grant_permits(self) -> None:
        """The bulkhead frees up: every parked permit request is granted."""
        parked, self.parked_permits = self.parked_permits, []
        guard, self.guard = self.guard, None
        try:
            for effect in parked:
                self.carry(effect)
        finally:
            self.guard = guard

    def release_tools(self, outcome: ToolOutcome | None = None) -> None:
        for effect in self.hung:
            inv = effect.invocation
            result = outcome or ToolOutcome(Settlement.ESTABLISHED, OutcomeClass.SUCCESS, {"ok": True})
            self.tools.applied[inv.effect_key] += 1
            self.tools.results[inv.effect_key] = result.result
            self.inputs.append(
                ToolOutcomeReceived(
                    inv.call_id, inv.operation_id, inv.attempt_id, result, True, effect.guard, effect.sandbox
                )
            )
        self.hung.clear()

    # ------------------------------------------------------------------ effects

    def carry(self, effect: Effect) -> None:
        now = self.clock.wall()
        if isinstance(effect, RequestAdmission):
            answer = self.admit(effect) if self.admit is not None else None
            if answer is None:
                self._ids += 1
                grant = TurnGrant(f"grant-{self._ids}", effect.request.estimated_tokens, now + 600)
                answer = AdmissionGranted(effect.request_id, grant)
            self.inputs.append(answer)
        elif isinstance(effect, CallModel):
            if self.hold_model:
                self.held_model.append(effect)
                return
            try:
                reply = self.script(effect.request.messages)
            except ModelError as e:
                self.inputs.append(
                    ModelFailed(effect.grant_id, str(e), e.retryable, e.rate_limited, e.retry_after, e.usage)
                )
                return
            self.inputs.append(ModelReplied(effect.grant_id, reply))
        elif isinstance(effect, CancelModelStream):
            for held in self.held_model:
                self.inputs.append(ModelCancelled(held.grant_id, effect.reason, Usage(100, 0, 7)))
            self.held_model.clear()
        elif isinstance(effect, SettleAdmission):
            self.settled_grants[effect.grant_id] = effect.actual_tokens
        elif isinstance(effect, ReportLimits):
            self.reported.append(effect)
        elif isinstance(effect, AcquirePermit):
            answer = self.guard(effect) if self.guard is not None else None
            if answer == HOLD:
                self.parked_permits.append(effect)
                return
            if answer is None:
                self._ids += 1
                permit = GuardPermit(f"permit-{self._ids}", effect.scope, 0, False)
                sandbox = (
                    SandboxPermit(f"sandbox-{self._ids}", effect.pool, now + 60) if effect.pool else None
                )
                answer = PermitGranted(effect.call_id, effect.request_id, permit, sandbox)
            assert not isinstance(answer, str)
            self.inputs.append(answer)
        elif isinstance(effect, ReleasePermit):
            self.released.append(effect)
        elif isinstance(effect, DispatchTool):
            inv = effect.invocation
            outcome = self.tools.invoke(inv, now)
            if outcome is None:
                self.hung.append(effect)
                return
            dispatched = not (outcome.error or "").startswith("not sent")
            self.inputs.append(
                ToolOutcomeReceived(
                    inv.call_id,
                    inv.operation_id,
                    inv.attempt_id,
                    outcome,
                    dispatched,
                    effect.guard,
                    effect.sandbox,
                )
            )
        elif isinstance(effect, ProbeTool) and self.tools.unanswered_probes[effect.tool] > 0:
            self.tools.unanswered_probes[effect.tool] -= 1  # asked, and the answer never comes back
            self.tools.probes.append(effect.effect_key)
        elif isinstance(effect, ProbeTool):
            self.inputs.append(
                ProbeAnswered(
                    effect.operation_id, self.tools.probe(effect.tool, effect.effect_key), effect.request_id
                )
            )
        elif isinstance(effect, CancelToolCall):
            self.tools.cancels.append(effect.effect_key)
        elif isinstance(effect, StartTimer):
            self.timers[effect.timer.timer_id] = effect.timer
            if effect.durable:
                self.durable_timers[effect.timer.timer_id] = effect.timer
        elif isinstance(effect, CancelTimer):
            self.timers.pop(effect.timer.timer_id, None)
            self.durable_timers.pop(effect.timer.timer_id, None)
        elif isinstance(effect, KillProcesses):
            self.kills += 1
        elif isinstance(effect, ReleaseLease):
            self.released_leases.append(effect.lease)
        elif isinstance(effect, Hibernate):
            self.hibernated = True
            self.timers = dict(self.durable_timers)  # the actor's local timers die with it
        elif isinstance(effect, PublishEscalation):
            self.escalations[effect.escalation.escalation_id] = effect.escalation
        elif isinstance(effect, OpenIncident):
            self.incidents.append(effect)
        elif isinstance(effect, SpawnChild):
            self.spawned.append(effect)
        elif isinstance(effect, CancelChild):
            self.cancelled_children.append(effect)
        else:  # pragma: no cover - the effect set is closed
            raise AssertionError(f"unknown effect {effect!r}")

    # ------------------------------------------------------------------ reading

    def of(self, kind: type) -> list[Any]:
        return [e for e in self.log if isinstance(e, kind)]

    def refusals(self) -> list[dict[str, Any]]:
        return [
            json.loads(e.content)
            for e in self.log
            if isinstance(e, ObservationAppended) and e.observation is ObservationKind.REFUSAL
        ]


class ModelError(Exception):
    """Raised by a script to make the model call fail (``ModelFailed``)."""

    def __init__(
        self,
        message: str,
        *,
        retryable: bool = True,
        rate_limited: bool = False,
        retry_after: float | None = None,
        usage: Usage | None = None,
    ) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.rate_limited = rate_limited
        self.retry_after = retry_after
        self.usage = usage or Usage()


def fold_one(record: Record, event: Event) -> Record:
    from runtime.decider import evolve

    return evolve(record, event)
