"""Stub agents and tool contracts for the supervision tests (issue 12): whole trajectories through
``runtime.decide`` on the in-memory interpreter (``sim.Sim``), with the model's behaviour under the test's
control (reliability guide §13.4: "test each guard directly with a stub agent whose behaviour you control").
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from pydantic import BaseModel, ConfigDict

from runtime.clock import FakeClock
from runtime.degradation import DegradationPolicy
from runtime.delegation import DelegationPolicy
from runtime.escalation import Escalation, EscalationTrigger
from runtime.incident import DisclosureRule
from runtime.ports import ModelReply, StopReason, ToolCallProposal, Usage
from runtime.progress import ProgressSpec
from runtime.record import Grants
from runtime.supervision import SupervisionPolicy, WatchdogLadder
from runtime.tools import RepeatContract, SideEffect, ToolContract, ToolRegistry
from runtime.watchdog import WatchdogConfig

from .sim import Sim, created, policy, provision_contracts, registry

__all__ = [
    "Script",
    "calls",
    "contracts",
    "escalations_of",
    "reply",
    "sim_for",
    "supervised",
]

Script = Callable[[Sequence[Mapping[str, Any]]], ModelReply]


class PatchArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    patch: str


class QueryArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    query: str


class JobArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    job: str


class GoalArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    goal: str


def _contract(name: str, args: type[BaseModel], side: SideEffect, scope: str, **kw: Any) -> ToolContract:
    repeat = RepeatContract.IDEMPOTENT if side is SideEffect.READ_ONLY else RepeatContract.NEVER_REPEAT
    return ToolContract(
        name=name,
        description=name,
        arguments=args,
        side_effect=side,
        repeat=repeat,
        dependency_scope=scope,
        needs_approval=False,
        **kw,
    )


def contracts() -> ToolRegistry:
    """run_tests and notify (sim), provisioning, plus: apply_patch (a write whose result is task state),
    read_log and search (reads, ``target_keys`` declared), job_status (a poll), delegate (children)."""
    return registry(
        *provision_contracts(),
        _contract("apply_patch", PatchArgs, SideEffect.IRREVERSIBLE, "repo"),
        _contract("read_log", QueryArgs, SideEffect.READ_ONLY, "logs", target_keys=("query",)),
        _contract("search", QueryArgs, SideEffect.READ_ONLY, "search", target_keys=("query",)),
        _contract("job_status", JobArgs, SideEffect.READ_ONLY, "jobs"),
        _contract("delegate", GoalArgs, SideEffect.IRREVERSIBLE, "delegation"),
    )


ALL_TOOLS = frozenset(
    {"run_tests", "notify", "apply_patch", "read_log", "search", "job_status", "delegate"}
    | {"provision_env", "release_env"}
)


def supervised(
    *,
    ladder: WatchdogLadder | None = None,
    progress: ProgressSpec | None = None,
    progress_watch: WatchdogConfig | None = None,
    disclosure: tuple[DisclosureRule, ...] = (),
    degradation: DegradationPolicy | None = None,
    delegation: DelegationPolicy | None = None,
    reg: ToolRegistry | None = None,
    **settings: Any,
) -> Any:
    """A policy over ``contracts()`` with the supervision settings given (defaults otherwise)."""
    sup = SupervisionPolicy(
        ladder=ladder or WatchdogLadder(),
        progress=progress or ProgressSpec(),
        progress_watch=progress_watch or WatchdogConfig(stagnation_steps=5),
        disclosure=disclosure,
        degradation=degradation or DegradationPolicy(),
        delegation=delegation or DelegationPolicy(),
    )
    return policy(reg or contracts(), supervision=sup, **settings)


def reply(*proposals: tuple[str, Mapping[str, Any] | str], n: int = 0) -> ModelReply:
    """One reply proposing ``proposals`` (tool, arguments) with call ids ``call-<n>-<i>``."""
    props = [
        ToolCallProposal(f"call-{n}-{i}", tool, args if isinstance(args, str) else json.dumps(args))
        for i, (tool, args) in enumerate(proposals)
    ]
    return ModelReply(StopReason.TOOL_USE, "", props, Usage(100, 0, 20))


def calls(messages: Sequence[Mapping[str, Any]]) -> int:
    """Model turns so far (assistant messages): a stub agent's step counter."""
    return sum(1 for m in messages if m.get("role") == "assistant")


def sim_for(
    script: Script,
    pol: Any,
    *,
    tools: frozenset[str] = ALL_TOOLS,
    ceilings: Mapping[str, float] | None = None,
    check: str = "always",
    clock: FakeClock | None = None,
    **kw: Any,
) -> Sim:
    clock = clock or FakeClock()
    sim = Sim(script, clock, pol=pol, **kw)
    event = created(clock, tools=tools, ceilings=ceilings, check=check)
    reg = pol.registry
    reads = frozenset(t for t in tools if t in reg and reg.get(t).side_effect is SideEffect.READ_ONLY)
    sim.start(replace(event, grants=Grants(tools=tools, read_only_tools=reads)))
    return sim


def escalations_of(sim: Sim, trigger: EscalationTrigger) -> list[Escalation]:
    """What the cluster's escalation registry holds of ``trigger`` (published by the decider)."""
    return [e for e in sim.escalations.values() if e.trigger is trigger]
