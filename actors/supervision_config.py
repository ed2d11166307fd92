"""Supervision as a workload declares it and a launch carries it (issue 12): the pydantic boundary form of
``runtime.supervision.SupervisionPolicy``.

Example (``examples/supervision.yaml``)::

    supervision:
      watchdog: {ladder: [inform, constrain, hold], on_hold: wait, stagnation_turns: 5}
      progress:                      # the task-state projection: which results count, canonicalised how
        run_tests: {key_args: [suite], fields: [passed, failed]}
      disclosure:
        - {data_class: fixtures, pattern: "FIXTURE-[0-9]{3}", tools: [search_packages]}
      escalations:
        default: {owner: operator, sla_s: 3600}
        guard: {owner: sre-oncall, sla_s: 600}
      degradation: {rungs: [full, constrained, refusal], constrained_turns: 3}
      delegation:
        tool: delegate
        budget: {turns: 4, tokens: 20000, dollars: 0.05}
        grants: [run_tests]
        scenario: "finish_after:2"
        check: {kind: tool_result, tool: run_tests}

Every field is optional and validated with its path; ``build(depth)`` makes the runtime's policy.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, model_validator

from runtime.degradation import DegradationPolicy, DegradeTrigger, Rung
from runtime.delegation import ChildCheck, ChildCheckKind, DelegationPolicy, OnFailure
from runtime.escalation import EscalationPolicy, EscalationRoute, EscalationTrigger
from runtime.fingerprint import DEFAULT_VOLATILE_KEYS
from runtime.incident import DisclosureRule, DisclosureRuleError
from runtime.progress import ProgressRule, ProgressSpec
from runtime.supervision import KNOWN_ERROR_CODES, LadderRung, OnHold, SupervisionPolicy, WatchdogLadder
from runtime.watchdog import WatchdogConfig

__all__ = [
    "DelegationSpec",
    "DisclosureSpec",
    "SupervisionSpec",
    "delegate_contract",
]

Positive = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class WatchdogSpec(_Spec):
    """The ladder and the detectors' windows (defaults: ``runtime.watchdog.WatchdogConfig``)."""

    ladder: tuple[LadderRung, ...] = (LadderRung.INFORM, LadderRung.CONSTRAIN, LadderRung.HOLD)
    on_hold: OnHold = OnHold.WAIT
    hold_timeout_s: Positive | None = None
    exact_window: int = Field(10, ge=2)
    exact_limit: int = Field(3, ge=2)
    coarse_window: int = Field(10, ge=2)
    coarse_limit: int = Field(5, ge=2)
    cycle_history: int = Field(8, ge=2)
    cycle_recurrences: int = Field(2, ge=1)
    stagnation_turns: int = Field(5, ge=1)

    @model_validator(mode="after")
    def _ladder(self) -> WatchdogSpec:
        if not self.ladder or self.ladder[-1] is not LadderRung.HOLD:
            raise ValueError("the ladder ends with hold (e.g. [inform, constrain, hold])")
        if self.exact_limit > self.exact_window or self.coarse_limit > self.coarse_window:
            raise ValueError("a detector's limit cannot exceed its window")
        return self


class ProgressRuleSpec(_Spec):
    key_args: tuple[str, ...] = ()
    fields: tuple[str, ...] = ()
    ignore: tuple[str, ...] = tuple(sorted(DEFAULT_VOLATILE_KEYS))
    waiting: dict[str, tuple[JsonValue, ...]] = Field(default_factory=dict)


class DisclosureSpec(_Spec):
    data_class: str = Field(min_length=1)
    pattern: str = Field(min_length=1)
    tools: tuple[str, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _compiles(self) -> DisclosureSpec:
        try:
            self.build()
        except DisclosureRuleError as e:
            raise ValueError(str(e)) from None
        return self

    def build(self) -> DisclosureRule:
        return DisclosureRule(self.data_class, self.pattern, frozenset(self.tools))


class RouteSpec(_Spec):
    owner: str = Field("operator", min_length=1)
    sla_s: Positive = 3600.0


class DegradationSpec(_Spec):
    rungs: tuple[Rung, ...] = (Rung.FULL,)
    triggers: dict[DegradeTrigger, Rung] | None = None
    constrained_turns: int | None = Field(3, ge=1)
    deterministic_answer: str | None = None

    @model_validator(mode="after")
    def _valid(self) -> DegradationSpec:
        self.build()
        return self

    def build(self) -> DegradationPolicy:
        kwargs: dict[str, Any] = {}
        if self.triggers is not None:
            kwargs["triggers"] = dict(self.triggers)
        try:
            return DegradationPolicy(
                rungs=self.rungs,
                constrained_turns=self.constrained_turns,
                deterministic_answer=self.deterministic_answer,
                **kwargs,
            )
        except ValueError as e:
            raise ValueError(str(e)) from None


class ChildCheckSpec(_Spec):
    kind: ChildCheckKind = ChildCheckKind.COMPLETED
    tool: str | None = None
    field: str | None = None
    equals: JsonValue = True

    @model_validator(mode="after")
    def _tool(self) -> ChildCheckSpec:
        if self.kind is ChildCheckKind.TOOL_RESULT and not self.tool:
            raise ValueError("a tool_result check names its tool")
        return self


class ChildCompletionSpec(_Spec):
    """The child's own completion check (its task contract), as ``tether run`` names checks."""

    name: Literal["always", "never", "min_tool_results", "tool_succeeded", "candidate_checked"] = (
        "min_tool_results"
    )
    params: dict[str, JsonValue] = Field(default_factory=lambda: dict[str, JsonValue](count=1))


class DelegationSpec(_Spec):
    """The delegation template: the tool whose calls spawn children, and each child's contract."""

    tool: str = Field("delegate", pattern=r"^[A-Za-z0-9_-]{1,64}$")
    max_depth: int = Field(1, ge=0)
    max_children: int = Field(3, ge=1)
    budget: dict[str, Positive] = Field(min_length=1)
    floor_fraction: float = Field(0.5, gt=0, le=1)
    deadline_s: Positive = 300.0
    grants: tuple[str, ...] = ()
    scenario: str = "finish_after:1"  # the child's model behaviour on the simulated provider
    check: ChildCheckSpec = ChildCheckSpec()
    completion_check: ChildCompletionSpec = ChildCompletionSpec()
    on_failure: OnFailure = OnFailure.REPORT

    def build(self, depth: int) -> DelegationPolicy:
        return DelegationPolicy(
            tool=self.tool,
            max_depth=self.max_depth,
            max_children=self.max_children,
            budget=dict(self.budget),
            floor_fraction=self.floor_fraction,
            deadline_s=self.deadline_s,
            grants=self.grants,
            check=ChildCheck(self.check.kind, self.check.tool, self.check.field, self.check.equals),
            on_failure=self.on_failure,
            metadata={"scenario": self.scenario},
            depth=depth,
        )


class SupervisionSpec(_Spec):
    """Supervision as a workload declares it (see the module docstring)."""

    watchdog: WatchdogSpec = WatchdogSpec()
    progress: dict[str, ProgressRuleSpec] = Field(default_factory=dict)
    disclosure: tuple[DisclosureSpec, ...] = ()
    escalations: dict[str, RouteSpec] = Field(default_factory=dict)
    degradation: DegradationSpec = DegradationSpec()
    delegation: DelegationSpec | None = None
    known_error_codes: tuple[str, ...] = ()  # beyond the gRPC status names: not novelty
    verification_repeats: int = Field(3, ge=2)

    @model_validator(mode="after")
    def _routes(self) -> SupervisionSpec:
        known = {t.value for t in EscalationTrigger} | {"default"}
        unknown = sorted(set(self.escalations) - known)
        if unknown:
            raise ValueError(f"escalations: unknown trigger(s) {unknown}; known: {sorted(known)}")
        return self

    def build(self, depth: int = 0) -> SupervisionPolicy:
        w = self.watchdog
        routes = {
            EscalationTrigger(name): EscalationRoute(r.owner, r.sla_s)
            for name, r in self.escalations.items()
            if name != "default"
        }
        default = self.escalations.get("default", RouteSpec())
        progress = {
            tool: ProgressRule(
                key_args=r.key_args, fields=r.fields, ignore=frozenset(r.ignore), waiting=dict(r.waiting)
            )
            for tool, r in self.progress.items()
        }
        return SupervisionPolicy(
            ladder=WatchdogLadder(w.ladder, w.on_hold, w.hold_timeout_s),
            progress=ProgressSpec(progress),
            progress_watch=WatchdogConfig(
                cycle_history=w.cycle_history,
                cycle_recurrences=w.cycle_recurrences,
                stagnation_steps=w.stagnation_turns,
            ),
            disclosure=tuple(d.build() for d in self.disclosure),
            escalations=EscalationPolicy(routes, EscalationRoute(default.owner, default.sla_s)),
            degradation=self.degradation.build(),
            delegation=self.delegation.build(depth) if self.delegation is not None else DelegationPolicy(),
            known_error_codes=KNOWN_ERROR_CODES | frozenset(self.known_error_codes),
            verification_repeats=self.verification_repeats,
        )

    def call_watchdog(self) -> WatchdogConfig:
        """The call-level detectors' windows (``TrajectoryPolicy.watchdog``)."""
        w = self.watchdog
        return WatchdogConfig(
            exact_window=w.exact_window,
            exact_limit=w.exact_limit,
            coarse_window=w.coarse_window,
            coarse_limit=w.coarse_limit,
            cycle_history=w.cycle_history,
            cycle_recurrences=w.cycle_recurrences,
            stagnation_steps=w.stagnation_turns,
        )


class GoalArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    goal: str = Field(min_length=1, max_length=2000, description="the sub-task, stated in full")


def delegate_contract(name: str) -> Any:
    """The delegation tool's contract: the model names a goal; the workload's template does the rest."""
    from runtime.tools import RepeatContract, SideEffect, ToolContract

    return ToolContract(
        name=name,
        description="Delegate a sub-task to a child agent with its own budget (carved from yours) and "
        "deadline; its report is checked before you see it.",
        arguments=GoalArgs,
        side_effect=SideEffect.IRREVERSIBLE,
        repeat=RepeatContract.NEVER_REPEAT,
        needs_approval=False,  # the contract (budget, grants, check) is the workload's, not the model's
        dependency_scope="delegation",
        target_keys=("goal",),
    )
