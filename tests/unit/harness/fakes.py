"""In-process fakes for the harness ports: a scripted model and a tool service with its own ledger."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict

from runtime.budget import PriceTable
from runtime.clock import FakeClock
from runtime.dispatch import UnlimitedAdmission
from runtime.errors import ModelCallCancelled
from runtime.events import TrajectoryCreated
from runtime.harness import Harness, HarnessConfig, HarnessPorts
from runtime.memstore import MemoryLogStore
from runtime.ports import (
    CancelToken,
    ModelReply,
    ModelRequest,
    OutcomeClass,
    ProbeResult,
    Settlement,
    StopReason,
    ToolCallProposal,
    ToolInvocation,
    ToolOutcome,
    Usage,
)
from runtime.record import CallLimits, CompletionCheck, Grants, TaskContract
from runtime.tools import RepeatContract, SideEffect, ToolContract, ToolRegistry

Script = Callable[[Sequence[Mapping[str, Any]]], ModelReply]


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


class ScriptedModel:
    """A ModelPort whose reply is a function of the conversation (stateless, like the testbed)."""

    def __init__(self, script: Script, gate: asyncio.Event | None = None) -> None:
        self.script = script
        self.gate = gate  # when set, calls wait for it (or for cancellation)
        self.calls = 0
        self.started = asyncio.Event()

    async def complete(self, request: ModelRequest, cancel: CancelToken) -> ModelReply:
        self.calls += 1
        self.started.set()
        if self.gate is not None:
            gate_wait = asyncio.ensure_future(self.gate.wait())
            cancel_wait = asyncio.ensure_future(cancel.wait())
            await asyncio.wait({gate_wait, cancel_wait}, return_when=asyncio.FIRST_COMPLETED)
            gate_wait.cancel()
            cancel_wait.cancel()
        if cancel.cancelled:
            raise ModelCallCancelled(cancel.reason or "cancelled", Usage(100, 0, 7))
        return self.script(request.messages)


@dataclass
class Ledger:
    """The tool service's own record of external effects (what fault tests judge by)."""

    effects: Counter[str] = field(default_factory=Counter)  # effect key -> times applied
    by_tool: Counter[str] = field(default_factory=Counter)

    def duplicates(self) -> int:
        return sum(n - 1 for n in self.effects.values() if n > 1)


class FakeTools:
    """A ToolPort with a ledger; ``hang`` makes named tools wait until released."""

    def __init__(self, dedupe: bool = True) -> None:
        self.ledger = Ledger()
        self.dedupe = dedupe
        self.hang: dict[str, asyncio.Event] = {}
        self.invoked = asyncio.Event()
        self.fail_next: list[ToolOutcome] = []

    async def invoke(self, inv: ToolInvocation) -> ToolOutcome:
        self.invoked.set()
        if inv.tool in self.hang:
            await self.hang[inv.tool].wait()
        if self.fail_next:
            return self.fail_next.pop(0)
        if not (self.dedupe and self.ledger.effects[inv.effect_key]):
            # a new effect; with dedupe, a repeated effect key returns the recorded result instead
            self.ledger.effects[inv.effect_key] += 1
            self.ledger.by_tool[inv.tool] += 1
        return ToolOutcome(Settlement.ESTABLISHED, OutcomeClass.SUCCESS, {"ok": True, "tool": inv.tool})

    async def probe(self, tool: str, effect_key: str, deadline: float) -> ProbeResult:
        if self.ledger.effects[effect_key]:
            return ProbeResult(Settlement.ESTABLISHED, {"ok": True})
        return ProbeResult(Settlement.ESTABLISHED_ABSENT)

    async def cancel(self, tool: str, effect_key: str) -> None:
        return None


class SuiteArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    suite: str


class NotifyArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    channel: str
    text: str


def registry() -> ToolRegistry:
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
    return reg


PRICES = PriceTable(3.0, 0.3, 15.0)


def created(
    clock: FakeClock,
    *,
    tid: str = "t1",
    ceilings: Mapping[str, float] | None = None,
    check: str = "min_tool_results",
    tools: frozenset[str] = frozenset({"run_tests", "notify"}),
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
        deadline=clock.wall() + 3600,
        context_ref=f"ctx:{tid}",
    )


def harness(
    model: ScriptedModel,
    tools: FakeTools,
    clock: FakeClock,
    log: MemoryLogStore | None = None,
    *,
    tid: str = "t1",
    **config: Any,
) -> Harness:
    ports = HarnessPorts(
        model=model,
        tools=tools,
        log=log or MemoryLogStore(),
        admission=UnlimitedAdmission(clock),
        clock=clock,
    )
    cfg = HarnessConfig(provider_key="sim", prices=PRICES, **config)
    return Harness(tid, ports, registry(), cfg)


async def settle_loop(
    clock: FakeClock, task: asyncio.Future[Any], step: float = 1.0, limit: int = 10_000
) -> None:
    """Let the event loop run; advance the fake clock only when everything is blocked on it."""
    for _ in range(limit):
        for _ in range(50):
            await asyncio.sleep(0)
            if task.done():
                return
        clock.advance(step)
    raise AssertionError("the harness did not finish within the fake-clock step limit")
