"""Adapters that refuse locally or lose replies never strand a trajectory; a probe gets its own deadline."""

from __future__ import annotations

import asyncio
import random
from typing import Any

from pydantic import BaseModel, ConfigDict

from actors.wiring import RetryOwnerPort
from breakers.retry import RetryOwner, RetryPolicy
from runtime.clock import FakeClock
from runtime.errors import PolicyRefusal
from runtime.ports import (
    GuardPermit,
    OutcomeClass,
    Settlement,
    ToolInvocation,
    ToolOutcome,
)
from runtime.states import TrajectoryState
from runtime.tools import Compensation, RepeatContract, SideEffect, ToolContract

from .fakes import (
    FakeTools,
    ScriptedModel,
    call,
    created,
    done,
    finish_after,
    harness,
    settle_loop,
    tool_results,
)

S = TrajectoryState


class EnvArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class _CountingGuard:
    """A guard that admits everything and remembers which outcomes entered the breaker window."""

    def __init__(self) -> None:
        self.recorded: list[OutcomeClass] = []

    async def admit(self, scope: str, call_id: str, deadline: float) -> GuardPermit:
        return GuardPermit(call_id, scope, 0, False)

    async def record(self, permit: GuardPermit, outcome: OutcomeClass) -> None:
        self.recorded.append(outcome)

    async def release(self, permit: GuardPermit) -> None:
        return None


class _RefusingTools(FakeTools):
    async def invoke(self, inv: ToolInvocation) -> ToolOutcome:
        raise PolicyRefusal(f"deadline for {inv.tool!r} passed before dispatch; not sent")


class _LostReplyTools(FakeTools):
    """Applies the effect, then the reply is lost; the probe refuses a deadline that already passed."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__()
        self.clock = clock
        self.probe_deadlines: list[float] = []

    async def invoke(self, inv: ToolInvocation) -> ToolOutcome:
        self.ledger.effects[inv.effect_key] += 1
        self.ledger.by_tool[inv.tool] += 1
        self.clock.advance(inv.deadline - self.clock.wall() + 1)  # the reply never came: deadline spent
        return ToolOutcome(Settlement.UNKNOWN, OutcomeClass.INFRASTRUCTURE_FAILURE, error="deadline exceeded")

    async def probe(self, tool: str, effect_key: str, deadline: float) -> Settlement:
        if deadline <= self.clock.wall():
            raise PolicyRefusal("probe deadline already passed: not sent")
        self.probe_deadlines.append(deadline)
        return await super().probe(tool, effect_key, deadline)


async def _run(h: Any, clock: FakeClock) -> Any:
    task = asyncio.ensure_future(h.run())
    await settle_loop(clock, task)
    return task.result().record


async def test_a_locally_refused_call_is_absent_and_never_enters_the_breaker_window() -> None:
    # Given a tool adapter that refuses before sending (e.g. its deadline already passed)
    clock, tools, guard = FakeClock(), _RefusingTools(), _CountingGuard()
    h = harness(ScriptedModel(finish_after(1)), tools, clock)
    h.ports.guard = guard
    await h.create(created(clock, check="always"))
    # When the trajectory runs
    rec = await _run(h, clock)
    # Then it is not stranded: the call settled established-absent and the trajectory ended normally
    op = next(iter(rec.operations.values()))
    assert op.settlement is Settlement.ESTABLISHED_ABSENT and rec.state is S.COMPLETED
    assert guard.recorded == []  # a local rejection is not a dependency outcome


async def test_a_lost_reply_is_settled_by_a_probe_with_its_own_deadline() -> None:
    # Given a probe-then-retry tool whose reply is lost after the effect was applied
    clock = FakeClock()
    tools = _LostReplyTools(clock)

    def script(messages):  # type: ignore[no-untyped-def]
        return call("provision_env", {"name": "e1"}, 0) if tool_results(messages) == 0 else done()

    h = harness(ScriptedModel(script), tools, clock, tool_timeout_s=5.0)
    h.registry.register(
        ToolContract(
            name="provision_env",
            description="Provision an environment.",
            arguments=EnvArgs,
            side_effect=SideEffect.REVERSIBLE,
            repeat=RepeatContract.PROBE_THEN_RETRY,
            probe=True,
            dependency_scope="env-service",
            compensation=Compensation(tool="release_env", from_result={"env_id": "env_id"}),
        )
    )
    h.ports.retry = RetryOwnerPort(RetryOwner("t1", RetryPolicy(), clock, random.Random(1)))
    await h.create(created(clock, check="always", tools=frozenset({"provision_env"})))
    # When the trajectory runs
    rec = await _run(h, clock)
    # Then the probe reached the endpoint (a fresh deadline), settled the operation, and nothing repeated
    op = next(iter(rec.operations.values()))
    assert tools.probe_deadlines, "the probe was never sent"
    assert op.settlement is Settlement.ESTABLISHED and op.attempts == 1
    assert tools.ledger.duplicates() == 0 and rec.state is S.COMPLETED
